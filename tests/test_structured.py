"""Structured outputs (worker/structured.py, worker/logits_masks.py), logit_bias and
min_tokens.

In process: the bitmask is applied as llguidance's own numpy reference applies it, padding
ids past the tokenizer are never allowed, the compile cache and its errors, and greedy
decoding under a constraint is transformers' greedy over the tokens llguidance allows, the
same alone and in a batch. Against a real `llm-worker serve` process, on both protocols:
20 sampled outputs (temperature 1, 20 seeds) under a regex, a choice, a GBNF grammar and a
nested JSON schema all match (the schema checked by `jsonschema`); bad constraints are
INVALID_ARGUMENT naming the field, and the worker stays SERVING with every block free;
logit_bias bans and forces tokens; min_tokens holds with EOS not ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import llguidance.numpy as llg_np
import numpy as np
import pytest
import torch
from llmworker.v1 import worker_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from scheduler.request import Request, SamplingParams
from tests.test_hostile import healthy_and_free
from tests.test_server import Worker, run
from worker import logits_masks
from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.door import MAX_STATUS_CHARS
from worker.engine import Engine
from worker.logits_masks import LogitsMasks, StepMasks
from worker.structured import ERROR_CHARS, Constraint, ConstraintError, GrammarCompiler
from worker.tokenizer import Tokenizer

N_SAMPLES = 20
CODE = r"[A-Z]{3}-\d{4}"
CHOICES = ["sunny", "rainy", "cloudy", "snowy"]
ARITHMETIC_GBNF = """\
root   ::= expr
expr   ::= term (("+" | "-") term){0,3}
term   ::= factor (("*" | "/") factor){0,2}
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]{0,2}
"""
# Nested: objects, an array of objects, enums, required fields, numbers with bounds.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "height_m": {"type": "number", "minimum": 1.2, "maximum": 2.3},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "pets": {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "kind": {"type": "string", "enum": ["cat", "dog", "fish"]},
                    "legs": {"type": "integer", "minimum": 0, "maximum": 4},
                },
                "required": ["kind", "legs"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["name", "age", "height_m", "role", "address", "pets"],
    "additionalProperties": False,
}


def parses_arithmetic(text: str) -> bool:
    """Does `text` derive from ARITHMETIC_GBNF? (A recursive-descent reader of it.)"""
    pos = 0

    def peek() -> str:
        return text[pos] if pos < len(text) else ""

    def number() -> bool:
        nonlocal pos
        m = re.compile(r"[1-9][0-9]{0,2}").match(text, pos)
        if not m:
            return False
        pos = m.end()
        return True

    def factor() -> bool:
        nonlocal pos
        if peek() == "(":
            pos += 1
            if not expr() or peek() != ")":
                return False
            pos += 1
            return True
        return number()

    def chain(item, ops: str, most: int) -> bool:
        nonlocal pos
        if not item():
            return False
        for _ in range(most):
            if not peek() or peek() not in ops:
                break
            pos += 1
            if not item():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/", 2)

    def expr() -> bool:
        return chain(term, "+-", 3)

    return expr() and pos == len(text)


# ----- in process -----------------------------------------------------------------------------


def _rows(n: int, **params) -> list[Request]:
    return [Request(f"r{i}", [1], SamplingParams(**params)) for i in range(n)]


def test_bitmask_applied_as_llguidance_applies_it(monkeypatch) -> None:
    """Random bitmasks on some rows of random logits: those rows are llguidance.numpy's
    `apply_token_bitmask_inplace` result, the others are untouched."""
    vocab = 1000  # not a multiple of 32: the last word's high bits are past the vocabulary
    masks = LogitsMasks(vocab, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    rows = [0, 2, 3]
    bitmask = torch.randint(-(2**31), 2**31 - 1, (8, masks.words), dtype=torch.int32,
                            generator=gen)
    bitmask[:, 3] = 0  # words that ban all 32 tokens, and words that allow all 32
    bitmask[:, 5] = -1
    bitmask[1, :] = 0
    masks._bitmask = bitmask
    logits = torch.randn(5, vocab, generator=gen)
    want = logits.numpy().copy()
    for k, row in enumerate(rows):
        one = want[row : row + 1]
        llg_np.apply_token_bitmask_inplace(one, bitmask[k : k + 1].numpy())
        want[row] = one[0]
    got = masks.apply(logits.clone(), StepMasks(_rows(5), rows))
    assert np.array_equal(got.numpy(), want)
    assert torch.isinf(got[rows]).any() and torch.isfinite(got[[1, 4]]).all()
    # The CPU's C kernel (cpu_kernels/token_bitmask.c) and the torch path (a GPU's) agree.
    assert logits_masks._c_usable(logits), "the C kernel builds here"
    monkeypatch.setattr(logits_masks, "_c_usable", lambda _: False)
    assert np.array_equal(masks.apply(logits.clone(), StepMasks(_rows(5), rows)).numpy(), want)


def test_logit_bias_and_min_tokens_rows() -> None:
    masks = LogitsMasks(50, torch.device("cpu"))
    reqs = [Request("a", [1], SamplingParams(logit_bias={3: 5.0, 7: -100.0}), eos_token_ids=(2,)),
            Request("b", [1], SamplingParams(min_tokens=2, stop_token_ids=[9], max_tokens=4),
                    eos_token_ids=(2,)),
            Request("c", [1], SamplingParams(min_tokens=1, ignore_eos=True), eos_token_ids=(2,))]
    step = masks.start(reqs)
    assert step is not None and step.fill is None  # no grammar: nothing to fill
    got = masks.apply(torch.zeros(3, 50), step)
    want = torch.zeros(3, 50)
    want[0, 3], want[0, 7] = 5.0, -100.0
    want[1, 2] = want[1, 9] = float("-inf")  # EOS and the stop id, below min_tokens
    assert torch.equal(got, want)  # row c: ignore_eos, no stop ids: nothing masked
    reqs[1].append_output_token(5)
    reqs[1].append_output_token(6)  # min_tokens reached: nothing left to do for b
    assert masks.start([reqs[1]]) is None


def test_grammar_rows_beside_bias_rows(tok, compiler) -> None:
    """A step of grammar rows only skips the bias pass (`StepMasks.bias` False) and masks
    just as the grammar says; a grammar row beside a logit_bias row (and one below its
    min_tokens) gets both, each row its own. Each row's mask lands in its own place."""
    grammar = compiler.compile(Constraint("choice", choices=("yes", "no")))
    vocab = tok.vocab_size
    bits = np.unpackbits(np.frombuffer(grammar.matcher().matcher.compute_bitmask(), np.uint8),
                         bitorder="little")
    allowed = set(np.flatnonzero(bits[:vocab]).tolist())  # llguidance's own bitmask
    assert 0 < len(allowed) < 100
    masks = LogitsMasks(vocab, torch.device("cpu"))

    def constrained(name: str) -> Request:
        r = Request(name, [1], SamplingParams(), eos_token_ids=tok.eos_token_ids)
        r.grammar = grammar.matcher()
        return r

    only = [constrained("g0"), constrained("g1")]
    step = masks.start(only)
    assert step is not None and not step.bias
    got = masks.apply(torch.zeros(2, vocab), step)
    for row in got:
        assert set(torch.isfinite(row).nonzero().flatten().tolist()) == allowed
    eos = tok.eos_token_ids[0]
    mixed = [Request("b", [1], SamplingParams(logit_bias={5: 3.0}), eos_token_ids=(eos,)),
             constrained("g2"),
             Request("m", [1], SamplingParams(min_tokens=1), eos_token_ids=(eos,))]
    step = masks.start(mixed)
    assert step is not None and step.bias and step.grammar_rows == [1]
    got = masks.apply(torch.zeros(3, vocab), step)
    assert got[0, 5] == 3.0 and torch.isfinite(got[0]).all()
    assert set(torch.isfinite(got[1]).nonzero().flatten().tolist()) == allowed
    assert got[2, eos] == float("-inf") and torch.isfinite(got[2]).sum() == vocab - 1


