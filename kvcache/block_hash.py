"""Chained content hashes of full KV blocks, the keys of the prefix cache.

A block's keys and values depend on every token before it, not just its own, so its hash
covers its parent's hash too: equal hashes mean equal token prefixes (up to SHA-256
collisions). A per-request `cache_salt` goes into every block's hash, so requests with
different salts (tenants) never share a block, even for equal tokens. A LoRA adapter's key
goes in the same way: keys and values computed under one adapter are never reused by
another or by the base model; requests of the same adapter share them.

    tokens   [ t0 .. t15 | t16 .. t31 | t32 .. t40 ]      block_size = 16
    hash     h0 = H(ROOT, salt, t0..t15)
                         h1 = H(h0, salt, t16..t31)
                                        (partial: no hash, never shared)

The byte encoding is canonical and stable across processes and Python versions (no
`hash()`, no pickle): parent digest (32 bytes), salt tag (0 = none; 1 = a string, then its
UTF-8 length as 4 bytes and the bytes), with a LoRA key a tag 2 and the key the same way
(nothing without one: base-model hashes are unchanged), then each token id as 8
little-endian bytes. The parent has a fixed width, salt and key are tagged and
length-prefixed and the token count is fixed by the block size, so no two inputs of one
block size encode to the same bytes (a key makes the encoding longer).
"""

import hashlib
import struct
from collections.abc import Iterator, Sequence

BlockHash = bytes
ROOT: BlockHash = bytes(32)  # the parent of a sequence's first block


def _salt_bytes(cache_salt: str | None) -> bytes:
    if cache_salt is None:
        return b"\x00"
    raw = cache_salt.encode()
    return b"\x01" + len(raw).to_bytes(4, "little") + raw


def _lora_bytes(lora_key: str | None) -> bytes:
    if lora_key is None:
        return b""
    raw = lora_key.encode()
    return b"\x02" + len(raw).to_bytes(4, "little") + raw


def hash_block(
    parent: BlockHash, token_ids: Sequence[int], cache_salt: str | None = None,
    lora_key: str | None = None,
) -> BlockHash:
    """The hash of one full block, given its parent's (`ROOT` for the first block)."""
    assert len(parent) == 32, "parent must be a 32-byte digest"
    data = (parent + _salt_bytes(cache_salt) + _lora_bytes(lora_key)
            + struct.pack(f"<{len(token_ids)}Q", *token_ids))
    return hashlib.sha256(data).digest()


def iter_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    parent: BlockHash = ROOT,
    start_block: int = 0,
    end_block: int | None = None,
    lora_key: str | None = None,
) -> Iterator[BlockHash]:
    """Hashes of the full blocks of `token_ids` from `start_block` up to `end_block` (by
    default the last full one), lazily: a caller that stops at the first cache miss hashes
    no further. `parent` is the hash of block ``start_block - 1``, or `ROOT` at 0."""
    assert start_block > 0 or parent == ROOT, "block 0's parent is ROOT"
    num_full = len(token_ids) // block_size
    end_block = num_full if end_block is None else end_block
    assert end_block <= num_full, f"block {end_block - 1} is not full"
    for i in range(start_block, end_block):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], cache_salt,
                            lora_key)
        yield parent
