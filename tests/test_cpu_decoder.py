"""The fused CPU decoder (ops/cpu_decoder.py): the model's forward pass as a few native calls.
Its hidden states match the op-by-op model's; a row's bits are the same alone, in decode
batches of 2 to 64 and beside prefill chunks (float32, int24, int16 and int8 activations); the runner
takes it, and `--kernels torch` does not."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import ops
from ops import cpu_decoder
from ops import quantized_linear as ql
from worker.config import ModelConfig, WorkerConfig
from worker.engine import Engine
from worker.models.llama import AttentionMetadata
from worker.weights import load_model

pytestmark = pytest.mark.skipif(not ql.available(), reason="no gcc or no AVX2/FMA/F16C here")

BS = 16


@pytest.fixture(scope="module", params=["float32", "int24", "int16", "int8"])
def decoder(request):
    """A fresh model (layers are swapped in place), quantized, and its decoder."""
    loaded = load_model("default")
    engine = Engine(WorkerConfig(model=ModelConfig(cpu_activations=request.param)), loaded=loaded)
    assert engine.runner.cpu_decoder is not None
    return engine.runner.cpu_decoder, loaded.model


class _Requests:
    """Requests with random prompts, each with blocks of its own in a private paged cache."""

    def __init__(self, model, lens: list[int], seed: int, kv_dtype: torch.dtype = torch.float32) -> None:
        cfg = model.config
        rng = random.Random(seed)
        self.lens = lens
        self.ids = [[rng.randrange(100, 40000) for _ in range(n + 1)] for n in lens]
        self.max_blocks = max(-(-(n + 1) // BS) for n in lens)
        blocks = list(range(len(lens) * self.max_blocks))
        rng.shuffle(blocks)
        self.tables = [blocks[i * self.max_blocks : (i + 1) * self.max_blocks] for i in range(len(lens))]
        shape = (len(blocks), BS, cfg.num_kv_heads, cfg.head_dim)
        self.kv = [(torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype))
                   for _ in range(cfg.num_layers)]

    def step(self, chunks: list[tuple[int, int, int]]) -> tuple:
        """(request, first position, count) per request -> the forward pass's arguments."""
        ids, pos, slots, starts, lens, tables = [], [], [], [0], [], []
        for r, p0, n in chunks:
            ids += self.ids[r][p0 : p0 + n]
            pos += range(p0, p0 + n)
            slots += [self.tables[r][p // BS] * BS + p % BS for p in range(p0, p0 + n)]
            starts.append(len(ids))
            lens.append(p0 + n)
            tables.append(self.tables[r])
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), block_tables=torch.tensor(tables, dtype=torch.int32),
            seq_lens=torch.tensor(lens), query_start_loc=torch.tensor(starts),
            max_query_len=max(n for _, _, n in chunks), max_seq_len=max(lens))
        return torch.tensor(ids), torch.tensor(pos), meta, self.kv


def _errors_against_op_by_op(dec, model, seed: int):
    """(chunks, relative max error of the fused hidden states against the op-by-op model's)
    for prefill chunks only, then decodes beside a chunk, then decodes only."""
    reqs = _Requests(model, [37, 5, 70], seed=seed)
    for chunks in ([(0, 0, 37), (1, 0, 5)], [(0, 37, 1), (1, 5, 1), (2, 0, 70)], [(0, 37, 1), (1, 5, 1), (2, 70, 1)]):
        fused = dec(*reqs.step(chunks))
        with torch.inference_mode():
            ref = model(*reqs.step(chunks))
        yield chunks, ((fused - ref).abs().max() / ref.abs().max()).item()


