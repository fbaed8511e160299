"""benchmarks/scheduling.py's priority run, tiny: its recorder reads the engine's step sink
(a StepOutput a step: it once took a list and recorded nothing), every request finishes,
each urgent one has a first-token time, and no block outlives the run."""

from __future__ import annotations

import argparse

from benchmarks.scheduling import run_priority


def test_the_priority_run_records_every_request(default_model) -> None:
    args = argparse.Namespace(kv_gib=0.03, max_num_seqs=4, budget=64, num_low=3, low_tokens=3,
                              num_urgent=2, urgent_tokens=2, first_urgent_s=0.0,
                              urgent_interval_s=0.0, timeout_s=120)
    run = run_priority(default_model, args, with_priorities=True)
    assert run["finished_all"]
    assert run["low_finished"] == 3 and run["urgent_finished"] == 2
    assert run["urgent_ttft_p99_s"] is not None and run["urgent_ttft_p99_s"] > 0
    assert run["free_blocks_after"] == run["kv_blocks"]
