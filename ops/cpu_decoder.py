"""A Llama-family model's forward pass on the CPU in float32 as one native call per step
(`cpu_kernels/decoder.c`), for a model whose every linear layer is a `QuantLinear` (a q/k/v may be a
`StackedLinear` of up to three, one per block type: a GGUF file's attn_v in another type).

Op by op, a batch-1 decode step of the default model issues hundreds of small torch ops and
ctypes calls (norms, rotary, cache writes, activations, 121 matmuls, 30 attentions), and
their dispatch costs more than their arithmetic. Here every step is one call:

    decode(embed -> 30 x [attn_in, attention, attn_out] -> final norm [-> head, all decodes])

Every row attends as a decode query (`cpu_kernels/paged_attention.c`): a prefill row at
position p over its request's first p + 1 cached tokens (in a layer with a sliding window
w, the last w of them: each row's window is its own, a prompt chunk's and a verification
step's rows included). So a prompt's bits do not depend
on how the scheduler chunked it (torch's SDPA, which ran the chunks before, rounds with
the chunk's length: a request's logprobs changed in the sixth digit beside other work).

With LoRA slots (worker/lora/slots.py) the C layers also add each adapter row's low-rank
delta to its linears' outputs (`cpu_kernels/lora.c`); base rows are never touched.

Every token of every step goes through the same C code, so a request's bits do not depend
on its batch. The norms, rotary, SiLU and attention round a little differently from
torch's (`decoder.c` says how), so the runner uses this module for every step or for none.
It reads the model's modules as `worker/models/llama.py` names them (this package imports
nothing of ours).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from ops import cpu_kernels
from ops.lora import LoraStack
from ops.quantized_linear import QuantEmbedding, QuantLinear
from ops.stacked_linear import StackedLinear

# decoder.c's embed_kind for a float32 table (else the lookup's records' qtype code)
_EMBED_TABLE = -1

_p, _i32, _f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _QLinear(ctypes.Structure):
    _fields_ = [("w", _p), ("qtype", _i32), ("planes", _i32), ("N", _i32), ("K", _i32), ("bias", _p)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _QLinear), ("o", _QLinear), ("gate_up", _QLinear), ("down", _QLinear),
                ("input_norm", _p), ("post_norm", _p), ("window", _i32), ("q_norm", _p), ("k_norm", _p),
                ("cos_sin", _p), ("attn_out_norm", _p), ("ffn_out_norm", _p),
                ("qkv_rest", _QLinear * 2), ("qkv_heads", _i32 * 3)]


class _LoraLinear(ctypes.Structure):
    _fields_ = [("a", _p), ("bt", _p * 3), ("n", _i32), ("out", _i32 * 3)]


class _LoraLayer(ctypes.Structure):
    _fields_ = [("qkv", _LoraLinear), ("o", _LoraLinear), ("gate_up", _LoraLinear), ("down", _LoraLinear)]


class _Model(ctypes.Structure):
    _fields_ = [("hidden", _i32), ("intermediate", _i32), ("num_heads", _i32), ("num_kv_heads", _i32),
                ("head_dim", _i32), ("num_layers", _i32), ("eps", _f32), ("scale", _f32),
                ("layers", ctypes.POINTER(_Layer)), ("final_norm", _p), ("rot_dim", _i32),
                ("embed_kind", _i32), ("embed", _p), ("block_size", _i32),
                ("lora", ctypes.POINTER(_LoraLayer)), ("lora_rank", _i32), ("head", _QLinear),
                ("embed_scale", _f32), ("softcap", _f32), ("final_softcap", _f32), ("gelu", _i32)]


class _Step(ctypes.Structure):
    _fields_ = [("M", _i32), ("ids", _p), ("positions", _p), ("slots", _p), ("n_dec", _i32),
                ("dec_rows", _p), ("dec_tables", _p), ("dec_lens", _p), ("max_blocks", _i32),
                ("k_caches", _p), ("v_caches", _p), ("residual", _p), ("qkv", _p), ("att", _p),
                ("out", _p), ("nthreads", _i32), ("lora_slots", _p), ("lora_pairs", _p), ("n_lora", _i32),
                ("lora_groups", _i32), ("logits", _p), ("argmax", _p), ("wake_fd", _i32), ("kv_half", _i32)]


# Steps of up to this many rows (decode steps, a few requests' verification rows) run on
# buffers kept from call to call (`CpuDecoder.decode`); the logits' are REUSE_ROWS x vocab.
REUSE_ROWS = 64

# The linears of a layer as decoder.c's lora_layer holds them, and their LORA_* bits.
LORA_GROUPS = {"qkv_proj": 1, "o_proj": 2, "gate_up_proj": 4, "down_proj": 8}


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = cpu_kernels.load("decoder")
    if lib is not None:
        lib.cpu_decoder_decode.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step)]
        lib.cpu_decoder_decode.restype = _i32
    return lib


def lora_unsupported(stacks: Sequence[Mapping[str, LoraStack]]) -> str | None:
    """Why LoRA slots `stacks` (one mapping per layer, worker/lora/slots.py) cannot run in
    the C layers (None: they can)."""
    for layer in stacks:
        if set(layer) != set(LORA_GROUPS):
            return "a layer's LoRA stacks are not qkv_proj, o_proj, gate_up_proj and down_proj"
        for st in layer.values():
            if st.a.dtype != torch.float32 or st.a.device.type != "cpu" or not st.a.is_contiguous():
                return "LoRA weights not contiguous float32 on the CPU"
            for b in st.bs:
                if b.dtype != torch.float32 or b.stride() != (b.shape[1] * b.shape[2], 1, b.shape[1]):
                    return "LoRA B not stored transposed ([slots, rank, out]) in float32"
            if len(st.bs) > 3 or st.a.shape[1] != len(st.bs) * st.bs[0].shape[2]:
                return "LoRA stacks of an unexpected shape"
    return None


def unsupported(model: nn.Module) -> str | None:
    """Why `model` cannot run here (None: it can)."""
    if _library() is None:
        return "no compiled kernel (gcc or AVX2 missing)"
    cfg = model.config
    if cfg.head_dim % 32 or cfg.hidden_size % 32:
        return f"head_dim {cfg.head_dim} or hidden size {cfg.hidden_size} not a multiple of 32"
    if model.norm.dtype != torch.float32 or model.norm.device.type != "cpu":
        return "not float32 on the CPU"
    for layer in model.layers:
        qkv = layer.self_attn.qkv_proj
        if isinstance(qkv, StackedLinear):
            why = _stacked_unsupported(qkv, cfg.head_dim)
            if why:
                return why
        elif not isinstance(qkv, QuantLinear):
            return "a linear layer is not quantized"
        for lin in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            if not isinstance(lin, QuantLinear):
                return ("a layer's gate_up_proj in blocks of two types" if isinstance(lin, StackedLinear)
                        else "a linear layer is not quantized")
    embed = model.embed_tokens
    if not isinstance(embed, QuantEmbedding) and not (
        isinstance(embed, nn.Embedding) and embed.weight.dtype == torch.float32
    ):
        return "an embedding of neither GGUF blocks nor a float32 table"
    return None


def _stacked_unsupported(qkv: StackedLinear, head_dim: int) -> str | None:
    """Why a q/k/v of parts in several block types cannot be decoder.c's qkv parts."""
    parts = _qkv_parts(qkv)
    if len(parts) > 3 or not all(isinstance(p, QuantLinear) for p in parts):
        return "a q/k/v of more than three parts, or of parts not quantized"
    if any(p.out_features % head_dim for p in parts):
        return "a q/k/v whose block types change within a head"
    if len({p.planes for p in parts}) > 1:
        return "a q/k/v whose parts take different activations"
    return None


