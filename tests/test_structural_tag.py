"""Structural tags (worker/structural_tag.py): what SMG and vLLM send for tool calls.

The converter, on the matcher: the shapes SMG's tool parsers build (xgrammar's `format`
tree, e.g. Mistral's `[TOOL_CALLS] [...]`) and vLLM's older `structures`/`triggers` let free
text through, enter the tag at its trigger and hold its arguments to the schema. Served, on
the vLLM protocol: a few-shot prompt makes the trigger certain; the text before it is free,
the arguments are held to a schema the prompt contradicts (so the constraint, not the model,
wrote them), the text after is free again. Bad tags are INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import grpc
import jsonschema
import pytest
from llmworker.v1 import worker_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from tests.test_hostile import healthy_and_free
from tests.test_server import Worker, run, text_of
from worker.structural_tag import StructuralTagError, to_lark
from worker.structured import Constraint, ConstraintError

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                          "unit": {"enum": ["kelvin"]}},
           "required": ["city", "unit"], "additionalProperties": False}
# vLLM's older shape: free text, and the structure wherever its trigger is written.
LEGACY = {"type": "structural_tag", "triggers": ["<function="], "structures": [
    {"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"}]}


def mistral(at_least_one: bool) -> dict:
    """The tag SMG's Mistral tool parser builds (crates/tool_parser/src/parsers/mistral.rs)."""
    call = {"begin": '{"name": "get_weather", "arguments": ',
            "content": {"type": "json_schema", "json_schema": WEATHER}, "end": "}"}
    return {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["[TOOL_CALLS]"], "at_least_one": at_least_one,
        "tags": [{"begin": "[TOOL_CALLS] [", "end": "]", "content": {
            "type": "tags_with_separator", "tags": [call], "separator": ", "}}]}}


CALL = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "kelvin"}}'
BAD_CALL = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
THINK_THEN_CODE = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"},
    {"type": "regex", "pattern": "[A-Z]{3}-[0-9]{4}"}]}}
CASES = [
    (mistral(False), f"Let me look. [TOOL_CALLS] [{CALL}, {CALL}] Anything else?", True),
    (mistral(False), "No tool is needed for that.", True),
    (mistral(False), f"Let me look. [TOOL_CALLS] [{BAD_CALL}]", False),
    (mistral(True), f"[TOOL_CALLS] [{CALL}]", True),
    (mistral(True), "Let me look.", False),  # at_least_one: no free text first
    (LEGACY, 'Sure. <function=get_weather>{"city": "Rome", "unit": "kelvin"}</function> Done.',
     True),
    (LEGACY, 'Sure. <function=get_time>{"zone": "UTC"}</function>', False),
    (THINK_THEN_CODE, "<think>a code, upper case</think>ABC-1234", True),
    (THINK_THEN_CODE, "<think>a code</think>abc-1234", False),
    ({"type": "structural_tag", "format": {"type": "or", "elements": [
        {"type": "const_string", "value": "yes"},
        {"type": "grammar", "grammar": 'root ::= "n" "o"+'}]}}, "nooo", True),
    ({"type": "structural_tag", "format": {"type": "repeat", "min": 2, "max": 3, "content": {
        "type": "const_string", "value": "ab"}}}, "ab", False),
]


@pytest.mark.parametrize("tag,text,allowed", CASES)
def test_tag_lets_through_what_it_should(compiler, tok, tag, text, allowed) -> None:
    m = compiler.compile(Constraint("structural_tag", json.dumps(tag))).matcher().matcher
    ok = all(m.consume_token(t) for t in tok.encode(text))
    assert (ok and m.is_accepting()) == allowed, (text, m.get_error())


def test_a_written_trigger_enters_the_tag(compiler, tok) -> None:
    """After the trigger only the tag's continuation is allowed: free text cannot go on."""
    m = compiler.compile(Constraint("structural_tag", json.dumps(LEGACY))).matcher().matcher
    for t in tok.encode("Sure. <function="):
        assert m.consume_token(t)
    assert not m.consume_token(tok.encode(" hello")[0])


BAD_TAGS = [
    ("{", "not valid JSON"),
    ('{"type": "structural_tag"}', 'needs a "format"'),
    (json.dumps({"format": {"type": "token", "token": "<|x|>"}}), "format.type"),
    (json.dumps({"format": {"type": "tag", "begin": {"type": "token", "token": "<x>"},
                            "content": {"type": "any_text"}, "end": "</x>"}}), "format.begin"),
    (json.dumps({"format": {"type": "triggered_tags", "triggers": ["<a"], "tags": [
        {"begin": "<b>", "content": {"type": "any_text"}, "end": "</b>"}]}}),
     "format.tags[0].begin"),
    (json.dumps({"format": {"type": "json_schema", "json_schema": {"type": "object"},
                            "style": "qwen_xml"}}), "format.style"),
    (json.dumps({"format": {"type": "json_schema", "json_schema": {"type": "foo"}}}),
     "does not compile"),
    ("[" * 50_000, "not valid JSON"),  # nested past Python's recursion limit
]


