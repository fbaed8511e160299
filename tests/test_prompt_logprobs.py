"""Prompt logprobs (worker/prompt_logprobs.py): each prompt token's logprob and its top-k,
computed from the logits of the prefill chunks (never a whole prompt's logits at once),
against transformers' log-softmax of the same GGUF in float32 (within 1e-4); the prefix
cache skipped for such requests; both gRPC protocols.

The engine runs the model as transformers does (float32 weights dequantized at load, the
torch kernels): the quantized linears compute on other arithmetic, so their logprobs are
compared only against that same engine."""

from __future__ import annotations

import pytest
import torch

import ops
from scheduler.request import SamplingParams
from worker import prompt_logprobs

TOL = 1e-4
PROMPT = ("The three primary colors are red, yellow and blue. Mixing two of them gives a "
          "secondary color: red and yellow make orange, and red and blue make purple, while "
          "yellow and blue make green. Painters have known this for centuries, and children "
          "learn it in school with a box of crayons.")
REFERENCE_FLAGS = ("--no-cpu-quantized-linear", "--no-cpu-packed-linear", "--kernels", "torch")


@pytest.fixture(scope="module")
def float_model():
    """A load of its own: an engine with quantized linears rewrites a shared model in place."""
    from worker.weights import load_model

    return load_model("default")


def _engine(loaded, *, budget: int, prefix_caching: bool = True):
    from worker.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
    from worker.engine import Engine

    conf = WorkerConfig(
        model=ModelConfig(max_model_len=1024, kernels="torch", cpu_quantized_linear=False,
                          cpu_packed_linear=False),
        cache=CacheConfig(kv_cache_memory=0.0625, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget))
    return Engine(conf, loaded=loaded)


@pytest.fixture(scope="module")
def prompt_ids(float_model) -> list[int]:
    return float_model.tokenizer.encode(PROMPT)


@pytest.fixture(scope="module")
def reference(hf_model, prompt_ids) -> torch.Tensor:
    """transformers' log-softmax at every prompt position, float32."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_against(reference: torch.Tensor, ids: list[int], got: list, k: int,
                  tol: float = TOL) -> None:
    """`got[i]` is prompt token i + 1's: its logprob and top k as transformers has them."""
    assert len(got) == len(ids) - 1
    for i, p in enumerate(got):
        row = reference[i]
        assert p.token_id == ids[i + 1]
        assert abs(p.logprob - row[ids[i + 1]].item()) < tol, f"token {i + 1}"
        assert len(p.top_logprobs) == k
        ref_top = row.topk(k)
        for j, (t, lp) in enumerate(p.top_logprobs):
            assert abs(lp - ref_top.values[j].item()) < tol, f"token {i + 1}, top {j}"
            # The same token, or one tied with it within the tolerance.
            assert abs(row[t].item() - ref_top.values[j].item()) < tol, f"token {i + 1}, top {j}"


def test_matches_transformers_over_chunks_and_a_batch(float_model, prompt_ids, reference,
                                                      monkeypatch) -> None:
    """A 16-token budget chunks the prompt over several steps, beside another request's
    decodes; logits are taken a few rows at a time (never more than ROWS_PER_PASS)."""
    monkeypatch.setattr(prompt_logprobs, "ROWS_PER_PASS", 5)
    engine = _engine(float_model, budget=16)
    widest = []
    compute_logits = engine.runner.model.compute_logits

    def spy(hidden):
        widest.append(hidden.shape[0])
        return compute_logits(hidden)

    monkeypatch.setattr(engine.runner.model, "compute_logits", spy)
    other = engine.make_request(prompt_ids[:7], SamplingParams(temperature=0.0, max_tokens=30))
    req = engine.make_request(prompt_ids, SamplingParams(temperature=0.0, max_tokens=3,
                                                         prompt_logprobs=5))
    outs = engine.generate([other, req])
    assert outs[0].prompt_logprobs is None
    check_against(reference, prompt_ids, outs[1].prompt_logprobs, 5)
    assert max(widest) <= 5
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_prefix_cache_is_skipped_and_recompute_takes_nothing_twice(float_model, prompt_ids,
                                                                  reference) -> None:
    engine = _engine(float_model, budget=64)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    engine.generate([engine.make_request(prompt_ids, plain)])  # cached now
    [with_lp] = engine.generate([engine.make_request(
        prompt_ids, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))])
    assert with_lp.cached_tokens == 0
    check_against(reference, prompt_ids, with_lp.prompt_logprobs, 0)
    [again] = engine.generate([engine.make_request(prompt_ids, plain)])
    assert again.cached_tokens > 0  # the cache was there to skip
    # Preempted (recompute) half-way through its prompt: each token's logprob once.
    engine = _engine(float_model, budget=16)
    req = engine.make_request(prompt_ids, SamplingParams(temperature=0.0, max_tokens=2,
                                                         prompt_logprobs=2))
    engine.submit(req)
    engine.step()
    assert 0 < len(req.prompt_logprobs) < len(prompt_ids) - 1
    engine.scheduler.reset_prefix_cache(requeue=True)
    while engine.scheduler.has_unfinished_requests():
        engine.step()
    assert req.num_preemptions == 1
    check_against(reference, prompt_ids, req.prompt_logprobs, 2)


