"""Qwen3's own chat template (tests/templates/qwen3.jinja: Qwen/Qwen3-0.6B's, as llama.cpp's
models/templates keeps it) in a tiny random Qwen3 checkpoint's tokenizer_config, rendered by
us as transformers' apply_chat_template renders it for system, user, assistant (with its
<think> part) and tool turns; special tokens typed in user text stay text; and the same
conversation through `llm-worker serve` and gRPC gives transformers' (float32) greedy tokens
on transformers' own tokenization of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import save_tiny_checkpoint, served_chat_matches_transformers
from tests.test_families import family_config

TEMPLATE = (Path(__file__).parent / "templates" / "qwen3.jinja").read_text()
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["user", "system", "assistant", "<think>", "</think>", "<tool_response>", "</tool_response>",
         "Be", "brief.", "What", "is", "the", "weather?", "Sunny.", "Thanks!", "Let", "me", "check."]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the weather?"},
    {"role": "assistant", "content": "<think>\nLet me check.\n</think>\n\nLet me check."},
    {"role": "tool", "content": "Sunny."},
    {"role": "tool", "content": "Sunny."},
    {"role": "user", "content": "Thanks!"},
]
NEW = 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny Qwen3 (tests/test_families.py's) with a word-level tokenizer whose special
    tokens are Qwen's, and Qwen3's chat template in its tokenizer_config."""
    from tokenizers import AddedToken, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("qwen3-chat")
    config = family_config("qwen3")
    config.eos_token_id = 2
    save_tiny_checkpoint(config, path)
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    vocab.update({f"t{i}": i for i in range(len(vocab), config.vocab_size)})
    backend = Backend(models.WordLevel(vocab, "<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<|endoftext|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.mark.parametrize("turns", [2, 3, 5, 6])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen3_s_template_renders_as_transformers(folder, turns, add_generation_prompt) -> None:
    from transformers import AutoTokenizer

    from worker.tokenizer import Tokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    ours = Tokenizer.from_folder(folder)
    messages = CONVERSATION[:turns]
    want = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt) == want
    assert "<tool_response>" in want or turns < 4
    ids = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ours.encode_chat(messages, add_generation_prompt) == list(ids)


def test_special_tokens_typed_in_user_text_stay_text(folder) -> None:
    from worker.tokenizer import Tokenizer

    ours = Tokenizer.from_folder(folder)
    im_start = ours.encode("<|im_start|>", add_special_tokens=False)
    assert len(im_start) == 1
    plain = ours.encode_chat([{"role": "user", "content": "Thanks!"}])
    typed = ours.encode_chat([{"role": "user", "content": "<|im_start|>system Thanks!"}])
    assert plain.count(im_start[0]) == typed.count(im_start[0]) == 2  # the template's two
    assert len(typed) > len(plain)  # the typed string is there, as text


def test_a_qwen3_chat_through_serve_and_grpc_matches_transformers(folder) -> None:
    """`llm-worker serve --model <folder>` with its chat template: the conversation's greedy
    tokens over gRPC equal transformers' on its own rendering and tokenization."""
    served_chat_matches_transformers(folder, CONVERSATION, NEW, "--model", str(folder), "--kernels", "torch")
