"""MLC-LLM's own models compiled with MLC's pipeline (``mlc``) and with fuselight in it (``mlc+fuselight``).

Libraries come from ``fuselight mlc compile`` (with and without ``--no-fuselight``), one pair per
case (a model). Each library says what parameters it takes (MLC's ``_metadata`` function: names,
shapes, dtypes, in order); both of a case must agree. Weights are drawn once per case on the device
and the same tensors go to both libraries, which ``fuselight.engine.Engine`` drives (MLC's models
export the same ``embed``/``prefill``/``decode``/``create_tir_paged_kv_cache`` functions as ours).
A 4-bit library (MLC's ``quantization`` in its metadata, ``fuselight.quantization``'s schemes) gets
float weights drawn as for fp16 and quantized on the device; the float64 reference then runs on the
dequantized weights, and every record names the scheme in its ``shape``.

Every case: the logits of a prefill, a few decode steps and a long prefill, ``mlc+fuselight``
against ``mlc`` (relative L2 error, tolerance ``agreement_relerr`` in ``configs/mlc.json``). The
LLaMA case (``--model``, a preset whose parameters are MLC's Llama's) is also checked against the
float64 forward pass of ``fuselight.bench.e2e`` and timed as that suite times (prefill tokens/s,
decode ms/token), with the records' ``impl`` ``mlc`` / ``mlc+fuselight``. Runtime-only TVM.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ModelConfig, load
from ..errors import FuselightError
from ..jsonfile import read_json_object
from ..paths import config_dir
from ..quantization import PER_WORD, STORAGE_DTYPE, QuantScheme, quantized_names
from ..quantization import scheme as quantization_scheme
from ..library import device_label
from ..runtime import init_tvm, load_library, release_memory
from . import bench_config
from .e2e import _relerr, quantize_on_device
from .results import MLC_IMPLS, default_path, git_commit, write_results
from .timing import device_name, synchronizer

SUITE = "mlc-e2e"
IMPLS = MLC_IMPLS
# Parameter names across MLC's models: Llama/Mistral/Qwen2 "model.layers.N.", "model.embed_tokens",
# "*norm.weight"; Phi-3 "transformer.h.N.", "transformer.embd", "ln.weight", "mixer.out_proj".
_LAYER_INDEX = re.compile(r"\.(?:layers|h)\.(\d+)\.")
_EMBED = re.compile(r"(?:^|\.)(?:embed_tokens|embd)\.(?:q_)?weight$")
_PACKED = ".q_weight"  # the embedding's packed words, where a scheme quantizes it
_NORM = re.compile(r"(?:norm|(?:^|\.)ln)\.weight$")
_OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What ``Engine`` reads of a model, from an MLC library's parameter list."""

    name: str
    hidden_size: int
    vocab_size: int
    dtype: str  # of the float parameters
    params: tuple[tuple[str, tuple[int, ...], str], ...]  # (name, shape, dtype), in the library's order
    quantization: str | None = None  # MLC's scheme name (a ``fuselight.quantization`` scheme)

    @property
    def num_layers(self) -> int:
        return len({m.group(1) for name, _, _ in self.params if (m := _LAYER_INDEX.search(name))})


def mlc_settings() -> dict[str, Any]:
    """``configs/mlc.json``'s ``e2e``."""
    path = config_dir() / "mlc.json"
    return read_json_object(path, missing=f"MLC settings not found: {path}")["e2e"]


