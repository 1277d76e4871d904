"""``fuselight mlc compile ...``: MLC-LLM's ``mlc_llm compile`` with fuselight in its pipeline.

Every argument but ours goes to MLC's compile command unchanged. Ours:

- ``--fuselight-passes a,b`` graph passes (``none``: no passes; default ``fuselight.passes.DEFAULT``);
- ``--fuselight-rules fam,...`` rule families (``none``: DLight's rules alone; default all);
- ``--fuselight-dump DIR`` the module after each of our steps and ``schedule.json``;
- ``--fuselight-no-programmatic-launch`` each kernel of a ``.so`` launched only after the one before it has finished
  (but those that wait for it by design: the decode attention's merge kernel, o_proj's prefetching GEMV);
- ``--no-fuselight`` MLC's own pipeline (the baseline), with the same target handling and output;
- ``--fuselight-ptx`` (either pipeline) a ``.so``'s CUDA carried as PTX for the target's arch
  (``fuselight compile --ptx``).

Two platform adjustments to MLC's command: the "thrust" library MLC adds to CUDA targets is left out
where TVM was built without it (TVM would only warn and fall back), and a ``.so`` output for a CUDA
or llvm target is written by ``fuselight.library.write_library``: the library, a metadata sidecar
(pipeline ``mlc`` or ``mlc+fuselight``, MLC's version) and, for CUDA, cubins compiled ahead of time,
so ``fuselight.runtime.load_library`` runs it on a host with the TVM runtime alone.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..bench.results import MLC_IMPLS
from ..errors import FuselightError
from . import SOURCE_ENV, describe, import_mlc_llm, import_mlc_module

MLC_COMPILE_MODULE = "mlc_llm.cli.compile"
TARGET_DETECTION = "detect_target_and_host"
# What the library's sidecar calls its pipeline: the results' impl names.
PIPELINE_MLC, PIPELINE_MLC_FUSELIGHT = MLC_IMPLS
_LIBRARY_SUFFIX = ".so"
_THRUST = "thrust"
_THRUST_FUNC = "tvm.contrib.thrust.sort"


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Our options, and the arguments left for ``mlc_llm compile``."""
    p = argparse.ArgumentParser(prog="fuselight mlc compile", add_help=False)
    p.add_argument("--fuselight-passes", default=None)
    p.add_argument("--fuselight-rules", default=None)
    p.add_argument("--fuselight-dump", default=None)
    p.add_argument("--fuselight-no-programmatic-launch", action="store_true")
    p.add_argument("--no-fuselight", action="store_true")
    # With or without fuselight: the library's CUDA carried as PTX for the target's arch.
    p.add_argument("--fuselight-ptx", action="store_true")
    return p.parse_known_args(list(argv))


