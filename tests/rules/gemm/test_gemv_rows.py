"""The GEMV row-streaming template (M = 1; ``rules/gemm/gemv_rows.py``): each epilogue and prologue
builds one kernel for sm_90 that nvcc compiles, the grid and the paired rows, ragged K and symbolic
M, and its config checks (numerics run on the GPU against float64, in the kernel suite)."""

from __future__ import annotations

import dataclasses
import re

import pytest
from conftest import needs_nvcc

tvm = pytest.importorskip("tvm")
from fuselight.device import device_model
from fuselight.errors import FuselightError
from fuselight.rules.base import with_kernels
from fuselight.rules.gemm import gemv, gemv_common, gemv_rows
from fuselight.rules.gemm.analysis import analyze_matmul
from fuselight.tune.gemm import matmul_prim_func
from test_fuse_norm_gemv import _fused, _gate_up, _nt_matmul
from test_gemv import _linear_residual, _lm_head
from tir_query import constants, kernel

ROWS = gemv_common.GemvConfig(max_m=1, warps=8, unroll=4, min_blocks_per_sm=2, rows_per_warp=1)


def _kernel(func, cfg: gemv_common.GemvConfig = ROWS):
    ops = analyze_matmul(func, prologue=True).operands
    return with_kernels(func, gemv.gemv_body(ops, cfg)), ops


def _source(funcs: dict, target) -> str:
    lib = tvm.compile(tvm.IRModule({name: f.with_attr("global_symbol", name) for name, f in funcs.items()}), target=target)
    return lib.mod.imports[0].inspect_source("cuda")