def test_min_tokens_yields_to_a_grammar_that_allows_only_stop_ids(tok, compiler) -> None:
    """A row whose grammar allows nothing but the stop ids min_tokens bans keeps the
    grammar's tokens (before: every logit -inf, a token the grammar refused, and the request
    failed as a server error); where the grammar allows more, the ban holds."""
    def allowed(grammar) -> list[int]:
        bits = np.unpackbits(np.frombuffer(grammar.matcher().matcher.compute_bitmask(), np.uint8),
                             bitorder="little")
        return np.flatnonzero(bits[: tok.vocab_size]).tolist()

    only_digits = compiler.compile(Constraint("regex", "[0-9]"))
    words = compiler.compile(Constraint("regex", "[0-9a-z]+"))
    digits = allowed(only_digits)
    assert len(digits) == 10 and all(tok.decode([t]).isdigit() for t in digits)
    assert len(allowed(words)) > 100
    reqs = []
    for name, grammar in (("digits", only_digits), ("words", words)):
        r = Request(name, [1], SamplingParams(min_tokens=2, stop_token_ids=digits),
                    eos_token_ids=tok.eos_token_ids)
        r.grammar = grammar.matcher()
        reqs.append(r)
    masks = LogitsMasks(tok.vocab_size, torch.device("cpu"))
    got = masks.apply(torch.randn(2, tok.vocab_size), masks.start(reqs))
    assert torch.isfinite(got[0]).nonzero().flatten().tolist() == digits
    assert torch.isfinite(got[1]).nonzero().flatten().tolist() == sorted(set(allowed(words)) - set(digits))


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlapped"])
def test_padding_ids_are_never_allowed(tok, overlap) -> None:
    """A model vocabulary wider than the tokenizer's (padded, as many GGUFs are): a row's
    bitmask allows no id past the tokenizer, even where a grammar allows anything. Filled
    in apply (the CPU's way) and in a helper thread during the forward pass (a GPU's)."""
    padded = tok.vocab_size + 40
    grammar = GrammarCompiler(tok, padded, tok.eos_token_ids).compile(
        Constraint("regex", r"(.|\n)*"))
    req = Request("p", [1], SamplingParams(), eos_token_ids=tok.eos_token_ids)
    req.grammar = grammar.matcher()
    masks = LogitsMasks(padded, torch.device("cpu"), overlap=overlap)
    step = masks.start([req])
    assert step is not None and (step.fill is not None) == overlap
    got = masks.apply(torch.zeros(1, padded), step)[0]
    assert torch.isinf(got[tok.vocab_size :]).all()
    assert torch.isfinite(got[: tok.vocab_size]).sum() > tok.vocab_size // 2


