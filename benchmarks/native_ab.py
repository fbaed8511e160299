"""The fused CPU decoder's native decode call, A/B in one process (issue 21):

    python -m benchmarks.native_ab --against ../wt-before --batch 1 --context 100 --rounds 30

On the project's shared 2-core machines the speed of a process drifts by 10-50% from one
minute to the next, so two checkouts measured one after the other (benchmarks.step_ab)
often differ by more than the change under test. Here one engine of this checkout captures
one decode step's arguments, then calls `cpu_decoder_decode` with them again and again,
alternating between kernel builds every `--calls` calls: this checkout's, and the
`ops/cpu_kernels` of each `--against` checkout (built with the same flags; their
`model_desc`/`step_desc` layouts must be this checkout's). A second engine with
`--no-cpu-huge-pages` is one more side (`--pages both`), and one with a float16 KV cache
(`--kv-cache-dtype both`: the same prompts, so the same steps). Only the native call is timed;
every side's logits must equal the first side's where the kernels' arithmetic is the same
(the table says when they differ).

`--breakdown` adds two sides of this checkout that say where the call's time goes: the same
call without the LM head (its logits not asked for), and a build whose matmuls only zero their
outputs (`-DLLMWORKER_SKIP_MATMULS`: what is left is the norms, rotary, attention and the
loops' waits). Their logits are not compared.

    python -m benchmarks.native_ab --batch 1 --rounds 20 --breakdown

`--drafts K` makes the captured step a speculative verification step: each request's K
drafted tokens (any K tokens: only the call's shape matters) make K + 1 rows of one request,
consecutive positions over the same cache.

    python -m benchmarks.native_ab --batch 1 --drafts 3 --context 250 --rounds 20

`--prefill` times the prompts' prefill call instead (`--context` rows a request, one step; its
hidden states compared, as it asks for no logits).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from clients.bench.environment import environment
from ops import cpu_decoder, cpu_kernels, huge_pages
from scheduler.request import SamplingParams
from worker.config import (
    CacheConfig,
    ModelConfig,
    NgramSpeculation,
    SchedulerConfig,
    SpeculativeConfig,
    WorkerConfig,
)
from worker.engine import Engine


def timing_ms(t: list[float]) -> dict[str, float]:
    """Call times (ms) as the A/B tables give them: the median, the tenth percentile, the fastest."""
    ts = sorted(t)
    return {"median_ms": statistics.median(ts), "p10_ms": ts[len(ts) // 10], "min_ms": ts[0]}


def _build(folder: Path, out: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    if not cpu_kernels.build(folder / "decoder.c", out, extra_flags):
        raise SystemExit(f"cannot build {folder / 'decoder.c'}")
    lib = ctypes.CDLL(str(out))
    lib.cpu_decoder_decode.argtypes = [ctypes.POINTER(cpu_decoder._Model), ctypes.POINTER(cpu_decoder._Step)]
    lib.cpu_decoder_decode.restype = cpu_decoder._i32
    return lib


class _Timed:
    """Stands in for the decoder's library: times each native call (without asking for the
    LM head's logits when `no_head`)."""

    def __init__(self, lib: ctypes.CDLL, times: list[float], no_head: bool = False) -> None:
        self.lib, self.times, self.no_head = lib, times, no_head

    def cpu_decoder_decode(self, m, s) -> int:
        if self.no_head:
            step = cpu_decoder._Step.from_buffer_copy(s._obj)
            step.logits = step.argmax = None  # the greedy tokens are found in the logits
            s = ctypes.byref(step)
        t0 = time.perf_counter()
        rc = self.lib.cpu_decoder_decode(m, s)
        self.times.append((time.perf_counter() - t0) * 1e3)
        return rc


def _engine(batch: int, context: int, huge_pages: bool, activations: str = "auto", drafts: int = 0,
            prefill: bool = False, kv_cache_dtype: str = "auto"):
    """An engine mid-decode, its decoder, and the arguments of one decode step (with `drafts`
    drafted tokens a request: a verification step), or with `prefill` of the prompts' prefill
    (every prompt whole, one step)."""
    spec = (SpeculativeConfig(NgramSpeculation(num_speculative_tokens=drafts, prompt_lookup_min=1,
                                                prompt_lookup_max=1, disable_by_batch_size=batch))
            if drafts else SpeculativeConfig())
    config = WorkerConfig(model=ModelConfig(cpu_huge_pages=huge_pages, cpu_activations=activations),
                          cache=CacheConfig(kv_cache_memory=0.5, kv_cache_dtype=kv_cache_dtype),
                          scheduler=SchedulerConfig(max_num_seqs=batch,
                                                    max_num_batched_tokens=max(8192, batch * context)),
                          speculative=spec)
    engine = Engine(config)
    if drafts:  # the drafts' values do not matter, only that every request has them
        engine.proposer.propose = lambda ids: list(ids[:drafts])
    if engine.runner.cpu_decoder is None:
        raise SystemExit("no fused C decoder here (no gcc, or no AVX2)")
    for i in range(batch):
        engine.submit(engine.make_request([(7 * j + 13 * i) % 40000 + 100 for j in range(context)],
                                          SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)))
    if not prefill:
        engine.step()
        engine.step()
    decoder, captured = engine.runner.cpu_decoder, {}
    decode = decoder.decode

    def capture(*a, **k):
        captured["args"] = (a, k)
        return decode(*a, **k)

    decoder.decode = capture
    engine.step()
    decoder.decode = decode
    rows, want = len(captured["args"][0][0]), batch * (context if prefill else drafts + 1)
    if rows != want:
        raise SystemExit(f"the captured step has {rows} rows, not {want}")
    return engine, decoder, captured["args"]


