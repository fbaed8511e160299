"""vLLM engine protocol messages <-> the door's: which fields we take, which we refuse, and
the response messages. The checks with limits are the door's (`worker.door`); what is here
is only what this wire format adds (its proto3 defaults, its unsupported fields). See
`worker.vllm_service` for the table of fields and status codes.
"""

from __future__ import annotations

from typing import Any

from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from scheduler.request import MAX_LOGPROBS
from worker.door import FieldNames, InvalidArgument, Submission
from worker.model_runner import SampleResult
from worker.outputs import RequestOutput
from worker.prompt_logprobs import PromptLogprob
from worker.structured import Constraint

_SEED_MASK = 0xFFFF_FFFF  # the proto's int32 seed, read as the uint32 of its bits
NAMES = FieldNames(input="input (tokenized or text)", token_ids="tokenized.input_ids",
                   messages="(chat is not part of this protocol)",
                   stop="sampling_params.stop", max_tokens="sampling_params.max_tokens",
                   truncate_prompt_tokens="sampling_params.truncate_prompt_tokens",
                   sampling={f: f"sampling_params.{f}" for f in (
                       "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                       "presence_penalty", "frequency_penalty", "seed", "stop_token_ids",
                       "ignore_eos", "skip_special_tokens", "logprobs", "logit_bias",
                       "min_tokens", "n", "prompt_logprobs")},
                   constraint={k: f"sampling_params.{k}" for k in (
                       "json_schema", "json_object", "regex", "grammar", "structural_tag")}
                   | {"choice": "sampling_params.choice.choices"})

# Request fields with no meaning here (one text model, one device; KV transfer only through
# kv_transfer_params_json, read by the door): sent set, they are refused, never ignored.
_UNSUPPORTED_REQUEST_FIELDS = (
    ("kv_transfer_params", "Mooncake's KV transfer (send kv_transfer_params_json)"),
    ("mm_inputs", "multimodal inputs (this is a text model)"),
    ("media_refs", "multimodal inputs (this is a text model)"),
)


def unsupported(msg: vpb.GenerateRequest) -> None:
    """Refuse every field we cannot honour; raises InvalidArgument naming it."""
    for name, what in _UNSUPPORTED_REQUEST_FIELDS:
        if msg.HasField(name):
            raise InvalidArgument(f"{name} is not supported: {what}")
    if msg.extra_mm_inputs:
        raise InvalidArgument("extra_mm_inputs is not supported: multimodal inputs (this is a "
                              "text model)")
    if msg.HasField("data_parallel_rank") and msg.data_parallel_rank != 0:
        raise InvalidArgument(f"data_parallel_rank {msg.data_parallel_rank} does not exist: "
                              "this worker is one rank (0)")
    p = msg.sampling_params
    if p.HasField("prompt_logprobs") and p.prompt_logprobs < 0:
        raise InvalidArgument(f"sampling_params.prompt_logprobs must be in [0, {MAX_LOGPROBS}], "
                              f"got {p.prompt_logprobs} (-1, the whole vocabulary for every "
                              "prompt token, is not supported)")
    if p.HasField("logprobs") and not 0 <= p.logprobs <= MAX_LOGPROBS:
        raise InvalidArgument(f"sampling_params.logprobs must be in [0, {MAX_LOGPROBS}], got "
                              f"{p.logprobs} (-1, all of them, is not supported)")


def submission(msg: vpb.GenerateRequest) -> Submission:
    """The door's view of `msg`; raises InvalidArgument for what this adapter cannot take."""
    unsupported(msg)
    p = msg.sampling_params
    kind = msg.WhichOneof("input")
    return Submission(
        request_id=msg.request_id,
        text=msg.text if kind == "text" else None,
        token_ids=msg.tokenized.input_ids if kind == "tokenized" else None,
        max_tokens=max_tokens(p),
        truncate_prompt_tokens=(p.truncate_prompt_tokens
                                if p.HasField("truncate_prompt_tokens") else None),
        sampling=sampling_fields(p),
        constraint=constraint(p),
        kv_transfer_params_json=(msg.kv_transfer_params_json
                                 if msg.HasField("kv_transfer_params_json") else None),
        names=NAMES,
    )


def constraint(p: vpb.SamplingParams) -> Constraint | None:
    """The structured-output constraint, as vLLM's StructuredOutputsParams reads the oneof
    (`grammar`: Lark or EBNF/GBNF, told apart by its syntax; `json_object` false = none)."""
    kind = p.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not p.json_object):
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind == "choice":
        return Constraint("choice", choices=p.choice.choices)
    return Constraint(kind, getattr(p, kind))


