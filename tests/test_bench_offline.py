"""Smoke tests of the in-process benchmarks (benchmarks/): a tiny workload through every
system, and the record each writes (figures beside the engine's config, the commit and a
command relative to the repo root)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import offline
from ops.linear import can_pack

ROOT = Path(__file__).resolve().parents[1]


def as_if_run(monkeypatch, module: str, argv: list[str]) -> list[str]:
    """sys.argv as `python -m module ARGV` makes it (argv[0] the module's absolute path)."""
    monkeypatch.setattr(sys, "argv", [str(ROOT / (module.replace(".", "/") + ".py")), *argv])
    return argv


def assert_recorded_where_and_how(env: dict, command: str, record: dict) -> None:
    """The commit and the command as one runs it from the repo root; no absolute path in
    the whole record (the test's tmp_path outputs are named by their file name alone)."""
    assert re.fullmatch(r"[0-9a-f]{40}", env["git_commit"] or ""), env.get("git_commit")
    assert env["command"] == command
    for text in re.findall(r'"([^"]*)"', json.dumps(record)):
        assert not os.path.isabs(text), f"an absolute path in the record: {text[:200]!r}"


def test_output_lengths_are_long_tailed_and_seeded() -> None:
    lens = offline.output_lengths(64, seed=0)
    assert lens == offline.output_lengths(64, seed=0)
    assert lens != offline.output_lengths(64, seed=1)
    assert sum(n > 200 for n in lens) == 4
    assert sum(n < 50 for n in lens) > 40
    assert min(lens) >= 4 and max(lens) <= 320
    assert max(offline.output_lengths(64, seed=0, max_len=8)) == 8


def test_bench_offline_smoke(default_model, hf_model, tmp_path, capsys, monkeypatch) -> None:
    out = tmp_path / "bench.json"
    argv = as_if_run(monkeypatch, "benchmarks.offline", [
        "--num-requests", "4", "--batch-size", "2", "--peer-batch-size", "4",
        "--max-output-len", "6", "--threads", "1", "--repeat", "2", "--output-json", str(out)])
    # One thread: a few tiny steps gain nothing from two, and on a shared machine torch's
    # worker threads waiting on a busy core make every op slow. Restored afterwards.
    threads = torch.get_num_threads()
    try:
        report = offline.main(argv, loaded=default_model, hf_model=hf_model)
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
    assert_recorded_where_and_how(
        report["machine"], "python -m benchmarks.offline " + " ".join(argv[:-1]) + " bench.json",
        report)
    for name, r in results.items():  # the engine's WorkerConfig beside its figures
        conf = r["engine_config"]
        if name == "transformers":
            assert conf is None
            continue
        assert conf["scheduler"]["max_num_seqs"] == 2
        assert conf["scheduler"]["max_num_batched_tokens"] == 512
        assert conf["scheduler"]["policy"] == ("continuous" if name == "continuous" else "static")
    assert "continuous / engine static" in capsys.readouterr().out
    rendered = offline.render_markdown([report])
    for name, r in results.items():
        assert f"| {name} | {r['batch_size']} | {r['output_tokens']} |" in rendered
    assert "continuous / engine static: **" in rendered


@pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32), reason="torch built without oneDNN")
def test_bench_cpu_ops_smoke(tmp_path) -> None:
    from benchmarks import cpu_ops as bench_cpu_ops

    out = tmp_path / "ops.json"
    report = bench_cpu_ops.main(["--rows", "1,3", "--repeat", "1", "--output-json", str(out)])
    assert json.loads(out.read_text())["linear"] == report["linear"]
    assert [r["rows"] for r in report["linear"]] == [1, 3]
    assert all(r["f_linear_ms"] > 0 and r["onednn_packed_ms"] > 0 for r in report["linear"])
    assert report["rows_differing_from_alone"]["onednn_packed"] == 0  # what ops/linear.py promises


def test_bench_step_variants_and_report(tmp_path, capsys, monkeypatch) -> None:
    from benchmarks import step as bench_step

    out = tmp_path / "step.json"
    argv = as_if_run(monkeypatch, "benchmarks.step", [
        "--variants", "quantized,float32", "--batch-sizes", "1,2", "--steps", "1", "--rounds", "1",
        "--output-json", str(out)])
    bench_step.main(argv)
    record = json.loads(out.read_text())
    rows = record["rows"]
    assert_recorded_where_and_how(
        record["info"], "python -m benchmarks.step " + " ".join(argv[:-1]) + " step.json", record)
    for r in rows:  # each row beside the WorkerConfig it ran under
        assert r["engine_config"]["scheduler"]["max_num_seqs"] == r["batch"]
        assert r["engine_config"]["model"]["cpu_quantized_linear"] == (r["variant"] == "quantized")
    assert [(r["variant"], r["batch"]) for r in rows] == [
        ("quantized", 1), ("float32", 1), ("quantized", 2), ("float32", 2)]
    assert all(r["step_ms"] > 0 and len(r["rounds_ms"]) == 1 for r in rows)
    capsys.readouterr()
    bench_step.main(["--report", str(out)])
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| decode batch | quantized ms/step") and len(table) == 4
    ratio = rows[1]["step_ms"] / rows[0]["step_ms"]
    assert f"**{ratio:.2f}x**" in table[2]
