"""The KV transfer's wire pieces both sides share (protos/llmworker/v1/kv_transfer.proto)."""

from __future__ import annotations

from llmworker.v1 import kv_transfer_pb2 as kpb

from worker.kv_transfer.handoff import Layout

# Trailing metadata of a refused pull: the reason the decode counts its fallback under.
REASON_KEY = "llm-worker-kv-reason"


def layout_message(layout: Layout) -> kpb.KVLayout:
    return kpb.KVLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                        head_dim=layout.head_dim, block_size=layout.block_size,
                        dtype=layout.dtype, model=layout.model)


def layout_of(msg: kpb.KVLayout) -> Layout:
    return Layout(msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.block_size, msg.dtype,
                  msg.model)
