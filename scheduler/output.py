"""What `Scheduler.schedule()` hands the model runner for one step."""

from dataclasses import dataclass, field

from scheduler.request import Request


@dataclass
class ScheduledRequest:
    """Compute positions ``start..start+num_new_tokens-1`` of `request` this step.

        all_token_ids  [ computed ... | this step's chunk | not yet ]
                       0            start    start+num_new_tokens    num_tokens

    `will_sample` is True iff the chunk reaches ``num_tokens``: the runner then samples one
    token from the logits at the chunk's last position.

    With speculative decoding, a decode's chunk runs past ``num_tokens`` by its draft tokens
    `spec_token_ids` (k of them: `num_new_tokens` = 1 + k, KV slots allocated for all):

        positions      N-1  N    ...  N-1+k          (N = num_tokens)
        token_ids      t    d1   ...  dk
        sampled        x0   x1   ...  xk             x_j is the model's token at N + j

    The runner samples every position; d_j is accepted while it equals x_{j-1}.
    """

    request: Request
    num_new_tokens: int
    start: int  # == request.num_computed_tokens at schedule time
    block_table: list[int]  # a copy, covering at least start + num_new_tokens positions
    will_sample: bool
    spec_token_ids: list[int] = field(default_factory=list)  # drafts, the chunk's last tokens
    # Parallel sampling (scheduler/sample_group.py): the followers sampled from this chunk's
    # last row of logits too (the leader's first token), forked after the step.
    forks: list[Request] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        """The chunk's input tokens: the request's own, then the drafts."""
        own = self.start + self.num_new_tokens - len(self.spec_token_ids)
        return self.request.all_token_ids[self.start : own] + self.spec_token_ids


@dataclass
class SchedulerOutput:
    """One step for the runner. Before the forward pass it makes the KV moves, each kind
    batched (one gather/scatter per layer), in this order: `blocks_to_swap_out`, then
    `blocks_to_swap_in`, then `blocks_to_copy`. Blocks freed and reused within the step
    are safe under that order only (`kvcache.moves` gives the argument). Moves come only
    with scheduled requests (`schedule()` asserts it), so an empty step has none."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    # The runner drops any per-request state it keeps for these ids (swapped ones too).
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # freed since the last step
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src gpu, dst gpu)
    # Prefill/decode disaggregation: requests admitted this step into WAITING_FOR_REMOTE_KV
    # (the engine starts their pulls; state PULLING) or whose handoff turned out unneeded
    # (state SKIPPED: the engine releases it on the prefill worker). Runs nothing itself.
    remote_kv: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        """Nothing for the model to run (ids above may still need handling)."""
        return not self.scheduled
