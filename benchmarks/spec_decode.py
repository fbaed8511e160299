"""N-gram speculative decoding against plain decoding, in-process, on an input-grounded
workload: rewrite a paragraph with one name replaced, fix the typos of a paragraph, extract
the fields of an invoice as JSON, rename a parameter in a function. Every answer copies
much of its prompt, which is where prompt-lookup drafts are accepted.

One stream: each prompt alone (greedy, up to --max-tokens, EOS ends it), on one engine per
side (plain, and one per --speculative-config), the sides alternating prompt by prompt in
each of --rounds rounds so that all see the same machine. Per side: output tokens/s after
the first token (decode) and from submission (end to end), the acceptance rate (accepted
draft tokens / draft tokens), output tokens per model step, and whether every side gave the
plain side's tokens (greedy: they must).

With --served: every side is an `llm-worker serve` child (its --speculative-config, prefix
caching off) and each prompt a chat request over gRPC, streamed as a user's client reads it;
the stream's chunks stand for steps (a step's tokens come as one chunk), and the drafted and
accepted counts are the ones the worker reports on the request's complete message.

With --batch-sizes B,...: B streams at once (the workload's prompts, repeated, EOS
ignored), plain against the first --speculative-config as configured (its
disable_by_batch_size turns it off above that many running requests) and, up to
--forced-max-batch streams, against speculation forced on: output tokens/s, to see above
which batch size verifying drafts costs more than it saves, and that a large batch loses
nothing once it turns itself off.

    python -m benchmarks.spec_decode --rounds 3 --output-json bench-results/spec-decode.json
    python -m benchmarks.spec_decode --speculative-config \\
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    python -m benchmarks.spec_decode --rounds 1 --batch-sizes 2,4,8,64 --max-tokens 64
    python -m benchmarks.spec_decode --served --rounds 4 --max-tokens 128
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from clients.bench.environment import environment, recorded
from clients.client import finish_reason_name
from scheduler.request import SamplingParams
from worker.config import (
    CacheConfig,
    ModelConfig,
    NgramSpeculation,
    SchedulerConfig,
    SpeculativeConfig,
    WorkerConfig,
    parse_speculative_config,
)
from worker.engine import Engine
from worker.tokenizer import Tokenizer
from worker.weights import LoadedModel, load_model

TASKS = {
    "rewrite": (
        "Rewrite the following paragraph, replacing the name 'Northwind' with 'Contoso' "
        "everywhere. Change nothing else.\n\n"
        "Northwind was founded in 1987 as a small shipping company in Rotterdam. In its first "
        "decade Northwind grew from three ships to forty, carrying grain, timber and machine "
        "parts across the North Sea. When the market for bulk freight collapsed in 1998, "
        "Northwind sold half of its fleet and invested in refrigerated containers, which "
        "turned out to be the best decision in the history of the company. Today Northwind "
        "employs two thousand people in eleven countries, and its blue and white containers "
        "can be seen in almost every major port of Europe."
    ),
    "typos": (
        "Correct the spelling mistakes in this paragraph and return the corrected paragraph "
        "only.\n\n"
        "The library will be closed on Monday becuase of the public holliday. All books that "
        "are due on that day can be returned on Tuesday without any late fee. The reading room "
        "on the second floor will open again on Wednesday morning at nine oclock, and the "
        "childrens section will hold its weekly story hour at four in the afternoon as usual. "
        "We thank you for your patience and wish you a plesant long weekend."
    ),
    "extract": (
        "Extract the following fields from the invoice below and answer in JSON with the keys "
        "invoice_number, date, customer, address, items (each with description, quantity and "
        "price) and total.\n\n"
        "INVOICE No. 2024-0387\nDate: 14 March 2024\nBill to: Greenfield Gardening Supplies "
        "Ltd.\nAddress: 42 Orchard Lane, Bristol BS1 4DJ, United Kingdom\n\n"
        "Description                     Qty   Price\n"
        "Terracotta pot, 30 cm            12   8.50\n"
        "Organic compost, 50 l bag         6  11.20\n"
        "Stainless steel garden trowel     4  14.99\n\n"
        "Total due: 229.16 GBP\nPayment within 30 days."
    ),
    "code": (
        "Rename the parameter `items` to `orders` in this Python function and show the whole "
        "function.\n\n"
        "def summarize(items, currency='EUR'):\n"
        "    total = 0.0\n"
        "    count = 0\n"
        "    largest = None\n"
        "    for item in items:\n"
        "        total += item.price * item.quantity\n"
        "        count += item.quantity\n"
        "        if largest is None or item.price > largest.price:\n"
        "            largest = item\n"
        "    average = total / count if count else 0.0\n"
        "    return {'total': round(total, 2), 'count': count, 'average': round(average, 2),\n"
        "            'largest': largest.name if largest else None, 'currency': currency}\n"
    ),
}
# k = 3: on the project's 2-core CPU each drafted row costs about a third of a step, so
# short drafts pay best (BENCHMARKS.md: k = 3 against 1, 2, 5 and 8). Suffixes of up to 8
# tokens: where a short suffix occurred several times, the longer match picks the occurrence
# that is being copied (acceptance 71% -> 74% here, every task faster: BENCHMARKS.md).
DEFAULT_SPEC = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 8, '
                '"prompt_lookup_min": 2}')


def task_prompt(tok: Tokenizer, task: str) -> list[int]:
    """The task's text as one user turn of the model's chat template, ready to answer."""
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": TASKS[task]}],
                                              add_generation_prompt=True))


def _engine(loaded: LoadedModel, spec: NgramSpeculation | None, seqs: int, kv_gib: float = 0.25,
            activations: str = "auto") -> Engine:
    # ModelConfig's defaults otherwise: CUDA graphs on a GPU (for verification steps too).
    conf = WorkerConfig(model=ModelConfig(max_model_len=2048, cpu_activations=activations),
                        cache=CacheConfig(kv_cache_memory=kv_gib),
                        scheduler=SchedulerConfig(max_num_seqs=max(seqs, 1)),
                        speculative=SpeculativeConfig(spec))
    return Engine(conf, loaded=loaded)


def _one_stream(engine: Engine, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One request alone: its tokens and times, and the engine's step and draft counts."""
    steps, drafted, accepted = engine.num_steps, engine.num_draft_tokens, engine.num_accepted_tokens
    first: list[float] = []

    def on_output(outs: list) -> None:
        if not first and any(o.new_token_ids for o in outs):
            first.append(time.perf_counter())

    req = engine.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    t0 = time.perf_counter()
    (done,) = engine.generate([req], on_output)
    t1 = time.perf_counter()
    n = len(done.token_ids)
    return {
        "tokens": done.token_ids, "num_tokens": n, "e2e_s": t1 - t0, "decode_s": t1 - first[0],
        "steps": engine.num_steps - steps, "draft_tokens": engine.num_draft_tokens - drafted,
        "accepted_tokens": engine.num_accepted_tokens - accepted,
    }