def test_matches_the_op_by_op_model(decoder) -> None:
    dec, model = decoder
    for chunks, rel in _errors_against_op_by_op(dec, model, seed=1):
        # float32 differs only in the rounding of the norms and SiLU; int24 keeps 23 bits of
        # each block's largest activation. With int8 activations a last-bit difference flips
        # the rounding of a few int8 values, each worth 1/127 of its block's largest (SmolLM2
        # has outliers), and 30 layers amplify it: two int8 runs differ about as much as each
        # differs from float32 (about 7% of the largest logit).
        bound = {"float32": 1e-4, "int24": 1e-4, "int16": 1e-3, "int8": 0.25}[dec.activations]
        assert rel < bound, f"{chunks}: relative error {rel:.2e}"


def test_a_rows_bits_do_not_depend_on_its_batch(decoder) -> None:
    """64 requests with contexts of 1 to 40 tokens: each decode alone, in every batch size
    2..64, and beside another request's prefill chunk gives the same hidden state bits."""
    dec, model = decoder
    rng = random.Random(7)
    lens = [rng.randint(1, 40) for _ in range(64)]
    reqs = _Requests(model, lens, seed=2)
    dec(*reqs.step([(r, 0, n) for r, n in enumerate(lens)]))  # fill every request's cache
    alone = torch.cat([dec(*reqs.step([(r, n, 1)])) for r, n in enumerate(lens)])
    for b in range(2, 65):
        first = (b * 7) % 64  # batches start at different requests and wrap around
        members = [(first + i) % 64 for i in range(b)]
        out = dec(*reqs.step([(r, lens[r], 1) for r in members]))
        assert torch.equal(out, alone[members]), f"a batch of {b} differs from its rows alone"
    # Decodes beside a prefill chunk: rows 0 and 2 are decodes, row 1.. a 20-token chunk
    # that rewrites request 5's first 20 positions with the same values.
    out = dec(*reqs.step([(3, lens[3], 1), (5, 0, 20), (9, lens[9], 1)]))
    assert torch.equal(out[0], alone[3]) and torch.equal(out[-1], alone[9])


def test_a_prompts_bits_do_not_depend_on_its_chunking(decoder) -> None:
    """A 70-token prompt prefilled whole, in chunks of the sizes a token budget cuts (beside
    other requests' rows), or one token a step as decodes: every position's hidden state has
    the same bits (each row attends as a decode query over its first p + 1 tokens; torch's
    SDPA, used for chunks before, rounded with the chunk's length)."""
    dec, model = decoder
    n = 70
    reqs = _Requests(model, [n, 12, 30], seed=5)
    whole = dec(*reqs.step([(0, 0, n)]))
    dec(*reqs.step([(1, 0, 12), (2, 0, 30)]))  # the neighbours' caches
    for cuts in ([1, 2, 5, 16, 33, 70], [37, 70], [64, 70]):
        got, p0 = [], 0
        for p1 in cuts:
            out = dec(*reqs.step([(1, 12, 1), (0, p0, p1 - p0), (2, 30, 1)]))
            got.append(out[1 : 1 + p1 - p0])
            p0 = p1
        assert torch.equal(torch.cat(got), whole), f"chunks ending at {cuts} differ from one prefill"
    one_by_one = torch.cat([dec(*reqs.step([(0, p, 1)])) for p in range(n)])
    assert torch.equal(one_by_one, whole), "decoding the prompt token by token differs from its prefill"