def test_compile_cache_and_errors(compiler) -> None:
    c = Constraint("json_schema", json.dumps(SCHEMA))
    first = compiler.compile(c)
    misses = compiler.num_compiled
    assert compiler.compile(Constraint("json_schema", json.dumps(SCHEMA))) is first
    assert compiler.num_compiled == misses
    a, b = first.matcher(), first.matcher()  # copies: one request's tokens are its own
    (brace,) = compiler.ll_tokenizer().tokenize_str("{")
    assert a.accept(brace) and a.num_accepted == 1 and b.num_accepted == 0
    assert a.matcher.validate_tokens([brace]) == 0 and b.matcher.validate_tokens([brace]) == 1
    bad = {
        Constraint("json_schema", '{"type": "foo"}'): "Invalid type",
        Constraint("json_schema", '{"type": '): "not valid JSON",
        Constraint("json_schema", "[" * 50_000): "not valid JSON",  # past Python's stack
        Constraint("regex", "[a-"): "unclosed character class",
        Constraint("gbnf", "root ::= expr\nexpr ::= missing"): "missing",
        Constraint("lark", "start: missing"): "missing",
        Constraint("choice", choices=()): "is empty",
        Constraint("regex", "(" * 5000): "",  # a long message is cut
    }
    for constraint, says in bad.items():
        with pytest.raises(ConstraintError) as e:
            compiler.compile(constraint)
        assert says in e.value.problem and len(e.value.problem) < ERROR_CHARS + 40, e.value


