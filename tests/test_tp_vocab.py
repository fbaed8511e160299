"""The vocab-parallel embedding and LM head (worker/parallel/vocab.py) without processes: the
ranks as threads (tests/tp_helpers.Ranks: the all-reduce a sum at a barrier, the gather
rank 0's list), each holding ceil(V / k) rows in whole tiles of 32, against TP = 1 in
float32, for tied and untied heads, vocabularies that leave a rank padding or no rows at
all, and Gemma's embedding scale and final soft-cap; and the logits passes of the step
message. The served cases are tests/test_tp_served.py, the GGUF ones tests/test_tp_gguf.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.tp_helpers import Ranks, run_ranks
from worker.models.llama import AttentionMetadata, LlamaConfig, LlamaForCausalLM
from worker.parallel import messages
from worker.parallel.shard import ShardPlan, shard_model
from worker.parallel.vocab import VocabParallelEmbedding, VocabParallelHead
from worker.weights import dummy

IDS = [3, 9, 27, 17, 5, 39, 2, 11, 30]  # every id < 40


def _cfg(vocab: int, tied: bool) -> LlamaConfig:
    return LlamaConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=96,
                       intermediate_size=96, num_layers=2, num_heads=6, num_kv_heads=1,
                       head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=128, tie_word_embeddings=tied)


@torch.inference_mode()
def _logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """Every position's logits, from one prompt pass through a private paged cache (one head
    call of len(ids) rows: the gather carries more than one row)."""
    cfg, n = model.config, len(ids)
    kv = [(torch.zeros(1, 16, cfg.num_kv_heads, cfg.head_dim), torch.zeros(1, 16, cfg.num_kv_heads, cfg.head_dim))
          for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(slot_mapping=torch.arange(n), block_tables=torch.zeros(1, 1, dtype=torch.int32),
                             seq_lens=torch.tensor([n]), query_start_loc=torch.tensor([0, n]),
                             max_query_len=n, max_seq_len=n)
    return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta, kv))


def _held(*tensors: torch.Tensor) -> int:
    """Bytes of the distinct storages among `tensors`."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _sharded(make, world: int, ids: list[int]):
    """`make()` (a fresh whole model, the same each call) made rank r's shard on each of
    `world` threads; (rank 0's logits, every rank's logits as its head returned them, the
    shards)."""
    ranks = Ranks(world)
    out: list = [None] * world
    models: list = [None] * world

    def run(rank: int) -> None:
        ranks.local.rank = rank
        model = make()
        shard_model(model, ShardPlan.of(model.config, world), rank, ranks.reduce, ranks.gather)
        models[rank] = model
        out[rank] = _logits(model, ids)

    plan = ShardPlan.of(make().config, world)
    run_ranks(ranks, world, run)
    assert ranks.num_gathers == 1  # one head call: one gather
    return out[0], out, models, plan


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize(("tied", "vocab", "world"), [
    (True, 200, 3),  # 96 rows a rank: rank 2 holds 192-199 and 88 zero rows
    (False, 200, 3),
    (True, 200, 2),  # 128 rows a rank: rank 1 holds 128-199 and 56 zero rows
    (False, 40, 3),  # 32 rows a rank: rank 1 holds 32-39, rank 2 none (all padding)
])
def test_vocab_parallel_logits_equal_tp1_and_a_rank_holds_its_rows(tied: bool, vocab: int, world: int) -> None:
    torch.manual_seed(0)
    cfg = _cfg(vocab, tied)
    whole = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    dummy.init_dummy(whole)
    state = whole.state_dict()
    ref = _logits(whole, IDS)

    def make() -> LlamaForCausalLM:
        m = LlamaForCausalLM(cfg).eval().requires_grad_(False)
        m.load_state_dict(state)
        return m

    got, each, models, plan = _sharded(make, world, IDS)
    assert got.shape == ref.shape == (len(IDS), vocab)
    _close(got, ref)
    table, head = whole.embed_tokens.weight, whole.lm_head.weight if not tied else whole.embed_tokens.weight
    whole_bytes = _held(table, head)
    for rank, model in enumerate(models):
        vocab_rows = plan.vocab(rank)
        n, rows = vocab_rows.rows_per_rank, vocab_rows.rows
        assert n % 32 == 0 and n * world >= vocab and (n - 32) * world < vocab
        embed, lm = model.embed_tokens, model.lm_head
        assert isinstance(embed, VocabParallelEmbedding) and isinstance(lm, VocabParallelHead)
        mine, my_head = embed.inner.weight, lm.inner.weight
        assert mine.shape == my_head.shape == (n, cfg.hidden_size)
        torch.testing.assert_close(mine[: len(rows)], table[rows.start : rows.stop], rtol=0, atol=0)
        torch.testing.assert_close(my_head[: len(rows)], head[rows.start : rows.stop], rtol=0, atol=0)
        assert not mine[len(rows):].any() and not my_head[len(rows):].any()  # the padding is zero
        if tied:
            assert my_head is mine  # one copy for the lookup and the head
        # what the rank holds of them: its rows, whole tiles, not the vocabulary
        assert _held(mine, my_head) == whole_bytes * n // vocab
        if rank:  # a follower's call gives its own slice back (rank 0 gathered them)
            assert each[rank].shape == (len(IDS), n)
            torch.testing.assert_close(each[rank][:, : len(rows)], got[:, rows.start : rows.stop])


