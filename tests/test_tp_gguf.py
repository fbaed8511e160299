"""GGUF files under tensor parallelism, without processes: each rank loads only its slices,
cut on the file's blocks (worker/parallel/gguf_split.py) and held as the CPU kernels'
records as at TP = 1; the ranks (threads, summed at a barrier) against the whole file's
model; a split that does not fall on whole blocks refused by its numbers. The served
cases are tests/test_tp_served.py."""

from __future__ import annotations

import pytest
import torch

from ops import quantized_linear
from ops.quantized_linear import QuantEmbedding, QuantLinear
from ops.stacked_linear import StackedLinear
from tests.gguf_tiny import write_tiny_llama
from tests.helpers import last_logits
from tests.tp_helpers import Ranks, run_ranks
from worker.parallel.shard import RowParallel, ShardPlan, shard_model
from worker.weights import ModelLoadError, load_model

pytestmark = pytest.mark.skipif(not quantized_linear.available(), reason="the C kernels need gcc and AVX2")

# Q4_K layers with a Q6_K attn_v, ffn_down and (tied) embedding: a Q4_K_M-like mix.
KQUANT_TYPES = {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}
IDS = [3, 9, 27, 17, 5, 40, 2, 101, 7]


def _linears(model: torch.nn.Module) -> list[QuantLinear]:
    return [m for m in model.layers.modules() if isinstance(m, QuantLinear)]


def _by_name(model: torch.nn.Module) -> dict[str, QuantLinear]:
    """The layers' QuantLinears by name, a row-parallel wrapper's under the wrapped name."""
    return {name.removesuffix(".inner"): m for name, m in model.layers.named_modules()
            if isinstance(m, QuantLinear)}


def _load(path, activations: str, split=None, quantized: bool = True):
    return load_model(str(path), "cpu", torch.float32, quantized, activations, split)


def _sharded_logits(loads, ids: list[int]) -> torch.Tensor:
    """Each load (rank r's slices, in rank order) made its rank's shard and run as a thread,
    summed at a barrier; rank 0's last logits."""
    world = len(loads)
    plan, ranks, out = ShardPlan.of(loads[0].config, world), Ranks(world), [None] * world

    def run(rank: int) -> None:
        ranks.local.rank = rank
        model = loads[rank].model
        shard_model(model, plan, rank, ranks.reduce, ranks.gather, sliced=True)
        out[rank] = last_logits(model, ids)  # each its slice of the logits, gathered to rank 0

    run_ranks(ranks, world, run)
    return out[0]


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """The sum over the ranks is the whole product in another order of float32 additions
    (each kernel's integer activations are per block of 32, the same in a slice): a few
    units in the 5th digit of logits near 100 (int16's own distance from float32's: ~1e-4)."""
    torch.testing.assert_close(got, ref, atol=1e-4 * float(ref.abs().max()), rtol=0)


