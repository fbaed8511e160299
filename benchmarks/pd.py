"""Prefill/decode disaggregation against one worker doing both (issue 51), on one machine.

    python -m benchmarks.pd --output-json bench-results/pd.json

The workload: `--streams` requests decoding (short prompts, long outputs, greedy, EOS
ignored) while a `--long-prompt-tokens` prompt arrives every `--arrival-s` seconds (a few
output tokens each), for `--duration-s` seconds. Two setups, each given the same CPUs:

- ``one``: one `llm-worker serve` on both CPUs (``taskset -c 0,1``), chunked prefill on (the
  default): the long prompts' chunks share steps with the decodes;
- ``pd``: a prefill worker on the first CPU (kv_producer) and a decode worker on the second
  (kv_consumer); every request goes as SMG's PD mode sends it (vLLM's sequential protocol,
  played by this process: the prefill leg with max_tokens 1 and do_remote_decode, its
  handoff copied into the decode leg), so the decode worker's steps never carry a prefill.

Figures per setup: the decoding streams' inter-token latency (gaps between their streamed
chunks, from when all have their first token to the end; p50, p90, p99, max), their output
throughput and the total, and the long prompts' time to first token (from the request's start,
the prefill leg included under P/D). Then the handoff's cost: one `--handoff-tokens` prompt
pulled by the decode worker (its own transfer-time counter, and the decode leg's time to
first token) against the same prompt computed by that worker alone on its CPU.

The client is this process (a thread per stream; it shares the machine's CPUs with the
workers in both setups alike). Prompts are token ids made unique per request, so nothing
comes from a prefix cache. `--serve-arg` values go to every worker (e.g.
`--serve-arg=--max-num-batched-tokens=256`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from llmworker.v1 import worker_pb2 as pb
from llmworker.v1 import worker_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc

from clients.bench.environment import environment

ROOT = Path(__file__).resolve().parents[1]
TAG = '{"do_remote_decode":true,"do_remote_prefill":false}'
ROLE = '{"kv_connector": "GrpcConnector", "kv_role": "%s"}'


class Served:
    """One `llm-worker serve` process on `cpus`."""

    def __init__(self, cpus: str, flags: list[str], label: str) -> None:
        cmd = ["taskset", "-c", cpus, sys.executable, "-m", "worker.cli", "serve", "--port", "0",
               *flags]
        self.label = label
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.address = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())
            if m := re.search(r"listening on (\S+):(\d+)", line):
                self.address = f"{m.group(1)}:{m.group(2)}"
            if re.search(r"serving .* on ", line):
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 300) -> Served:
        if not self._ready.wait(timeout) or self.proc.poll() is not None:
            raise RuntimeError(f"{self.label} did not start:\n" + "\n".join(self.lines[-20:]))
        self.channel = grpc.insecure_channel(self.address)
        self.vllm = vllm_engine_pb2_grpc.VllmEngineStub(self.channel)
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        return self

    def status(self) -> pb.GetServerStatusResponse:
        return self.stub.GetServerStatus(pb.GetServerStatusRequest(), timeout=30)

    def close(self) -> None:
        if hasattr(self, "channel"):
            self.channel.close()
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def prompt(n: int, seed: int) -> list[int]:
    """`n` token ids, the first ones unique to `seed` (no prefix shared between requests)."""
    return [1000 + seed % 30000, *[(seed * 7919 + i * 31) % 40000 + 100 for i in range(n - 1)]]


def request(ids: list[int], max_tokens: int, stream: bool, kv: str | None = None,
            rid: str = "") -> vpb.GenerateRequest:
    r = vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=ids),
                            stream=stream, sampling_params=vpb.SamplingParams(
                                temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    if kv is not None:
        r.kv_transfer_params_json = kv
    return r


class Setup:
    """Where requests go: one worker, or a prefill and a decode (the sequential protocol)."""

    def __init__(self, one: Served | None = None, prefill: Served | None = None,
                 decode: Served | None = None) -> None:
        self.one, self.prefill, self.decode = one, prefill, decode

    def stream(self, ids: list[int], max_tokens: int, rid: str):
        """The decoding worker's response stream for one request (after its prefill leg)."""
        if self.one is not None:
            return self.one.vllm.Generate(request(ids, max_tokens, True, rid=rid), timeout=3600)
        assert self.prefill is not None and self.decode is not None
        leg = list(self.prefill.vllm.Generate(request(ids, 1, False, TAG, rid), timeout=600))
        kv = leg[-1].complete.kv_transfer_params_json or None
        return self.decode.vllm.Generate(request(ids, max_tokens, True, kv, rid), timeout=3600)


