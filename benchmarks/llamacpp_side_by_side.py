"""Side by side with llama.cpp's `llama-server` on this machine (issue 21): the same GGUF,
the same prompts (the bench client's seeded datasets, sent as text to both), both
streaming, the same number of threads, one server working at a time.

    python -m benchmarks.llamacpp_side_by_side --llama-server PATH --rounds 5 \\
        --output-json bench-results/llamacpp-side-by-side.json

`--read-floor` runs the one-stream workload request by request, the two servers' requests
interleaved and the memory floor read between them (`paired_one_stream`, ReadFloor: a sum
over huge pages; the machine's read bandwidth moves within seconds), and records each run's
decode rate over its floor, for both servers.

`--rounds N` runs each workload N times a side, alternating between the two servers (ours
first in even rounds, theirs first in odd ones), both up for the whole workload. This
project's shared machines drift by 10-30% within a minute, so a side measured after the
other can win or lose by the drift alone (one stream, five one-round runs in a row on one
Zen 3: 0.996x to 1.47x). A ratio is the median of the rounds' ratios, each round's two runs
back to back; each side's figures are its medians over rounds. Round r's prompts come from
seed r (both sides the same), so no round finds an earlier round's prompts in either
server's prefix cache.

`../shared/tools/build_llamacpp.sh` builds `llama-server` (it prints its path). Four
workloads, each through `llm-worker-bench` (OpenAI backend for llama.cpp, gRPC for ours):

- one stream alone: chat prompts, 128 output tokens (EOS ignored), one at a time; decode
  tokens/s after the first token = 1000 / median time per output token;
- a long prompt alone: ~1,650 tokens of text, 1 output token; time to first token;
- long context: the same length of prompt, then 128 output tokens (EOS ignored); decode
  tokens/s after the first token;
- 64 chat streams at once: output tokens/s.

llama-server runs with one slot (`-np 1 -c 4096`) for the first three, as one would run it
for one user (with 64 slots its one stream decodes slower), and with 64 slots (`-np 64
-c 131072`) for the third.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from clients.bench.environment import environment
from worker.weights import default_model_path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LLAMA_SERVER = (Path.home() / ".cache/llamacpp-peer/lcsrc/llama_cpp_python-0.3.36"
                        "/vendor/llama.cpp/build/bin/llama-server")
WORKLOADS = {
    # name: bench arguments
    "one_stream": ["--dataset", "chat", "--num-requests", "6", "--max-concurrency", "1",
                   "--output-len", "128", "--ignore-eos", "--warmup", "1"],
    "long_prompt": ["--dataset", "random", "--input-len", "1650", "--output-len", "1",
                    "--num-requests", "3", "--max-concurrency", "1", "--ids-input", "text",
                    "--warmup", "1"],
    # One person deep in a conversation: decode over ~1,650 tokens of context, where each
    # step's attention reads the whole cache (ours float32, llama.cpp's f16).
    "long_context": ["--dataset", "random", "--input-len", "1650", "--output-len", "128",
                     "--ignore-eos", "--num-requests", "3", "--max-concurrency", "1",
                     "--ids-input", "text", "--warmup", "1"],
    "64_streams": ["--dataset", "chat", "--num-requests", "64", "--max-concurrency", "64",
                   "--ignore-eos", "--warmup", "2"],
}


# llama-server's slots (-np) per workload; -c is 4096 for one slot, 2048 per slot for 64.
SLOTS = {"one_stream": 1, "long_prompt": 1, "long_context": 1, "64_streams": 64}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_server(path: Path, threads: int, slots: int, ctx_per_slot: int, model: Path | None = None) -> Iterator[str]:
    port = free_port()
    cmd = [str(path), "-m", str(model or default_model_path()), "-t", str(threads), "-tb", str(threads),
           "-np", str(slots), "-c", str(slots * ctx_per_slot), "--host", "127.0.0.1",
           "--port", str(port), "--no-webui"]
    env = {**os.environ, "LD_LIBRARY_PATH": str(path.parent)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"llama-server exited {proc.returncode}: {cmd}"
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            assert time.monotonic() < end, "llama-server not ready in 120 s"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@contextlib.contextmanager
def our_worker(extra: list[str], root: Path = ROOT, env: dict[str, str] | None = None) -> Iterator[str]:
    """An `llm-worker serve` of the checkout at `root` (its code first on the path), with
    `env` over this process's environment; yields its address once it serves."""
    cmd = [sys.executable, "-m", "worker.cli", "serve", "--port", "0", *extra]
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})})
    assert proc.stderr is not None
    address: list[str] = []
    ready = threading.Event()

    def read() -> None:  # the address, then "serving ... on" once the model is loaded
        for line in proc.stderr:  # type: ignore[union-attr]
            m = re.search(r"listening on (\S+):(\d+)", line)
            if m and not address:
                address.append(f"{m.group(1)}:{m.group(2)}")
            if address and re.search(r"serving .* on ", line):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(180), "llm-worker serve did not start"
        yield address[0]
    finally:
        proc.terminate()
        proc.wait(30)