def test_the_config_selects_the_template():
    # rows_per_warp set: gemv_body writes the row-streaming kernel (shuffles, no tensor cores).
    func = matmul_prim_func(384, 256, "float16", m=1)
    rows = kernel(_kernel(func)[0])
    mma = kernel(_kernel(func, dataclasses.replace(ROWS, rows_per_warp=None))[0])
    assert "tirx.ptx.mma_legacy" not in rows.calls and rows.calls["tirx.tvm_warp_shuffle_xor"] == 1
    assert mma.calls["tirx.ptx.mma_legacy"] == 1 and "tirx.tvm_warp_shuffle_xor" not in mma.calls
    assert rows.launch == {"blockIdx.x": 384 // 8, "threadIdx.x": 256}  # 8 warps, a row each
    assert mma.launch == {"blockIdx.x": 384 // 16, "threadIdx.x": 256}  # mma's 16 rows a block


K = 4096
# What each function is and what its kernel must write (the normed prologue's residual variant also
# writes the residual sum, Tg); a block is 8 warps of one row, so blocks = rows / 8 (gate_up: output
# columns, each a gate and an up row).
FUNCS = {
    "plain": (lambda: matmul_prim_func(4096, 14336, "float16", m=1), 4096 // 8, {"O"}),
    "residual": (lambda: _linear_residual(4096, K, 1), 4096 // 8, {"O"}),
    "lm_head": (lambda: _lm_head(1000, K, 1), -(-1000 // 8), {"O"}),  # two casts
    "qkv": (lambda: _fused(_nt_matmul(6144, K), 6144, k=K), 6144 // 8, {"Tg", "compute_intermediate"}),
    "qkv_first": (lambda: _fused(_nt_matmul(6144, K), 6144, residual=False, k=K), 6144 // 8, {"compute_intermediate"}),
    "gate_up": (lambda: _fused(_gate_up(28672, K), 28672, casts=(), k=K), 28672 // 2 // 8,
                {"Tg", "silu_multiply_intermediate"}),
    "bf16": (lambda: matmul_prim_func(4096, 4096, "bfloat16", m=1), 4096 // 8, {"O"}),
    # a float32 residual stream (residual_stream_fp32): x in float32, or bf16 where the stream starts
    **{f"qkv_stream_{x}": (lambda x=x: _fused(_nt_matmul(6144, K, "bfloat16"), 6144, casts=("bfloat16",), k=K,
                                               dtype="bfloat16", x_dtype=x, stream="float32"),
                           6144 // 8, {"Tg", "compute_intermediate"}) for x in ("float32", "bfloat16")},
}


@pytest.mark.parametrize("name", FUNCS)
def test_each_epilogue_and_prologue_builds_one_kernel(name):
    make, blocks, outputs = FUNCS[name]
    kern = kernel(_kernel(make())[0])
    assert kern.launch == {"blockIdx.x": blocks, "threadIdx.x": ROWS.warps * 32}
    assert kern.attrs["tirx.launch_bounds_min_blocks_per_sm"] == ROWS.min_blocks_per_sm
    assert kern.outputs == outputs
    assert "tirx.ptx.mma_legacy" not in kern.calls and kern.calls["tirx.tvm_warp_shuffle_xor"] == 1
    # The norm prologue: the row's sum of squares reduced over the block, then rsqrt.
    normed = name in ("qkv", "qkv_first", "gate_up") or name.startswith("qkv_stream")
    assert ("tirx.rsqrt" in kern.calls) == normed and ("tirx.tvm_thread_allreduce" in kern.calls) == normed
    # gate_up's warps hold a gate and an up row: two accumulators, two rows of weights in flight.
    assert kern.allocs["acc"] == ("local", "float32", (2 if name == "gate_up" else 1,))
    if name.startswith("qkv_stream"):  # x + r held (and written) in float32
        assert kern.allocs["t_reg"][1] == "float32"


@needs_nvcc
def test_nvcc_compiles_every_epilogue_and_prologue(cuda):
    from fuselight.cuda_compile import compile_cuda

    source = _source({name: _kernel(make())[0] for name, (make, _, _) in FUNCS.items()}, cuda)
    assert compile_cuda(source, "sm_90")


def test_grid_and_shared_memory():
    plain = analyze_matmul(matmul_prim_func(4100 - 4, 256, "float16", m=1)).operands  # 4096 columns
    assert gemv_rows.rows_grid_blocks(plain, ROWS) == 4096 // 8
    assert gemv_rows.rows_grid_blocks(plain, dataclasses.replace(ROWS, rows_per_warp=3)) == -(-4096 // 24)
    paired = analyze_matmul(_fused(_gate_up(2 * 344, 256), 2 * 344, casts=(), k=256), prologue=True).operands
    assert gemv_rows.rows_grid_blocks(paired, ROWS) == -(-344 // 8)  # output columns, each two rows
    assert gemv.shared_bytes(plain, ROWS) == 256 * 2  # the token row


def test_paired_warps_stream_the_gate_row_and_its_up_row():
    # Output column c reads weight rows c and c + n / 2 (344 rows further); silu(gate) * up in the epilogue.
    n, k = 2 * 344, 256
    kern = kernel(_kernel(_fused(_gate_up(n, k), n, casts=(), k=k))[0])
    assert 344 in set().union(*(constants(i) for i in kern.loads["W"]))
    assert kern.calls["tirx.sigmoid"] == 1
    assert kern.launch == {"blockIdx.x": 344 // 8, "threadIdx.x": 256}


def test_ragged_k_masks_the_pieces_past_the_row():
    # K = 384: 48 pieces of 16 bytes, not a multiple of 32 lanes x 4 steps: the last round is masked
    # at piece 48, not at the 64 of whole rounds.
    bounds = kernel(_kernel(matmul_prim_func(256, 384, "float16", m=1))[0]).bounds
    assert bounds[48] >= 1 and 64 not in bounds


@needs_nvcc
def test_symbolic_m_of_one_row_builds(cuda):
    # The Matmul rule's branch for M <= 1 of a symbolic M runs this template.
    from fuselight.cuda_compile import compile_cuda

    func = matmul_prim_func(4096, 4096, "float16")
    scheduled, ops = _kernel(func)
    assert not isinstance(ops.m, int)
    kern = kernel(scheduled)  # one launch, the same grid as a static M of 1
    assert kern.launch == {"blockIdx.x": 4096 // 8, "threadIdx.x": 256} and kern.outputs == {"O"}
    assert compile_cuda(_source({"sym": scheduled}, cuda), "sm_90")


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
        gemv.check_gemv(ops, ROWS, device_model("sm_90").smem_per_block)  # 64 KiB of token row > 48 KiB
