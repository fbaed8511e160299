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


def test_spec_replay_counts_steps_drafts_and_cost() -> None:
    """An output that copies its prompt: the first step finds no 2-gram to match, the
    second matches "10 11" at the prompt's start and drafts 12 13 14 (all accepted, plus
    15 from the model): 5 tokens after the first in 2 steps costing 1 and 1 + 3c."""
    from benchmarks.spec_replay import POLICIES, replay

    seqs = [([10, 11, 12, 13, 14, 15], [10, 11, 12, 13, 14, 15])]
    r = replay(seqs, POLICIES["k=3"], 0.5)
    assert r == {"speedup": 5 / 3.5, "tokens_per_step": 2.5, "acceptance": 1.0}
    # k = 2: drafts 12 13 (accepted, + 14), then "13 14" matches: draft 15 is capped away
    # (no token after it to verify with), so one plain step: 3 steps, cost 1 + (1 + 2c) + 1.
    r = replay(seqs, POLICIES["k=2"], 0.5)
    assert r["tokens_per_step"] == 5 / 3 and r["speedup"] == 5 / 4


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


def test_native_ab_breakdown_times_every_side(tmp_path: Path) -> None:
    """`benchmarks.native_ab --breakdown`: the whole call, the call without the LM head (its
    logits and greedy tokens not asked for) and the build without matmuls each run and time."""
    from benchmarks import native_ab
    from ops import quantized_linear

    if not quantized_linear.available():
        pytest.skip("no gcc or no AVX2/FMA/F16C here")
    out = tmp_path / "ab.json"
    native_ab.main(["--rounds", "1", "--calls", "2", "--context", "20", "--breakdown", "--output-json", str(out)])
    sides = json.loads(out.read_text())["sides"]
    assert list(sides) == ["this", "this, no LM head", "this, no matmuls"]
    assert all(s["min_ms"] > 0 for s in sides.values())
    assert sides["this"]["same_logits"] is True
    # without the head's 28 MB read, and without any matmul, the call is shorter
    assert sides["this, no matmuls"]["median_ms"] < sides["this"]["median_ms"]


def test_native_ab_captures_a_verification_step_and_a_prefill(tmp_path: Path) -> None:
    """`benchmarks.native_ab --drafts K` times a step of K + 1 rows a request (it refuses a
    capture of any other shape), `--prefill` the prompts' prefill call (its hidden states
    compared, as it has no logits); each side's result equals itself across calls."""
    from benchmarks import native_ab
    from ops import quantized_linear

    if not quantized_linear.available():
        pytest.skip("no gcc or no AVX2/FMA/F16C here")
    for flags in (["--batch", "2", "--drafts", "2"], ["--prefill", "--context", "30"]):
        out = tmp_path / "ab.json"
        native_ab.main(["--rounds", "1", "--calls", "2", "--context", "20", *flags, "--output-json", str(out)])
        report = json.loads(out.read_text())
        assert report["drafts"] == (2 if "--drafts" in flags else 0)
        assert report["prefill"] == ("--prefill" in flags)
        assert report["sides"]["this"]["same_logits"] is True and report["sides"]["this"]["min_ms"] > 0


def test_native_ab_builds_every_side_for_the_isa_asked(tmp_path: Path) -> None:
    """`benchmarks.native_ab --isa NAME`: the sides are built for NAME (the AVX2-only machines'
    kernels timed on an AVX-512 one), the report says which, and the process goes back to its
    best ISA afterwards."""
    from benchmarks import native_ab
    from ops import cpu_kernels, quantized_linear

    if not quantized_linear.available():
        pytest.skip("no gcc or no AVX2/FMA/F16C here")
    least = cpu_kernels.supported_isas()[-1]
    out = tmp_path / "ab.json"
    native_ab.main(["--isa", least, "--rounds", "1", "--calls", "2", "--context", "20",
                    "--cpu-activations", "float32", "--output-json", str(out)])
    report = json.loads(out.read_text())
    assert report["isa"] == least and report["sides"]["this"]["same_logits"] is True
    assert cpu_kernels.isa() == cpu_kernels.supported_isas()[0]
    with pytest.raises(SystemExit):  # not an ISA this CPU has: refused by the parser
        native_ab.main(["--isa", "no-such-isa"])



