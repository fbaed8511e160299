"""The model's tokenizer on the client side, for what needs it: sending chats as rendered text
(``--chat-input text``), random ids as text (``--ids-input text``), and giving the transformers peer the same prompt ids
the worker computes (chat template with a generation prompt, then encode without adding
special tokens, as worker/service.py does). The embedded default GGUF unless a path is given.
Imports the worker's tokenizer, so only these modes need the worker installed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from clients.bench.dataset import BenchRequest


def load_tokenizer(path: str | Path | None = None) -> Any:
    from worker.tokenizer import Tokenizer
    from worker.weights import default_model_path

    p = Path(path) if path else default_model_path()
    return Tokenizer.from_folder(p) if p.is_dir() else Tokenizer.from_gguf(p)


def as_text(req: BenchRequest, tok: Any) -> BenchRequest:
    """A chat request rendered to text; other requests unchanged."""
    if req.messages is None:
        return req
    text = tok.apply_chat_template(req.messages, add_generation_prompt=True)
    return BenchRequest(req.index, req.output_len, req.kind, text=text)


def ids_as_text(req: BenchRequest, tok: Any) -> BenchRequest:
    """A token-id request decoded to text, for servers that take no ids (SMG's completions).

    Random ids do not round-trip: the text re-encodes to a different count. One pass trims
    it to at most the asked-for length; the server's usage reports the true prompt tokens.
    """
    if req.token_ids is None:
        return req
    n = len(req.token_ids)
    text = tok.decode(req.token_ids)
    again = tok.encode(text)
    if len(again) > n:
        text = tok.decode(again[:n])
    return BenchRequest(req.index, req.output_len, req.kind, text=text)


def prompt_ids(req: BenchRequest, tok: Any) -> list[int]:
    if req.token_ids is not None:
        return list(req.token_ids)
    if req.messages is not None:
        return tok.encode(tok.apply_chat_template(req.messages, add_generation_prompt=True))
    assert req.text is not None
    return tok.encode(req.text, True)  # raw text: BOS only if the model adds one
