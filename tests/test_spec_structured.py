"""Speculative decoding beside structured outputs, logit_bias and min_tokens in one batch:
constrained requests get no drafts (their masks depend on the position), unconstrained ones
keep theirs, and every request's tokens are what it gets without speculation."""

from __future__ import annotations

import re

from scheduler.request import SamplingParams
from tests.test_spec_decode import GROUNDED, SPEC, _engine
from worker.structured import Constraint, GrammarCompiler
from worker.weights import LoadedModel

REGEX = r"[A-Z]{3}-\d{4}"


def test_constrained_and_drafted_requests_share_steps(default_model: LoadedModel) -> None:
    tok = default_model.tokenizer
    assert tok is not None
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}],
                                              add_generation_prompt=True)) for p in GROUNDED]
    code = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Give me a ticket code."}], add_generation_prompt=True))
    grammar = GrammarCompiler(tok, default_model.config.vocab_size,
                              default_model.eos_token_ids).compile(Constraint("regex", REGEX))
    eos = default_model.eos_token_ids[0]
    banned = tok.encode(" the")[0]

    def run(spec) -> tuple[list[list[int]], int]:
        engine = _engine(default_model, spec)
        reqs = [engine.make_request(p, SamplingParams(temperature=0.0, max_tokens=40)) for p in ids]
        constrained = engine.make_request(code, SamplingParams(temperature=0.0, max_tokens=20))
        constrained.grammar = grammar.matcher()
        at_least = engine.make_request(ids[0], SamplingParams(temperature=0.0, max_tokens=12,
                                                              min_tokens=12))
        biased = engine.make_request(ids[1], SamplingParams(temperature=0.0, max_tokens=40,
                                                            logit_bias={banned: -100.0}))
        done = engine.generate([*reqs, constrained, at_least, biased])
        assert not engine.scheduler.has_unfinished_requests()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        engine.kv.check_integrity()
        assert re.fullmatch(REGEX, done[len(reqs)].text), done[len(reqs)].text
        assert len(done[len(reqs) + 1].token_ids) == 12 and eos not in done[len(reqs) + 1].token_ids[:-1]
        assert banned not in done[len(reqs) + 2].token_ids
        return [d.token_ids for d in done], engine.num_accepted_tokens

    want, _ = run(None)
    got, accepted = run(SPEC)
    assert got == want
    assert accepted > 0  # the unconstrained ones were drafted and accepted drafts