def _qkv_parts(qkv: nn.Module) -> list[QuantLinear]:
    """A layer's q/k/v as its QuantLinears: a StackedLinear's parts, or the one."""
    return list(qkv.parts) if isinstance(qkv, StackedLinear) else [qkv]


def _qkv(qkv: nn.Module, head_dim: int) -> tuple[_QLinear, Any, Any]:
    """decoder.c's qkv, qkv_rest and qkv_heads of a layer's q/k/v (one QuantLinear, or a
    StackedLinear of up to three)."""
    parts = _qkv_parts(qkv)
    rest = (_QLinear * 2)(*(_qlinear(p) for p in parts[1:]))
    heads = (_i32 * 3)(*(p.out_features // head_dim for p in parts))
    return _qlinear(parts[0]), rest, heads


def _linears(layer: nn.Module) -> list[QuantLinear]:
    """A layer's QuantLinears (a stacked q/k/v's parts one by one)."""
    return [*_qkv_parts(layer.self_attn.qkv_proj), layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj]


def _qlinear(lin: QuantLinear) -> _QLinear:
    bias = lin.bias.data_ptr() if lin.bias is not None else None
    return _QLinear(lin.packed.data_ptr(), lin.code, lin.planes, lin.out_features, lin.in_features, bias)


class CpuDecoder:
    """`model.forward(input_ids, positions, meta, kv_caches)` of a Llama-family model (see
    the top), returning the final hidden states [T, hidden]."""

    def __init__(self, model: nn.Module, block_size: int,
                 lora: Sequence[Mapping[str, LoraStack]] | None = None) -> None:
        """`lora`: the runner's LoRA slots, one mapping of stacks per layer (allocated once:
        their addresses stay valid), for the steps that carry a StepLora."""
        reason = unsupported(model) or (lora_unsupported(lora) if lora is not None else None)
        assert reason is None, reason
        self._lib = _library()
        cfg = model.config
        self.config = cfg
        self.block_size = block_size
        self._keep: list[Any] = []  # every tensor the C side points at stays alive here
        layers = (_Layer * cfg.num_layers)()
        cos_sin = model.cos_sin.contiguous()
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            # Gemma (worker/models/gemma.py): the MLP's input norm is pre_feedforward_layernorm,
            # and the sublayers' outputs are normed (post_attention_layernorm, post_feedforward_layernorm).
            gemma = hasattr(layer, "post_feedforward_layernorm")
            mlp_in = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
            norms = [layer.input_layernorm.detach().contiguous(), mlp_in.detach().contiguous()]
            outs = [layer.post_attention_layernorm.detach().contiguous(),
                    layer.post_feedforward_layernorm.detach().contiguous()] if gemma else [None, None]
            qk = [None if n is None else n.detach().contiguous() for n in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))]
            # A layer's own table where it has one (two rope bases: Gemma 3's local layers).
            table_cs = cos_sin if getattr(attn, "cos_sin", None) is None else attn.cos_sin.contiguous()
            self._keep += [*norms, *qk, *outs, table_cs, attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
            qkv, qkv_rest, qkv_heads = _qkv(attn.qkv_proj, cfg.head_dim)
            layers[i] = _Layer(qkv, _qlinear(attn.o_proj), _qlinear(mlp.gate_up_proj),
                               _qlinear(mlp.down_proj), norms[0].data_ptr(), norms[1].data_ptr(),
                               min(attn.window or 0, 2**31 - 1),  # (past any context a cache holds)
                               *(None if n is None else n.data_ptr() for n in qk), table_cs.data_ptr(),
                               *(None if n is None else n.data_ptr() for n in outs), qkv_rest, qkv_heads)
        embed = model.embed_tokens
        if isinstance(embed, QuantEmbedding):
            kind, table = embed.code, embed.packed
        else:
            kind, table = _EMBED_TABLE, embed.weight.detach().contiguous()
        final_norm = model.norm.detach().contiguous()
        self._keep += [layers, table, final_norm, cos_sin]
        self.activations = ", ".join(sorted({lin.activations for layer in model.layers for lin in _linears(layer)}))
        lora_layers, rank = None, 0
        if lora is not None:
            assert len(lora) == cfg.num_layers
            lora_layers = (_LoraLayer * cfg.num_layers)()
            for i, stacks in enumerate(lora):
                lora_layers[i] = _LoraLayer(*(_lora_linear(stacks[g]) for g in LORA_GROUPS))
                self._keep += list(stacks.values())
            rank = lora[0]["qkv_proj"].bs[0].shape[2]
            self._keep.append(lora_layers)
        # The LM head, when quantized: a decode step's logits come from the same call.
        head = model.lm_head if model.lm_head is not None else model.tied_head
        self.head = head if isinstance(head, QuantLinear) and head.bias is None else None
        # The rotating dimensions: the table's width (partial rotary: fewer than head_dim).
        rot_dim = cos_sin.shape[1]
        assert rot_dim % 2 == 0 and rot_dim <= cfg.head_dim, (rot_dim, cfg.head_dim)
        self._model = _Model(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                             cfg.head_dim, cfg.num_layers, cfg.rms_norm_eps, model.layers[0].self_attn.scale,
                             layers, final_norm.data_ptr(), rot_dim, kind, table.data_ptr(),
                             block_size, lora_layers, rank,
                             _qlinear(self.head) if self.head is not None else _QLinear(),
                             getattr(model, "embed_scale", 1.0), model.layers[0].self_attn.softcap or 0.0,
                             getattr(cfg, "final_logit_softcapping", None) or 0.0,
                             int(getattr(model.layers[0].mlp, "activation", "silu") == "gelu_tanh"))
        self.has_lora = lora is not None
        self._caches: tuple[list, ctypes.Array, ctypes.Array] | None = None
        self._kv_half = False
        self._base: _Buffers | None = None
        self._base_logits: torch.Tensor | None = None
        self._views: dict[int, _Buffers] = {}

    def describe(self) -> str:
        lora = ", LoRA in the layers" if self.has_lora else ""
        return f"fused C ({cpu_kernels.isa()}, {self.activations} activations{lora})"

    def _cache_pointers(self, kv_caches: list) -> tuple[ctypes.Array, ctypes.Array]:
        if self._caches is None or self._caches[0] is not kv_caches:
            for k, v in kv_caches:
                assert k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype == kv_caches[0][0].dtype
                assert k.dtype in (torch.float32, torch.float16), "a KV cache of float32 or float16"
                assert k.shape[1] == self.block_size
            n = len(kv_caches)
            ks = (ctypes.c_void_p * n)(*[k.data_ptr() for k, _ in kv_caches])
            vs = (ctypes.c_void_p * n)(*[v.data_ptr() for _, v in kv_caches])
            self._caches = (kv_caches, ks, vs)
            self._kv_half = kv_caches[0][0].dtype == torch.float16  # --kv-cache-dtype float16
        return self._caches[1], self._caches[2]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, kv_caches: list) -> torch.Tensor:
        return self.forward(input_ids, positions, meta, kv_caches)[0]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, kv_caches: list,
                logits: bool = False, argmax: torch.Tensor | None = None,
                wake_fd: int = -1) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`decode` on a step given as the torch model takes it (`meta`: an AttentionMetadata),
        its outputs its own. `argmax` (int64 [T]), where given, is written in place."""
        def host(x: torch.Tensor) -> np.ndarray:
            return x.long().contiguous().numpy()

        if argmax is not None:
            assert argmax.dtype == torch.int64 and argmax.shape == input_ids.shape and argmax.is_contiguous()
        return self.decode(host(input_ids), host(positions), host(meta.slot_mapping), host(meta.block_tables),
                           host(meta.seq_lens), host(meta.query_start_loc), meta.max_query_len, kv_caches,
                           lora=getattr(meta, "lora", None), logits=logits,
                           argmax=None if argmax is None else argmax.numpy(), wake_fd=wake_fd, reuse=False)

    def decode(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, tables: np.ndarray,
               seq_lens: np.ndarray, query_start_loc: np.ndarray, max_query_len: int, kv_caches: list,
               lora: Any = None, logits: bool = False, argmax: np.ndarray | None = None,
               wake_fd: int = -1, reuse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden [T, hidden], logits [T, vocab] or None) of a step given as the runner builds
        it: int64 host arrays `ids`, `positions`, `slots` [T], `tables` [R, max_blocks],
        `seq_lens` [R] and `query_start_loc` [R + 1] of its R requests. `logits`: have the
        call compute every row's logits too, which it does when every row is a decode and the
        head is quantized (the runner's `compute_logits`, bit for bit); else None. `argmax`
        (int64 [T]): where the logits come back, the call has also written each row's greedy
        token there, the first maximum as `ops.sampling.finite_argmax` finds it, or -1 where
        that gives None (a maximum that is not finite). It reads each tile of logits while it
        is in L1, where numpy's argmax after the call read them cold (a batch-1 step
        1.002-1.014x faster, BENCHMARKS.md). `wake_fd` >= 0: the call writes one byte to it as
        it begins, with the GIL released (a served worker's event loop: worker/engine.py).

        With `reuse`, a step of up to REUSE_ROWS rows makes no torch op: its outputs and
        scratch are views of buffers kept from earlier calls, which the next call overwrites
        (the runner is done with them within its step). Between two calls the batch-1 step's
        Python runs in caches that the call's ~92 MB of weights have just swept, where each
        kind of torch op's first dispatch costs far more than its warm microsecond: that
        Python took ~0.4 ms, ~11% of the step, and ~0.1 ms in warm caches; now ~0.2 ms
        (benchmarks/step_python.py, BENCHMARKS.md session 26)."""
        t = ids.shape[0]
        for a in (ids, positions, slots, tables, seq_lens, query_start_loc):
            assert a.dtype == np.int64, "the decoder takes int64 host arrays"
        assert positions.shape[0] == slots.shape[0] == t and query_start_loc[-1] == t
        if max_query_len == 1:
            dec_rows, dec_tables, dec_lens = query_start_loc[:-1], tables, seq_lens
        else:
            # Every row attends as a decode row of its own (paged_attention.c): a prefill
            # row at position p is a query over the request's first p + 1 cached tokens.
            # Its arithmetic then depends on p alone, not on how the prompt was chunked
            # (torch's SDPA rounds differently with the chunk's length).
            request = np.repeat(np.arange(seq_lens.shape[0]), np.diff(query_start_loc))
            dec_rows = np.arange(t, dtype=np.int64)
            dec_tables = tables[request]
            dec_lens = seq_lens[request] - query_start_loc[1:][request] + 1 + dec_rows
        with_logits = logits and max_query_len == 1 and self.head is not None
        buf = self._reused(t) if reuse and t <= REUSE_ROWS else self._fresh(t)
        ks, vs = self._cache_pointers(kv_caches)
        at = cpu_kernels.address
        step = _Step(t, at(ids), at(positions), at(slots), dec_rows.shape[0], at(dec_rows),
                     at(dec_tables), at(dec_lens), tables.shape[1], ctypes.addressof(ks),
                     ctypes.addressof(vs), *buf.pointers, torch.get_num_threads())
        step.wake_fd = wake_fd  # (ctypes zeroes it: fd 0 is stdin)
        step.kv_half = self._kv_half
        keep = None
        if lora is not None:
            assert self.has_lora, "a step with LoRA rows on a decoder built without LoRA slots"
            token_slots = lora.token_slots
            assert len(token_slots) == t
            keep = (np.array(token_slots, dtype=np.int32),
                    np.array(_pairs_by_slot(token_slots), dtype=np.int32).reshape(-1, 2))
            step.lora_slots, step.lora_pairs = at(keep[0]), at(keep[1])
            step.n_lora = keep[1].shape[0]
            step.lora_groups = sum(LORA_GROUPS[g] for g in lora.layers[0])
        all_logits = None
        if with_logits:
            if buf.logits is not None:
                all_logits, step.logits = buf.logits, buf.logits_pointer
            else:
                all_logits = torch.empty(t, self.head.out_features)
                step.logits = all_logits.data_ptr()
            if argmax is not None:
                assert argmax.dtype == np.int64 and argmax.shape == (t,)
                step.argmax = at(argmax)
        _check(self._lib.cpu_decoder_decode(ctypes.byref(self._model), ctypes.byref(step)))
        del keep  # (the LoRA arrays lived through the call)
        return buf.out, all_logits

    def _fresh(self, t: int) -> _Buffers:
        cfg = self.config
        residual, out = torch.empty(t, cfg.hidden_size), torch.empty(t, cfg.hidden_size)
        qkv = torch.empty(t, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)
        att = torch.empty(t, cfg.num_heads * cfg.head_dim)
        return _Buffers(out, None, 0, (residual.data_ptr(), qkv.data_ptr(), att.data_ptr(), out.data_ptr()),
                        (residual, qkv, att))

    def _reused(self, t: int) -> _Buffers:
        """Views of REUSE_ROWS rows' buffers for a step of t rows (made once per t)."""
        buf = self._views.get(t)
        if buf is None:
            if self._base is None:
                self._base = self._fresh(REUSE_ROWS)
                if self.head is not None:
                    self._base_logits = torch.empty(REUSE_ROWS, self.head.out_features)
            base = self._base
            logits = self._base_logits[:t] if self._base_logits is not None else None
            buf = self._views[t] = _Buffers(base.out[:t], logits, 0 if logits is None else logits.data_ptr(),
                                            base.pointers, base.keep)
        return buf