def _hf_constrained_greedy(hf_model, grammar, ids: list[int], max_new: int,
                           eos: tuple[int, ...]) -> list[int]:
    """transformers' logits, llguidance's own mask (numpy), argmax: the reference."""
    m = grammar.matcher().matcher
    vocab = hf_model.config.vocab_size
    out: list[int] = []
    past, feed = None, ids
    with torch.inference_mode():
        while len(out) < max_new and not m.is_stopped():
            res = hf_model(torch.tensor([feed]), past_key_values=past, use_cache=True)
            past = res.past_key_values
            logits = res.logits[0, -1:].float().numpy().copy()
            bm = llg_np.allocate_token_bitmask(1, vocab)
            llg_np.fill_next_token_bitmask(m, bm)
            llg_np.apply_token_bitmask_inplace(logits, bm)
            t = int(logits.argmax())
            out.append(t)
            feed = [t]
            assert m.consume_token(t)
            if t in eos:
                break
    return out


def test_greedy_under_a_constraint_is_transformers_and_batch_invariant(
        default_model, hf_model, chat_prompt_ids) -> None:
    tok = default_model.tokenizer
    compiler = GrammarCompiler(tok, default_model.config.vocab_size, default_model.eos_token_ids)
    engine = Engine(WorkerConfig(model=ModelConfig(max_model_len=1024),
                                 cache=CacheConfig(kv_cache_memory=0.25),
                                 scheduler=SchedulerConfig(max_num_seqs=16,
                                                           max_num_batched_tokens=256)),
                    loaded=default_model)
    cases = [(chat_prompt_ids[7], Constraint("regex", r"[0-9]{2,4}( is the answer)?"), 12),
             (chat_prompt_ids[0], Constraint("json_schema", json.dumps(SCHEMA)), 160),
             (chat_prompt_ids[4], Constraint("choice", choices=("yes", "no", "maybe")), 8)]

    def request(ids, constraint, max_tokens):
        req = engine.make_request(ids, SamplingParams(temperature=0, max_tokens=max_tokens))
        req.grammar = compiler.compile(constraint).matcher()
        return req

    alone = [engine.generate([request(*case)])[0] for case in cases]
    companions = [engine.make_request(ids, SamplingParams(temperature=1.0, seed=i, max_tokens=10))
                  for i, ids in enumerate(chat_prompt_ids[1:4])]
    together = engine.generate([companions[0], *(request(*c) for c in cases), *companions[1:]])
    for (ids, constraint, max_tokens), one, batched in zip(cases, alone, together[1:4],
                                                           strict=True):
        assert one.token_ids == batched.token_ids, constraint.kind
        want = _hf_constrained_greedy(hf_model, compiler.compile(constraint), ids, max_tokens,
                                      default_model.eos_token_ids)
        assert one.token_ids == want, (constraint.kind, tok.decode(one.token_ids),
                                       tok.decode(want))
        assert one.finish_reason == "stop", (constraint.kind, one.text)
    assert re.fullmatch(r"[0-9]{2,4}( is the answer)?", alone[0].text)
    jsonschema.validate(json.loads(alone[1].text), SCHEMA)
    assert alone[2].text in ("yes", "no", "maybe")
    assert not engine.scheduler.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.budget.num_blocks
    stats = engine.runner.logits_masks.stats
    assert stats.num_rows > 0 and stats.fill_s > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constrained_requests_survive_preemption(default_model, chat_prompt_ids, mode) -> None:
    """A 32-block cache for 6 JSON requests: preemption is constant (recomputed requests
    keep their tokens, so their matchers stay where they were); every output is the one
    the request gets in a large cache, and those that finish validate."""
    tok = default_model.tokenizer
    compiler = GrammarCompiler(tok, default_model.config.vocab_size, default_model.eos_token_ids)
    grammar = compiler.compile(Constraint("json_schema", json.dumps(SCHEMA)))
    block = 16 * 2 * 30 * 3 * 64 * 4  # a 16-token block of SmolLM2-135M in float32

    def engine(blocks: int, swap: int = 0, preemption: str = mode) -> Engine:
        return Engine(WorkerConfig(
            model=ModelConfig(max_model_len=512),
            cache=CacheConfig(kv_cache_memory=blocks * block / (1 << 30),
                              swap_space=swap * block / (1 << 30)),
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=128,
                                      preemption_mode=preemption)), loaded=default_model)

    def requests(e: Engine) -> list[Request]:
        reqs = []
        for i, ids in enumerate(chat_prompt_ids[:6]):
            r = e.make_request(ids, SamplingParams(temperature=0.8, seed=i, max_tokens=160))
            r.grammar = grammar.matcher()
            reqs.append(r)
        return reqs

    big = engine(400, preemption="recompute")
    want = [c.token_ids for c in big.generate(requests(big))]
    small = engine(32, swap=200 if mode == "swap" else 0)
    got = small.generate(requests(small))
    assert small.num_preemptions > 0
    assert [c.token_ids for c in got] == want
    for c in got:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert sum(c.finish_reason == "stop" for c in got) >= len(got) // 2
    assert small.kv.num_free_blocks == small.kv.num_blocks


