"""The decode timeline probe's host-side summary (``bench/probes/decode_timeline.py``) on a made-up
timeline whose period, busy time, gaps and exclusive times are known. Its GPU run needs a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench" / "probes"))
import decode_timeline as probe  # noqa: E402


def _steps(n: int, period: float) -> list[tuple[str, float, float]]:
    """Steps of: a 1 us copy, a 3 us idle gap, kernel a (10 us), kernel b launched early (starts 2 us
    before a ends, runs 7 us), a 0.5 us gap, the LM head (20 us); the step lasts ``period``."""
    events = []
    for i in range(n):
        t = 100.0 + i * period
        events += [
            ("Memcpy DtoD (Device -> Device)", t, t + 1),
            ("a_kernel", t + 4, t + 14),
            ("b_kernel", t + 12, t + 19),
            ("lm_head_kernel", t + 19.5, t + 39.5),
        ]
    return events


def test_summary_of_a_known_timeline():
    period = 45.0
    got = probe.timeline_summary(_steps(6, period))
    assert got["marker"] == "lm_head_kernel"  # the longest single run
    assert got["steps"] == 4  # whole steps between the second and the last LM head end
    assert got["period_us"] == pytest.approx(period)
    # covered a step: copy 1 + a..b 15 + LM head 20 = 36; idle: the rest of the 45
    assert got["busy_us"] == pytest.approx(36.0)
    assert got["idle_us"] == pytest.approx(9.0)
    assert got["gaps_us"] == {
        "lm_head_kernel -> Memcpy DtoD (Device -> Device)": pytest.approx(5.5),
        "Memcpy DtoD (Device -> Device) -> a_kernel": pytest.approx(3.0),
        "b_kernel -> lm_head_kernel": pytest.approx(0.5),
    }
    # b launched early counts from a's end; the values add up to busy
    assert got["exclusive_us"]["a_kernel"] == pytest.approx(10.0)
    assert got["exclusive_us"]["b_kernel"] == pytest.approx(5.0)
    assert sum(got["exclusive_us"].values()) == pytest.approx(got["busy_us"])


def test_command_line_needs_an_output():
    with pytest.raises(SystemExit):
        probe.main(["lib.so"])