def run_workload(setup: Setup, args: argparse.Namespace) -> dict[str, Any]:
    streams: list[dict[str, Any]] = [{"times": [], "tokens": 0} for _ in range(args.streams)]
    calls: list[Any] = []
    stop = threading.Event()

    def decoding(i: int) -> None:
        call = setup.stream(prompt(args.stream_prompt_tokens, 10_000 + i), args.stream_max_tokens,
                            f"s{i}")
        calls.append(call)
        try:
            for resp in call:
                if resp.HasField("chunk") and resp.chunk.token_ids:
                    streams[i]["times"].append(time.perf_counter())
                    streams[i]["tokens"] += len(resp.chunk.token_ids)
                if stop.is_set():
                    break
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise

    long_ttft: list[float] = []
    long_tokens = [0]

    def long_prompt(k: int) -> None:
        t0 = time.perf_counter()
        first = None
        for resp in setup.stream(prompt(args.long_prompt_tokens, 20_000 + k),
                                 args.long_max_tokens, f"l{k}"):
            if resp.HasField("chunk") and resp.chunk.token_ids:
                first = first or time.perf_counter()
                long_tokens[0] += len(resp.chunk.token_ids)
        assert first is not None
        long_ttft.append(first - t0)

    threads = [threading.Thread(target=decoding, args=(i,), daemon=True)
               for i in range(args.streams)]
    for t in threads:
        t.start()
    deadline = time.perf_counter() + 600
    while not all(s["times"] for s in streams):  # every stream decoding
        if time.perf_counter() > deadline:
            raise RuntimeError("the decoding streams did not all start")
        time.sleep(0.01)
    start = time.perf_counter()
    base = [len(s["times"]) for s in streams]
    base_tokens = [s["tokens"] for s in streams]
    longs: list[threading.Thread] = []
    k = 0
    while time.perf_counter() - start < args.duration_s:
        at = start + args.arrival_s * (k + 0.5)  # the first arrives half a period in
        if at >= start + args.duration_s:
            break
        time.sleep(max(0.0, at - time.perf_counter()))
        t = threading.Thread(target=long_prompt, args=(k,), daemon=True)
        t.start()
        longs.append(t)
        k += 1
    time.sleep(max(0.0, start + args.duration_s - time.perf_counter()))
    end = time.perf_counter()
    stop.set()
    gaps = []
    tokens = 0
    for s, first, first_tokens in zip(streams, base, base_tokens, strict=True):
        ts = [t for t in s["times"][first - 1:] if t <= end]
        gaps += [later - t for t, later in itertools.pairwise(ts)]
        tokens += s["tokens"] - first_tokens
    for call in calls:
        call.cancel()
    for t in longs:
        t.join(600)
    gaps.sort()

    def pct(q: float) -> float:
        return gaps[min(len(gaps) - 1, int(q * len(gaps)))] if gaps else float("nan")

    window = end - start
    return {
        "window_s": window,
        "itl_ms": {"p50": 1e3 * pct(0.50), "p90": 1e3 * pct(0.90), "p99": 1e3 * pct(0.99),
                   "max": 1e3 * (gaps[-1] if gaps else float("nan")),
                   "mean": 1e3 * statistics.fmean(gaps) if gaps else float("nan"),
                   "samples": len(gaps)},
        "stream_tok_s": tokens / window,
        "output_tok_s": (tokens + long_tokens[0]) / window,
        "long_prompts": len(long_ttft),
        "long_ttft_s": {"median": statistics.median(long_ttft) if long_ttft else None,
                        "max": max(long_ttft, default=None), "all": long_ttft},
    }


