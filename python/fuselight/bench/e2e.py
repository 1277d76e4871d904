"""End-to-end suite: a LLaMA model at batch 1, prefill tokens/s and decode ms/token.

Implementations: libraries compiled by ``fuselight compile`` with the baseline and the fuselight
pipeline (driven by ``fuselight.engine.Engine``), and Hugging Face transformers' eager
``LlamaForCausalLM`` (SDPA limited to the flash and memory-efficient backends, as configured).
All run the same seeded random weights, drawn once on the device: the TVM engines get the fused
tensors and transformers gets views of them under its own names, so the weights exist once. Quantized
libraries (their sidecar's ``quantization``) get random packed weights; transformers and the float64
reference run on the weights those store, and every record of such a library says its scheme in ``shape``.
Prefill is timed as one whole call; decode as the median of single steps after a prompt of the
given context. Prefill logits are checked against a float64 forward pass of the same weights.
Runtime-only TVM; PyTorch and transformers are imported when the suite runs.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..config import ModelConfig, load
from ..errors import FuselightError
from ..library import device_label
from ..pdl_audit import audit_if_possible
from ..quantization import QuantScheme, dequantize_torch, quantize_torch, quantized_names
from ..runtime import init_tvm, load_library, read_metadata, release_memory
from . import bench_config
from .kernels_run import sdpa_backends
from .profile import profile_steps
from .results import COMPILED_IMPLS, default_path, git_commit, make_record, write_results
from .timing import device_name, host_samples, summarize, synchronizer, time_host

SUITE = "e2e"
# Model fields a library's metadata need not agree on with the benchmarked config (all others must).
_IGNORED_MODEL_FIELDS = frozenset({"name"})


def random_weights(config: ModelConfig, device: Any, seed: int) -> dict[str, Any]:
    """Seeded random float weights as torch tensors on ``device``, one allocation each, by
    ``dense_weight_shapes()`` name (a quantized model's too: ``quantize_on_device`` stores them).

    Same distributions as ``fuselight.model.weights.random_weights`` (drawn by PyTorch, so not the
    same numbers): norms 1 + noise, projections at std ``init_std``.
    """
    import torch

    from ..model.weights import init_std, is_norm_weight

    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, config.dtype)
    weights = {}
    for name, shape in config.dense_weight_shapes().items():
        t = torch.empty(shape, dtype=dtype, device=device)
        t.normal_(0.0, init_std(name, config), generator=gen)
        if is_norm_weight(name):
            t += 1.0
        weights[name] = t
    return weights


def quantize_on_device(weights: dict[str, Any], schemes: dict[str, QuantScheme]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(the library's tensors by parameter name, the float weights they store)``: each weight named
    in ``schemes`` quantized on its device (``X.weight`` -> ``quantization.quantized_names``: packed
    words with the group scales of the float draw, so the dequantized matrix keeps its std) and its
    entry in ``weights`` replaced by the dequantized weight the kernels compute; the rest as they are."""
    library = {}
    for name, w in weights.items():
        if name not in schemes:
            library[name] = w
            continue
        stored = quantize_torch(w, schemes[name])
        library.update(zip(quantized_names(name, schemes[name]), stored))
        weights[name] = dequantize_torch(stored, schemes[name])
    return library, weights


def hf_model(config: ModelConfig, weights: dict[str, Any], device: Any) -> Any:
    """transformers' ``LlamaForCausalLM`` whose parameters are views of ``weights`` (no copies)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..model.weights import hf_config, to_hf_state

    hf_cfg = LlamaConfig(**hf_config(config), attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_cfg)
    model.load_state_dict(to_hf_state(config, weights), strict=not config.tie_word_embeddings, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    # Non-persistent buffers (the rotary table) are not in the state dict: build them on the device.
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=hf_cfg)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise FuselightError(f"transformers model tensor {left[0]!r} was not given a value")
    return model.eval()


def _llama3_inv_freq(torch: Any, config: ModelConfig, device: Any) -> Any:
    """RoPE inverse frequencies in float64, with Llama-3 scaling as transformers applies it."""
    d = config.head_dim
    inv = 1.0 / config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
    s = config.rope_scaling
    if s is None:
        return inv
    wavelen = 2 * math.pi / inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def reference_logits(config: ModelConfig, weights: dict[str, Any], ids: np.ndarray) -> Any:
    """Float64 logits of the last position after ``ids``, weights upcast one layer at a time."""
    import torch

    dev = weights["model.embed_tokens.weight"].device
    n, heads, kv_heads, hd = len(ids), config.num_attention_heads, config.num_key_value_heads, config.head_dim
    eps = config.rms_norm_eps

    def w(name: str) -> Any:
        # Upcast on use: float64 copies of one layer at a time.
        return weights[name].double()

    def norm(x: Any, weight: Any) -> Any:
        return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps) * weight

    def rope(x: Any) -> Any:  # x [n, heads, hd], rotate-half layout
        angles = torch.arange(n, dtype=torch.float64, device=dev)[:, None] * _llama3_inv_freq(torch, config, dev)[None]
        cos, sin = (torch.cat([f, f], dim=-1)[:, None, :] for f in (angles.cos(), angles.sin()))
        half = hd // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    index = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=dev)
    x = weights["model.embed_tokens.weight"][index].double()
    mask = torch.ones(n, n, dtype=torch.bool, device=dev).triu(1)
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        qkv = norm(x, w(p + "input_layernorm.weight")) @ w(p + "self_attn.qkv_proj.weight").T
        q, k, v = qkv.split([config.q_size, config.kv_size, config.kv_size], dim=-1)
        q, k = rope(q.reshape(n, heads, hd)), rope(k.reshape(n, kv_heads, hd))
        v = v.reshape(n, kv_heads, hd)
        group = heads // kv_heads
        k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
        scores = (q.transpose(0, 1) @ k.transpose(1, 2)) * hd**-0.5
        attn = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v  # [heads, n, hd]
        x = x + attn.transpose(0, 1).reshape(n, config.q_size) @ w(p + "self_attn.o_proj.weight").T
        gate, up = (norm(x, w(p + "post_attention_layernorm.weight")) @ w(p + "mlp.gate_up_proj.weight").T).chunk(
            2, dim=-1
        )
        x = x + (torch.nn.functional.silu(gate) * up) @ w(p + "mlp.down_proj.weight").T
    last = norm(x[-1:], w("model.norm.weight"))
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    return (last @ w(head).T).reshape(-1)


def _relerr(out: Any, ref: Any) -> float:
    """||out - ref|| / ||ref|| of two torch tensors of the same size, flattened, in float64."""
    out, ref = out.reshape(-1).double(), ref.reshape(-1).double()
    return float((out - ref).norm() / ref.norm())


def _accuracy(logits: dict[str, list[Any]], refs: list[Any], prompt: int) -> dict[str, Any]:
    """Per-step relative errors of each impl against float64 and against transformers (torch)."""
    result: dict[str, Any] = {"prompt": prompt, "decode_steps": len(refs) - 1, "impls": {}}
    for impl, steps in logits.items():
        entry = {"vs_float64": [_relerr(out, ref) for out, ref in zip(steps, refs)]}
        if impl != "torch" and "torch" in logits:
            entry["vs_torch"] = [_relerr(out, ref) for out, ref in zip(steps, logits["torch"])]
        result["impls"][impl] = entry
    return result


def _costs(config: ModelConfig) -> tuple[int, int, int, int]:
    """(weight elements in the layers, lm_head elements, bytes of the weights a step reads as stored
    (packed words and scales when quantized), bytes per activation element)."""
    head = "model.embed_tokens." if config.tie_word_embeddings else "lm_head."
    dense = config.dense_weight_shapes()
    layers = sum(math.prod(s) for name, s in dense.items() if name.startswith("model.layers."))
    return layers, math.prod(dense[head + "weight"]), config.num_weight_bytes(decode=True), \
        (4 if config.dtype == "float32" else 2)


def prefill_cost(config: ModelConfig, tokens: int) -> tuple[int, int]:
    """(bytes, flops) of a prefill: weights read once, logits of the last token only."""
    layers, head, weight_bytes, _ = _costs(config)
    attention = 2 * tokens * tokens * config.head_dim * config.num_attention_heads * config.num_hidden_layers
    return weight_bytes, 2 * tokens * layers + 2 * head + attention


def decode_cost(config: ModelConfig, context: int) -> tuple[int, int]:
    """(bytes, flops) of one decode step at ``context``: all weights and the KV cache read."""
    layers, head, weight_bytes, item = _costs(config)
    kv = 2 * context * config.kv_size * config.num_hidden_layers
    attention = 4 * context * config.head_dim * config.num_attention_heads * config.num_hidden_layers
    return weight_bytes + kv * item, 2 * (layers + head) + attention


class _Runner(Protocol):
    """One implementation: ``reset``, ``prefill(ids) -> last logits``, ``decode(id) -> logits``."""

    def reset(self) -> None: ...

    def prefill(self, ids: np.ndarray) -> Any: ...

    def decode(self, token: int) -> Any: ...


class _TvmRunner:
    def __init__(self, engine: Any, torch: Any) -> None:
        self.engine, self.torch = engine, torch

    def reset(self) -> None:
        self.engine.reset()

    def prefill(self, ids: np.ndarray) -> Any:
        return self.torch.from_dlpack(self.engine.prefill(ids)).reshape(-1)

    def decode(self, token: int) -> Any:
        return self.torch.from_dlpack(self.engine.decode(token)).reshape(-1)

    def generate(self, ids: np.ndarray, steps: int) -> tuple[np.ndarray, float]:
        """Prefill ``ids`` afresh, then ``Engine.greedy`` over ``steps`` decode steps: its
        ``steps + 1`` tokens and its wall-clock seconds (the untimed prefill is synchronised)."""
        self.engine.reset()
        logits = self.engine.prefill(ids)
        start = time.perf_counter()
        tokens = self.engine.greedy(logits, steps + 1)
        return tokens, time.perf_counter() - start

    def greedy_by_steps(self, ids: np.ndarray, steps: int) -> np.ndarray:
        """The same tokens as ``generate``, one synchronous step at a time, argmax on the host."""
        self.reset()
        logits = self.prefill(ids)
        tokens = []
        for _ in range(steps):
            tokens.append(int(logits.argmax()))
            logits = self.decode(tokens[-1])
        return np.array([*tokens, int(logits.argmax())], dtype=np.int32)


class _HfRunner:
    def __init__(self, model: Any, torch: Any, device: Any, backends: list) -> None:
        self.model, self.torch, self.device, self.backends = model, torch, device, backends
        params = inspect.signature(model.forward).parameters
        # Only the last position's logits, as the TVM engine computes them (the argument's name
        # depends on the transformers version).
        self.keep = next(({k: 1} for k in ("logits_to_keep", "num_logits_to_keep") if k in params), {})
        self.past = None

    def _forward(self, ids: Any) -> Any:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(self.backends):
            out = self.model(ids, past_key_values=self.past, use_cache=True, **self.keep)
        self.past = out.past_key_values
        return out.logits[0, -1]

    def reset(self) -> None:
        self.past = None

    def prefill(self, ids: np.ndarray) -> Any:
        return self._forward(self.torch.as_tensor(np.asarray(ids, dtype=np.int64), device=self.device)[None])

    def decode(self, token: int) -> Any:
        return self._forward(self.torch.tensor([[int(token)]], dtype=self.torch.int64, device=self.device))


def _check_library(meta: dict[str, Any], config: ModelConfig, path: Path) -> None:
    """Refuse a library built for another model: every config field but the name must match."""
    model = meta.get("model")
    if not isinstance(model, dict):
        raise FuselightError(f"{path}: metadata has no 'model' (not a model library)")
    # JSON-normalised, as the metadata was written (nested dataclasses -> dicts, tuples -> lists).
    want = json.loads(json.dumps(dataclasses.asdict(config)))
    for field, value in want.items():
        if field in _IGNORED_MODEL_FIELDS:
            continue
        got = model.get(field, "<missing>")
        if got != value:
            raise FuselightError(
                f"{path}: library built for {field}={got!r}, benchmark model {config.name!r} has {value!r}"
            )


def _open_tvm(
    th: Any, path: Path, device: str, config: ModelConfig, params: list, max_len: int, accept_ptx: bool = False
) -> tuple[_Runner, str]:
    """An engine over ``path`` on the shared ``params`` (TVM tensors), and the library's baseline source."""
    from ..engine import Engine

    vm, dev, meta = load_library(path, device, accept_ptx=accept_ptx)
    engine = Engine(
        vm,
        params,
        config,
        dev,
        max_total_seq_len=max_len,
        # The library's own prefill bound; other sizes from configs/runtime.json.
        prefill_chunk_size=meta.get("prefill_chunk_size"),
    )
    return _TvmRunner(engine, th), meta.get("baseline_source") or "unknown"


class _Measure:
    """Prefill and decode measurements of one implementation, as records."""

    def __init__(
        self, config: ModelConfig, runner: _Runner, ids: np.ndarray, sync: Callable[[], None], common: dict,
        shape: dict[str, Any] | None = None,
    ) -> None:
        """``shape``: what every record's shape also says (a quantized library's ``quantization``)."""
        self.config, self.runner, self.ids, self.sync, self.common = config, runner, ids, sync, common
        self.shape = shape or {}
        self.cfg = bench_config()["e2e"]

    def prefill(self, n: int, ref: Any) -> dict[str, Any]:
        """Whole-prompt prefill from an empty cache; logits checked against ``ref``."""
        runner, ids = self.runner, self.ids[:n]
        runner.reset()
        # Copied out: the next call may reuse the logits buffer.
        relerr = _relerr(runner.prefill(ids).clone(), ref)
        self.sync()
        stats = time_host(
            lambda: runner.prefill(ids),
            warmup=self.cfg["prefill_warmup"],
            repeat=self.cfg["prefill_repeat"],
            sync=self.sync,
            setup=runner.reset,
        )
        nbytes, flops = prefill_cost(self.config, n)
        rate = n / stats.median_us * 1e6
        print(
            f"  prefill {n}: {stats.median_us / 1e3:.2f} ms ({rate:.0f} tok/s), logits relerr {relerr:.1e}", flush=True
        )
        return make_record(
            **self.common,
            case=f"{self.config.name}-prefill",
            shape={"tokens": n, **self.shape},
            metric="tokens_per_s",
            stats=stats,
            nbytes=nbytes,
            flops=flops,
            relerr=relerr,
        )

    def accuracy_logits(self, prompt: int, steps: int) -> list[Any]:
        """Last-position logits of a ``prompt``-token prefill and then ``steps`` decode steps."""
        runner, ids = self.runner, self.ids
        runner.reset()
        # Copied out: the next step may reuse the logits buffer.
        out = [runner.prefill(ids[:prompt]).double().clone()]
        for i in range(steps):
            out.append(runner.decode(int(ids[prompt + i])).double().clone())
        self.sync()
        return out

    def decode(self, contexts: list[int], steps: int, profile: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Median single-step decode time after a prompt of each of ``contexts`` tokens.

        The steps are taken in ``decode_rounds`` interleaved rounds (each round prefills every
        context afresh, takes untimed warm-up steps, then its share of the timed ones), so a slow
        drift of the host's speed falls on every context alike: on the H100 machine the same step
        of the same library varied by 4% from minute to minute while its GPU time stayed within 0.5%.
        With ``profile`` (a dict), further steps run under the CUDA profiler and their kernels by
        family are stored in it under ``str(context)``.
        """
        runner, warmup, rounds = self.runner, self.cfg["decode_warmup"], self.cfg["decode_rounds"]
        per_round = -(-steps // rounds)
        samples: dict[int, list[float]] = {c: [] for c in contexts}
        for _ in range(rounds):
            for context in contexts:
                runner.reset()
                runner.prefill(self.ids[:context])
                tokens = iter(int(t) for t in self.ids[context : context + warmup + per_round])
                samples[context] += host_samples(
                    lambda it=tokens: runner.decode(next(it)), warmup=warmup, repeat=per_round, sync=self.sync
                )
        records = []
        for context in contexts:
            stats = summarize(samples[context])
            print(f"  decode after {context}: {stats.median_us / 1e3:.2f} ms/token", flush=True)
            if profile is not None:
                self._profile(context, profile)
            nbytes, flops = decode_cost(self.config, context)
            records.append(
                make_record(
                    **self.common,
                    case=f"{self.config.name}-decode",
                    shape={"context": context, "steps": stats.n, **self.shape},
                    metric="ms_per_token",
                    stats=stats,
                    nbytes=nbytes,
                    flops=flops,
                    relerr=None,
                )
            )
        return records

    def generate(self, contexts: list[int], steps: int, check: int) -> tuple[list[dict[str, Any]], dict[str, int]]:
        """Greedy generation through ``Engine.greedy`` (token kept on the device, the next step
        enqueued while the current one finishes): ms per decode step over ``steps`` steps after a
        prompt of each context, one sample per round, rounds interleaved as in ``decode``. Also, per
        context, how many of the first ``check + 1`` tokens agree with step-by-step decoding whose
        argmax runs on the host."""
        runner, rounds = self.runner, self.cfg["decode_rounds"]
        agree = {}
        for context in contexts:
            prompt = self.ids[:context]
            got = runner.generate(prompt, check)[0]
            want = runner.greedy_by_steps(prompt, check)
            agree[str(context)] = int(np.cumprod(got == want).sum())
        samples: dict[int, list[float]] = {c: [] for c in contexts}
        for _ in range(rounds):
            for context in contexts:
                seconds = runner.generate(self.ids[:context], steps)[1]
                samples[context].append(seconds / steps * 1e6)
        records = []
        for context in contexts:
            stats = summarize(samples[context])
            print(
                f"  generate after {context}: {stats.median_us / 1e3:.2f} ms/token "
                f"({agree[str(context)]}/{check + 1} tokens as step by step)",
                flush=True,
            )
            nbytes, flops = decode_cost(self.config, context)
            records.append(
                make_record(
                    **self.common,
                    case=f"{self.config.name}-generate",
                    shape={"context": context, "steps": steps, **self.shape},
                    metric="ms_per_token",
                    stats=stats,
                    nbytes=nbytes,
                    flops=flops,
                    relerr=None,
                )
            )
        return records, agree

    def _profile(self, context: int, profile: dict[str, Any]) -> None:
        runner, warmup, extra = self.runner, self.cfg["decode_warmup"], self.cfg["profile_steps"]
        runner.reset()
        runner.prefill(self.ids[:context])
        tokens = iter(int(t) for t in self.ids[context : context + warmup + extra])
        for _ in range(warmup):
            runner.decode(next(tokens))
        prof = profile_steps(lambda: runner.decode(next(tokens)), extra, self.sync)
        profile[str(context)] = prof
        host = f"; host launches {prof['host_launches']:.0f}" if "host_launches" in prof else ""
        print(f"    profile: busy {prof['busy_us']:.0f} us{host}; exclusive " + ", ".join(
            f"{k} {v['exclusive_us']:.0f} us/{v['launches']:.0f}" for k, v in prof["families"].items()), flush=True)


def e2e_name(config: ModelConfig, preset_dtype: str) -> str:
    """The e2e results' name: ``e2e-<model>``, then the weight scheme, or the dtype where it is not
    the preset's (``e2e-llama-3-8b``, ``e2e-llama-3-8b-q4f16_1``, ``e2e-smollm2-135m-float16``)."""
    if config.quantization:
        return f"e2e-{config.name}-{config.quantization}"
    return f"e2e-{config.name}" + (f"-{config.dtype}" if config.dtype != preset_dtype else "")


def run_e2e(
    libs: dict[str, Path],
    config_name: str,
    out_json: Path | None = None,
    *,
    torch: bool = True,
    device: str = "cuda",
    prefill_tokens: list[int] | None = None,
    decode_contexts: list[int] | None = None,
    decode_steps: int | None = None,
    profile: bool = False,
    accept_ptx: bool = False,
) -> list[dict[str, Any]]:
    """Benchmark ``libs`` ({"baseline"|"fuselight": library path}) and, with ``torch``, transformers.

    ``accept_ptx``: run libraries built as PTX for an older GPU (``runtime.load_module``); their
    records' device says so (``library.device_label``).

    ``device`` "cpu" runs llvm libraries (for tests). Unset lists come from ``e2e`` in bench.json.
    ``profile`` (cuda): each library's decode kernels by family at each context, in the results'
    ``decode_profile`` (see ``fuselight.bench.profile``). ``out_json`` defaults to
    ``bench/results/<device>/<e2e_name(...)>.json``.
    """
    from ..report import accuracy_text, text_table

    cfg = bench_config()["e2e"]
    for impl in libs:
        if impl not in COMPILED_IMPLS:
            raise FuselightError(f"--lib {impl}=...: implementation must be one of {', '.join(COMPILED_IMPLS)}")
    if not libs and not torch:
        raise FuselightError("nothing to benchmark: no libraries and no torch")
    config = load(config_name)
    preset_dtype = config.dtype
    prefill_tokens = prefill_tokens or cfg["prefill_tokens"]
    decode_contexts = decode_contexts or cfg["decode_contexts"]
    decode_steps = decode_steps or cfg["decode_steps"]
    max_len = max(
        max(prefill_tokens),
        max(decode_contexts)
        + max(
            cfg["decode_warmup"] + max(-(-decode_steps // cfg["decode_rounds"]), cfg["profile_steps"] if profile else 0),
            cfg["generate_steps"],
            cfg["generate_check"],
        ),
        cfg["accuracy_prompt"] + cfg["accuracy_decode_steps"],
    )
    if max_len > config.max_position_embeddings:
        raise FuselightError(
            f"e2e needs {max_len} positions, model {config.name!r} has {config.max_position_embeddings}"
        )
    metas = [read_metadata(Path(path)) for path in libs.values()]
    # The weight scheme and the dtype are the libraries' (a preset names its checkpoint's dtype and
    # float weights; `fuselight compile --dtype/--quantization` may build others); all must agree.
    for field, apply in (("dtype", config.with_dtype), ("quantization", config.with_quantization)):
        values = {(m.get("model") or {}).get(field) for m in metas}
        if len(values) > 1:
            raise FuselightError(f"the libraries differ in {field}: {sorted(map(str, values))}")
        if values and (value := values.pop()) is not None:
            config = apply(value)
    for meta, path in zip(metas, libs.values()):
        _check_library(meta, config, Path(path))
    # The GPU host's copy of the tree may have no git history: prefer the commit each build recorded
    # (transformers' records get the first library's).
    metas_by_impl = dict(zip(libs, metas))
    commits = {impl: m["git_commit"] for impl, m in metas_by_impl.items() if m.get("git_commit")}
    commit = next(iter(commits.values()), None) or git_commit()

    tvm = init_tvm()
    import torch as th

    if device == "cuda" and not th.cuda.is_available():
        raise FuselightError("PyTorch sees no CUDA device")
    tdev = th.device("cuda:0" if device == "cuda" else "cpu")
    sync = synchronizer(device)
    seed = bench_config()["seed"]
    ids = np.random.default_rng(seed).integers(0, config.vocab_size, size=max_len, dtype=np.int32)
    common = {
        "suite": SUITE,
        "device": device_name(device),
        "tvm_version": tvm.__version__,
        "git_commit": commit,
    }
    records: list[dict[str, Any]] = []
    with th.inference_mode():
        print(
            f"e2e {config.name} ({config.dtype}) on {common['device']}: drawing weights, float64 reference", flush=True
        )
        library, weights = quantize_on_device(random_weights(config, tdev, seed), config.quantized_weights())
        params = [tvm.runtime.from_dlpack(library[name]) for name in config.weight_shapes()]
        refs = {n: reference_logits(config, weights, ids[:n]) for n in prefill_tokens}
        # Decoding token t after a prefix computes what a prefill of prefix + t does: one float64
        # forward per step is the reference for the accuracy check.
        acc_prompt, acc_steps = cfg["accuracy_prompt"], cfg["accuracy_decode_steps"]
        acc_refs = [reference_logits(config, weights, ids[: acc_prompt + i]) for i in range(acc_steps + 1)]
        acc_logits: dict[str, list[Any]] = {}
        profiles: dict[str, dict[str, Any]] = {}
        generate_check: dict[str, dict[str, int]] = {}
        impls = list(libs) + (["torch"] if torch else [])
        for impl in impls:
            print(f"{impl}: loading", flush=True)
            if impl == "torch":
                runner: _Runner = _HfRunner(hf_model(config, weights, tdev), th, tdev, sdpa_backends(device))
                source = None
            else:
                runner, source = _open_tvm(th, Path(libs[impl]), device, config, params, max_len, accept_ptx)
            measure = _Measure(
                config, runner, ids, sync,
                {**common, "git_commit": commits.get(impl, commit), "impl": impl, "baseline_source": source,
                 "device": device_label(common["device"], metas_by_impl.get(impl, {}))},
                {"quantization": config.quantization} if config.quantization and impl != "torch" else None,
            )
            acc_logits[impl] = measure.accuracy_logits(acc_prompt, acc_steps)
            records += [measure.prefill(n, refs[n]) for n in prefill_tokens]
            prof = profiles.setdefault(impl, {}) if profile and impl != "torch" else None
            records += measure.decode(decode_contexts, decode_steps, prof)
            if isinstance(runner, _TvmRunner) and runner.engine.can_generate:
                generated, generate_check[impl] = measure.generate(
                    decode_contexts, cfg["generate_steps"], cfg["generate_check"]
                )
                records += generated
            del runner, measure
            release_memory()
            if device == "cuda":
                th.cuda.empty_cache()
        accuracy = _accuracy(acc_logits, acc_refs, acc_prompt)
    meta = {
        "suite": SUITE,
        "model": config.name,
        "quantization": config.quantization,
        "libraries": {k: str(v) for k, v in libs.items()},
        "torch": torch,
        "accuracy": accuracy,
        # Per library and context: leading greedy tokens that agree with step-by-step decoding.
        "generate_check": {"tokens": cfg["generate_check"] + 1, "agree": generate_check},
        **({"decode_profile": profiles} if profile else {}),
    }
    if device == "cuda":
        meta["pdl_audit"] = {impl: audit_if_possible(path) for impl, path in libs.items()}
    out_json = Path(out_json) if out_json else default_path(common["device"], e2e_name(config, preset_dtype))
    write_results(out_json, records, meta)
    print(text_table(records))
    print(accuracy_text(accuracy))
    for impl, found in meta.get("pdl_audit", {}).items():
        if found is not None:
            print(f"{impl}: {found['waiting']} of {found['kernels']} kernels wait for the grid before them; "
                  f"{len(found['out_of_order'])} touch memory before the wait {[k['kernel'] for k in found['out_of_order']]}")
    print(f"{len(records)} measurements; results: {out_json}", flush=True)
    return records