def read_gbps(mb: int = 100, repeats: int = 10) -> dict[str, float]:
    """A plain read (a float32 sum) of `mb` MB, best of `repeats`, in 4 KB and in 2 MB pages."""
    n = mb << 18  # floats
    plain = torch.ones(n)
    huge = huge_pages.arena(n * 4).view(torch.float32)
    huge.fill_(1.0)
    out = {}
    for name, t in (("4k", plain), ("huge", huge)):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            t.sum()
            best = min(best, time.perf_counter() - t0)
        out[name] = t.numel() * 4 / best / 1e9
    out["huge_bytes"] = huge_pages.huge_bytes_at(huge.data_ptr())
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", action="append", default=[], help="another checkout's root (repeatable)")
    ap.add_argument("--pages", choices=("huge", "4k", "both"), default="huge",
                    help="the engine's --cpu-huge-pages: on, off, or both as sides of their own")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "float16", "both"), default="auto",
                    help="the engine's --kv-cache-dtype, or both as sides of their own")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--cpu-activations", default="auto", help="the engine's --cpu-activations (every side's)")
    ap.add_argument("--context", type=int, default=100, help="prompt tokens per request")
    ap.add_argument("--drafts", type=int, default=0,
                    help="drafted tokens a request: a verification step of drafts + 1 rows each")
    ap.add_argument("--prefill", action="store_true",
                    help="time the prompts' prefill (--context rows a request) instead of a decode step")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=10, help="calls per side per round")
    ap.add_argument("--breakdown", action="store_true",
                    help="also this checkout without the LM head, and without the matmuls")
    ap.add_argument("--isa", choices=cpu_kernels.supported_isas(),
                    help="build every side for this ISA instead of the CPU's best (e.g. avx2: the "
                         "AVX2-only machines' kernels on an AVX-512 one)")
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    with cpu_kernels.forced_isa(args.isa):  # before the first kernel loads (a fresh process)
        _run(args)


def _run(args: argparse.Namespace) -> None:
    reads = read_gbps()
    print(f"a plain read of 100 MB: {reads['4k']:.1f} GB/s in 4 KB pages, {reads['huge']:.1f} GB/s in 2 MB pages "
          f"({reads['huge_bytes'] >> 20} MiB of the buffer in huge pages)")

    pages = ("huge", "4k") if args.pages == "both" else (args.pages,)
    kvs = ("auto", "float16") if args.kv_cache_dtype == "both" else (args.kv_cache_dtype,)
    # an engine per (pages, KV cache dtype), named by what varies
    engines = {" ".join([p] * (len(pages) > 1) + [f"kv {kv}"] * (len(kvs) > 1)) or p:
               _engine(args.batch, args.context, p == "huge", args.cpu_activations, args.drafts, args.prefill, kv)
               for p in pages for kv in kvs}
    here = Path(__file__).resolve().parents[1]
    # side -> (engine, library, without the head); breakdown sides' logits are not compared
    sides: dict[str, tuple[str, ctypes.CDLL, bool]] = {}
    partial: set[str] = set()
    with tempfile.TemporaryDirectory() as tmp:
        for root in [here, *map(Path, args.against)]:
            name = "this" if root == here else root.name
            lib = _build(root / "ops" / "cpu_kernels", Path(tmp) / f"{len(sides)}.so")
            for pages in engines:
                sides[f"{name}/{pages}" if len(engines) > 1 else name] = (pages, lib, False)
        if args.breakdown:
            pages = next(iter(engines))
            bare = _build(here / "ops" / "cpu_kernels", Path(tmp) / "bare.so", ("-DLLMWORKER_SKIP_MATMULS",))
            sides["this, no LM head"] = (pages, sides[next(iter(sides))][1], True)
            sides["this, no matmuls"] = (pages, bare, False)
            partial = {"this, no LM head", "this, no matmuls"}
        times: dict[str, list[float]] = {s: [] for s in sides}
        reference: dict[str, object] = {}
        same: dict[str, bool | None] = {s: None if s in partial else True for s in sides}
        for _ in range(args.rounds + 1):  # the first round warms up
            for side, (pages, lib, no_head) in sides.items():
                _, decoder, (a, k) = engines[pages]
                own = decoder._lib
                decoder._lib = _Timed(lib, times[side], no_head)
                try:
                    for _ in range(args.calls):
                        hidden, logits = decoder.decode(*a, **k)
                    if logits is None:  # a prefill step: its hidden states are compared
                        logits = hidden
                finally:
                    decoder._lib = own
                if side in partial:
                    continue
                first = reference.setdefault(pages, logits.clone())
                same[side] = same[side] and bool((logits == first).all())
    out = {"batch": args.batch, "drafts": args.drafts, "prefill": args.prefill, "context": args.context,
           "rounds": args.rounds, "calls": args.calls, "cpu_activations": args.cpu_activations,
           "isa": cpu_kernels.isa(), "read_gbps": reads, "sides": {}}
    print("| side | native call ms: median (p10, fastest) | logits as the first side's |")
    print("|---|---|---|")
    for side, t in times.items():
        t = t[args.calls:]  # without the warm-up round
        row = {**timing_ms(t), "same_logits": same[side]}
        out["sides"][side] = row
        print(f"| {side} | {row['median_ms']:.2f} ({row['p10_ms']:.2f}, {row['min_ms']:.2f}) | "
              f"{'-' if same[side] is None else 'yes' if same[side] else 'no'} |")
    if args.output_json:
        out["environment"] = environment()
        Path(args.output_json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
