"""--stream-interval N (vLLM's flag): a stream's messages carry N tokens, but a sample's first
tokens and its end go at once; the engine thread leaves the event loop asleep for a step that
makes no message due (worker.bridge, Engine.start)."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from llmworker.v1 import worker_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from scheduler.request import Request, SamplingParams
from tests.test_server import ROOT, FakeEngine, Worker, _out, run
from worker.bridge import EngineBridge
from worker.config import ServerConfig
from worker.engine import StepOutput


def test_messages_carry_the_interval_the_first_and_last_go_at_once() -> None:
    async def main() -> None:
        eng = FakeEngine()
        bridge = EngineBridge(eng, stream_interval=3)  # type: ignore[arg-type]
        bridge.start()
        stream = bridge.open(Request("a", [1, 2]))
        woke, got = [], []
        for tok in range(10, 18):  # eight steps of one token each, the last one finishes
            last = tok == 17
            out = _out("a", [tok], chr(tok + 87), finished=last,
                       finish_reason="length" if last else None, completion_tokens=tok - 9)
            woke.append(await asyncio.to_thread(eng.sink, [out]))
            await asyncio.sleep(0.01)  # the loop drains what a wake-up announced
            while stream._due:  # a reader as fast as the engine: it reads what is due
                got.append(await stream.next())
        # Woken for the first token, every third one since, and the end; not between.
        assert woke == [True, False, False, True, False, False, True, True]
        assert [o.new_token_ids for o in got] == [[10], [11, 12, 13], [14, 15, 16], [17]]
        assert "".join(o.new_text for o in got) == "abcdefgh"
        assert [r.token_id for o in got for r in o.logprobs] == list(range(10, 18))
        assert got[-1].finished and got[-1].completion_tokens == 8
        assert bridge.num_in_flight == 0 and not bridge._since_due  # nothing kept per request
        await bridge.close()

    asyncio.run(main())


def test_an_observer_that_raises_drops_no_output(caplog) -> None:
    """A step observer (the KV-event hub) and a request observer (metrics) that raise: the
    failure is logged, and every token still reaches its stream (before, the step's outputs
    were dropped for every client: 23 tokens of 24, usage saying 24)."""
    class Broken:
        def step(self, step, t):
            raise ValueError("Value out of range: 99999999999999999999")

        def output(self, stream, out, t):
            raise ValueError("a request observer")

        def finished(self, stream, out):
            raise ValueError("a request observer")

    async def main() -> list:
        eng = FakeEngine()
        bridge = EngineBridge(eng)  # type: ignore[arg-type]
        bridge.step_observers.append(Broken())
        bridge.observers.append(Broken())
        bridge.start()
        stream = bridge.open(Request("a", [1, 2]))
        got = []
        for tok in range(10, 14):
            last = tok == 13
            await asyncio.to_thread(eng.sink, [_out("a", [tok], "x", finished=last,
                                                   finish_reason="length" if last else None)])
            await asyncio.sleep(0.01)
            while stream._due:
                got.append(await stream.next())
        assert bridge.num_in_flight == 0
        await bridge.close()
        return got

    got = asyncio.run(main())
    assert [t for o in got for t in o.new_token_ids] == [10, 11, 12, 13] and got[-1].finished
    assert "Value out of range" in caplog.text


def test_each_sample_counts_for_itself_and_an_end_flushes_what_waits() -> None:
    """n = 2: each sample's first tokens go at once and each counts its own interval; an
    output still waiting (not due) is flushed with its sample's finished output; a step the
    loop was not woken for reaches the stream with the next one it is woken for."""
    async def main() -> None:
        eng = FakeEngine()
        bridge = EngineBridge(eng, stream_interval=4)  # type: ignore[arg-type]
        bridge.start()
        req = Request("g", [1], SamplingParams(n=2))
        stream = bridge.open(req)

        def step(*outs) -> bool:
            for o in outs:
                o.request = req  # FakeEngine would tie both to the leader: keep index apart
            return bridge._sink(StepOutput(list(outs)))

        assert step(_out("g", [1], "a", index=0), _out("g", [2], "b", index=1))
        bridge._drain()  # the loop, for the wake-up it was given
        first = [await stream.next(), await stream.next()]
        assert sorted((o.index, o.new_token_ids) for o in first) == [(0, [1]), (1, [2])]
        assert not step(_out("g", [3], "c", index=0), _out("g", [4], "d", index=1))
        assert not step(_out("g", [5, 6], "ef", index=0))  # sample 0 at 3 of 4
        assert step(_out("g", [7], "g", index=0), _out("g", [8], "h", index=1))  # 0 at 4
        bridge._drain()  # three steps, one wake-up
        due0 = await stream.next()
        assert (due0.index, due0.new_token_ids) == (0, [3, 5, 6, 7])
        assert not stream._due  # sample 1's [4, 8] waits: two of four
        assert step(_out("g", [9], "i", index=1, finished=True, finish_reason="stop"))
        bridge._drain()
        end1 = await stream.next()
        assert (end1.index, end1.new_token_ids, end1.finished) == (1, [4, 8, 9], True)
        assert step(_out("g", [], "", index=0, finished=True, finish_reason="length"))
        bridge._drain()
        assert (await stream.next()).finished and stream.finished
        await bridge.close()

    asyncio.run(main())


def test_the_setting_is_checked_from_the_flag_and_the_variable() -> None:
    assert ServerConfig().stream_interval == 1
    with pytest.raises(ValueError, match="--stream-interval must be >= 1, got 0"):
        ServerConfig(stream_interval=0)
    env = {**os.environ, "LLMWORKER_STREAM_INTERVAL": "-3"}
    done = subprocess.run([sys.executable, "-m", "worker.cli", "serve", "--port", "0"], env=env,
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2 and "--stream-interval must be >= 1, got -3" in done.stderr


INTERVAL = 4
TOKENS = 41


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker("--model", "dummy:smollm2-135m", "--stream-interval", str(INTERVAL))
    try:
        yield w.wait_ready()
    finally:
        w.close()


def test_served_streams_send_a_message_per_interval_on_both_protocols(worker: Worker) -> None:
    """At most the first message, one per 4 tokens and the end (the loop may merge more, on
    a busy machine: never fewer tokens in all, never a token held back past the end)."""
    most = 1 + math.ceil((TOKENS - 1) / INTERVAL)
    ids = list(range(100, 140))
    chunks, complete = run(worker.stub, token_ids=pb.TokenIdsInput(ids=ids),
                           sampling=pb.SamplingParams(temperature=0.0),
                           stopping=pb.StoppingCriteria(max_tokens=TOKENS, ignore_eos=True))
    ours = [t for c in chunks for t in c.token_ids]
    assert len(ours) == TOKENS == complete.usage.completion_tokens
    assert 2 <= len(chunks) <= most, [len(c.token_ids) for c in chunks]
    assert len(chunks[0].token_ids) < TOKENS  # the first tokens were not held to the end

    req = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=ids), stream=True,
                              sampling_params=vpb.SamplingParams(
                                  temperature=0.0, max_tokens=TOKENS, ignore_eos=True))
    vchunks = [r.chunk for r in worker.vllm.Generate(req, timeout=120) if r.HasField("chunk")]
    assert [t for c in vchunks for t in c.token_ids] == ours  # greedy: the same tokens
    assert 2 <= len(vchunks) <= most
    running = [c.completion_tokens for c in vchunks]
    assert running == sorted(running) and running[-1] == TOKENS


def test_a_held_output_is_not_handed_out_by_a_wake() -> None:
    """The door's deadline timer wakes a stream (`wake`): with only a held (not due) output
    pending, `next` gives None, as with nothing pending; the output goes with the next due
    one, merged."""
    async def main() -> None:
        eng = FakeEngine()
        bridge = EngineBridge(eng, stream_interval=4)  # type: ignore[arg-type]
        bridge.start()
        stream = bridge.open(Request("a", [1]))
        assert await asyncio.to_thread(eng.sink, [_out("a", [5], "x")])  # the first: due
        await asyncio.sleep(0.01)
        assert (await stream.next()).new_token_ids == [5]
        assert not await asyncio.to_thread(eng.sink, [_out("a", [6], "y")])  # held
        bridge._drain()
        stream.wake()
        assert await asyncio.wait_for(stream.next(), 5) is None
        for tok in (7, 8):
            assert not await asyncio.to_thread(eng.sink, [_out("a", [tok], "z")])
        assert await asyncio.to_thread(eng.sink, [_out("a", [9], "w")])  # four since the first
        await asyncio.sleep(0.01)
        assert (await stream.next()).new_token_ids == [6, 7, 8, 9]
        await bridge.close()

    asyncio.run(main())
