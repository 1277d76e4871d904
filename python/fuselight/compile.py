"""Compile our LLaMA model with a named pipeline into a library and its metadata sidecar.

The sidecar ``LIB.json`` records what the runtime must know before loading (target, arch, model
config, pipeline, baseline source, versions) and, for CUDA, the ahead-of-time cubins in
``LIB.cuda/`` keyed by the hash of each CUDA source, so the GPU host needs no compiler.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import tir_pipeline
from .config import ModelConfig
from .contracts import ATTENTION_BUILTIN, ATTENTION_FORWARD_FUNC
from .contracts import FUSED_ROPE_APPEND_ATTR as FUSED_ATTR
from .contracts import FUSED_ROPE_APPEND_DECODE_ATTR as FUSED_DECODE_ATTR
from .contracts import KERNEL_LAUNCHES_ATTR
from .device import device_model
from .errors import FuselightError
from .library import git_commit, write_library
from .options import Options
from .target import TargetSpec

PIPELINES = ("baseline", "fuselight")
# What a fuselight build for an arch without a device description says (once).
UNDESCRIBED = ("{arch}: no device description in configs/targets/devices.json: fuselight's passes and rules "
               "are off, DLight schedules every kernel")
# TVM's paged KV cache launches these kernels for one decode attention call of one layer besides the
# attention kernel itself: q/k rotary split, K/V append into pages.
# The KV cache's own kernels around each attention call: split-rotary and append (TVM's), or one
# where fuselight.passes.fuse_rope_append gave it the fused kernel.
KV_CACHE_KERNELS_PER_DECODE_ATTENTION = 2
# A kernel PrimFunc that launches more than one kernel says how many in this attribute.
# Format of a library's metadata sidecar.
METADATA_FORMAT = 1
# The builtin that replays (or captures) a CUDA graph of a capture function.
_CUDA_GRAPH_BUILTIN = "vm.builtin.cuda_graph.run_or_capture"
# The graph pass that lets one CUDA graph hold a decode step (passes.capture_whole_step); named, it
# runs only where the build captures graphs.
WHOLE_STEP_PASS = "capture_whole_step"
# The pass config RewriteCUDAGraph reads.
CUDA_GRAPH_CONFIG = "relax.backend.use_cuda_graph"
# The fuselight pipeline's kernel launches in a decode step (``kernel_stats``; tests/python/test_compile.py
# keeps these true): a layer's, float and 4-bit weights (the same fusions: the dequantize goes
# into the norm's GEMV and the gate+up SiLU kernel), and those outside the layers (the final norm
# and the LM head).
DECODE_LAUNCHES_PER_LAYER = {"float": 6, "quantized": 6}
DECODE_LAUNCHES_OUTSIDE_LAYERS = 2


@dataclasses.dataclass(frozen=True)
class KernelStats:
    """Static counts from the module as the pipeline leaves it (before code generation)."""

    kernels: int  # PrimFuncs the module carries
    launches_per_decode_step: int  # PrimFunc calls in `decode` + the paged KV cache's kernels
    decode_kernels: tuple[str, ...]  # PrimFuncs `decode` calls, in call order (repeats kept)


@dataclasses.dataclass
class Built:
    config: ModelConfig
    target: TargetSpec
    pipeline: str
    executable: Any  # tvm.relax.VMExecutable
    stats: KernelStats
    compile_seconds: float
    param_names: list[str]
    prefill_chunk_size: int
    baseline_source: str  # where the baseline passes came from when this was built
    options: Options | None = None  # the fuselight pipeline's passes and rules (None: baseline)
    cuda_graph: bool = False  # static parts captured and replayed as CUDA graphs


def pipeline_pass(
    name: str, tvm_target: Any, variable_bounds: Mapping[str, int], options: Options | None = None
) -> Any:
    """The pipeline ``name`` (one of ``PIPELINES``) for ``tvm_target``, a ``tvm.transform.Pass``.

    variable_bounds: upper bounds of symbolic dims by name, so memory is planned statically.
    options: the fuselight pipeline's passes and rules (the baseline takes none).
    """
    if name not in PIPELINES:
        raise FuselightError(f"unknown pipeline {name!r}: expected one of {', '.join(PIPELINES)}")
    from . import pipeline as pl
    from .rules import fuselight_rules

    if name == "baseline":
        if options is not None and options != Options():
            raise FuselightError("the baseline pipeline takes no fuselight passes or rules options")
        return pl.baseline_pipeline(tvm_target, variable_bounds=dict(variable_bounds))
    options = options or Options()
    return pl.fuselight_pipeline(
        tvm_target, passes=options.graph_passes(), rules=fuselight_rules(options.rules),
        variable_bounds=dict(variable_bounds),
    )


def lower(
    mod: Any, tvm_target: Any, pipeline: Any, *, cuda_graph: bool = False, programmatic_launch: bool = False,
    parallel: bool = False,
) -> tuple[Any, Any]:
    """Run the ``pipeline`` pass over ``mod`` under ``tvm_target`` and compile the result.

    cuda_graph: let RewriteCUDAGraph capture the static parts of each function (as MLC-LLM's
    default optimisation level does for CUDA): replayed as CUDA graphs, their kernels cost no
    host launch each.
    programmatic_launch: every kernel may launch while the one before it finishes
    (``tir_pipeline.NAME_EVERY_KERNEL``; ignored where the target does not support it).
    parallel: lower over the host's cores and compile the CUDA in several units (``tir_pipeline.register``).
    Returns the lowered IRModule and its ``tvm.relax.VMExecutable``.
    """
    import tvm

    every_kernel = programmatic_launch and tir_pipeline.programmatic_launch_supported(
        tvm_target.kind.name, str(tvm_target.attrs.get("arch", "")) or None
    )
    with tvm.transform.PassContext(config={CUDA_GRAPH_CONFIG: cuda_graph}), tvm_target:
        lowered = pipeline(mod)
    return lowered, tvm.compile(
        lowered, target=tvm_target, relax_pipeline=None, tir_pipeline=tir_pipeline.register(every_kernel, parallel)
    )


def graphs_by_default(target: TargetSpec, programmatic_launch: bool, config: ModelConfig | None = None) -> bool:
    """Whether a build for ``target`` captures CUDA graphs without programmatic launch when not told
    (``build`` then adds the whole-step graph where the default passes run, with programmatic launch
    inside it where this says no: the GPU sets the pace).

    On CUDA, graphs unless every kernel launches programmatically there
    (``tir_pipeline.NAME_EVERY_KERNEL``): a graph ends at each call it leaves out, the KV cache's
    attention in every layer, and the kernel after a graph or after such a call then starts only
    when the one before has finished (2.4-2.6 us idle at each of the two boundaries a layer on an
    H100: about 160 us a decode step, ``docs/experiments/without-cuda-graphs.md``), while kernels launched one by
    one from the stream each overlap the one before. Launched one by one, though, the host sets the
    pace where it launches a step's kernels more slowly than the GPU runs them: so with
    programmatic launch, graphs exactly when the host's time to launch ``config``'s decode step
    (``DECODE_LAUNCHES_PER_LAYER`` a layer, at the device's ``host_launch_us`` each;
    ``fuselight.device``) exceeds ``decode_graph_factor`` (``configs/runtime.json``) times the
    step's weight-streaming floor (``num_weight_bytes(decode=True)`` at the device's DRAM rate): the
    factor allows for kernels streaming below the copy rate. Measured on the H100
    (docs/experiments/decode-form.md), greedy generation at context 128 without / with graphs:
    SmolLM2-135M (launches ~12x the floor) 1.26 / 0.83 ms/token; Llama-3.2-1B (0.7x) 1.05 / 1.13;
    Llama-3-8B q4f16_1 (1.2x) 2.51 / 2.60. Those graphs ended at every attention call; the whole
    step in one graph with programmatic launch inside it generates within 2% of kernels one by one
    (Llama-3.2-1B 1.055 / 1.050-1.055, Llama-3-8B fp16 5.27 / 5.26, q4f16_1 2.19 / 2.23, q4f16_0
    2.43 / 2.38) with one host launch a step, so ``build`` takes it where the GPU sets the pace."""
    if target.kind != "cuda":
        return False
    if not (programmatic_launch and tir_pipeline.programmatic_launch_supported(target.kind, target.arch)):
        return True
    from .engine import runtime_config  # as build() does: engine imports the compiled model's weights

    device = device_model(target.arch)
    if config is None or device is None:
        return False
    per_layer = DECODE_LAUNCHES_PER_LAYER["quantized" if config.quantization else "float"]
    launches_us = (per_layer * config.num_hidden_layers + DECODE_LAUNCHES_OUTSIDE_LAYERS) * device.host_launch_us
    weights_us = config.num_weight_bytes(decode=True) / (device.dram_gbps * 1e3)
    return launches_us > float(runtime_config()["decode_graph_factor"]) * weights_us


def kv_cache_kernels(mod: Any) -> int:
    """The KV cache's kernels around one decode attention call besides attention (see the constants):
    1 with the fused RoPE + append kernel, none where decode attention does that work too."""
    from tvm import tirx

    attrs = [f.attrs for f in mod.functions.values() if isinstance(f, tirx.PrimFunc) and f.attrs is not None]
    if any(FUSED_DECODE_ATTR in a for a in attrs):
        return 0
    return 1 if any(FUSED_ATTR in a for a in attrs) else KV_CACHE_KERNELS_PER_DECODE_ATTENTION


def _decode_attention_launches(mod: Any) -> int:
    """Launches of the decode attention kernel a decode step of the module's KV cache runs: the fused
    RoPE + append + decode kernel where the cache has one (its wrappers launch it, not the plain
    decode kernel beside it), else the decode kernel (1 if it says nothing)."""
    from tvm import tirx

    found = [func for gv, func in mod.functions.items()
             if isinstance(func, tirx.PrimFunc) and "decode_paged_kv" in gv.name_hint and "sliding" not in gv.name_hint
             and func.attrs is not None and KERNEL_LAUNCHES_ATTR in func.attrs]
    found.sort(key=lambda func: FUSED_DECODE_ATTR not in func.attrs)  # the fused kernel first
    return int(found[0].attrs[KERNEL_LAUNCHES_ATTR]) if found else 1


def kernel_stats(mod: Any) -> KernelStats:
    """Count PrimFuncs and the kernel launches one call of ``decode`` makes."""
    import tvm
    from tvm import relax, tirx

    prims = {gv: f for gv, f in mod.functions.items() if isinstance(f, tirx.PrimFunc)}
    calls: list[str] = []
    attention_calls = 0

    # After CallTIRRewrite a kernel call is a Call whose op is the PrimFunc's GlobalVar, and the
    # KV cache's attention is a Call of an ExternFunc. With CUDA graphs, a run of kernels moves into
    # a capture function that ``decode`` hands to the graph builtin: its kernels count where it runs.
    def visit(expr: Any) -> None:
        nonlocal attention_calls
        if not isinstance(expr, relax.Call):
            return
        if isinstance(expr.op, relax.GlobalVar) and expr.op in prims:
            calls.append(expr.op.name_hint)
        elif isinstance(expr.op, relax.ExternFunc) and expr.op.global_symbol in (ATTENTION_BUILTIN, ATTENTION_FORWARD_FUNC):
            attention_calls += 1
        elif (
            expr.op.same_as(tvm.ir.Op.get("relax.call_builtin_with_ctx"))
            and isinstance(expr.args[0], relax.ExternFunc)
            and expr.args[0].global_symbol == _CUDA_GRAPH_BUILTIN
        ):
            relax.analysis.post_order_visit(mod[expr.args[1].fields[0]], visit)

    decode = next((f for gv, f in mod.functions.items() if gv.name_hint == "decode"), None)
    if decode is None:
        raise FuselightError("module has no 'decode' function")
    relax.analysis.post_order_visit(decode, visit)
    return KernelStats(
        kernels=len(prims),
        launches_per_decode_step=len(calls)
        + (kv_cache_kernels(mod) + _decode_attention_launches(mod)) * attention_calls,
        decode_kernels=tuple(calls),
    )


def effective_options(target: TargetSpec, pipeline: str, options: Options | None) -> Options | None:
    """``options``, except for a fuselight build for an arch without a device description: none of our
    passes or rules (nothing would claim a kernel there) and no programmatic launch (``UNDESCRIBED``)."""
    if pipeline == "fuselight" and not target.described:
        return Options(passes=(), rules=(), programmatic_launch=False)
    return options


def build(
    config: ModelConfig,
    target: TargetSpec,
    pipeline: str,
    *,
    prefill_chunk_size: int | None = None,
    options: Options | None = None,
    cuda_graph: bool | None = None,
) -> Built:
    """Export our model for ``target``, run ``pipeline`` (with ``options``) over it, and compile.

    Prefills longer than ``prefill_chunk_size`` tokens (default: ``configs/runtime.json``) are run
    in chunks by the engine. A fuselight build for an arch without a device description runs no
    passes or rules of ours (``UNDESCRIBED``). ``cuda_graph`` captures the static parts of each function as CUDA
    graphs; None: on for CUDA (as in MLC-LLM's default ``O2``). With fuselight's default passes the
    whole decode step is then one graph (``capture_whole_step``), kernels in it launching
    programmatically unless the host would set the pace (``graphs_by_default``); with passes of the
    caller's choosing, graphs only where ``graphs_by_default`` chooses them (then without
    programmatic launch), else kernels launched one by one.
    """
    from .engine import runtime_config
    from .model.llama import export_module
    from .pipeline import baseline_source
    from .target import to_tvm

    if prefill_chunk_size is None:
        prefill_chunk_size = int(runtime_config()["prefill_chunk_size"])
    options = effective_options(target, pipeline, options)
    source = baseline_source()
    tvm_target = to_tvm(target)
    start = time.perf_counter()
    if cuda_graph and target.kind != "cuda":
        raise FuselightError(f"CUDA graphs need a cuda target, not {target.kind!r}")
    # The baseline launches its kernels as MLC-LLM's builds do.
    pdl = pipeline != "baseline" and (options or Options()).programmatic_launch
    if cuda_graph is None:
        chosen = options or Options()
        whole_step = None  # the default passes and the whole-step graph, where fuselight's defaults run
        if pdl and chosen.passes is None:
            from .passes import DEFAULT, served  # not at the top: the GPU host's runtime has no passes

            whole_step = tuple(served((*DEFAULT, WHOLE_STEP_PASS), chosen.rule_families))
        cuda_graph = graphs_by_default(target, pdl, config)
        if cuda_graph and pdl:
            # Where graphs win, the host sets the pace: programmatic launch only lengthens its launch
            # path (SmolLM2-135M single steps 1.33 -> 1.11 ms on the H100 without it), and one graph
            # holds the whole decode step where the default passes run (0.82 -> 0.60 ms; decode-form.md).
            pdl = False
            options = dataclasses.replace(chosen, programmatic_launch=False, passes=whole_step or chosen.passes)
        elif pdl and whole_step is not None and config is not None and device_model(target.arch) is not None:
            # Where the GPU sets the pace, one graph for the whole step with programmatic launch inside
            # it: within 2% of kernels launched one by one in generation, single steps mostly faster,
            # and the host launches once a step (Llama-3.2-1B, Llama-3-8B in four formats; decode-form.md).
            cuda_graph = True
            options = dataclasses.replace(chosen, passes=whole_step)
    if not cuda_graph and options is not None and WHOLE_STEP_PASS in (options.passes or ()):
        # whole-step capture is a form of graphs: where the step launches kernel by kernel it only
        # sizes the decode grid for the whole cache
        options = dataclasses.replace(options, passes=tuple(p for p in options.passes if p != WHOLE_STEP_PASS))
    # As MLC-LLM compiles: the prefill length is bounded by the chunk size, so memory is planned statically.
    seq = pipeline_pass(pipeline, tvm_target, {"seq_len": prefill_chunk_size}, options)
    mod, params = export_module(config, tvm_target)
    # The baseline lowers as TVM (and MLC-LLM) do: one process, one CUDA unit.
    lowered, executable = lower(
        mod, tvm_target, seq, cuda_graph=cuda_graph, programmatic_launch=pdl, parallel=pipeline == "fuselight"
    )
    return Built(
        config=config,
        target=target,
        pipeline=pipeline,
        executable=executable,
        stats=kernel_stats(lowered),
        compile_seconds=time.perf_counter() - start,
        param_names=[name for name, _, _ in params],
        prefill_chunk_size=prefill_chunk_size,
        baseline_source=source,
        options=options if pipeline == "fuselight" else None,
        cuda_graph=cuda_graph,
    )


def library_metadata(target: TargetSpec, pipeline: str, baseline_source: str, **extra: Any) -> dict[str, Any]:
    """The metadata sidecar every library carries (models and kernel-suite cases alike), plus ``extra``."""
    import tvm

    return {
        "format": METADATA_FORMAT,
        "target": target.kind,
        "arch": target.arch,
        "pipeline": pipeline,
        "baseline_source": baseline_source,
        **extra,
        "tvm_version": tvm.__version__,
        "git_commit": git_commit(),
    }


def metadata(built: Built) -> dict[str, Any]:
    """The sidecar of a model library: ``library_metadata`` plus the model, its parameters and stats."""
    return library_metadata(
        built.target,
        built.pipeline,
        built.baseline_source,
        model=dataclasses.asdict(built.config),
        quantization=built.config.quantization,  # the weight scheme (None: float weights)
        param_names=built.param_names,
        prefill_chunk_size=built.prefill_chunk_size,
        stats=dataclasses.asdict(built.stats),
        compile_seconds=round(built.compile_seconds, 2),
        cuda_graph=built.cuda_graph,
        **({"fuselight": (built.options or Options()).describe()} if built.pipeline == "fuselight" else {}),
    )


def export(built: Built, path: Path, *, aot_cuda: bool = True) -> Path:
    """Write ``path`` (the library), ``path.json`` (metadata) and, for CUDA, ``path.cuda/`` cubins."""
    return write_library(built.executable, path, metadata(built), built.target, aot_cuda=aot_cuda)