def write_gguf_tokenizer(folder: Path, model: Path | None = None) -> str:
    """The GGUF's tokenizer (the default model's unless `model`), as the worker builds it, as a
    tokenizer.json in `folder` (the bench client's client-side tokenizer for text datasets)."""
    from worker.tokenizer import Tokenizer

    path = folder / "tokenizer.json"
    path.write_text(Tokenizer.from_gguf(model or default_model_path())._tok.to_str())
    return str(path)


# workload: (ratio's name, metric, True when ours / theirs, False when theirs / ours); above 1
# ours is ahead (decodes faster, reaches the first token sooner, streams more).
RATIOS = {"one_stream": ("one_stream_decode", "decode_tokens_per_s", True),
          "long_prompt": ("long_prompt_ttft_theirs_over_ours", "ttft_ms_median", False),
          "long_context": ("long_context_decode", "decode_tokens_per_s", True),
          "64_streams": ("64_streams_output_throughput", "output_throughput", True)}


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]
            if isinstance(runs[0][k], (int, float))}


def bench(server: list[str], workload: str, tokenizer: str, seed: int = 0,
          extra: Sequence[str] = ()) -> dict[str, Any]:
    """One `llm-worker-bench run` of `workload` (plus `extra` arguments) against `server`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "clients.bench.cli", "run", *server, *WORKLOADS[workload], *extra,
               "--tokenizer", tokenizer, "--seed", str(seed), "--no-progress", "--output-json", str(out)]
        done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True)
        if done.returncode:
            raise SystemExit(f"llm-worker-bench failed ({done.returncode}):\n{done.stderr[-2000:]}")
        summary = json.loads(out.read_text())["runs"][0]["summary"]
    return {"output_throughput": summary["output_throughput"],
            "ttft_ms_median": summary["ttft_ms"]["median"],
            "tpot_ms_median": summary["tpot_ms"]["median"],
            "decode_tokens_per_s": 1000.0 / summary["tpot_ms"]["median"]
            if summary["tpot_ms"]["median"] else None,
            "completed": summary.get("completed")}


class ReadFloor:
    """One stream's memory floor: the bytes a decode step reads (every tensor of the file but
    the token embedding, which a step reads one row of, unless it is also the tied head) over
    this machine's read bandwidth (a float32 sum over `megabytes` on `threads` threads, in
    huge pages as the worker holds its weights: on 4 KB pages the same sum reads ~25 GB/s
    where it reads ~32 in huge pages, and our decode outran that "floor" by 12%; Zen 4,
    2026-12-02). 128 MB reads as fast as 512 MB here, in 2-8 ms.

    The bandwidth this VM gets moves between ~17 and ~65 GB/s within seconds (a sum every
    second for a minute; Zen 4, 2026-12-02), so a floor read for a second before and after
    a ~17 s run was often another moment's: one round read 61 GB/s around our run and our
    decode ran at 0.50 of it, another read 34 and ours ran at 0.93 (BENCHMARKS.md run lc14).
    Nor can it be read while a server decodes: the sum's threads then share the two cores
    with the server's and read about half. `paired_one_stream` reads it between requests."""

    def __init__(self, model: Path, threads: int, megabytes: int = 128) -> None:
        import torch

        from ops import huge_pages
        from worker.weights.gguf_reader import GGUFFile

        f = GGUFFile(model)
        names = {t.name for t in f.tensors}
        self.step_bytes = sum(t.n_bytes for t in f.tensors
                              if t.name != "token_embd.weight" or "output.weight" not in names)
        torch.set_num_threads(threads)
        self.probe = huge_pages.arena(megabytes * 1024 * 1024).view(torch.float32)
        self.probe.fill_(1.0)
        self.huge_page_bytes = huge_pages.huge_bytes_at(self.probe.data_ptr())
        self.probe.sum()  # warm-up

    def sample(self, seconds: float) -> list[float]:
        """Read bandwidths (GB/s), one a sum, for about `seconds` (at least one)."""
        out, end = [], time.perf_counter() + seconds
        while not out or time.perf_counter() < end:
            t0 = time.perf_counter()
            self.probe.sum()
            out.append(self.probe.numel() * 4 / (time.perf_counter() - t0) / 1e9)
        return out

    def floor(self, gbs: float) -> dict[str, float]:
        """The bandwidth and the tokens/s of a step reading `step_bytes` at it."""
        return {"read_bandwidth_gbs": round(gbs, 2), "floor_tokens_per_s": round(gbs * 1e9 / self.step_bytes, 2)}


