"""benchmarks.llamacpp_side_by_side.ReadFloor: the bytes one decode step reads, and a floor
read between the requests it is compared with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks import llamacpp_side_by_side as sbs
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


def test_a_round_interleaves_the_servers_request_by_request_with_the_floor_read_between(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    floor = ReadFloor(write_tiny_llama(tmp_path / "m.gguf"), 1, megabytes=8)
    events: list[tuple] = []
    gbs = iter(range(10, 100))  # each sample a new bandwidth: 10, 11, ... GB/s
    floor.sample = lambda seconds: events.append(("sample",)) or [float(next(gbs))]  # type: ignore[method-assign]
    tpot = {"ours": iter([20.0, 30.0, 10.0]), "theirs": iter([40.0, 50.0, 45.0])}

    def bench(server, workload, tokenizer, seed=0, extra=()):
        side = server[0]
        events.append(("bench", side, seed, tuple(extra)))
        t = next(tpot[side])
        return {"output_throughput": 1.0, "ttft_ms_median": 5.0, "tpot_ms_median": t,
                "decode_tokens_per_s": 1000.0 / t, "completed": 1}

    monkeypatch.setattr(sbs, "bench", bench)
    out = sbs.paired_one_stream({"ours": ["ours"], "theirs": ["theirs"]}, ["ours", "theirs"], "tok", 2, floor,
                                requests=3, seconds=0.0)
    benches = [e[1:] for e in events if e[0] == "bench"]
    one, rest = ("--num-requests", "1", "--warmup", "1"), ("--num-requests", "1", "--warmup", "0")
    # request i's prompt (seed 1000 r + i) to both, the order turning each request; warm-up once
    assert benches == [("ours", 2000, one), ("theirs", 2000, one), ("theirs", 2001, rest), ("ours", 2001, rest),
                       ("ours", 2002, rest), ("theirs", 2002, rest)]
    # a sample before the first request and after every one: neither server works while it reads
    assert [e[0] for e in events] == ["sample"] + ["bench", "sample"] * 6
    # ours ran 1st, 4th, 5th: between samples (10, 11), (13, 14), (14, 15)
    assert [x["floor"]["read_bandwidth_gbs"] for x in out["ours"]["requests"]] == [10.5, 13.5, 14.5]
    assert [x["floor"]["read_bandwidth_gbs"] for x in out["theirs"]["requests"]] == [11.5, 12.5, 15.5]
    assert out["ours"]["tpot_ms_median"] == 20.0 and out["ours"]["decode_tokens_per_s"] == 50.0
    assert out["theirs"]["decode_tokens_per_s"] == 1000.0 / 45.0 and out["theirs"]["completed"] == 3
    assert out["ours"]["floor"]["read_bandwidth_gbs"] == 13.5
    # each request over its own floor, and the side's median of those
    want = [round((1000.0 / t) / (g * 1e9 / floor.step_bytes), 3) for t, g in ((20, 10.5), (30, 13.5), (10, 14.5))]
    assert [x["over_floor"] for x in out["ours"]["requests"]] == pytest.approx(want, rel=1e-3)
    assert out["ours"]["over_floor"] == sorted(x["over_floor"] for x in out["ours"]["requests"])[1]


def test_a_sample_is_a_sum_over_the_probe(tmp_path: Path) -> None:
    floor = ReadFloor(write_tiny_llama(tmp_path / "m.gguf"), 1, megabytes=8)
    assert len(floor.sample(0.0)) == 1 and len(floor.sample(0.05)) >= 1
    assert all(g > 0.1 for g in floor.sample(0.05))
    f = floor.floor(12.345678)
    assert f["read_bandwidth_gbs"] == 12.35 and f["floor_tokens_per_s"] == round(12.345678e9 / floor.step_bytes, 2)


def test_the_probe_reads_huge_pages_as_the_weights_are_held(tmp_path: Path) -> None:
    # on 4 KB pages a sum read ~25 GB/s where our decode read ~28: no floor (Zen 4)
    floor = ReadFloor(write_tiny_llama(tmp_path / "m.gguf"), 1, megabytes=8)
    if huge_pages.thp_mode() in ("always", "madvise"):
        assert floor.huge_page_bytes > 0