def test_with_n_samples_every_sample_gets_them(float_model, prompt_ids, reference) -> None:
    engine = _engine(float_model, budget=64, prefix_caching=False)
    outs = engine.generate([engine.make_request(prompt_ids, SamplingParams(
        n=3, seed=1, max_tokens=4, prompt_logprobs=1))])
    assert [o.index for o in outs] == [0, 1, 2]
    for o in outs:
        check_against(reference, prompt_ids, o.prompt_logprobs, 1)
    assert sum(r.num_preemptions for r in engine.scheduler.requests.values()) == 0


def test_bounds() -> None:
    SamplingParams(prompt_logprobs=20)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be None or in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)


@pytest.mark.skipif(not ops.c_kernels_available(), reason="the C kernels cannot be built here")
@pytest.mark.parametrize("k", [0, 5])
def test_the_c_kernel_gives_the_references_values(k) -> None:
    """compute() over more rows than a pass holds, through the C kernel (the CPU's default)
    and through the torch reference: the same values to float tolerance, the same top ids
    (the logits are distinct)."""
    g = torch.Generator().manual_seed(0)
    head = torch.randn(5003, 64, generator=g)
    hidden = torch.randn(prompt_logprobs.ROWS_PER_PASS + 45, 64, generator=g)
    rows = list(range(3, hidden.shape[0]))
    targets = torch.randint(0, 5003, (len(rows),), generator=g).tolist()
    results = {}
    for backend in ("c", "torch"):
        with ops.use_backend(backend):
            results[backend] = prompt_logprobs.compute(lambda h: h @ head.t(), hidden, rows, targets, k)
    assert len(results["c"]) == len(rows)
    for got, want in zip(results["c"], results["torch"], strict=True):
        assert got.token_id == want.token_id
        assert got.logprob == pytest.approx(want.logprob, abs=2e-5)
        assert [t for t, _ in got.top_logprobs] == [t for t, _ in want.top_logprobs]
        assert [v for _, v in got.top_logprobs] == pytest.approx([v for _, v in want.top_logprobs], abs=2e-5)


# -- both gRPC protocols ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def worker():

    from tests.test_server import Worker

    w = Worker(*REFERENCE_FLAGS)
    try:
        yield w.wait_ready()
    finally:
        w.close()


def test_our_protocol(worker, prompt_ids, reference) -> None:
    from llmworker.v1 import worker_pb2 as pb

    from tests.test_server import run

    chunks, complete = run(worker.stub, token_ids=pb.TokenIdsInput(ids=prompt_ids),
                           prompt_logprobs=3, sampling=pb.SamplingParams(temperature=0.0),
                           stopping=pb.StoppingCriteria(max_tokens=4, ignore_eos=True))
    assert complete.finish_reason == pb.FINISH_REASON_LENGTH
    got = [c.prompt_logprobs for c in chunks if c.prompt_logprobs]
    assert len(got) == 1 and chunks[0].prompt_logprobs, "on the first chunk, once"
    as_results = [prompt_logprobs.PromptLogprob(p.token_id, p.logprob,
                                                [(t.token_id, t.logprob) for t in p.top_logprobs])
                  for p in got[0]]
    check_against(reference, prompt_ids, as_results, 3)


def test_vllm_protocol(worker, prompt_ids, reference) -> None:
    import grpc
    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

    def generate(stream: bool, **params):
        req = vpb.GenerateRequest(
            tokenized=vpb.TokenizedInput(input_ids=prompt_ids), stream=stream,
            sampling_params=vpb.SamplingParams(**{"temperature": 0.0, "max_tokens": 3,
                                                  "ignore_eos": True, **params}))
        return list(worker.vllm.Generate(req, timeout=120))

    def check(lp: vpb.InputLogProbs, k: int) -> None:
        assert list(lp.token_ids) == prompt_ids
        assert not lp.token_logprobs[0].HasField("value") and not lp.top_logprobs[0].token_ids
        check_against(reference, prompt_ids, [
            prompt_logprobs.PromptLogprob(t, v.value, list(zip(top.token_ids, top.values,
                                                               strict=True)))
            for t, v, top in zip(prompt_ids[1:], lp.token_logprobs[1:], lp.top_logprobs[1:],
                                 strict=True)], k)

    resps = generate(stream=False, prompt_logprobs=4)
    assert len(resps) == 1 and resps[0].HasField("complete")
    check(resps[0].complete.input_logprobs, 4)
    # Streamed, with n = 2: on each sample's first chunk.
    resps = generate(stream=True, prompt_logprobs=2, n=2, temperature=1.0, seed=3)
    firsts = {}
    for r in resps:
        if not r.HasField("chunk"):
            assert not r.complete.HasField("input_logprobs")  # streamed: on the chunks
        elif r.chunk.index not in firsts:
            firsts[r.chunk.index] = r.chunk
            check(r.chunk.input_logprobs, 2)
        else:
            assert not r.chunk.HasField("input_logprobs"), "only on the first chunk"
    assert sorted(firsts) == [0, 1]
    with pytest.raises(grpc.RpcError) as e:
        generate(stream=False, prompt_logprobs=-1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_logprobs" in e.value.details() and "-1" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        generate(stream=False, prompt_logprobs=21)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling_params.prompt_logprobs must be None or in [0, 20]" in e.value.details()