def paired_one_stream(targets: dict[str, list[str]], order: list[str], tokenizer: str, r: int,
                      floor: ReadFloor, requests: int = 6, seconds: float = 0.3) -> dict[str, dict[str, Any]]:
    """Round `r` of the one-stream workload with the floor read between requests: request i
    (its prompt from seed 1000 r + i, the same for both) to one server, then the other
    (`order` reversed on odd i), each a one-request bench run, the floor sampled for
    `seconds` before and after each with neither server working. A request's floor is the
    median of the samples on its two sides (~3 s apart); a side's round gives its median
    TPOT's decode rate, as a six-request run does, and its median request over its floor."""
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in order}
    last = floor.sample(seconds)
    for i in range(requests):
        for side in (order if i % 2 == 0 else order[::-1]):
            got = bench(targets[side], "one_stream", tokenizer, seed=1000 * r + i,
                        extra=["--num-requests", "1", "--warmup", "1" if i == 0 else "0"])
            after = floor.sample(seconds)
            f = floor.floor(statistics.median(last + after))
            last = after
            runs[side].append({**got, "floor": f, "over_floor": round(got["decode_tokens_per_s"] / f["floor_tokens_per_s"], 3)})
    out = {}
    for side, each in runs.items():
        # the requests' medians (over_floor's too), but for the rate, which is the median
        # TPOT's (not the median of six rates), and the count, which adds up
        med = _medians(each)
        out[side] = {**med, "decode_tokens_per_s": 1000.0 / med["tpot_ms_median"],
                     "completed": sum(x["completed"] or 0 for x in each),
                     "floor": floor.floor(statistics.median(x["floor"]["read_bandwidth_gbs"] for x in each)),
                     "requests": each}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA_SERVER)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=Path, default=None,
                    help="a GGUF file both servers load (default: the embedded default model), e.g. one "
                         "of benchmarks/make_gguf_models.py's")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer.json for the bench's text (default: the worker's, exported)")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="extra `llm-worker serve` flags (repeatable)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=1, help="alternating runs a side per workload")
    ap.add_argument("--read-floor", action="store_true",
                    help="run one stream request by request, the servers interleaved, with the memory "
                         "floor read between requests (paired_one_stream), and record each run over its floor")
    ap.add_argument("--output-json", type=Path, default=None)
    args = ap.parse_args()
    assert args.llama_server.exists(), f"no llama-server at {args.llama_server}"
    names = [w for w in args.workloads.split(",") if w]
    tok = args.tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        if tok is None:
            tok = write_gguf_tokenizer(Path(tmp), args.model)
        results: dict[str, dict[str, Any]] = {"llm-worker": {}, "llama.cpp": {}}
        rounds: dict[str, list[dict[str, Any]]] = {}
        os.environ.update({"OMP_NUM_THREADS": str(args.threads)})
        serve_args = [*(["--model", str(args.model)] if args.model else []), *args.serve_arg]
        floor = ReadFloor(args.model or default_model_path(), args.threads) if args.read_floor else None
        with our_worker(serve_args) as addr:
            # one slot for one stream (as one would run it), 64 for 64 streams
            for w in names:
                slots = SLOTS[w]
                with llama_server(args.llama_server, args.threads, slots,
                                  4096 if slots == 1 else 2048, args.model) as url:
                    targets = {"llm-worker": ["--backend", "grpc", "--target", addr],
                               "llama.cpp": ["--backend", "openai", "--base-url", url]}
                    rounds[w] = []
                    for r in range(args.rounds):
                        order = list(targets) if r % 2 == 0 else list(targets)[::-1]
                        if floor is not None and w == "one_stream":
                            one = paired_one_stream(targets, order, tok, r, floor)
                        else:
                            one = {side: bench(targets[side], w, tok, seed=r) for side in order}
                        rounds[w].append(one)
                        for side in order:
                            print(side, w, f"round {r + 1}", {k: v for k, v in one[side].items() if k != "requests"},
                                  flush=True)
                for side in results:
                    results[side][w] = _medians([one[side] for one in rounds[w]])
    ratios: dict[str, float] = {}
    round_ratios: dict[str, list[float]] = {}
    for w, (key, metric, ours_over_theirs) in RATIOS.items():
        if w in names:
            each = [one["llm-worker"][metric] / one["llama.cpp"][metric] if ours_over_theirs
                    else one["llama.cpp"][metric] / one["llm-worker"][metric] for one in rounds[w]]
            round_ratios[key] = each
            ratios[key] = statistics.median(each)
    version = subprocess.run([str(args.llama_server), "--version"], capture_output=True,
                             text=True, env={"LD_LIBRARY_PATH": str(args.llama_server.parent)})
    record = {"results": results, "ratios": ratios, "round_ratios": round_ratios,
              "rounds": rounds, "threads": args.threads,
              "workloads": {w: WORKLOADS[w] for w in names},
              "llama_server_version": (version.stdout + version.stderr).strip()[-300:],
              "llama_server_flags": {w: f"-t {args.threads} -tb {args.threads} -np {SLOTS[w]} -c "
                                     f"{4096 if SLOTS[w] == 1 else SLOTS[w] * 2048}" for w in names},
              "model": str(args.model or default_model_path()),
              "serve_args": serve_args, "environment": environment()}
    if floor is not None and "one_stream" in names:
        # each side's runs over their own floors (ReadFloor), the medians over rounds
        each = {side: [one[side] for one in rounds["one_stream"]] for side in results}
        record["read_floor"] = {
            "step_bytes": floor.step_bytes, "probe_huge_page_bytes": floor.huge_page_bytes,
            "floor_tokens_per_s_median": statistics.median(
                x["floor"]["floor_tokens_per_s"] for x in each["llm-worker"]),
            "one_stream_over_floor": statistics.median(x["over_floor"] for x in each["llm-worker"]),
            "one_stream_over_floor_llama_cpp": statistics.median(x["over_floor"] for x in each["llama.cpp"])}
        print("read floor", record["read_floor"], flush=True)
    print(json.dumps(ratios, indent=1))
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