@pytest.mark.parametrize("activations", ["float32", "auto"])
def test_a_k_quant_files_rank_slices_stay_quantized_and_sum_to_the_whole(tmp_path, activations) -> None:
    """hidden 512 (16 heads of 32, 1 KV head, intermediate 1024) at -tp 2: o_proj's 256
    columns a rank are one Q4_K block of 256, down_proj's 512 two Q6_K blocks."""
    path = write_tiny_llama(tmp_path / "k.gguf", "Q4_K", hidden=512, layers=2, types=KQUANT_TYPES)
    whole = _load(path, activations)
    ref = last_logits(whole.model, IDS)
    theirs = _by_name(whole.model)
    whole_bytes = sum(m.packed.nbytes for m in theirs.values())
    world = 2
    loads = [_load(path, activations, (world, r)) for r in range(world)]
    _close(_sharded_logits(loads, IDS), ref)
    for rank, loaded in enumerate(loads):
        layer = loaded.model.layers[0]
        qkv, o, down = layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj
        assert isinstance(qkv, StackedLinear)  # Q4_K q and k rows, Q6_K v rows
        assert [(p.qtype, p.out_features) for p in qkv.parts] == [("Q4_K", 8 * 32 + 32), ("Q6_K", 32)]
        assert isinstance(o, RowParallel) and isinstance(o.inner, QuantLinear)
        assert (o.inner.qtype, o.inner.in_features, o.inner.out_features) == ("Q4_K", 256, 512)
        assert (down.inner.qtype, down.inner.in_features) == ("Q6_K", 512)
        assert isinstance(layer.mlp.gate_up_proj, QuantLinear) and layer.mlp.gate_up_proj.out_features == 1024
        # the tied Q6_K table's rows of the rank: ceil(288 / 2) = 144, in whole tiles 160
        # (rank 1's last 16 zero), one copy for the lookup and the head
        embed, head = loaded.model.embed_tokens, loaded.model.lm_head
        assert isinstance(embed.inner, QuantEmbedding) and embed.inner.num_embeddings == 160
        assert isinstance(head.inner, QuantLinear) and head.inner.packed is embed.inner.packed
        # a rank's records are its share of the whole's: half of every linear, but k and v
        # (one KV head, replicated) whole
        mine = _by_name(loaded.model)
        assert mine.keys() == theirs.keys()
        for name, m in mine.items():
            w = theirs[name]
            assert m.packed.nbytes * w.out_features * w.in_features == (
                w.packed.nbytes * m.out_features * m.in_features), name
        held = sum(m.packed.nbytes for m in mine.values())
        assert whole_bytes / 2 < held < 0.6 * whole_bytes
        assert "Q4_K records" in loaded.describe_weights()
        assert loaded.split == (world, rank)


def test_a_split_off_the_blocks_is_refused_by_its_numbers(tmp_path) -> None:
    """hidden 256 (8 heads of 32, 1 KV head) at -tp 2: o_proj's 128 columns a rank are half
    a Q4_K block. Dequantized (--no-cpu-quantized-linear) the same split loads, sliced anywhere."""
    path = write_tiny_llama(tmp_path / "k.gguf", "Q4_K", hidden=256, layers=1, types=KQUANT_TYPES)
    with pytest.raises(ModelLoadError, match=r"--tensor-parallel-size 2: layer 0 o_proj: 128 columns a "
                                             r"rank is not a whole number of Q4_K blocks of 256; sizes "
                                             r"that work: 1 \(or --no-cpu-quantized-linear"):
        _load(path, "float32", (2, 0))
    from tests.test_plan import CPU
    from worker import plan

    info = plan.read_model(str(path))  # the planner refuses it as the worker does
    with pytest.raises(ValueError, match=r"layer 0 o_proj: 128 columns a rank is not a whole number"):
        plan.fit_at(info, CPU, "float32", 2, 128, plan.CacheConfig(), plan.SchedulerConfig())
    assert plan.fit_at(info, CPU, "bfloat16", 2, 128, plan.CacheConfig(), plan.SchedulerConfig()).tp == 2
    floats = [_load(path, "float32", (2, r), quantized=False) for r in range(2)]
    assert floats[1].model.layers[0].self_attn.o_proj.weight.shape == (256, 128)
    assert not _linears(floats[1].model)
    whole = _load(path, "float32", quantized=False)  # the float slices (q/k unpermuted by head) sum up too
    _close(_sharded_logits(floats, IDS), last_logits(whole.model, IDS))


