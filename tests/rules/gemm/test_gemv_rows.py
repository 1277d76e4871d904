"""The GEMV row-streaming template (M = 1; ``rules/gemm/gemv_rows.py``): each epilogue and prologue
builds one kernel for sm_90 that nvcc compiles, the grid and the paired rows, ragged K and symbolic
M, and its config checks (numerics run on the GPU against float64, in the kernel suite)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from conftest import needs_nvcc

tvm = pytest.importorskip("tvm")
from fuselight.errors import FuselightError
from fuselight.rules.base import with_kernels
from fuselight.rules.gemm import gemv, gemv_rows
from fuselight.rules.gemm.analysis import analyze_matmul
from fuselight.target import resolve, to_tvm
from fuselight.tune.gemm import matmul_prim_func
from test_fuse_norm_gemv import _fused, _gate_up, _nt_matmul
from test_gemv import _linear_residual, _lm_head

ROWS = gemv.GemvConfig(max_m=1, warps=8, unroll=4, min_blocks_per_sm=2, rows_per_warp=1)


@pytest.fixture(scope="module")
def cuda():
    return to_tvm(resolve("cuda", "sm_90"))


def _kernel(func, cfg: gemv.GemvConfig = ROWS):
    ops = analyze_matmul(func, prologue=True).operands
    return with_kernels(func, gemv.gemv_body(ops, cfg)), ops


def _source(funcs: dict, target) -> str:
    lib = tvm.compile(tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()}), target=target)
    return lib.mod.imports[0].inspect_source("cuda")


def _kernels(source: str) -> set[str]:
    return set(re.findall(r"__global__ void __launch_bounds__\([^)]*\) (\w+)\(", source))


def test_the_config_selects_the_template():
    # rows_per_warp set: gemv_body writes the row-streaming kernel (no tensor cores).
    ops = analyze_matmul(matmul_prim_func(384, 256, "float16", m=1)).operands
    assert "mma" not in str(gemv.gemv_body(ops, ROWS))
    assert "mma" in str(gemv.gemv_body(ops, dataclasses.replace(ROWS, rows_per_warp=None)))


@needs_nvcc
def test_each_epilogue_and_prologue_builds_one_kernel_that_nvcc_compiles(cuda):
    from fuselight.cuda_compile import compile_cuda

    k = 4096
    funcs = {
        "plain": matmul_prim_func(4096, 14336, "float16", m=1),
        "residual": _linear_residual(4096, 4096, 1),
        "lm_head": _lm_head(1000, k, 1),  # two casts
        "qkv": _fused(_nt_matmul(6144, k), 6144, k=k),  # norm prologue with the residual
        "qkv_first": _fused(_nt_matmul(6144, k), 6144, residual=False, k=k),
        "gate_up": _fused(_gate_up(28672, k), 28672, casts=(), k=k),  # paired, norm prologue
        "bf16": matmul_prim_func(4096, 4096, "bfloat16", m=1),
    }
    source = _source({name: _kernel(f)[0] for name, f in funcs.items()}, cuda)
    assert _kernels(source) == {f"{name}_kernel" for name in funcs}  # one launch each
    assert "mma.sync" not in source and source.count("__shfl_xor_sync") >= 5 * len(funcs)
    assert f"__launch_bounds__({ROWS.warps * 32}, {ROWS.min_blocks_per_sm})" in source
    assert "rsqrtf" in source and "R_ptr[" in source  # the norm prologue; the residual epilogue
    assert compile_cuda(source, "sm_90")


def test_grid_and_shared_memory():
    plain = analyze_matmul(matmul_prim_func(4100 - 4, 256, "float16", m=1)).operands  # 4096 columns
    assert gemv_rows.rows_grid_blocks(plain, ROWS) == 4096 // 8
    assert gemv_rows.rows_grid_blocks(plain, dataclasses.replace(ROWS, rows_per_warp=3)) == -(-4096 // 24)
    paired = analyze_matmul(_fused(_gate_up(2 * 344, 256), 2 * 344, casts=(), k=256), prologue=True).operands
    assert gemv_rows.rows_grid_blocks(paired, ROWS) == -(-344 // 8)  # output columns, each two rows
    assert gemv.shared_bytes(plain, ROWS) == 256 * 2  # the token row


def test_paired_warps_stream_the_gate_row_and_its_up_row(cuda):
    # Output column c reads weight rows c and c + n / 2: the up rows sit n / 2 x k elements further.
    n, k = 2 * 344, 256
    source = _source({"g": _kernel(_fused(_gate_up(n, k), n, casts=(), k=k))[0]}, cuda)
    assert str(n // 2 * k) in source
    assert "silu" in source.lower() or "__expf" in source or "exp" in source  # silu in the epilogue


def test_ragged_k_masks_the_pieces_past_the_row(cuda):
    # K = 384: 48 pieces of 16 bytes, not a multiple of 32 lanes x 4 steps: the last round is masked.
    func = matmul_prim_func(256, 384, "float16", m=1)
    source = _source({"r": _kernel(func)[0]}, cuda)
    assert re.search(r"< 48\)", source)


@needs_nvcc
def test_symbolic_m_of_one_row_builds(cuda):
    # The Matmul rule's branch for M <= 1 of a symbolic M runs this template.
    from fuselight.cuda_compile import compile_cuda

    func = matmul_prim_func(4096, 4096, "float16")
    kernel, ops = _kernel(func)
    assert not isinstance(ops.m, int)
    source = _source({"sym": kernel}, cuda)
    assert len(_kernels(source)) == 1 and compile_cuda(source, "sm_90")


@needs_nvcc
def test_o_proj_asks_l2_for_its_rows_then_waits_once_before_any_load(cuda):
    # The shipped bucket for o_proj's shape (the GEMV after the decode attention) prefetches; down's
    # (K 14336) does not. In the every-kernel PDL pipeline the kernel keeps its own single wait.
    from fuselight import tir_pipeline
    from fuselight.cuda_compile import compile_cuda
    from fuselight.rules.gemv import gemv_config

    configs = {}
    for name, (n, k) in {"o_proj": (4096, 4096), "down": (4096, 14336)}.items():
        ops = analyze_matmul(_linear_residual(n, k, 1)).operands
        configs[name] = gemv_config(ops, 1, cuda)
    assert configs["o_proj"].prefetch_l2_percent and configs["down"].prefetch_l2_percent is None
    kernel = _kernel(_linear_residual(4096, 4096, 1), configs["o_proj"])[0]
    mod = tvm.IRModule({"o_proj": kernel.with_attr("global_symbol", "o_proj")})
    source = tvm.compile(mod, target=cuda, tir_pipeline=tir_pipeline.register(every_kernel=True)).mod.imports[0].inspect_source("cuda")
    body = source[re.search(r"o_proj_kernel\([^)]*\) \{", source).end():]
    prefetch, wait, load = body.index("fuselight_prefetch_l2("), body.index("griddepcontrol_wait();"), body.index("= *(uint4*)(W_ptr")
    assert prefetch < wait < load and body.count("griddepcontrol_wait();") == 1
    assert f"(uint){4096 * 2 * configs['o_proj'].prefetch_l2_percent // 100}" in body  # bytes of each row
    assert compile_cuda(source, "sm_90")


@pytest.mark.parametrize("field,value", [("rows_per_warp", 0), ("max_m", 2)])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(FuselightError, match="rows_per_warp" if field == "max_m" else field):
        gemv.check_gemv_config(dataclasses.replace(ROWS, **{field: value}))


def test_too_large_a_token_row_is_refused():
    ops = analyze_matmul(matmul_prim_func(256, 32768, "float16", m=1)).operands
    with pytest.raises(FuselightError, match="shared memory"):
        gemv.check_gemv(ops, ROWS, gemv.STATIC_SHARED_BYTES)
