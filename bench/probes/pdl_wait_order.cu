// Where does ptxas put griddepcontrol.wait relative to loads around it? (docs/experiments/
// rope-append-and-pdl-wait.md, "What ptxas does with griddepcontrol.wait", session 13.) A GEMV-like kernel: 4 loads of W (16 bytes
// each) meant to run before the wait, then the wait, then loads of X (written by the kernel before, in
// a programmatic launch) and a dot product. Build each variant and read its SASS (ACQBULK is the wait):
//   for v in 1 2 3 4 5 6 7; do nvcc -cubin -arch=sm_90 -O3 --use_fast_math -DV=$v -o t$v.cubin pdl_wait_order.cu; done
//   for v in 1 2 3 4 5 6 7; do cuobjdump -sass t$v.cubin | grep -n 'ACQBULK\|LDG' | head -12; done
// Seen with nvcc 13.0: V1, V3, V7: ACQBULK first (the W loads after it). V4, V5: W loads, then ACQBULK,
// then the X loads. V2, V6: W loads before ACQBULK, and X's read-only (.nc) loads moved above it too.
#include <cuda_fp16.h>
__device__ __forceinline__ void gd_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
extern "C" __global__ void __launch_bounds__(512, 2) k(const half* __restrict__ W, const half* __restrict__ X, half* __restrict__ Y) {
  int base = (blockIdx.x * 16 + (threadIdx.x >> 5)) * 4096 + (threadIdx.x & 31) * 8;
  uint4 w[4];
#if V == 1   // plain nc loads
  for (int u = 0; u < 4; ++u) w[u] = *(const uint4*)(W + base + u * 256);
#elif V == 2 // non-nc volatile-asm loads
  for (int u = 0; u < 4; ++u) asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(w[u].x), "=r"(w[u].y), "=r"(w[u].z), "=r"(w[u].w) : "l"(W + base + u * 256));
#elif V == 3 // nc loads via volatile asm
  for (int u = 0; u < 4; ++u) asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(w[u].x), "=r"(w[u].y), "=r"(w[u].z), "=r"(w[u].w) : "l"(W + base + u * 256) : "memory");
#else
  for (int u = 0; u < 4; ++u) w[u] = *(const uint4*)(W + base + u * 256);
#endif
#if V == 4   // branch (block boundary) before the wait
  if (blockIdx.x > gridDim.x) asm volatile("trap;");
#elif V == 5 // data-dependent branch
  if (w[0].x == 0x7fff7fffu && w[3].w == 0x7fff7fffu && threadIdx.x > 4096) asm volatile("trap;");
#elif V == 6 // fence
  __threadfence_block();
#elif V == 7 // warp sync
  __syncwarp();
#endif
  gd_wait();
  float acc = 0.f;
  for (int u = 0; u < 4; ++u) {
    uint4 x = *(const uint4*)(X + (threadIdx.x & 31) * 8 + u * 256);
    const half2* wh = (const half2*)&w[u]; const half2* xh = (const half2*)&x;
    for (int e = 0; e < 4; ++e) { float2 a = __half22float2(wh[e]), b = __half22float2(xh[e]); acc += a.x * b.x + a.y * b.y; }
  }
  for (int s = 16; s; s >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, s);
  if ((threadIdx.x & 31) == 0) Y[blockIdx.x * 16 + (threadIdx.x >> 5)] = __float2half(acc);
}
