"""Probe (docs/experiments/bf16-accuracy.md, issue 24): which activation roundings make a bf16 LLaMA's
logits 1.45e-2 away from the float64 forward. NumPy only, on the CPU.

A float64 LLaMA (the float64 reference of ``fuselight.bench.e2e``: same weight stds, RMSNorm, rotate-half
RoPE, GQA causal attention) in which each place where a compiled build stores an activation ("site")
rounds it to a chosen format; the matmuls and reductions themselves are exact, as the kernels accumulate
in float32. All variants run in lockstep over the same random weights (drawn per layer, never stored),
and each reports ``||logits - ref|| / ||ref||`` of the last prompt position, the e2e suite's ``relerr``,
after every layer (the logits of the normed hidden state there), so one run gives the growth with depth.

    python3 bench/probes/bf16_rounding_sites.py --hidden 4096 --layers 32 --out /tmp/sites.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import ml_dtypes
import numpy as np

# Where the kernels of a build store an activation in the model dtype, in forward order.
SITES = ("norm", "qkv", "rope", "p", "attn", "o", "residual", "gate_up", "silu_mul", "down")
FORMATS = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32}


def rounder(fmt: str | None):
    if fmt is None:
        return lambda x: x
    dtype = FORMATS[fmt]
    return lambda x: x.astype(dtype).astype(np.float64)


def variants() -> dict[str, dict[str, str | None]]:
    """Variant name -> format per site (None: exact)."""
    out: dict[str, dict[str, str | None]] = {"float64": dict.fromkeys(SITES)}
    out["all fp16"] = dict.fromkeys(SITES, "fp16")
    out["all bf16"] = dict.fromkeys(SITES, "bf16")
    for s in SITES:
        out[f"bf16, {s} fp32"] = {**dict.fromkeys(SITES, "bf16"), s: "fp32"}
    for s in SITES:
        out[f"only {s} bf16"] = {**dict.fromkeys(SITES), s: "bf16"}
    out["bf16, residual+o+down fp32"] = {**dict.fromkeys(SITES, "bf16"), "residual": "fp32", "o": "fp32",
                                         "down": "fp32"}
    out["fp16, residual fp32"] = {**dict.fromkeys(SITES, "fp16"), "residual": "fp32"}
    return out


def inv_freq(head_dim: int, theta: float) -> np.ndarray:
    return 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=None, help="default 3.5 x hidden (Llama-3-8B's 14336)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--gqa", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, help="variant names separated by semicolons (float64 always runs)")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    hidden, layers, hd, n = a.hidden, a.layers, a.head_dim, a.tokens
    inter = a.intermediate or hidden * 7 // 2
    heads = hidden // hd
    kv = heads // a.gqa
    eps = 1e-5
    rng = np.random.default_rng(a.seed)
    vs = variants()
    if a.only:
        vs = {k: v for k, v in vs.items() if k == "float64" or k in a.only.split(";")}
    rnd = {name: {s: rounder(f) for s, f in sites.items()} for name, sites in vs.items()}

    def w(shape: tuple[int, int], std: float) -> np.ndarray:
        # bf16 values, as the dequantized weights are: exact in every variant
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(ml_dtypes.bfloat16).astype(np.float64)

    def norm_w() -> np.ndarray:
        return w((1, hidden), 0.1)[0] + 1.0

    freqs = np.arange(n, dtype=np.float64)[:, None] * inv_freq(hd, 500000.0)[None]
    cos, sin = (np.concatenate([f, f], -1)[:, None, :] for f in (np.cos(freqs), np.sin(freqs)))
    mask = np.triu(np.ones((n, n), dtype=bool), 1)

    def rope(x: np.ndarray) -> np.ndarray:
        half = hd // 2
        return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin

    def rms(x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * g

    head = w((a.vocab, hidden), 1.0)  # tied embedding: rows at RMS 1
    final_g = norm_w()
    ids = rng.integers(0, a.vocab, n)
    xs = {name: head[ids].copy() for name in vs}
    errs: dict[str, list[float]] = {name: [] for name in vs}
    std_o = 1 / math.sqrt(2 * layers)
    t0 = time.time()
    for layer in range(layers):
        g1, g2 = norm_w(), norm_w()
        wqkv = w(((heads + 2 * kv) * hd, hidden), hidden**-0.5)
        wo = w((hidden, heads * hd), (heads * hd) ** -0.5 * std_o)
        wgu = w((2 * inter, hidden), hidden**-0.5)
        wd = w((hidden, inter), inter**-0.5 * std_o)
        for name, r in rnd.items():
            x = xs[name]
            qkv = r["qkv"](r["norm"](rms(x, g1)) @ wqkv.T)
            q = qkv[:, : heads * hd].reshape(n, heads, hd)
            k = qkv[:, heads * hd: (heads + kv) * hd].reshape(n, kv, hd)
            v = qkv[:, (heads + kv) * hd:].reshape(n, kv, hd)
            q, k = r["rope"](rope(q)), r["rope"](rope(k))
            k, v = (np.repeat(t, heads // kv, axis=1).transpose(1, 0, 2) for t in (k, v))
            s = (q.transpose(1, 0, 2) @ k.transpose(0, 2, 1)) * hd**-0.5
            s = np.where(mask, -np.inf, s)
            p = np.exp(s - s.max(-1, keepdims=True))
            # flash attention: P (below 1, unnormalized) in the model dtype for the PV product, the
            # row sum from the unrounded P
            attn = (r["p"](p) @ v) / p.sum(-1, keepdims=True)
            attn = r["attn"](attn.transpose(1, 0, 2).reshape(n, heads * hd))
            x = r["residual"](x + r["o"](attn @ wo.T))
            gu = r["gate_up"](r["norm"](rms(x, g2)) @ wgu.T)
            gate, up = gu[:, :inter], gu[:, inter:]
            h = r["silu_mul"](gate / (1 + np.exp(-gate)) * up)
            x = r["residual"](x + r["down"](h @ wd.T))
            xs[name] = x
        logits = {name: r["norm"](rms(xs[name][-1:], final_g)) @ head.T for name, r in rnd.items()}
        ref = logits["float64"]
        for name in vs:
            errs[name].append(float(np.linalg.norm(logits[name] - ref) / np.linalg.norm(ref)))
        print(f"layer {layer + 1}/{layers} ({time.time() - t0:.0f} s): all bf16 "
              f"{errs.get('all bf16', [math.nan])[-1]:.2e}, |x| rms {np.sqrt(np.mean(xs['float64'] ** 2)):.2f}",
              flush=True)
    result = {"args": {k: str(v) for k, v in vars(a).items()}, "sites": {k: v for k, v in vs.items()},
              "relerr_after_layer": errs}
    a.out.write_text(json.dumps(result, indent=1))
    width = max(map(len, vs))
    for name in vs:
        e = errs[name]
        print(f"{name:<{width}}  " + "  ".join(f"{e[i - 1]:.2e}" for i in sorted({1, layers // 4, layers // 2, layers})))


if __name__ == "__main__":
    main()
