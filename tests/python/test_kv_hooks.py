"""The KV cache's wrappers in C++ (``fuselight/kv_hooks.cc``) against the Python ones (``fuselight.kv_hooks``):
the same calls, on tensors that share or do not share memory, launch the same kernels with the same
arguments, in the same order; and a library built with the wrappers carries the C++ ones."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi
from fuselight import kv_hooks
from fuselight.contracts import HOOKS_DECODE_FUNC, HOOKS_FUNC

# One layer's cache calls in decode and in prefill, and stranger orders (repeated splits, views of
# other memory or shape): op, then the slots of the pool each tensor argument comes from.
SEQUENCES = [
    [("split", "qkv", "pos", "q", "k", "v"), ("append", "pages", "k", "v", "apos"), ("decode", "q", "pages", "pos")],
    [("split", "qkv", "pos", "q", "k", "v"), ("other", "q"), ("append", "pages", "k", "v", "apos")],
    [("split", "qkv", "pos", "q", "k", "v"), ("split", "qkv", "pos", "q", "k", "v"), ("append", "pages", "k", "v", "apos")],
    [("split", "qkv", "pos", "q", "k", "v"), ("append", "pages", "k_other", "v", "apos"), ("decode", "q", "pages", "pos")],
    [("split", "qkv", "pos", "q", "k", "v"), ("append", "pages", "k", "v_short", "apos"), ("decode", "q", "pages", "pos")],
    [("split", "qkv", "pos", "q", "k", "v"), ("append", "pages", "k", "v", "apos"), ("decode", "q", "pages_other", "pos")],
    [("split", "qkv", "pos", "q", "k", "v"), ("append", "pages", "k", "v", "apos"), ("other", "q"), ("decode", "q", "pages", "pos")],
    [("append", "pages", "k", "v", "apos"), ("decode", "q", "pages", "pos"), ("other", "q")],
]


def _pool() -> dict[str, tvm.runtime.Tensor]:
    """Tensors by slot; ``*_short`` is a view of the same memory with another shape."""
    rng = np.random.default_rng(5)
    shapes = {"qkv": (1, 15, 8), "pos": (1,), "q": (1, 9, 8), "k": (1, 3, 8), "v": (1, 3, 8), "pages": (4, 2, 3, 16, 8),
              "apos": (1,), "k_other": (1, 3, 8), "pages_other": (4, 2, 3, 16, 8)}
    pool = {name: tvm.runtime.tensor(rng.standard_normal(shape).astype("float32")) for name, shape in shapes.items()}
    pool["v_short"] = pool["v"]._create_view((1, 2, 8))
    return pool


def _run(factory, with_decode: bool, sequence, pool) -> list[tuple]:
    """Drive the wrappers ``factory`` returns; every launch as (kernel, arguments by slot name; a
    tensor of the wrappers' own by its dtype and contents)."""
    names = {(t.data_ptr(), tuple(t.shape)): n for n, t in pool.items()}
    launches: list[tuple] = []

    def arg(a):
        if not hasattr(a, "shape"):
            return int(a)
        return names.get((a.data_ptr(), tuple(a.shape))) or (str(a.dtype), tuple(a.numpy().tolist()))

    def kernel(name):
        def call(*args):
            launches.append((name, tuple(arg(a) for a in args)))

        return call

    fused = [kernel("fused"), kernel("fused_decode")] if with_decode else [kernel("fused")]
    inner = [kernel("split"), kernel("append")] + ([kernel("decode")] if with_decode else [])
    wrappers = list(factory(*fused, *inner, kernel("other")))
    by_op = {"split": wrappers[0], "append": wrappers[1], "decode": wrappers[2] if with_decode else None, "other": wrappers[-1]}
    for op, *slots in sequence:
        if op == "decode" and not with_decode:
            op = "other"
        args = [pool[s] for s in slots] + ([1] if op == "split" else [])
        by_op[op](*args)
    by_op["other"]()  # what is still pending runs before any other kernel
    return launches


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """The C++ factories, loaded in-process; the Python ones registered again afterwards."""
    kv_hooks.register()
    kv_hooks.load_native(tmp_path_factory.mktemp("kv_hooks"))
    found = {name: tvm_ffi.get_global_func(name) for name in (HOOKS_FUNC, HOOKS_DECODE_FUNC)}
    yield found
    tvm_ffi.register_global_func(HOOKS_FUNC, kv_hooks.make_wrappers, override=True)
    tvm_ffi.register_global_func(HOOKS_DECODE_FUNC, kv_hooks.make_decode_wrappers, override=True)


@pytest.mark.parametrize("with_decode", [False, True])
@pytest.mark.parametrize("index", range(len(SEQUENCES)))
def test_native_wrappers_launch_what_the_python_ones_do(native, with_decode, index):
    pool = _pool()
    python = kv_hooks.make_decode_wrappers if with_decode else kv_hooks.make_wrappers
    expected = _run(python, with_decode, SEQUENCES[index], pool)
    got = _run(native[HOOKS_DECODE_FUNC if with_decode else HOOKS_FUNC], with_decode, SEQUENCES[index], pool)
    assert got == expected
    assert expected  # every sequence launches something


def test_decode_layer_is_one_fused_launch(native):
    pool = _pool()
    launches = _run(native[HOOKS_DECODE_FUNC], True, SEQUENCES[0], pool)
    # the split's arguments, the append's pages and positions, the attention's own after q and pages,
    # then the counters: zero, one for each of the cache's 4 pages x 3 KV heads
    counters = ("int32", (0,) * 12)
    assert launches == [("fused_decode", ("qkv", "pos", "q", "k", "v", 1, "pages", "apos", "pos", counters)), ("other", ())]


def test_only_libraries_whose_cache_takes_the_wrappers_carry_them():
    class Executable:
        def __init__(self, text: str) -> None:
            self.text = text

        def as_text(self) -> str:
            return self.text

    assert kv_hooks.uses_hooks(Executable(f'call "{HOOKS_DECODE_FUNC}" ...'))
    assert not kv_hooks.uses_hooks(Executable('call "vm.builtin.paged_attention_kv_cache_create" ...'))


@pytest.mark.slow
def test_exported_library_decodes_with_the_native_wrappers(tmp_path):
    """Our tiny LLaMA built with the wrappers and exported: it carries the C++ ones, a decode step
    calls no Python wrapper, and its logits match the float64 reference."""
    import sys

    from conftest import compare_with_reference
    from fuselight import compile as fc
    from fuselight import config, runtime
    from fuselight.model.weights import random_weights
    from fuselight.target import resolve

    cfg = config.load("tiny-llama")
    lib = fc.export(fc.build(cfg, resolve("llvm"), "fuselight"), tmp_path / "tiny.so")
    vm, dev, meta = runtime.load_library(lib, "cpu")
    assert meta["native_kv_hooks"] is True
    python_calls = []

    def profile(frame, event, _arg):
        if event == "call" and frame.f_code.co_filename == kv_hooks.__file__:
            python_calls.append(frame.f_code.co_name)

    rng = np.random.default_rng(11)
    sys.setprofile(profile)
    try:
        errors = compare_with_reference(
            vm, dev, cfg, random_weights(cfg, seed=11), rng.integers(0, cfg.vocab_size, 21), [3, 500, 7],
            max_total_seq_len=64, prefill_chunk_size=16,
        )
    finally:
        sys.setprofile(None)
    assert max(errors) < 1e-4, errors
    assert [c for c in python_calls if c != "register"] == []


def test_native_object_is_compiled_once_per_source_into_the_cache(tmp_path, monkeypatch):
    compiled: list[tuple[str, ...]] = []
    compile_ = kv_hooks._compile

    def counted(out, *flags):
        compiled.append(flags)
        return compile_(out, *flags)

    monkeypatch.setattr(kv_hooks, "_compile", counted)
    first = kv_hooks.native_object(tmp_path)
    again = kv_hooks.native_object(tmp_path)
    assert compiled == [("-c",)] and again == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left
    assert first.read_bytes()[:4] == b"\x7fELF"
