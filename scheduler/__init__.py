"""Which requests run this step and how many tokens each.

Pure bookkeeping: imports `kvcache` only, no torch, no gRPC, nothing from `worker`.
"""

from scheduler.output import ScheduledRequest, SchedulerOutput
from scheduler.request import Request, RequestStatus, SamplingParams
from scheduler.scheduler import PREEMPTION_MODES, PrefixCacheReset, Scheduler

__all__ = [
    "PREEMPTION_MODES",
    "PrefixCacheReset",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
]
