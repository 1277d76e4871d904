"""Probe (docs/experiments/bf16-accuracy.md, issue 24): our LLaMA model code, bfloat16 with q4bf16_1 weights,
built for ``llvm`` by the fuselight pipeline with and without the ``residual_stream_fp32`` pass, against
the float64 reference of its dequantized weights (``tests/reference_llama.py``): the relative error of
the last-position logits after a prompt and each of a few decode steps, as ``bench e2e`` measures it.

    PYTHONPATH=python:tests python3 bench/probes/bf16_residual_cpu.py --layers 4,8,16 --out /tmp/cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from conftest import compare_with_reference
from fuselight import config
from fuselight.compile import build
from fuselight import kv_hooks
from fuselight.model.weights import hf_config, random_weights
from fuselight.options import Options
from fuselight.passes import DEFAULT
from fuselight.target import resolve

VARIANTS = {"bf16 stream": tuple(p for p in DEFAULT if p != "residual_stream_fp32"), "float32 stream": DEFAULT}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="4,8")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--scheme", default="q4bf16_1")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--decode", type=int, default=3)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    kv_hooks.register()  # the fuselight build calls them
    results = []
    for layers in map(int, a.layers.split(",")):
        raw = {**hf_config(config.load("tiny-llama")), "hidden_size": a.hidden, "intermediate_size": a.hidden * 7 // 2,
               "num_attention_heads": a.hidden // 64, "num_key_value_heads": a.hidden // 256, "head_dim": 64,
               "vocab_size": 2000, "num_hidden_layers": layers}
        cfg = config.from_dict(raw, name=f"bf16-{layers}").with_quantization(a.scheme)
        weights = random_weights(cfg, seed=a.seed)
        rng = np.random.default_rng(a.seed)
        prompt = rng.integers(0, cfg.vocab_size, a.prompt)
        decode = [int(t) for t in rng.integers(0, cfg.vocab_size, a.decode)]
        for name, passes in VARIANTS.items():
            t0 = time.time()
            built = build(cfg, resolve("llvm"), "fuselight", options=Options(passes=passes))
            vm = relax.VirtualMachine(built.executable, tvm.cpu())
            errors = compare_with_reference(vm, tvm.cpu(), cfg, weights, prompt, decode,
                                            max_total_seq_len=a.prompt + a.decode + 8, prefill_chunk_size=a.prompt)
            results.append({"layers": layers, "hidden": a.hidden, "variant": name, "relerr": errors})
            print(f"L={layers} {name}: {' '.join(f'{e:.2e}' for e in errors)} ({time.time() - t0:.0f} s)", flush=True)
            a.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
