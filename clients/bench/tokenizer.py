"""The served model's tokenizer on the client side, for what needs it: sending chats as
rendered text (``--chat-input text``), random ids as text (``--ids-input text``), and giving
the transformers peer the prompt ids the worker computes (chat template with a generation
prompt, then encode without adding special tokens; plain text encoded as the model's own
tokenizer does).

Its files come over the wire, as SMG gets them: the vLLM engine protocol's ``GetTokenizer``
(a zip of the worker's tokenizer.json, tokenizer_config.json with the chat template, and
generation_config.json; SHA-256 checked). Or from a path the user gives: such a zip, a
Hugging Face folder, or a bare tokenizer.json (no chat template then). They are loaded with
transformers' own tokenizer classes (imported only here, and only when one is needed), so a
chat renders as transformers renders it, never with this project's code.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2_grpc

from clients.bench.dataset import BenchRequest

GRPC_PREFIX = "grpc://"


def fetch_tokenizer_zip(target: str, *, token: str | None = None, timeout: float = 60.0) -> bytes:
    """The worker's tokenizer files as one zip, from ``VllmEngine.GetTokenizer`` at `target`
    (HOST:PORT); the SHA-256 on the last chunk must match the bytes."""
    md = (("authorization", f"Bearer {token}"),) if token else None
    with grpc.insecure_channel(target) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        data, sha = bytearray(), ""
        for chunk in stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=timeout,
                                       metadata=md):
            data += chunk.data
            sha = chunk.sha256 or sha
    if sha and hashlib.sha256(data).hexdigest() != sha:
        raise ValueError(f"GetTokenizer from {target}: the zip's SHA-256 does not match {sha}")
    return bytes(data)


def _from_folder(folder: Path) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder; never the hub
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def _from_zip(data: bytes) -> Any:
    with tempfile.TemporaryDirectory(prefix="llmworker-tokenizer-") as d:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            for name in zf.namelist():
                if "/" in name or name.startswith("."):  # flat, as the worker writes it
                    raise ValueError(f"unexpected entry {name[:80]!r} in the tokenizer zip")
                (Path(d) / name).write_bytes(zf.read(name))
        return _from_folder(Path(d))  # everything is read in: the folder can go


def load_tokenizer(source: str | None, *, target: str, token: str | None = None) -> Any:
    """A transformers tokenizer. `source`: None (fetch from the worker at `target`),
    ``grpc://HOST:PORT`` (fetch from that worker), a .zip, a Hugging Face folder, or a
    tokenizer.json file."""
    if source is None or source.startswith(GRPC_PREFIX):
        where = target if source is None else source.removeprefix(GRPC_PREFIX)
        return _from_zip(fetch_tokenizer_zip(where, token=token))
    path = Path(source)
    if path.is_dir():
        return _from_folder(path)
    if path.suffix == ".zip":
        return _from_zip(path.read_bytes())
    if path.name.endswith(".json") and path.is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_file=str(path))
    raise ValueError(f"--tokenizer: not a folder, .zip, tokenizer.json or grpc://HOST:PORT: "
                     f"{source[:200]!r}")


def render_chat(tok: Any, messages: list[dict[str, str]]) -> str:
    if not getattr(tok, "chat_template", None):
        raise ValueError("this tokenizer has no chat template (a bare tokenizer.json?); give "
                         "--tokenizer a folder or grpc://HOST:PORT of the worker")
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def as_text(req: BenchRequest, tok: Any) -> BenchRequest:
    """A chat request rendered to text; other requests unchanged."""
    if req.messages is None:
        return req
    return BenchRequest(req.index, req.output_len, req.kind, text=render_chat(tok, req.messages))


def ids_as_text(req: BenchRequest, tok: Any) -> BenchRequest:
    """A token-id request decoded to text, for servers that take no ids (SMG's completions).

    Random ids do not round-trip: the text re-encodes to a different count. One pass trims
    it to at most the asked-for length; the server's usage reports the true prompt tokens.
    """
    if req.token_ids is None:
        return req
    n = len(req.token_ids)
    text = tok.decode(req.token_ids, skip_special_tokens=True)
    again = tok.encode(text, add_special_tokens=False)
    if len(again) > n:
        text = tok.decode(again[:n], skip_special_tokens=True)
    return BenchRequest(req.index, req.output_len, req.kind, text=text)


def prompt_ids(req: BenchRequest, tok: Any) -> list[int]:
    """The ids the worker computes for `req`: a rendered template writes its own BOS; raw
    text gets the model tokenizer's special tokens (BOS only if it adds one)."""
    if req.token_ids is not None:
        return list(req.token_ids)
    if tok is None:
        raise ValueError("text and chat requests need the model's tokenizer")
    if req.messages is not None:
        return list(tok.encode(render_chat(tok, req.messages), add_special_tokens=False))
    assert req.text is not None
    return list(tok.encode(req.text, add_special_tokens=True))


def pad_id(tok: Any) -> int:
    """The id the peer pads prompts with: the tokenizer's pad, else its EOS, else 0 (any id
    works: padded positions are masked)."""
    if tok is None:
        return 0
    for tid in (tok.pad_token_id, tok.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0
