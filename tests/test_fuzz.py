"""Hostile input over the wire, with answers that are predicted, not merely "defined":

- a valid request (every field generated within every limit) gets OK, its chunks, and
  exactly one ``complete`` with finish reason stop or length and at most max_tokens tokens;
- a valid request with exactly one field broken (out of range, NaN, too long, too many,
  missing) gets INVALID_ARGUMENT whose message names that field;
- a request wild in every field, and raw bytes, get OK or INVALID_ARGUMENT (never UNKNOWN
  or INTERNAL: an exception that escaped validation), and bytes that do not parse as a
  GenerateRequest get INVALID_ARGUMENT;
- afterwards the worker is SERVING and no KV block outlives its request.

CI runs LLMWORKER_FUZZ_EXAMPLES (default 150) examples per test; set it to 10000 for the
long run whose figures go into RELIABILITY.md."""

from __future__ import annotations

import itertools
import math
import os
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llmworker.v1 import worker_pb2 as pb

from tests.test_server import MAX_MODEL_LEN, SERVICE, Worker, blocks_all_free, wait_until

EXAMPLES = int(os.environ.get("LLMWORKER_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large, HealthCheck.large_base_example])
VOCAB = 49152  # the default model's; the fixture checks it against GetModelInfo
DEFAULT_MAX_TOKENS = 4
MAX_STOP_STRINGS, MAX_STOP_LEN, MAX_REQUEST_ID_LEN, MAX_LOGPROBS = 16, 256, 256, 20  # defaults
ROLES = ("system", "user", "assistant")
seen: Counter[str] = Counter()
_ids = itertools.count()


@pytest.fixture(scope="module")
def fuzz_worker() -> Iterator[Worker]:
    w = Worker("--default-max-tokens", str(DEFAULT_MAX_TOKENS), "--max-waiting", "64")
    try:
        w.wait_ready()
        info = w.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert info.vocab_size == VOCAB, info
        yield w
    finally:
        w.close()


@dataclass
class Answer:
    code: grpc.StatusCode
    details: str
    completes: list[pb.GenerateComplete]
    num_tokens: int  # token ids over every chunk


def _call(w: Worker, request_bytes: bytes) -> Answer:
    """Generate with raw request bytes, the stream read to its end."""
    call = w.channel.unary_stream(f"/{SERVICE}/Generate")(request_bytes, timeout=60)
    completes, n = [], 0
    try:
        for raw in call:
            resp = pb.GenerateResponse.FromString(raw)
            if resp.HasField("complete"):
                completes.append(resp.complete)
            else:
                n += len(resp.chunk.token_ids)
    except grpc.RpcError as e:
        seen[e.code().name] += 1
        return Answer(e.code(), e.details() or "", completes, n)
    seen["OK"] += 1
    return Answer(grpc.StatusCode.OK, "", completes, n)


def _assert_ok(a: Answer, req: pb.GenerateRequest) -> None:
    assert a.code == grpc.StatusCode.OK, f"{a.code.name} {a.details!r} for a valid request {req}"
    assert len(a.completes) == 1, f"an OK stream must end with exactly one complete: {a}"
    done = a.completes[0]
    assert done.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), done
    max_tokens = req.stopping.max_tokens or DEFAULT_MAX_TOKENS
    assert done.usage.completion_tokens <= max_tokens, (done, max_tokens)
    assert done.usage.prompt_tokens >= 1, done


# ----- valid requests: every field within every limit ---------------------------------------

texts = st.text(max_size=120)


@st.composite
def valid_requests(draw, kind: str | None = None) -> pb.GenerateRequest:
    # A unique id when one is sent: an id still in flight would rightly be ALREADY_EXISTS.
    # (no control characters: the door refuses them in an id, see the wild requests)
    id_text = st.text(alphabet=st.characters(min_codepoint=0x20, exclude_characters="\x7f"), max_size=40)
    rid = draw(st.one_of(st.just(""), id_text.map(lambda t: f"{t}#{next(_ids)}")))
    req = pb.GenerateRequest(
        request_id=rid,
        priority=draw(st.integers(-(2**31), 2**31 - 1)),
        logprobs=draw(st.booleans()),
        top_logprobs=draw(st.integers(0, 5)),
        cache_salt=draw(texts),
        include_special_tokens=draw(st.booleans()),
    )
    kind = kind or draw(st.sampled_from(["text", "chat", "token_ids"]))
    if kind == "text":
        req.text = draw(st.text(min_size=1, max_size=120))
    elif kind == "chat":
        msgs = draw(st.lists(st.tuples(st.sampled_from(ROLES), texts), min_size=1, max_size=4))
        req.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in msgs)
    else:
        req.token_ids.ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=60)))
    s = req.sampling
    ranges = {"temperature": (0.0, 2.0), "top_p": (0.05, 1.0), "min_p": (0.0, 0.5),
              "repetition_penalty": (0.5, 2.0), "presence_penalty": (-2.0, 2.0),
              "frequency_penalty": (-2.0, 2.0)}
    for name, (lo, hi) in ranges.items():
        if draw(st.booleans()):
            setattr(s, name, draw(st.floats(lo, hi)))  # float32 on the wire, still in range
    if draw(st.booleans()):
        s.top_k = draw(st.integers(0, 100))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    stop = req.stopping
    stop.max_tokens = draw(st.integers(0, 5))  # 0: the worker's default; short keeps it fast
    stop.stop.extend(draw(st.lists(st.text(min_size=1, max_size=8), max_size=3)))
    stop.stop_token_ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), max_size=3)))
    stop.ignore_eos = draw(st.booleans())
    return req


