"""The KV handoff's JSON (``kv_transfer_params_json``), both ways, and the facts two workers
must share for one's blocks to mean the same in the other's cache.

A prefill worker's GenerateComplete carries (vLLM NIXL's keys where they mean the same)::

    {"do_remote_prefill": true, "do_remote_decode": false,
     "remote_engine_id": "...", "remote_request_id": "...",
     "remote_host": "10.0.0.7", "remote_port": 50051,   # where to pull from (our main port)
     "remote_block_ids": [[12, 13, 40]], "tp_size": 1, "remote_num_tokens": 37,
     "llm_worker": {"v": 1, "handle": "<43 URL-safe characters>", "block_size": 16,
                    "kv_cache_dtype": "float32", "model": "<fingerprint>", "lease_s": 30.0}}

The block ids are informational (NIXL's): a pull names its blocks by the handle alone, so
a forged list reads nothing. What comes in is read strictly: at most `MAX_PARAMS_BYTES`,
every key's type checked, bounded strings and lists; bad input is a ValueError naming the
key (INVALID_ARGUMENT at the door). A well-formed handoff this worker cannot use (another
connector's, another model's, a peer it does not trust) is not an error: the prompt is
computed here, and `usable` says why.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

FIELD = "kv_transfer_params_json"
# What GetServerInfo.kv_connector says: SMG 1.13 tags the prefill leg with do_remote_decode
# and relays the returned handoff only for this exact name (others: "passthrough", no tag).
SMG_CONNECTOR = "NixlConnector"
# GetServerInfo.attention_backend: our paged attention, named so that SMG's pairing finds
# our KV layout different from any vLLM backend's that reports one.
ATTENTION_BACKEND = "LLM_WORKER_PAGED"
VERSION = 1
MAX_PARAMS_BYTES = 64 << 10
MAX_HOST_CHARS = 253
_HANDLE = re.compile(r"[A-Za-z0-9_-]{16,128}")
_PRINTABLE = re.compile(r"[!-~]+")


@dataclass(frozen=True)
class Layout:
    """What two caches must agree on (llmworker.v1.KVLayout)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # the cache's: float32, float16, bfloat16
    model: str  # `model_fingerprint`

    def block_bytes(self, itemsize: int) -> int:
        """Bytes of one block of one layer's keys (its values: as many)."""
        return self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def mismatch(self, other: Layout) -> str | None:
        """The first fact two layouts differ in, named as a fallback reason; None if alike."""
        if self.model != other.model:
            return "model"
        if self.block_size != other.block_size:
            return "block_size"
        if self.dtype != other.dtype:
            return "dtype"
        if (self.num_layers, self.num_kv_heads, self.head_dim) != (
                other.num_layers, other.num_kv_heads, other.head_dim):
            return "layout"
        return None


