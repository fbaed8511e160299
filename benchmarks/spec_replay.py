"""What other draft lengths would have given, replayed from a `benchmarks.spec_decode` run.

Greedy outputs are the same with and without speculation, so the plain side's tokens of a
run are the exact continuation every draft is checked against: a step drafts from the
prompt and the output so far (the proposer's longest suffix match, n = 2..4), accepts the
drafts that equal the next tokens, and emits those plus one. Steps cost 1 + c per drafted
row (c: a verification row's cost over a one-row step's, e.g. from `benchmarks.native_ab`
at batch 1 and 4). A policy gives the draft length from the match length n.

    python -m benchmarks.spec_replay bench-results/issue21-session10/spec-decode-cpu.json --row-cost 0.2,0.32
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from benchmarks.spec_decode import task_prompt
from worker.spec_decode.ngram import NgramProposer
from worker.weights import load_model

Policy = Callable[[int], int]
POLICIES: dict[str, Policy] = {
    **{f"k={k}": (lambda n, k=k: k) for k in (2, 3, 4, 5)},
    "n=4: 3, n=3: 3, n=2: 2": lambda n: {4: 3, 3: 3, 2: 2}[n],
    "n=4: 5, n=3: 3, n=2: 1": lambda n: {4: 5, 3: 3, 2: 1}[n],
    "n=4: 4, n=3: 2, n=2: 0": lambda n: {4: 4, 3: 2, 2: 0}[n],
}


def _match_len(proposer: NgramProposer, tokens: list[int]) -> int:
    """The length of the suffix the proposer matches (0: none), asking it with each bound."""
    for n in range(proposer.max_n, proposer.min_n - 1, -1):
        if NgramProposer(1, n, n).propose(tokens):
            return n
    return 0


def replay(seqs: list[tuple[list[int], list[int]]], policy: Policy, row_cost: float) -> dict[str, float]:
    cost = steps = drafted = accepted = out = 0.0
    finder = NgramProposer(1, 2, 4)
    for prompt, tokens in seqs:
        i = 1  # the first output token comes from the prefill step
        while i < len(tokens):
            so_far = prompt + tokens[:i]
            n = _match_len(finder, so_far)
            k = min(policy(n), len(tokens) - i - 1) if n else 0
            drafts = NgramProposer(k, n, n).propose(so_far) if k > 0 else []
            a = 0
            while a < len(drafts) and drafts[a] == tokens[i + a]:
                a += 1
            i += a + 1
            steps += 1
            cost += 1 + row_cost * len(drafts)
            drafted += len(drafts)
            accepted += a
        out += len(tokens) - 1
    return {"speedup": out / cost, "tokens_per_step": out / steps, "acceptance": accepted / max(drafted, 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", help="a benchmarks.spec_decode --output-json file (default model)")
    ap.add_argument("--row-cost", default="0.2,0.32", help="comma list of c")
    args = ap.parse_args(argv)
    report = json.loads(Path(args.report).read_text())
    tok = load_model("default").tokenizer
    assert tok is not None
    plain = report["rounds"][0]["plain"]
    seqs = [(task_prompt(tok, t), plain[t]["tokens"]) for t in report["tasks"]]
    costs = [float(c) for c in args.row_cost.split(",")]
    print("| policy (draft length by match length) | " + " | ".join(f"speedup, c = {c}" for c in costs)
          + " | tokens per step | acceptance |")
    print("|---|" + "---|" * (len(costs) + 2))
    for name, policy in POLICIES.items():
        rows = [replay(seqs, policy, c) for c in costs]
        print(f"| {name} | " + " | ".join(f"{r['speedup']:.2f}x" for r in rows)
              + f" | {rows[0]['tokens_per_step']:.2f} | {rows[0]['acceptance']:.0%} |")


if __name__ == "__main__":
    main()