def test_a_float16_cache(decoder) -> None:
    """--kv-cache-dtype float16: the call writes each key and value rounded to half as
    torch's .half() does, and reads them back exactly. Its hidden states match the op-by-op
    model's over a float16 cache (which casts as it writes and reads) as closely as over
    float32 caches, differ from a float32 cache's by the halves' rounding, and a row's bits
    are the same alone, in a batch and in chunks."""
    dec, model = decoder
    lens = [37, 5, 70, 300]
    half, single = (_Requests(model, lens, seed=4, kv_dtype=t) for t in (torch.float16, torch.float32))
    ref = _Requests(model, lens, seed=4, kv_dtype=torch.float16)
    prefill = [(r, 0, n) for r, n in enumerate(lens)]
    dec(*half.step(prefill))
    dec(*single.step(prefill))
    # The first layer's keys and values (from the same embeddings either way) are the float32
    # cache's rounded to half, bit for bit; later layers' inputs differ by that rounding.
    (k16, v16), (k32, v32) = half.kv[0], single.kv[0]
    assert torch.equal(k16, k32.half()) and torch.equal(v16, v32.half()) and k16.abs().sum() > 0
    with torch.inference_mode():
        model(*ref.step(prefill))
    decode = [(r, n, 1) for r, n in enumerate(lens)]
    got, full = dec(*half.step(decode)), dec(*single.step(decode))
    with torch.inference_mode():
        want = model(*ref.step(decode))
    rel = ((got - want).abs().max() / want.abs().max()).item()
    # Ten times the float32 caches' bounds (test_matches_the_op_by_op_model): where the two
    # computations' keys differ in their last float32 bits, the halves can round apart (a
    # half's step is 2^-11 of it).
    bound = {"float32": 1e-3, "int24": 1e-3, "int16": 1e-2, "int8": 0.25}[dec.activations]
    assert rel < bound, f"fused vs op by op over float16 caches: relative error {rel:.2e}"
    rounding = ((got - full).abs().max() / full.abs().max()).item()
    assert 0 < rounding < 0.05, f"float16 against float32 caches: {rounding:.2e}"
    alone = torch.cat([dec(*half.step([(r, n, 1)])) for r, n in enumerate(lens)])
    assert torch.equal(alone, got), "a float16 cache's decode differs alone and in a batch"
    chunked = torch.cat([dec(*half.step([(3, p0, p1 - p0)]))[-1:] for p0, p1 in ((0, 100), (100, 301))])
    assert torch.equal(chunked[-1], got[3]), "a float16 cache's prompt differs when chunked"


def test_a_verification_steps_rows_have_their_bits_alone(decoder) -> None:
    """A speculative verification step: a request's next token and its drafts are rows at
    consecutive positions over one cache, whose attention reads each key once for all of them
    (runs of rows, shared out chunk by chunk when few). At contexts where the rows' chunks of
    keys differ in length (47 to 50 tokens: one chunk more; 250, 301: four of different
    lengths), 2 to 8 rows a request, alone and beside other requests' runs and a decode, every
    row's hidden state has the bits of the same positions decoded one at a time."""
    dec, model = decoder
    lens = [250, 47, 301, 120]
    reqs = _Requests(model, [n + 8 for n in lens], seed=9)
    dec(*reqs.step([(r, 0, n) for r, n in enumerate(lens)]))  # every request's cache
    one_by_one = {r: torch.cat([dec(*reqs.step([(r, p, 1)])) for p in range(n, n + 8)])
                  for r, n in enumerate(lens)}
    for chunks in ([(0, lens[0], 4)], [(1, lens[1], 4)], [(2, lens[2], 2)], [(0, lens[0], 8)],
                   [(0, lens[0], 4), (1, lens[1], 3), (3, lens[3], 1)],
                   [(3, lens[3], 1), (2, lens[2], 4), (0, lens[0], 2), (1, lens[1], 5)]):
        out, row = dec(*reqs.step(chunks)), 0
        for r, _, n in chunks:
            assert torch.equal(out[row : row + n], one_by_one[r][:n]), f"{chunks}: request {r} differs"
            row += n