@pytest.mark.parametrize("text,what", BAD_TAGS)
def test_bad_tags_are_refused_naming_where(compiler, text, what) -> None:
    with pytest.raises(ConstraintError, match=re.escape(what)):
        compiler.compile(Constraint("structural_tag", text))


@pytest.mark.parametrize("tag", [
    {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": "[" * 20000 + "]" * 20000}},
    {"type": "structural_tag", "triggers": ["<f"],  # the older shape, its schema a string
     "structures": [{"begin": "<f>", "schema": "[" * 20000 + "]" * 20000, "end": "</f>"}]},
])
def test_a_schema_string_nested_past_pythons_stack_is_refused(tag) -> None:
    """A JSON string inside the tag nested past the interpreter's recursion limit: an
    UNKNOWN status with a traceback before (json.loads' RecursionError escaped the door)."""
    with pytest.raises(StructuralTagError, match="json_schema: is not valid JSON: maximum recursion"):
        to_lark(json.dumps(tag))


def test_depth_is_bounded() -> None:
    fmt: dict = {"type": "const_string", "value": "x"}
    for _ in range(40):
        fmt = {"type": "optional", "content": fmt}
    with pytest.raises(StructuralTagError, match="nests deeper"):
        to_lark(json.dumps({"format": fmt}))


# ----- served ---------------------------------------------------------------------------------

SHOTS = "".join(
    f'Q: What is the weather in {city}?\nA: Let me check. <function=get_weather>'
    f'{{"city": "{city}", "unit": "{unit}"}}</function> Here it is.\n'
    for city, unit in [("Oslo", "celsius"), ("Boston", "fahrenheit"), ("Rome", "celsius")])
PROMPT = SHOTS + "Q: What is the weather in Paris?\nA:"
TOOL_CALL = re.compile(r"(?s)(.*?)<function=get_weather>(.*?)</function>(.*)")


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker("--max-generation-time-s", "120")
    try:
        yield w.wait_ready()
    finally:
        w.close()


def _vllm(w: Worker, tag: str, temperature: float, seed: int) -> vpb.GenerateComplete:
    req = vpb.GenerateRequest(text=PROMPT, sampling_params=vpb.SamplingParams(
        temperature=temperature, seed=seed, max_tokens=48, stop=["\nQ:"], structural_tag=tag))
    (resp,) = list(w.vllm.Generate(req, timeout=300))
    return resp.complete


def test_vllm_structural_tag_free_text_then_arguments_then_free_text(worker, tok) -> None:
    """The prompt's calls all say celsius or fahrenheit; the tag's schema allows only kelvin:
    every call written validates against the schema, so the constraint wrote it."""
    tag = json.dumps(LEGACY)
    greedy = _vllm(worker, tag, 0.0, 0)
    text = tok.decode(list(greedy.output_ids))
    m = TOOL_CALL.fullmatch(text)
    assert m, text
    before, args, after = m.groups()
    assert before.strip() and after.strip(), text  # free text on both sides
    jsonschema.validate(json.loads(args), WEATHER)
    calls = 0
    for seed in range(8):
        c = _vllm(worker, tag, 1.0, seed)
        text = tok.decode(list(c.output_ids))
        for args in re.findall(r"<function=get_weather>(.*?)</function>", text, re.S):
            jsonschema.validate(json.loads(args), WEATHER)
            calls += 1
    assert calls >= 4  # the few-shot prompt makes the call the likely continuation
    healthy_and_free(worker)


def test_ours_carries_the_structural_tag(worker, tok) -> None:
    chunks, _ = run(worker.stub, text=PROMPT, structural_tag=json.dumps(LEGACY),
                           sampling=pb.SamplingParams(temperature=0.0),
                           stopping=pb.StoppingCriteria(max_tokens=48, stop=["\nQ:"]))
    m = TOOL_CALL.fullmatch(text_of(chunks))
    assert m, text_of(chunks)
    jsonschema.validate(json.loads(m.group(2)), WEATHER)


@pytest.mark.parametrize("text,what", BAD_TAGS[:4])
def test_bad_tags_are_invalid_argument_at_the_door(worker, text, what) -> None:
    req = vpb.GenerateRequest(text="Hi", sampling_params=vpb.SamplingParams(
        max_tokens=4, structural_tag=text))
    with pytest.raises(grpc.RpcError) as e:
        list(worker.vllm.Generate(req, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params.structural_tag" in e.value.details(), e.value.details()
    assert what in e.value.details(), e.value.details()
    healthy_and_free(worker)
