"""The persistent decode kernel, first stage: several M = 1 GEMVs of a decode layer in one launch.

Why: a small model's decode step is 6 launches a layer of a few microseconds each (SmolLM2-135M:
181 a step), so the host's launch rate, or the gap between two kernels, sets the pace, not memory.
One launch that runs the GEMV stages of a layer back to back (o_proj + residual; RMSNorm + gate_up
with SiLU-mul; down + residual; optionally the next layer's RMSNorm + QKV) pays one launch and keeps
the blocks resident between stages. ``bench/probes/persistent_decode.py`` measures whether it beats
the shipped kernels launched one after another (docs/experiments/persistent-decode.md).

How: ``persistent_body(stages, arch, name)`` takes the stages as ``(GemmOperands, GemvConfig)``
pairs (each a function the Gemv rule takes with the row template, ``gemv_rows``), whose buffers are
shared where a stage reads what an earlier one wrote (``link``: the same parameter Vars). The grid
is ``sms x blocks_per_sm`` blocks (the device model's SM count), every stage with the same
``warps``; each stage is the row template's per-block work (``gemv_rows.rows_stage``) in its
looping mode: block ``bx`` computes the stage's column groups ``bx``, ``bx + grid``, ... (a stage
with fewer groups than blocks leaves the rest idle; their first loads read clamped rows, from L2).
One shared buffer holds the token row of every stage (the largest K).

Barrier and prefetch: between two stages, a grid barrier (``BARRIER_SOURCE``). A stage issues its
first round of weight loads before it waits there (weights do not depend on the previous stage, so
memory streams while the slowest block of the previous stage finishes), and reads its token row,
the previous stage's output (or the norm's input and residual), only after it. What the kernel wrote
is read with coherent loads: nvcc never uses the read-only path (``ld.global.nc``) for a buffer the
kernel also writes; the tests check the PTX for that. The first stage waits for the grid before the
kernel where the TIR pipeline puts every kernel's wait (at the entry, sm_90's programmatic launch):
the barrier's counters are then never touched while the previous launch of the kernel runs.

The barrier is self-resetting (a generation count): thread 0 of each block reads the generation,
fences, and arrives on a counter in global memory; the last to arrive sets the counter back to zero
and bumps the generation, the others spin on it with acquire loads; then the block syncs. Its two
words are a ``__device__`` array of the kernel's own (named after it: two kernels of a module never
share one), zero at module load and left with the counter at zero by every barrier, so consecutive
launches need no reset. One launch of a kernel at a time: two streams running the same kernel at
once would share its counter (a decode step is one stream).

Occupancy: a barrier waits for every block, so all of them must be resident at once, or it never
returns. ``check_persistent`` refuses (FuselightError with the numbers) a plan whose
``blocks_per_sm`` blocks of its threads and shared memory exceed the SM's limits in the device
model; the kernel's launch bounds ask ptxas for ``blocks_per_sm`` blocks an SM (it then caps the
registers to fit: the tests read them back from nvcc). Whoever launches it must still compare the
grid with what the GPU holds (``cudaOccupancyMaxActiveBlocksPerMultiprocessor``, the probe's run)
and fall back to the separate kernels where it is smaller.

TVM: the stages are macros expanded one after another inside one ``blockIdx.x`` / ``threadIdx.x``
binding and one ``sblock`` (each allocates its own registers there); the barrier is a CUDA device
function (``cuda_func_call``) at the stage's hook, a place every thread of a block reaches.
No numerics run on the CPU: a barrier deadlocks where blocks run one by one (``llvm``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import tvm
from fuselight.device import require_device
from fuselight.errors import FuselightError
from fuselight.paths import config_dir
from tvm import tirx
from tvm.backend.cuda import op as cuda_op
from tvm.script import tirx as T

from .. import arch_config
from ..arch_config import arch_entry, from_fields
from ..base import with_kernels
from .gemv import CONFIG_FAMILY, check_gemv
from .gemv_common import GemvConfig
from .gemv_rows import declared, rows_stage
from .operands import GemmOperands
from .plan import WARP

CONFIG_NAME = "gemv_persistent"
# The config's entries: float weights, 4-bit (q4f16_1) weights.
WEIGHTS = ("float", "q4")
# Shared memory: TVM aligns each buffer to 64 bytes; a norm's block reduction has a float32 a warp
# and its result.
SHARED_ALIGN, REDUCE_BYTES = 64, 4

# The grid barrier (see the module docstring), ``{name}``: the kernel's. Memory order: a block's
# writes of a stage precede thread 0's arrival (``__syncthreads``, then ``__threadfence``: cumulative,
# so the other threads' writes it observed through the sync are ordered before the arrival too);
# the last arrival's read-modify-write follows every other block's arrival, and its fence orders all
# of them before the generation bump; a waiting block's acquire load sees the bump, its fence and
# ``__syncthreads`` order the block's later loads after it. The generation read before arriving is
# current: it cannot change until this block arrives, and thread 0 saw the last bump (its own, or by
# its acquire load) earlier in program order. The counter is set back before the bump, and no block
# arrives at the next barrier before it sees the bump.
BARRIER_SOURCE = """
__device__ unsigned int {name}_state[2];  // arrivals, generation
__forceinline__ __device__ void {name}() {{
  __syncthreads();
  if (threadIdx.x == 0) {{
    unsigned int* count = {name}_state;
    unsigned int* gen = {name}_state + 1;
    unsigned int g, now;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(g) : "l"(gen) : "memory");
    __threadfence();
    if (atomicAdd(count, 1u) == gridDim.x - 1) {{
      atomicExch(count, 0u);
      __threadfence();
      atomicAdd(gen, 1u);
    }} else {{
      do {{
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(gen) : "memory");
      }} while (now == g);
    }}
    __threadfence();
  }}
  __syncthreads();
}}
"""


@dataclasses.dataclass(frozen=True)
class PersistentConfig:
    """The plan of one persistent kernel (``configs/gemm/gemv_persistent.json``, by weights)."""

    blocks_per_sm: int  # resident blocks an SM: the grid is this x the SM count
    warps: int  # a block's warps, the same for every stage
    rows_per_warp: int  # output columns a warp owns in a column group (the row template's)
    unroll: int  # 512-byte steps of each weight row in flight (the row template's)
    double_buffer: bool = False  # the row template's: the next round's (group's) loads during this one
    half_sums: bool = False  # 4-bit weights, fp16 tokens: the row template's fp16 pair sums


def barrier_name(name: str) -> str:
    """The barrier's device function for the kernel ``name`` (its counters are named after it)."""
    return "fuselight_grid_barrier_" + re.sub(r"\W", "_", name)