# ----- a real worker --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker("--max-generation-time-s", "120")
    try:
        yield w.wait_ready()
    finally:
        w.close()


def _chat(text: str) -> pb.ChatInput:
    return pb.ChatInput(messages=[pb.ChatMessage(role="user", content=text)])


def sample_ours(w: Worker, n: int = N_SAMPLES, max_tokens: int = 128,
                **fields) -> list[tuple[str, pb.GenerateComplete]]:
    """n sampled outputs (temperature 1, seeds 1000..), sent at once: (text, complete)."""
    def one(seed: int) -> tuple[str, pb.GenerateComplete]:
        chunks, complete = run(w.stub, timeout=300, **fields,
                               sampling=pb.SamplingParams(temperature=1.0, seed=seed),
                               stopping=pb.StoppingCriteria(max_tokens=max_tokens))
        return "".join(c.text for c in chunks), complete

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(1000, 1000 + n)))


def _all_stop(outs: list[tuple[str, pb.GenerateComplete]]) -> list[str]:
    for text, complete in outs:
        assert complete.finish_reason == pb.FINISH_REASON_STOP, (text, complete)
    texts = [t for t, _ in outs]
    assert len(set(texts)) > 1, texts  # 20 seeds sampled, not one fixed answer
    return texts


def test_regex_outputs_all_match(worker) -> None:
    texts = _all_stop(sample_ours(worker, chat=_chat("Invent a product code for a new gadget."),
                                  regex=CODE))
    for t in texts:
        assert re.fullmatch(CODE, t), t


def test_choice_outputs_are_the_choices(worker) -> None:
    texts = _all_stop(sample_ours(worker, chat=_chat("What will the weather be tomorrow?"),
                                  choice=pb.ChoiceConstraint(choices=CHOICES)))
    assert set(texts) <= set(CHOICES), texts


def test_gbnf_arithmetic_outputs_all_parse(worker) -> None:
    grammar = pb.GrammarConstraint(text=ARITHMETIC_GBNF, syntax=pb.GRAMMAR_SYNTAX_GBNF)
    texts = _all_stop(sample_ours(worker, chat=_chat("Write an arithmetic expression."),
                                  grammar=grammar))
    for t in texts:
        assert parses_arithmetic(t), t