class _ServedSide:
    """One side served: an `llm-worker serve` child with this side's speculation (none for
    the plain side), sent each task as the chat turn `task_prompt` renders."""

    def __init__(self, spec_json: str | None, activations: str) -> None:
        from benchmarks.served_vs_offline import Served

        args = [f"--cpu-activations={activations}", "--max-model-len=2048"]
        self.served = Served(args + ([f"--speculative-config={spec_json}"] if spec_json else []))

    def one_stream(self, task: str, max_tokens: int) -> dict[str, Any]:
        times, tokens, complete = [], [], None
        t0 = time.perf_counter()
        for resp in self.served.client.generate(messages=[{"role": "user", "content": TASKS[task]}],
                                                max_tokens=max_tokens, temperature=0.0):
            if resp.HasField("chunk") and resp.chunk.token_ids:
                times.append(time.perf_counter())
                tokens += resp.chunk.token_ids
            elif resp.HasField("complete"):
                complete = resp.complete
        t1 = time.perf_counter()
        assert complete is not None and finish_reason_name(complete.finish_reason) in ("stop", "length"), complete
        return {"tokens": tokens, "num_tokens": len(tokens), "e2e_s": t1 - t0, "decode_s": t1 - times[0],
                "steps": len(times), "draft_tokens": complete.spec_draft_tokens,
                "accepted_tokens": complete.spec_accepted_tokens, "prompt_tokens": complete.usage.prompt_tokens}

    def close(self) -> None:
        self.served.close()