def _names(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    return tuple(name for name in text.split(",") if name and name != "none")


def options_from_args(ours: argparse.Namespace) -> Any:
    """``fuselight.options.Options`` from our parsed flags (None with ``--no-fuselight``)."""
    from ..options import Options

    if ours.no_fuselight:
        given = [f for f in ("fuselight_passes", "fuselight_rules", "fuselight_dump") if getattr(ours, f) is not None]
        if ours.fuselight_no_programmatic_launch:
            given.append("fuselight_no_programmatic_launch")
        if given:
            raise FuselightError(f"--no-fuselight with --{given[0].replace('_', '-')}: pick one")
        return None
    options = Options(
        passes=_names(ours.fuselight_passes),
        rules=_names(ours.fuselight_rules),
        dump=Path(ours.fuselight_dump) if ours.fuselight_dump else None,
        programmatic_launch=not ours.fuselight_no_programmatic_launch,
    )
    options.check_without_fuselight_runtime()
    return options


def compile_main(argv: Sequence[str]) -> int:
    """Run MLC-LLM's compile command on ``argv`` (ours taken out) with fuselight enabled or not."""
    ours, forwarded = parse_args(argv)
    if import_mlc_llm() is None:
        raise FuselightError(
            f"MLC-LLM is not available: install mlc_llm or set {SOURCE_ENV} to an MLC-LLM source checkout"
        )
    options = options_from_args(ours)
    from . import pipeline

    command = import_mlc_module(MLC_COMPILE_MODULE)
    detect = getattr(command, TARGET_DETECTION, None)
    if detect is None or not callable(getattr(command, "main", None)):
        raise FuselightError(f"this MLC-LLM's {MLC_COMPILE_MODULE} lacks main or {TARGET_DETECTION}")
    name = PIPELINE_MLC if options is None else PIPELINE_MLC_FUSELIGHT
    setattr(command, TARGET_DETECTION, _adjusted_detection(detect, name, options, ours.fuselight_ptx))
    try:
        if options is None:
            pipeline.disable()
            command.main(forwarded)
        else:
            with pipeline.enabled(options):
                command.main(forwarded)
    finally:
        setattr(command, TARGET_DETECTION, detect)
    return 0


def _adjusted_detection(
    detect: Callable[..., Any], name: str, options: Any, ptx: bool = False
) -> Callable[..., Any]:
    def detect_target_and_host(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        target, build_func = detect(*args, **kwargs)
        target = without_missing_thrust(target)
        return target, _library_build(build_func, name, options, ptx)

    return detect_target_and_host


def without_missing_thrust(target: Any) -> Any:
    """``target`` without "thrust" in its libs when TVM was built without thrust."""
    import tvm

    libs = list(target.attrs.get("libs", []) or [])
    if _THRUST not in libs or tvm.get_global_func(_THRUST_FUNC, allow_missing=True) is not None:
        return target
    exported = dict(target.export())
    exported["libs"] = [lib for lib in libs if lib != _THRUST]
    if not exported["libs"]:
        del exported["libs"]
    return tvm.target.Target(exported)


def _library_build(mlc_build: Callable[..., Any], name: str, options: Any, ptx: bool = False) -> Callable[..., Any]:
    """MLC's build function, or for a ``.so`` on cuda/llvm ours: library, sidecar and AOT cubins
    (``ptx``: the arch's PTX, ``fuselight.target.resolve``)."""

    def build(mod: Any, args: Any, pipeline: Any = None) -> None:
        kind = args.target.kind.name
        if Path(args.output).suffix != _LIBRARY_SUFFIX or kind not in ("cuda", "llvm"):
            mlc_build(mod, args, pipeline=pipeline)
            return
        from tvm import relax

        from .. import tir_pipeline
        from ..compile import library_metadata
        from ..library import write_library
        from ..target import arch_of, resolve

        spec = resolve(kind, arch_of(args.target) if kind == "cuda" else None, ptx=ptx)
        # MLC's own build (no options) launches its kernels as MLC does.
        every_kernel = (options is not None and options.programmatic_launch
                        and tir_pipeline.programmatic_launch_supported(kind, spec.arch))
        executable = relax.build(
            mod, target=args.target, relax_pipeline=pipeline,
            tir_pipeline=tir_pipeline.register(every_kernel, parallel=options is not None),
            system_lib=False,
        )
        extra: dict[str, Any] = {
            "mlc_model_type": args.model.name,
            "quantization": args.quantization.name,
            # The sizes MLC leaves symbolic in the parameter list (vocab_size) are fixed here.
            "mlc_model_config": _plain_fields(args.config),
        }
        if options is not None:
            extra["fuselight"] = options.describe(fuselight_runtime=False)
        meta = library_metadata(spec, name, describe(import_mlc_llm()), **extra)
        write_library(executable, Path(args.output), meta, spec)

    return build


def _plain_fields(config: Any) -> dict[str, Any]:
    """The model config's number, string and boolean fields (MLC's configs are dataclasses)."""
    fields = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(vars(config))
    return {k: v for k, v in fields.items() if isinstance(v, (bool, int, float, str))}
