"""Hostile input over the wire: random values in every field of GenerateRequest, and raw
bytes that are not a GenerateRequest at all. Every answer must be a defined status (never
UNKNOWN), the worker must stay SERVING, and no KV block may outlive its request.

CI runs LLMWORKER_FUZZ_EXAMPLES (default 150) examples per test; set it to 10000 for the
long run whose figures go into RELIABILITY.md."""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llmworker.v1 import worker_pb2 as pb

from tests.test_server import SERVICE, Worker, blocks_all_free, wait_until

EXAMPLES = int(os.environ.get("LLMWORKER_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# What a well-formed request may get back. INTERNAL or UNKNOWN would be a bug (an
# exception that escaped validation); DEADLINE_EXCEEDED would mean a request hung.
DEFINED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
seen: Counter[str] = Counter()


@pytest.fixture(scope="module")
def fuzz_worker() -> Iterator[Worker]:
    w = Worker("--default-max-tokens", "4", "--max-waiting", "64")
    try:
        yield w.wait_ready()
    finally:
        w.close()


floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, 1.0, -1.0, 0.5, 2.0, 1e-9, 3.4e38, math.nan, math.inf, -math.inf]),
)
u32 = st.integers(0, 2**32 - 1)
texts = st.text(max_size=120)


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    """Half the requests are wild in every field; the other half keep each field in its
    valid range (so the generation path is fuzzed too, not only validation)."""
    wild = draw(st.booleans())
    pick = (lambda w, t: draw(w if wild else t))  # noqa: E731
    req = pb.GenerateRequest(
        request_id=pick(st.one_of(st.just(""), st.text(max_size=300)), st.just("")),
        priority=pick(st.integers(-(2**31), 2**31 - 1), st.integers(-3, 3)),
        logprobs=draw(st.booleans()),
        top_logprobs=pick(st.one_of(st.integers(0, 25), u32), st.integers(0, 5)),
        cache_salt=draw(texts),
        include_special_tokens=draw(st.booleans()),
    )
    kind = draw(st.sampled_from(["text", "chat", "token_ids", "none"]))
    if kind == "text":
        req.text = draw(texts)
    elif kind == "chat":
        roles = st.one_of(st.sampled_from(["system", "user", "assistant"]), st.text(max_size=10))
        msgs = draw(st.lists(st.tuples(roles, texts), max_size=4))
        req.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in msgs)
        if not msgs:
            req.chat.SetInParent()
    elif kind == "token_ids":
        ids = st.one_of(st.integers(0, 49200), u32) if wild else st.integers(0, 49151)
        req.token_ids.ids.extend(draw(st.lists(ids, max_size=60)))
        if not req.token_ids.ids:
            req.token_ids.SetInParent()
    s = req.sampling
    sane = {"temperature": (0.0, 2.0), "top_p": (0.05, 1.0), "min_p": (0.0, 0.5),
            "repetition_penalty": (0.5, 2.0), "presence_penalty": (-2.0, 2.0),
            "frequency_penalty": (-2.0, 2.0)}
    for name, (lo, hi) in sane.items():
        if draw(st.booleans()):
            setattr(s, name, pick(floats, st.floats(lo, hi)))
    if draw(st.booleans()):
        s.top_k = pick(st.integers(-(2**31), 2**31 - 1), st.integers(0, 100))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    stop = req.stopping
    stop.max_tokens = pick(st.one_of(st.integers(0, 5), u32), st.integers(0, 5))
    stop.stop.extend(pick(st.lists(st.text(max_size=300), max_size=20),
                          st.lists(st.text(min_size=1, max_size=8), max_size=3)))
    stop.stop_token_ids.extend(pick(st.lists(u32, max_size=5),
                                    st.lists(st.integers(0, 49151), max_size=3)))
    stop.ignore_eos = draw(st.booleans())
    return req


def _call(w: Worker, request_bytes: bytes) -> grpc.StatusCode:
    """Generate with raw request bytes; the final status, the stream read to its end."""
    call = w.channel.unary_stream(f"/{SERVICE}/Generate")(request_bytes, timeout=60)
    n_complete = 0
    try:
        for raw in call:
            if pb.GenerateResponse.FromString(raw).HasField("complete"):
                n_complete += 1
    except grpc.RpcError as e:
        return e.code()
    assert n_complete == 1, "an OK stream must end with exactly one complete"
    return grpc.StatusCode.OK


@FUZZ
@given(req=generate_requests())
def test_every_field_fuzzed_gets_a_defined_status(fuzz_worker: Worker, req: pb.GenerateRequest) -> None:
    # Keep the fuzz fast: a mid-sized max_tokens would run for real. Huge ones stay (they
    # exceed max_model_len and must be refused at the door).
    if 5 < req.stopping.max_tokens < 1_000_000:
        req.stopping.max_tokens = 5
    code = _call(fuzz_worker, req.SerializeToString())
    seen[code.name] += 1
    assert code in DEFINED, f"{code} for {req}"


@FUZZ
@given(data=st.binary(max_size=400))
def test_raw_bytes_get_a_defined_status(fuzz_worker: Worker, data: bytes) -> None:
    code = _call(fuzz_worker, data)
    seen[code.name] += 1
    # Bytes that do not parse as a GenerateRequest get INVALID_ARGUMENT (worker/wire.py).
    assert code in DEFINED, code


def test_after_the_fuzz_the_worker_serves_and_holds_no_block(fuzz_worker: Worker) -> None:
    status = fuzz_worker.health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    wait_until(lambda: blocks_all_free(fuzz_worker), timeout=30, what="every block to be free")
    load = fuzz_worker.stub.GetLoad(pb.GetLoadRequest(), timeout=5)
    assert load.num_running == load.num_waiting == load.num_swapped == 0
    print("fuzz statuses:", dict(seen))