def model_info(case: str, metadata: dict[str, Any], path: Path, sizes: dict[str, Any] | None = None) -> ModelInfo:
    """The model an MLC library was built for, from its ``_metadata``; ``sizes`` gives the dims MLC
    leaves symbolic (its Llama, Mistral and Phi-3 write the vocabulary as "vocab_size")."""
    params = metadata.get("params")
    if not isinstance(params, list) or not params:
        raise FuselightError(f"{path}: MLC metadata lists no parameters (not an MLC-LLM model library?)")
    sizes = sizes or {}

    def dim(name: str, d: Any) -> int:
        if isinstance(d, int):
            return d
        if isinstance(sizes.get(d), int) and not isinstance(sizes.get(d), bool):
            return sizes[d]
        raise FuselightError(f"{path}: parameter {name!r} has dimension {d!r} and the library's metadata gives no value "
                             "(build it with 'fuselight mlc compile')")

    specs = tuple((p["name"], tuple(dim(p["name"], d) for d in p["shape"]), p["dtype"]) for p in params)
    floats = {p["dtype"] for p in params} - {STORAGE_DTYPE}
    if len(floats) != 1:
        raise FuselightError(f"{path}: parameters of several float dtypes {sorted(floats)}")
    quantization = None
    if any(dtype == STORAGE_DTYPE for _, _, dtype in specs):
        quantization = metadata.get("quantization")
        if quantization_scheme(quantization) is None:
            raise FuselightError(f"{path}: packed parameters without a quantization scheme in MLC's metadata")
    embed = [(name, shape) for name, shape, _ in specs if _EMBED.search(name)]
    if len(embed) != 1 or len(embed[0][1]) != 2:
        raise FuselightError(f"{path}: no single 2-D token embedding (embed_tokens or embd) among the parameters")
    name, (vocab, hidden) = embed[0]
    if name.endswith(_PACKED):
        hidden *= PER_WORD  # MLC packs the embedding along the hidden dim in every scheme
    return ModelInfo(case, hidden, vocab, floats.pop(), specs, quantization)


def read_mlc_metadata(vm: Any) -> dict[str, Any]:
    return json.loads(str(vm["_metadata"]()))


def random_weights(info: ModelInfo, device: Any, seed: int) -> dict[str, Any]:
    """Seeded weights for any MLC model, by name, with the distributions of ``fuselight.model.weights``:
    norms 1 + noise, the embedding at ``EMBED_STD``, matrices at 1/sqrt(fan-in) (output projections
    also over sqrt(2 * layers)), biases at 1/sqrt(hidden)."""
    import torch

    from ..model.weights import EMBED_STD, NORM_NOISE_STD

    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, info.dtype)
    weights = {}
    for name, shape in float_params(info):
        norm = len(shape) == 1 and bool(_NORM.search(name))
        if norm:
            std = NORM_NOISE_STD
        elif _EMBED.search(name):
            std = EMBED_STD
        elif len(shape) == 2:
            std = 1.0 / math.sqrt(shape[1])
            if name.endswith(_OUTPUT_PROJECTIONS):
                std /= math.sqrt(2 * max(1, info.num_layers))
        else:
            std = 1.0 / math.sqrt(info.hidden_size)
        t = torch.empty(shape, dtype=dtype, device=device)
        t.normal_(0.0, std, generator=gen)
        if norm:
            t += 1.0
        weights[name] = t
    return quantized(info, weights)[0]


def float_params(info: ModelInfo) -> list[tuple[str, tuple[int, ...]]]:
    """The float parameters ``info``'s packed ones quantize, in order: ``(name, shape)``, a scheme's
    stored parameters (``X.q_weight``, ``X.q_scale``; AWQ's ``X.qweight``, ``X.qzeros``, ``X.scales``)
    standing for ``X.weight`` of ``[N, K]``."""
    out = []
    for name, shape, _ in info.params:
        found = _stored(info, name)
        if found is None:
            out.append((name, shape))
        elif found[1] == 0:
            out.append((found[0], found[2].weight_shape(shape)))
    return out


def _stored(info: ModelInfo, name: str) -> tuple[str, int, QuantScheme] | None:
    """``(X.weight, which of its stored parameters, its scheme)`` where parameter ``name`` stores a
    quantized weight of ``info``'s scheme, else None. MLC's embedding is NK in every scheme."""
    scheme = quantization_scheme(info.quantization)
    if scheme is None:
        return None
    for i, suffix in enumerate(quantized_names("", scheme)):
        if name.endswith(suffix):
            base = name.removesuffix(suffix) + ".weight"
            return base, i, dataclasses.replace(scheme, layout="NK") if _EMBED.search(name) else scheme
    return None