@FUZZ
@given(req=valid_requests())
def test_valid_requests_get_ok_and_one_complete(fuzz_worker: Worker, req: pb.GenerateRequest) -> None:
    _assert_ok(_call(fuzz_worker, req.SerializeToString()), req)


# ----- one field broken: INVALID_ARGUMENT naming it -----------------------------------------

def _below(x: float) -> st.SearchStrategy[float]:
    return st.floats(max_value=x, exclude_max=True, width=32, allow_nan=False)


def _above(x: float) -> st.SearchStrategy[float]:
    return st.floats(min_value=x, exclude_min=True, width=32, allow_nan=False)


NAN = st.just(math.nan)
# field -> (the input kind it needs or None, the pattern its message must match, a breaker)
Breaker = Callable[[pb.GenerateRequest, st.DataObject], None]
BREAKERS: dict[str, tuple[str | None, str, Breaker]] = {}


def breaks(name: str, pattern: str, kind: str | None = None):
    def register(fn: Breaker) -> Breaker:
        BREAKERS[name] = (kind, pattern, fn)
        return fn
    return register


def _set_sampling(field: str, values: st.SearchStrategy) -> Breaker:
    return lambda req, data: setattr(req.sampling, field, data.draw(values, label=field))


for _field, _bad in {
    "temperature": st.one_of(_below(0.0), NAN, st.just(math.inf)),
    "top_p": st.one_of(_below(0.0), st.just(0.0), _above(1.0), NAN),
    "min_p": st.one_of(_below(0.0), _above(1.0), NAN),
    "repetition_penalty": st.one_of(_below(0.0), st.just(0.0), NAN, st.just(math.inf)),
    "presence_penalty": st.one_of(_below(-2.0), _above(2.0), NAN),
    "frequency_penalty": st.one_of(_below(-2.0), _above(2.0), NAN),
}.items():
    breaks(_field, _field)(_set_sampling(_field, _bad))
# -1 is "off" in vLLM; anything below it is wrong on either reading.
breaks("top_k", "top_k")(_set_sampling("top_k", st.integers(-(2**31), -2)))


@breaks("max_tokens", "max_tokens")
def _(req, data):  # more than max_model_len holds
    req.stopping.max_tokens = data.draw(st.integers(MAX_MODEL_LEN + 1, 2**32 - 1))


@breaks("stop count", r"stop")
def _(req, data):
    del req.stopping.stop[:]
    req.stopping.stop.extend(data.draw(st.lists(st.text(min_size=1, max_size=4),
                                                min_size=MAX_STOP_STRINGS + 1, max_size=40)))


@breaks("stop length", r"stop")
def _(req, data):
    long = data.draw(st.text(min_size=MAX_STOP_LEN + 1, max_size=MAX_STOP_LEN + 60))
    req.stopping.stop.insert(data.draw(st.integers(0, len(req.stopping.stop))), long)


@breaks("stop empty", r"stop")
def _(req, data):
    req.stopping.stop.insert(data.draw(st.integers(0, len(req.stopping.stop))), "")


@breaks("request_id", "request_id")
def _(req, data):
    req.request_id = data.draw(st.text(min_size=MAX_REQUEST_ID_LEN + 1,
                                       max_size=MAX_REQUEST_ID_LEN + 60))


@breaks("top_logprobs", "top_logprobs")
def _(req, data):
    req.top_logprobs = data.draw(st.integers(MAX_LOGPROBS + 1, 2**32 - 1))


@breaks("token id", r"token.?id", kind="token_ids")
def _(req, data):
    bad = data.draw(st.integers(VOCAB, 2**32 - 1))
    req.token_ids.ids.insert(data.draw(st.integers(0, len(req.token_ids.ids))), bad)


@breaks("token_ids empty", r"token_ids", kind="token_ids")
def _(req, data):
    req.token_ids.ClearField("ids")
    req.token_ids.SetInParent()


@breaks("chat role", r"role", kind="chat")
def _(req, data):
    role = data.draw(st.text(max_size=10).filter(lambda r: r not in (*ROLES, "tool")))
    i = data.draw(st.integers(0, len(req.chat.messages) - 1))
    req.chat.messages[i].role = role


@breaks("chat empty", r"messages", kind="chat")
def _(req, data):
    req.chat.ClearField("messages")
    req.chat.SetInParent()