def test_json_schema_outputs_all_validate(worker) -> None:
    prompt = "Describe a person (name, age, height, role, address, pets) as JSON."
    texts = _all_stop(sample_ours(worker, max_tokens=256, chat=_chat(prompt),
                                  json_schema=json.dumps(SCHEMA)))
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)


def test_lark_and_json_object(worker) -> None:
    lark = pb.GrammarConstraint(text='start: ("yes" | "no") "!"', syntax=pb.GRAMMAR_SYNTAX_LARK)
    for text in _all_stop(sample_ours(worker, n=6, chat=_chat("Do you agree?"), grammar=lark)):
        assert text in ("yes!", "no!")
    outs = sample_ours(worker, n=6, max_tokens=256, chat=_chat("Give me a JSON object."),
                       json_object=True)
    # Any object: its strings are unbounded, so some may run out of max_tokens.
    done = [t for t, c in outs if c.finish_reason == pb.FINISH_REASON_STOP]
    assert len(done) >= len(outs) // 2, outs
    for text in done:
        assert isinstance(json.loads(text), dict), text


BAD = [
    ({"json_schema": '{"type": "foo"}'}, "json_schema", "Invalid type"),
    ({"json_schema": '{"type": '}, "json_schema", "not valid JSON"),
    ({"regex": "[a-"}, "regex", "unclosed character class"),
    ({"grammar": pb.GrammarConstraint(text="root ::= expr\nexpr ::= undefined_rule",
                                      syntax=pb.GRAMMAR_SYNTAX_GBNF)},
     "grammar.text", "undefined_rule"),
    ({"grammar": pb.GrammarConstraint(text="start: undefined_rule")}, "grammar.text",
     "undefined_rule"),
    ({"grammar": pb.GrammarConstraint(text="start: a", syntax=7)}, "grammar.syntax", "unknown"),
    ({"choice": pb.ChoiceConstraint()}, "choice.choices", "empty"),
    ({"regex": r"[^\s\S]"}, "regex", "allows no output: no token can begin it"),
    ({"json_schema": '{"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}'}, "json_schema",
     "allows no output"),
    ({"json_schema": '{"type": "object", "x-guidance": "zzz"}'}, "json_schema",
     "x-guidance must be an object"),
    ({"regex": "a" * (64 * 1024 + 1)}, "regex", "--max-structured-bytes"),
    ({"json_schema": json.dumps({"enum": ["x" * 1000] * 70})}, "json_schema",
     "--max-structured-bytes"),
    ({"sampling": pb.SamplingParams(logit_bias={5: 150.0})}, "sampling_params.logit_bias",
     "[-100, 100]"),
    ({"sampling": pb.SamplingParams(logit_bias={t: 1.0 for t in range(1025)})},
     "sampling_params.logit_bias", "at most 1024"),
    ({"sampling": pb.SamplingParams(logit_bias={10**6: 1.0})}, "sampling_params.logit_bias",
     "vocabulary"),
    ({"stopping": pb.StoppingCriteria(max_tokens=4, min_tokens=5)}, "stopping.min_tokens",
     "max_tokens"),
    # banned while min_tokens holds, such an id failed the whole model step (session 27)
    ({"stopping": pb.StoppingCriteria(max_tokens=4, min_tokens=1, stop_token_ids=[49152])},
     "stopping.stop_token_ids", "has token id 49152, out of the vocabulary [0, 49152)"),
    ({"stopping": pb.StoppingCriteria(max_tokens=4, stop_token_ids=[5, 2**32 - 1])},
     "stopping.stop_token_ids", "out of the vocabulary"),
]


@pytest.mark.parametrize(("fields", "field", "says"), BAD, ids=[f"{f}-{s}" for _, f, s in BAD])
def test_bad_constraints_are_invalid_argument(worker, fields, field, says) -> None:
    with pytest.raises(grpc.RpcError) as e:
        run(worker.stub, timeout=60, text="Hello", **fields)
    details = e.value.details() or ""
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, details
    assert field in details and says in details, details
    assert len(details) <= MAX_STATUS_CHARS


