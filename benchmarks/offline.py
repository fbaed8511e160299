"""Offline throughput: our engine (continuous and static batching) against transformers.

Runs four systems in one process on the same requests, in the same order, and prints
output tokens per second for each and the ratios:

- ``continuous``: `Engine.generate` with continuous batching (``max_num_seqs`` = B);
- ``static``: the same engine with ``policy="static"`` (admit B, run them all to the end);
  a member that ends leaves the batch's steps, so the batch shrinks as it runs;
- ``static-padded``: the same engine run as transformers' static batches run: each batch
  of B on its own, every member generating until the batch's longest ends (its extra
  tokens are thrown away). Against ``transformers`` it isolates the kernels (same batches,
  decode rows and steps); against ``continuous`` it isolates the policy;
- ``transformers``: `generate` on transformers' own load of the same GGUF, float32,
  in static batches of B, left-padded, greedy.

The workload is N chat requests (a built-in list of questions through the model's chat
template) with long-tailed output lengths: lognormal, median 24, a few (N/16) over 200.
Every system generates exactly the requested number of tokens per request (EOS is
ignored), so each does the same useful work; static batches also do the wasted work of
finishing alongside their longest member, which is what continuous batching saves.

    python -m benchmarks.offline                         # 64 requests, B = 8, all four
    python -m benchmarks.offline --num-requests 8 --systems continuous,static
    python -m benchmarks.offline --output-json bench.json
    python -m benchmarks.offline --repeat 3 --peer-batch-size 64   # rounds; transformers at B=64

This machine's speed drifts over minutes, so `--repeat R` runs the
systems in rounds (each round runs every system once, in turn) and reports for each
system its median round (the lower middle one when R is even), and every round's wall time.

"Occupancy" is output tokens / model steps: how many requests produce a useful token
in an average forward pass (at most B). A transformers batch takes max(L) steps.

In-process (it imports the engine); the JSON records each system's `WorkerConfig` beside
its figures, and the commit and command in ``machine``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.peer_transformers import load_hf_model, run_static_batches
from clients.bench.chat import pick_questions
from clients.bench.environment import environment, recorded
from clients.bench.lengths import output_lengths
from scheduler.request import SamplingParams
from worker.config import SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.weights import LoadedModel, load_model

SYSTEMS = ("continuous", "static", "static-padded", "transformers")



# ----------------------------------------------------------------------------- workload


@dataclass
class Workload:
    questions: list[str]
    prompts: list[list[int]]  # token ids, chat template applied
    output_lens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    def summary(self) -> dict[str, Any]:
        p, o = np.array([len(x) for x in self.prompts]), np.array(self.output_lens)
        return {
            "num_requests": self.num_requests,
            "prompt_tokens": int(p.sum()),
            "prompt_len": {"min": int(p.min()), "median": float(np.median(p)), "max": int(p.max())},
            "output_tokens": int(o.sum()),
            "output_len": {
                "min": int(o.min()), "median": float(np.median(o)), "max": int(o.max()),
                "num_over_200": int((o > 200).sum()), "num_under_50": int((o < 50).sum()),
            },
            "output_lens": self.output_lens,
        }


def make_workload(loaded: LoadedModel, n: int, seed: int, max_output_len: int = 320) -> Workload:
    tok = loaded.tokenizer
    assert tok is not None, "the benchmark needs a model with a tokenizer and chat template"
    questions = pick_questions(n, seed)
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions
    ]
    return Workload(questions, prompts, output_lengths(n, seed, max_output_len))


# ----------------------------------------------------------------------------- systems


@dataclass
class Result:
    system: str
    requests: int
    output_tokens: int
    wall_s: float
    steps: int  # model forward passes
    tokens: list[list[int]] = field(repr=False)
    batch_size: int = 0
    rounds_wall_s: list[float] = field(default_factory=list)
    engine_config: dict[str, Any] | None = None  # the WorkerConfig it ran under (ours only)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def occupancy(self) -> float:
        return self.output_tokens / self.steps if self.steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["tokens"]
        d.update(output_tok_per_s=self.tok_per_s, mean_batch_occupancy=self.occupancy)
        return d


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def run_engine(
    loaded: LoadedModel, wl: Workload, system: str, batch_size: int, max_num_batched_tokens: int
) -> Result:
    """`continuous` and `static` submit every request at once and the engine's policy picks
    each step's rows. `static-padded` submits batches of B in order, as `run_transformers`
    makes them, one at a time, every member's max_tokens its batch's longest: every row is
    computed until its batch ends, and only a request's own first tokens count."""
    padded = system == "static-padded"
    conf = engine_config(system, batch_size, max_num_batched_tokens)
    engine = Engine(conf, loaded=loaded)
    warm = [engine.make_request(p, _greedy(4), f"warmup-{i}") for i, p in enumerate(wl.prompts[:2])]
    engine.generate(warm)

    n_req, lens = wl.num_requests, wl.output_lens
    group = batch_size if padded else n_req
    spans = [range(b, min(b + group, n_req)) for b in range(0, n_req, group)]
    max_tokens = [max(lens[j] for j in s) if padded else lens[i] for s in spans for i in s]
    batches = [
        [engine.make_request(wl.prompts[i], _greedy(max_tokens[i]), f"req-{i}") for i in s]
        for s in spans
    ]
    steps0 = engine.num_steps
    t0 = time.perf_counter()
    done = [c for reqs in batches for c in engine.generate(reqs)]
    wall = time.perf_counter() - t0
    steps = engine.num_steps - steps0

    for c, m in zip(done, max_tokens, strict=True):
        assert len(c.token_ids) == m, f"{system}: {c.request_id} made {len(c.token_ids)} of {m}"
        assert c.finish_reason == "length", (c.request_id, c.finish_reason)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, f"{system}: blocks still held"
    tokens = [c.token_ids[:n] for c, n in zip(done, lens, strict=True)]  # its own length counts
    return Result(system, len(done), sum(map(len, tokens)), wall, steps, tokens, batch_size,
                  engine_config=json.loads(conf.to_json()))  # as GetServerStatus gives it


