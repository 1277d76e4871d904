"""The README's main job: a small LLaMA through the baseline and fuselight pipelines on the CPU.

Compiles both, runs the same prompt and decode steps with the same random weights, and prints
what fuselight changed: kernels, launches per decode step, logits agreement, time.
"""

from __future__ import annotations

import time

import numpy as np

from .config import ModelConfig


def _relerr(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _run(built, weights: dict[str, np.ndarray], prompt: np.ndarray, steps: int) -> dict:
    import tvm
    from tvm import relax

    from .engine import Engine

    dev = tvm.cpu()
    vm = relax.VirtualMachine(built.executable, dev)
    params = [tvm.runtime.tensor(weights[name], dev) for name in built.param_names]
    engine = Engine(
        vm, params, built.config, dev, max_total_seq_len=len(prompt) + steps, prefill_chunk_size=built.prefill_chunk_size
    )
    t0 = time.perf_counter()
    logits = [engine.prefill(prompt).numpy().reshape(-1)]
    t1 = time.perf_counter()
    for _ in range(steps):
        logits.append(engine.decode(int(np.argmax(logits[-1]))).numpy().reshape(-1))
    t2 = time.perf_counter()
    return {"logits": logits, "prefill_ms": (t1 - t0) * 1e3, "decode_ms": (t2 - t1) * 1e3 / max(steps, 1)}


def run_demo(config: ModelConfig, *, prompt_len: int = 13, decode_steps: int = 8, seed: int = 0) -> dict:
    """Both pipelines on ``config``; a float32 build of the same weights is the accuracy reference."""
    from . import compile as fc
    from . import passes, rules
    from .model.weights import random_weights
    from .target import resolve

    target = resolve("llvm")
    print(
        f"fuselight demo: {config.name} ({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"vocab {config.vocab_size}), {config.dtype}, CPU (llvm); prompt {prompt_len} tokens + {decode_steps} decode steps"
    )
    weights = random_weights(config, seed=seed)
    prompt = np.random.default_rng(seed).integers(0, config.vocab_size, prompt_len).astype("int32")
    builds, runs = {}, {}
    for name in fc.PIPELINES:
        print(f"  compiling with the {name} pipeline ...", flush=True)
        builds[name] = fc.build(config, target, name)
        runs[name] = _run(builds[name], weights, prompt, decode_steps)
    # The same weights computed in float32: what the half-precision builds should approach.
    print("  compiling the float32 reference (baseline pipeline) ...", flush=True)
    ref_build = fc.build(config.with_dtype("float32"), target, "baseline")
    ref = _run(ref_build, {k: v.astype("float32") for k, v in weights.items()}, prompt, decode_steps)["logits"]
    base, fuse = runs["baseline"], runs["fuselight"]
    agree = max(_relerr(f, b) for f, b in zip(fuse["logits"], base["logits"]))
    same_tokens = all(np.argmax(f) == np.argmax(b) for f, b in zip(fuse["logits"], base["logits"]))
    errors = {p: max(_relerr(out, r) for out, r in zip(runs[p]["logits"], ref)) for p in fc.PIPELINES}
    rows = [
        ("kernels (PrimFuncs)", *(str(builds[p].stats.kernels) for p in fc.PIPELINES)),
        ("launches per decode step", *(str(builds[p].stats.launches_per_decode_step) for p in fc.PIPELINES)),
        ("compile time (s)", *(f"{builds[p].compile_seconds:.1f}" for p in fc.PIPELINES)),
        (f"prefill {prompt_len} tokens (ms)", *(f"{runs[p]['prefill_ms']:.2f}" for p in fc.PIPELINES)),
        ("decode (ms/token)", *(f"{runs[p]['decode_ms']:.2f}" for p in fc.PIPELINES)),
        ("logits rel. error vs float32", *(f"{errors[p]:.2e}" for p in fc.PIPELINES)),
        ("logits rel. diff vs baseline", "-", f"{agree:.2e}"),
        ("same greedy tokens", "-", "yes" if same_tokens else "NO"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'':<{width}}  {'baseline':>12}  {'fuselight':>12}")
    for label, b, f in rows:
        print(f"{label:<{width}}  {b:>12}  {f:>12}")
    added = sorted(set(builds["fuselight"].stats.decode_kernels) - set(builds["baseline"].stats.decode_kernels))
    removed = sorted(set(builds["baseline"].stats.decode_kernels) - set(builds["fuselight"].stats.decode_kernels))
    ours = list(rules.RULES)
    print(
        f"\nfuselight passes: {', '.join(passes.DEFAULT)}; fuselight rules: {', '.join(ours) or 'none yet'} "
        "(DLight's defaults follow on GPUs; on the CPU kernels keep TVM's default lowering)"
    )
    print("kernels in decode only with fuselight:", ", ".join(added) or "none")
    print("kernels in decode only with baseline: ", ", ".join(removed) or "none")
    return {"builds": builds, "runs": runs, "agreement": agree, "errors": errors}