@breaks("text empty", r"text", kind="text")
def _(req, data):
    req.text = ""


@breaks("no input", r"input")
def _(req, data):
    req.ClearField("input")


@FUZZ
@given(data=st.data(), which=st.sampled_from(sorted(BREAKERS)))
def test_one_broken_field_gets_invalid_argument_naming_it(
    fuzz_worker: Worker, data: st.DataObject, which: str
) -> None:
    kind, pattern, brk = BREAKERS[which]
    req = data.draw(valid_requests(kind), label="valid")
    brk(req, data)
    a = _call(fuzz_worker, req.SerializeToString())
    assert a.code == grpc.StatusCode.INVALID_ARGUMENT, f"{which}: {a.code.name} for {req}"
    assert re.search(pattern, a.details), f"{which}: the message {a.details!r} names no {pattern!r}"
    assert not a.completes and not a.num_tokens


# ----- wild requests and raw bytes: never an escaped exception ------------------------------

floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, 1.0, -1.0, 0.5, 2.0, 1e-9, 3.4e38, math.nan, math.inf, -math.inf]),
)
u32 = st.integers(0, 2**32 - 1)


@st.composite
def wild_requests(draw) -> pb.GenerateRequest:
    """Every field drawn from its whole wire range: valid or not, nobody predicts which."""
    req = pb.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), st.text(max_size=300).map(
            lambda t: f"{t}#{next(_ids)}"))),  # unique: never in flight twice
        priority=draw(st.integers(-(2**31), 2**31 - 1)),
        logprobs=draw(st.booleans()),
        top_logprobs=draw(st.one_of(st.integers(0, 25), u32)),
        cache_salt=draw(texts),
        include_special_tokens=draw(st.booleans()),
    )
    kind = draw(st.sampled_from(["text", "chat", "token_ids", "none"]))
    if kind == "text":
        req.text = draw(texts)
    elif kind == "chat":
        roles = st.one_of(st.sampled_from(ROLES), st.text(max_size=10))
        msgs = draw(st.lists(st.tuples(roles, texts), max_size=4))
        req.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in msgs)
        if not msgs:
            req.chat.SetInParent()
    elif kind == "token_ids":
        req.token_ids.ids.extend(draw(st.lists(st.one_of(st.integers(0, VOCAB + 48), u32),
                                               max_size=60)))
        if not req.token_ids.ids:
            req.token_ids.SetInParent()
    s = req.sampling
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        if draw(st.booleans()):
            setattr(s, name, draw(floats))
    if draw(st.booleans()):
        s.top_k = draw(st.integers(-(2**31), 2**31 - 1))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    stop = req.stopping
    # Small or huge: a mid-sized max_tokens would run for real; huge ones exceed
    # max_model_len and must be refused at the door.
    stop.max_tokens = draw(st.one_of(st.integers(0, 5), st.integers(10**6, 2**32 - 1)))
    stop.stop.extend(draw(st.lists(st.text(max_size=300), max_size=20)))
    stop.stop_token_ids.extend(draw(st.lists(u32, max_size=5)))
    # With min_tokens a stop id is banned on the logits: one past the vocabulary failed the
    # whole model step, every request in it (session 27's directed probe found it).
    if draw(st.booleans()):
        stop.min_tokens = draw(st.one_of(st.integers(0, 5), u32))
    stop.ignore_eos = draw(st.booleans())
    return req


@FUZZ
@given(req=wild_requests())
def test_every_field_wild_gets_ok_or_invalid_argument(
    fuzz_worker: Worker, req: pb.GenerateRequest
) -> None:
    a = _call(fuzz_worker, req.SerializeToString())
    if a.code == grpc.StatusCode.OK:
        _assert_ok(a, req)
    else:
        assert a.code == grpc.StatusCode.INVALID_ARGUMENT, f"{a.code.name} {a.details!r} for {req}"


@FUZZ
@given(data=st.binary(max_size=400))
def test_raw_bytes_get_ok_or_invalid_argument(fuzz_worker: Worker, data: bytes) -> None:
    a = _call(fuzz_worker, data)
    try:
        req = pb.GenerateRequest.FromString(data)
    except DecodeError:  # not a GenerateRequest at all: refused by worker/wire.py
        assert a.code == grpc.StatusCode.INVALID_ARGUMENT, (a.code, a.details)
        return
    if a.code == grpc.StatusCode.OK:
        _assert_ok(a, req)
    else:
        assert a.code == grpc.StatusCode.INVALID_ARGUMENT, (a.code, a.details)


def test_after_the_fuzz_the_worker_serves_and_holds_no_block(fuzz_worker: Worker) -> None:
    status = fuzz_worker.health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    wait_until(lambda: blocks_all_free(fuzz_worker), timeout=30, what="every block to be free")
    load = fuzz_worker.stub.GetLoad(pb.GetLoadRequest(), timeout=5)
    assert load.num_running == load.num_waiting == load.num_swapped == 0
    print("fuzz statuses:", dict(seen))