@pytest.mark.parametrize("fields", [
    {"regex": "((a{100}){100}){100}"},
    {"structural_tag": json.dumps({"type": "structural_tag", "format": {
        "type": "repeat", "min": 100000, "max": 100000, "content": {"type": "const_string", "value": "x"}}})},
], ids=["regex", "structural_tag"])
def test_a_constraint_past_the_grammar_engines_limits_is_the_clients_error(worker, fields) -> None:
    """A constraint that compiles and masks its first token but takes llguidance past one
    of its limits as it advances: INVALID_ARGUMENT saying so (INTERNAL before, a server
    fault), and the worker free after."""
    with pytest.raises(grpc.RpcError) as e:
        run(worker.stub, timeout=60, text="Output: ", sampling=pb.SamplingParams(temperature=0),
            stopping=pb.StoppingCriteria(max_tokens=8), **fields)
    details = e.value.details() or ""
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, details
    assert "the grammar refused token" in details and re.search(r"(?i)too many", details), details
    assert len(details) <= MAX_STATUS_CHARS
    healthy_and_free(worker)


def test_grammar_limits_are_told_from_refused_tokens() -> None:
    from worker.structured import grammar_limit as _grammar_limit

    assert _grammar_limit("lexer error: too many expressions constructed <state> Tokens: ⟦aaaa⟧")
    assert _grammar_limit("Too many items (limit 50000; ff_tokens) <state> ...")
    # a token the grammar does not allow, whatever it spells, is not a limit
    assert not _grammar_limit('Parser Error: token " limit" doesn\'t satisfy the grammar; too many')
    assert not _grammar_limit("Parser Error: something <state> too many rows, limit 3")


def test_worker_healthy_and_free_after_bad_constraints(worker) -> None:
    for fields, _, _ in BAD:
        with pytest.raises(grpc.RpcError):
            run(worker.stub, timeout=60, text="Hello", **fields)
    healthy_and_free(worker)


def _greedy_ids(w: Worker, prompt: str, **fields) -> tuple[list[int], pb.GenerateComplete]:
    stopping = fields.pop("stopping", pb.StoppingCriteria(max_tokens=64))
    sampling = fields.pop("sampling", pb.SamplingParams(temperature=0.0))
    chunks, complete = run(w.stub, timeout=120, chat=_chat(prompt), sampling=sampling,
                           stopping=stopping, **fields)
    return [t for c in chunks for t in c.token_ids], complete


def test_logit_bias_bans_and_forces(worker) -> None:
    prompt = "What is the capital of France?"
    ids, _ = _greedy_ids(worker, prompt)
    banned = ids[0]  # the greedy first token: the most likely one
    again, _ = _greedy_ids(worker, prompt,
                           sampling=pb.SamplingParams(temperature=0.0, logit_bias={banned: -100}))
    assert banned not in again and again != ids
    for seed in range(8):
        sampled, _ = _greedy_ids(worker, prompt, sampling=pb.SamplingParams(
            temperature=1.0, seed=seed, logit_bias={banned: -100}))
        assert banned not in sampled
    forced = 1234  # any token: +100 outweighs every logit the model gives
    for seed in range(4):
        out, complete = _greedy_ids(
            worker, prompt, stopping=pb.StoppingCriteria(max_tokens=8),
            sampling=pb.SamplingParams(temperature=1.0, seed=seed, logit_bias={forced: 100}))
        assert out == [forced] * 8 and complete.finish_reason == pb.FINISH_REASON_LENGTH


def test_min_tokens_holds_and_eos_still_ends(worker) -> None:
    prompt = "Reply with one word: yes or no?"
    eos = list(worker.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).eos_token_ids)
    ids, complete = _greedy_ids(worker, prompt)
    assert complete.finish_reason == pb.FINISH_REASON_STOP and ids[-1] in eos
    k = len(ids)  # greedy ends here with EOS
    floor = k + 5
    held, complete = _greedy_ids(worker, prompt,
                                 stopping=pb.StoppingCriteria(max_tokens=256, min_tokens=floor))
    assert len(held) >= floor and not set(held[: floor - 1]) & set(eos), held
    # EOS is not ignored: once past the minimum, it still ends the request.
    assert complete.finish_reason == pb.FINISH_REASON_STOP and held[-1] in eos, held