def test_the_default_models_rank_holds_its_q4_1_slices_as_the_planner_says() -> None:
    """The default model (9 heads, 3 KV heads, hidden 576, intermediate 1536) at -tp 3: a
    rank's o_proj is 192 columns, down_proj 512, whole Q4_1 blocks of 32. Rank 0 holds what
    the planner's per-rank figure says (its layers' third, and a third of the tied Q8_0
    table, 16384 of 49152 rows, which is also its head)."""
    from tests.test_plan import CPU, _held_bytes
    from worker import plan

    loaded = load_model("default", "cpu", torch.float32, True, "auto", (3, 0))
    layer = loaded.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, QuantLinear) and layer.self_attn.o_proj.qtype == "Q4_1"
    assert layer.self_attn.o_proj.in_features == 192 and layer.mlp.down_proj.in_features == 512
    assert loaded.model.config.num_heads == 3 and loaded.config.num_heads == 9
    embed = loaded.model.embed_tokens
    assert isinstance(embed, QuantEmbedding) and embed.num_embeddings == 16384 == 49152 // 3
    assert embed.packed is loaded.model.tied_head.packed
    fit = plan.fit_at(plan.read_model("default"), CPU, "float32", 3, 512, plan.CacheConfig(kv_cache_memory_bytes=1 << 24),
                      plan.SchedulerConfig())
    assert fit.held == _held_bytes(loaded.model)


@pytest.mark.parametrize("name", ["phi3", "gemma3"])
def test_a_familys_q8_0_file_at_tp2_sums_to_the_whole(name) -> None:
    """llama.cpp's converter's --outtype q8_0 files of tiny Phi-3 (one attn_qkv tensor and
    one gate+up ffn_up: a rank's rows are three and two spans of one tensor) and Gemma 3 (its
    q/k norms, the scaled embedding, the tied Q8_0 head) at -tp 2 (2 heads, 1 KV head:
    replicated), each rank on its Q8_0 records, against TP = 1 on the same file."""
    from benchmarks import make_gguf_models as made
    from tests.test_gguf_families import _folder

    tools = made.find_converter()
    if tools is None:
        pytest.skip("convert_hf_to_gguf.py not found (benchmarks/make_gguf_models.py: find_converter)")
    path = made.converted(tools, _folder(name), f"{name}-tiny", "q8_0")
    whole = _load(path, "float32")
    ids = IDS[:6]
    ref = last_logits(whole.model, ids)
    loads = [_load(path, "float32", (2, r)) for r in range(2)]
    _close(_sharded_logits(loads, ids), ref)
    layer = loads[1].model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear) and layer.self_attn.qkv_proj.out_features == 3 * 32
    assert layer.self_attn.o_proj.inner.in_features == 32 and layer.mlp.down_proj.inner.in_features == 64
    assert layer.mlp.gate_up_proj.out_features == 128


def test_an_untied_heads_rows_and_the_tables_stay_on_their_blocks(tmp_path) -> None:
    """A GGUF with its own output.weight (Q8_0) beside a Q4_0 token_embd, vocabulary 288 at
    -tp 2: each rank holds 160 rows of each on their blocks (144 of the file's, rank 1's last
    16 zero blocks), and the gathered logits are TP = 1's."""
    import gguf
    import numpy as np

    def output(w: gguf.GGUFWriter) -> None:
        values = (np.random.default_rng(7).standard_normal((288, 64)) * 0.05).astype(np.float32)
        data = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor("output.weight", data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    path = write_tiny_llama(tmp_path / "untied.gguf", "Q4_0", more=output)
    whole = _load(path, "float32")
    assert not whole.config.tie_word_embeddings and isinstance(whole.model.lm_head, QuantLinear)
    loads = [_load(path, "float32", (2, r)) for r in range(2)]
    _close(_sharded_logits(loads, IDS), last_logits(whole.model, IDS))
    for loaded in loads:
        embed, head = loaded.model.embed_tokens.inner, loaded.model.lm_head.inner
        assert isinstance(embed, QuantEmbedding) and (embed.qtype, embed.num_embeddings) == ("Q4_0", 160)
        assert isinstance(head, QuantLinear) and (head.qtype, head.out_features) == ("Q8_0", 160)
        assert head.packed.nbytes * 288 == whole.model.lm_head.packed.nbytes * 160
