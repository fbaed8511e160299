"""A request and everything the scheduler knows about it. State lives here: its tokens,
how many are computed, its status, the chained hashes of its full blocks (grown as tokens
arrive, never recomputed), and the engine's output state (detokenizer, stop strings).
Whatever a request owns ends with it."""

import enum
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvcache.block_hash import ROOT, BlockHash, iter_block_hashes

MAX_LOGPROBS = 20
# A temperature below this samples greedily, as in vLLM: dividing logits by a smaller one
# overflows float32 (and a distribution that sharp is the argmax anyway).
SAMPLING_EPS = 1e-5
# Repetition penalties beyond these bounds change nothing more (a logit divided or
# multiplied by 100 already dominates any gap between logits) but can overflow float32.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
# logit_bias: OpenAI's range of a bias (-100 bans a token, +100 all but forces it), and
# at most this many tokens (a small vocabulary's worth; more is a mistake or an attack).
MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS = 100.0, 1024
# Parallel samples of one prompt (n): the prompt is prefilled once and its blocks shared
# (scheduler/sample_group.py). OpenAI allows up to 128; 16 keeps one request's fan-out
# within a batch's seats.
MAX_N = 16


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()  # preempted with its KV in CPU swap space; resumes where it was
    # Admitted with its blocks, its prompt's keys and values being pulled from the prefill
    # worker that computed them (`RemoteKV`); joins running when the pull ends.
    WAITING_FOR_REMOTE_KV = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.SWAPPED,
                            RequestStatus.WAITING_FOR_REMOTE_KV)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


# (field, valid?, the limit as the error message states it). NaN fails every comparison.
_LIMITS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("temperature", lambda v: 0 <= v < math.inf, ">= 0 and finite"),
    ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    # Below 2**31 as the wire's int32: a larger one overflowed the sampler's int64 tensor
    # mid-step (the request then failed there, not at the door); >= the vocabulary is off.
    ("top_k", lambda v: 0 <= v < 2**31, ">= 0 (0 = off) and < 2**31"),
    ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("repetition_penalty", lambda v: MIN_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY,
     f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 = off)"),
    ("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    ("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    ("max_tokens", lambda v: v >= 1, ">= 1"),
    ("stop", lambda v: all(isinstance(s, str) and s for s in v), "non-empty strings"),
    ("stop_token_ids", lambda v: all(isinstance(t, int) and t >= 0 for t in v), "ints >= 0"),
    ("logprobs", lambda v: v is None or 0 <= v <= MAX_LOGPROBS, f"None or in [0, {MAX_LOGPROBS}]"),
    ("min_tokens", lambda v: v >= 0, ">= 0"),
    ("n", lambda v: 1 <= v <= MAX_N, f"in [1, {MAX_N}]"),
    ("prompt_logprobs", lambda v: v is None or 0 <= v <= MAX_LOGPROBS,
     f"None or in [0, {MAX_LOGPROBS}]"),
    ("logit_bias", lambda v: len(v) <= MAX_LOGIT_BIAS_TOKENS and all(
        isinstance(t, int) and t >= 0 and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for t, b in v),
     f"at most {MAX_LOGIT_BIAS_TOKENS} token ids >= 0 with biases in "
     f"[{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"),
)