def handoff_cost(prefill: Served, decode: Served, n: int) -> dict[str, Any]:
    """One `n`-token prompt: pulled by the decode worker against computed by it alone."""
    ids = prompt(n, 30_000)
    t0 = time.perf_counter()
    list(decode.vllm.Generate(request(ids, 1, False, rid="recompute"), timeout=600))
    recompute = time.perf_counter() - t0
    ids = prompt(n, 30_001)
    leg = list(prefill.vllm.Generate(request(ids, 1, False, TAG, "h"), timeout=600))
    kv = leg[-1].complete.kv_transfer_params_json
    before = decode.status().kv_transfer
    t0 = time.perf_counter()
    list(decode.vllm.Generate(request(ids, 1, False, kv, "h"), timeout=600))
    leg_s = time.perf_counter() - t0
    after = decode.status().kv_transfer
    if after.pulls != before.pulls + 1:
        raise RuntimeError(f"the handoff was not pulled: {after}")
    return {"prompt_tokens": n, "recompute_s": recompute, "decode_leg_ttft_s": leg_s,
            "pull_s": after.pull_seconds - before.pull_seconds,
            "pulled_bytes": after.pulled_bytes - before.pulled_bytes,
            "pulled_blocks": after.pulled_blocks - before.pulled_blocks,
            "recompute_over_pull": recompute / max(1e-9, after.pull_seconds - before.pull_seconds)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setups", default="one,pd", help="comma list of one, pd")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--stream-prompt-tokens", type=int, default=32)
    ap.add_argument("--stream-max-tokens", type=int, default=3000)
    ap.add_argument("--long-prompt-tokens", type=int, default=1500)
    ap.add_argument("--long-max-tokens", type=int, default=8)
    ap.add_argument("--arrival-s", type=float, default=3.0)
    ap.add_argument("--duration-s", type=float, default=45.0)
    ap.add_argument("--handoff-tokens", type=int, default=2000, help="0: skip the handoff cost")
    ap.add_argument("--cpus", default="", help="two CPUs, e.g. 0,1 (default: the first two "
                                               "this process may use)")
    ap.add_argument("--kv-cache-memory", default="1", help="GiB of KV cache per worker")
    ap.add_argument("--max-model-len", default="4096")
    ap.add_argument("--serve-arg", action="append", default=[],
                    help="a flag for every worker (repeatable)")
    ap.add_argument("--output-json", default="")
    args = ap.parse_args(argv)
    cpus = args.cpus.split(",") if args.cpus else [str(c) for c in sorted(os.sched_getaffinity(0))[:2]]
    if len(cpus) != 2:
        ap.error("--cpus: two CPUs are needed")
    common = ["--kv-cache-memory", args.kv_cache_memory, "--max-model-len", args.max_model_len,
              *args.serve_arg]
    result: dict[str, Any] = {"environment": environment(), "args": vars(args), "cpus": cpus,
                              "setups": {}}
    for name in args.setups.split(","):
        if name == "one":
            workers = [Served(",".join(cpus), common, "one")]
            setup = Setup(one=workers[0].wait_ready())
        elif name == "pd":
            p = Served(cpus[0], [*common, "--kv-transfer-config", ROLE % "kv_producer"], "prefill")
            p.wait_ready()
            d = Served(cpus[1], [*common, "--kv-transfer-config", ROLE % "kv_consumer",
                                 "--kv-transfer-peers", p.address], "decode")
            workers = [p, d]
            setup = Setup(prefill=p, decode=d.wait_ready())
        else:
            ap.error(f"--setups: unknown setup {name!r}")
        try:
            print(f"# {name}: {args.streams} streams, a {args.long_prompt_tokens}-token prompt "
                  f"every {args.arrival_s:g}s for {args.duration_s:g}s", file=sys.stderr)
            got = run_workload(setup, args)
            if name == "pd":
                st = setup.decode.status().kv_transfer
                got["decode_worker"] = {"pulls": st.pulls, "pulled_bytes": st.pulled_bytes,
                                        "fallbacks": dict(st.fallbacks)}
                if args.handoff_tokens:
                    result["handoff"] = handoff_cost(setup.prefill, setup.decode,
                                                     args.handoff_tokens)
            result["setups"][name] = got
            print(json.dumps({name: {k: got[k] for k in ("itl_ms", "stream_tok_s",
                                                          "output_tok_s")}}), file=sys.stderr)
        finally:
            for w in workers:
                w.close()
    s = result["setups"]
    if "one" in s and "pd" in s:
        result["p99_itl_one_over_pd"] = s["one"]["itl_ms"]["p99"] / s["pd"]["itl_ms"]["p99"]
    text = json.dumps(result, indent=2)
    if args.output_json:
        Path(args.output_json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