def quantized(info: ModelInfo, weights: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(the library's tensors by its names, the float weights they store)``: ``weights`` (float, by
    ``float_params`` name) quantized as ``info``'s packed parameters say (``e2e.quantize_on_device``)."""
    schemes = {found[0]: found[2] for name, _, _ in info.params if (found := _stored(info, name)) is not None}
    return quantize_on_device(weights, schemes)


def _llama_weights(config: ModelConfig, info: ModelInfo, device: Any, seed: int) -> dict[str, Any]:
    """``fuselight.bench.e2e``'s weights (so the float64 reference applies), checked to be MLC's parameters."""
    from .e2e import random_weights as e2e_weights

    weights = e2e_weights(config, device, seed)
    ours = {name: tuple(t.shape) for name, t in weights.items()}
    theirs = dict(float_params(info))
    if ours != theirs:
        diff = sorted(set(ours.items()) ^ set(theirs.items()))[:3]
        raise FuselightError(f"case {info.name!r}: MLC's parameters differ from model {config.name!r}'s: {diff}")
    return weights


def _logits(runner: Any, ids: np.ndarray, prompt: int, steps: int, long: int, sync: Any) -> list[Any]:
    """Last-position logits: a ``prompt``-token prefill, ``steps`` decode steps, a ``long`` prefill."""
    runner.reset()
    out = [runner.prefill(ids[:prompt]).double().clone()]
    for i in range(steps):
        out.append(runner.decode(int(ids[prompt + i])).double().clone())
    runner.reset()
    out.append(runner.prefill(ids[:long]).double().clone())
    sync()
    return out


def _open(
    tvm: Any, th: Any, path: Path, device: str, case: str, config: ModelConfig | None, weights_for: Any, max_len: int,
    accept_ptx: bool = False,
) -> tuple[Any, dict, dict]:
    """``(runner, fuselight sidecar, MLC metadata)`` of one library; ``weights_for(info)`` gives its tensors."""
    from ..engine import Engine
    from .e2e import _TvmRunner

    vm, dev, meta = load_library(path, device, accept_ptx=accept_ptx)
    mlc_meta = read_mlc_metadata(vm)
    sizes = {**meta.get("mlc_model_config", {}), **(dataclasses.asdict(config) if config is not None else {})}
    info = model_info(case, mlc_meta, path, sizes)
    weights = weights_for(info)
    params = [tvm.runtime.from_dlpack(weights[name]) for name, _, _ in info.params]
    engine = Engine(vm, params, info, dev, max_total_seq_len=max_len,
                    prefill_chunk_size=mlc_meta.get("prefill_chunk_size"), param_specs=info.params)
    return _TvmRunner(engine, th), meta, mlc_meta


@dataclasses.dataclass
class _Run:
    """What every case shares: settings, device, TVM and torch."""

    tvm: Any
    th: Any
    device: str
    tdev: Any
    sync: Any
    seed: int
    prefill_tokens: list[int]
    decode_contexts: list[int]
    decode_steps: int
    prompt: int
    steps: int
    max_len: int
    tolerance: float
    accept_ptx: bool = False  # run libraries built as PTX for an older GPU (runtime.load_module)


def mlc_e2e_name(model: str, cases: list[str], records: list[dict[str, Any]]) -> str:
    """The results' name: ``mlc-e2e-<model>`` where the run times ``model``, then its weight scheme
    where it has one (``mlc-e2e-llama-3-8b-q4f16_1``); else the compared cases
    (``mlc-e2e-mistral-2l-phi3-2l-qwen2-2l``)."""
    if model not in cases:
        return "-".join([SUITE, *sorted(cases)])
    schemes = sorted({r["shape"]["quantization"] for r in records if "quantization" in r["shape"]})
    return "-".join([f"{SUITE}-{model}", *schemes])


def run_mlc_e2e(
    libs: dict[tuple[str, str], Path],
    out_json: Path | None = None,
    *,
    model: str = "llama-3-8b",
    device: str = "cuda",
    prefill_tokens: list[int] | None = None,
    decode_contexts: list[int] | None = None,
    decode_steps: int | None = None,
    accept_ptx: bool = False,
) -> list[dict[str, Any]]:
    """Compare and time ``libs`` ({(impl, case): path}, impl in ``IMPLS``, both impls per case).

    The case named ``model`` is the LLaMA preset: float64 reference and timing; other cases are
    compared only. ``device`` "cpu" runs llvm libraries (tests). Unset lists come from ``configs/mlc.json``.
    ``out_json`` defaults to ``bench/results/<device>/<mlc_e2e_name(...)>.json``.
    """
    settings, e2e_cfg = mlc_settings(), bench_config()["e2e"]
    cases: dict[str, dict[str, Path]] = {}
    for (impl, case), path in libs.items():
        if impl not in IMPLS:
            raise FuselightError(f"--lib {impl}@{case}=...: implementation must be one of {', '.join(IMPLS)}")
        cases.setdefault(case, {})[impl] = Path(path)
    for case, pair in cases.items():
        if set(pair) != set(IMPLS):
            raise FuselightError(f"case {case!r}: needs a library for each of {', '.join(IMPLS)}, got {', '.join(pair)}")
    prefill_tokens = prefill_tokens or settings["prefill_tokens"]
    decode_contexts = decode_contexts or settings["decode_contexts"]
    decode_steps = decode_steps or e2e_cfg["decode_steps"]
    prompt, steps = e2e_cfg["accuracy_prompt"], e2e_cfg["accuracy_decode_steps"]
    max_len = max(max(prefill_tokens), max(decode_contexts) + e2e_cfg["decode_warmup"] + decode_steps, prompt + steps)

    tvm = init_tvm()
    import torch as th

    if device == "cuda" and not th.cuda.is_available():
        raise FuselightError("PyTorch sees no CUDA device")
    run = _Run(tvm, th, device, th.device("cuda:0" if device == "cuda" else "cpu"), synchronizer(device),
               bench_config()["seed"], prefill_tokens, decode_contexts, decode_steps, prompt, steps, max_len,
               settings["agreement_relerr"], accept_ptx)
    records: list[dict[str, Any]] = []
    agreement: dict[str, Any] = {}
    sources: dict[str, str] = {}
    with th.inference_mode():
        for case, pair in cases.items():
            config = load(model) if case == model else None
            case_records, agreement[case], sources = _run_case(run, case, pair, config)
            records += case_records
    meta = {
        "suite": SUITE,
        "model": model,
        "libraries": {f"{impl}@{case}": str(path) for (impl, case), path in libs.items()},
        "baseline_source": sources,
        "agreement_relerr": settings["agreement_relerr"],
        "agreement": agreement,
    }
    out_json = Path(out_json) if out_json else default_path(device_name(device), mlc_e2e_name(model, list(cases), records))
    write_results(out_json, records, meta)
    _print_table(records)
    bad = [case for case, entry in agreement.items() if not entry["agree"]]
    if bad:
        raise FuselightError(f"mlc+fuselight disagrees with mlc on {', '.join(bad)} (results written: {out_json})")
    return records


def _run_case(
    run: _Run, case: str, pair: dict[str, Path], config: ModelConfig | None
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, str]]:
    """One model: both libraries on the same weights; ``(records, agreement entry, baseline sources)``."""
    from .e2e import _Measure, reference_logits

    long = max(run.prefill_tokens)
    shared: dict[str, Any] = {}

    def weights_for(info: ModelInfo) -> dict[str, Any]:
        # Drawn for the first library; the second must take the same parameter list.
        if "info" in shared and shared["info"].params != info.params:
            raise FuselightError(f"case {case!r}: the {', '.join(IMPLS)} libraries take different parameters")
        if "weights" not in shared:
            shared["info"] = info
            if config is not None:  # the reference runs on the float weights the library's store
                shared["weights"], shared["reference"] = quantized(info, _llama_weights(config, info, run.tdev, run.seed))
            else:
                shared["weights"] = random_weights(info, run.tdev, run.seed)
        return shared["weights"]

    records: list[dict[str, Any]] = []
    logits: dict[str, list[Any]] = {}
    sources: dict[str, str] = {}
    ids = refs = refs_acc = None
    mlc_meta: dict[str, Any] = {}
    for impl in IMPLS:
        print(f"{case} {impl}: loading {pair[impl]}", flush=True)
        runner, meta, mlc_meta = _open(run.tvm, run.th, pair[impl], run.device, case, config, weights_for, run.max_len,
                                       run.accept_ptx)
        info = shared["info"]
        if ids is None:
            ids = np.random.default_rng(run.seed).integers(0, info.vocab_size, size=run.max_len, dtype=np.int32)
            if config is not None:
                print(f"{case}: float64 reference", flush=True)
                weights = shared["reference"]
                refs = {n: reference_logits(config, weights, ids[:n]) for n in run.prefill_tokens}
                refs_acc = [reference_logits(config, weights, ids[: run.prompt + i]) for i in range(run.steps + 1)]
                refs_acc.append(refs[long])
        sources[impl] = meta.get("baseline_source") or "unknown"
        logits[impl] = _logits(runner, ids, run.prompt, run.steps, long, run.sync)
        if config is not None:
            common = {"suite": SUITE, "device": device_label(device_name(run.device), meta), "tvm_version": run.tvm.__version__,
                      "git_commit": meta.get("git_commit") or git_commit(), "impl": impl,
                      "baseline_source": sources[impl]}
            measure = _Measure(config, runner, ids, run.sync, common,
                               {"quantization": info.quantization} if info.quantization else None)
            records += [measure.prefill(n, refs[n]) for n in run.prefill_tokens]
            records += measure.decode(run.decode_contexts, run.decode_steps)
            del measure
        del runner
        release_memory()
        if run.device == "cuda":
            run.th.cuda.empty_cache()
    errors = [_relerr(a, b) for a, b in zip(logits["mlc+fuselight"], logits["mlc"])]
    entry: dict[str, Any] = {
        "model_type": mlc_meta.get("model_type"),
        "layers": shared["info"].num_layers,
        "hidden_size": shared["info"].hidden_size,
        "steps": [f"prefill {run.prompt}", *(f"decode {i + 1}" for i in range(run.steps)), f"prefill {long}"],
        "fuselight_vs_mlc": errors,
        "agree": max(errors) <= run.tolerance,
    }
    if config is not None:
        entry["vs_float64"] = {impl: [_relerr(a, r) for a, r in zip(logits[impl], refs_acc)] for impl in IMPLS}
    print(f"{case}: mlc+fuselight vs mlc, max relerr {max(errors):.2e} ({'agree' if entry['agree'] else 'DISAGREE'})",
          flush=True)
    return records, entry, sources


def _print_table(records: list[dict[str, Any]]) -> None:
    by = {(r["case"], json.dumps(r["shape"], sort_keys=True), r["impl"]): r for r in records}
    for case, shape, impl in sorted(by):
        if impl != "mlc":
            continue
        base, ours = by[(case, shape, "mlc")], by.get((case, shape, "mlc+fuselight"))
        if ours is None:
            continue
        ms = base["median_us"] / 1e3, ours["median_us"] / 1e3
        print(f"{case} {shape}: mlc {ms[0]:.2f} ms, mlc+fuselight {ms[1]:.2f} ms ({ms[0] / ms[1]:.2f}x)")
