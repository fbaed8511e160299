"""Issue 8's reliability scenarios at CI scale, against real worker processes.

The same code produces RELIABILITY.md's figures at full scale (`python -m clients.reliability
run all`); here each runs small and every one of its checks must hold: every request
accounted for (completed, refused with RESOURCE_EXHAUSTED, or cancelled by its client), no
block left behind, the worker still SERVING.
"""

from __future__ import annotations

import asyncio

import pytest

from clients.reliability.report import render_one
from clients.reliability.scenarios import SCENARIOS

pytestmark = pytest.mark.slow

SMALL = {
    "storm": {"n": 48, "witnesses": 4, "concurrency": 24, "max_tokens": 32},
    "overload": {"duration_s": 15.0, "max_tokens": 48, "max_num_seqs": 4, "max_waiting": 4,
                 "cancel_fraction": 0.2},
    "sigterm": {"streams": 8, "grace_s": 10.0, "long_tokens": 1500},
    "fault": {"streams": 24, "max_tokens": 24},
    "slow_reader": {"normal": 8, "stalled": 2, "max_tokens": 24},
    "deadline": {"normal": 8, "expiring": 4, "deadline_s": 6.0, "max_tokens": 16},
    "soak": {"duration_s": 24.0, "window_s": 8.0, "max_tokens": 24, "cancel_fraction": 0.1},
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_holds(name: str) -> None:
    rec = asyncio.run(SCENARIOS[name](**SMALL[name]))
    report = render_one(rec.to_json(0.0))  # the report renders every record
    assert rec.checks and report.count("| yes |") + report.count("| **no** |") == len(rec.checks)
    assert rec.ok, "\n".join(rec.failed())


def test_the_soak_calls_a_worker_that_slows_per_request_a_slowdown() -> None:
    """The control for the soak's TTFT check: the same scenario, shorter, against a worker
    whose steps scan a list of the requests it has served (each adds a quarter of a step,
    benchmarks.faulty_worker) fails that check, and only through the slowdown."""
    rec = asyncio.run(SCENARIOS["soak"](duration_s=8.0, window_s=2.0, max_tokens=8,
                                        cancel_fraction=0.0, leak_per_request=0.25))
    (ttft,) = [c for c in rec.checks if c["name"].startswith("TTFT flat")]
    assert not ttft["ok"], ttft["detail"]
    assert rec.figures["ttft_flatness"]["trend_growth"] > 2, rec.figures
    assert all(c["ok"] for c in rec.checks if "every request" in c["name"]), rec.failed()
