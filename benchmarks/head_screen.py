"""Can a smaller copy of the LM head find the greedy token exactly? (issue 21)

    python -m benchmarks.head_screen --max-tokens 48 \\
        --output-json bench-results/issue21-session27/head-screen.json

The default model's LM head (its tied embedding, Q8_0) is 30 of the ~96 MB a batch-1 step
reads, and a greedy step wants only the argmax of its logits. A *screen* would read a copy
of the head with fewer bits a weight (here each block's Q8_0 integers requantized to `b`
bits on their own scale), giving approximate logits s. Given a bound e_i with
|logit_i - s_i| <= e_i for every row, only the *candidates*, the rows whose s_i + e_i reaches
max_j (s_j - e_j), need their exact logits, and the greedy token would be exactly the
default arithmetic's. This measures how many candidates that leaves, on the hidden states of
real greedy decode steps (chat prompts, the default model, captured from the fused decoder's
calls):

- `cs`: Cauchy-Schwarz, |(w_i - w~_i) . x| <= ||w_i - w~_i|| ||x|| (a norm a row, stored
  once; x's once a step), with x's `k` largest dimensions (by mean |x|: the hidden state's
  few massive activations) computed with the exact weights, so that only the rest is bounded;
- `l1`: per block of 32, max |w - w~| times the block's sum of |x|;
- `oracle`: the actual error as its own bound: what no rigorous bound can beat, and the
  candidates an unproven screen would leave.

The exact logits are computed in float64 from the GGUF's blocks; the engine's own (its
default arithmetic) are compared with them (`engine_max_diff`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.step import step_config
from clients.bench.environment import environment, recorded
from scheduler.request import SamplingParams
from worker.engine import Engine
from worker.weights import default_model_path

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain recursion to a five-year-old.",
    "List three uses of a paperclip.",
    "def fibonacci(n):\n    # complete this Python function",
    "Translate 'good morning' into Spanish and German.",
    "Why do cats purr? Answer in two sentences.",
    "What is 17 times 23?",
]
QBLOCK = 32


def head_blocks(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The tied head's Q8_0 blocks: scales d [V, K/32] and integers q [V, K/32, 32]."""
    from gguf import GGUFReader

    t = next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
    if t.tensor_type.name != "Q8_0":
        raise SystemExit(f"the head is {t.tensor_type.name}, not Q8_0")
    k = int(t.shape[0])
    raw = np.asarray(t.data).reshape(-1, k // QBLOCK, 2 + QBLOCK)
    d = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    return d, raw[..., 2:].copy().view(np.int8).astype(np.float64)


def capture(prompts: list[str], max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(hidden [steps, H], logits [steps, V]) of every greedy decode step of the prompts, one
    request at a time, as the fused decoder's calls returned them."""
    engine = Engine(step_config(1))
    decoder = engine.runner.cpu_decoder
    if decoder is None or decoder.head is None:
        raise SystemExit("no fused C decoder with a quantized head here (no gcc, or no AVX2)")
    tok, hidden, logits = engine.tokenizer, [], []
    decode = decoder.decode

    def kept(*a: Any, **k: Any) -> Any:
        h, lg = decode(*a, **k)
        if lg is not None:
            hidden.append(h.numpy().copy())
            logits.append(lg.numpy().copy())
        return h, lg

    decoder.decode = kept
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
        engine.generate([engine.make_request(ids, params)])
    return np.concatenate(hidden).astype(np.float64), np.concatenate(logits)


def candidates(s: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """Per step, the rows that may hold the maximum: s + bound >= max(s - bound)."""
    floor = (s - bound).max(axis=1, keepdims=True)
    return ((s + bound) >= floor).sum(axis=1)


def summary(counts: np.ndarray) -> dict[str, float]:
    return {"median": float(np.median(counts)), "p90": float(np.percentile(counts, 90)),
            "max": int(counts.max())}


def screen(d: np.ndarray, q: np.ndarray, bits: int) -> np.ndarray:
    """Each block's integers on `bits` signed levels of the block's own step (max |q| over
    the largest level), as Q8_0 units: what the screen's weights are."""
    top = 2 ** (bits - 1) - 1
    step = np.maximum(np.abs(q).max(axis=2, keepdims=True), 1) / top
    return np.clip(np.round(q / step), -top - 1, top) * step


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many chat prompts (1-{len(PROMPTS)})")
    ap.add_argument("--max-tokens", type=int, default=48, help="greedy tokens a prompt")
    ap.add_argument("--bits", default="4,3,2", help="the screens' bits a weight")
    ap.add_argument("--outliers", default="0,16,64", help="x's largest dimensions computed exactly (cs)")
    ap.add_argument("--output-json", type=Path)
    args = ap.parse_args(argv)
    d, q = head_blocks(default_model_path())
    vocab, nb = d.shape
    w = (d[..., None] * q).reshape(vocab, nb * QBLOCK)
    x, engine_logits = capture(PROMPTS[: args.prompts], args.max_tokens)
    exact = x @ w.T
    by_size = np.argsort(-np.abs(x).mean(axis=0))
    out: dict[str, Any] = {
        "args": recorded(vars(args)), "steps": int(x.shape[0]),
        "engine_max_diff": float(np.abs(exact - engine_logits).max()),
        "massive_dims": [int(i) for i in by_size[:4]],
        "x_abs_max": float(np.abs(x).max()), "x_norm_mean": float(np.linalg.norm(x, axis=1).mean()),
        "oracle_exact": summary(candidates(exact, np.zeros_like(exact))), "rows": []}
    print(f"{out['steps']} steps; the engine's logits within {out['engine_max_diff']:.2g} of float64's; "
          f"x: mean norm {out['x_norm_mean']:.1f}, max |x| {out['x_abs_max']:.1f} (dims {out['massive_dims']})")
    print("| bits | exact dims | bound | mean bound | actual error: mean | candidates: median (p90, max) |")
    print("|---|---|---|---|---|---|")
    for bits in map(int, args.bits.split(",")):
        qs = screen(d, q, bits)
        resid = (d[..., None] * (q - qs)).reshape(vocab, -1)  # w - w~
        for k in map(int, args.outliers.split(",")):
            big, rest = by_size[:k], by_size[k:]
            s = x[:, rest] @ (w[:, rest] - resid[:, rest]).T + x[:, big] @ w[:, big].T
            err = np.abs(exact - s)
            cs = np.linalg.norm(x[:, rest], axis=1)[:, None] * np.linalg.norm(resid[:, rest], axis=1)[None, :]
            bounds = {"oracle": err, "cs": cs}
            if k == 0:
                blocks = np.abs(x).reshape(x.shape[0], nb, QBLOCK).sum(axis=2)  # [steps, nb]
                bounds["l1"] = blocks @ (np.abs(resid).reshape(vocab, nb, QBLOCK).max(axis=2)).T
            for name, b in bounds.items():
                if name != "oracle":
                    assert (b >= err - 1e-9).all(), f"{name} is not a bound"
                row = {"bits": bits, "exact_dims": k, "bound": name, "mean_bound": float(b.mean()),
                       "mean_error": float(err.mean()), "candidates": summary(candidates(s, b))}
                out["rows"].append(row)
                c = row["candidates"]
                print(f"| {bits} | {k} | {name} | {row['mean_bound']:.3f} | {row['mean_error']:.3f} | "
                      f"{c['median']:.0f} ({c['p90']:.0f}, {c['max']}) |")
    if args.output_json:
        out["environment"] = environment()
        args.output_json.write_text(json.dumps(out, indent=1))
        print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
