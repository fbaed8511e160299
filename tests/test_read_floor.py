"""benchmarks.llamacpp_side_by_side.ReadFloor: the bytes one decode step reads, and a floor
sampled around the run it is compared with."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.llamacpp_side_by_side import ReadFloor
from ops import huge_pages
from tests.gguf_tiny import write_tiny_llama
from worker.weights.gguf_reader import GGUFFile


def _bytes(path: Path) -> dict[str, int]:
    return {t.name: t.n_bytes for t in GGUFFile(path).tensors}


def test_a_tied_table_is_read_as_the_head_and_an_untied_one_is_not(tmp_path: Path) -> None:
    tied = write_tiny_llama(tmp_path / "tied.gguf", layers=2)
    untied = write_tiny_llama(tmp_path / "untied.gguf", layers=2, more=lambda w: w.add_tensor(
        "output.weight", np.zeros((32, 64), np.float32)))
    assert ReadFloor(tied, 1, megabytes=4).step_bytes == sum(_bytes(tied).values())
    every = _bytes(untied)
    assert ReadFloor(untied, 1, megabytes=4).step_bytes == sum(every.values()) - every["token_embd.weight"]


def test_the_floor_brackets_the_run_and_is_the_step_at_that_bandwidth(tmp_path: Path) -> None:
    floor = ReadFloor(write_tiny_llama(tmp_path / "m.gguf"), 1, megabytes=8)
    order: list[str] = []
    sample = floor.sample
    floor.sample = lambda seconds: order.append("sample") or sample(seconds)  # type: ignore[method-assign]
    got, f = floor.around(lambda: order.append("run") or "ran", seconds=0.05)
    assert got == "ran" and order == ["sample", "run", "sample"]
    assert f["read_bandwidth_gbs"] > 0.1
    # the bandwidth is recorded to 0.01 GB/s, the floor from the unrounded one
    want = f["read_bandwidth_gbs"] * 1e9 / floor.step_bytes
    assert abs(f["floor_tokens_per_s"] - want) <= 0.006 / f["read_bandwidth_gbs"] * want + 0.01
    assert len(floor.sample(0.05)) >= 1


def test_the_probe_reads_huge_pages_as_the_weights_are_held(tmp_path: Path) -> None:
    # on 4 KB pages a sum read ~25 GB/s where our decode read ~28: no floor (Zen 4)
    floor = ReadFloor(write_tiny_llama(tmp_path / "m.gguf"), 1, megabytes=8)
    if huge_pages.thp_mode() in ("always", "madvise"):
        assert floor.huge_page_bytes > 0
