"""`benchmarks.ab`, the one A/B tool: sides parsed, rounds alternated, the paired ratio's
direction, the JSON it writes, each workload on a tiny run, and a side's code that really is
its own checkout's (in a process of its own, and in the kernels' builds)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
from pathlib import Path

import pytest

from benchmarks import ab
from ops import cpu_kernels, quantized_linear
from worker.weights import default_model_path
from worker.weights.gguf_reader import GGUFFile

ROOT = Path(__file__).resolve().parents[1]
needs_kernels = pytest.mark.skipif(not quantized_linear.available(), reason="no gcc or no AVX2/FMA/F16C here")


def run(tmp_path: Path, *argv: str) -> dict:
    out = tmp_path / "ab.json"
    ab.main([*argv, "--output-json", str(out)])
    report = json.loads(out.read_text())
    assert report["tool"] == "benchmarks.ab" and report["workload"] == argv[0]
    assert report["environment"]["command"].startswith(f"python -m benchmarks.ab {argv[0]} ")
    return report


def test_a_side_is_a_checkout_its_environment_and_its_flags(tmp_path: Path) -> None:
    side = ab.parse_side("passive=.,OMP_WAIT_POLICY=passive,--kv-cache-dtype=float16,--no-cpu-huge-pages")
    assert (side.name, side.root, side.env) == ("passive", ROOT, {"OMP_WAIT_POLICY": "passive"})
    assert side.flags == ["--kv-cache-dtype=float16", "--no-cpu-huge-pages"]
    for bad in ("nameonly", "=.", f"x={tmp_path}"):  # no path, no name, not a checkout
        with pytest.raises(Exception, match="--side"):
            ab.parse_side(bad)
    with pytest.raises(SystemExit):  # two sides of one name
        ab.main(["step", "--side", "a=.", "--side", "a=.,--cpu-activations=float32"])


def test_the_paired_ratio_says_above_one_when_the_side_is_ahead() -> None:
    """Times: first / side; rates: side / first; the median over rounds of each round's pair,
    so a round where the whole machine was slow moves both sides alike."""
    rounds = [{"a": {"step_ms": [10.0, 12.0], "decode_tok_s": [100.0]}, "b": {"step_ms": [5.0], "decode_tok_s": [200.0]}},
              {"a": {"step_ms": [40.0], "decode_tok_s": [25.0]}, "b": {"step_ms": [20.0], "decode_tok_s": [50.0]}},
              {"a": {"step_ms": [10.0], "decode_tok_s": [100.0]}, "b": {"step_ms": [50.0], "decode_tok_s": [20.0]}}]
    s = ab.summarize(rounds, ["a", "b"])
    assert s["step_ms"]["vs_a"] == {"b": 2.0} and s["decode_tok_s"]["vs_a"] == {"b": 2.0}
    assert not s["step_ms"]["higher_is_better"] and s["decode_tok_s"]["higher_is_better"]
    assert s["step_ms"]["sides"]["a"] == {"median": 11.0, "p10": 10.0, "p90": 40.0, "min": 10.0, "max": 40.0, "n": 4}


def test_step_two_settings_alternate_in_one_process(tmp_path: Path) -> None:
    report = run(tmp_path, "step", "--side", "int16=.,--cpu-activations=int16", "--side", "f32=.,--cpu-activations=float32",
                 "--batch-sizes", "1,2", "--steps", "3", "--rounds", "2", "--warmup", "0", "--context", "8")
    assert report["mode"] == "in-process" and [s["name"] for s in report["sides"]] == ["int16", "f32"]
    assert [s["flags"] for s in report["sides"]] == [["--cpu-activations=int16"], ["--cpu-activations=float32"]]
    assert len(report["rounds"]) == 2
    for rnd in report["rounds"]:
        for side in ("int16", "f32"):
            assert set(rnd[side]) == {"step_ms b=1", "decode_tok_s b=1", "step_ms b=2", "decode_tok_s b=2"}
            assert len(rnd[side]["step_ms b=2"]) == 3 and min(rnd[side]["step_ms b=2"]) > 0
    s = report["summary"]["step_ms b=1"]
    assert s["sides"]["f32"]["n"] == 6 and s["sides"]["f32"]["min"] <= s["sides"]["f32"]["median"]
    assert s["vs_int16"]["f32"] > 0
    kernels = report["details"]["kernels"]
    if "fused C" in kernels["int16"]:  # the setting reached the engine
        assert "float32 activations" in kernels["f32"] and "float32 activations" not in kernels["int16"]


def _patched_checkout(tmp_path: Path) -> Path:
    """A checkout whose worker/ is a copy with a mark in its runner's kernel description."""
    other = tmp_path / "other"
    other.mkdir()
    for name in ("scheduler", "kvcache", "ops", "protos", "clients", "benchmarks"):
        (other / name).symlink_to(ROOT / name)
    shutil.copytree(ROOT / "worker", other / "worker", ignore=shutil.ignore_patterns("__pycache__"))
    runner = other / "worker" / "model_runner.py"
    runner.write_text(runner.read_text() + "\n\n_described = ModelRunner.describe_kernels\n"
                      "ModelRunner.describe_kernels = lambda self: 'OTHER CHECKOUT ' + _described(self)\n")
    return other


