"""``fuselight explain``: a model's Relax graph with operator classes and costs, and what the graph
passes make of it next to the MLC baseline.

The graphs: our LLaMA (``explain``) or a transformer layer of ``fuselight.model.zoo``
(``explain_graph``). Each function's operators (bindings that call an op; tuple plumbing and
aliases are views and left out) with their DNNFusion mapping type, TVM op pattern, FLOPs and bytes,
evaluated at a representative length: every symbolic dim (``seq_len``) and the cached length
``kv_len`` seen by attention are set to ``prompt_len``; LLaMA's ``decode`` (one token) then reads as
the step after a ``prompt_len``-token prompt.

``rewrites_available`` is ``PropertyRewrite``'s catalogue (name, law, exact or tolerance);
``rewrites_applied`` what it applies to the graph (name, count), ``rewrites_refused`` the matches it
leaves alone because no proposal is provably no worse (name, count), and ``after_rewrite`` each
function's operator count and costs once it has, with ``planned_kernels``, the fusion planner's
kernels on the rewritten graph. For LLaMA, the weight transforms (``MergeSiblingMatmuls``,
``FoldNormWeight``) are in the catalogue too; as they change the weights the caller passes, they are
not applied here: ``weight_transforms`` counts where each would apply.

``pipelines``: the MLC baseline, the fuselight pipeline (its default passes), and to show what the
graph passes themselves do, the fuselight pipeline without ``fusion_plan`` (TVM's FuseOps fusing
alone) and the baseline with ``property_rewrite`` and ``fusion_plan`` only (``graph_passes_only``),
each run for CUDA sm_90 through FuseTIR and dead-code elimination (scheduling changes no
count): per pipeline ``operators``
(the step function's operators after its graph passes), ``kernels`` (PrimFuncs in the module),
``launches_per_decode_step`` (kernel launches of one call of the step function, ``decode`` for
LLaMA, ``forward`` for a layer: a reshape left alone is a view, not a launch; a KV-cache attention
call launches the cache's kernels too) and ``est_bytes_per_decode_step`` (what those launches read
and write, each PrimFunc call counting its arguments in full, at ``prompt_len``). ``groups`` are the
fusion groups the fuselight pipeline lowered (function, members, classes, the fused function),
``groups_skipped`` the planned groups it left alone and why; ``graph_passes_only`` lists its own.

``untouched``: what the passes leave alone because they can't prove anything about it: operators
the classifier can't classify (opaque), tensors of unknown shape or rank, functions already fused
by another pipeline (``Primitive``), and skipped groups (``explain_module`` reports these for any
module).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from .config import ModelConfig
from .relax_rewrite import module_with_unique_binding_names

# The model's entry points (``fuselight.model.llama.export_module``); the KV-cache constructor
# computes nothing per token.
MODEL_FUNCTIONS = ("embed", "prefill", "decode")
# Where the pipelines are compared.
PIPELINE_TARGET = ("cuda", "sm_90")
# The graph passes of the fusion issue, run alone over the baseline.
GRAPH_PASSES = ["property_rewrite", "fusion_plan"]


def explain(config: ModelConfig, prompt_len: int) -> dict[str, Any]:
    """The JSON-ready report for our LLaMA with ``config`` (nothing is compiled)."""
    from .model.llama import export_module

    _check_prompt_len(prompt_len)
    mod, _ = export_module(config, _target())
    report = {
        "model": config.name,
        "dtype": config.dtype,
        "prompt_len": prompt_len,
        **explain_module(mod, MODEL_FUNCTIONS, prompt_len),
        "weight_transforms": _weight_transform_sites(mod),
    }
    report.update(compare_pipelines(mod, "decode", prompt_len))
    return report


def explain_graph(name: str, prompt_len: int) -> dict[str, Any]:
    """The JSON-ready report for the ``fuselight.model.zoo`` graph ``name``."""
    from .model import zoo

    _check_prompt_len(prompt_len)
    config = zoo.load(name)
    mod = zoo.export_module(config)
    report = {
        "model": name,
        "dtype": config.dtype,
        "prompt_len": prompt_len,
        **explain_module(mod, ("forward",), prompt_len),
    }
    report.update(compare_pipelines(mod, "forward", prompt_len))
    return report


def explain_module(mod, functions: Sequence[str], prompt_len: int) -> dict[str, Any]:
    """Operators, rewrites, the plan and what is left untouched, for ``functions`` of ``mod``."""
    from tvm import relax

    from .passes import fold_norm_weight, merge_sibling_matmuls
    from .passes.apply_fusion_plan import PRIMITIVE_ATTR
    from .passes.classify import KV_LEN, MAPPINGS, NON_CALL_OPS, classify_module
    from .passes.fusion_plan import kernels, plan_fusion
    from .passes.property_rewrite import (
        APPLIED_ATTR,
        REFUSED_ATTR,
        PropertyRewrite,
        catalogue,
    )

    classified = classify_module(mod)
    rewritten = module_with_unique_binding_names(PropertyRewrite()(mod))
    classified_after = classify_module(rewritten)
    dims = {KV_LEN.name: prompt_len}
    for name in functions:
        dims.update({v.name: prompt_len for v in relax.analysis.defined_symbolic_vars(mod[name])})
    plan = plan_fusion(rewritten, dims)
    report_functions, after_rewrite, untouched = {}, {}, []
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function) and func.attrs is not None and PRIMITIVE_ATTR in func.attrs:
            untouched.append({"function": gv.name_hint, "reason": "already fused (Primitive function): left as it is"})
    for name in functions:
        symbolic = {v.name: prompt_len for v in relax.analysis.defined_symbolic_vars(mod[name])}
        bindings = {**symbolic, KV_LEN.name: prompt_len}
        operators = []
        for info in classified[name]:
            if info.op in NON_CALL_OPS:
                continue
            flops, nbytes = info.cost(bindings)
            operators.append({**info.to_dict(), "est_flops": flops, "est_bytes": nbytes})
            reason = _untouched_reason(info)
            if reason is not None:
                untouched.append({"function": name, "binding": info.name, "op": info.op, "reason": reason})
        counts = Counter(op["mapping"] for op in operators)
        report_functions[name] = {
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
        "functions": report_functions,
        "rewrites_available": catalogue() + [merge_sibling_matmuls.REWRITE, fold_norm_weight.REWRITE],
        "rewrites_applied": _counts(rewritten.attrs[APPLIED_ATTR]),
        "rewrites_refused": _counts(rewritten.attrs[REFUSED_ATTR]),
        "after_rewrite": after_rewrite,
        "untouched": untouched,
    }


def _untouched_reason(info) -> str | None:
    if info.mapping == "opaque":
        return "operator not classified (opaque): never rewritten or fused"
    if info.bytes_written is None:
        return "tensor of unknown shape or rank: cost not provable, never rewritten or fused"
    return None


def compare_pipelines(mod, step: str, prompt_len: int) -> dict[str, Any]:
    """``pipelines`` (baseline and fuselight counts), ``groups`` and ``groups_skipped`` (see the module doc)."""
    from .engine import runtime_config
    from .passes import DEFAULT
    from .pipeline import baseline_source

    bounds = {"seq_len": int(runtime_config()["prefill_chunk_size"])}
    baseline, _ = _run_pipeline(mod, step, prompt_len, None, bounds)
    fuselight, lowering = _run_pipeline(mod, step, prompt_len, DEFAULT, bounds)
    without = [p for p in DEFAULT if p != "fusion_plan"]
    unplanned, _ = _run_pipeline(mod, step, prompt_len, without, bounds)
    alone, alone_lowering = _run_pipeline(mod, step, prompt_len, GRAPH_PASSES, bounds)
    return {
        "pipelines": {
            "baseline": {"source": baseline_source(), **baseline},
            "fuselight": {"passes": list(DEFAULT), "groups_lowered": len(lowering.applied), **fuselight},
            "fuselight_without_fusion_plan": {"passes": without, **unplanned},
            "graph_passes_only": {"passes": GRAPH_PASSES, **alone, "groups": [g.to_dict() for g in alone_lowering.applied]},
        },
        "groups": [g.to_dict() for g in lowering.applied] if lowering is not None else [],
        "groups_skipped": [g.to_dict() for g in lowering.skipped] if lowering is not None else [],
    }


def _run_pipeline(mod, step: str, prompt_len: int, graph_passes: Sequence[str] | None, bounds: Mapping[str, int]):
    """The counts for one pipeline, and its ``fusion_plan`` pass (None if it runs none)."""
    from tvm import relax

    from .compile import _decode_attention_launches, kv_cache_kernels
    from .passes.classify import KV_LEN, NON_CALL_OPS, classify_binding, classify_module
    from .passes.fusion_plan import io_bytes
    from .pipeline import stages

    target = _target()
    built = [s for s in stages(target, graph_passes=graph_passes or (), variable_bounds=bounds) if s.phase <= 3]
    lowering = next((s.pass_ for s in built if s.name == "fusion_plan"), None)
    operators = None
    with target:
        for stage in built:
            if stage.phase == 2 and operators is None:
                operators = sum(1 for i in classify_module(mod)[step] if i.op not in NON_CALL_OPS)
            mod = stage.pass_(mod)
    dims = {KV_LEN.name: prompt_len, **{v.name: prompt_len for v in relax.analysis.defined_symbolic_vars(mod[step])}}
    launches, nbytes = 0, 0
    for block in mod[step].body.blocks:
        for binding in block.bindings:
            info = classify_binding(binding, mod)
            if info.op.startswith("call_tir:"):
                if _is_view(mod[binding.value.args[0]]):
                    continue  # RewriteDataflowReshape makes it a view
                launches += 1
                cost = io_bytes(binding, dims)  # a fused PrimFunc may be opaque to the classifier
            elif info.op.startswith("call_dps_packed:vm.builtin.attention_kv_cache"):
                # As `fuselight compile` counts: the cache's kernels, and the decode kernel's launches.
                launches += kv_cache_kernels(mod) + _decode_attention_launches(mod)
                cost = info.cost(dims)[1]
            elif info.op.startswith(("call_dps_packed:", "call_pure_packed:", "call_packed:")):
                launches += 1
                cost = info.cost(dims)[1]
            else:
                continue
            nbytes = None if nbytes is None or cost is None else nbytes + cost
    counts = {
        "operators": operators,
        "kernels": sum(1 for _gv, f in mod.functions_items() if not isinstance(f, relax.Function)),
        "launches_per_decode_step": launches,
        "est_bytes_per_decode_step": nbytes,
    }
    return counts, lowering


def _is_view(func) -> bool:
    """Whether the build turns this kernel into a view: a reshape, or a chain of reshapes FuseOps
    fused (which RewriteDataflowReshape recognises once scheduling has inlined the chain)."""
    from tvm import relax, s_tir

    if relax.analysis.has_reshape_pattern(func):
        return True
    sch = s_tir.Schedule(func)
    try:
        for block in sch.get_child_blocks(sch.get_sblock("root"))[:-1]:
            sch.compute_inline(block)
    except (s_tir.ScheduleError, ValueError):
        return False  # not a pure chain of index maps
    return relax.analysis.has_reshape_pattern(sch.mod["main"])


def _target():
    from .target import resolve, to_tvm

    return to_tvm(resolve(*PIPELINE_TARGET))


def _check_prompt_len(prompt_len: int) -> None:
    from .errors import FuselightError

    if prompt_len < 1:
        raise FuselightError(f"--prompt-len must be positive, got {prompt_len}")


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
        lines += _table(rows)
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
    rows = [("pipeline", "operators", "kernels", "launches/step", "est bytes/step")]
    for name, p in report["pipelines"].items():
        rows.append((name, str(p["operators"]), str(p["kernels"]), str(p["launches_per_decode_step"]),
                     _num(p["est_bytes_per_decode_step"])))  # fmt: skip
    lines += ["", "pipelines (step: decode, or the layer's forward)"] + _table(rows)
    lines.append(f"  fusion groups lowered: {len(report['groups'])}, left alone: {len(report['groups_skipped'])}")
    for item in report["untouched"]:
        where = f"{item['function']}.{item['binding']}" if "binding" in item else item["function"]
        lines.append(f"  untouched: {where}: {item['reason']}")
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


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
