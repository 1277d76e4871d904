"""Shared test helpers: our model compiled for the CPU, once per config per session; nvcc's cache; the
sm_90 target and a rule's schedule of a function."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
from fuselight.config import ModelConfig
from fuselight.cuda_compile import compile_cuda, nvcc_path
from fuselight.library import CACHE_ENV

# A test whose point is nvcc's verdict is skipped (and counted as skipped) where nvcc is absent.
needs_nvcc = pytest.mark.skipif(nvcc_path() is None, reason="nvcc not installed")


def require_nvcc() -> str:
    """nvcc's path, or skip the test here: a test's nvcc step after its other checks is reported as a
    skip where nvcc is absent, never as a pass."""
    path = nvcc_path()
    if path is None:
        pytest.skip("nvcc not installed: the CUDA source was not compiled")
    return path


def compile_cuda_concurrently(jobs: Iterable[tuple[str, str]]) -> list[bytes]:
    """nvcc's fatbin of each ``(source, arch)``, the runs side by side (one process each, as many at
    once as there are cores: a test's nvcc runs are independent, and one run keeps one core busy);
    skips the test where nvcc is absent. ``jobs`` may be a generator that builds each source: a run
    starts as its job is yielded, while the next source is built. The first failure is raised."""
    require_nvcc()
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(lambda job: compile_cuda(*job), jobs))


@pytest.fixture(scope="session", autouse=True)
def nvcc_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The disk cache of compiled CUDA (``fuselight.library.cached_fatbin``) for this session only:
    a source compiled twice runs nvcc once, and nothing lands in the user's cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("cuda-cache")))
        yield


@pytest.fixture(scope="module")
def cuda() -> Any:
    """The TVM target of fuselight's sm_90 (H100)."""
    from fuselight.target import resolve, to_tvm

    return to_tvm(resolve("cuda", "sm_90"))


def apply_rule(rule: Any, func: Any, target: Any) -> Any:
    """``rule``'s schedule of ``func`` for ``target`` (the scheduled PrimFunc), None where it declines."""
    sch = rule.apply(func.with_attr("target", target), target, False)
    return None if sch is None else sch.mod["main"]


def compile_for_cpu(config: ModelConfig) -> tuple[Any, Any]:
    """Our model compiled for ``llvm`` with TVM's default CPU pipeline: ``(vm, device)``."""
    import tvm
    from fuselight.model.llama import export_module
    from fuselight.target import resolve, to_tvm
    from tvm import relax

    target = to_tvm(resolve("llvm"))
    mod, _ = export_module(config, target)
    executable = tvm.compile(mod, target=target, relax_pipeline=relax.get_default_pipeline(target))
    device = tvm.cpu()
    return relax.VirtualMachine(executable, device), device


@pytest.fixture(scope="session")
def cpu_model() -> Callable[[ModelConfig], tuple[Any, Any]]:
    """``cpu_model(config) -> (vm, device)``, compiling each distinct config once per session."""
    cache: dict[ModelConfig, tuple[Any, Any]] = {}

    def get(config: ModelConfig) -> tuple[Any, Any]:
        if config not in cache:
            cache[config] = compile_for_cpu(config)
        return cache[config]

    return get


def relative_error(out: Any, ref: Any) -> float:
    """``||out - ref|| / ||ref||`` in float64."""
    import numpy as np

    out, ref = np.asarray(out, dtype=np.float64).reshape(-1), np.asarray(ref, dtype=np.float64).reshape(-1)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def compare_with_reference(
    vm: Any, device: Any, config: ModelConfig, weights: dict, prompt: Any, decode_ids: list[int], **engine_args: Any
) -> list[float]:
    """Prefill ``prompt`` then decode ``decode_ids`` on our compiled model (``weights``: its
    parameters) and on the float64 reference; the relative error of each step's last-position logits."""
    import tvm
    from fuselight.engine import Engine
    from fuselight.model.weights import dequantize_weights, hf_config, to_hf_state
    from reference_llama import ReferenceLlama

    params = [tvm.runtime.tensor(w, device=device) for w in weights.values()]
    engine = Engine(vm, params, config, device, **engine_args)
    # Quantized parameters: the reference runs on the float64 weights they store.
    reference = ReferenceLlama(hf_config(config), to_hf_state(config, dequantize_weights(config, weights)))
    errors = [relative_error(engine.prefill(prompt).numpy(), reference.prefill(prompt))]
    for token in decode_ids:
        errors.append(relative_error(engine.decode(token).numpy(), reference.decode(token)))
    return errors


class FakeTensor:
    """What ``fuselight.kv_hooks`` reads of a tensor: its data pointer, shape and device (the CPU)."""

    def __init__(self, ptr: int, shape: tuple = (1, 2, 8)) -> None:
        import tvm

        self.ptr, self.shape, self.device = ptr, shape, tvm.cpu(0)

    def data_ptr(self) -> int:
        return self.ptr


# ---- work started before the first test -----------------------------------------------------------


def in_spawned_processes(fn: Callable[[Any], Any], args: Iterable[Any], workers: int) -> dict[Any, concurrent.futures.Future]:
    """``{arg: the future of fn(arg)}``, run by ``workers`` spawned processes (TVM's runtime does not
    survive a fork), started now. ``fn`` must be importable: a test module's function."""
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    runs = {arg: pool.submit(fn, arg) for arg in args}
    pool.shutdown(wait=False)
    return runs


def pytest_collection_finish(session: pytest.Session) -> None:
    """``start_in_background(alone)`` of each module with a selected test marked ``background``, before
    the first test: work of its own processes (another arch's pipeline, say) then runs on the core
    pytest leaves idle while the tests before that module run. ``alone``: no other module's tests
    were selected (the work may take every core)."""
    if session.config.option.collectonly:
        return
    modules = {item.module for item in session.items if getattr(item, "module", None) is not None}
    for module in {item.module for item in session.items if item.get_closest_marker("background")}:
        module.start_in_background(alone=len(modules) == 1)


# ---- hypothesis: a fresh seed each run, printed -------------------------------------------------------

_HYPOTHESIS_SEED: list[int] = []


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """A random ``--hypothesis-seed`` where none is given, set before hypothesis's plugin reads it:
    every run draws fresh examples, and ``pytest_terminal_summary`` prints the seed to rerun them."""
    import random

    try:
        seed = config.getoption("hypothesis_seed")
    except ValueError:  # hypothesis's plugin not loaded
        return
    if seed is None:
        seed = random.SystemRandom().randrange(2**32)
        config.option.hypothesis_seed = str(seed)
    from hypothesis import core

    core.global_force_seed = int(seed) if str(seed).isdigit() else seed
    _HYPOTHESIS_SEED[:] = [seed]


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"hypothesis seed: --hypothesis-seed={_HYPOTHESIS_SEED[0]}"] if _HYPOTHESIS_SEED else []


_SUMMARY = pytest.StashKey[list]()


@pytest.fixture
def summary_line(request: pytest.FixtureRequest) -> Callable[[str], None]:
    """``summary_line(text)``: a line for the end of the run's output, shown with ``-q`` too."""
    lines = request.config.stash.setdefault(_SUMMARY, [])
    return lambda text: lines.append(f"{request.node.name}: {text}")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in terminalreporter.config.stash.get(_SUMMARY, []):
        terminalreporter.write_line(line)
    if _HYPOTHESIS_SEED:
        terminalreporter.write_line(f"hypothesis seed: --hypothesis-seed={_HYPOTHESIS_SEED[0]} (rerun with it to reproduce)")
