"""Tensor parallelism without processes: the shard plan's arithmetic and refusals, the
sliced model against the whole one (the ranks simulated in one process), and the binary
step messages. The multi-process tests are tests/test_tp_served.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_no_pickle import violations
from tests.tp_helpers import Ranks, run_ranks
from worker.models.llama import LlamaConfig, LlamaForCausalLM
from worker.parallel import messages
from worker.parallel.shard import ShardPlan, shard_model
from worker.weights import dummy


def _cfg(heads: int = 4, kv: int = 2, inter: int = 96) -> LlamaConfig:
    return LlamaConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64,
                       intermediate_size=inter, num_layers=2, num_heads=heads, num_kv_heads=kv,
                       head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=128, tie_word_embeddings=False,
                       attention_bias=True)


def test_a_split_that_does_not_divide_the_heads_names_them(default_model) -> None:
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2: the model's 9 attention "
                                         r"heads do not split over 2 ranks \(sizes that divide "
                                         r"them: 1, 3, 9\)"):
        ShardPlan.of(default_model.config, 2)
    plan = ShardPlan.of(default_model.config, 3)  # 9 heads, 3 KV heads: one KV head a rank
    assert [plan.kv_heads(r) for r in range(3)] == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError, match="3 ranks cannot share the model's 2 KV heads"):
        ShardPlan.of(_cfg(heads=6, kv=2), 3)
    with pytest.raises(ValueError, match="intermediate size 90 does not split over 4"):
        ShardPlan.of(_cfg(inter=90), 4)


@pytest.mark.parametrize(("kv", "world", "expected"), [
    (1, 2, [0, 0]), (2, 4, [0, 0, 1, 1]), (2, 2, [0, 1]), (4, 2, [0, 2])])
def test_kv_heads_are_the_ones_each_ranks_query_heads_read(kv, world, expected) -> None:
    plan = ShardPlan.of(_cfg(heads=4, kv=kv), world)
    group = 4 // kv
    for rank in range(world):
        kv_heads = plan.kv_heads(rank)
        assert kv_heads.start == expected[rank]
        # every query head of the rank reads a KV head the rank holds
        assert all(q // group in kv_heads for q in plan.q_heads(rank))
        assert len(kv_heads) == plan.kv_heads_per_rank == max(1, kv // world)


@pytest.mark.parametrize(("kv", "world"), [(1, 2), (2, 4), (2, 2)])
def test_the_shards_sum_to_the_whole_model(kv: int, world: int) -> None:
    from tests.helpers import last_logits

    torch.manual_seed(0)
    cfg = _cfg(heads=4, kv=kv)
    whole = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    dummy.init_dummy(whole)
    ids = [3, 9, 27, 17, 5, 40, 2]
    ref = last_logits(whole, ids)
    ranks = Ranks(world)
    hidden: list[torch.Tensor | None] = [None] * world
    state = whole.state_dict()

    def run(rank: int) -> None:
        ranks.local.rank = rank
        model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
        model.load_state_dict(state, strict=False)
        model.lm_head.weight.copy_(whole.lm_head.weight)
        shard_model(model, ShardPlan.of(cfg, world), rank, ranks.reduce, ranks.gather)
        assert model.config.num_kv_heads == max(1, kv // world)
        # every rank: the same forward with its own KV heads, and its slice of the logits
        # (gathered to rank 0; a follower's call returns its own slice)
        logits = last_logits(model, ids)
        if rank == 0:
            hidden[0] = logits

    run_ranks(ranks, world, run)
    assert hidden[0] is not None
    torch.testing.assert_close(hidden[0], ref, atol=1e-5, rtol=1e-5)


def _random_adapter(cfg: LlamaConfig, rank: int = 4):
    from worker.lora.adapter import TARGETS, AdapterConfig, LoraAdapter, module_shapes

    g = torch.Generator().manual_seed(1)
    weights = {(layer, p): (torch.randn(rank, n_in, generator=g) / n_in ** 0.5,
                            0.5 * torch.randn(n_out, rank, generator=g))
               for layer in range(cfg.num_layers) for p, (n_in, n_out) in module_shapes(cfg).items()}
    return LoraAdapter("a", "-", AdapterConfig(rank, 2.0 * rank, False, TARGETS), weights)


@torch.inference_mode()
def _adapted_logits(model: LlamaForCausalLM, slots, ids: list[int]) -> torch.Tensor:
    """`last_logits` with every token on LoRA slot 0, through the model's own cache layout."""
    from worker.models.llama import AttentionMetadata

    cfg, n = model.config, len(ids)
    kv = [(torch.zeros(1, 16, cfg.num_kv_heads, cfg.head_dim), torch.zeros(1, 16, cfg.num_kv_heads, cfg.head_dim))
          for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(slot_mapping=torch.arange(n), block_tables=torch.zeros(1, 1, dtype=torch.int32),
                             seq_lens=torch.tensor([n]), query_start_loc=torch.tensor([0, n]),
                             max_query_len=n, max_seq_len=n, lora=slots.step([0] * n))
    hidden = model(torch.tensor(ids), torch.arange(n), meta, kv)
    return model.compute_logits(hidden[-1:])[0] if model.lm_head is not None else hidden


@pytest.mark.parametrize(("kv", "world"), [(1, 2), (2, 2)])
def test_a_lora_adapters_shards_sum_to_the_whole_adapted_model(kv: int, world: int) -> None:
    """Each rank's slots get the adapter through a LORA message (worker/parallel/lora.py)
    and keep their share (ShardPlan.lora_slicer): B's rows under q/k/v and gate/up, A's
    columns under o and down (their deltas summed by the all-reduce)."""
    from worker.lora.slots import LoraSlots
    from worker.parallel import lora as tp_lora

    torch.manual_seed(0)
    cfg = _cfg(heads=4, kv=kv)
    whole = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    dummy.init_dummy(whole)
    adapter = _random_adapter(cfg)
    ids = [3, 9, 27, 17, 5, 40, 2]
    full = LoraSlots(cfg, 2, 8, torch.device("cpu"), torch.float32)
    assert full.assign([adapter]) == {adapter.uid: 0}
    ref = _adapted_logits(whole, full, ids)
    assert (ref - _adapted_logits(whole, LoraSlots(cfg, 2, 8, torch.device("cpu"), torch.float32),
                                  ids)).abs().max() > 0.1, "the adapter was meant to change the logits"
    head, payload = tp_lora.pack(0, adapter)
    assert payload.dtype == np.float32 and messages.payload_len(head) == len(payload)
    with pytest.raises(ValueError, match=r"carries \d+ floats; this model needs"):  # a follower exits on it
        tp_lora.unpack(head, payload[:-1], cfg)
    ranks, out = Ranks(world), [None] * world
    state = whole.state_dict()
    plan = ShardPlan.of(cfg, world)

    def run(rank: int) -> None:
        ranks.local.rank = rank
        model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
        model.load_state_dict(state)
        shard_model(model, plan, rank, ranks.reduce, ranks.gather)
        slots = LoraSlots(model.config, 2, 8, torch.device("cpu"), torch.float32, plan.lora_slicer(rank))
        slots.write(*tp_lora.unpack(head, payload, cfg))
        out[rank] = _adapted_logits(model, slots, ids)

    run_ranks(ranks, world, run)
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)


