"""The step as rank 0 sends it to the followers: fixed binary integer arrays, never a
pickle. Two broadcasts a message: a header of HEADER_LEN int64 (its kind and sizes), then
one payload whose layout the header fixes (int64; float32 for LORA's adapter weights).

    FORWARD  header [1, T, R, max_blocks, max_query_len, max_seq_len, has_lora, P, N, 0]
             payload  input_ids[T] | positions[T] | slot_mapping[T]
                      | block_tables[R * max_blocks] | seq_lens[R] | query_start_loc[R + 1]
                      | lora_slots[T] (with has_lora = 1: each token's adapter slot, -1 base)
                      | pass_rows[P] | logit_rows[N]: the step's P logits passes (calls of
                        the vocab-parallel head, in rank 0's order: prompt logprobs' then
                        the sampled rows'), pass i the next pass_rows[i] of logit_rows
                        (rows of the step's hidden states, in [0, T)); N = sum(pass_rows)
    MOVES    header [2, n_out, n_in, n_copy, 0, ...]
             payload  (src, dst) pairs: swap out[n_out], swap in[n_in], copy[n_copy]
    STOP     header [3, 0, ...]: the followers exit 0
    LORA     header [4, slot, r, target_mask, use_rslora, alpha (float64 bits), n, 0, ...]
             payload  n float32 (this kind's one float payload): a LoRA adapter for slot
                      `slot`, every layer's targeted projections' A then B, whole, flat
                      (worker/parallel/lora.py); each follower slices its share

T: the step's tokens; R: its attention rows (ModelRunner._forward). Sampling, grammars,
logprobs and speculation stay on rank 0: the followers run the layers and their slices of
the logits passes (worker/parallel/vocab.py), which rank 0 gathers. Adapters are
registered, loaded and unloaded on rank 0 alone; a follower's slots get what rank 0's get,
when rank 0 writes them (a LORA message before the FORWARD that first uses the slot).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

HEADER_LEN = 10
FORWARD, MOVES, STOP, LORA = 1, 2, 3, 4
# A header that asks for more is refused rather than allocated (a corrupt message).
MAX_PAYLOAD = 1 << 28


@dataclass
class ForwardArrays:
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [R, max_blocks] int32
    seq_lens: np.ndarray  # [R] int64
    query_start_loc: np.ndarray  # [R + 1] int64
    max_query_len: int
    max_seq_len: int
    lora_slots: np.ndarray | None = None  # [T] int64: each token's adapter slot (-1: none)
    # The step's logits passes, in order: each the rows of the hidden states one call of
    # the head takes (int64, none empty); none: no logits this step (no gather on any rank).
    logits: list[np.ndarray] = field(default_factory=list)


@dataclass
class Moves:
    """The step's KV moves as ModelRunner.move_blocks reads them."""

    blocks_to_swap_out: list[tuple[int, int]]
    blocks_to_swap_in: list[tuple[int, int]]
    blocks_to_copy: list[tuple[int, int]]


def header(kind: int, *sizes: int) -> np.ndarray:
    h = np.zeros(HEADER_LEN, dtype=np.int64)
    h[0] = kind
    h[1:1 + len(sizes)] = sizes
    return h


def pack_forward(a: ForwardArrays) -> tuple[np.ndarray, np.ndarray]:
    rows, max_blocks = a.block_tables.shape
    has_lora = a.lora_slots is not None
    counts = [len(p) for p in a.logits]
    assert all(counts), "an empty logits pass"
    h = header(FORWARD, len(a.input_ids), rows, max_blocks, a.max_query_len, a.max_seq_len,
               int(has_lora), len(counts), sum(counts))
    parts = [a.input_ids, a.positions, a.slot_mapping, a.block_tables.reshape(-1).astype(np.int64),
             a.seq_lens, a.query_start_loc]
    if a.lora_slots is not None:
        assert len(a.lora_slots) == len(a.input_ids)
        parts.append(a.lora_slots)
    parts += [np.array(counts, dtype=np.int64), *a.logits]
    return h, np.concatenate(parts).astype(np.int64, copy=False)


def payload_len(h: np.ndarray) -> int:
    """How many int64 the payload after header `h` holds (0: none); ValueError on a header
    no rank 0 sends."""
    kind = int(h[0])
    if kind == FORWARD:
        t, r, b = (int(x) for x in h[1:4])
        if int(h[6]) not in (0, 1):
            raise ValueError(f"a step message header out of bounds: {h.tolist()}")
        n = (3 + int(h[6])) * t + r * b + 2 * r + 1 + int(h[7]) + int(h[8])
    elif kind == MOVES:
        n = 2 * int(h[1:4].sum())
    elif kind == STOP:
        n = 0
    elif kind == LORA:
        n = int(h[6])
    else:
        raise ValueError(f"a step message of unknown kind {kind}")
    sizes = np.delete(h[1:], 4) if kind == LORA else h[1:]  # (alpha's bits may read < 0)
    if not 0 <= n <= MAX_PAYLOAD or (sizes < 0).any():
        raise ValueError(f"a step message header out of bounds: {h[:6].tolist()}")
    return n


def unpack_forward(h: np.ndarray, payload: np.ndarray) -> ForwardArrays:
    """The step; ValueError where its logits passes do not add up (a corrupt message)."""
    t, r, b, max_query_len, max_seq_len, has_lora, p, n = (int(x) for x in h[1:9])
    cuts = np.cumsum([t, t, t, r * b, r, r + 1, t * has_lora, p])
    ids, pos, slots, tables, seq_lens, qsl, lora_slots, counts, rows = np.split(payload, cuts)
    if (counts < 1).any() or int(counts.sum()) != n or len(rows) != n or ((rows < 0) | (rows >= t)).any():
        raise ValueError(f"a step message's logits passes are out of bounds: {counts.tolist()[:8]} "
                         f"passes of {n} rows of {t}")
    return ForwardArrays(ids, pos, slots, tables.reshape(r, b).astype(np.int32), seq_lens, qsl,
                         max_query_len, max_seq_len, lora_slots if has_lora else None,
                         np.split(rows, np.cumsum(counts)[:-1]) if p else [])


def pack_moves(m: Moves) -> tuple[np.ndarray, np.ndarray]:
    parts = (m.blocks_to_swap_out, m.blocks_to_swap_in, m.blocks_to_copy)
    pairs = [p for part in parts for p in part]
    payload = np.array(pairs, dtype=np.int64).reshape(-1)
    return header(MOVES, *(len(p) for p in parts)), payload


def unpack_moves(h: np.ndarray, payload: np.ndarray) -> Moves:
    n_out, n_in, _ = (int(x) for x in h[1:4])
    pairs = [(int(a), int(b)) for a, b in payload.reshape(-1, 2)]
    return Moves(pairs[:n_out], pairs[n_out:n_out + n_in], pairs[n_out + n_in:])
