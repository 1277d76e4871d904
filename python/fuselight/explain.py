"""``fuselight explain``: our LLaMA's Relax graph with operator classes and costs, before any lowering.

Each model function's operators (bindings that call an op; tuple plumbing and aliases are views and
left out) with their DNNFusion mapping type, TVM op pattern, FLOPs and bytes, evaluated at a
representative length: every symbolic dim of the function (``seq_len`` for ``embed``/``prefill``)
and the cached length ``kv_len`` seen by attention are set to ``prompt_len``; ``decode`` (one token)
then reads as the step after a ``prompt_len``-token prompt.

``rewrites_available`` is ``PropertyRewrite``'s catalogue (name, law, exact or tolerance);
``rewrites_applied`` what it applies to the graph (name, count), ``rewrites_refused`` the matches it
leaves alone because no proposal is provably no worse (name, count), and ``after_rewrite`` each
function's operator count and costs once it has. The weight transforms (``MergeSiblingMatmuls``,
``FoldNormWeight``) are in the catalogue too; as they change the weights the caller passes, they are
not applied here: ``weight_transforms`` counts where each would apply.

``groups``: the fusion planner's groups of two or more bindings on the rewritten graph (function,
members, classes, anchor), and ``after_rewrite`` each function's ``planned_kernels``. The plan is
an analysis: the pipeline still fuses with TVM's FuseOps.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from .config import ModelConfig

# The model's entry points (``fuselight.model.llama.export_module``); the KV-cache constructor
# computes nothing per token.
MODEL_FUNCTIONS = ("embed", "prefill", "decode")
NOTE = "property_rewrite is not in the default passes yet; the fusion plan is not lowered yet (FuseOps fuses)"


def explain(config: ModelConfig, prompt_len: int) -> dict[str, Any]:
    """The JSON-ready report for ``config`` (exported for ``llvm``; nothing is compiled)."""
    from tvm import relax

    from .errors import FuselightError
    from .model.llama import export_module
    from .passes import fold_norm_weight, merge_sibling_matmuls
    from .passes.classify import KV_LEN, MAPPINGS, NON_CALL_OPS, classify_module
    from .passes.fusion_plan import kernels, plan_fusion
    from .passes.property_rewrite import (
        APPLIED_ATTR,
        REFUSED_ATTR,
        PropertyRewrite,
        catalogue,
    )
    from .target import resolve, to_tvm

    if prompt_len < 1:
        raise FuselightError(f"--prompt-len must be positive, got {prompt_len}")
    mod, _ = export_module(config, to_tvm(resolve("llvm")))
    classified = classify_module(mod)
    rewritten = PropertyRewrite()(mod)
    classified_after = classify_module(rewritten)
    dims = {KV_LEN.name: prompt_len}
    for name in MODEL_FUNCTIONS:
        dims.update({v.name: prompt_len for v in relax.analysis.defined_symbolic_vars(mod[name])})
    plan = plan_fusion(rewritten, dims)
    functions, after_rewrite = {}, {}
    for name in MODEL_FUNCTIONS:
        symbolic = {v.name: prompt_len for v in relax.analysis.defined_symbolic_vars(mod[name])}
        bindings = {**symbolic, KV_LEN.name: prompt_len}
        operators = []
        for info in classified[name]:
            if info.op in NON_CALL_OPS:
                continue
            flops, nbytes = info.cost(bindings)
            operators.append({**info.to_dict(), "est_flops": flops, "est_bytes": nbytes})
        counts = Counter(op["mapping"] for op in operators)
        functions[name] = {
            "evaluated_at": bindings,
            "operators": operators,
            "counts": {m: counts[m] for m in MAPPINGS},
            "est_flops": _total(op["est_flops"] for op in operators),
            "est_bytes": _total(op["est_bytes"] for op in operators),
        }
        after = [info.cost(bindings) for info in classified_after[name] if info.op not in NON_CALL_OPS]
        after_rewrite[name] = {
            "operators": len(after),
            "est_flops": _total(f for f, _ in after),
            "est_bytes": _total(b for _, b in after),
            "planned_kernels": kernels(plan[name]),
        }
    return {
        "model": config.name,
        "dtype": config.dtype,
        "prompt_len": prompt_len,
        "functions": functions,
        "rewrites_available": catalogue() + [merge_sibling_matmuls.REWRITE, fold_norm_weight.REWRITE],
        "rewrites_applied": _counts(rewritten.attrs[APPLIED_ATTR]),
        "rewrites_refused": _counts(rewritten.attrs[REFUSED_ATTR]),
        "after_rewrite": after_rewrite,
        "weight_transforms": _weight_transform_sites(mod),
        "groups": [
            {"function": name, **g.to_dict()} for name in MODEL_FUNCTIONS for g in plan[name] if len(g.members) > 1
        ],
        "note": NOTE,
    }


def _weight_transform_sites(mod) -> list[dict[str, Any]]:
    from .passes import FoldNormWeight, MergeSiblingMatmuls

    merge, fold = MergeSiblingMatmuls(), FoldNormWeight()
    merge(mod)
    fold(mod)
    return [
        {"name": "merge_sibling_matmuls", "count": len(merge.merged)},
        {"name": "fold_norm_weight", "count": len(fold.folded)},
    ]


def _counts(attr) -> list[dict[str, Any]]:
    return [{"name": str(name), "count": int(count)} for name, count in sorted(attr.items())]


def _total(values) -> int | None:
    """The sum, or ``None`` when any operator's cost is unknown (opaque op, unknown shape)."""
    values = list(values)
    return None if any(v is None for v in values) else sum(values)


