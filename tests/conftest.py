"""Shared fixtures. The default model and its transformers twin load once per session."""

from __future__ import annotations

import os

# No test may reach a model hub; set before transformers is imported anywhere.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter; it reads this once, at import.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.weights import LoadedModel, default_model_path, load_model

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain recursion to a five-year-old.",
    "List three uses of a paperclip.",
    "def fibonacci(n):\n    # complete this Python function",
    "Translate 'good morning' into Spanish and German.",
    "Why do cats purr? Answer in two sentences.",
    "What is 17 times 23?",
    "Give me a name for a pet goldfish. 🐟",
    "东京是哪个国家的首都？",
]


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    return load_model("default")


@pytest.fixture(scope="session")
def hf_model():
    """transformers' own load of the same GGUF file, float32."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def tok():
    """The tokenizer the worker uses (the default model's GGUF), built per module."""
    from worker.tokenizer import Tokenizer

    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="module")
def compiler(tok):
    """A grammar compiler over `tok`, per module (its compile cache starts empty)."""
    from worker.structured import GrammarCompiler

    return GrammarCompiler(tok, tok.vocab_size, tok.eos_token_ids)


@pytest.fixture(scope="session")
def chat_prompt_ids(default_model: LoadedModel) -> list[list[int]]:
    tok = default_model.tokenizer
    assert tok is not None
    return [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
        for p in CHAT_PROMPTS
    ]