def test_another_checkout_runs_its_own_code_in_a_process_of_its_own(tmp_path: Path) -> None:
    other = _patched_checkout(tmp_path)
    report = run(tmp_path, "prefill", "--side", f"before={other}", "--side", "after=.,AB_TEST_SIDE=1",
                 "--prompts", "16", "--rounds", "1", "--warmup", "0")
    assert report["mode"] == "processes"
    kernels = report["details"]["kernels"]
    assert kernels["before"].startswith("OTHER CHECKOUT ") and not kernels["after"].startswith("OTHER")
    assert report["sides"][1]["env"] == {"AB_TEST_SIDE": "1"}
    assert not os.path.isabs(report["sides"][0]["root"])
    assert report["rounds"][0]["before"]["prefill_s p=16"][0] > 0


def test_offline_generates_the_whole_set(tmp_path: Path) -> None:
    report = run(tmp_path, "offline", "--num-requests", "3", "--max-tokens", "4", "--context", "8",
                 "--rounds", "1", "--warmup", "0")
    assert report["sides"] == [{"name": "this", "root": ".", "env": {}, "flags": []}]
    assert report["summary"]["output_tok_s"]["higher_is_better"]
    assert report["summary"]["output_tok_s"]["sides"]["this"]["median"] > 0


@needs_kernels
def test_native_sides_of_settings_and_the_breakdown(tmp_path: Path) -> None:
    """Two settings' engines (float32 and float16 KV caches), this checkout's build; the
    breakdown's calls without the head and without the matmuls are shorter than the call, the
    one reading the weights in the matmuls' place longer than the one without them; the
    plain sum is timed over the bytes of the records every linear holds (the tied head once),
    and each round's ratios are its medians'."""
    report = run(tmp_path, "native", "--side", "f32=.", "--side", "f16=.,--kv-cache-dtype=float16",
                 "--rounds", "2", "--warmup", "0", "--calls", "3", "--context", "20", "--breakdown")
    first = report["rounds"][0]["f32"]
    assert set(first) == {"call_ms", "call_ms no LM head", "call_ms no matmuls", "call_ms reads only",
                          "sum_ms of the weights' bytes"}
    assert set(report["rounds"][0]["f16"]) == {"call_ms"}
    assert report["details"]["same_output"] == {"f32": True, "f16": True}
    assert "KV cache float16" in report["details"]["kernels"]["f16"]
    summary = report["summary"]
    median = {m: summary[m]["sides"]["f32"]["median"] for m in first}
    assert median["call_ms no matmuls"] < median["call_ms"]
    assert median["call_ms no matmuls"] < median["call_ms reads only"]

    # the default model's records: its file's tensors, the tied embedding/head once, repacked
    # a few percent larger at most
    file_bytes = sum(t.n_bytes for t in GGUFFile(default_model_path()).tensors if "norm" not in t.name)
    held = report["details"]["weight_bytes"]
    assert 0.95 * file_bytes < held < 1.15 * file_bytes
    # the read-only build reads them: no 2-core machine streams ~100 MB faster than 200 GB/s
    assert median["call_ms reads only"] - median["call_ms no matmuls"] > held / 200e9 * 1e3
    ratios = report["details"]["breakdown_ratios"]
    assert {k: v["n"] for k, v in ratios.items()} == {"call over reads only": 2, "reads only over sum": 2,
                                                       "call over sum": 2}
    for r in report["rounds"]:
        med = {m: statistics.median(v) for m, v in r["f32"].items()}
        assert med["call_ms"] / med["sum_ms of the weights' bytes"] in (ratios["call over sum"]["min"],
                                                                         ratios["call over sum"]["max"])