def format_text(report: dict[str, Any]) -> str:
    """The report as aligned text: one table per function, then counts and totals."""
    lines = [f"{report['model']} ({report['dtype']}), costs at prompt_len={report['prompt_len']}"]
    for name, fn in report["functions"].items():
        at = ", ".join(f"{k}={v}" for k, v in fn["evaluated_at"].items())
        lines += ["", f"{name}  [{at}]"]
        rows = [("binding", "op", "mapping", "tvm pattern", "shape", "dtype", "flops", "bytes")]
        for op in fn["operators"]:
            rows.append(
                (
                    op["name"], op["op"], op["mapping"], op["tvm_pattern"] or "-", _shape(op["shape"]),
                    _dtype(op["dtype"]), _num(op["est_flops"]), _num(op["est_bytes"]),
                )
            )  # fmt: skip
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        counts = ", ".join(f"{m} {n}" for m, n in fn["counts"].items() if n)
        lines.append(f"  {len(fn['operators'])} operators: {counts}")
        lines.append(f"  total: {_num(fn['est_flops'])} flops, {_num(fn['est_bytes'])} bytes")
    applied = ", ".join(f"{r['name']} x{r['count']}" for r in report["rewrites_applied"]) or "none"
    lines += ["", f"property rewrites ({len(report['rewrites_available'])} in the catalogue) applied: {applied}"]
    for name, fn in report["after_rewrite"].items():
        lines.append(
            f"  {name}: {fn['operators']} operators, {_num(fn['est_flops'])} flops, {_num(fn['est_bytes'])} bytes,"
            f" {fn['planned_kernels']} planned kernels"
        )
    lines += ["", report["note"]]
    return "\n".join(lines)


def _shape(shape: Any) -> str:
    if shape is None:
        return "?"
    if any(s is None or isinstance(s, list) for s in shape):  # a tuple output: one shape per field
        return "(" + ", ".join(_shape(s) for s in shape) + ")"
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _dtype(dtype: Any) -> str:
    return "(" + ", ".join(map(_dtype, dtype)) + ")" if isinstance(dtype, list) else str(dtype or "?")


def _num(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"
