"""MLC's compile command shape: target detection by name, then a build function given the pipeline."""

import argparse
import json
from pathlib import Path

import tvm
from tvm import relax, tirx


def detect_target_and_host(hint, host_hint="auto"):
    target = tvm.target.Target(json.loads(hint))
    if target.kind.name == "cuda":
        exported = dict(target.export())
        exported["libs"] = [*exported.get("libs", []), "thrust"]  # as MLC adds it
        target = tvm.target.Target(exported)

    def build(mod, args, pipeline=None):
        relax.build(mod, target=args.target, relax_pipeline=pipeline).export_library(str(args.output))

    return target, build


def make_module(hidden, out):
    """``main(x [n, hidden], w [out, hidden]) = softmax(x @ w^T)``: a linear layer as models write one."""
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, hidden), "float32"))
    w = relax.Var("w", relax.TensorType((out, hidden), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w)))
            gv = bb.emit_output(relax.op.nn.softmax(y))
        bb.emit_func_output(gv)
    return bb.get()


class _Named:
    def __init__(self, name):
        self.name = name


def main(argv):
    """The model argument is a JSON file with ``hidden`` and ``out``."""
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--device", required=True)
    p.add_argument("-o", "--output", required=True)
    parsed = p.parse_args(argv)
    target, build = detect_target_and_host(parsed.device)
    config = json.loads(Path(parsed.model).read_text())
    args = argparse.Namespace(target=target, output=Path(parsed.output), model=_Named("stub"),
                              quantization=_Named("q0f32"), config=argparse.Namespace(**config))
    with target:
        build(make_module(config["hidden"], config["out"]), args,
              pipeline=relax.get_pipeline("mlc_llm", target=target))
