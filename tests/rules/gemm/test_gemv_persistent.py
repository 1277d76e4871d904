"""The persistent decode kernel (``rules/gemm/gemv_persistent.py``): a decode layer's GEMV stages
(o_proj + residual, RMSNorm + gate_up with SiLU-mul, down + residual, the next RMSNorm + QKV) in one
kernel with grid barriers between them, built for SmolLM2-135M's odd sizes (hidden 576, 9/3 heads of
64: QKV 960) with a prime-ish intermediate (47 x 32) and a column group of 12 (ragged last groups),
fp16 and q4f16_1: its structure read from the TIR (one barrier between two stages; each stage's first
weight loads before its barrier, what an earlier stage wrote read only after it; grid and launch
bounds), the CUDA compiled by nvcc for sm_90 (with programmatic launch, whose wait comes first) and
sm_80, its registers fitting the SM at ``blocks_per_sm`` blocks, no read of a buffer the kernel
writes through the read-only path (``ld.global.nc``, from the PTX), and the occupancy guard.

A grid barrier cannot run on the CPU (``llvm`` runs the blocks one by one: the first block would
wait at the first barrier forever), so the numerics are the probe's, on the GPU, against float64:
``bench/probes/persistent_decode.py``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import subprocess
from pathlib import Path

import pytest
from conftest import require_nvcc

tvm = pytest.importorskip("tvm")
from fuselight import tir_pipeline
from fuselight.cuda_compile import FAST_MATH_FLAG, TVM_FLAGS, gencode
from fuselight.device import device_model
from fuselight.errors import FuselightError
from fuselight.layer_prim_funcs import decode_layer, linear_residual
from fuselight.rules.gemm import gemv_persistent as gp
from fuselight.rules.gemm.analysis import analyze_matmul
from fuselight.target import resolve, to_tvm
from tir_query import kernel
from tvm import tirx

HIDDEN, INTERMEDIATE, QKV, EPS = 576, 47 * 32, (9 + 2 * 3) * 64, 1e-5
PLAN = gp.PersistentConfig(blocks_per_sm=2, warps=4, rows_per_warp=3, unroll=2, double_buffer=True)
WEIGHTS = {None: "fp16", "q4f16_1": "q4"}
STAGES = 4
SM90 = device_model("sm_90")


def _stages(scheme, plan=PLAN, next_qkv=True):
    funcs, feeds = decode_layer(HIDDEN, INTERMEDIATE, QKV, EPS, scheme=scheme, next_qkv=next_qkv)
    linked = gp.link(funcs, feeds)
    plan = dataclasses.replace(plan, half_sums=scheme is not None)
    ops = [analyze_matmul(f, prologue=True, dequant=True).operands for f in linked]
    return linked, [(o, gp.stage_config(plan, o)) for o in ops]


def _kernel_func(scheme, arch="sm_90"):
    name = f"persistent_{WEIGHTS[scheme]}"
    linked, stages = _stages(scheme)
    return gp.kernel_func(linked, gp.persistent_body(stages, arch, name), name), stages


def _nvcc(source: str, arch: str, out: Path) -> str:
    """nvcc's ptxas report (``--resource-usage``) of ``source`` for ``arch``, its PTX kept in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "k.cu").write_text(source)
    cmd = [require_nvcc(), "-O3", "--fatbin", f"-gencode={gencode(arch)}", *TVM_FLAGS, FAST_MATH_FLAG,
           "--resource-usage", "--keep", "--keep-dir", str(out), "-o", str(out / "k.fatbin"), str(out / "k.cu")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr + proc.stdout


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Both kernels (fp16, q4) in one sm_90 module built with programmatic launch (the fuselight
    pipeline's), and the fp16 one for sm_80; their sources, ptxas reports and the sm_90 PTX."""
    funcs = {s: _kernel_func(s) for s in WEIGHTS}
    sm90 = to_tvm(resolve("cuda", "sm_90"))
    mod = tvm.IRModule({f.attrs["global_symbol"]: f.with_attr("target", sm90) for f, _ in funcs.values()})
    source90 = tvm.compile(mod, target=sm90, tir_pipeline=tir_pipeline.register(True)).mod.imports[0].inspect_source("cuda")
    sm80 = to_tvm(resolve("cuda", "sm_80"))
    f80, _ = _kernel_func(None, "sm_80")
    source80 = tvm.compile(tvm.IRModule({"persistent_fp16": f80.with_attr("target", sm80)}), target=sm80,
                           tir_pipeline=tir_pipeline.register()).mod.imports[0].inspect_source("cuda")
    tmp = tmp_path_factory.mktemp("persistent")
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:  # one nvcc a source, side by side
        reports = list(pool.map(lambda job: _nvcc(*job), [(source90, "sm_90", tmp / "sm90"), (source80, "sm_80", tmp / "sm80")]))
    ptx = "\n".join(p.read_text() for p in (tmp / "sm90").glob("*.ptx"))
    return {"funcs": funcs, "source90": source90, "source80": source80, "report90": reports[0],
            "report80": reports[1], "ptx": ptx, "sm80_func": f80}


# --- the TIR: barriers, order, grid ---------------------------------------------------------------


def _events(func):
    """Program-order events of ``func``: ("barrier",) at each barrier call, ("load", i) at each load of
    parameter i (through itself or a flat view of it)."""
    params = list(func.params)
    views: list[tuple] = []

    def param_index(buffer):
        for view, base in views:
            if view.same_as(buffer):
                buffer = base
        return next((i for i, p in enumerate(params) if p.same_as(buffer)), None)

    events: list[tuple] = []

    def visit(node):
        if isinstance(node, tirx.DeclBuffer) and isinstance(node.data, tvm.ir.Call):
            views.append((node.buffer, node.data.args[0]))
        elif isinstance(node, tvm.ir.Call) and getattr(node.op, "name", "") == "tirx.cuda.func_call":
            if str(node.args[0].value).startswith("fuselight_grid_barrier_"):
                events.append(("barrier",))
        elif isinstance(node, tirx.BufferLoad):
            i = param_index(node.buffer)
            if i is not None:
                events.append(("load", i))
        return True

    tirx.stmt_functor.pre_order_visit(func.body, visit)
    return events


def _index(func, buffer):
    return next(i for i, p in enumerate(func.params) if p.same_as(buffer))


@pytest.mark.parametrize("scheme", WEIGHTS)
def test_each_stage_loads_weights_before_its_barrier_and_reads_earlier_outputs_after_it(built, scheme):
    func, stages = built["funcs"][scheme]
    events = _events(func)
    barriers = [i for i, e in enumerate(events) if e == ("barrier",)]
    assert len(barriers) == STAGES - 1
    for s, (ops, _) in enumerate(stages):
        weight_loads = [i for i, e in enumerate(events) if e == ("load", _index(func, ops.b))]
        if s > 0:  # its first round streams while the previous stage finishes
            assert weight_loads[0] < barriers[s - 1]
            if s > 1:
                assert weight_loads[0] > barriers[s - 2]  # (not hoisted above the stage before)
        outputs = [ops.out.buffer] + ([ops.prologue.total] if ops.prologue and ops.prologue.total else [])
        for out in outputs:
            reads = [i for i, e in enumerate(events) if e == ("load", _index(func, out))]
            if s < STAGES - 1:
                assert reads, f"stage {s}'s output is read by a later stage"
                assert min(reads) > barriers[s]  # only once every block has written it
            else:
                assert not reads


@pytest.mark.parametrize("scheme", WEIGHTS)
def test_grid_is_the_resident_blocks_and_launch_bounds_ask_for_them(built, scheme):
    kern = kernel(built["funcs"][scheme][0])
    assert kern.launch == {"blockIdx.x": SM90.sms * PLAN.blocks_per_sm, "threadIdx.x": PLAN.warps * 32}
    assert kern.attrs["tirx.launch_bounds_min_blocks_per_sm"] == PLAN.blocks_per_sm
    # One shared token row, of the longest K (down's), for every stage.
    assert [a for a in kern.allocs.values() if a[0] == "shared"] == [("shared", "float16", (INTERMEDIATE,))]


def test_the_kernel_reads_what_it_wrote_through_one_pointer(built):
    # The flat views the row template reads a token row through are gone for the linked buffers: each
    # intermediate is one kernel parameter (a second, read-only, pointer could read through ld.global.nc).
    func, stages = built["funcs"][None]
    names = [p.name for p in func.params]
    assert names == ["x", "w", "residual", "add", "norm_weight", "weight0", "silu_multiply_intermediate", "w", "add",
                     "norm_weight", "weight0", "compute_intermediate"]
    assert stages[1][0].prologue.x.same_as(stages[0][0].out.buffer)
    # 4 weights, 2 norm weights, x, the residual h and the 4 outputs: one pointer each.
    assert len(_pointer_params(built["source90"], "persistent_fp16_kernel")) == 12


# --- nvcc ----------------------------------------------------------------------------------------------


def _resources(report: str) -> dict[str, tuple[int, int]]:
    """(registers, shared bytes) of each kernel in a ptxas report."""
    found, current = {}, None
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = m.group(1)
        m = re.search(r"Used (\d+) registers.* (\d+) bytes smem", line)
        if m and current:
            found[current] = (int(m.group(1)), int(m.group(2)))
    return found


def test_nvcc_compiles_for_sm_90_and_registers_fit_the_sm(built):
    found = _resources(built["report90"])
    assert set(found) == {"persistent_fp16_kernel", "persistent_q4_kernel"}
    for scheme, weights in WEIGHTS.items():
        regs, smem = found[f"persistent_{weights}_kernel"]
        assert regs * PLAN.warps * 32 * PLAN.blocks_per_sm <= SM90.regs_per_sm, (weights, regs)
        # The shared memory the occupancy guard counts bounds what ptxas allocates, within the padding.
        stages = built["funcs"][scheme][1]
        norms = sum(ops.prologue is not None for ops, _ in stages)
        assert INTERMEDIATE * 2 + norms * (PLAN.warps + 1) * 4 <= smem <= gp.shared_bytes(stages)
        assert gp.shared_bytes(stages) - smem < gp.SHARED_ALIGN * (1 + 2 * norms)
    assert set(re.findall(r"(\d+) bytes spill stores", built["report90"])) == {"0"}
    # Programmatic launch (sm_90): the wait comes before the kernel's first load.
    body = built["source90"][built["source90"].index("persistent_fp16_kernel(half"):]
    assert body.index("griddepcontrol_wait();") < body.index("= *(uint4*)(")


def test_nvcc_compiles_for_sm_80_without_hopper_instructions(built):
    found = _resources(built["report80"])
    assert set(found) == {"persistent_fp16_kernel"}
    assert "griddepcontrol" not in built["source80"]
    assert found["persistent_fp16_kernel"][0] * PLAN.warps * 32 * PLAN.blocks_per_sm <= device_model("sm_80").regs_per_sm


_PARAM = re.compile(r"ld\.param\.u64\s+(%rd\d+),\s*\[(\w+)_param_(\d+)\]")
_REG = re.compile(r"%\w+")


def _ptx_body(ptx: str, kernel_name: str) -> list[str]:
    start = ptx.index(f".entry {kernel_name}(")
    end = ptx.find(".entry", start + 1)
    return ptx[start:end if end > 0 else len(ptx)].splitlines()


def nc_loads(ptx: str, kernel_name: str) -> list[tuple[int, set[int]]]:
    """Each ``ld.global.nc`` of the kernel: its line in the kernel's PTX and the kernel parameters
    (indices) its address may derive from: a flow-insensitive closure over the register definitions
    (ld.param gives a parameter; arithmetic and moves carry their operands'; other loads start nothing)."""
    origins: dict[str, set[int]] = {}
    defs: list[tuple[str, list[str]]] = []
    nc_addresses = []
    for n, line in enumerate(_ptx_body(ptx, kernel_name)):
        line = re.sub(r"^\s*@!?%p\d+\s+", "", line.strip())
        m = _PARAM.match(line)
        if m:
            origins.setdefault(m.group(1), set()).add(int(m.group(3)))
            continue
        op, _, rest = line.partition(" ")
        if op.startswith("ld.global.nc"):
            nc_addresses.append((n, re.search(r"\[(%rd\d+)", rest).group(1)))
        if op.startswith(("ld.", "st.", "atom.", "red.", "bra", "setp", "bar", "@", "//", ".")) or not rest:
            continue
        regs = _REG.findall(rest)
        if len(regs) >= 2:
            defs.append((regs[0], regs[1:]))
    changed = True
    while changed:
        changed = False
        for dst, srcs in defs:
            new = set().union(*(origins.get(s, set()) for s in srcs)) - origins.get(dst, set())
            if new:
                origins.setdefault(dst, set()).update(new)
                changed = True
    return [(n, origins.get(a, set())) for n, a in nc_addresses]


def _pointer_params(source: str, kernel_name: str) -> list[str]:
    signature = re.search(rf"{kernel_name}\(([^)]*)\) {{", source).group(1)
    return [p.split()[-1] for p in signature.split(",")]


@pytest.mark.parametrize("scheme", WEIGHTS)
def test_no_buffer_the_kernel_writes_is_read_through_the_read_only_path(built, scheme):
    name = f"persistent_{WEIGHTS[scheme]}_kernel"
    params = _pointer_params(built["source90"], name)
    body = built["source90"][built["source90"].index(f"{name}(half"):]
    written = {p for p in params if re.search(rf"\b{p}\[[^\]]*\] = ", body)}
    assert len(written) == STAGES  # h1, act, h2, qkv
    # Every other pointer is one of the function's inputs (weights, scales, norms, x, residual): no
    # second pointer to a written buffer (a flat view's) that nvcc could take for read-only.
    assert len(params) - len(written) == len(built["funcs"][scheme][0].params) - STAGES
    nc_params = {params[i] for _, o in nc_loads(built["ptx"], name) for i in o}
    assert nc_params, "the weights are read through ld.global.nc"  # (the analysis sees such loads)
    assert any(p.startswith("W_ptr") for p in nc_params)
    assert not nc_params & written


@pytest.mark.parametrize("scheme", WEIGHTS)
def test_in_the_ptx_each_stage_loads_weights_before_its_barrier(built, scheme):
    # The TIR's order survives NVVM: each barrier's counter reset (one atom.exch a barrier) comes
    # after a load of the next stage's weights (W, W_1, ...: the stages' views in order) and after the
    # last barrier before it.
    name = f"persistent_{WEIGHTS[scheme]}_kernel"
    params = _pointer_params(built["source90"], name)
    barriers = [n for n, line in enumerate(_ptx_body(built["ptx"], name)) if "atom.global.exch" in line]
    assert len(barriers) == STAGES - 1
    loads = nc_loads(built["ptx"], name)
    for s in range(1, STAGES):
        weight = params.index(f"W_ptr_{s}")
        first = min(n for n, o in loads if weight in o)
        assert (barriers[s - 2] if s > 1 else 0) < first < barriers[s - 1]


def test_nc_origins_follow_address_arithmetic():
    # The analysis itself: a load through a pointer derived from parameter 1 is attributed to it.
    ptx = """.entry k(
\tld.param.u64 \t%rd1, [k_param_0];
\tld.param.u64 \t%rd2, [k_param_1];
\tcvta.to.global.u64 \t%rd3, %rd2;
\tmul.wide.s32 \t%rd4, %r1, 2;
\tadd.s64 \t%rd5, %rd3, %rd4;
\tld.global.nc.v4.u32 \t{%r2, %r3, %r4, %r5}, [%rd5+16];
\tld.global.u16 \t%rs1, [%rd1];
}"""
    assert nc_loads(ptx, "k") == [(6, {1})]


# --- the occupancy guard and other refusals ---------------------------------------------------------


def test_a_plan_the_sm_cannot_hold_is_refused_with_its_numbers():
    _, stages = _stages(None, dataclasses.replace(PLAN, warps=32, blocks_per_sm=3))
    with pytest.raises(FuselightError, match=r"3 blocks an SM of 1024 threads .* 2048 threads"):
        gp.persistent_body(stages, "sm_90", "k")
    # Shared memory: down's token row of 14336 halves, 9 blocks an SM.
    down = analyze_matmul(linear_residual(64, 14336)).operands
    plan = dataclasses.replace(PLAN, blocks_per_sm=9)
    with pytest.raises(FuselightError, match=r"9 blocks an SM of 128 threads and 28672 bytes .* 233472 bytes an SM"):
        gp.check_persistent([(down, gp.stage_config(plan, down))], "sm_90")
    gp.check_persistent([(down, gp.stage_config(dataclasses.replace(PLAN, blocks_per_sm=8), down))], "sm_90")


def test_stages_must_share_warps_and_loop_over_the_grid():
    _, stages = _stages(None, next_qkv=False)
    mixed = [stages[0], (stages[1][0], dataclasses.replace(stages[1][1], warps=8)), stages[2]]
    with pytest.raises(FuselightError, match="stage 1 has warps 8"):
        gp.check_persistent(mixed, "sm_90")
    one_block_a_group = [(ops, dataclasses.replace(cfg, grid_blocks_per_sm=None)) for ops, cfg in stages]
    with pytest.raises(FuselightError, match="stage 0 needs the row template looping"):
        gp.check_persistent(one_block_a_group, "sm_90")


def test_link_refuses_buffers_that_do_not_match():
    funcs, feeds = decode_layer(HIDDEN, INTERMEDIATE, QKV, EPS)
    with pytest.raises(FuselightError, match="x of function 2"):  # act [1, 1, 1504] is not h1 [1, 1, 576]
        gp.link(funcs, {**feeds, (2, "x"): (0, "add")})
    with pytest.raises(FuselightError, match="no parameter 'h'"):
        gp.link(funcs, {(1, "x"): (0, "h")})


def test_shipped_plans_build_for_every_described_arch():
    for arch in ("sm_80", "sm_86", "sm_89", "sm_90"):
        for weights in gp.WEIGHTS:
            plan = gp.load_persistent_config(arch, weights)
            _, stages = _stages(None if weights == "float" else "q4f16_1", plan)
            gp.check_persistent(stages, arch)
    with pytest.raises(FuselightError, match="weights must be one of"):
        gp.load_persistent_config("sm_90", "int8")
