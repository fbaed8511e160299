"""Structured outputs' cost: N concurrent chat requests all under one JSON schema against
the same requests unconstrained, in one process, on one engine configuration.

- ``json_schema``: every request under SCHEMA (nested objects, an array, enums, bounded
  numbers), greedy; each ends when its JSON is complete;
- ``free``: the same prompts unconstrained, each made to generate exactly as many tokens
  as its constrained run did (EOS ignored), so both do the same work in the same batch
  shapes; the ratio of output tokens per second is the constraint's cost.

The two alternate in rounds (``--repeat``; each reports its median round). Also measured:
the mask's cost per step at batch N (filling N rows of the token bitmask with llguidance
and applying it to [N, V] logits, by `worker.logits_masks`, on matchers mid-JSON), next to
the engine's mean step time; and the compile time of the schema: cold (llguidance's
tokenizer built from ours, then the grammar), a second distinct schema, and cached.

    python -m benchmarks.structured                     # 64 requests, 3 rounds
    python -m benchmarks.structured --num-requests 8 --repeat 1
    python -m benchmarks.structured --output-json bench-results/structured.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import jsonschema
import torch

from clients.bench.chat import pick_questions
from clients.bench.environment import environment, recorded
from scheduler.request import Request, SamplingParams
from worker.config import SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.logits_masks import LogitsMasks
from worker.structured import Constraint, GrammarCompiler
from worker.weights import LoadedModel, load_model

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 120},
        "topic": {"type": "string", "enum": ["science", "history", "math", "code", "other"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "facts": {
            "type": "array", "minItems": 1, "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {"fact": {"type": "string", "maxLength": 60},
                               "year": {"type": "integer", "minimum": 0, "maximum": 2100}},
                "required": ["fact", "year"], "additionalProperties": False,
            },
        },
    },
    "required": ["answer", "topic", "confidence", "facts"],
    "additionalProperties": False,
}
INSTRUCTION = ("Answer as JSON with keys answer, topic, confidence (0 to 1) and facts (a list "
               "of {fact, year}).")


def _prompts(loaded: LoadedModel, n: int, seed: int) -> list[list[int]]:
    tok = loaded.tokenizer
    assert tok is not None
    return [tok.encode_chat([{"role": "user", "content": f"{q}\n{INSTRUCTION}"}])
            for q in pick_questions(n, seed)]


def _engine(loaded: LoadedModel, n: int, budget: int) -> Engine:
    conf = WorkerConfig(scheduler=SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=budget))
    return Engine(conf, loaded=loaded)


def run(engine: Engine, compiler: GrammarCompiler, prompts: list[list[int]],
        lengths: list[int] | None, max_tokens: int) -> dict[str, Any]:
    """One round: constrained when `lengths` is None, else free with those lengths."""
    grammar = compiler.compile(Constraint("json_schema", json.dumps(SCHEMA)))
    reqs: list[Request] = []
    for i, ids in enumerate(prompts):
        if lengths is None:
            r = engine.make_request(ids, SamplingParams(temperature=0, max_tokens=max_tokens))
            r.grammar = grammar.matcher()
        else:
            r = engine.make_request(ids, SamplingParams(temperature=0, max_tokens=lengths[i],
                                                        ignore_eos=True))
        reqs.append(r)
    stats = engine.runner.logits_masks.stats
    before = copy.copy(stats)
    steps0 = engine.num_steps
    t0 = time.perf_counter()
    done = engine.generate(reqs)
    wall = time.perf_counter() - t0
    steps = engine.num_steps - steps0
    out = sum(len(c.token_ids) for c in done)
    res: dict[str, Any] = {"wall_s": wall, "steps": steps, "output_tokens": out,
                           "output_tok_per_s": out / wall, "step_ms": 1e3 * wall / steps}
    if lengths is None:
        valid = 0
        for c in done:
            try:
                jsonschema.validate(json.loads(c.text), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        masked = stats.num_steps - before.num_steps
        res.update(
            lengths=[len(c.token_ids) for c in done], valid=valid,
            finish_reasons={r: sum(c.finish_reason == r for c in done)
                            for r in {c.finish_reason for c in done}},
            masked_steps=masked,
            mean_rows=(stats.num_rows - before.num_rows) / max(masked, 1),
            fill_ms_per_step=1e3 * (stats.fill_s - before.fill_s) / max(masked, 1),
            wait_ms_per_step=1e3 * (stats.wait_s - before.wait_s) / max(masked, 1),
            apply_ms_per_step=1e3 * (stats.apply_s - before.apply_s) / max(masked, 1))
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "blocks still held"
    return res


def mask_cost(compiler: GrammarCompiler, loaded: LoadedModel, n: int,
              repeat: int = 20) -> dict[str, float]:
    """Fill + apply for n rows at once, on matchers part-way into SCHEMA's JSON (inside a
    string, where most of the vocabulary is allowed: the costly case for the fill)."""
    tok = compiler.ll_tokenizer()
    grammar = compiler.compile(Constraint("json_schema", json.dumps(SCHEMA)))
    vocab = loaded.config.vocab_size
    masks = LogitsMasks(vocab, torch.device("cpu"))
    reqs = []
    prefixes = ['{"answer": "The', '{"answer": "x", "topic": "sci', '{"answer": "', '{']
    for i in range(n):
        r = Request(f"m{i}", [1], SamplingParams(), eos_token_ids=loaded.eos_token_ids)
        r.grammar = grammar.matcher()
        assert r.grammar.matcher.consume_tokens(tok.tokenize_str(prefixes[i % len(prefixes)]))
        reqs.append(r)
    fill, apply_ = [], []
    st = masks.stats
    for _ in range(repeat + 1):
        logits = torch.randn(n, vocab)
        before = copy.copy(st)
        masks.apply(logits, masks.start(reqs))  # on the CPU the fill is inside apply
        fill.append(st.fill_s - before.fill_s)
        apply_.append(st.apply_s - before.apply_s)
        assert st.num_rows - before.num_rows == n
    fill, apply_ = fill[1:], apply_[1:]  # the first fills llguidance's caches
    return {"rows": n, "fill_ms_median": 1e3 * statistics.median(fill),
            "apply_ms_median": 1e3 * statistics.median(apply_),
            "total_ms_median": 1e3 * statistics.median(f + a for f, a in zip(fill, apply_,
                                                                             strict=True))}


def compile_times(loaded: LoadedModel) -> dict[str, float]:
    assert loaded.tokenizer is not None
    fresh = GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size, loaded.eos_token_ids)
    t0 = time.perf_counter()
    fresh.ll_tokenizer()
    t1 = time.perf_counter()
    cold = fresh.compile(Constraint("json_schema", json.dumps(SCHEMA)))
    t2 = time.perf_counter()
    other = dict(SCHEMA, required=["answer", "topic"])  # a second, distinct schema
    fresh.compile(Constraint("json_schema", json.dumps(other)))
    t3 = time.perf_counter()
    again = fresh.compile(Constraint("json_schema", json.dumps(SCHEMA)))
    t4 = time.perf_counter()
    assert again is cold
    return {"llguidance_tokenizer_ms": 1e3 * (t1 - t0), "schema_cold_ms": 1e3 * (t2 - t1),
            "second_schema_ms": 1e3 * (t3 - t2), "cached_ms": 1e3 * (t4 - t3)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.structured",
                                description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=64, help="N, all at once (default 64)")
    p.add_argument("--repeat", type=int, default=3, help="rounds of both (default 3)")
    p.add_argument("--max-tokens", type=int, default=320,
                   help="cap of a constrained request (default 320)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--output-json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model("default")
    assert loaded.tokenizer is not None
    compiles = compile_times(loaded)
    print("compile:", json.dumps({k: round(v, 3) for k, v in compiles.items()}), flush=True)
    compiler = GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size, loaded.eos_token_ids)
    prompts = _prompts(loaded, args.num_requests, args.seed)
    engine = _engine(loaded, args.num_requests, args.max_num_batched_tokens)
    # Every prompt once, so that every round of both modes finds the same prompt blocks in
    # the prefix cache. Warming two prompts left the first json_schema round the only one to
    # prefill all 64 prompts cold (7 prefill steps instead of 1, ~3 s on 2 cores), and the
    # free round after it found them cached: a cost of the order, not of the constraint.
    warm = [engine.make_request(ids, SamplingParams(temperature=0, max_tokens=1))
            for ids in prompts]
    engine.generate(warm)
    mask = mask_cost(compiler, loaded, args.num_requests)
    print("mask at batch", args.num_requests, json.dumps({k: round(v, 3) for k, v in mask.items()}),
          flush=True)
    rounds: dict[str, list[dict[str, Any]]] = {"json_schema": [], "free": []}
    lengths = None
    for rnd in range(args.repeat):
        # The first round runs json_schema first (free needs its lengths); later rounds
        # alternate which mode goes first, so that a drift of the machine's speed within a
        # round does not always fall on the same mode.
        if rnd % 2 == 1:
            f = run(engine, compiler, prompts, lengths, args.max_tokens)
            c = run(engine, compiler, prompts, None, args.max_tokens)
        else:
            c = run(engine, compiler, prompts, None, args.max_tokens)
            lengths = lengths or c["lengths"]
            f = run(engine, compiler, prompts, lengths, args.max_tokens)
        assert c["lengths"] == lengths, "greedy constrained output changed between rounds"
        rounds["json_schema"].append(c)
        rounds["free"].append(f)
        print(f"  round {rnd + 1}: json_schema {c['output_tok_per_s']:.1f} tok/s "
              f"({c['step_ms']:.1f} ms/step; mask fill {c['fill_ms_per_step']:.2f}, wait "
              f"{c['wait_ms_per_step']:.2f}, apply {c['apply_ms_per_step']:.2f} ms/step; "
              f"{c['valid']}/{args.num_requests} valid), free {f['output_tok_per_s']:.1f} tok/s "
              f"({f['step_ms']:.1f} ms/step); ratio {f['wall_s'] / c['wall_s']:.3f}",
              flush=True)
    median = {k: sorted(v, key=lambda r: r["wall_s"])[(len(v) - 1) // 2]
              for k, v in rounds.items()}
    ratio = median["json_schema"]["output_tok_per_s"] / median["free"]["output_tok_per_s"]
    # Each round's own ratio too (the two modes of a round ran back to back).
    per_round = [f["wall_s"] / c["wall_s"] for c, f in zip(rounds["json_schema"], rounds["free"],
                                                          strict=True)]
    print(f"json_schema / free output tok/s: {ratio:.3f} (median rounds); per round: "
          + ", ".join(f"{r:.3f}" for r in per_round))
    report = {"machine": {**environment(), "torch_threads": torch.get_num_threads()},
              "args": recorded(vars(args)), "schema": SCHEMA, "compile": compiles,
              "mask_at_batch": mask, "median": median, "rounds": rounds, "ratio": ratio,
              "ratio_per_round": per_round}
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
