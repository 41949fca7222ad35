from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Options(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "seed", "num_predict", "stop", "num_ctx", "num_keep", "num_batch", "num_thread", "cache")
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
    STOP_FIELD_NUMBER: _ClassVar[int]
    NUM_CTX_FIELD_NUMBER: _ClassVar[int]
    NUM_KEEP_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCH_FIELD_NUMBER: _ClassVar[int]
    NUM_THREAD_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
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
    stop: _containers.RepeatedScalarFieldContainer[str]
    num_ctx: int
    num_keep: int
    num_batch: int
    num_thread: int
    cache: bool
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., typical_p: _Optional[float] = ..., repeat_penalty: _Optional[float] = ..., repeat_last_n: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., num_predict: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., num_ctx: _Optional[int] = ..., num_keep: _Optional[int] = ..., num_batch: _Optional[int] = ..., num_thread: _Optional[int] = ..., cache: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "system", "raw", "options", "context")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    system: str
    raw: bool
    options: Options
    context: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., system: _Optional[str] = ..., raw: _Optional[bool] = ..., options: _Optional[_Union[Options, _Mapping]] = ..., context: _Optional[_Iterable[int]] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("model", "messages", "options")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    options: Options
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., options: _Optional[_Union[Options, _Mapping]] = ...) -> None: ...

class Figures(_message.Message):
    __slots__ = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count", "eval_duration", "cached_tokens", "decode_worker", "prefill_worker", "cache")
    TOTAL_DURATION_FIELD_NUMBER: _ClassVar[int]
    LOAD_DURATION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EVAL_COUNT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EVAL_DURATION_FIELD_NUMBER: _ClassVar[int]
    EVAL_COUNT_FIELD_NUMBER: _ClassVar[int]
    EVAL_DURATION_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    total_duration: int
    load_duration: int
    prompt_eval_count: int
    prompt_eval_duration: int
    eval_count: int
    eval_duration: int
    cached_tokens: int
    decode_worker: str
    prefill_worker: str
    cache: str
    def __init__(self, total_duration: _Optional[int] = ..., load_duration: _Optional[int] = ..., prompt_eval_count: _Optional[int] = ..., prompt_eval_duration: _Optional[int] = ..., eval_count: _Optional[int] = ..., eval_duration: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., decode_worker: _Optional[str] = ..., prefill_worker: _Optional[str] = ..., cache: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("model", "response", "done", "done_reason", "figures", "context")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    DONE_REASON_FIELD_NUMBER: _ClassVar[int]
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    model: str
    response: str
    done: bool
    done_reason: str
    figures: Figures
    context: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., response: _Optional[str] = ..., done: _Optional[bool] = ..., done_reason: _Optional[str] = ..., figures: _Optional[_Union[Figures, _Mapping]] = ..., context: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatResponse(_message.Message):
    __slots__ = ("model", "message", "done", "done_reason", "figures")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    DONE_REASON_FIELD_NUMBER: _ClassVar[int]
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    model: str
    message: Message
    done: bool
    done_reason: str
    figures: Figures
    def __init__(self, model: _Optional[str] = ..., message: _Optional[_Union[Message, _Mapping]] = ..., done: _Optional[bool] = ..., done_reason: _Optional[str] = ..., figures: _Optional[_Union[Figures, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Model(_message.Message):
    __slots__ = ("name", "size", "digest", "format", "family", "parameter_size", "quantization_level", "context_length", "modified_at")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_LEVEL_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MODIFIED_AT_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    digest: str
    format: str
    family: str
    parameter_size: str
    quantization_level: str
    context_length: int
    modified_at: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., digest: _Optional[str] = ..., format: _Optional[str] = ..., family: _Optional[str] = ..., parameter_size: _Optional[str] = ..., quantization_level: _Optional[str] = ..., context_length: _Optional[int] = ..., modified_at: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[Model]
    def __init__(self, models: _Optional[_Iterable[_Union[Model, _Mapping]]] = ...) -> None: ...
