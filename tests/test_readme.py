"""The README stays true: its pass table is MLC-LLM's pipeline as the baseline runs it, and its commands exist."""

import re
from pathlib import Path

from fuselight.cli import _parser
from fuselight.pipeline import BASELINE_PASSES

README = Path(__file__).resolve().parent.parent / "README.md"


def test_baseline_pass_table_matches_pipeline():
    text = README.read_text()
    table = text.split("<!-- baseline-passes")[1].split("<!-- /baseline-passes -->")[0]
    rows = [line.split("|")[1:4] for line in table.splitlines() if re.match(r"^\| \d ", line)]
    listed = [(int(phase), name.strip(), ours.strip()) for phase, name, ours in rows]
    assert listed == [(p.phase, p.name, p.ours) for p in BASELINE_PASSES]


def test_readme_commands_parse():
    text = README.read_text()
    commands = re.findall(r"^(?:python3 -m )?fuselight (.+?)(?:\s+#.*)?$", text, flags=re.M)
    assert len(commands) >= 5
    for command in commands:
        argv = [a for a in command.replace("\\", "").split() if a]
        _parser().parse_args(argv)


def test_setup_commands_are_the_ci_commands():
    ci = (README.parent / ".ci" / "run").read_text()
    assert 'pip install -e ".[test]" && python3 -m pytest -q' in README.read_text()
    assert 'python3 -m pip install -q -e ".[test]"' in ci and "python3 -m pytest -q" in ci