class _Buffers(NamedTuple):
    """A call's outputs (the hidden states; the logits when reused, else made per call) and
    the C pointers of its residual, qkv, att and out buffers (rows from 0: `_Step`'s order)."""

    out: torch.Tensor
    logits: torch.Tensor | None
    logits_pointer: int
    pointers: tuple[int, int, int, int]
    keep: tuple[torch.Tensor, ...]  # the scratch the pointers name


def _pairs_by_slot(token_slots: Sequence[int]) -> list[list[int]]:
    """The adapter rows (slot >= 0) grouped by slot, in pairs of the same slot ([r, -1] for
    a slot's odd row out): decoder.c's lora_pairs."""
    by_slot: dict[int, list[int]] = {}
    for r, slot in enumerate(token_slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(r)
    pairs = []
    for slot in sorted(by_slot):
        rows = by_slot[slot]
        pairs += [[rows[i], rows[i + 1] if i + 1 < len(rows) else -1] for i in range(0, len(rows), 2)]
    return pairs


def _lora_linear(st: LoraStack) -> _LoraLinear:
    n = len(st.bs)
    bt = [b.data_ptr() for b in st.bs] + [None] * (3 - n)
    out = [b.shape[1] for b in st.bs] + [0] * (3 - n)
    return _LoraLinear(st.a.data_ptr(), (_p * 3)(*bt), n, (_i32 * 3)(*out))


def _check(rc: int) -> None:
    if rc:
        raise RuntimeError(f"CPU decoder kernel failed ({rc}): bad shapes or lengths")