def sampling_fields(p: vpb.SamplingParams) -> dict[str, Any]:
    """Our `SamplingParams` fields (bar max_tokens) from the proto's; proto3 zeros that
    mean "unset" become our defaults, the way vLLM's own servicer reads them."""
    return dict(
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.top_p != 0.0 else 1.0,
        top_k=p.top_k,  # 0 = off, as ours
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 0.0 else 1.0,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        seed=p.seed & _SEED_MASK if p.HasField("seed") else None,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        skip_special_tokens=p.skip_special_tokens,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        min_tokens=p.min_tokens,
        # int32 keys: a negative id reaches SamplingParams, which names it.
        logit_bias=dict(p.logit_bias),
        n=p.n or 1,  # 0 (unset) = 1
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
    )


def max_tokens(p: vpb.SamplingParams) -> int:
    """0 (unset) = the server's default; an explicit 0 is refused."""
    if p.HasField("max_tokens") and p.max_tokens == 0:
        raise InvalidArgument("sampling_params.max_tokens must be >= 1 (or unset for the "
                              "default)")
    return p.max_tokens


def output_logprobs(results: list[SampleResult] | None) -> vpb.OutputLogProbs | None:
    if not results:
        return None
    out = vpb.OutputLogProbs()
    for r in results:
        out.token_ids.append(r.token_id)
        out.token_logprobs.append(r.logprob if r.logprob is not None else 0.0)
        top = r.top_logprobs or ()
        out.top_logprobs.append(vpb.TopLogProbs(token_ids=[t for t, _ in top],
                                                values=[lp for _, lp in top]))
    return out


def input_logprobs(prompt_ids: list[int],
                   results: list[PromptLogprob] | None) -> vpb.InputLogProbs | None:
    """vLLM's prompt logprobs: one entry per prompt token, the first without a value."""
    if results is None:
        return None
    assert len(results) == len(prompt_ids) - 1
    out = vpb.InputLogProbs(token_ids=prompt_ids)
    out.token_logprobs.append(vpb.InputTokenLogProb())
    out.top_logprobs.append(vpb.TopLogProbs())
    for r in results:
        out.token_logprobs.append(vpb.InputTokenLogProb(value=r.logprob))
        out.top_logprobs.append(vpb.TopLogProbs(token_ids=[t for t, _ in r.top_logprobs],
                                                values=[lp for _, lp in r.top_logprobs]))
    return out


def _prompt_ids(out: RequestOutput) -> list[int]:
    return out.request.prompt_token_ids if out.request is not None else []


def chunk_response(out: RequestOutput, completion_tokens: int,
                   logprobs: bool) -> vpb.GenerateResponse:
    return vpb.GenerateResponse(chunk=vpb.GenerateStreamChunk(
        token_ids=out.new_token_ids,
        prompt_tokens=out.prompt_tokens,
        completion_tokens=completion_tokens,
        cached_tokens=out.cached_tokens,
        output_logprobs=output_logprobs(out.logprobs) if logprobs else None,
        input_logprobs=input_logprobs(_prompt_ids(out), out.prompt_logprobs),
        index=out.index,
    ))


def complete_response(out: RequestOutput, output_ids: list[int],
                      logprobs: list[SampleResult] | None,
                      prompt_logprobs: list[PromptLogprob] | None = None,
                      kv_transfer_params_json: str | None = None) -> vpb.GenerateResponse:
    complete = vpb.GenerateComplete(
        output_ids=output_ids,
        finish_reason=out.finish_reason or "error",
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        cached_tokens=out.cached_tokens,
        output_logprobs=output_logprobs(logprobs),
        input_logprobs=input_logprobs(_prompt_ids(out), prompt_logprobs),
        index=out.index,
    )
    if out.request is not None:  # speculative decoding's usage (0 without it)
        complete.spec_accepted_tokens = out.request.num_accepted_tokens
        complete.spec_draft_tokens = out.request.num_draft_tokens
    if kv_transfer_params_json is not None:  # a prefill's handoff (worker.kv_transfer)
        complete.kv_transfer_params_json = kv_transfer_params_json
    if isinstance(out.stop_reason, int):
        complete.matched_token_id = out.stop_reason
    elif isinstance(out.stop_reason, str):
        complete.matched_stop_str = out.stop_reason
    return vpb.GenerateResponse(complete=complete)