@needs_kernels
def test_native_captures_a_verification_step_a_prefill_and_builds_for_the_isa_asked(tmp_path: Path) -> None:
    for flags in (["--batch", "2", "--drafts", "2"], ["--prefill", "--context", "30"]):
        report = run(tmp_path, "native", "--rounds", "1", "--warmup", "0", "--calls", "2", "--context", "20", *flags)
        assert report["options"]["drafts"] == (2 if "--drafts" in flags else 0)
        assert report["options"]["prefill"] == ("--prefill" in flags)
        assert report["details"]["same_output"] == {"this": True}
    least = cpu_kernels.supported_isas()[-1]
    report = run(tmp_path, "native", "--isa", least, "--side", "f32=.,--cpu-activations=float32",
                 "--rounds", "1", "--warmup", "0", "--calls", "2", "--context", "20")
    assert report["isa"] == least and f"({least}," in report["details"]["kernels"]["f32"]
    assert cpu_kernels.isa() == cpu_kernels.supported_isas()[0]  # back to the best afterwards


@needs_kernels
def test_linear_repacks_with_each_checkouts_own_code(tmp_path: Path) -> None:
    """Each side packs the weight with its own checkout's code (ops/quant_records.py, what
    writes the records) and multiplies with its own build (here a copy whose integer records
    end in 64 bytes more, which its kernel never reads: a layout of another size); the
    outputs are compared."""
    other = tmp_path / "other"
    (other / "worker").mkdir(parents=True)  # a checkout, as far as a side's path goes
    shutil.copytree(ROOT / "ops", other / "ops", ignore=shutil.ignore_patterns("__pycache__"))
    py = other / "ops" / "quant_records.py"
    target = "        list(pool.map(chunk, range(0, n, step)))  # list(): a chunk's error raised here\n    return out\n"
    assert py.read_text().count(target) == 1, "the test no longer finds where the records are written"
    py.write_text(py.read_text().replace(
        target, target.replace("return out", "return torch.cat([out, torch.zeros(64, dtype=torch.uint8)]) if integer else out")))
    for activations in ("int8", "float32"):
        report = run(tmp_path, "linear", "--side", f"this=.,--cpu-activations={activations}",
                     "--side", f"other={other},--cpu-activations={activations}", "--weight", "blk.0.attn_output.weight",
                     "--rows", "3", "--calls", "2", "--rounds", "2", "--warmup", "0")
        d = report["details"]
        assert d["qtype"] == "Q4_1" and d["shape"] == [576, 576]
        assert d["same_output"] == {"this": True, "other": True}
        assert d["sides"]["other"]["packed_bytes"] == d["sides"]["this"]["packed_bytes"] + (64 if activations == "int8" else 0)
        assert report["summary"]["call_ms"]["sides"]["other"]["n"] == 4


@pytest.mark.slow
def test_served_measures_each_sides_worker_through_the_bench(tmp_path: Path) -> None:
    report = run(tmp_path, "served", "--side", "one=.", "--side", "two=.,--stream-interval=2", "--rounds", "1",
                 "--warmup", "0", "--bench-arg=--num-requests=2", "--bench-arg=--output-len=8")
    assert report["mode"] == "servers"
    for side in ("one", "two"):
        got = report["rounds"][0][side]
        assert set(got) == {"one_stream decode_tok_s", "one_stream output_tok_s", "one_stream ttft_ms"}
        assert all(v[0] > 0 for v in got.values())
    assert "--num-requests=2" in report["details"]["bench_args"]["one_stream"]
