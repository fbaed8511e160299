"""LoRA adapters under tensor parallelism: rank 0's slot writes, sent to the followers.

Adapters are named, read from disk, checked, loaded and unloaded on rank 0 alone
(worker/lora/registry.py, the admin RPCs included). When rank 0 copies an adapter into a
device slot (LoraSlots.assign, on a slot miss), it sends the same adapter, whole, as one
LORA message (messages.py) before the step that uses it; each follower rebuilds it and
writes its share (ShardPlan.lora_slicer) into the same slot. So every rank's slots hold the
same adapters without a follower ever reading a file: nothing can load on one rank and
fail on another. A message that does not fit the model (a corrupt one) raises in the
follower, which exits; rank 0 sees the group break (RankLost), loudly.
"""

from __future__ import annotations

import numpy as np
import torch

from worker.lora.adapter import TARGETS, AdapterConfig, LoraAdapter, module_shapes
from worker.models.llama import LlamaConfig
from worker.parallel import messages


def _mask(targets: tuple[str, ...]) -> int:
    return sum(1 << i for i, t in enumerate(TARGETS) if t in targets)


def pack(slot: int, adapter: LoraAdapter) -> tuple[np.ndarray, np.ndarray]:
    """The LORA message writing `adapter` into `slot`: its A and B of every layer and
    targeted projection, in (layer, TARGETS) order, as float32."""
    cfg = adapter.config
    layers = sorted({layer for layer, _ in adapter.weights})
    parts = [t.reshape(-1).numpy() for layer in layers for proj in TARGETS
             if (layer, proj) in adapter.weights for t in adapter.weights[layer, proj]]
    payload = np.concatenate(parts).astype(np.float32, copy=False)
    alpha_bits = int(np.array(cfg.alpha, dtype=np.float64).view(np.int64))
    h = messages.header(messages.LORA, slot, cfg.rank, _mask(cfg.target_modules),
                        int(cfg.use_rslora), alpha_bits, len(payload))
    return h, payload


def unpack(h: np.ndarray, payload: np.ndarray, model: LlamaConfig) -> tuple[int, LoraAdapter]:
    """(slot, adapter) of a LORA message for a base model of (whole) config `model`;
    ValueError when its sizes do not fit that model."""
    slot, rank, mask, rslora = (int(x) for x in h[1:5])
    alpha = float(np.array(h[5], dtype=np.int64).view(np.float64))
    targets = tuple(t for i, t in enumerate(TARGETS) if mask >> i & 1)
    shapes = module_shapes(model)
    want = model.num_layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)
    if not targets or rank < 1 or len(payload) != want:
        raise ValueError(f"a LoRA message of rank {rank} on {', '.join(targets) or 'nothing'} "
                         f"carries {len(payload)} floats; this model needs {want}")
    flat = torch.from_numpy(np.ascontiguousarray(payload, dtype=np.float32))
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    at = 0
    for layer in range(model.num_layers):
        for proj in targets:
            n_in, n_out = shapes[proj]
            a = flat[at:at + rank * n_in].view(rank, n_in)
            at += rank * n_in
            b = flat[at:at + n_out * rank].view(n_out, rank)
            at += n_out * rank
            weights[layer, proj] = (a, b)
    config = AdapterConfig(rank, alpha, bool(rslora), targets)
    return slot, LoraAdapter(f"slot {slot}", "(from rank 0)", config, weights)
