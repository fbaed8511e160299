"""Scheduling figures for BENCHMARKS.md (issue 5), on the engine in this process:

    python -m benchmarks.scheduling priority --output-json bench-results/priority.json
    python -m benchmarks.scheduling prefix --output-json bench-results/prefix.json

priority: a backlog of low-priority requests fills a small cache; urgent requests arrive
    one by one while it drains. Run twice on the same requests and arrival times: with
    the urgent ones at a more urgent priority (lower value), and with every request at
    the same priority. Reports the urgent requests' time to first token (p50, p99), how
    many low-priority requests finished, preemptions and swaps.
prefix: 32 requests share a 500-token system prompt; two waves of 32 distinct questions.
    Each wave's prefill time (first submit to the last first token; max_tokens 1) and its
    `cached_tokens`, with prefix caching on and off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

import torch

from benchmarks.offline import machine_info
from clients.bench.environment import recorded
from scheduler.request import SamplingParams
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine, StepOutput
from worker.outputs import RequestOutput
from worker.weights import LoadedModel, load_model

QUESTIONS = [
    "What is the capital of France?", "Name three primary colours.", "What is 12 times 9?",
    "Who wrote Hamlet?", "Define entropy in one line.", "What is a prime number?",
    "How many legs has a spider?", "What does CPU stand for?", "Translate 'cat' into German.",
    "What is the boiling point of water?", "Give a synonym for happy.", "What is photosynthesis?",
    "Name a noble gas.", "What year did the Berlin wall fall?", "What is the square root of 81?",
    "Spell 'necessary' backwards.", "What is the largest planet?", "Who painted the Mona Lisa?",
    "What is an adjective?", "Name a mammal that flies.", "What is H2O?", "Define gravity.",
    "What is the speed of light?", "Name an even prime.", "What is a haiku?",
    "How many days in a leap year?", "What language is spoken in Brazil?", "What is DNA?",
    "Name a programming language.", "What is the freezing point of water?",
    "Who discovered penicillin?", "What is a verb?", "Name the longest river.",
    "What is 15 squared?", "What is an atom?", "Name a primary school subject.",
    "What is the chemical symbol for gold?", "What is a triangle?", "Name a citrus fruit.",
    "What is the opposite of cold?", "How many continents are there?", "What is a noun?",
    "Name a string instrument.", "What is the tallest mountain?", "What is a comet?",
    "Define democracy briefly.", "What is 100 divided by 4?", "Name a colour of the rainbow.",
    "What is a volcano?", "Who was Ada Lovelace?", "What is a leap second?",
    "Name an ocean.", "What is friction?", "What is a synonym for big?",
    "What is the main gas in air?", "Name a bird that cannot fly.", "What is an island?",
    "What is a fraction?", "Name a desert.", "What is the sun?", "What is rain?",
    "Name a planet with rings.", "What is an echo?", "What is a molecule?",
]


def _engine(loaded: LoadedModel, gib: float, seqs: int, budget: int, prefix: bool = True,
            swap_gib: float = 4.0, mode: str = "auto", max_model_len: int = 1024) -> Engine:
    conf = WorkerConfig(
        model=ModelConfig(max_model_len=max_model_len),
        cache=CacheConfig(kv_cache_memory=gib, enable_prefix_caching=prefix, swap_space=swap_gib),
        scheduler=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget,
                                  preemption_mode=mode),
    )
    return Engine(conf, loaded=loaded)


def _chat(loaded: LoadedModel, text: str, system: str | None = None) -> list[int]:
    tok = loaded.tokenizer
    assert tok is not None, "this benchmark needs a model with a tokenizer"
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}]
    return tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))


class _Recorder:
    """The engine's step sink (`Engine.start`'s on_step: one StepOutput a step): first-token
    and finish times by request id."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.done: dict[str, RequestOutput] = {}
        self.cond = threading.Condition()

    def __call__(self, step: StepOutput) -> None:
        now = time.monotonic()
        with self.cond:
            for o in step.outputs:
                if o.new_token_ids and o.request_id not in self.first:
                    self.first[o.request_id] = now
                if o.finished:
                    self.done[o.request_id] = o
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


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def run_priority(loaded: LoadedModel, args: argparse.Namespace, with_priorities: bool) -> dict[str, Any]:
    engine = _engine(loaded, args.kv_gib, args.max_num_seqs, args.budget, prefix=False,
                     max_model_len=512)
    low_params = SamplingParams(temperature=0, max_tokens=args.low_tokens, ignore_eos=True)
    urgent_params = SamplingParams(temperature=0, max_tokens=args.urgent_tokens, ignore_eos=True)
    low_prio, urgent_prio = (10, 0) if with_priorities else (0, 0)
    rec = _Recorder()
    submitted: dict[str, float] = {}
    low_ids, urgent_ids = [], []
    low_reqs = [engine.make_request(_chat(loaded, QUESTIONS[i % len(QUESTIONS)] + " Explain."),
                                    low_params, request_id=f"low-{i}", priority=low_prio)
                for i in range(args.num_low)]
    urgent_reqs = [engine.make_request(_chat(loaded, QUESTIONS[-1 - i % len(QUESTIONS)]),
                                       urgent_params, request_id=f"urgent-{i}", priority=urgent_prio)
                   for i in range(args.num_urgent)]
    engine.start(rec)
    t0 = time.monotonic()
    try:
        for r in low_reqs:
            submitted[r.request_id] = time.monotonic()
            engine.submit(r)
            low_ids.append(r.request_id)
        for i, r in enumerate(urgent_reqs):
            # Fixed arrival times (relative to the start), the same in both runs.
            delay = t0 + args.first_urgent_s + i * args.urgent_interval_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            submitted[r.request_id] = time.monotonic()
            engine.submit(r)
            urgent_ids.append(r.request_id)
        finished = rec.wait_for(low_ids + urgent_ids, args.timeout_s)
    finally:
        engine.shutdown()
    wall = time.monotonic() - t0
    ttft = [rec.first[i] - submitted[i] for i in urgent_ids if i in rec.first]
    low_ttft = [rec.first[i] - submitted[i] for i in low_ids if i in rec.first]
    reqs = low_reqs + urgent_reqs
    return {
        "with_priorities": with_priorities,
        "finished_all": finished,
        "low_finished": sum(1 for i in low_ids if i in rec.done and rec.done[i].finish_reason == "length"),
        "urgent_finished": sum(1 for i in urgent_ids if i in rec.done),
        "urgent_ttft_p50_s": statistics.median(ttft) if ttft else None,
        "urgent_ttft_p99_s": _pct(ttft, 0.99) if ttft else None,
        "urgent_ttft_max_s": max(ttft) if ttft else None,
        "low_ttft_p50_s": statistics.median(low_ttft) if low_ttft else None,
        "num_preemptions": sum(r.num_preemptions for r in reqs),
        "num_swap_outs": getattr(engine.scheduler, "num_swap_outs", None),
        "kv_blocks": engine.kv.num_blocks,
        "cpu_blocks": engine.kv.num_cpu_blocks,
        "steps": engine.num_steps,
        "wall_s": wall,
        "free_blocks_after": engine.kv.num_free_blocks,
    }


