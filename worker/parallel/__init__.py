"""Tensor parallelism (`-tp k`): one model split over k ranks of one node.

The serve process is rank 0: door, scheduler, sampler, gRPC, and its own shard. It
starts k-1 followers (`follower.py`), each loading the same model and keeping its shard
(`shard.py`: its heads and MLP slice; `vocab.py`: its rows of the embedding and the LM
head, whose logits rank 0 gathers), and sends them every step as fixed binary integer arrays
(`messages.py`) over torch.distributed (`group.py`: gloo on the CPU, NCCL on CUDA);
nothing is pickled. A rank that dies, hangs past --distributed-timeout-seconds or
raises ends every stream (UNAVAILABLE) and the worker (`RankLost`).

This module imports nothing heavy: the engine names `RankLost` without loading
torch.distributed.
"""

from __future__ import annotations


class RankLost(RuntimeError):
    """A rank of the tensor-parallel group died, hung past the timeout or failed a step:
    the group cannot run another step, so the engine stops (every stream UNAVAILABLE)."""