def _served_rounds(args: argparse.Namespace, specs: list[NgramSpeculation | None], tasks: list[str],
                   report: dict[str, Any]) -> None:
    """The one-stream rounds with every side served (--served)."""
    sides: dict[str, _ServedSide] = {}
    try:
        sides["plain"] = _ServedSide(None, args.cpu_activations)
        for spec, spec_json in zip(specs, args.speculative_config or [DEFAULT_SPEC], strict=True):
            assert spec is not None
            sides[_side_name(spec)] = _ServedSide(spec_json, args.cpu_activations)
        report["sides"] = list(sides)

        def checked(side: _ServedSide, task: str, max_tokens: int) -> dict[str, Any]:
            res = side.one_stream(task, max_tokens)
            # the server rendered the chat turn as task_prompt does here
            assert res["prompt_tokens"] == report["prompt_tokens"][task], (task, res["prompt_tokens"])
            return res

        _rounds({name: functools.partial(checked, side) for name, side in sides.items()}, tasks, args, report)
    finally:
        for side in sides.values():
            side.close()


def _rounds(sides: dict[str, Callable[[str, int], dict[str, Any]]], tasks: list[str], args: argparse.Namespace,
            report: dict[str, Any]) -> None:
    """A warm-up (first calls build kernels and caches), then --rounds rounds of every task
    alone, the sides taking turns task by task; `sides[name](task, max_tokens)` runs one."""
    for run in sides.values():
        run(tasks[0], 8)
    for r in range(args.rounds):
        results: dict[str, dict[str, Any]] = {s: {} for s in sides}
        for task in tasks:
            for name, run in sides.items():
                results[name][task] = res = run(task, args.max_tokens)
                _say_round(r, task, name, res)
        report["rounds"].append(results)


def _side_name(spec: NgramSpeculation) -> str:
    return f"ngram k={spec.num_speculative_tokens} n={spec.prompt_lookup_min}..{spec.prompt_lookup_max}"


def _say_round(r: int, task: str, side: str, res: dict[str, Any]) -> None:
    print(f"round {r + 1} {task:>8} {side:>24}: {res['num_tokens']} tokens, "
          f"{(res['num_tokens'] - 1) / res['decode_s']:.1f} tok/s decode, "
          f"{res['accepted_tokens']}/{res['draft_tokens']} drafts accepted", flush=True)


