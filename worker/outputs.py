"""What the engine publishes per request per step, and the per-request state that
turns sampled tokens into text deltas and matches stop strings."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.request import Request
from worker.model_runner import SampleResult
from worker.prompt_logprobs import PromptLogprob
from worker.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[SampleResult] | None = None  # one per new token, when asked for
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_time_s: float | None = None  # arrival -> first scheduled
    ttft_s: float | None = None  # arrival -> first token
    total_time_s: float | None = None
    error: str | None = None
    # The request failed through what it asked for (finish_reason "error"): refused as it
    # arrived, what it asked for not there any more (e.g. its LoRA adapter unloaded after the
    # door checked it), or its constraint taken past the grammar engine's limits while it
    # generated. A client error (INVALID_ARGUMENT), not a fault of the worker (INTERNAL).
    refused: bool = False
    # The request this output belongs to: the bridge routes by it rather than by id, so a
    # request id is free for reuse the moment its stream ends (an abort), even while the
    # engine still has outputs of the old request in flight. With n > 1 it is the sample's
    # own request; `request_id` is the leader's (the id the client sent) and `index` the
    # sample's (scheduler/sample_group.py).
    request: Request | None = field(default=None, repr=False, compare=False)
    index: int = 0
    # The prompt's logprobs (worker.prompt_logprobs; entry i is token i + 1's), on each
    # sample's first output that has tokens, when asked for.
    prompt_logprobs: list[PromptLogprob] | None = field(default=None, repr=False)

    @property
    def stream_key(self) -> Request | None:
        """The request whose stream this output goes to: a sample's group leader."""
        r = self.request
        return r.group.leader if r is not None and r.group is not None else r

    def merge(self, new: RequestOutput) -> None:
        """Fold `new`, a later step's output of the same request, into this one: text,
        token ids and logprobs concatenate; counts and final fields are the latest."""
        assert new.request_id == self.request_id and new.index == self.index and not self.finished
        if self.prompt_logprobs is None:
            self.prompt_logprobs = new.prompt_logprobs
        self.new_token_ids = self.new_token_ids + new.new_token_ids  # never alias a list
        self.new_text += new.new_text
        if new.logprobs:
            self.logprobs = (self.logprobs or []) + new.logprobs
        self.prompt_tokens = new.prompt_tokens
        self.completion_tokens = new.completion_tokens
        self.cached_tokens = new.cached_tokens
        if new.finished:
            self.finished = True
            self.finish_reason = new.finish_reason
            self.stop_reason = new.stop_reason
            self.error = new.error
            self.queue_time_s = new.queue_time_s
            self.ttft_s = new.ttft_s
            self.total_time_s = new.total_time_s


@dataclass
class OutputState:
    """Detokenizes one request's tokens and withholds text that may be the start
    of a stop string, so a stop string is never streamed."""

    request: Request
    detok: IncrementalDetokenizer | None
    emitted: int = 0  # characters of text already published
    text: str = ""
    pending_logprobs: list[SampleResult] = field(default_factory=list)

    @classmethod
    def create(cls, request: Request, tokenizer: Tokenizer | None) -> OutputState:
        skip = request.sampling_params.skip_special_tokens
        detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, skip) if tokenizer else None
        return cls(request, detok)

    def add_token(self, token_id: int) -> str | None:
        """Add a sampled token; return the stop string it completed, if any."""
        if self.detok is None:
            return None
        before = len(self.text)
        self.text += self.detok.add_tokens([token_id])
        stops = self.request.sampling_params.stop
        if not stops:
            return None
        longest = max(len(s) for s in stops)
        window_start = max(0, before - longest + 1)
        hits = [(i, s) for s in stops if (i := self.text.find(s, window_start)) >= 0]
        if not hits:
            return None
        pos, stop = min(hits)
        self.text = self.text[:pos]  # the stop string itself is not returned
        return stop

    def take_text(self, finished: bool) -> str:
        if self.detok is not None and finished and self.request.stop_reason not in self.request.sampling_params.stop:
            self.text += self.detok.flush()
        end = len(self.text)
        stops = self.request.sampling_params.stop
        if stops and not finished:
            end = max(self.emitted, end - max(len(s) for s in stops) + 1)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
