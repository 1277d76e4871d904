"""FoldNormWeight: RMSNorm weights folded into the following linear layers' weights by the lifted
weight transform; same results; refused where the norm has other users, its weight is not a weight,
or the norm is not over the last axis; overflowing float16 weights refused."""

import numpy as np
import pytest
import tvm
from fuselight.errors import FuselightError
from fuselight.passes.fold_norm_weight import FOLDED_ATTR, FoldNormWeight
from fuselight.passes.weight_transform import lift_and_transform
from tvm import relax, tirx
from tvm.relax import op as O

HIDDEN = 16
ROWS = (("w_q", 16), ("w_kv", 8))
N = tirx.Var("n", "int64")


def _layer(dtype="float32", residual=False, axis=-1, g_is_input=False):
    """x -> rms_norm(x, g) -> two linear layers (and the residual x + norm when asked)."""
    x = relax.Var("x", relax.TensorType([N, HIDDEN], dtype))
    g = relax.Var("g", relax.TensorType([HIDDEN], dtype))
    ws = [relax.Var(n, relax.TensorType([r, HIDDEN], dtype)) for n, r in ROWS]
    params = [x, g, *ws]
    bb = relax.BlockBuilder()
    with bb.function("main", params, attrs={"num_input": 2 if g_is_input else 1}):
        with bb.dataflow():
            h = bb.emit(O.nn.rms_norm(x, g, axes=[axis]))
            outs = [bb.emit(O.matmul(h, bb.emit(O.permute_dims(w)))) for w in ws]
            if residual:
                outs.append(bb.emit(O.add(x, h)))
            out = bb.emit_output(relax.Tuple(outs))
        bb.emit_func_output(out)
    return bb.get()


def _run(mod, args):
    vm = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    return [t.numpy() for t in vm["main"](*[tvm.runtime.tensor(a) for a in args])]


def _weights(dtype, scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    g = (1 + 0.5 * rng.standard_normal(HIDDEN)) * scale
    return [g.astype(dtype)] + [(rng.standard_normal((r, HIDDEN)) * HIDDEN**-0.5 * scale).astype(dtype) for _, r in ROWS]


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float16", 2e-3)])
def test_folded_same_results(dtype, tol):
    mod = _layer(dtype)
    p = FoldNormWeight()
    folded = p(mod)
    assert p.folded == [("main", "g")] and [list(f) for f in folded.attrs[FOLDED_ATTR]] == [["main", "g"]]
    weights = _weights(dtype)
    lifted, new_weights = lift_and_transform(folded, "main", weights)
    # g is gone: the layers take W * g (transposed by the transform too).
    assert sorted(w.shape for w in new_weights) == sorted((HIDDEN, r) for _, r in ROWS)
    x = np.random.default_rng(1).standard_normal((5, HIDDEN)).astype(dtype)
    for got, ref in zip(_run(lifted, [x, *new_weights]), _run(mod, [x, *weights])):
        scale = np.abs(ref.astype("float64")).max()
        np.testing.assert_allclose(got.astype("float64"), ref.astype("float64"), rtol=tol, atol=tol * scale)


def test_float16_overflow_refused():
    folded = FoldNormWeight()(_layer("float16"))
    with pytest.raises(FuselightError, match="overflow"):
        lift_and_transform(folded, "main", _weights("float16", scale=400.0))


@pytest.mark.parametrize("case", ["residual", "g_is_input", "axis_0"])
def test_not_folded(case):
    mod = _layer(residual=case == "residual", g_is_input=case == "g_is_input", axis=0 if case == "axis_0" else -1)
    p = FoldNormWeight()
    out = p(mod)
    assert p.folded == [] and out["main"].same_as(mod["main"])


def test_tiny_llama():
    from fuselight import config
    from fuselight.model.llama import export_module
    from fuselight.target import resolve, to_tvm

    cfg = config.load("tiny-llama")
    mod, _ = export_module(cfg, to_tvm(resolve("llvm")))
    p = FoldNormWeight()
    out = p(mod)
    folded = {fn: [name for f, name in p.folded if f == fn] for fn in ("prefill", "decode")}
    # Each layer's two norms into qkv_proj and gate_up_proj; decode's final norm into lm_head too
    # (prefill's goes through the last-position gather first).
    assert len(folded["prefill"]) == 2 * cfg.num_hidden_layers
    assert len(folded["decode"]) == 2 * cfg.num_hidden_layers + 1
    norms = [b.value for blk in out["decode"].body.blocks for b in blk.bindings
             if isinstance(b.value, relax.Call) and b.value.op.name == "relax.nn.rms_norm"]  # fmt: skip
    assert all(isinstance(n.args[1], relax.Constant) for n in norms)
