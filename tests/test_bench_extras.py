"""llm-worker-bench without its optional extras: what it cannot do is said at start, and the
measurements always reach the JSON file, before anything optional (plot, peer) runs."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clients.bench import plot
from clients.bench.cli import main
from tests import blocked_imports
from tests.test_server import Worker

ROOT = Path(__file__).resolve().parents[1]
INSTALL = "pip install -e '.[bench]'"


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker("--max-num-seqs", "8")
    try:
        yield w.wait_ready()
    finally:
        w.close()


def sweep_argv(target: str, out: Path, *extra: str) -> list[str]:
    return ["run", "--target", target, "--dataset", "random", "--input-len", "8",
            "--output-len", "3", "--num-requests", "4", "--ignore-eos", "--warmup", "0",
            "--request-rate", "1,2,4,inf", "--output-json", str(out), "--no-progress",
            "--seed", "1", *extra]


def test_sweep_without_matplotlib_says_so_at_start_and_writes_its_json(
        worker: Worker, tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    cmd = blocked_imports.command("clients.bench.cli", *sweep_argv(worker.address, out),
                                  blocked=("matplotlib",))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    assert proc.stdout is not None
    lines, json_at_note = [], None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("note:"):
            json_at_note = out.exists()
    assert proc.wait(120) == 0, "".join(lines)
    text = "".join(lines)
    note = ("note: no sweep plot: it needs matplotlib, which is not installed "
            f"({INSTALL}); the results still go to the JSON file")
    assert lines[0].rstrip("\n") == note, text  # the first thing it says
    assert json_at_note is False  # said before the sweep ran, not after
    assert "Traceback" not in text and f"wrote {out}" in text
    result = json.loads(out.read_text())
    assert [r["request_rate"] for r in result["runs"]] == [1.0, 2.0, 4.0, "inf"]
    for run in result["runs"]:
        s = run["summary"]
        assert (s["completed"], s["failed"]) == (4, 0)
        assert s["total_output_tokens"] == 12 and s["output_throughput"] > 0
    assert result["knee"]["request_rate"] in (1.0, 2.0, 4.0, "inf")
    assert "plot" not in result and not out.with_suffix(".png").exists()


def test_asked_for_plot_without_matplotlib_is_refused_before_any_request(
        tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    t0 = time.monotonic()
    # Nothing listens on this target: a refusal at start never gets to connect.
    cmd = blocked_imports.command(
        "clients.bench.cli", *sweep_argv("127.0.0.1:9", out, "--plot", str(tmp_path / "p.png")),
        blocked=("matplotlib",))
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(
        f"error: --plot needs matplotlib, which is not installed ({INSTALL})")
    assert not out.exists() and time.monotonic() - t0 < 60


def test_peer_without_transformers_is_refused_before_any_request(tmp_path: Path) -> None:
    cmd = blocked_imports.command(
        "clients.bench.cli", "run", "--target", "127.0.0.1:9", "--peer", "transformers",
        "--output-json", str(tmp_path / "r.json"), blocked=("transformers",))
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: --peer transformers needs transformers, which is not "
                                  f"installed ({INSTALL})")


def test_a_failing_plot_leaves_the_measurements_in_the_json(
        worker: Worker, tmp_path: Path, monkeypatch, capsys) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("no fonts on this machine")

    monkeypatch.setattr(plot, "plot_sweep", broken)
    out = tmp_path / "sweep.json"
    assert main(sweep_argv(worker.address, out)) == 0
    err = capsys.readouterr().err
    assert f"warning: no plot (RuntimeError: no fonts on this machine); {out} has the results" in err
    result = json.loads(out.read_text())
    assert len(result["runs"]) == 4 and all(r["summary"]["completed"] == 4
                                             for r in result["runs"])
    assert "plot" not in result


def test_startup_times_listening_then_serving(tmp_path: Path) -> None:
    from benchmarks import startup

    out = tmp_path / "startup.json"
    startup.main(["--rounds", "1", "--flags", "--model dummy:smollm2-135m --max-num-seqs 1",
                  "--output-json", str(out)])
    report = json.loads(out.read_text())
    after = report["times"]["after"]
    assert 0 < after["listening"][0] < after["serving"][0] < 120
    assert report["times"]["before"]["listening"] == []  # no --against
    assert "| serving |" in startup.render_markdown(report)


def test_spec_decode_runs_every_side_on_the_asked_activations(tmp_path: Path) -> None:
    from benchmarks import spec_decode

    out = tmp_path / "spec.json"
    spec_decode.main(["--tasks", "typos", "--rounds", "1", "--max-tokens", "12",
                      "--cpu-activations", "int24", "--output-json", str(out)])
    report = json.loads(out.read_text())
    kernels = report["info"]["kernels"]
    assert "int24 activations" in kernels or "torch" in kernels  # no gcc/AVX2: the torch paths
    assert report["sides"] == ["plain", "ngram k=3 n=2..8"]
    assert all(s["same_tokens_as_plain"] for s in report["summary"].values())


def test_spec_decode_served_sides_report_the_workers_counts(tmp_path: Path) -> None:
    """`--served`: a worker per side over gRPC; the same greedy tokens on both, and the drafts
    the speculating worker says it verified for each request (its complete message)."""
    from benchmarks import spec_decode

    out = tmp_path / "served.json"
    spec_decode.main(["--served", "--tasks", "code", "--rounds", "1", "--max-tokens", "24",
                      "--output-json", str(out)])
    report = json.loads(out.read_text())
    assert report["sides"] == ["plain", "ngram k=3 n=2..8"] and report["info"]["served"]
    (rnd,) = report["rounds"]
    plain, spec = rnd["plain"]["code"], rnd["ngram k=3 n=2..8"]["code"]
    assert plain["num_tokens"] == 24 and plain["draft_tokens"] == 0
    assert 0 < spec["accepted_tokens"] <= spec["draft_tokens"]  # renaming a parameter copies code
    assert spec["steps"] < 24  # accepted drafts come several tokens a chunk
    assert all(s["same_tokens_as_plain"] for s in report["summary"].values())


def test_sampler_ops_times_both_sides_of_each_part(tmp_path: Path) -> None:
    """`benchmarks.sampler_ops`: penalties, logprobs and a whole sample call, the reference
    against the C kernels, each timed; the C penalties (a few hundred tokens against [B, V]
    passes) are the faster even at two calls."""
    from benchmarks import sampler_ops
    from ops import cpu_sampling

    if not cpu_sampling.available():
        pytest.skip("no gcc or no AVX2/FMA/F16C here")
    out = tmp_path / "ops.json"
    sampler_ops.main(["--batch-sizes", "1,4", "--repeat", "3", "--output-json", str(out)])
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"1", "4"}
    for parts in results.values():
        assert set(parts) == {"penalties", "logprobs", "sample"}
        assert all(r["reference_ms"] > 0 and r["c_ms"] > 0 for r in parts.values())
    assert results["4"]["penalties"]["ratio"] > 1
