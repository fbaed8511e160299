from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "model")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    model: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class PullBlocksRequest(_message.Message):
    __slots__ = ("handle", "prompt_digest", "layout", "first_block", "num_blocks", "max_chunk_bytes")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    handle: str
    prompt_digest: bytes
    layout: KVLayout
    first_block: int
    num_blocks: int
    max_chunk_bytes: int
    def __init__(self, handle: _Optional[str] = ..., prompt_digest: _Optional[bytes] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("layout", "num_tokens", "first_block", "num_blocks", "total_bytes")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    num_tokens: int
    first_block: int
    num_blocks: int
    total_bytes: int
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., num_tokens: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class KVBlocksChunk(_message.Message):
    __slots__ = ("layer", "first_block", "num_blocks", "keys", "values")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    layer: int
    first_block: int
    num_blocks: int
    keys: bytes
    values: bytes
    def __init__(self, layer: _Optional[int] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., keys: _Optional[bytes] = ..., values: _Optional[bytes] = ...) -> None: ...

class PullBlocksResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    chunk: KVBlocksChunk
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., chunk: _Optional[_Union[KVBlocksChunk, _Mapping]] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("handle", "lease_s")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    handle: str
    lease_s: float
    def __init__(self, handle: _Optional[str] = ..., lease_s: _Optional[float] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("expires_in_s",)
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    expires_in_s: float
    def __init__(self, expires_in_s: _Optional[float] = ...) -> None: ...

class ReleaseBlocksRequest(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: str
    def __init__(self, handle: _Optional[str] = ...) -> None: ...

class ReleaseBlocksResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
