"""The tokenizer files our worker uses, zipped, for the vLLM protocol's `GetTokenizer`.

A Hugging Face folder: its own tokenizer files, as they are. A GGUF file (the embedded
default model): the tokenizer we rebuilt from its metadata, written the way a Hugging Face
folder holds it, at the zip's root:

    tokenizer.json          `tokenizers`' own serialization of the tokenizer we encode with
                            (no post-processor: BOS is added only as ours adds it)
    tokenizer_config.json   chat_template, bos/eos/pad/unk tokens, add_bos_token, the added
                            tokens (special or not), model_max_length
    generation_config.json  bos_token_id and every id that ends generation

The archive is deterministic (fixed timestamps, sorted entries): the same model gives the
same bytes and the same SHA-256.
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path

from worker.tokenizer import Tokenizer

# A Hugging Face folder's files a tokenizer may need (the rest is weights and model config).
FOLDER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                "generation_config.json", "config.json", "chat_template.jinja",
                "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")
_EPOCH = (1980, 1, 1, 0, 0, 0)  # zip's earliest date: no wall clock in the bytes


def gguf_files(tok: Tokenizer, max_model_len: int) -> dict[str, bytes]:
    """tokenizer.json, tokenizer_config.json and generation_config.json for a tokenizer
    rebuilt from GGUF metadata."""
    hf = tok._tok  # the `tokenizers.Tokenizer` our encode() runs

    def token(tid: int | None) -> str | None:
        return None if tid is None else hf.id_to_token(tid)

    added = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                 "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
        for i, t in sorted(hf.get_added_tokens_decoder().items())
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": tok.chat_template,
        "bos_token": token(tok.bos_token_id),
        "eos_token": token(tok.eos_token_ids[0] if tok.eos_token_ids else None),
        "pad_token": token(tok.pad_token_id),
        "unk_token": token(tok.unk_token_id),
        "add_bos_token": tok.add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_model_len,
        "added_tokens_decoder": added,
    }
    generation = {"bos_token_id": tok.bos_token_id, "eos_token_id": list(tok.eos_token_ids)}
    return {
        "tokenizer.json": hf.to_str().encode(),
        "tokenizer_config.json": _json(config),
        "generation_config.json": _json(generation),
    }


def folder_files(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in FOLDER_FILES
            if (folder / name).is_file()}


def build_zip(files: dict[str, bytes]) -> tuple[bytes, str]:
    """The zip of `files` (name -> bytes) and its SHA-256 in hex."""
    if not files:
        raise ValueError("no tokenizer files to send")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(files):
            info = zipfile.ZipInfo(name, date_time=_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, files[name])
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()


def _json(obj: object) -> bytes:
    return json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True).encode()