def test_step_messages_round_trip_and_refuse_bad_headers() -> None:
    a = messages.ForwardArrays(
        np.array([5, 6, 7], np.int64), np.array([0, 1, 9], np.int64), np.array([32, 33, 41], np.int64),
        np.array([[2, 0], [2, 3]], np.int32), np.array([2, 10], np.int64), np.array([0, 2, 3], np.int64),
        2, 10)
    head, payload = messages.pack_forward(a)
    assert payload.dtype == np.int64 and messages.payload_len(head) == len(payload)
    b = messages.unpack_forward(head, payload)
    for f in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    assert (b.max_query_len, b.max_seq_len) == (2, 10) and b.block_tables.dtype == np.int32
    m = messages.Moves([(1, 2)], [(3, 4), (5, 6)], [(7, 8)])
    head, payload = messages.pack_moves(m)
    assert messages.unpack_moves(head, payload) == m
    a.lora_slots = np.array([-1, 0, 0], np.int64)
    head, payload = messages.pack_forward(a)
    assert messages.payload_len(head) == len(payload) == 21  # 18 + a slot a token
    np.testing.assert_array_equal(messages.unpack_forward(head, payload).lora_slots, a.lora_slots)
    with pytest.raises(ValueError, match="unknown kind 9"):
        messages.payload_len(messages.header(9))
    with pytest.raises(ValueError, match="out of bounds"):
        messages.payload_len(messages.header(messages.FORWARD, 1 << 40, 1, 1))


OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object",
                      "scatter_object_list", "send_object_list", "recv_object_list")


def test_the_group_sends_tensors_only_never_objects() -> None:
    """torch.distributed's *_object collectives pickle: none is named anywhere in the
    package, and the step crosses as int64 tensors (messages.py)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "worker" / "parallel"
    files = sorted(root.glob("*.py"))
    assert len(files) >= 5
    for f in files:
        text = f.read_text("utf-8")
        assert not violations(text), f
        assert not [n for n in OBJECT_COLLECTIVES if n in text], f


def test_the_planner_names_the_smallest_size_that_fits(capsys) -> None:
    import math
    import re

    from worker import plan
    from worker.cli import main

    assert main(["plan", "--model", "dummy:llama-3-70b", "--device", "h100"]) == 2
    err = capsys.readouterr().err
    assert "does not fit at --tensor-parallel-size 1 on h100" in err, err
    k = int(re.search(r"smallest --tensor-parallel-size that fits: (\d+)", err).group(1))
    model = plan.read_model("dummy:llama-3-70b")
    dev = plan.DEVICES["h100"]
    cache, sched = plan.CacheConfig(), plan.SchedulerConfig()
    tried, found = plan.smallest_fit(model, dev, "bfloat16", 8192, cache, sched)
    assert found is not None and found.tp == k > 1
    assert all(f.why is not None for f in tried[:-1])  # every smaller size was tried and fails
    # per-rank figures: rank 0 holds the replicated parts, 1/k of the layers' linears and
    # its ceil(V / k) rows (whole tiles of 32) of the untied embedding and head
    whole = plan.weights(model, dev, "bfloat16")
    rows = math.ceil(math.ceil(128256 / k) / 32) * 32
    vocab_cut = whole.vocab_bytes - whole.vocab_bytes // 128256 * rows
    assert whole.vocab_bytes == 2 * 128256 * 8192 * 2
    assert found.held == sum(whole.held.values()) - whole.layer_linear_bytes * (k - 1) // k - vocab_cut
    assert f"{found.budget.num_blocks} blocks" in err
    assert main(["plan", "--model", "dummy:llama-3-70b", "--device", "h100", "-tp", str(k)]) == 0
    out = capsys.readouterr().out
    assert (f"-tp {k}: 16 heads / 2 KV heads, {rows} vocab rows a rank; 161 all-reduces and a "
            "gather of logits a step") in out, out
    assert re.search(r"decode    batch 1: step .*all-reduce [0-9.]+ ms", out), out


def test_the_engine_refuses_tp2_on_the_default_model_naming_its_9_heads(default_model) -> None:
    from worker.config import ParallelConfig, WorkerConfig
    from worker.engine import Engine

    # The session's load may already be taken by an earlier test's engine: unchanged is the claim.
    linears, taken = default_model.linears, default_model.taken
    with pytest.raises(ValueError, match="--tensor-parallel-size 2: the model's 9 attention heads"):
        Engine(WorkerConfig(parallel=ParallelConfig(tensor_parallel_size=2)), loaded=default_model)
    assert default_model.linears == linears and default_model.taken == taken  # refused before a reload
