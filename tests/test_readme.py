"""The README stays true and short: its examples run, its commands parse, its setup is CI's; the
pass table of docs/pipelines.md is MLC-LLM's pipeline as the baseline runs it."""

import re
from pathlib import Path

import pytest
from fuselight.cli import _parser
from fuselight.pipeline import BASELINE_PASSES

README = Path(__file__).resolve().parent.parent / "README.md"
PIPELINES_DOC = README.parent / "docs" / "pipelines.md"
MAX_README_LINES = 150


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= MAX_README_LINES


@pytest.mark.slow
def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks
    for block in blocks:
        scope: dict = {}
        exec(compile(block, str(README), "exec"), scope)  # noqa: S102 - the README's own code
    assert scope["ex"] is not None
    # The graph passes and the rules did something: fused functions, scheduled kernels.
    assert any("fuselight.rule" in (f.attrs or {}) for f in scope["rewritten"].functions.values()
               if hasattr(f, "attrs") and f.attrs is not None)
    assert any((f.attrs or {}).get("tirx.is_scheduled") for f in scope["scheduled"].functions.values()
               if hasattr(f, "attrs") and f.attrs is not None)


def test_baseline_pass_table_matches_pipeline():
    text = PIPELINES_DOC.read_text()
    table = text.split("<!-- baseline-passes")[1].split("<!-- /baseline-passes -->")[0]
    rows = [line.split("|")[1:4] for line in table.splitlines() if re.match(r"^\| \d ", line)]
    listed = [(int(phase), name.strip(), ours.strip()) for phase, name, ours in rows]
    assert listed == [(p.phase, p.name, p.ours) for p in BASELINE_PASSES]


def test_readme_commands_parse():
    text = README.read_text()
    commands = re.findall(r"^(?:python3 -m )?fuselight (.+?)(?:\s+#.*)?$", text, flags=re.M)
    assert len(commands) >= 4
    for command in commands:
        argv = [a for a in command.replace("\\", "").split() if a]
        _parser().parse_args(argv)


def test_setup_commands_are_the_ci_commands():
    ci = (README.parent / ".ci" / "run").read_text()
    assert 'pip install -e ".[test]" && python3 -m pytest -q' in README.read_text()
    assert 'python3 -m pip install -q -e ".[test]"' in ci and "python3 -m pytest -q" in ci
