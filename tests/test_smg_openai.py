"""What gateways forward, through the real SMG binary in front of one worker, with the
OpenAI API: structured outputs (`response_format: json_schema`), tool calls (`tool_choice`
required, named, auto), `n`, `min_tokens`.

SMG 1.13 does not forward `logit_bias` to a vLLM-protocol worker on any path, nor
`min_tokens` on its chat path (crates/grpc_client/src/vllm_engine.rs builds the sampling
params without them): min_tokens is shown through its /v1/completions, and logit_bias on the
vLLM protocol itself, as SMG would send it (tests/test_structured.py).

What SMG sends to the worker for each is read from the worker's own counter of constrained
requests by kind (`llm_worker:structured_output_requests_total`), never from SMG: for a
model with no tool parser that builds a structural tag (the default model), `required` and a
named function arrive as a JSON schema (an array of calls, or the function's parameters),
and `auto` arrives unconstrained (SMG's `generate_tool_constraint` returns none for auto).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_hostile import healthy_and_free
from tests.test_server import Worker
from tests.test_smg import WARMUP_OFF, Gateway, _smg_runs, free_port
from tests.test_structured import SCHEMA
from worker.tokenizer import Tokenizer
from worker.weights import default_model_path

pytestmark = pytest.mark.slow

N_SAMPLES = 20
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 24},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "The weather forecast of a city."}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME,
                                           "description": "The time in a time zone."}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What will the weather be in Paris this week?"}]


@pytest.fixture(scope="module")
def gw() -> Iterator[Gateway]:
    if why := _smg_runs():
        pytest.fail(why)
    port = free_port()
    w = Worker("--metrics-port", str(port), "--max-generation-time-s", "120")
    w.metrics_port = port
    gw = None
    try:
        w.wait_ready()
        gw = Gateway([w], *WARMUP_OFF)
        yield gw.wait_ready()
    finally:
        if gw is not None:
            gw.close()
        w.close()


def constrained(gw: Gateway) -> dict[str, float]:
    """The worker's constrained requests so far, by constraint kind."""
    url = f"http://127.0.0.1:{gw.workers[0].metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    fam = fams.get("llm_worker:structured_output_requests")
    return {} if fam is None else {s.labels["kind"]: s.value for s in fam.samples
                                   if s.name.endswith("_total")}


def grew(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def test_response_format_json_schema_20_samples_validate(gw: Gateway) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                  "strict": True}}
    messages = [{"role": "user", "content": "Describe a person (name, age, height, role, "
                                            "address, pets) as JSON."}]
    before = constrained(gw)

    def one(seed: int) -> dict:
        return gw.chat(messages=messages, response_format=fmt, temperature=1.0, seed=seed,
                       max_tokens=320)["choices"][0]

    with ThreadPoolExecutor(N_SAMPLES) as pool:
        choices = list(pool.map(one, range(N_SAMPLES)))
    texts = []
    for c in choices:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)
        texts.append(c["message"]["content"])
    assert len(set(texts)) > 1, texts  # sampled, not one fixed answer
    assert grew(before, constrained(gw)) == {"json_schema": N_SAMPLES}
    healthy_and_free(gw.workers[0])


def _calls(choice: dict) -> list[dict]:
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert calls, choice
    for call in calls:
        fn = call["function"]
        jsonschema.validate(json.loads(fn["arguments"]), SCHEMAS[fn["name"]])
    return calls


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tool_choice_required_returns_valid_calls(gw: Gateway, temperature: float) -> None:
    before = constrained(gw)
    for seed in range(4 if temperature else 1):
        out = gw.chat(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
                      temperature=temperature, seed=seed)
        _calls(out["choices"][0])
    # An array of calls under a JSON schema: what SMG sends without a structural-tag parser.
    assert grew(before, constrained(gw)) == {"json_schema": 4 if temperature else 1}


def test_named_tool_choice_calls_that_function(gw: Gateway) -> None:
    before = constrained(gw)
    for seed in range(4):
        out = gw.chat(messages=ASK, tools=TOOLS, max_tokens=120, temperature=1.0, seed=seed,
                      tool_choice={"type": "function", "function": {"name": "get_time"}})
        (call,) = _calls(out["choices"][0])
        assert call["function"]["name"] == "get_time"
    assert grew(before, constrained(gw)) == {"json_schema": 4}


def test_tool_choice_auto_arrives_unconstrained(gw: Gateway) -> None:
    """SMG sends no constraint for auto (its tool parser reads whatever the model wrote):
    the worker counts none, and the answer is whatever the model chose."""
    before = constrained(gw)
    out = gw.chat(messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=48, temperature=0)
    choice = out["choices"][0]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls"), choice
    if choice["finish_reason"] == "tool_calls":
        _calls(choice)
    assert grew(before, constrained(gw)) == {}


def completion(gw: Gateway, **body) -> dict:
    """POST /v1/completions (SMG forwards min_tokens on this path; its chat path does not)."""
    return gw.post("/v1/completions", **body)


def test_min_tokens_holds_with_eos_not_ignored(gw: Gateway) -> None:
    """EOS is masked until 24 tokens are out, and still ends the answer after them."""
    t = Tokenizer.from_gguf(default_model_path())
    prompt = t.apply_chat_template([{"role": "user", "content": "Reply with one word: yes or no?"}])
    short = completion(gw, prompt=prompt, max_tokens=200, temperature=0)
    assert short["usage"]["completion_tokens"] < 24
    assert short["choices"][0]["finish_reason"] == "stop"
    held = completion(gw, prompt=prompt, max_tokens=200, temperature=0, min_tokens=24)
    assert held["usage"]["completion_tokens"] >= 24, held
    assert held["choices"][0]["finish_reason"] == "stop", held
    healthy_and_free(gw.workers[0])


def test_n_4_returns_four_choices_seeded_reproducible(gw: Gateway) -> None:
    messages = [{"role": "user", "content": "Name a colour and a fruit."}]

    def four(seed: int) -> tuple[list[str], dict]:
        out = gw.chat(messages=messages, n=4, temperature=1.0, seed=seed, max_tokens=24)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        assert [c["index"] for c in choices] == [0, 1, 2, 3], out
        return [c["message"]["content"] for c in choices], out["usage"]

    texts, usage = four(7)
    assert len(set(texts)) > 1, texts  # four samples, not one answer four times
    assert four(7)[0] == texts  # seeded: the same four again
    assert four(8)[0] != texts
    # The prompt is counted once in the usage; the completions of all four.
    one = gw.chat(messages=messages, temperature=1.0, seed=7, max_tokens=24)
    assert usage["prompt_tokens"] == one["usage"]["prompt_tokens"]
    assert 4 <= usage["completion_tokens"] <= 4 * 24
    healthy_and_free(gw.workers[0])
