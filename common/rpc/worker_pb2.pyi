from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "seed", "num_predict", "num_ctx", "grammar_kind", "grammar", "logprobs", "prompt_logprobs", "min_tokens", "logit_bias", "no_speculation")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    TYPICAL_P_FIELD_NUMBER: _ClassVar[int]
    REPEAT_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPEAT_LAST_N_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREDICT_FIELD_NUMBER: _ClassVar[int]
    NUM_CTX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_KIND_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    NO_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    typical_p: float
    repeat_penalty: float
    repeat_last_n: int
    presence_penalty: float
    frequency_penalty: float
    seed: int
    num_predict: int
    num_ctx: int
    grammar_kind: str
    grammar: str
    logprobs: int
    prompt_logprobs: int
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    no_speculation: bool
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., repeat_penalty: _Optional[float] = ..., repeat_last_n: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., num_predict: _Optional[int] = ..., num_ctx: _Optional[int] = ..., grammar_kind: _Optional[str] = ..., grammar: _Optional[str] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., no_speculation: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "stop_token_ids", "max_tokens", "remote_prefill", "max_chunk_tokens", "transfer_id", "num_prior_output_tokens", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PRIOR_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingOptions
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    remote_prefill: bool
    max_chunk_tokens: int
    transfer_id: str
    num_prior_output_tokens: int
    cache_salt: bytes
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., remote_prefill: _Optional[bool] = ..., max_chunk_tokens: _Optional[int] = ..., transfer_id: _Optional[str] = ..., num_prior_output_tokens: _Optional[int] = ..., cache_salt: _Optional[bytes] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("token_ids", "finished", "finish_reason", "error", "num_cached_tokens", "kv_bytes_received", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    finish_reason: str
    error: str
    num_cached_tokens: int
    kv_bytes_received: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., error: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: Tokens
    def __init__(self, tokens: _Optional[_Union[Tokens, _Mapping]] = ...) -> None: ...

class KVDestination(_message.Message):
    __slots__ = ("endpoint", "backend")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    backend: str
    def __init__(self, endpoint: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "destination", "max_chunk_tokens", "transfer_id", "num_prior_output_tokens", "cache_salt", "stop_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PRIOR_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingOptions
    destination: KVDestination
    max_chunk_tokens: int
    transfer_id: str
    num_prior_output_tokens: int
    cache_salt: bytes
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., destination: _Optional[_Union[KVDestination, _Mapping]] = ..., max_chunk_tokens: _Optional[int] = ..., transfer_id: _Optional[str] = ..., num_prior_output_tokens: _Optional[int] = ..., cache_salt: _Optional[bytes] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillResult(_message.Message):
    __slots__ = ("first_token", "num_cached_tokens", "prefill_seconds", "logprobs", "prompt_logprobs")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    num_cached_tokens: int
    prefill_seconds: float
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, first_token: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "role", "num_blocks", "num_free_blocks", "num_running", "num_waiting", "queued_prefill_tokens", "max_num_batched_tokens", "block_size", "cached_block_hashes", "kv", "unloaded", "refused_calls", "spec_decode", "prefill_token_seconds")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_CALLS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int
    max_num_batched_tokens: int
    block_size: int
    cached_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    kv: KVTransferCounters
    unloaded: bool
    refused_calls: _containers.RepeatedCompositeFieldContainer[RefusedCalls]
    spec_decode: SpecDecodeCounters
    prefill_token_seconds: float
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., cached_block_hashes: _Optional[_Iterable[bytes]] = ..., kv: _Optional[_Union[KVTransferCounters, _Mapping]] = ..., unloaded: _Optional[bool] = ..., refused_calls: _Optional[_Iterable[_Union[RefusedCalls, _Mapping]]] = ..., spec_decode: _Optional[_Union[SpecDecodeCounters, _Mapping]] = ..., prefill_token_seconds: _Optional[float] = ...) -> None: ...

class SpecDecodeCounters(_message.Message):
    __slots__ = ("num_steps", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens", "method")
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_EMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    num_steps: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_emitted_tokens: int
    method: str
    def __init__(self, num_steps: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., num_emitted_tokens: _Optional[int] = ..., method: _Optional[str] = ...) -> None: ...

class RefusedCalls(_message.Message):
    __slots__ = ("method", "reason", "count")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    method: str
    reason: str
    count: int
    def __init__(self, method: _Optional[str] = ..., reason: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class KVTransferCounters(_message.Message):
    __slots__ = ("backend", "bytes_sent", "bytes_received", "transfers_done", "transfers_failed", "transfer_seconds", "skipped_blocks", "auth_rejected")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_DONE_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FAILED_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    AUTH_REJECTED_FIELD_NUMBER: _ClassVar[int]
    backend: str
    bytes_sent: int
    bytes_received: int
    transfers_done: int
    transfers_failed: int
    transfer_seconds: float
    skipped_blocks: int
    auth_rejected: int
    def __init__(self, backend: _Optional[str] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., transfers_done: _Optional[int] = ..., transfers_failed: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., skipped_blocks: _Optional[int] = ..., auth_rejected: _Optional[int] = ...) -> None: ...

class ResidencyRequest(_message.Message):
    __slots__ = ("resident",)
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    resident: bool
    def __init__(self, resident: _Optional[bool] = ...) -> None: ...

class ResidencyResult(_message.Message):
    __slots__ = ("resident", "load_seconds")
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    resident: bool
    load_seconds: float
    def __init__(self, resident: _Optional[bool] = ..., load_seconds: _Optional[float] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("request_id", "inputs", "normalize", "max_chunk_tokens", "pooling")
    class Pooling(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        POOLING_MEAN: _ClassVar[EmbedRequest.Pooling]
        POOLING_LAST: _ClassVar[EmbedRequest.Pooling]
    POOLING_MEAN: EmbedRequest.Pooling
    POOLING_LAST: EmbedRequest.Pooling
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    inputs: _containers.RepeatedCompositeFieldContainer[TokenIds]
    normalize: bool
    max_chunk_tokens: int
    pooling: EmbedRequest.Pooling
    def __init__(self, request_id: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., normalize: _Optional[bool] = ..., max_chunk_tokens: _Optional[int] = ..., pooling: _Optional[_Union[EmbedRequest.Pooling, str]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class EmbedResult(_message.Message):
    __slots__ = ("embeddings",)
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "kv_endpoint", "kv_backend", "model_fingerprint", "kv_layout_fingerprint", "status")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    KV_BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    address: str
    kv_endpoint: str
    kv_backend: str
    model_fingerprint: str
    kv_layout_fingerprint: str
    status: WorkerStatus
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., kv_endpoint: _Optional[str] = ..., kv_backend: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., kv_layout_fingerprint: _Optional[str] = ..., status: _Optional[_Union[WorkerStatus, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("accepted", "reason", "heartbeat_interval_s")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    heartbeat_interval_s: float
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "status")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    status: WorkerStatus
    def __init__(self, worker_id: _Optional[str] = ..., status: _Optional[_Union[WorkerStatus, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...
