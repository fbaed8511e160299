"""Small helpers shared by tests."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from worker.models.llama import AttentionMetadata, LlamaForCausalLM


@torch.inference_mode()
def last_logits(model: LlamaForCausalLM, ids: list[int], block_size: int = 16) -> torch.Tensor:
    """One whole-prompt forward pass through a private paged cache; logits of the last position."""
    cfg = model.config
    dev = model.norm.device  # not the embedding's: a runner may have swapped it for Q8_0 blocks
    dtype = model.norm.dtype
    n = len(ids)
    nblk = (n + block_size - 1) // block_size
    kv = [
        (torch.zeros(nblk, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=dev),
         torch.zeros(nblk, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=dev))
        for _ in range(cfg.num_layers)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=dev),
        block_tables=torch.arange(nblk, dtype=torch.int32, device=dev)[None],
        seq_lens=torch.tensor([n], device=dev),
        query_start_loc=torch.tensor([0, n], device=dev),
        max_query_len=n,
        max_seq_len=n,
    )
    hidden = model(torch.tensor(ids, device=dev), torch.arange(n, device=dev), meta, kv)
    return model.compute_logits(hidden[-1:])[0]


@torch.inference_mode()
def hf_greedy(hf_model, ids: list[int], max_new_tokens: int, **generate_kwargs) -> list[int]:
    """transformers' greedy continuation of one prompt, stopping at EOS as it does by default
    (`generate_kwargs`: e.g. repetition_penalty)."""
    out = hf_model.generate(
        torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=hf_model.config.eos_token_id,
        **generate_kwargs,
    )
    return out[0, len(ids):].tolist()


def engine_greedy(loaded, prompts: list[list[int]], max_tokens: int, config=None) -> list[list[int]]:
    """Our engine's greedy continuations of `prompts` (one batch, stopping at EOS), on `loaded`;
    every block is freed after."""
    from scheduler.request import SamplingParams
    from worker.config import WorkerConfig
    from worker.engine import Engine

    engine = Engine(config or WorkerConfig(), loaded=loaded)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    done = engine.generate([engine.make_request(ids, params) for ids in prompts])
    assert engine.kv.num_free_blocks == engine.budget.num_blocks
    return [c.token_ids for c in done]


def kernel_device() -> torch.device:
    """Where kernel tests run: the GPU when there is one, else the CPU under the interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


requires_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def save_tiny_checkpoint(config, folder, seed: int = 0):
    """A Hugging Face folder as users make one: transformers' model of `config` (a config
    class instance: its own random init under `seed`, float32) saved with save_pretrained,
    and a word-level tokenizer of the (text) config's vocab_size tokens ("t0", "t1", ...; eos "t2") saved
    the same way, so the worker loads the folder as it loads any. Returns the model."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    backend = Backend(models.WordLevel({f"t{i}": i for i in range(config.get_text_config().vocab_size)}, "t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(folder)
    return model


def round_linears_to_q8_0(hf_model) -> None:
    """Each linear weight of `hf_model`'s layers replaced by its gguf-py Q8_0 round trip, so
    its rows are Q8_0-exact: a Q8_0 load of them (q8_0_linears) computes these very weights."""
    from gguf import GGMLQuantizationType, quants

    q8 = GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if ".layers." in name and p.dim() == 2:
                p.copy_(torch.from_numpy(quants.dequantize(quants.quantize(p.detach().numpy(), q8), q8)))


def q8_0_linears(loaded) -> int:
    """Make a load's layer linears (q/k/v and gate/up fused as we hold them) Q8_0
    QuantLinears, for the fused C decoder; each must quantize to itself (the checkpoint was
    rounded with round_linears_to_q8_0). Returns how many were replaced."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from ops.quantized_linear import QuantizedWeight, quantize_linears

    q8 = GGMLQuantizationType.Q8_0
    blocks = {}
    for name, mod in loaded.model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.startswith("layers."):
            w = mod.weight.detach().numpy()
            b = quants.quantize(w, q8)
            assert np.array_equal(quants.dequantize(b, q8), w), name
            blocks[name] = QuantizedWeight("Q8_0", np.ascontiguousarray(b), w.shape)
    return quantize_linears(loaded.model, blocks, "float32")


def served_chat_matches_transformers(folder, messages: list[dict], new_tokens: int, *serve_args: str) -> None:
    """`llm-worker serve *serve_args` with its chat template, greedy over gRPC: the prompt's
    token count and the tokens equal transformers' on the checkpoint `folder` (its own
    rendering and tokenization of `messages`)."""
    from llmworker.v1 import worker_pb2 as pb
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.test_families import hf_greedy as forward_greedy  # (EOS ignored, as served here)
    from tests.test_server import Worker, run

    ids = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if not isinstance(ids, list) else ids)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    want, _ = forward_greedy(hf, ids, new_tokens)
    w = Worker(*serve_args, "--max-model-len", "128")
    try:
        w.wait_ready()
        chunks, done = run(w.stub, chat=pb.ChatInput(messages=[pb.ChatMessage(**m) for m in messages]),
                           sampling=pb.SamplingParams(temperature=0.0),
                           stopping=pb.StoppingCriteria(max_tokens=new_tokens, ignore_eos=True))
    finally:
        w.close()
    assert done.usage.prompt_tokens == len(ids)
    assert [t for c in chunks for t in c.token_ids] == want