def run_prefix(loaded: LoadedModel, args: argparse.Namespace, prefix: bool) -> dict[str, Any]:
    engine = _engine(loaded, 1.0, 64, args.budget, prefix=prefix)
    system = _system_prompt(loaded, args.system_tokens)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    waves = []
    for w in range(2):
        qs = QUESTIONS[w * 32 : w * 32 + 32]
        reqs = [engine.make_request(_chat(loaded, q, system), params) for q in qs]
        t0 = time.perf_counter()
        done = engine.generate(reqs)
        wall = time.perf_counter() - t0
        waves.append({
            "wave": w + 1, "requests": len(reqs), "prompt_tokens": sum(len(r.prompt_token_ids) for r in reqs),
            "cached_tokens": sum(c.cached_tokens for c in done),
            "cached_tokens_min": min(c.cached_tokens for c in done),
            "prefill_s": wall,
        })
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return {"prefix_caching": prefix, "waves": waves,
            "hit_tokens": engine.kv.stats.num_hit_tokens, "queried_tokens": engine.kv.stats.num_queried_tokens}


def _system_prompt(loaded: LoadedModel, n_tokens: int) -> str:
    """A system prompt of about `n_tokens` tokens (whole sentences of a fixed text)."""
    tok = loaded.tokenizer
    assert tok is not None
    sentences = [f"Rule {i}: answer briefly, politely and accurately, citing rule {i} when unsure."
                 for i in range(1, 200)]
    text = "You are a careful assistant."
    for s in sentences:
        if len(tok.encode(text + " " + s)) > n_tokens:
            break
        text += " " + s
    return text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("priority", "prefix"))
    ap.add_argument("--model", default="default")
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--kv-gib", type=float, default=0.03, help="priority: a small KV cache, GiB")
    ap.add_argument("--num-low", type=int, default=24)
    ap.add_argument("--low-tokens", type=int, default=48)
    ap.add_argument("--num-urgent", type=int, default=16)
    ap.add_argument("--urgent-tokens", type=int, default=4)
    ap.add_argument("--first-urgent-s", type=float, default=2.0)
    ap.add_argument("--urgent-interval-s", type=float, default=0.75)
    ap.add_argument("--system-tokens", type=int, default=500)
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    loaded = load_model(args.model)
    report: dict[str, Any] = {"info": {**machine_info(), "args": recorded(vars(args)), "threads": torch.get_num_threads()}}
    if args.what == "priority":
        runs = [run_priority(loaded, args, with_priorities=p) for p in (False, True)]
        report["runs"] = runs
        for r in runs:
            print(f"priorities {'on ' if r['with_priorities'] else 'off'}: urgent TTFT p50 "
                  f"{r['urgent_ttft_p50_s']:.2f} s, p99 {r['urgent_ttft_p99_s']:.2f} s; low finished "
                  f"{r['low_finished']}/{args.num_low}; preemptions {r['num_preemptions']}; "
                  f"{r['steps']} steps, {r['wall_s']:.1f} s", flush=True)
        ratio = runs[0]["urgent_ttft_p99_s"] / runs[1]["urgent_ttft_p99_s"]
        report["p99_ratio"] = ratio
        print(f"urgent p99 TTFT without / with priorities: {ratio:.1f}x")
    else:
        runs = [run_prefix(loaded, args, prefix=p) for p in (True, False)]
        report["runs"] = runs
        for r in runs:
            for w in r["waves"]:
                print(f"prefix caching {'on ' if r['prefix_caching'] else 'off'} wave {w['wave']}: "
                      f"{w['prompt_tokens']} prompt tokens, cached {w['cached_tokens']} "
                      f"(min {w['cached_tokens_min']} per request), prefill {w['prefill_s']:.2f} s",
                      flush=True)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