def test_a_decode_steps_logits_from_the_same_call_are_the_heads_bits(decoder) -> None:
    """A decode step asks the call for its logits too (the LM head's tiles in the same
    parallel region): they are `compute_logits` of its hidden states to the bit, at batch 1,
    5 and 64; a step with a prefill chunk leaves the head to the runner (None)."""
    dec, model = decoder
    assert dec.head is not None
    rng = random.Random(3)
    lens = [rng.randint(1, 30) for _ in range(64)]
    reqs = _Requests(model, lens, seed=4)
    hidden, logits = dec.forward(*reqs.step([(r, 0, n) for r, n in enumerate(lens)]), logits=True)
    assert logits is None  # prefill chunks
    for b in (1, 5, 64):
        hidden, logits = dec.forward(*reqs.step([(r, lens[r], 1) for r in range(b)]), logits=True)
        with torch.inference_mode():
            want = model.compute_logits(hidden)
        assert logits is not None and logits.shape == (b, model.config.vocab_size)
        assert torch.equal(logits, want), f"batch {b}: fused logits differ from the head's"
        assert torch.equal(hidden, dec(*reqs.step([(r, lens[r], 1) for r in range(b)])))


@pytest.mark.parametrize("activations", ["float32", "int16"])
def test_a_qkv_in_two_block_types(activations) -> None:
    """A GGUF file may store attn_v in another type than q and k (llama-quantize's Q4_K_M in
    half the layers): the q/k/v is then a StackedLinear of one QuantLinear a type, which the
    C layers take as parts (decoder.c's qkv_rest). Here every other layer's q and k as Q8_0
    and its v as Q4_1 (a type with a min, so the float path's block sums come from the second
    part): the fused decoder takes the model and matches the op-by-op model on it."""
    from gguf import GGMLQuantizationType, quants

    from ops.stacked_linear import StackedLinear

    loaded = load_model("default", cpu_activations=activations)  # (no reload by the engine)
    model, cfg = loaded.model, loaded.config
    qk_rows = (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim

    def part(w: torch.Tensor, qtype: GGMLQuantizationType) -> ql.QuantLinear:
        blocks = quants.quantize(np.ascontiguousarray(w.numpy()), qtype)
        return ql.QuantLinear(ql.QuantizedWeight(qtype.name, blocks, tuple(w.shape)), activations=activations)

    for layer in model.layers[::2]:
        with torch.no_grad():
            w = layer.self_attn.qkv_proj(torch.eye(cfg.hidden_size)).T.contiguous()  # its dequantized rows
        layer.self_attn.qkv_proj = StackedLinear([part(w[:qk_rows], GGMLQuantizationType.Q8_0),
                                                  part(w[qk_rows:], GGMLQuantizationType.Q4_1)])
    engine = Engine(WorkerConfig(model=ModelConfig(cpu_activations=activations)), loaded=loaded)
    dec = engine.runner.cpu_decoder
    assert dec is not None, cpu_decoder.unsupported(model)
    for chunks, rel in _errors_against_op_by_op(dec, model, seed=3):
        assert rel < {"float32": 1e-4, "int16": 1e-3}[activations], f"{chunks}: relative error {rel:.2e}"


def test_the_runner_takes_it_and_the_torch_backend_does_not() -> None:
    loaded = load_model("default")
    engine = Engine(WorkerConfig(), loaded=loaded)
    assert "decoder: fused C (" in engine.runner.describe_kernels()
    assert cpu_decoder.unsupported(loaded.model) is None
    try:
        engine = Engine(WorkerConfig(model=ModelConfig(kernels="torch")), loaded=load_model("default"))
        assert engine.runner.cpu_decoder is None and "decoder: op by op" in engine.runner.describe_kernels()
    finally:
        ops.set_backend("auto")
    engine = Engine(WorkerConfig(model=ModelConfig(cpu_quantized_linear=False)), loaded=load_model("default"))
    assert engine.runner.cpu_decoder is None
    assert cpu_decoder.unsupported(engine.runner.model) == "a linear layer is not quantized"


def _fp16_bytes(x: float) -> np.ndarray:
    return np.frombuffer(np.array([x], np.float16).tobytes(), np.uint8)


def test_the_calls_greedy_tokens_are_the_first_finite_maximum_as_numpy_finds_it(decoder) -> None:
    """With `argmax`, the call writes each row's greedy token as it writes the logits: the
    first maximum (numpy's argmax, `greedy_ids_cpu`), -1 where that is not finite. Against a
    head whose rows are made to tie (a later row's blocks copied into an earlier tile, into
    the other thread's block and into the last tile), to be NaN, and to be +inf, at batch 1,
    3 and 17, under one thread and two."""
    from ops.sampling import greedy_ids_cpu

    dec, model = decoder
    loaded = load_model("default")
    w = loaded.quantized["embed_tokens"]  # the tied head's blocks, as the file stores them
    assert dec.head is not None and dec.head.out_features == w.shape[0]
    acts = dec.head.activations
    rng = random.Random(11)
    lens = [rng.randint(1, 20) for _ in range(17)]
    reqs = _Requests(model, lens, seed=12)
    dec(*reqs.step([(r, 0, n) for r, n in enumerate(lens)]))
    # a copy: a ctypes struct's field is a view into the struct, which the swaps below overwrite
    keep_model, keep_head = cpu_decoder._QLinear.from_buffer_copy(dec._model.head), dec.head
    threads = torch.get_num_threads()
    try:
        for b in (1, 3, 17):
            step = reqs.step([(r, lens[r], 1) for r in range(b)])
            _, logits = dec.forward(*step, logits=True)
            assert logits is not None
            top = logits.argmax(-1).tolist()
            vocab = w.shape[0]
            # (row, how its GGUF blocks change): ties with the maximum in earlier tiles and
            # in the last, a NaN logit, a +inf one (a scale that is inf times positive sums)
            cases = [("tie early", [(5, top[0])]), ("tie other half", [(vocab // 2 + 7, top[0])]),
                     ("tie last tile", [(vocab - 1, top[0])]), ("tie twice", [(vocab - 40, top[-1]),
                                                                              (33, top[-1])]),
                     ("nan", "nan"), ("inf", "inf"), ("none", [])]
            for name, change in cases:
                blocks = w.blocks.copy()
                if change == "nan":
                    blocks[vocab // 3, 0:2] = _fp16_bytes(float("nan"))
                elif change == "inf":
                    blocks[vocab // 3 + 1, 0:2] = _fp16_bytes(float("inf"))
                else:
                    for dst, src in change:
                        blocks[dst] = blocks[src]
                head = ql.QuantLinear(ql.QuantizedWeight(w.qtype, blocks, w.shape), activations=acts)
                dec._model.head, dec.head = cpu_decoder._qlinear(head), head
                for n in (1, 2):
                    torch.set_num_threads(n)
                    got = torch.full((b,), -7, dtype=torch.int64)
                    _, lg = dec.forward(*step, logits=True, argmax=got)
                    assert lg is not None
                    want = greedy_ids_cpu(lg)
                    rows = [greedy_ids_cpu(lg[r : r + 1]) for r in range(b)]
                    expect = [-1 if ids is None else ids[0] for ids in rows]
                    assert got.tolist() == expect, f"{name}, batch {b}, {n} threads"
                    if want is not None:
                        assert got.tolist() == want
                    if name.startswith("tie") and b == 1:  # the earliest of the equal rows won
                        assert got.tolist() == [min(i for pair in change for i in pair)], name
                    if name == "nan":
                        assert expect == [-1] * b  # every row's first maximum is the NaN
    finally:
        torch.set_num_threads(threads)
        dec._model.head, dec.head = keep_model, keep_head


def _host_arrays(step: tuple) -> tuple:
    """A `_Requests.step` as the runner hands it to `CpuDecoder.decode`: int64 host arrays."""
    ids, pos, meta, kv = step

    def host(x: torch.Tensor) -> np.ndarray:
        return x.long().numpy().copy()

    return (host(ids), host(pos), host(meta.slot_mapping), host(meta.block_tables), host(meta.seq_lens),
            host(meta.query_start_loc), meta.max_query_len, kv)


def test_decode_reuses_its_buffers_and_forward_returns_outputs_of_its_own(decoder) -> None:
    """The runner's `decode` of a step of up to REUSE_ROWS rows returns views of buffers that
    the next call overwrites (no torch op a step); `forward` returns outputs of its own; the
    bits and the greedy tokens are the same. A step of more rows gets buffers of its own."""
    dec, model = decoder
    lens = [9, 14, 3]
    reqs = _Requests(model, lens, seed=21)
    dec(*reqs.step([(r, 0, n) for r, n in enumerate(lens)]))
    one, three = reqs.step([(0, lens[0], 1)]), reqs.step([(r, lens[r], 1) for r in range(3)])
    h1, l1 = dec.forward(*one, logits=True)
    h3, l3 = dec.forward(*three, logits=True)
    assert l1 is not None and l3 is not None
    kept = h3.clone(), l3.clone()
    greedy = np.full(3, -7, dtype=np.int64)
    d3, dl3 = dec.decode(*_host_arrays(three), logits=True, argmax=greedy)
    assert dl3 is not None and torch.equal(d3, h3) and torch.equal(dl3, l3)
    assert greedy.tolist() == l3.argmax(-1).tolist()
    d1, dl1 = dec.decode(*_host_arrays(one), logits=True)
    assert dl1 is not None and torch.equal(d1, h1) and torch.equal(dl1, l1)
    assert d1.data_ptr() == d3.data_ptr() and dl1.data_ptr() == dl3.data_ptr()
    assert torch.equal(d3[0], h1[0]) and torch.equal(dl3[0], l1[0])  # the batch-1 call's rows
    assert torch.equal(h3, kept[0]) and torch.equal(l3, kept[1])  # forward's stayed as they were
    n = cpu_decoder.REUSE_ROWS + 6
    big = _Requests(model, [n], seed=22).step([(0, 0, n)])
    a, _ = dec.decode(*_host_arrays(big))
    b, _ = dec.decode(*_host_arrays(big))
    assert a.data_ptr() != b.data_ptr() and torch.equal(a, b)


class _TorchCalls(torch.overrides.TorchFunctionMode):
    """Records every torch function and tensor method called from Python."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_a_batch_1_greedy_decode_step_makes_no_torch_op() -> None:
    """Between two native calls a batch-1 step's Python runs in caches that the call's weights
    have just swept, where each kind of torch op's first dispatch costs tens of microseconds
    (BENCHMARKS.md, session 26): the runner's plain greedy decode steps make none, and still
    give a token a step. A sampled step's torch ops are the sampler's base draw and reads of
    the logits' shape."""
    from scheduler.request import SamplingParams

    engine = Engine(WorkerConfig(), loaded=load_model("default"))
    assert engine.runner.cpu_decoder is not None
    for params, most in ((SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), 0),
                         (SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True), 16)):
        engine.submit(engine.make_request(list(range(100, 140)), params))
        engine.step()
        engine.step()
        tokens = []
        with _TorchCalls() as seen:
            for _ in range(6):
                tokens += [t for out in engine.step().outputs for t in out.new_token_ids]
        assert len(tokens) == 6
        assert len(seen.calls) <= 6 * most, seen.calls[:20]
        while engine.has_work():
            engine.step()


def test_kernel_pointers_are_the_buffers_own() -> None:
    """`cpu_kernels.address`: where a numpy array's or an array.array's data starts; a
    buffer a kernel could not take as it is (not C-contiguous, read-only) is refused."""
    import array

    from ops import cpu_kernels

    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    assert cpu_kernels.address(a) == a.ctypes.data and cpu_kernels.address(a[1:]) == a[1:].ctypes.data
    f = array.array("f", [1.0, 2.0])
    assert cpu_kernels.address(f) == f.buffer_info()[0]
    frozen = np.arange(3)
    frozen.flags.writeable = False
    for bad in (a[:, ::2], a.T, frozen):
        with pytest.raises(TypeError):
            cpu_kernels.address(bad)
