"""A short request during a long prompt's prefill (issue 48), on the engine in this process:

    python -m benchmarks.long_prefill --rounds 2 --output-json bench-results/long-prefill.json

Each round, for each setting of the partial-prefill flags (scheduler/partial_prefill.py):
a fresh engine gets a `--long-tokens` prompt, and `--short-after-s` later an
`--short-tokens` one; both decode `--max-tokens` greedy tokens. Reports each request's
time to first token, the engine steps the short one waited, and the long prompt's TTFT
when it runs alone; checks that every setting gives the same greedy tokens. Settings run
in alternating order, round by round, so that a machine's drift hits them alike; each
round's prompts differ (no prefix-cache hits between rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

from benchmarks.offline import machine_info
from clients.bench.environment import recorded
from scheduler.request import SamplingParams
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine, StepOutput
from worker.weights import LoadedModel, load_model

# name -> (long_prefill_token_threshold, max_num_partial_prefills, max_long_partial_prefills)
SETTINGS: dict[str, tuple[int, int, int]] = {
    "off": (0, 1, 1),  # vLLM's defaults: the long prompt takes every step's whole budget
    "partial-2": (0, 2, 1),  # v0: prefills split the budget; long = 4% of max_model_len
    "threshold-half": (-2, 1, 1),  # v1: every chunk at most half the budget (-k: budget // k)
}


class _Recorder:
    """The engine's step sink: first-token time and step number, and tokens, by request."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.first: dict[str, tuple[float, int]] = {}
        self.last: dict[str, float] = {}
        self.tokens: dict[str, list[int]] = {}
        self.done: set[str] = set()
        self.cond = threading.Condition()

    def __call__(self, step: StepOutput) -> None:
        now, n = time.monotonic(), self.engine.num_steps
        with self.cond:
            for o in step.outputs:
                if o.new_token_ids:
                    self.first.setdefault(o.request_id, (now, n))
                    self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    self.done.add(o.request_id)
                    self.last[o.request_id] = now
            self.cond.notify_all()

    def wait_for(self, ids: list[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not all(i in self.done for i in ids):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
        return True


def _flags(name: str, budget: int) -> dict[str, int]:
    t, p, m = SETTINGS[name]
    return {"long_prefill_token_threshold": budget // -t if t < 0 else t,
            "max_num_partial_prefills": p, "max_long_partial_prefills": m}


def _engine(loaded: LoadedModel, args: argparse.Namespace, name: str) -> Engine:
    conf = WorkerConfig(
        model=ModelConfig(model=args.model, max_model_len=args.max_model_len),
        cache=CacheConfig(kv_cache_memory=args.kv_gib),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.budget, **_flags(name, args.budget)),
    )
    return Engine(conf, loaded=loaded)


def _prompts(loaded: LoadedModel, args: argparse.Namespace, rnd: int) -> tuple[list[int], list[int]]:
    tok = loaded.tokenizer
    assert tok is not None, "this benchmark needs a model with a tokenizer"
    text = " ".join(f"Note {rnd}.{i}: the reading of gauge {i % 97} was {(i * 37 + rnd) % 1000}."
                    for i in range(args.long_tokens))
    long = tok.encode(text)[: args.long_tokens]
    short = tok.encode(f"Round {rnd}: what is the capital of France? Answer in one word.")
    assert len(long) == args.long_tokens, "the text is too short for --long-tokens"
    return long, short[: args.short_tokens]


def run_one(loaded: LoadedModel, args: argparse.Namespace, name: str, rnd: int) -> dict[str, Any]:
    long, short = _prompts(loaded, args, rnd)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    out: dict[str, Any] = {"setting": name, "round": rnd, **_flags(name, args.budget)}
    # The long prompt alone (with --alone), then with the short request arriving during its
    # prefill.
    for alone in ((True, False) if args.alone else (False,)):
        engine = _engine(loaded, args, name)
        rec = _Recorder(engine)
        reqs = [engine.make_request(long, params, request_id="long")]
        if not alone:
            reqs.append(engine.make_request(short, params, request_id="short"))
        engine.start(rec)
        try:
            t0 = time.monotonic()
            engine.submit(reqs[0])
            sent = {"long": (t0, 0)}
            if not alone:
                time.sleep(max(0.0, t0 + args.short_after_s - time.monotonic()))
                sent["short"] = (time.monotonic(), engine.num_steps)
                engine.submit(reqs[1])
            finished = rec.wait_for(list(sent), args.timeout_s)
        finally:
            engine.shutdown()
        assert finished, f"{name}: requests did not finish within {args.timeout_s} s"
        if alone:
            out["long_alone_ttft_s"] = rec.first["long"][0] - t0
            out["long_alone_steps"] = rec.first["long"][1]
            alone_tokens = rec.tokens["long"]
            continue
        out["long_ttft_s"] = rec.first["long"][0] - t0
        out["long_steps"] = rec.first["long"][1]
        out["short_sent_at_s"] = sent["short"][0] - t0
        out["short_ttft_s"] = rec.first["short"][0] - sent["short"][0]
        # Steps from the one running when it arrived to the one that sampled its token.
        out["short_steps"] = rec.first["short"][1] - sent["short"][1]
        out["short_e2e_s"] = rec.last["short"] - sent["short"][0]
        out["tokens"] = {"long": rec.tokens["long"], "short": rec.tokens["short"]}
        if args.alone:
            out["long_tokens_same_alone"] = rec.tokens["long"] == alone_tokens
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["setting"], []).append(r)
    base = by.get("off")
    summary = {}
    for name, rs in by.items():
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("short_ttft_s", "short_steps", "short_e2e_s", "long_ttft_s", "long_steps",
                         "long_alone_ttft_s") if k in rs[0]}
        med["short_ttft_max_s"] = max(r["short_ttft_s"] for r in rs)
        if base is not None:
            off_long = statistics.median(r["long_ttft_s"] for r in base)
            med["long_ttft_vs_off"] = med["long_ttft_s"] / off_long
            if "long_alone_ttft_s" in med:
                off_alone = statistics.median(r["long_alone_ttft_s"] for r in base)
                med["long_alone_ttft_vs_off"] = med["long_alone_ttft_s"] / off_alone
            off_tokens = {o["round"]: o["tokens"] for o in base}
            med["greedy_tokens_as_off"] = all(r["tokens"] == off_tokens[r["round"]]
                                              for r in rs if r["round"] in off_tokens)
        summary[name] = med
    return summary


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--long-tokens", type=int, default=5000)
    ap.add_argument("--short-tokens", type=int, default=8)
    ap.add_argument("--short-after-s", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--budget", type=int, default=SchedulerConfig.max_num_batched_tokens,
                    help="--max-num-batched-tokens")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--kv-gib", type=float, default=0.5, help="KV cache, GiB")
    ap.add_argument("--alone", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the long prompt alone (a second engine run per round)")
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    loaded = load_model(args.model)
    # Warm up (kernel builds, first-touch of the weights) outside every setting's figures.
    warm = _engine(loaded, args, "off")
    warm.generate([warm.make_request(_prompts(loaded, args, -1)[0][:600],
                                     SamplingParams(temperature=0, max_tokens=2))])
    del warm
    runs: list[dict[str, Any]] = []
    info = {**machine_info(), "args": recorded(vars(args))}
    for rnd in range(args.rounds):
        order = args.settings if rnd % 2 == 0 else args.settings[::-1]
        for name in order:
            r = run_one(loaded, args, name, rnd)
            runs.append(r)
            if args.output_json:  # after every run: a long run cut short keeps what it has
                _write(args.output_json, info, runs)
            print(f"round {rnd} {name:<18} short TTFT {r['short_ttft_s']:6.2f} s "
                  f"({r['short_steps']} steps), done {r['short_e2e_s']:6.2f} s; long TTFT {r['long_ttft_s']:6.2f} s "
                  f"({r['long_steps']} steps), alone {r.get('long_alone_ttft_s', float('nan')):6.2f} s",
                  flush=True)
    summary = summarize(runs)
    for name, s in summary.items():
        print(f"{name:<18} median short TTFT {s['short_ttft_s']:.2f} s ({s['short_steps']:g} "
              f"steps), long TTFT x{s.get('long_ttft_vs_off', float('nan')):.3f} of off "
              f"(alone x{s.get('long_alone_ttft_vs_off', float('nan')):.3f}); greedy tokens "
              f"as off: {s.get('greedy_tokens_as_off')}")
    if args.output_json:
        _write(args.output_json, info, runs)


def _write(path: str, info: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        json.dump({"info": info, "num_runs": len(runs),
                   "summary": summarize(runs), "runs": runs}, f, indent=2)


if __name__ == "__main__":
    main()
