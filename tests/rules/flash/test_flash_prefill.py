"""Flash-attention prefill templates build for sm_90 into tensor-core CUDA; bad configs fail cleanly.

The numerics run on the GPU (the kernel benchmark suite); here: every supported head dim, dtype and
GQA group builds, the CUDA uses mma.sync / ldmatrix / cp.async, nvcc accepts it, the ragged and
paged kernels keep TVM's signatures, carry fuselight's symbols and refuse rotary_mode 1 on the host,
and the PagedAttention rule swaps in the paged one for TVM's (not its sliding-window variant).
"""

import dataclasses

import pytest
from conftest import compile_cuda_concurrently, needs_nvcc
from fuselight.errors import FuselightError
from fuselight.rules.flash.prefill import (
    PrefillConfig,
    check_config,
    flash_attention_dense,
    flash_prefill_paged,
    flash_prefill_ragged,
    load_prefill_config,
)
from fuselight.rules.paged_attention import PagedAttention, analyze, kernel_for
from fuselight.target import resolve, to_tvm

ROTARY_MESSAGE = "rotary_mode 1 (RoPE inside attention) is not supported"


CUDA = to_tvm(resolve("cuda", "sm_90"))


def _build(func):
    import tvm

    return tvm.compile(
        tvm.IRModule({"main": func}), target=to_tvm(resolve("cuda", "sm_90"))
    )


def _cuda(executable) -> str:
    return executable.mod.imports[0].inspect_source("cuda")


def _assert_tensor_core(src: str) -> None:
    assert "mma.sync.aligned.m16n8k16" in src
    assert "ldmatrix.sync.aligned.m8n8.x4.trans" in src  # V as the B operand
    assert "cp.async" in src


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kv_heads", [8, 32])
def test_ragged_builds_with_tensor_cores(head_dim, dtype, kv_heads):
    func = flash_prefill_ragged(
        kv_heads, 32, head_dim, dtype, load_prefill_config("sm_90", head_dim)
    )
    assert func.attrs["tirx.is_scheduled"]
    exe = _build(func)
    src = _cuda(exe)
    _assert_tensor_core(src)
    abbrev = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    assert f".{abbrev}.{abbrev}.f32" in src
    # The rotary check runs on the host, before any launch.
    assert ROTARY_MESSAGE in exe.mod.inspect_source("ll")
    assert ROTARY_MESSAGE not in src


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kv_heads", [8, 32])
def test_paged_builds_with_tensor_cores(head_dim, dtype, kv_heads):
    func = flash_prefill_paged(
        kv_heads, 32, head_dim, dtype, 16, load_prefill_config("sm_90", head_dim)
    )
    exe = _build(func)
    src = _cuda(exe)
    _assert_tensor_core(src)
    assert "fuselight_prefill_paged_kv_kernel" in src
    # K/V rows are found through the page table.
    assert "page_values" in src
    assert ROTARY_MESSAGE in exe.mod.inspect_source("ll")
    assert ROTARY_MESSAGE not in src


def _signature(func):
    """Parameter names, and for buffers dtype, shape (as text) and elem_offset kind."""
    import tvm

    def describe(p):
        t = p.ty
        if isinstance(t, tvm.tirx.buffer.BufferType):
            return (
                p.name,
                str(t.dtype),
                [str(s) for s in t.shape],
                isinstance(t.elem_offset, tvm.tirx.Var),
            )
        return (p.name, str(t))

    return [describe(p) for p in func.params]


def test_ragged_is_a_drop_in_for_tvms_kernel():
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill_ragged

    ours = flash_prefill_ragged(
        8, 32, 128, "float16", load_prefill_config("sm_90", 128)
    )
    tvms = _attention_prefill_ragged(
        8, 32, 128, 128, "float16", {}, to_tvm(resolve("cuda", "sm_90"))
    )
    assert _signature(ours) == _signature(tvms)
    assert str(ours.params[0].ty.shape[0]) == "qo_len"  # lengths stay symbolic
    assert ours.attrs["global_symbol"] == "fuselight_prefill_ragged_kv"


def _tvm_paged(h_kv=8, h_q=32, d=128, dtype="float16", sliding=False, page_size=16):
    from tvm.relax.frontend.nn.llm._prefill_kernels import _attention_prefill

    return _attention_prefill(h_kv, h_q, d, dtype, sliding, {}, CUDA, page_size)


@pytest.mark.parametrize("page_size", [16, 32])
def test_paged_is_a_drop_in_for_tvms_kernel(page_size):
    ours = flash_prefill_paged(
        8, 32, 128, "float16", page_size, load_prefill_config("sm_90", 128)
    )
    tvms = _tvm_paged(page_size=page_size)
    assert _signature(ours) == _signature(tvms)
    assert [str(s) for s in ours.params[2].ty.shape] == ["max_num_pages", "2", "8", str(page_size), "128"]
    assert ours.attrs["global_symbol"] == "fuselight_prefill_paged_kv"