def load_persistent_config(arch: str, weights: str) -> PersistentConfig:
    """The plan for ``weights`` (one of ``WEIGHTS``) on ``arch``: the arch's measured entry, else the
    ``analytic`` one; FuselightError for a bad one or an undescribed arch."""
    if weights not in WEIGHTS:
        raise FuselightError(f"persistent GEMV: weights must be one of {WEIGHTS}, got {weights!r}")
    node, where = arch_entry(config_dir() / CONFIG_FAMILY / f"{CONFIG_NAME}.json", arch, arch_config.as_written)
    if not isinstance(node, dict) or weights not in node:
        raise FuselightError(f"{where}: no entry {weights!r}")
    plan = from_fields(PersistentConfig, node[weights], f"{where}[{weights!r}]")
    _check_plan(plan, f"{where}[{weights!r}]")
    return plan


def _check_plan(plan: PersistentConfig, where: str) -> None:
    if plan.warps & (plan.warps - 1):  # (the row template's warps; the block's limits: check_persistent)
        raise FuselightError(f"{where}: field 'warps' must be a power of two, got {plan.warps}")


def stage_config(plan: PersistentConfig, ops: GemmOperands) -> GemvConfig:
    """The row template's config of one stage under ``plan`` (looping over the persistent grid)."""
    return GemvConfig(max_m=1, warps=plan.warps, unroll=plan.unroll, min_blocks_per_sm=plan.blocks_per_sm,
                      rows_per_warp=plan.rows_per_warp, double_buffer=plan.double_buffer,
                      grid_blocks_per_sm=plan.blocks_per_sm,
                      half_sums=plan.half_sums and ops.dequant is not None and ops.dtype == "float16")