# ----- the vLLM protocol ----------------------------------------------------------------------


def sample_vllm(w: Worker, tok: Tokenizer, prompt: str, n: int = N_SAMPLES,
                max_tokens: int = 128, **constraint) -> list[tuple[str, vpb.GenerateComplete]]:
    ids = tok.encode_chat([{"role": "user", "content": prompt}])

    def one(seed: int) -> tuple[str, vpb.GenerateComplete]:
        req = vpb.GenerateRequest(
            tokenized=vpb.TokenizedInput(input_ids=ids),
            sampling_params=vpb.SamplingParams(temperature=1.0, seed=seed,
                                               max_tokens=max_tokens, **constraint))
        (resp,) = list(w.vllm.Generate(req, timeout=300))
        c = resp.complete
        return tok.decode(list(c.output_ids)), c

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def _vllm_all_stop(outs: list[tuple[str, vpb.GenerateComplete]]) -> list[str]:
    for text, c in outs:
        assert c.finish_reason == "stop", (text, c.finish_reason)
    texts = [t for t, _ in outs]
    assert len(set(texts)) > 1, texts
    return texts


def test_vllm_json_schema_and_regex(worker, tok) -> None:
    prompt = "Describe a person (name, age, height, role, address, pets) as JSON."
    for text in _vllm_all_stop(sample_vllm(worker, tok, prompt, max_tokens=256,
                                           json_schema=json.dumps(SCHEMA))):
        jsonschema.validate(json.loads(text), SCHEMA)
    for text in _vllm_all_stop(sample_vllm(worker, tok, "Invent a product code.", regex=CODE)):
        assert re.fullmatch(CODE, text), text


def test_vllm_choice_grammar_and_logit_bias(worker, tok) -> None:
    outs = sample_vllm(worker, tok, "What will the weather be tomorrow?", n=8,
                       choice=vpb.ChoiceConstraint(choices=CHOICES))
    assert set(_vllm_all_stop(outs)) <= set(CHOICES)
    # vLLM's `grammar` field: EBNF/GBNF or Lark, told apart by the syntax.
    for text in _vllm_all_stop(sample_vllm(worker, tok, "Write an arithmetic expression.", n=8,
                                           grammar=ARITHMETIC_GBNF)):
        assert parses_arithmetic(text), text
    for _, c in sample_vllm(worker, tok, "Count to five.", n=4, max_tokens=6,
                            logit_bias={1234: 100.0}):
        assert list(c.output_ids) == [1234] * 6
    ids = tok.encode_chat([{"role": "user", "content": "Reply with one word: yes or no?"}])

    def greedy(min_tokens: int) -> vpb.GenerateComplete:
        req = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=ids), sampling_params=(
            vpb.SamplingParams(temperature=0.0, max_tokens=256, min_tokens=min_tokens)))
        (resp,) = list(worker.vllm.Generate(req, timeout=120))
        return resp.complete

    free = greedy(0)
    assert free.finish_reason == "stop" and free.completion_tokens < 20
    # Ban every token of the greedy answer: none of them appears.
    banned = set(free.output_ids)
    req = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=ids), sampling_params=(
        vpb.SamplingParams(temperature=0.0, max_tokens=32,
                           logit_bias={t: -100.0 for t in banned})))
    (resp,) = list(worker.vllm.Generate(req, timeout=120))
    assert resp.complete.output_ids and not banned & set(resp.complete.output_ids)
    held = greedy(20)
    assert held.completion_tokens >= 20 and held.finish_reason == "stop"
    assert held.matched_token_id in tok.eos_token_ids
    healthy_and_free(worker)
