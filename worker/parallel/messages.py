"""The step as rank 0 sends it to the followers: fixed binary integer arrays, never a
pickle. Two broadcasts a message: a header of HEADER_LEN int64 (its kind and sizes), then
one int64 payload whose layout the header fixes.

    FORWARD  header [1, T, R, max_blocks, max_query_len, max_seq_len, 0, 0]
             payload  input_ids[T] | positions[T] | slot_mapping[T]
                      | block_tables[R * max_blocks] | seq_lens[R] | query_start_loc[R + 1]
    MOVES    header [2, n_out, n_in, n_copy, 0, 0, 0, 0]
             payload  (src, dst) pairs: swap out[n_out], swap in[n_in], copy[n_copy]
    STOP     header [3, 0, ...]: the followers exit 0

T: the step's tokens; R: its attention rows (ModelRunner._forward). Sampling, grammars,
logprobs and speculation stay on rank 0: the followers only run the layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

HEADER_LEN = 8
FORWARD, MOVES, STOP = 1, 2, 3
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
    h = header(FORWARD, len(a.input_ids), rows, max_blocks, a.max_query_len, a.max_seq_len)
    payload = np.concatenate([a.input_ids, a.positions, a.slot_mapping,
                              a.block_tables.reshape(-1).astype(np.int64), a.seq_lens,
                              a.query_start_loc]).astype(np.int64, copy=False)
    return h, payload


def payload_len(h: np.ndarray) -> int:
    """How many int64 the payload after header `h` holds (0: none); ValueError on a header
    no rank 0 sends."""
    kind = int(h[0])
    if kind == FORWARD:
        t, r, b = (int(x) for x in h[1:4])
        n = 3 * t + r * b + 2 * r + 1
    elif kind == MOVES:
        n = 2 * int(h[1:4].sum())
    elif kind == STOP:
        n = 0
    else:
        raise ValueError(f"a step message of unknown kind {kind}")
    if not 0 <= n <= MAX_PAYLOAD or (h[1:] < 0).any():
        raise ValueError(f"a step message header out of bounds: {h[:6].tolist()}")
    return n


def unpack_forward(h: np.ndarray, payload: np.ndarray) -> ForwardArrays:
    t, r, b, max_query_len, max_seq_len = (int(x) for x in h[1:6])
    cuts = np.cumsum([t, t, t, r * b, r])
    ids, pos, slots, tables, seq_lens, qsl = np.split(payload, cuts)
    return ForwardArrays(ids, pos, slots, tables.reshape(r, b).astype(np.int32), seq_lens, qsl,
                         max_query_len, max_seq_len)


def pack_moves(m: Moves) -> tuple[np.ndarray, np.ndarray]:
    parts = (m.blocks_to_swap_out, m.blocks_to_swap_in, m.blocks_to_copy)
    pairs = [p for part in parts for p in part]
    payload = np.array(pairs, dtype=np.int64).reshape(-1)
    return header(MOVES, *(len(p) for p in parts)), payload


def unpack_moves(h: np.ndarray, payload: np.ndarray) -> Moves:
    n_out, n_in, _ = (int(x) for x in h[1:4])
    pairs = [(int(a), int(b)) for a, b in payload.reshape(-1, 2)]
    return Moves(pairs[:n_out], pairs[n_out:n_out + n_in], pairs[n_out + n_in:])