def test_rule_swaps_tvms_paged_prefill_but_not_its_sliding_window_variant():
    desc = analyze(_tvm_paged(4, 16, 64, "bfloat16", page_size=32))
    assert (desc.kind, desc.num_qo_heads, desc.num_kv_heads, desc.head_dim, desc.page_size, desc.dtype) == (
        "prefill_paged", 16, 4, 64, 32, "bfloat16"
    )
    ours = kernel_for(_tvm_paged(), CUDA)
    assert ours.attrs["global_symbol"] == "fuselight_prefill_paged_kv"
    assert _signature(ours) == _signature(_tvm_paged())
    sliding = _tvm_paged(sliding=True)
    assert len(sliding.params[5].ty.shape) == 2  # length_info [3, batch]: what tells them apart
    assert analyze(sliding) is None
    assert kernel_for(sliding, CUDA) is None


@pytest.mark.parametrize(
    ("layout", "causal", "mask", "dtype", "kv_heads", "head_dim"),
    [
        ("BSHD", True, False, "float16", 8, 128),
        ("BHSD", False, True, "bfloat16", 32, 64),
    ],
)
def test_dense_builds_with_tensor_cores(
    layout, causal, mask, dtype, kv_heads, head_dim
):
    cfg = load_prefill_config("sm_90", head_dim)
    func = flash_attention_dense(
        32,
        kv_heads,
        head_dim,
        dtype,
        causal=causal,
        sm_scale=head_dim**-0.5,
        layout=layout,
        additive_mask=mask,
        config=cfg,
    )
    assert [p.name for p in func.params] == [
        "q",
        "k",
        "v",
        *(["mask"] if mask else []),
        "out",
    ]
    symbolic = [
        s
        for s in func.params[0].ty.shape
        if not isinstance(s, int) and "Var" in type(s).__name__
    ]
    assert [str(s) for s in symbolic] == ["batch", "q_len"] and all(
        str(s.ty) == "int64" for s in symbolic
    )
    _assert_tensor_core(_cuda(_build(func)))


@needs_nvcc
def test_nvcc_compiles_ragged_paged_and_dense():
    ragged = flash_prefill_ragged(
        8, 32, 128, "float16", load_prefill_config("sm_90", 128)
    )
    paged = flash_prefill_paged(
        8, 32, 64, "bfloat16", 16, load_prefill_config("sm_90", 64)
    )
    dense = flash_attention_dense(
        32, 32, 64, "bfloat16", causal=True, sm_scale=0.125, layout="BHSD", additive_mask=True,
        config=load_prefill_config("sm_90", 64),
    )  # fmt: skip
    assert all(compile_cuda_concurrently((_cuda(_build(func)), "sm_90") for func in (ragged, paged, dense)))


def test_config_from_json():
    for head_dim in (64, 128):
        cfg = load_prefill_config("sm_90", head_dim)
        assert cfg.tile_q == 16 * cfg.warps and cfg.tile_kv % 16 == 0


@pytest.mark.parametrize(
    ("change", "head_dim", "field"),
    [
        ({"tile_kv": 40}, 128, "tile_kv"),  # not a multiple of the mma k step
        ({"warps": 8}, 128, "shared memory"),  # Q 128 rows + K + V > 48 KiB
        (
            {"warps": 3},
            64,
            "warps 3",
        ),  # 96 threads cannot split a 64 x 64 K tile in 16-byte loads
        ({}, 96, "head_dim"),
    ],
)
def test_bad_config_names_the_problem(change, head_dim, field):
    cfg = dataclasses.replace(PrefillConfig(warps=4, tile_kv=64), **change)
    with pytest.raises(FuselightError, match=field):
        check_config(cfg, head_dim)


def test_bad_arguments_fail_cleanly():
    cfg = load_prefill_config("sm_90", 128)
    with pytest.raises(FuselightError, match="no entry 'sm_75' and no device description"):
        load_prefill_config("sm_75", 128)
    with pytest.raises(FuselightError, match="no entry '96'"):
        load_prefill_config("sm_90", 96)
    with pytest.raises(FuselightError, match="dtype"):
        flash_prefill_ragged(8, 32, 128, "float32", cfg)
    with pytest.raises(FuselightError, match="multiple"):
        flash_prefill_ragged(5, 32, 128, "float16", cfg)
    with pytest.raises(FuselightError, match="page_size 0"):
        flash_prefill_paged(8, 32, 128, "float16", 0, cfg)
    with pytest.raises(FuselightError, match="multiple"):
        flash_prefill_paged(5, 32, 128, "float16", 16, cfg)
    with pytest.raises(FuselightError, match="layout"):
        flash_attention_dense(
            32,
            8,
            128,
            "float16",
            causal=True,
            sm_scale=1.0,
            layout="SBHD",
            additive_mask=False,
            config=cfg,
        )
