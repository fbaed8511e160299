"""Smoke test of the offline benchmark: a tiny workload through all three systems."""

from __future__ import annotations

import json

import pytest
import torch

from clients import bench_offline
from ops.linear import can_pack


def test_output_lengths_are_long_tailed_and_seeded() -> None:
    lens = bench_offline.output_lengths(64, seed=0)
    assert lens == bench_offline.output_lengths(64, seed=0)
    assert lens != bench_offline.output_lengths(64, seed=1)
    assert sum(n > 200 for n in lens) == 4
    assert sum(n < 50 for n in lens) > 40
    assert min(lens) >= 4 and max(lens) <= 320
    assert max(bench_offline.output_lengths(64, seed=0, max_len=8)) == 8


def test_bench_offline_smoke(default_model, hf_model, tmp_path, capsys) -> None:
    out = tmp_path / "bench.json"
    # One thread: a few tiny steps gain nothing from two, and on a shared machine torch's
    # worker threads waiting on a busy core make every op slow. Restored afterwards.
    threads = torch.get_num_threads()
    try:
        report = bench_offline.main(
            ["--num-requests", "4", "--batch-size", "2", "--peer-batch-size", "4",
             "--max-output-len", "6", "--threads", "1", "--repeat", "2", "--output-json", str(out)],
            loaded=default_model, hf_model=hf_model,
        )
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))

    results = report["results"]
    assert set(results) == {"continuous", "static", "static-padded", "transformers"}
    work = report["workload"]
    assert work["num_requests"] == 4 and max(work["output_lens"]) <= 6
    for name, r in results.items():
        assert r["requests"] == 4 and r["output_tokens"] == work["output_tokens"]
        assert r["output_tok_per_s"] > 0 and r["wall_s"] > 0
        # two rounds each; the reported one is the median (the faster of two)
        assert len(r["rounds_wall_s"]) == 2 and r["wall_s"] == min(r["rounds_wall_s"])
        assert r["batch_size"] == (4 if name == "transformers" else 2)
        assert 0 < r["mean_batch_occupancy"] <= r["batch_size"]

    tps = {k: r["output_tok_per_s"] for k, r in results.items()}
    assert report["ratios"] == {
        "continuous / transformers static": pytest.approx(tps["continuous"] / tps["transformers"]),
        "continuous / engine static": pytest.approx(tps["continuous"] / tps["static"]),
        "continuous / engine static, padded": pytest.approx(tps["continuous"] / tps["static-padded"]),
        "engine static, padded / transformers static":
            pytest.approx(tps["static-padded"] / tps["transformers"]),
    }
    # Both static modes take a step per token of each batch's longest member (the first
    # comes from the prefill); the padded one computes every row of those steps.
    lens = work["output_lens"]
    batches = sum(max(lens[b : b + 2]) for b in range(0, 4, 2))
    assert results["static"]["steps"] == results["static-padded"]["steps"] == batches
    for other in ("static", "static-padded"):  # a design contract: batch invariance
        assert report["agreement"][f"continuous vs {other}"]["matching"] == 4
    assert report["machine"]["torch"] == torch.__version__
    assert "continuous / engine static" in capsys.readouterr().out
    rendered = bench_offline.render_markdown([report])
    for name, r in results.items():
        assert f"| {name} | {r['batch_size']} | {r['output_tokens']} |" in rendered
    assert "continuous / engine static: **" in rendered


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="torch built without oneDNN")
def test_bench_cpu_ops_smoke(tmp_path) -> None:
    from clients import bench_cpu_ops

    out = tmp_path / "ops.json"
    report = bench_cpu_ops.main(["--rows", "1,3", "--repeat", "1", "--output-json", str(out)])
    assert json.loads(out.read_text())["linear"] == report["linear"]
    assert [r["rows"] for r in report["linear"]] == [1, 3]
    assert all(r["f_linear_ms"] > 0 and r["onednn_packed_ms"] > 0 for r in report["linear"])
    assert report["rows_differing_from_alone"]["onednn_packed"] == 0  # what ops/linear.py promises


def test_bench_step_variants_and_report(tmp_path, capsys) -> None:
    from clients import bench_step

    out = tmp_path / "step.json"
    bench_step.main(["--variants", "quantized,float32", "--batch-sizes", "1,2", "--steps", "1",
                     "--rounds", "1", "--output-json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["batch"]) for r in rows] == [
        ("quantized", 1), ("float32", 1), ("quantized", 2), ("float32", 2)]
    assert all(r["step_ms"] > 0 and len(r["rounds_ms"]) == 1 for r in rows)
    capsys.readouterr()
    bench_step.main(["--report", str(out)])
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| decode batch | quantized ms/step") and len(table) == 4
    ratio = rows[1]["step_ms"] / rows[0]["step_ms"]
    assert f"**{ratio:.2f}x**" in table[2]
