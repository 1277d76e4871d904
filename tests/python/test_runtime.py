"""Runtime side: the CUDA compile callback's lookup order, library metadata checks, loading, AOT CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import needs_nvcc
from fuselight import library, runtime
from fuselight.library import aot_dir, metadata_path
from fuselight.errors import FuselightError

# A CUDA fatbin starts with this magic number (0xBA55ED50, little-endian).
FATBIN_MAGIC = b"\x50\xed\x55\xba"


@pytest.fixture
def callback_state(tmp_path, monkeypatch):
    """A fresh callback state with its disk cache under tmp_path; the callback registered."""
    monkeypatch.setattr(runtime, "_STATE", runtime._CompilerState())
    runtime.register_cuda_compiler(cache_dir=tmp_path / "cache", arch="sm_90")
    return runtime._STATE


def _library_with_cubin(
    tmp_path: Path, source: str, binary: bytes, arch: str = "sm_90", *, ptx: bool = False
) -> tuple[Path, dict]:
    lib = tmp_path / "lib.so"
    lib.write_bytes(b"not loaded in this test")
    sha = runtime.source_hash(source)
    aot_dir(lib).mkdir()
    (aot_dir(lib) / f"{sha}.fatbin").write_bytes(binary)
    meta = {"target": "cuda", "arch": arch, "ptx": ptx, "cuda_sources": {sha: f"{sha}.fatbin"}}
    metadata_path(lib).write_text(json.dumps(meta))
    return lib, meta


def _call_registered(code: str) -> bytes:
    import tvm_ffi

    return bytes(tvm_ffi.get_global_func(runtime.CALLBACK_NAME)(code))


def test_callback_prefers_aot_cubin_over_cache(tmp_path, callback_state):
    source = 'extern "C" __global__ void add_one(float* x) { x[threadIdx.x] += 1.0f; }\n'
    lib, _ = _library_with_cubin(tmp_path, source, b"AOT-FATBIN")
    cache = callback_state.cache_dir / f"{runtime.source_hash(source)}-sm_90.fatbin"
    cache.parent.mkdir(parents=True)
    cache.write_bytes(b"CACHED-FATBIN")
    runtime.register_aot(lib, runtime.read_metadata(lib))
    # Through TVM's FFI, as the CUDA module loader calls it.
    assert _call_registered(source) == b"AOT-FATBIN"
    # Another source (one character differs) is not the AOT one: the cache answers it by its own hash.
    other = source.replace("1.0f", "2.0f")
    other_cache = callback_state.cache_dir / f"{runtime.source_hash(other)}-sm_90.fatbin"
    other_cache.write_bytes(b"OTHER-CACHED")
    assert _call_registered(other) == b"OTHER-CACHED"


def test_cached_fatbin_runs_nvcc_once_per_source_and_arch(tmp_path, monkeypatch):
    compiled = []

    def fake_nvcc(code, arch="sm_90", ptx=False):
        compiled.append((code, arch, ptx))
        return f"{arch}{'-ptx' if ptx else ''}:{len(code)}".encode()

    monkeypatch.setattr(library, "compile_cuda", fake_nvcc)
    source = "__global__ void k(float* x) { x[threadIdx.x] *= 3.0f; }\n"
    cache = tmp_path / "cache"
    assert library.cached_fatbin(source, "sm_90", cache) == b"sm_90:56"
    assert library.cache_path(runtime.source_hash(source), "sm_90", cache).read_bytes() == b"sm_90:56"
    # The same source again (a rebuild whose kernels did not change): no nvcc.
    assert library.cached_fatbin(source, "sm_90", cache) == b"sm_90:56"
    assert compiled == [(source, "sm_90", False)]
    # Another arch, another source or the arch's PTX is compiled, and cached apart.
    assert library.cached_fatbin(source, "sm_80", cache) == b"sm_80:56"
    assert library.cached_fatbin(source + " ", "sm_90", cache) == b"sm_90:57"
    assert library.cached_fatbin(source, "sm_80", cache, ptx=True) == b"sm_80-ptx:56"
    assert library.cached_fatbin(source, "sm_80", cache, ptx=True) == b"sm_80-ptx:56"
    assert len(compiled) == 4 and compiled[-1] == (source, "sm_80", True)
    assert sorted(p.name.endswith(".fatbin") for p in cache.iterdir()) == [True] * 4


def test_callback_without_cubin_or_nvcc_fails_clearly(tmp_path, callback_state, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(FuselightError, match="no precompiled cubin .* nvcc is not on PATH"):
        runtime.cuda_binary("__global__ void k() {}\n")
    # Through the FFI it arrives as a RuntimeError; the message is kept for load_library's one line.
    with pytest.raises(RuntimeError, match="nvcc is not on PATH"):
        _call_registered("__global__ void k2() {}\n")
    assert "nvcc is not on PATH" in callback_state.error


def test_register_aot_requires_the_listed_cubins(tmp_path, callback_state):
    lib, meta = _library_with_cubin(tmp_path, "__global__ void k() {}\n", b"X")
    for f in aot_dir(lib).iterdir():
        f.unlink()
    with pytest.raises(FuselightError, match="precompiled CUDA .* missing"):
        runtime.register_aot(lib, meta)


def test_arch_mismatch_is_refused(tmp_path, callback_state, monkeypatch):
    lib, _ = _library_with_cubin(tmp_path, "__global__ void k() {}\n", b"X", arch="sm_80")
    monkeypatch.setattr(runtime, "device_arch", lambda dev=None: "sm_90")
    with pytest.raises(FuselightError, match="library built for sm_80, this GPU is sm_90"):
        runtime.load_library(lib, "cuda")
    runtime.check_arch("sm_90a", "sm_90")  # the arch-specific suffix names the same GPU
    with pytest.raises(FuselightError, match="unsupported arch"):
        runtime.check_arch("compute_90", "sm_90")


def test_ptx_library_of_another_arch_is_refused_unless_asked(tmp_path, callback_state, monkeypatch):
    lib, _ = _library_with_cubin(tmp_path, "__global__ void k() {}\n", b"PTX-FATBIN", arch="sm_80", ptx=True)
    monkeypatch.setattr(runtime, "device_arch", lambda dev=None: "sm_90")
    with pytest.raises(FuselightError) as err:
        runtime.load_library(lib, "cuda")
    # One line that says what was built, what this GPU is, and what may run here when asked.
    assert "\n" not in str(err.value)
    assert "library built for sm_80 PTX, this GPU is sm_90 (only a PTX build for an arch <= sm_90" in str(err.value)
    assert "accept_ptx=True" in str(err.value) and runtime.ACCEPT_PTX_ENV in str(err.value)
    # Machine code of another arch never runs, asked or not; PTX only on its arch or a newer one.
    runtime.check_arch("sm_80", "sm_90", ptx=True, accept_ptx=True)
    runtime.check_arch("sm_89", "sm_89", ptx=True)  # its own GPU: nothing to accept
    for built, device, ptx in (("sm_80", "sm_90", False), ("sm_89", "sm_86", True), ("sm_90", "sm_100", True)):
        with pytest.raises(FuselightError, match=f"library built for {built}.*this GPU is {device}"):
            runtime.check_arch(built, device, ptx=ptx, accept_ptx=True)


def test_ptx_library_accepted_when_asked(tmp_path, callback_state, monkeypatch):
    """Accepted, the library's PTX is what the loader's callback returns (the driver compiles it)."""
    import tvm

    source = 'extern "C" __global__ void k(float* x) { x[0] = 1.0f; }\n'
    lib, _ = _library_with_cubin(tmp_path, source, b"SM80-PTX-FATBIN", arch="sm_80", ptx=True)
    monkeypatch.setattr(runtime, "device_arch", lambda dev=None: "sm_90")
    loaded = []

    def load_module(path: str):  # as TVM's CUDA module loader: the source through the callback
        loaded.append(_call_registered(source))
        return "module"

    monkeypatch.setattr(tvm.runtime, "load_module", load_module)
    module, _, meta = runtime.load_module(lib, "cuda", accept_ptx=True)
    assert (module, meta["arch"], meta["ptx"], loaded) == ("module", "sm_80", True, [b"SM80-PTX-FATBIN"])
    # A source without a fatbin is compiled as the library was built: sm_80 PTX, cached under that name.
    other = source.replace("1.0f", "2.0f")
    cache = callback_state.cache_dir / f"{runtime.source_hash(other)}-sm_80-ptx.fatbin"
    cache.parent.mkdir(parents=True)
    cache.write_bytes(b"CACHED-SM80-PTX")
    (callback_state.cache_dir / f"{runtime.source_hash(other)}-sm_80.fatbin").write_bytes(b"CACHED-SM80-SASS")
    assert (callback_state.arch, callback_state.ptx) == ("sm_80", True)
    assert _call_registered(other) == b"CACHED-SM80-PTX"


def test_accept_ptx_from_environment(monkeypatch):
    monkeypatch.delenv(runtime.ACCEPT_PTX_ENV, raising=False)
    assert runtime.accept_ptx_from_env() is False
    monkeypatch.setenv(runtime.ACCEPT_PTX_ENV, "0")
    assert runtime.accept_ptx_from_env() is False
    monkeypatch.setenv(runtime.ACCEPT_PTX_ENV, "1")
    assert runtime.accept_ptx_from_env() is True


def test_metadata_errors_name_the_problem(tmp_path):
    lib = tmp_path / "model.so"
    lib.write_bytes(b"")
    with pytest.raises(FuselightError, match="model.so.json not found"):
        runtime.load_library(lib, "cpu")
    metadata_path(lib).write_text("{not json")
    with pytest.raises(FuselightError, match="not valid JSON"):
        runtime.read_metadata(lib)
    metadata_path(lib).write_text(json.dumps({"target": "rocm"}))
    with pytest.raises(FuselightError, match="field 'target' 'rocm'"):
        runtime.read_metadata(lib)
    metadata_path(lib).write_text(json.dumps({"target": "cuda", "arch": "sm_90", "ptx": "yes"}))
    with pytest.raises(FuselightError, match="field 'ptx' must be true or false"):
        runtime.read_metadata(lib)
    metadata_path(lib).write_text(json.dumps({"target": "cuda", "arch": "sm_90", "cuda_sources": {}}))
    with pytest.raises(FuselightError, match="target 'cuda' cannot run on device 'cpu'"):
        runtime.load_library(lib, "cpu")
    with pytest.raises(FuselightError, match="library not found"):
        runtime.load_library(tmp_path / "missing.so", "cpu")


def test_gpu_host_modules_import_without_tvm_compiler_or_torch():
    code = (
        "import sys\n"
        "import fuselight.runtime, fuselight.bench.timing, fuselight.bench.e2e, fuselight.bench.kernels\n"
        "import fuselight.bench.kernels_run, fuselight.bench.results, fuselight.report\n"
        "bad = [m for m in sys.modules if m.startswith(('tvm.relax', 'torch', 'transformers', 'matplotlib'))]\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr


def test_llvm_library_loads_and_runs(tmp_path):
    from fuselight.bench.kernels import load_suite
    from fuselight.bench.kernels_build import export_case
    from fuselight.target import resolve

    case = load_suite("small", ["rmsnorm-64"])[0]
    lib = export_case(case, "baseline", resolve("llvm"), tmp_path)
    vm, dev, meta = runtime.load_library(lib, "cpu")
    assert meta["target"] == "llvm" and meta["case"]["name"] == "rmsnorm-64"
    import tvm

    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 64)).astype("float16")
    w = (1 + 0.1 * rng.standard_normal(64)).astype("float16")
    out = vm["main"](tvm.runtime.tensor(x, dev), tvm.runtime.tensor(w, dev)).numpy()
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + case.attrs["eps"]) * w
    np.testing.assert_allclose(out, ref, rtol=5e-3, atol=5e-3)


@needs_nvcc
def test_cuda_case_compiled_ahead_of_time(tmp_path, callback_state):
    from fuselight.bench.kernels import load_suite
    from fuselight.bench.kernels_build import compile_case, export_case
    from fuselight.target import resolve

    case = load_suite("small", ["gemm-48x64"])[0]
    spec = resolve("cuda", "sm_90")
    lib = export_case(case, "fuselight", spec, tmp_path)
    meta = runtime.read_metadata(lib)
    assert meta["arch"] == "sm_90" and meta["pipeline"] == "fuselight" and meta["cuda_sources"]
    sources = runtime.cuda_sources(compile_case(case, "fuselight", spec))
    # The build is deterministic: the source hashes of a rebuild are the ones the metadata lists.
    assert {runtime.source_hash(s) for s in sources} == set(meta["cuda_sources"])
    for name in meta["cuda_sources"].values():
        assert (aot_dir(lib) / name).read_bytes()[:4] == FATBIN_MAGIC
    runtime.register_aot(lib, meta)
    for code in sources:
        assert _call_registered(code) == (aot_dir(lib) / meta["cuda_sources"][runtime.source_hash(code)]).read_bytes()