def test_linear_ab_repacks_with_each_checkouts_own_code(tmp_path: Path) -> None:
    """`benchmarks.linear_ab`: each side packs the weight with its own checkout's
    quantized_linear.py and multiplies with its own build of the kernel (here a copy of this
    checkout whose integer records end in 64 bytes more, which its kernel never reads: a
    layout of another size), for integer and float activations; the outputs are compared."""
    import shutil

    from benchmarks import linear_ab
    from ops import quantized_linear

    if not quantized_linear.available():
        pytest.skip("no gcc or no AVX2/FMA/F16C here")
    other = tmp_path / "other"
    shutil.copytree(ROOT / "ops", other / "ops", ignore=shutil.ignore_patterns("__pycache__"))
    py = other / "ops" / "quant_records.py"  # its own, not this checkout's, is the one it repacks with
    patched = py.read_text().replace(
        "part.reshape(part.shape[0], tile)\n    return out\n",
        "part.reshape(part.shape[0], tile)\n    return torch.cat([out, torch.zeros(64, dtype=torch.uint8)]) if integer else out\n")
    assert patched != py.read_text()
    py.write_text(patched)
    for activations in ("int8", "float32"):
        out = tmp_path / f"ab-{activations}.json"
        linear_ab.main(["--against", str(other), "--weight", "blk.0.attn_output.weight", "--rows", "3",
                        "--activations", activations, "--rounds", "4", "--output-json", str(out)])
        report = json.loads(out.read_text())
        this, them = report["sides"]["this"], report["sides"]["other"]
        assert report["qtype"] == "Q4_1" and report["shape"] == [576, 576] and report["activations"] == activations
        assert this["same_output"] and them["same_output"]
        assert them["packed_bytes"] == this["packed_bytes"] + (64 if activations == "int8" else 0)
        assert this["min_ms"] > 0 and them["min_ms"] > 0

def test_fused_argmax_ab_times_both_ways_on_the_same_tokens(tmp_path: Path) -> None:
    """`benchmarks.fused_argmax_ab`: steps alternate between the call's greedy tokens and
    numpy's, every generation gives the reference's tokens, and both ways are timed."""
    from benchmarks import fused_argmax_ab
    from ops import quantized_linear

    if not quantized_linear.available():
        pytest.skip("no gcc or no AVX2/FMA/F16C here")
    out = tmp_path / "ab.json"
    fused_argmax_ab.main(["--generations", "2", "--max-tokens", "24", "--output-json", str(out)])
    report = json.loads(out.read_text())
    assert report["same_tokens"] is True
    assert set(report["steps_ms"]) == {"in the call", "numpy after the call"}
    assert all(len(v) >= 8 and min(v) > 0 for v in report["steps_ms"].values())


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


def test_step_python_times_the_python_around_the_call_three_ways(tmp_path: Path) -> None:
    """`benchmarks.step_python`: the real call, a stand-in in warm caches and one after a
    sweep each run their steps; a stand-in's step is far shorter than the real call's, and
    each way's Python a step is positive."""
    from benchmarks import step_python
    from ops import quantized_linear

    if not quantized_linear.available():
        pytest.skip("no gcc or no AVX2/FMA/F16C here")
    # the sampled run also on the AVX2 build, the AVX2-only machines' path
    for extra in ([], ["--sampling", "temperature=0.8,top_p=0.9,seed=2", "--isa", "avx2"]):
        out = tmp_path / "py.json"
        step_python.main(["--steps", "12", "--rounds", "1", "--context", "20", "--sweep-mb", "8", *extra,
                          "--output-json", str(out)])
        report = json.loads(out.read_text())
        assert ("(avx2," in report["info"]["kernels"]) == ("--isa" in extra)
        ways = report["ways"]
        assert list(ways) == ["call", "warm", "swept"]
        assert all(w["steps"] == 8 and w["python_us"] > 0 for w in ways.values())
        assert ways["warm"]["call_ms"] < ways["call"]["call_ms"] / 5


def test_head_screen_bounds_hold_and_leave_no_fewer_candidates_than_the_actual_error(tmp_path: Path) -> None:
    """`benchmarks.head_screen`: on captured greedy decode steps every rigorous bound is at
    least the screen's actual error (the script asserts it), so it leaves at least the rows
    the actual error leaves; exact logits leave one row; the engine's logits are float64's."""
    from benchmarks import head_screen
    from ops import quantized_linear

    if not quantized_linear.available():
        pytest.skip("no gcc or no AVX2/FMA/F16C here")
    out = tmp_path / "screen.json"
    head_screen.main(["--prompts", "1", "--max-tokens", "3", "--bits", "4,2", "--outliers", "0,16",
                      "--output-json", str(out)])
    report = json.loads(out.read_text())
    assert report["steps"] == 2 and report["engine_max_diff"] < 1e-2
    assert report["oracle_exact"]["max"] == 1
    rows = {(r["bits"], r["exact_dims"], r["bound"]): r for r in report["rows"]}
    assert set(rows) == {(b, k, n) for b in (4, 2) for k in (0, 16) for n in ("oracle", "cs")} | {
        (4, 0, "l1"), (2, 0, "l1")}
    for (b, k, n), r in rows.items():
        if n != "oracle":
            oracle = rows[b, k, "oracle"]
            assert r["mean_bound"] > oracle["mean_bound"]
            assert r["candidates"]["median"] >= oracle["candidates"]["median"]
    # fewer bits, a larger error
    assert rows[2, 0, "oracle"]["mean_error"] > rows[4, 0, "oracle"]["mean_error"]
