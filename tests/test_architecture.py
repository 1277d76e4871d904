"""The package's layering, read from its imports (``ast``: nothing is imported to check it).

- Passes rewrite graphs; rules schedule. A module under ``passes/`` may ask a rule whether it takes
  a function (the rule class's ``supports`` / ``takes``, its ``analyze`` and descriptions) and use
  the rules' analysis modules, never a rule's templates or scheduling code; no module under
  ``rules/`` imports ``passes/``. Names both halves share live in ``fuselight.contracts`` and
  ``fuselight.computations``.
- No import cycles among the package's modules, counting imports inside functions too (those made
  only under ``TYPE_CHECKING`` do not run).
- Under ``passes/`` and ``rules/`` imports sit at the top of the module (optional packages aside).
- A config's ``_doc`` is at most three lines; the lab notes behind it live in ``docs/experiments/``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Where each part of the ``fuselight`` package lives in the source tree.
SOURCES = ((ROOT / "python" / "fuselight", "fuselight"), (ROOT / "passes", "fuselight.passes"),
           (ROOT / "rules", "fuselight.rules"))

# The modules under rules/ a pass may import: the rules themselves (for ``supports``/``analyze``,
# see RULE_NAMES) and analysis that builds nothing.
RULE_MODULES = {f"fuselight.rules.{p.stem}" for p in (ROOT / "rules").glob("*.py")} - {
    "fuselight.rules.__init__", "fuselight.rules.base", "fuselight.rules.arch_config", "fuselight.rules.stages"}
ANALYSIS_MODULES = {
    "fuselight.rules.stages",
    "fuselight.rules.gemm.analysis",
    "fuselight.rules.gemm.operands",
    "fuselight.rules.reduce.analysis",
    "fuselight.rules.flash.rotary",  # reads TVM's split-rotary kernel as expressions
}
# What a pass may take from a rule module: the rule class, analysis functions, descriptions.
RULE_NAMES = re.compile(r"^(analyze\w*|\w+Desc|[A-Z]\w*)$")
TEMPLATE_NAME = re.compile(r"(kernel|body|_rule$|^flash_|^load_|schedule)")


def _modules() -> dict[str, Path]:
    found = {}
    for base, package in SOURCES:
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if package == "fuselight" and parts and parts[0] in ("passes", "rules"):
                continue  # the overlay's links, if any
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, tuple[str, ...], int]]:
    """``(module, names taken from it, line)`` for every import of a package module in ``name``,
    at any depth, except under ``if TYPE_CHECKING``."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: list[tuple[str, tuple[str, ...], int]] = []

    def absolute(level: int, module: str | None) -> str:
        if level == 0:
            return module or ""
        parts = package.split(".")
        return ".".join(parts[: len(parts) - (level - 1)] + ([module] if module else []))

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, (), child.lineno) for a in child.names if a.name in MODULES)
            elif isinstance(child, ast.ImportFrom):
                module = absolute(child.level, child.module)
                for a in child.names:
                    sub = f"{module}.{a.name}"
                    if sub in MODULES:
                        found.append((sub, (), child.lineno))
                    elif module in MODULES:
                        found.append((module, (a.name,), child.lineno))
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def test_the_walk_sees_the_package() -> None:
    assert {"fuselight.pipeline", "fuselight.passes", "fuselight.passes.fuse_gate_up_silu", "fuselight.rules",
            "fuselight.rules.matmul", "fuselight.rules.gemm.analysis", "fuselight.contracts"} <= set(MODULES)
    assert ("fuselight.rules.matmul", ("Matmul",)) in [(m, n) for m, n, _ in _imports("fuselight.passes.fuse_gate_up_silu")]


def test_passes_ask_rules_but_never_import_their_scheduling() -> None:
    bad = []
    for name in MODULES:
        if not name.startswith("fuselight.passes"):
            continue
        for module, names, line in _imports(name):
            if not module.startswith("fuselight.rules"):
                continue
            where = f"{MODULES[name].relative_to(ROOT)}:{line}: {module}"
            if module in ANALYSIS_MODULES:
                continue
            if module not in RULE_MODULES or not names:
                bad.append(f"{where} (a rule's templates or scheduling code, or the rule registry)")
            bad += [f"{where}.{n} (not a rule, its analysis or description)" for n in names
                    if not RULE_NAMES.match(n) or TEMPLATE_NAME.search(n)]
    assert not bad, "passes importing scheduling code:\n" + "\n".join(bad)


def test_rules_never_import_passes() -> None:
    bad = [f"{MODULES[name].relative_to(ROOT)}:{line}: {module}"
           for name in MODULES if name.startswith("fuselight.rules")
           for module, _, line in _imports(name) if module.startswith("fuselight.passes")]
    assert not bad, "rules importing passes:\n" + "\n".join(bad)


def _circles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles() -> None:
    edges = {name: {m for m, _, _ in _imports(name) if m != name} for name in MODULES}
    circles = [sorted(c) for c in _circles(edges)]
    assert not circles, f"import cycles: {circles}"


def test_config_docs_are_at_most_three_lines() -> None:
    """A config's ``_doc`` strings say what it holds in at most three lines (360 characters); the notes
    and measurements behind its values live in ``docs/experiments/``."""
    import json

    def docs(node: object, where: str):
        if isinstance(node, dict):
            for key, value in node.items():
                if key.startswith("_") and "doc" in key:
                    yield f"{where}{key}", value
                yield from docs(value, f"{where}{key}.")

    long = []
    for path in sorted((ROOT / "configs").rglob("*.json")):
        for key, doc in docs(json.loads(path.read_text()), ""):
            lines = doc if isinstance(doc, list) else [doc]
            if len(lines) > 3 or sum(len(line) for line in lines) > 360:
                long.append(f"{path.relative_to(ROOT)}: {key}")
    assert not long, "config docs over three lines:\n" + "\n".join(long)


# Imported only where used: optional on the build host (the GEMM cost model's learner).
OPTIONAL_IMPORTS = ("xgboost",)


def test_passes_and_rules_import_at_the_top() -> None:
    """Under ``passes/`` and ``rules/`` (build-host code) every import is at the top of its module, so
    the imports say what a module depends on; only optional packages are imported where used."""
    inside = []
    for root in (ROOT / "passes", ROOT / "rules"):
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text())
            for func in ast.walk(tree):
                if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(func):
                    if isinstance(node, ast.Import):
                        modules = [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom):
                        modules = ["." * node.level + (node.module or "")]
                    else:
                        continue
                    if any(m.split(".")[0] not in OPTIONAL_IMPORTS for m in modules):
                        inside.append(f"{path.relative_to(ROOT)}:{node.lineno}: {', '.join(modules)}")
    assert not inside, "imports inside functions:\n" + "\n".join(inside)