class SamplingParamsError(ValueError):
    """An invalid sampling parameter: `field` (SamplingParams' name, which a wire format may
    spell differently) and what is wrong with it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # in the returned text (e.g. <|im_end|>)
    logprobs: int | None = None  # None = off; n = chosen token's logprob plus top-n others
    # EOS and stop_token_ids are masked until this many tokens are out (ignore_eos: EOS is
    # no stop, so only the stop ids are).
    min_tokens: int = 0
    # (token id, bias) pairs, sorted; added to the logits before sampling. A mapping is
    # accepted. The vocabulary is checked by the engine (Engine.make_request).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Parallel samples of the prompt; sample i draws from the seed stream seed + i (vLLM's
    # rule), so a seeded request is reproducible and its samples differ.
    n: int = 1
    # None = off; k = each prompt token's own logprob plus the top-k (the first token has
    # none). Such a request skips the prefix cache: cached tokens have no logits.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers; keep the frozen value hashable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias
        pairs = bias.items() if isinstance(bias, Mapping) else bias
        object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in pairs)))
        for name, valid, limit in _LIMITS:
            value = getattr(self, name)
            if not valid(value):
                raise SamplingParamsError(name, f"must be {limit}, got {_bounded(value)}")
        if self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        """Sampled as the argmax: temperature below `SAMPLING_EPS`, or top_k 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Any of the repetition, presence and frequency penalties on (NaN counts as on)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _bounded(value: Any) -> str:
    """A value for an error message, quoted at most 64 characters long (a sequence with
    its length): hostile input is never echoed whole."""
    text = repr(value)
    text = text if len(text) <= 64 else text[:64] + "..."
    return f"{len(value)} items: {text}" if isinstance(value, tuple | list) else text


class RemoteKVState(enum.Enum):
    PENDING = enum.auto()  # waiting for admission
    SKIPPED = enum.auto()  # admitted without a pull: its own prefix cache held enough
    PULLING = enum.auto()  # blocks allocated, the pull under way
    DONE = enum.auto()  # pulled: those tokens count as computed
    FAILED = enum.auto()  # the pull failed; the prompt is computed here