def engine_config(system: str, batch_size: int, max_num_batched_tokens: int) -> WorkerConfig:
    """What `system` runs under: the defaults but for the policy, seats and token budget."""
    return WorkerConfig(scheduler=SchedulerConfig(
        policy="static" if system == "static-padded" else system, max_num_seqs=batch_size,
        max_num_batched_tokens=max_num_batched_tokens,
    ))


def run_transformers(hf_model, wl: Workload, batch_size: int, pad_id: int) -> Result:
    r = run_static_batches(hf_model, wl.prompts, wl.output_lens, batch_size, pad_id)
    return Result("transformers", r["requests"], r["output_tokens"], r["wall_s"], r["steps"],
                  r["tokens"], batch_size)


# ----------------------------------------------------------------------------- report


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How many requests' greedy tokens agree exactly; where the others first differ."""
    first_diff = {}
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            n = min(len(x), len(y))
            first_diff[i] = next((j for j in range(n) if x[j] != y[j]), n)
    return {"matching": len(a) - len(first_diff), "total": len(a),
            "first_difference_at": first_diff}


def machine_info() -> dict[str, Any]:
    return {**environment(), "torch_threads": torch.get_num_threads()}


def _table(results: list[Result]) -> str:
    head = f"{'system':<14}{'B':>4}{'requests':>9}{'out tokens':>12}{'wall s':>10}{'out tok/s':>11}"
    head += f"{'steps':>8}{'occupancy':>11}  rounds (wall s)"
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(
            f"{r.system:<14}{r.batch_size:>4}{r.requests:>9}{r.output_tokens:>12}{r.wall_s:>10.2f}"
            f"{r.tok_per_s:>11.1f}{r.steps:>8}{r.occupancy:>11.2f}  "
            + ", ".join(f"{w:.1f}" for w in r.rounds_wall_s)
        )
    return "\n".join(lines)