def _batch(engine: Engine, prompts: list[list[int]], batch: int, max_tokens: int) -> dict[str, float]:
    reqs = [engine.make_request(prompts[i % len(prompts)],
                                SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            for i in range(batch)]
    drafted, accepted = engine.num_draft_tokens, engine.num_accepted_tokens
    steps, graph_steps = engine.num_steps, engine.runner.num_graph_steps
    t0 = time.perf_counter()
    done = engine.generate(reqs)
    dt = time.perf_counter() - t0
    return {"output_tokens_per_s": sum(len(d.token_ids) for d in done) / dt, "seconds": dt,
            "draft_tokens": engine.num_draft_tokens - drafted,
            "accepted_tokens": engine.num_accepted_tokens - accepted,
            "steps": engine.num_steps - steps, "graph_steps": engine.runner.num_graph_steps - graph_steps}


def _batch_sides(sides: dict[str, Engine], prompts: list[list[int]], batch: int, max_tokens: int,
                 rounds: int) -> dict[str, dict[str, Any]]:
    """Each side at `batch` streams, `rounds` times, the order reversed every round: per
    side the median round, and every round under "runs"."""
    warmups: dict[str, list[float]] = {s: [] for s in sides}
    for side, engine in sides.items():
        # Warm-up at this size first: on a GPU the first steps of a new shape compile
        # Triton kernels (seconds), which would land on whichever side ran first. Twice:
        # the second run finds the first's prompts in the prefix cache, as every timed run
        # does, so its prefill (the tails after cached blocks: another kernel variant) is
        # compiled too. With one warm-up, at 7dd3d02 on an H100, the first timed side still
        # ran 2.3-4.6x slower than every later run of either side.
        for _ in range(2):
            warmups[side].append(_batch(engine, prompts, batch, 4)["seconds"])
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    for r in range(rounds):
        for side in (list(sides) if r % 2 == 0 else list(reversed(sides))):
            runs[side].append(_batch(sides[side], prompts, batch, max_tokens))
    out = {}
    for side, rs in runs.items():
        mid = sorted(rs, key=lambda x: x["output_tokens_per_s"])[(len(rs) - 1) // 2]
        out[side] = {**mid, "runs": rs, "warmup_seconds": warmups[side]}
    return out


def summarize(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per side: decode and end-to-end tokens/s (all prompts of a round together, median over
    rounds), acceptance rate, tokens per step, and agreement with the plain side."""
    out = {}
    plain = report["sides"][0]
    for side in report["sides"]:
        runs = [r[side] for r in report["rounds"]]
        decode = [sum(p["num_tokens"] - 1 for p in r.values()) / sum(p["decode_s"] for p in r.values())
                  for r in runs]
        e2e = [sum(p["num_tokens"] for p in r.values()) / sum(p["e2e_s"] for p in r.values()) for r in runs]
        drafted = sum(p["draft_tokens"] for r in runs for p in r.values())
        accepted = sum(p["accepted_tokens"] for r in runs for p in r.values())
        tokens = sum(p["num_tokens"] for r in runs for p in r.values())
        steps = sum(p["steps"] for r in runs for p in r.values())
        same = all(r[side][t]["tokens"] == r[plain][t]["tokens"] for r in report["rounds"] for t in r[side])
        out[side] = {"decode_tokens_per_s": statistics.median(decode),
                     "e2e_tokens_per_s": statistics.median(e2e),
                     "acceptance_rate": accepted / drafted if drafted else 0.0,
                     "draft_tokens": drafted, "accepted_tokens": accepted,
                     "tokens_per_step": tokens / steps, "same_tokens_as_plain": same}
    base = out[plain]["decode_tokens_per_s"]
    for s in out.values():
        s["decode_speedup"] = s["decode_tokens_per_s"] / base
    return out


def render_markdown(report: dict[str, Any]) -> str:
    summary = summarize(report)
    lines = ["| side | decode tokens/s | end-to-end tokens/s | speedup (decode) | acceptance | "
             "tokens per step | same tokens as plain |", "|---|---|---|---|---|---|---|"]
    for side, s in summary.items():
        acc = f"{s['acceptance_rate']:.0%} ({s['accepted_tokens']}/{s['draft_tokens']})" if s["draft_tokens"] else "-"
        lines.append(f"| {side} | {s['decode_tokens_per_s']:.1f} | {s['e2e_tokens_per_s']:.1f} | "
                     f"**{s['decode_speedup']:.2f}x** | {acc} | {s['tokens_per_step']:.2f} | "
                     f"{'yes' if s['same_tokens_as_plain'] else 'NO'} |")
    per_task = ["", "| task | output tokens | " + " | ".join(f"{s} decode tok/s" for s in report["sides"]) + " |",
                "|---|---|" + "---|" * len(report["sides"])]
    for task in report["tasks"]:
        cells = []
        for side in report["sides"]:
            runs = [r[side][task] for r in report["rounds"]]
            cells.append(f"{statistics.median((p['num_tokens'] - 1) / p['decode_s'] for p in runs):.1f}")
        n = report["rounds"][0][report["sides"][0]][task]["num_tokens"]
        per_task.append(f"| {task} | {n} | " + " | ".join(cells) + " |")
    out = "\n".join(lines + per_task)
    if report.get("batches"):
        out += ("\n\n| streams at once | plain tokens/s | speculation as configured tokens/s (ratio) | "
                "forced on tokens/s (ratio) | forced on: acceptance |\n|---|---|---|---|---|\n")
        for b, r in report["batches"].items():
            base = r["plain"]["output_tokens_per_s"]

            def cell(side: dict | None, base: float = base) -> str:
                return "-" if side is None else f"{side['output_tokens_per_s']:.1f} ({side['output_tokens_per_s'] / base:.2f}x)"

            forced = r.get("forced")
            acc = (f"{forced['accepted_tokens'] / forced['draft_tokens']:.0%}"
                   if forced and forced["draft_tokens"] else "-")
            out += f"| {b} | {base:.1f} | {cell(r['configured'])} | {cell(forced)} | {acc} |\n"
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--speculative-config", action="append", default=[],
                    help=f"a speculation side, vLLM's JSON (repeat for several; default {DEFAULT_SPEC})")
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when available)")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                    help="auto: the device's default (bfloat16 on CUDA, float32 on the CPU)")
    ap.add_argument("--tokenizer-model", default="",
                    help="render the prompts with this model's tokenizer (for a dummy:SHAPE model, "
                         "which has none; e.g. default)")
    ap.add_argument("--kv-cache-memory", type=float, default=0.25, help="GiB of KV cache per engine")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tasks", default=",".join(TASKS), help="comma list of " + ", ".join(TASKS))
    ap.add_argument("--batch-sizes", default="", help="also B streams at once, e.g. 2,4,8,64")
    ap.add_argument("--batch-rounds", type=int, default=2,
                    help="times each side runs each batch size, alternating the order; the median counts")
    ap.add_argument("--forced-max-batch", type=int, default=16,
                    help="largest batch size also run with speculation forced on")
    ap.add_argument("--threads", type=int, default=0, help="torch (and kernel) threads; 0 = torch's default")
    ap.add_argument("--cpu-activations", default="auto",
                    help="the engines' --cpu-activations (every side's; on a GPU it is ignored)")
    ap.add_argument("--served", action="store_true",
                    help="one `llm-worker serve` child per side, each prompt a chat request over gRPC")
    ap.add_argument("--output-json")
    ap.add_argument("--report", metavar="JSON", help="print the tables of an --output-json file and exit")
    args = ap.parse_args(argv)
    if args.report:
        print(render_markdown(json.loads(Path(args.report).read_text())))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    specs = [parse_speculative_config(s) for s in args.speculative_config or [DEFAULT_SPEC]]
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    loaded = load_model(args.model, device, dtype)
    tok = load_model(args.tokenizer_model).tokenizer if args.tokenizer_model else loaded.tokenizer
    assert tok is not None, "the workload is text: the model needs a tokenizer (--tokenizer-model)"
    assert tok.vocab_size <= loaded.config.vocab_size, "the tokenizer's ids must fit the model's vocabulary"
    tasks = [t for t in args.tasks.split(",") if t]
    prompts = {t: task_prompt(tok, t) for t in tasks}
    kv = args.kv_cache_memory
    act = args.cpu_activations
    if args.served:
        if args.batch_sizes or args.model != "default" or args.threads:
            raise SystemExit("--served runs the default model's one-stream rounds with the server's threads")
        report = {"info": {**environment(), "args": recorded(vars(args)), "served": True},
                  "sides": [], "specs": [dataclasses.asdict(s) for s in specs if s is not None],
                  "tasks": tasks, "prompt_tokens": {t: len(p) for t, p in prompts.items()}, "rounds": []}
        _served_rounds(args, specs, tasks, report)
        _finish(report, args)
        return
    sides: dict[str, Engine] = {"plain": _engine(loaded, None, 1, kv, act)}
    for spec in specs:
        assert spec is not None
        sides[_side_name(spec)] = _engine(loaded, spec, 1, kv, act)
    report: dict[str, Any] = {
        "info": {**environment(), "args": recorded(vars(args)), "threads": torch.get_num_threads(),
                 "kernels": sides["plain"].runner.describe_kernels(),
                 "device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch."),
                 "gpu": torch.cuda.get_device_name() if loaded.device.type == "cuda" else None},
        "sides": list(sides), "specs": [dataclasses.asdict(s) for s in specs if s is not None],
        "tasks": tasks, "prompt_tokens": {t: len(p) for t, p in prompts.items()}, "rounds": [],
    }
    _rounds({name: (lambda task, n, engine=engine: _one_stream(engine, prompts[task], n))
             for name, engine in sides.items()}, tasks, args, report)
    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    if batches:
        report["batches"] = {}
        seqs = max(batches)
        assert specs[0] is not None
        forced = dataclasses.replace(specs[0], disable_by_batch_size=seqs)
        plain_b, configured_b = _engine(loaded, None, seqs, kv, act), _engine(loaded, specs[0], seqs, kv, act)
        forced_b = _engine(loaded, forced, seqs, kv, act)
        ps = list(prompts.values())
        for b in batches:
            batch_sides = {"plain": plain_b, "configured": configured_b}
            if b <= args.forced_max_batch:
                batch_sides["forced"] = forced_b
            res: dict[str, Any] = {"forced": None, **_batch_sides(batch_sides, ps, b, args.max_tokens,
                                                                  args.batch_rounds)}
            report["batches"][str(b)] = res
            print(f"batch {b}: " + ", ".join(f"{k} {v['output_tokens_per_s']:.1f} tok/s "
                                             f"({v['graph_steps']}/{v['steps']} steps from graphs)"
                                             for k, v in res.items() if v), flush=True)
    _finish(report, args)


def _finish(report: dict[str, Any], args: argparse.Namespace) -> None:
    report["summary"] = summarize(report)
    print(render_markdown(report))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