@dataclass(eq=False)
class RemoteKV:
    """A decode request's handoff from a prefill worker, as the scheduler sees it: the
    prefill computed the first `num_tokens` prompt tokens. At admission the scheduler
    takes what its own prefix cache holds, allocates the prompt's blocks and names the
    ones the pull fills (`block_ids`, from `first_block` of the prompt's blocks on), which
    cover `num_tokens_wanted` tokens: all but the last prompt token, which the decode always
    computes (its logits give the first token). `handoff` is the transport's own record
    (worker.kv_transfer); the pull never runs on the engine thread."""

    num_tokens: int
    handoff: Any = field(default=None, repr=False)
    state: RemoteKVState = RemoteKVState.PENDING
    num_local_tokens: int = 0  # of the prompt, found in the prefix cache here
    first_block: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_tokens_wanted: int = 0
    num_pulled_tokens: int = 0  # set when the pull succeeded
    reason: str = ""  # why it failed or was skipped


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower = more urgent; negative allowed (see scheduler/scheduler.py)
    # Prefix-cache sharing happens only between requests with the same salt (tenants).
    cache_salt: str | None = None
    # The LoRA adapter it runs with (None: the base model): its name, and its registration's
    # key (worker/lora/registry.py), which the prefix cache hashes like the salt and the
    # scheduler counts against --max-loras.
    lora_name: str | None = None
    lora_key: str | None = None
    # Prefill/decode disaggregation. On a prefill worker: the prompt's digest when the
    # request is tagged for remote decode; finishing, it pins its prompt's blocks under that
    # key (`kv_handoff`: the `kvcache.pins.Pin`, or None when no pin was made). On a decode
    # worker: the handoff to pull its prompt's keys and values from.
    kv_pin_key: bytes | None = None
    remote_kv: RemoteKV | None = None

    output_token_ids: list[int] = field(default_factory=list, init=False)
    all_token_ids: list[int] = field(init=False)  # prompt + output, kept in step
    # Tokens whose keys/values are in the cache; catches up with num_tokens each step.
    num_computed_tokens: int = field(default=0, init=False)
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    stop_reason: str | int | None = field(default=None, init=False)

    # For metrics.
    first_scheduled_time: float | None = field(default=None, init=False)
    first_token_time: float | None = field(default=None, init=False)
    finished_time: float | None = field(default=None, init=False)
    # Prompt tokens served from the prefix cache at first admission (usage.cached_tokens).
    num_cached_tokens: int = field(default=0, init=False)
    num_preemptions: int = field(default=0, init=False)
    # Set by Scheduler.add_request: breaks ties between equal arrival times, FCFS.
    seq: int = field(default=0, init=False)
    # Chained hashes (kvcache.block_hash) of every full block of all_token_ids, for prefix
    # caching: each block is hashed once, when it fills. `hash_block_size` 0 = not hashed
    # (prefix caching off); the scheduler sets it on admission.
    block_hashes: list[BlockHash] = field(default_factory=list, init=False)
    hash_block_size: int = field(default=0, init=False)
    # The engine's per-request output state (worker.outputs.OutputState: detokenizer and
    # stop-string matching); lives and dies with the request.
    output_state: Any = field(default=None, init=False, repr=False)
    # The adapter's weights (worker.lora.LoraAdapter), held from the engine's intake to the
    # request's end; the runner copies them into a device slot. None: the base model.
    lora: Any = field(default=None, init=False, repr=False)
    # Its structured-output constraint's matcher (worker.structured.GrammarMatcher), set at
    # admission; advanced by the engine over each accepted token. None = unconstrained.
    grammar: Any = field(default=None, init=False, repr=False)
    # Speculative decoding (worker/spec_decode): draft tokens proposed for the next step,
    # which the scheduler may schedule after the last token (all, some, or none of them);
    # and, for the usage figures, drafts verified so far and how many were accepted.
    spec_token_ids: list[int] = field(default_factory=list, init=False)
    num_draft_tokens: int = field(default=0, init=False)
    num_accepted_tokens: int = field(default=0, init=False)
    # Parallel sampling (n > 1, scheduler/sample_group.py): the group of samples of one
    # prompt this request belongs to (None = alone) and its index there (0 prefills).
    group: Any = field(default=None, init=False, repr=False)
    sample_index: int = field(default=0, init=False)
    # prompt_logprobs: entry i is prompt token i + 1's (the first token has none), appended
    # by the model runner as the prefill chunks compute them (worker.prompt_logprobs).
    prompt_logprobs: list[Any] = field(default_factory=list, init=False, repr=False)
    kv_handoff: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.eos_token_ids = tuple(self.eos_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished()

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        assert not self.is_finished, f"{self.request_id}: token after finish"
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.hash_block_size and self.num_tokens % self.hash_block_size == 0:
            self.update_block_hashes()

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the output tokens past the first `num_output_tokens`: a stop string ended the
        request inside the tokens one speculative step appended. Their keys and values stay
        where they were written (blocks cached then hold real tokens of this request); only
        the token lists, the hashes of blocks no longer full, and `num_computed_tokens` (at
        most the tokens left but the last) follow."""
        assert 1 <= num_output_tokens <= self.num_output_tokens, (
            f"{self.request_id}: cannot keep {num_output_tokens} of {self.num_output_tokens} tokens")
        drop = self.num_output_tokens - num_output_tokens
        if not drop:
            return
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_tokens - drop:]
        if self.hash_block_size:
            del self.block_hashes[self.num_tokens // self.hash_block_size:]
        self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens - 1)

    def start_block_hashes(self, block_size: int) -> None:
        """Hash the full blocks of the tokens so far, and every block that fills later."""
        assert block_size > 0 and not self.block_hashes
        self.hash_block_size = block_size
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        """Extend `block_hashes` over the blocks filled since the last call."""
        bs, done = self.hash_block_size, len(self.block_hashes)
        if self.num_tokens // bs > done:
            parent = self.block_hashes[-1] if done else ROOT
            self.block_hashes.extend(
                iter_block_hashes(self.all_token_ids, bs, self.cache_salt, parent, done,
                                  lora_key=self.lora_key))

    def check_stop(self, max_model_len: int) -> bool:
        """Token-level stop checks after a new token; sets the finished status.

        A stop token ends with "stop" even when it is also the last allowed token. It stays
        in `output_token_ids` (the detokenizer decides whether to show it). Stop strings are
        matched by the engine, which then calls `Scheduler.finish_requests`.
        """
        assert self.output_token_ids, f"{self.request_id}: check_stop before any output"
        last = self.output_token_ids[-1]
        sp = self.sampling_params
        if (not sp.ignore_eos and last in self.eos_token_ids) or last in sp.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = last
        elif self.num_output_tokens >= sp.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
        else:
            return False
        return True
