"""A GGUF tensor as one piece of a model weight (a row block of a fused q/k/v or gate/up),
or a tensor-parallel rank's slice of it (worker/parallel/gguf_split.py): some of its rows
(whole heads, an MLP slice, or vocabulary rows and then zero rows to whole tiles) and some
of its input columns (whole blocks).

A slice is read from the file's map as blocks: rows are whole rows of blocks, and columns
that start and end on block boundaries are a byte range of each row, so a rank's blocks are
the file's own, never the whole tensor's copy (`blocks`). Dequantized (`floats`), the
selected rows are dequantized and then cut to the columns, which need not fall on blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES

from worker.weights import gguf_file, gguf_finite
from worker.weights.gguf_reader import GGUFTensor


@dataclass(frozen=True)
class Piece:
    tensor: GGUFTensor
    heads: int | None  # q/k rows to unpermute over this many heads (of the whole tensor)
    rows: tuple[range, ...] | None = None  # the tensor's rows kept, in order; None: all
    cols: range | None = None  # the input columns kept (a matrix); None: all
    pad_rows: int = 0  # zero rows after the kept ones (a vocab-parallel rank's padding)

    @property
    def qtype(self) -> str:
        return self.tensor.tensor_type.name

    @property
    def full_shape(self) -> tuple[int, ...]:  # (out, in) for a matrix, as torch holds it
        return tuple(int(d) for d in reversed(self.tensor.shape))

    @property
    def kept_shape(self) -> tuple[int, ...]:
        """The file's elements this piece keeps (its padding not counted)."""
        out, *rest = self.full_shape
        if self.rows is not None:
            out = sum(len(r) for r in self.rows)
        if self.cols is not None:
            rest = [len(self.cols)]
        return (out, *rest)

    @property
    def shape(self) -> tuple[int, ...]:
        out, *rest = self.kept_shape
        return (out + self.pad_rows, *rest)

    @property
    def block_size(self) -> int:
        """Elements a block of this type holds (1 for F32, F16, BF16)."""
        return GGML_QUANT_SIZES[self.tensor.tensor_type][0]

    @property
    def n_bytes(self) -> int:
        """The file's bytes of what this piece keeps."""
        whole = int(np.prod(self.full_shape))
        return self.tensor.n_bytes * int(np.prod(self.kept_shape)) // whole

    def _rows(self, data: np.ndarray) -> np.ndarray:
        if self.rows is None:
            return data
        if len(self.rows) == 1:
            return data[self.rows[0].start : self.rows[0].stop]
        return np.concatenate([data[r.start : r.stop] for r in self.rows])

    def _heads(self) -> int | None:
        """Heads of the kept rows: whole heads, so unpermuting them over their own count is
        unpermuting the whole tensor and then selecting (the permutation is within a head)."""
        if not self.heads:
            return None
        return self.heads * self.kept_shape[0] // self.full_shape[0]

    def blocks(self) -> np.ndarray:
        """The file's blocks of this piece, [rows, bytes per row] (elements for F32/F16),
        rows unpermuted: a view of the map where nothing moves, else a copy of the slice.
        A float16 scale (or F16/BF16 element) that is inf or NaN: refused (gguf_finite.py)."""
        data = self._rows(self.tensor.data)
        gguf_finite.check_blocks(self.tensor.name, self.qtype, data)
        if self.cols is not None:
            c, n, bs = self.cols, self.full_shape[1], self.block_size
            assert c.start % bs == 0 and c.stop % bs == 0, (self.tensor.name, c, bs)
            per = data.shape[1] // (n // bs)  # bytes (or elements) a block
            data = np.ascontiguousarray(data[:, c.start // bs * per : c.stop // bs * per])
        heads = self._heads()
        return _padded(gguf_file.unpermute(data, heads) if heads else data, self.pad_rows)

    def floats(self) -> np.ndarray:
        """float32 values of this piece, rows unpermuted; one that is inf or NaN: refused."""
        data = self._rows(self.tensor.data)
        rows = self.kept_shape[0]
        if rows:
            w = gguf_file.dequantize_tensor(data, self.tensor.tensor_type)
            w = w.reshape((rows, *self.full_shape[1:]))
            gguf_finite.check_floats(self.tensor.name, self.qtype, w)
        else:  # a vocab-parallel rank past the vocabulary's end: padding only
            w = np.zeros((0, *self.full_shape[1:]), dtype=np.float32)
        if self.cols is not None:
            w = w[:, self.cols.start : self.cols.stop]
        heads = self._heads()
        return _padded(gguf_file.unpermute(w, heads) if heads else w, self.pad_rows)


def _padded(data: np.ndarray, rows: int) -> np.ndarray:
    """`data` and then `rows` zero rows: zero bytes are a zero block in every GGML type
    (its scales and quants zero), and 0.0 in F32, F16 and BF16."""
    if not rows:
        return data
    return np.concatenate([data, np.zeros((rows, *data.shape[1:]), dtype=data.dtype)])