def shared_bytes(stages: list[tuple[GemmOperands, GemvConfig]]) -> int:
    """Shared memory of a block, at most: the token row of the longest K, and each norm's reduction (a
    float32 a warp, and the result), each buffer padded to its alignment (ptxas packs the last one)."""

    def aligned(n: int) -> int:
        return -(-n // SHARED_ALIGN) * SHARED_ALIGN

    norms = sum(ops.prologue is not None for ops, _ in stages)
    reduction = aligned(stages[0][1].warps * REDUCE_BYTES) + aligned(REDUCE_BYTES)
    return aligned(max(ops.k for ops, _ in stages) * 2) + norms * reduction


def check_persistent(stages: list[tuple[GemmOperands, GemvConfig]], arch: str) -> None:
    """FuselightError where the stages cannot run as one persistent kernel on ``arch``: a stage the
    row template does not serve, stages of different warps, dtypes or grids, or ``blocks_per_sm``
    blocks that an SM of the device cannot hold at once (threads, shared memory, a block's limits)."""
    if not stages:
        raise FuselightError("persistent GEMV: no stages")
    device = require_device(arch)
    for i, (ops, cfg) in enumerate(stages):
        if cfg.rows_per_warp is None or cfg.grid_blocks_per_sm is None or cfg.prefetch_l2_percent is not None:
            raise FuselightError(f"persistent GEMV: stage {i} needs the row template looping over the grid "
                                 "(rows_per_warp, grid_blocks_per_sm) and no prefetch_l2_percent")
        check_gemv(ops, cfg)
    first = stages[0][1]
    for i, (ops, cfg) in enumerate(stages):
        if (cfg.warps, cfg.grid_blocks_per_sm, ops.dtype) != (first.warps, first.grid_blocks_per_sm, stages[0][0].dtype):
            raise FuselightError(f"persistent GEMV: stage {i} has warps {cfg.warps}, blocks_per_sm "
                                 f"{cfg.grid_blocks_per_sm}, dtype {ops.dtype}; stage 0 {first.warps}, "
                                 f"{first.grid_blocks_per_sm}, {stages[0][0].dtype}")
        if not isinstance(ops.out_n, int):
            raise FuselightError(f"persistent GEMV: stage {i} has a symbolic N ({ops.out_n})")
    per_sm, threads, smem = first.grid_blocks_per_sm, first.warps * WARP, shared_bytes(stages)
    if threads > device.max_threads_per_block or smem > device.smem_per_block:
        raise FuselightError(f"persistent GEMV: a block of {threads} threads and {smem} bytes of shared memory "
                             f"exceeds {arch}'s {device.max_threads_per_block} threads and {device.smem_per_block} bytes")
    if per_sm * threads > device.max_threads_per_sm or per_sm * smem > device.smem_per_sm:
        raise FuselightError(f"persistent GEMV: {per_sm} blocks an SM of {threads} threads and {smem} bytes of shared "
                             f"memory exceed {arch}'s {device.max_threads_per_sm} threads and {device.smem_per_sm} "
                             f"bytes an SM: the grid would not be resident at once")


def grid_blocks(stages: list[tuple[GemmOperands, GemvConfig]], arch: str) -> int:
    """The persistent grid: ``blocks_per_sm`` on each of the device's SMs."""
    return require_device(arch).sms * stages[0][1].grid_blocks_per_sm


def persistent_body(stages: list[tuple[GemmOperands, GemvConfig]], arch: str, name: str) -> Any:
    """The kernel body (a ``tvm.tirx.Stmt``) computing ``stages`` in order in one launch on ``arch``,
    a grid barrier between consecutive stages (see the module docstring); ``name``: the kernel's
    global symbol (names its barrier). Bind it to a function whose parameters are the stages'
    buffers (``kernel_func``). FuselightError where ``check_persistent`` refuses the stages."""
    check_persistent(stages, arch)
    grid = grid_blocks(stages, arch)
    first = stages[0][1]
    threads, per_sm = first.warps * WARP, first.grid_blocks_per_sm
    dtype = stages[0][0].dtype
    row = max(ops.k for ops, _ in stages)
    barrier, source = barrier_name(name), BARRIER_SOURCE.format(name=barrier_name(name))

    @T.macro
    def wait_for_grid():
        T.evaluate(cuda_op.cuda_func_call(barrier, source_code=source))

    built = [rows_stage(ops, cfg, grid, looping=True, hook=None if i == 0 else wait_for_grid)
             for i, (ops, cfg) in enumerate(stages)]
    run = _in_order([stage for stage, _ in built])

    # fmt: off
    @T.prim_func(s_tir=True, check_well_formed=False)
    def body():
        for bx in T.thread_binding(grid, thread="blockIdx.x"):
            for tid in T.thread_binding(threads, thread="threadIdx.x"):
                with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", per_sm), T.sblock("gemv_persistent"):
                    T.reads()
                    T.writes()
                    xs = T.sblock_alloc_buffer((row,), dtype, scope="shared")
                    run(bx, tid, xs)
    # fmt: on
    written = [b for ops, _ in stages for b in (ops.out.buffer, ops.prologue and ops.prologue.total) if b is not None]
    return _through_written(declared([view for _, views in built for view in views], body.body), written)


def _through_written(stmt: Any, written: list[Any]) -> Any:
    """``stmt`` with the row template's flat views (``DeclBuffer``) of the ``written`` buffers gone,
    their loads and stores made through the buffers themselves. A view is a kernel parameter of its
    own, a second ``__restrict__`` pointer to memory the kernel writes through another: nvcc may then
    read it through the read-only path (``ld.global.nc``), which does not see this launch's writes.
    The buffers' leading dimensions are 1 (M = 1), so a view's flat index is the last dimension's."""
    views: list[tuple[Any, Any]] = []

    def find(node: Any) -> None:
        if isinstance(node, tirx.DeclBuffer) and isinstance(node.data, tvm.ir.Call) and node.data.op.name == "tirx.buffer_data":
            base = node.data.args[0]
            if any(base.same_as(w) for w in written):
                views.append((node.buffer, base))

    tirx.stmt_functor.post_order_visit(stmt, find)

    def base_of(buffer: Any) -> Any:
        return next((base for view, base in views if view.same_as(buffer)), None)

    def index(base: Any, flat: Any) -> list[Any]:
        shape = list(base.ty.shape)
        if any(int(d) != 1 for d in shape[:-1]):
            raise FuselightError(f"persistent GEMV: {base.name} of shape {shape} is not one row")
        return [tirx.IntImm("int32", 0)] * (len(shape) - 1) + [flat]

    def rewrite(node: Any) -> Any:
        if isinstance(node, tirx.DeclBuffer):
            return tirx.Evaluate(0) if base_of(node.buffer) is not None else node
        base = base_of(node.buffer)
        if base is None:
            return node
        if isinstance(node, tirx.BufferLoad):
            return tirx.BufferLoad(base, index(base, node.indices[0]), node.predicate)
        return tirx.BufferStore(base, node.value, index(base, node.indices[0]), node.predicate)

    return tirx.stmt_functor.ir_transform(stmt, None, rewrite, ["tirx.DeclBuffer", "tirx.BufferLoad", "tirx.BufferStore"])


def _in_order(stages: list[Any]) -> Any:
    """One macro ``(bx, tid, xs)`` expanding ``stages`` (macros of the same arguments) in order."""
    if len(stages) == 1:
        return stages[0]
    head, rest = stages[0], _in_order(stages[1:])

    @T.macro
    def both(bx, tid, xs):
        head(bx, tid, xs)
        rest(bx, tid, xs)

    return both


def link(funcs: list[Any], feeds: dict[tuple[int, str], tuple[int, str]]) -> list[Any]:
    """``funcs`` (the stages' PrimFuncs) with the parameters ``feeds`` names replaced: ``(i, p) ->
    (j, q)`` makes parameter ``p`` of function ``i`` the parameter ``q`` of function ``j < i`` (what
    stage i reads is what stage j wrote, or read). FuselightError for a name a function lacks, or
    shapes and dtypes that differ."""
    swaps: list[dict[Any, Any]] = []
    for i, func in enumerate(funcs):
        swap = {}
        for (dst, pname), (src, qname) in feeds.items():
            if dst != i:
                continue
            if not 0 <= src < i:
                raise FuselightError(f"persistent GEMV: function {i} can read only earlier functions' buffers, not {src}'s")
            old, new = _param(func, pname, i), _param(funcs[src], qname, src)
            new = swaps[src].get(new, new)  # itself linked to an earlier function's
            if (list(old.ty.shape), str(old.ty.dtype)) != (list(new.ty.shape), str(new.ty.dtype)):
                raise FuselightError(f"persistent GEMV: {pname} of function {i} ({list(old.ty.shape)} {old.ty.dtype}) "
                                     f"is not {qname} of function {src} ({list(new.ty.shape)} {new.ty.dtype})")
            swap[old] = new
        swaps.append(swap)
    return [tirx.PrimFunc([swap.get(p, p) for p in func.params], tirx.stmt_functor.substitute(func.body, swap),
                          func.ret_type, func.attrs) for func, swap in zip(funcs, swaps)]


def _param(func: Any, name: str, i: int) -> Any:
    found = [p for p in func.params if p.name == name]
    if len(found) != 1:
        raise FuselightError(f"persistent GEMV: function {i} has no parameter {name!r} "
                             f"(has {[p.name for p in func.params]})")
    return found[0]


def kernel_func(funcs: list[Any], body: Any, name: str) -> Any:
    """A PrimFunc named ``name`` running ``body``, whose parameters are those of the linked
    ``funcs`` (each once, in order), marked scheduled (as ``rules.base.with_kernels``)."""
    params: list[Any] = []
    for func in funcs:
        params.extend(p for p in func.params if not any(p.same_as(q) for q in params))
    return with_kernels(tirx.PrimFunc(params, tirx.Evaluate(0)), body).with_attr("global_symbol", name)

