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
    """

    request: Request
    num_new_tokens: int
    start: int  # == request.num_computed_tokens at schedule time
    block_table: list[int]  # a copy, covering at least start + num_new_tokens positions
    will_sample: bool

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start : self.start + self.num_new_tokens]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    # The runner drops any per-request state it keeps for these ids.
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # freed since the last step

    @property
    def is_empty(self) -> bool:
        """Nothing for the model to run (ids above may still need handling)."""
        return not self.scheduled