def test_gemmas_embedding_scale_and_soft_cap_apply_as_at_tp1(tmp_path) -> None:
    """Gemma 2 with a final soft-cap of 0.5 (it bites on random weights) and its embedding
    times sqrt(hidden), a tied vocabulary of 200 at -tp 2 (rank 1: 72 rows and 56 zero)."""
    from transformers import Gemma2Config

    from tests.helpers import save_tiny_checkpoint
    from tests.test_gemma import SHAPE
    from worker.weights import load_model

    save_tiny_checkpoint(Gemma2Config(**{**SHAPE, "vocab_size": 200}, attn_logit_softcapping=2.0,
                                      final_logit_softcapping=0.5), tmp_path)
    whole = load_model(str(tmp_path), "cpu", torch.float32).model
    ref = _logits(whole, IDS)
    assert float(ref.abs().max()) <= 0.5  # capped
    got, _, models, _ = _sharded(lambda: load_model(str(tmp_path), "cpu", torch.float32).model, 2, IDS)
    _close(got, ref)
    assert models[1].embed_tokens.inner.weight.shape == (128, 64)


def test_the_step_message_carries_the_logits_passes() -> None:
    a = messages.ForwardArrays(
        np.array([5, 6, 7], np.int64), np.array([0, 1, 2], np.int64), np.array([32, 33, 34], np.int64),
        np.array([[2]], np.int32), np.array([3], np.int64), np.array([0, 3], np.int64), 3, 3)
    head, payload = messages.pack_forward(a)  # a step that samples nothing: no pass, no gather
    assert messages.unpack_forward(head, payload).logits == []
    a.logits = [np.array([0, 1], np.int64), np.array([2, 2], np.int64)]  # prompt logprobs, then a fork's row twice
    head, payload = messages.pack_forward(a)
    assert messages.payload_len(head) == len(payload) == 13 + 2 + 4
    got = messages.unpack_forward(head, payload).logits
    assert [p.tolist() for p in got] == [[0, 1], [2, 2]]
    bad = payload.copy()
    bad[-1] = 3  # a row past the step's 3 tokens
    with pytest.raises(ValueError, match="logits passes are out of bounds"):
        messages.unpack_forward(head, bad)


class _Recorder:
    """A step hook (ModelRunner.step_hook, as leader.TensorParallel) that keeps each step's
    logits passes, as a follower would receive them."""

    def __init__(self) -> None:
        self.steps: list[list[list[int]]] = []

    def moves(self, *_) -> None:
        pass

    def forward(self, input_ids, positions, slot_mapping, block_tables, seq_lens, query_start_loc,
                max_query_len, max_seq_len, lora_slots=None, logits=()) -> None:
        self.steps.append([list(p) for p in logits])


def test_the_runner_sends_exactly_the_head_calls_it_makes(tmp_path, monkeypatch) -> None:
    """A follower makes the calls of the head that the step message names, rank 0 the ones
    its runner makes: they must be the same calls of the same rows, in the same order, or
    the gathers do not pair up. A 300-token prompt with prompt logprobs in chunks of 128
    (passes of 50 rows, the last chunk's beside the sampled row's), then decodes (one
    row each), after a prompt whose first chunks sample nothing and want no logprobs (no
    pass)."""
    from scheduler.request import SamplingParams
    from tests.tp_helpers import tiny_checkpoint
    from worker import prompt_logprobs
    from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
    from worker.engine import Engine

    monkeypatch.setattr(prompt_logprobs, "ROWS_PER_PASS", 50)  # several passes a chunk
    engine = Engine(WorkerConfig(model=ModelConfig(model=tiny_checkpoint(tmp_path, kv_heads=2), max_model_len=512),
                                 cache=CacheConfig(kv_cache_memory=0.05),
                                 scheduler=SchedulerConfig(max_num_batched_tokens=128)))
    runner, model = engine.runner, engine.runner.model
    hook = runner.step_hook = _Recorder()
    calls: list[list[torch.Tensor]] = []
    hidden: list[torch.Tensor] = []
    forward, head = model.forward, model.compute_logits
    model.forward = lambda *a: hidden.append(forward(*a)) or hidden[-1]
    model.compute_logits = lambda h: calls[-1].append(h) or head(h)
    runner_forward = runner._forward

    def step_forward(*a, **k):
        calls.append([])
        return runner_forward(*a, **k)

    runner._forward = step_forward
    prompt = [(7 * i) % 250 + 3 for i in range(300)]
    engine.submit(engine.make_request(prompt[::-1], SamplingParams(temperature=0, max_tokens=2)))
    engine.submit(engine.make_request(prompt, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2)))
    while engine.has_work():
        engine.step()
    assert len(hook.steps) == len(calls) == len(hidden) > 4
    for passes, made, h in zip(hook.steps, calls, hidden, strict=True):
        assert len(passes) == len(made)
        for rows, got in zip(passes, made, strict=True):  # a follower's call: the same rows of its hidden
            torch.testing.assert_close(h.index_select(0, torch.tensor(rows)), got, rtol=0, atol=0)
    assert [] in hook.steps  # a step with no logits: no pass, so no gather on any rank
    # a chunk's prompt logprobs in passes of 50 rows, and the sampled rows' pass after them
    assert max(map(len, hook.steps)) >= 3 and any(len(r) == 50 for p in hook.steps for r in p)
