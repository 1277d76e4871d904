"""The GEMV template and the Gemv rule: which functions the rule takes (static M below the Matmul
rule's ``min_static_m``), that its kernels build for sm_90 and nvcc compiles them, the symbolic-M
form, and the config checks (numerics run on the GPU against float64)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import apply_rule, needs_nvcc
import tvm
from fuselight.errors import FuselightError
from fuselight.rules.gemm import estimate, gemv, gemv_common
from fuselight.rules.gemm.analysis import analyze_matmul
from fuselight.rules.gemv import Gemv
from fuselight.rules.matmul import Matmul
from fuselight.tune.gemm import matmul_prim_func
from tvm import tirx
from tvm.script import tirx as T
from tir_query import kernel

LM_HEAD = (128256, 4096)


def _lm_head(n: int, k: int, m: int) -> tirx.PrimFunc:
    """The logits layer as it reaches the rules: matmul, cast to fp16, cast to fp32."""

    # fmt: off
    @T.prim_func(private=True, s_tir=True)
    def func(A: T.Buffer((T.int64(1), T.int64(m), T.int64(k)), "float16"),
             W: T.Buffer((T.int64(n), T.int64(k)), "float16"),
             O: T.Buffer((T.int64(1), T.int64(m), T.int64(n)), "float32")):
        C = T.sblock_alloc_buffer((T.int64(1), T.int64(m), T.int64(n)))
        D = T.sblock_alloc_buffer((T.int64(1), T.int64(m), T.int64(n)), "float16")
        for i0, i1, i2, kk in T.grid(T.int64(1), T.int64(m), T.int64(n), T.int64(k)):
            with T.sblock("NT_matmul"):
                v0, v1, v2, vk = T.axis.remap("SSSR", [i0, i1, i2, kk])
                with T.init():
                    C[v0, v1, v2] = T.float32(0)
                C[v0, v1, v2] = C[v0, v1, v2] + T.Cast("float32", A[v0, v1, vk]) * T.Cast("float32", W[v2, vk])
        for i0, i1, i2 in T.grid(T.int64(1), T.int64(m), T.int64(n)):
            with T.sblock("cast"):
                v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
                D[v0, v1, v2] = T.Cast("float16", C[v0, v1, v2])
        for i0, i1, i2 in T.grid(T.int64(1), T.int64(m), T.int64(n)):
            with T.sblock("cast_1"):
                v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
                O[v0, v1, v2] = T.Cast("float32", D[v0, v1, v2])
    # fmt: on
    return func


def _linear_residual(n: int, k: int, m: int) -> tirx.PrimFunc:
    """o_proj with the residual add fused: cast(x @ W^T) + R."""

    # fmt: off
    @T.prim_func(private=True, s_tir=True)
    def func(A: T.Buffer((T.int64(1), T.int64(m), T.int64(k)), "float16"),
             W: T.Buffer((T.int64(n), T.int64(k)), "float16"),
             R: T.Buffer((T.int64(1), T.int64(m), T.int64(n)), "float16"),
             O: T.Buffer((T.int64(1), T.int64(m), T.int64(n)), "float16")):
        C = T.sblock_alloc_buffer((T.int64(1), T.int64(m), T.int64(n)))
        D = T.sblock_alloc_buffer((T.int64(1), T.int64(m), T.int64(n)), "float16")
        for i0, i1, i2, kk in T.grid(T.int64(1), T.int64(m), T.int64(n), T.int64(k)):
            with T.sblock("NT_matmul"):
                v0, v1, v2, vk = T.axis.remap("SSSR", [i0, i1, i2, kk])
                with T.init():
                    C[v0, v1, v2] = T.float32(0)
                C[v0, v1, v2] = C[v0, v1, v2] + T.Cast("float32", A[v0, v1, vk]) * T.Cast("float32", W[v2, vk])
        for i0, i1, i2 in T.grid(T.int64(1), T.int64(m), T.int64(n)):
            with T.sblock("cast"):
                v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
                D[v0, v1, v2] = T.Cast("float16", C[v0, v1, v2])
        for i0, i1, i2 in T.grid(T.int64(1), T.int64(m), T.int64(n)):
            with T.sblock("add"):
                v0, v1, v2 = T.axis.remap("SSS", [i0, i1, i2])
                O[v0, v1, v2] = D[v0, v1, v2] + R[v0, v1, v2]
    # fmt: on
    return func


# The shipped sm_90 buckets (configs/gemm/gemv.json), read by hand. The rule sizes the grid as
# blocks of 16 rows (16 warps, a row each): qkv's 384 blocks take the bucket for grids up to 528
# (two blocks an SM); o_proj's and down's 256 the one for up to 256 (o_proj's K of 4096 also asks L2
# for its rows); gate_up's 1792 the one for any grid: 8 warps, so 28672 / 8 = 3584 blocks.
@pytest.mark.parametrize("n,k,blocks,warps,min_blocks,prefetch", [
    (6144, 4096, 384, 16, 2, False), (4096, 4096, 256, 16, 1, True),
    (28672, 4096, 3584, 8, 2, False), (4096, 14336, 256, 16, 1, False)])
def test_rule_takes_llama_decode_gemvs_with_their_buckets(n, k, blocks, warps, min_blocks, prefetch, cuda):
    func = matmul_prim_func(n, k, "float16", m=1)
    scheduled = apply_rule(Gemv(), func, cuda)
    assert [p.name for p in scheduled.params] == [p.name for p in func.params]  # the signature stays
    kern = kernel(scheduled)  # one launch: the cast epilogue is fused
    assert kern.launch == {"blockIdx.x": blocks, "threadIdx.x": 32 * warps}
    assert kern.attrs["tirx.launch_bounds_min_blocks_per_sm"] == min_blocks
    assert kern.outputs == {"O"}  # no intermediate leaves the kernel
    assert kern.allocs["xs"] == ("shared", "float16", (k,))  # the token row, staged once a block
    assert kern.allocs["acc"] == ("local", "float32", (1,))  # one row a warp, summed in fp32
    # Whole rows summed over the lanes by shuffles (the row template, no tensor cores); weights and
    # the token row move 8 halves (16 bytes) a load.
    assert kern.calls["tirx.tvm_warp_shuffle_xor"] == 1 and "tirx.ptx.mma_legacy" not in kern.calls
    assert kern.vectorized[8] >= 3
    assert ("tirx.cuda.func_call" in kern.calls) == prefetch  # the L2 prefetch is the one extern call


def test_config_for_takes_the_smallest_grid_bucket_that_fits():
    small = gemv_common.GemvConfig(max_m=1, warps=4, unroll=8, min_blocks_per_sm=4, max_blocks=528)
    large = gemv_common.GemvConfig(max_m=1, warps=16, unroll=4, min_blocks_per_sm=1)
    m2 = gemv_common.GemvConfig(max_m=2, warps=8, unroll=4, min_blocks_per_sm=1)
    configs = [m2, large, small]
    assert gemv.config_for(configs, 1, 256) == small
    assert gemv.config_for(configs, 1, 528) == small
    assert gemv.config_for(configs, 1, 529) == large
    assert gemv.config_for(configs, 1) == large  # grid unknown: only buckets for any grid
    assert gemv.config_for(configs, 2, 256) == m2
    assert gemv.config_for(configs, 3, 256) is None
    short = dataclasses.replace(small, max_k=4096)
    configs.append(short)
    assert gemv.config_for(configs, 1, 256, 4096) == short  # the smallest max_k that fits
    assert gemv.config_for(configs, 1, 256, 4097) == small
    assert gemv.config_for(configs, 1, 256) == small  # K unknown: only buckets for any K


def test_rule_takes_the_lm_head_with_its_two_casts(cuda):
    desc = Gemv.analyze(_lm_head(*LM_HEAD, 1))
    assert desc is not None and desc.out_dtype == "float32" and len(desc.epilogue_stages) == 2
    kern = kernel(apply_rule(Gemv(), _lm_head(*LM_HEAD, 1), cuda))
    # 128256 rows in the bucket for any grid (8 warps, a row each): 16032 blocks of 256 threads
    assert kern.launch == {"blockIdx.x": 128256 // 8, "threadIdx.x": 256}
    # Both casts in the one kernel: the fp32 sum rounded to fp16, then widened, straight into O.
    assert kern.outputs == {"O"}
    (value,) = kern.values["O"]
    assert isinstance(value, tirx.Cast) and str(value.ty) == "float32"
    assert isinstance(value.value, tirx.Cast) and str(value.value.ty) == "float16"
    assert isinstance(value.value.value, tirx.BufferLoad) and value.value.value.buffer.name == "acc"


def test_rule_fuses_a_residual_add_epilogue(cuda):
    func = _linear_residual(4096, 4096, 1)
    kern = kernel(apply_rule(Gemv(), func, cuda))
    assert kern.outputs == {"O"}
    (value,) = kern.values["O"]  # cast(sum) + R[row]: the residual is read in the epilogue
    assert isinstance(value, tirx.Add) and isinstance(value.a, tirx.Cast) and str(value.a.ty) == "float16"
    residual = value.b  # a load of the function's R (the kernel's view of it), not of a buffer it allocates
    assert isinstance(residual, tirx.BufferLoad) and residual.buffer.name.startswith("R")
    assert residual.buffer.name not in kern.allocs


def test_rule_takes_a_target_that_does_not_state_its_shared_memory():
    # The kernel's shared memory is static: without the target's figure, CUDA's static limit bounds it.
    bare = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    assert "max_shared_memory_per_block" not in bare.attrs
    kern = kernel(apply_rule(Gemv(), matmul_prim_func(4096, 4096, "float16", m=1), bare))
    assert kern.launch == {"blockIdx.x": 256, "threadIdx.x": 512}  # o_proj's bucket, as with the full target
    shared = [shape for scope, _, shape in kern.allocs.values() if scope == "shared"]
    assert shared == [(4096,)]  # 8 KiB of fp16: under CUDA's 48 KiB static limit


# The mma template: a block's 16 weight rows are mma's M and the tokens its N, in tiles of 8, so a
# lane accumulates 4 floats a token tile; warps split K and sum through shared memory (each lane's
# floats, for each warp). Buckets: M 2 and 8 take 16 warps, M 9 and 15 the 16-token bucket's 4.
@pytest.mark.parametrize("m,warps", [(2, 16), (8, 16), (9, 4), (15, 4)])
def test_rule_takes_every_static_m_below_min_static_m(m, warps, cuda):
    kern = kernel(apply_rule(Gemv(), matmul_prim_func(4096, 4096, "float16", m=m), cuda))
    tiles = -(-m // 8)
    assert kern.launch == {"blockIdx.x": 4096 // 16, "threadIdx.x": 32 * warps}
    assert kern.calls["tirx.ptx.mma_legacy"] == 1 and "tirx.tvm_warp_shuffle_xor" not in kern.calls
    assert kern.allocs["acc"] == ("local", "float32", (4 * tiles,))
    assert kern.allocs["red"] == ("shared", "float32", (warps * 32 * 4 * tiles,))
    assert kern.outputs == {"O"}


def test_rule_leaves_matmul_m_dynamic_m_and_cpu(cuda):
    min_m = estimate.load_dispatch("sm_90").min_static_m
    at_min = matmul_prim_func(4096, 4096, "float16", m=min_m)
    assert apply_rule(Gemv(), at_min, cuda) is None
    assert Matmul().apply(at_min.with_attr("target", cuda), cuda, False) is not None  # the Matmul rule's
    assert Gemv.analyze(matmul_prim_func(4096, 4096, "float16")) is None  # dynamic M: the Matmul rule's
    llvm = tvm.target.Target("llvm")
    assert Gemv().apply(matmul_prim_func(4096, 4096, "float16", m=1), llvm, False) is None


def test_rule_leaves_what_the_template_does_not_take(cuda):
    assert apply_rule(Gemv(), matmul_prim_func(4096, 4100, "float16", m=1), cuda) is None  # K not a multiple of 32

    @T.prim_func(private=True, s_tir=True)
    def add(a: T.Buffer((1, 4096), "float16"), b: T.Buffer((1, 4096), "float16")):
        for i, j in T.grid(1, 4096):
            with T.sblock("add"):
                vi, vj = T.axis.remap("SS", [i, j])
                b[vi, vj] = a[vi, vj] + T.float16(1)

    assert Gemv.analyze(add) is None


def test_registered_after_matmul():
    from fuselight.rules import DEFAULT, RULES

    assert DEFAULT.index("gemv") == DEFAULT.index("matmul") + 1
    assert isinstance(RULES["gemv"].make(), Gemv)


def test_symbolic_m_template_builds_one_kernel_for_every_m_up_to_16(cuda):
    func = matmul_prim_func(4096, 4096, "float16")
    ops = analyze_matmul(func).operands
    cfg = gemv_common.GemvConfig(max_m=16, warps=4, unroll=4, min_blocks_per_sm=1)
    body = tirx.SBlockRealize([], True, tirx.SBlock([], [], [], "root", gemv.gemv_body(ops, cfg)))
    kern = kernel(tirx.PrimFunc(func.params, body, func.ret_type, func.attrs))
    # sized for the bucket's 16 tokens (two tiles of 8) whatever M is at run time
    assert kern.launch == {"blockIdx.x": 256, "threadIdx.x": 128}
    assert kern.allocs["acc"] == ("local", "float32", (8,)) and kern.calls["tirx.ptx.mma_legacy"] == 1
    assert kern.outputs == {"O"}


@needs_nvcc
def test_nvcc_compiles_the_gemv_kernels(cuda):
    from fuselight.cuda_compile import compile_cuda

    funcs = {"gemv": apply_rule(Gemv(), matmul_prim_func(4096, 14336, "float16", m=1), cuda),
             "lm_head": apply_rule(Gemv(), _lm_head(*LM_HEAD, 3), cuda),
             "m15": apply_rule(Gemv(), matmul_prim_func(4096, 4096, "bfloat16", m=15), cuda)}
    lib = tvm.compile(tvm.IRModule({k: f.with_attr("global_symbol", k) for k, f in funcs.items()}), target=cuda)
    assert compile_cuda(lib.mod.imports[0].inspect_source("cuda"), "sm_90")


def test_block_warps_divide_the_k_steps():
    cfg = gemv_common.GemvConfig(max_m=1, warps=16, unroll=4, min_blocks_per_sm=1)

    def warps(k):
        return gemv.block_warps(analyze_matmul(matmul_prim_func(4096, k, "float16", m=1)).operands, cfg)

    assert warps(4096) == 16  # 128 steps of 32
    assert warps(14336) == 16  # 448 steps
    assert warps(32 * 12) == 4  # 12 steps: halved until they divide


def test_shipped_config_covers_every_gemv_m():
    configs = gemv.load_gemv_configs("sm_90")
    for m in range(1, estimate.load_dispatch("sm_90").min_static_m):
        assert gemv.config_for(configs, m) is not None
    with pytest.raises(FuselightError, match="no device description"):
        gemv.load_gemv_configs("sm_75")  # no entry, no description: the rule leaves the function


@pytest.mark.parametrize("warps,unroll,lane_run,steps", [(1, 4, 1, 12), (4, 4, 2, 112), (16, 4, 4, 8), (2, 6, 4, 9), (8, 8, 8, 3)])
def test_piece_words_cover_every_word_of_a_row_once(warps, unroll, lane_run, steps):
    # The k permutation the weights and tokens share: the pieces all lanes of all warps read over
    # all steps are the row's words, each exactly once, whatever the run.
    cfg = gemv_common.GemvConfig(max_m=16, warps=warps, unroll=unroll, min_blocks_per_sm=1, lane_run=lane_run)
    run = gemv.lane_run(cfg, steps)
    words = [gemv.piece_word(step, warp, quad, warps, run) + e
             for warp in range(warps) for step in range(steps) for quad in range(4) for e in range(gemv_common.PIECE_WORDS)]
    assert sorted(words) == list(range(warps * steps * gemv.STEP_K // 2))
    # A lane's pieces within a run are adjacent: 16 run contiguous bytes.
    assert gemv.piece_word(1, 0, 0, warps, run) - gemv.piece_word(0, 0, 0, warps, run) == (gemv_common.PIECE_WORDS if run > 1 else warps * gemv.STEP_K // 2)


def test_lane_run_is_halved_until_it_divides_the_round_and_the_steps():
    cfg = gemv_common.GemvConfig(max_m=16, warps=4, unroll=4, min_blocks_per_sm=1, lane_run=4)
    assert gemv.lane_run(cfg, 112) == 4
    assert gemv.lane_run(cfg, 6) == 2  # a run may not straddle the end of K
    assert gemv.lane_run(cfg, 7) == 1
    assert gemv.lane_run(dataclasses.replace(cfg, unroll=6), 12) == 2  # nor a round


@pytest.mark.parametrize("field,value", [("max_m", 17), ("max_m", 0), ("warps", 3), ("warps", 64), ("unroll", 0),
                                         ("min_blocks_per_sm", 0), ("max_blocks", 0), ("lane_run", 0), ("max_k", 0),
                                         ("prefetch_l2_percent", 0), ("prefetch_l2_percent", 25)])
def test_bad_config_names_the_field(field, value):
    cfg = gemv_common.GemvConfig(max_m=1, warps=8, unroll=4, min_blocks_per_sm=1)
    with pytest.raises(FuselightError, match=field):
        gemv.check_gemv_config(dataclasses.replace(cfg, **{field: value}))


def test_bad_config_file_names_the_bucket_and_field(tmp_path, monkeypatch):
    from fuselight import paths
    from fuselight.rules import arch_config

    cfg = json.loads((paths.config_dir() / "gemm" / "gemv.json").read_text())
    bucket = next(iter(cfg["sm_90"]))
    (tmp_path / "gemm").mkdir()
    monkeypatch.setattr(gemv, "config_dir", lambda: tmp_path)
    monkeypatch.setattr(arch_config, "config_dir", lambda: tmp_path)
    for field, value in (("unroll", "4"), ("max_m", 40)):
        broken = json.loads(json.dumps(cfg))
        broken["sm_90"][bucket][field] = value
        (tmp_path / "gemm" / "gemv.json").write_text(json.dumps(broken))
        with pytest.raises(FuselightError, match=f"{bucket}.*{field}"):
            gemv.load_gemv_configs("sm_90")


def test_template_refuses_operands_it_cannot_compute():
    ops = analyze_matmul(matmul_prim_func(4096, 4096, "float16", m=4)).operands
    cfg = gemv_common.GemvConfig(max_m=2, warps=8, unroll=4, min_blocks_per_sm=1)
    with pytest.raises(FuselightError, match="max_m"):
        gemv.gemv_body(ops, cfg)
    with pytest.raises(FuselightError, match="NT"):
        gemv.gemv_body(dataclasses.replace(ops, b_layout="NN"), dataclasses.replace(cfg, max_m=4))
