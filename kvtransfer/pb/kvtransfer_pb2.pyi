from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Layout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "model_id", "fingerprint")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    model_id: str
    fingerprint: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., model_id: _Optional[str] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class KVHeader(_message.Message):
    __slots__ = ("transfer_id", "layer", "block_ids", "dtype", "shape", "fingerprint", "checksum", "seq", "payload_nbytes", "sender_error", "sender_id", "finish", "first_token", "num_units", "auth_token", "layer_count")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_NBYTES_FIELD_NUMBER: _ClassVar[int]
    SENDER_ERROR_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_UNITS_FIELD_NUMBER: _ClassVar[int]
    AUTH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LAYER_COUNT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    layer: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    fingerprint: str
    checksum: int
    seq: int
    payload_nbytes: int
    sender_error: str
    sender_id: str
    finish: bool
    first_token: int
    num_units: int
    auth_token: bytes
    layer_count: int
    def __init__(self, transfer_id: _Optional[str] = ..., layer: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., fingerprint: _Optional[str] = ..., checksum: _Optional[int] = ..., seq: _Optional[int] = ..., payload_nbytes: _Optional[int] = ..., sender_error: _Optional[str] = ..., sender_id: _Optional[str] = ..., finish: _Optional[bool] = ..., first_token: _Optional[int] = ..., num_units: _Optional[int] = ..., auth_token: _Optional[bytes] = ..., layer_count: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("seq", "transfer_id", "layer", "ok", "reason")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    seq: int
    transfer_id: str
    layer: int
    ok: bool
    reason: str
    def __init__(self, seq: _Optional[int] = ..., transfer_id: _Optional[str] = ..., layer: _Optional[int] = ..., ok: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("layout", "sender_id", "pid", "start_time")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    layout: Layout
    sender_id: str
    pid: int
    start_time: int
    def __init__(self, layout: _Optional[_Union[Layout, _Mapping]] = ..., sender_id: _Optional[str] = ..., pid: _Optional[int] = ..., start_time: _Optional[int] = ...) -> None: ...

class HandshakeReply(_message.Message):
    __slots__ = ("layout", "num_blocks", "shm_name", "owner_shm_name", "max_unit_layers", "shm_verify")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    OWNER_SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_UNIT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    SHM_VERIFY_FIELD_NUMBER: _ClassVar[int]
    layout: Layout
    num_blocks: int
    shm_name: str
    owner_shm_name: str
    max_unit_layers: int
    shm_verify: str
    def __init__(self, layout: _Optional[_Union[Layout, _Mapping]] = ..., num_blocks: _Optional[int] = ..., shm_name: _Optional[str] = ..., owner_shm_name: _Optional[str] = ..., max_unit_layers: _Optional[int] = ..., shm_verify: _Optional[str] = ...) -> None: ...

class GrantRequest(_message.Message):
    __slots__ = ("transfer_id", "sender_id", "auth_token")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    AUTH_TOKEN_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    sender_id: str
    auth_token: bytes
    def __init__(self, transfer_id: _Optional[str] = ..., sender_id: _Optional[str] = ..., auth_token: _Optional[bytes] = ...) -> None: ...

class GrantReply(_message.Message):
    __slots__ = ("transfer_id", "ok", "reason", "skip_blocks", "block_ids", "num_layers")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    ok: bool
    reason: str
    skip_blocks: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_layers: int
    def __init__(self, transfer_id: _Optional[str] = ..., ok: _Optional[bool] = ..., reason: _Optional[str] = ..., skip_blocks: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_layers: _Optional[int] = ...) -> None: ...

class Revoke(_message.Message):
    __slots__ = ("transfer_id", "reason")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    reason: str
    def __init__(self, transfer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Revoked(_message.Message):
    __slots__ = ("transfer_id", "sender_id")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    sender_id: str
    def __init__(self, transfer_id: _Optional[str] = ..., sender_id: _Optional[str] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...