def model_fingerprint(name: str, architecture: str, model_dtype: str, source: str,
                      shape: Sequence[int]) -> str:
    """A short digest of what makes two workers' keys and values the same for one prompt:
    the model (its name, architecture, weights' source and shapes) and its compute dtype."""
    text = "|".join([name, architecture, model_dtype, source, *map(str, shape)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prompt_digest(token_ids: Sequence[int], lora_name: str | None) -> bytes:
    """SHA-256 of a prompt's token ids and adapter: a handle reads only its own prompt's
    blocks, so one request's handle presented for another prompt reads nothing."""
    h = hashlib.sha256()
    h.update((lora_name or "").encode() + b"\0")
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    return h.digest()


@dataclass(frozen=True)
class Handoff:
    """A do_remote_prefill handoff of ours, parsed (decode side)."""

    host: str
    port: int
    handle: str
    num_tokens: int
    block_size: int
    kv_cache_dtype: str
    model: str
    lease_s: float
    engine_id: str = ""

    @property
    def address(self) -> str:
        """HOST:PORT as --kv-transfer-peers spells it (lower case, IPv6 in brackets)."""
        host = self.host.lower()
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class KVParams:
    """What a request's kv_transfer_params_json asks for: to be the prefill leg of a
    handoff (`remote_decode`), or the decode leg of one (`handoff`, or `foreign` when it is
    another connector's: computed here)."""

    remote_decode: bool = False
    handoff: Handoff | None = None
    foreign: str = ""  # why a do_remote_prefill handoff is not one of ours


class BadParams(ValueError):
    """Malformed kv_transfer_params_json; the message names the key."""


def _get(d: dict, key: str, kinds: type | tuple[type, ...], where: str = FIELD) -> Any:
    value = d.get(key)
    if value is None:
        return None
    allowed = kinds if isinstance(kinds, tuple) else (kinds,)
    # bool is an int in Python; JSON true is never a count.
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise BadParams(f"{where}: {key} must be {'/'.join(k.__name__ for k in allowed)}, "
                        f"got {_short(value)}")
    return value


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 48 else f"{text[:48]}... ({len(text)} characters)"


def _int(d: dict, key: str, lo: int, hi: int, where: str = FIELD) -> int | None:
    value = _get(d, key, int, where)
    if value is not None and not lo <= value <= hi:
        raise BadParams(f"{where}: {key} must be in [{lo}, {hi}], got {value}")
    return value


def _str(d: dict, key: str, limit: int, where: str = FIELD) -> str | None:
    value = _get(d, key, str, where)
    if value is not None and (len(value) > limit or not _PRINTABLE.fullmatch(value)):
        raise BadParams(f"{where}: {key} must be 1 to {limit} printable ASCII characters "
                        f"without spaces, got {_short(value)}")
    return value


def parse(text: str, max_blocks: int) -> KVParams:
    """Read kv_transfer_params_json; raises BadParams. `max_blocks`: the most blocks a
    prompt of this worker can have (a longer remote_block_ids is refused)."""
    if len(text) > MAX_PARAMS_BYTES:
        raise BadParams(f"{FIELD} is {len(text)} characters; at most {MAX_PARAMS_BYTES} are "
                        "allowed")
    try:
        d = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise BadParams(f"{FIELD} is not JSON ({str(e)[:80]})") from None
    if not isinstance(d, dict):
        raise BadParams(f"{FIELD} must be a JSON object, got {_short(d)}")
    remote_decode = bool(_get(d, "do_remote_decode", bool))
    remote_prefill = bool(_get(d, "do_remote_prefill", bool))
    if remote_decode and remote_prefill:
        raise BadParams(f"{FIELD}: do_remote_decode and do_remote_prefill cannot both be true")
    if not remote_prefill:
        return KVParams(remote_decode=remote_decode)
    host = _str(d, "remote_host", MAX_HOST_CHARS)
    port = _int(d, "remote_port", 1, 65535)
    num_tokens = _int(d, "remote_num_tokens", 1, 1 << 31)
    rid = _get(d, "remote_request_id", str)
    if rid is not None and len(rid) > 1024:
        raise BadParams(f"{FIELD}: remote_request_id is {len(rid)} characters; at most 1024")
    engine_id = _str(d, "remote_engine_id", 128) or ""
    tp = _int(d, "tp_size", 1, 1 << 16)
    ids = _get(d, "remote_block_ids", list)
    if ids is not None:
        groups = ids if all(isinstance(g, list) for g in ids) else [ids]  # vLLM's older form
        count = 0
        for g in groups:
            if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in g):
                raise BadParams(f"{FIELD}: remote_block_ids must hold block ids (ints >= 0)")
            count += len(g)
        if count > max_blocks:
            raise BadParams(f"{FIELD}: remote_block_ids has {count} ids; a prompt here has at "
                            f"most {max_blocks} blocks")
    ours = _get(d, "llm_worker", dict)
    if ours is None:
        return KVParams(foreign="foreign_handoff")  # another connector's (a real NIXL prefill)
    where = f"{FIELD}: llm_worker"
    if _get(ours, "v", int, where) != VERSION:
        return KVParams(foreign="version")
    handle = _get(ours, "handle", str, where)
    if handle is None or not _HANDLE.fullmatch(handle):
        raise BadParams(f"{where}.handle must be 16 to 128 URL-safe characters")
    block_size = _int(ours, "block_size", 1, 1 << 16, where)
    dtype = _str(ours, "kv_cache_dtype", 32, where)
    model = _str(ours, "model", 64, where)
    lease = _get(ours, "lease_s", (int, float), where)
    if lease is not None and not (math.isfinite(lease) and 0 < lease <= 3600):
        raise BadParams(f"{where}.lease_s must be in (0, 3600], got {_short(lease)}")
    missing = [k for k, v in (("remote_host", host), ("remote_port", port),
                              ("remote_num_tokens", num_tokens), ("llm_worker.block_size",
                                                                  block_size),
                              ("llm_worker.kv_cache_dtype", dtype), ("llm_worker.model", model))
               if v is None]
    if missing:
        raise BadParams(f"{FIELD}: do_remote_prefill without {', '.join(missing)}")
    if tp not in (None, 1):
        return KVParams(foreign="tp_size")
    assert host and port and num_tokens and block_size and dtype and model
    return KVParams(handoff=Handoff(host, port, handle, num_tokens, block_size, dtype, model,
                                    float(lease or 30.0), engine_id))


def usable(h: Handoff, layout: Layout, num_prompt_tokens: int,
           peers: Sequence[str]) -> str | None:
    """Why this decode worker cannot pull `h` for a prompt of `num_prompt_tokens` (a
    fallback reason), or None. The peer check comes first: an address not on
    --kv-transfer-peers is never connected to."""
    if h.address not in peers:
        return "untrusted_peer"
    said = Layout(layout.num_layers, layout.num_kv_heads, layout.head_dim, h.block_size,
                  h.kv_cache_dtype, h.model)  # what the handoff says of the prefill's cache
    if why := layout.mismatch(said):
        return why
    return "num_tokens" if h.num_tokens != num_prompt_tokens else None


def build(*, handle: str, request_id: str, blocks: Sequence[int], num_tokens: int,
          layout: Layout, host: str, port: int, engine_id: str, lease_s: float) -> str:
    """The prefill's handoff for its GenerateComplete."""
    return json.dumps({
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_engine_id": engine_id, "remote_request_id": request_id,
        "remote_host": host, "remote_port": port,
        "remote_block_ids": [list(blocks)], "tp_size": 1, "remote_num_tokens": num_tokens,
        "llm_worker": {"v": VERSION, "handle": handle, "block_size": layout.block_size,
                       "kv_cache_dtype": layout.dtype, "model": layout.model,
                       "lease_s": lease_s},
    }, separators=(",", ":"))