def render_markdown(reports: list[dict[str, Any]]) -> str:
    """BENCHMARKS.md tables from `--output-json` files: one row per system, a ratio row."""
    out = []
    for rep in reports:
        m, c, w = rep["machine"], rep["config"], rep["workload"]
        commit = (m.get("git_commit") or "?")[:10] + (" (uncommitted changes)" if m.get("git_dirty") else "")
        out += [
            f"- date {m['date']}; CPU {m['cpu']} x{m['cpu_count']}, torch {m['torch']}, "
            f"{m['torch_threads']} threads; commit `{commit}`",
            f"- command: `{m['command']}`",
            f"- workload: {w['num_requests']} requests, prompts {w['prompt_tokens']} tokens, outputs "
            f"{w['output_tokens']} tokens (median {w['output_len']['median']:g}, max "
            f"{w['output_len']['max']}, {w['output_len']['num_over_200']} over 200); seed {c['seed']}, "
            f"token budget {c['max_num_batched_tokens']}, {c.get('repeat', 1)} round(s), median round shown",
            "",
            "| system | B | output tokens | wall s | steps | tokens/step | output tok/s | every round's wall s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, r in rep["results"].items():
            rounds = ", ".join(f"{x:.1f}" for x in r.get("rounds_wall_s") or [r["wall_s"]])
            out.append(f"| {name} | {r.get('batch_size', c['batch_size'])} | {r['output_tokens']} | "
                       f"{r['wall_s']:.1f} | {r['steps']} | {r['mean_batch_occupancy']:.2f} | "
                       f"**{r['output_tok_per_s']:.1f}** | {rounds} |")
        ratios = "; ".join(f"{k}: **{v:.2f}x**" for k, v in rep["ratios"].items())
        agree = "; ".join(f"{k}: {a['matching']}/{a['total']} identical"
                          for k, a in rep["agreement"].items())
        out += ["", f"Ratios: {ratios}. Greedy tokens: {agree}.", ""]
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.offline", description=__doc__.split("\n")[0]
    )
    p.add_argument("--num-requests", type=int, default=64, help="N (default 64)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="B: max_num_seqs of the engine, batch size of transformers (default 8)")
    p.add_argument("--peer-batch-size", type=int, default=0,
                   help="batch size of transformers' static batches (default: --batch-size)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of every system; each reports its median round (default 1)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="engine token budget of one step (default 512)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma list of {', '.join(SYSTEMS)} (default all)")
    p.add_argument("--max-output-len", type=int, default=320,
                   help="cap on output lengths, for quick runs (default 320)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch.set_num_threads (default: the cpu count)")
    p.add_argument("--output-json", type=Path,
                   help="write every figure, the config and machine info here")
    p.add_argument("--report", type=Path, nargs="+", metavar="JSON",
                   help="print BENCHMARKS.md tables from earlier --output-json files and exit")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad or not args.systems:
        p.error(f"--systems: unknown {bad}; choose from {', '.join(SYSTEMS)}")
    positive = ("num_requests", "batch_size", "max_num_batched_tokens", "max_output_len", "threads",
                "repeat")
    for name in positive:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.peer_batch_size < 0:
        p.error("--peer-batch-size must be >= 1 (or 0: the same as --batch-size)")
    args.peer_batch_size = args.peer_batch_size or args.batch_size
    return args


def main(
    argv: list[str] | None = None, *, loaded: LoadedModel | None = None, hf_model=None
) -> dict[str, Any]:
    """Run the benchmark; returns what --output-json writes. Pass `loaded` (our
    `load_model("default")`) and `hf_model` (`load_hf_model()`) to reuse loaded models."""
    args = parse_args(argv)
    if args.report:
        print(render_markdown([json.loads(f.read_text()) for f in args.report]))
        return {}
    torch.set_num_threads(args.threads)
    if loaded is None:
        loaded = load_model("default")
    wl = make_workload(loaded, args.num_requests, args.seed, args.max_output_len)
    s = wl.summary()
    print(
        f"{loaded.name}: {s['num_requests']} requests, prompts {s['prompt_tokens']} tokens "
        f"(median {s['prompt_len']['median']:g}), outputs {s['output_tokens']} tokens "
        f"(median {s['output_len']['median']:g}, max {s['output_len']['max']}, "
        f"{s['output_len']['num_over_200']} over 200); B={args.batch_size} "
        f"(transformers {args.peer_batch_size}), {args.repeat} round(s), "
        f"budget {args.max_num_batched_tokens}, {torch.get_num_threads()} threads",
        flush=True,
    )

    runs: dict[str, list[Result]] = {system: [] for system in args.systems}
    for rnd in range(args.repeat):
        for system in args.systems:
            gc.collect()
            if system == "transformers":
                if hf_model is None:
                    hf_model = load_hf_model()
                assert loaded.tokenizer is not None
                pad = loaded.tokenizer.pad_token_id
                pad = pad if pad is not None else loaded.eos_token_ids[0]
                r = run_transformers(hf_model, wl, args.peer_batch_size, pad)
            else:
                r = run_engine(loaded, wl, system, args.batch_size, args.max_num_batched_tokens)
            runs[system].append(r)
            print(f"  round {rnd + 1}, {system}: {r.tok_per_s:.1f} output tok/s ({r.wall_s:.2f} s)",
                  flush=True)
    results: dict[str, Result] = {}
    for system, rs in runs.items():
        results[system] = sorted(rs, key=lambda r: r.wall_s)[(len(rs) - 1) // 2]  # median round
        results[system].rounds_wall_s = [r.wall_s for r in rs]
        assert all(r.tokens == rs[0].tokens for r in rs), f"{system}: rounds disagree on tokens"

    print()
    print(_table(list(results.values())))
    ratios = {}
    for num, den, label in (
        ("continuous", "transformers", "continuous / transformers static"),
        ("continuous", "static", "continuous / engine static"),
        ("continuous", "static-padded", "continuous / engine static, padded"),
        ("static-padded", "transformers", "engine static, padded / transformers static"),
    ):
        if num in results and den in results:
            ratios[label] = results[num].tok_per_s / results[den].tok_per_s
            print(f"{label}: {ratios[label]:.2f}x")

    agree = {}
    ours = next((k for k in ("continuous", "static") if k in results), None)
    if ours and "transformers" in results:
        agree[f"{ours} vs transformers"] = agreement(
            results[ours].tokens, results["transformers"].tokens
        )
    for other in ("static", "static-padded"):
        if "continuous" in results and other in results:
            agree[f"continuous vs {other}"] = agreement(
                results["continuous"].tokens, results[other].tokens
            )
    for label, a in agree.items():
        diff = a["first_difference_at"]
        extra = f" (request: first differing token {diff})" if diff else ""
        print(f"greedy agreement, {label}: {a['matching']}/{a['total']} requests identical{extra}")

    report = {
        "config": recorded(vars(args)),
        "model": loaded.name,
        "workload": s,
        "results": {k: r.to_dict() for k, r in results.items()},
        "ratios": ratios,
        "agreement": agree,
        "machine": machine_info(),
    }
    if args.output_json:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.output_json}")
    return report


if __name__ == "__main__":
    main()
