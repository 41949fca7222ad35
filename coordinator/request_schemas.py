"""The request bodies of the HTTP API as pydantic models: documentation, never the parser.

The routes parse their bodies by hand (ollama_request.py, openai_api.py, model_routes.py,
embedding_routes.py), because Ollama's and OpenAI's error messages and leniencies are part of
the API and pydantic's would differ. These models describe what those parsers accept, for
/openapi.json (openapi.py) and for the schema-driven fuzzer (tests/reliability/test_fuzz_http.py): field
names, types, enums and ranges, taken from the parsers' own constants so the two cannot drift
apart silently. Unknown fields are allowed (`extra="allow"`) because every parser ignores them,
as Ollama's Go decoder and OpenAI-compatible servers do.

A value the schema allows may still be refused with a 400 for a reason no schema can say (an
option out of a model-dependent range, a tool_choice naming no tool); a value outside it always
is.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from coordinator.ollama_request import _ROLES
from common.logprobs import MAX_LOGPROBS
from common.pooling import Pooling
from common.sampling_params import MAX_BIAS, MAX_COUNT, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS

Count = Field(default=None, ge=0, le=MAX_COUNT)
# tandem's `pooling` on every embedding route (embedding_routes._pooling): "mean" or "last".
PoolingName = Literal[tuple(p.value for p in Pooling)]  # type: ignore[valid-type]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class Options(_Body):
    """Ollama's `options` (common/sampling_params.py): null means the default."""

    temperature: float | None = Field(default=None, ge=0, le=100)
    top_k: int | None = Count
    top_p: float | None = Field(default=None, ge=0, le=1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    typical_p: float | None = Field(default=None, ge=0, le=1)
    repeat_penalty: float | None = Field(default=None, ge=0.001, le=100)
    repeat_last_n: int | None = Field(default=None, ge=-1, le=MAX_COUNT)
    presence_penalty: float | None = Field(default=None, ge=-100, le=100)
    frequency_penalty: float | None = Field(default=None, ge=-100, le=100)
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 63)
    num_predict: int | None = Field(default=None, ge=-2, le=MAX_COUNT)
    stop: str | list[str] | None = None
    num_ctx: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    num_keep: int | None = Field(default=None, ge=-1, le=MAX_COUNT)
    num_batch: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    num_thread: int | None = Count
    min_tokens: int | None = Count  # tandem's extension (vLLM's name)
    speculative: bool | None = None  # tandem's: false opts out of speculative decoding
    cache: bool | None = None  # tandem's: the response cache may (true) or may not (false) answer


KeepAlive = Union[str, float, None]  # a Go duration ("5m"), or seconds; 0 unloads
Format = Union[Literal["", "json"], dict[str, Any], None]  # "json" or a JSON schema


class ToolFunction(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema object


class Tool(_Body):
    type: Literal["function"] = "function"
    function: ToolFunction


class OllamaMessage(_Body):
    role: Literal[_ROLES]  # type: ignore[valid-type]
    content: str | None = None  # null is "", as in Ollama
    images: list[str] | None = Field(default=None, max_length=0)  # no vision input
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None


class _OllamaGeneration(_Body):
    model: str = Field(min_length=1)
    stream: bool | None = None  # true unless false
    format: Format = None
    options: Options | None = None
    keep_alive: KeepAlive = None
    # coordinator/thinking.py: true/false or a level, for a template that can think
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class ChatRequest(_OllamaGeneration):
    """POST /api/chat. No messages: load the model (keep_alive 0: unload)."""

    messages: list[OllamaMessage] | None = None
    tools: list[Tool] | None = None
    # default true: a chat longer than its context drops its oldest non-system messages
    truncate: bool | None = None


class GenerateRequest(_OllamaGeneration):
    """POST /api/generate. No prompt and no context: load the model."""

    prompt: str | None = None
    system: str | None = None
    raw: bool | None = None
    context: list[int] | None = Field(default=None, json_schema_extra={"items": {"minimum": 0}})
    suffix: Literal[""] | None = None  # no insert
    template: Literal[""] | None = None  # the model's own template only
    images: list[str] | None = Field(default=None, max_length=0)


class ModelName(_Body):
    """/api/show, /api/delete, /api/pull: `model`, or the older `name`."""

    model_config = ConfigDict(extra="allow", json_schema_extra={
        "anyOf": [{"required": ["model"]}, {"required": ["name"]}]})

    model: str | None = Field(default=None, min_length=1)
    name: str | None = Field(default=None, min_length=1)


class PullRequest(ModelName):
    stream: bool | None = None
    insecure: bool | None = None  # accepted, ignored: tandem pulls over pip's own TLS


class CopyRequest(_Body):
    source: str = Field(min_length=1)
    destination: str = Field(min_length=1)


class CreateRequest(ModelName):
    """POST /api/create: `from` (an absolute path on the server's host or a model name) or
    `files` (one {"NAME.gguf": "sha256:<hex>"} blob uploaded to /api/blobs); `template` (Jinja)
    and `system` are kept with the name. adapters, quantize, parameters, messages and license
    are refused with a 400 when they ask for anything."""

    from_: str | None = Field(default=None, alias="from", min_length=1)
    files: dict[str, str] | None = None
    template: str | None = None
    system: str | None = None
    stream: bool | None = None


class _EmbedOptions(_Body):
    num_ctx: int | None = Field(default=None, ge=1)


class EmbedRequest(_Body):
    """POST /api/embed."""

    model: str = Field(min_length=1)
    input: str | list[str] = Field(min_length=1)
    truncate: bool | None = None
    options: _EmbedOptions | None = None
    dimensions: int | None = None  # 1..the hidden size: truncated and re-normalized
    keep_alive: KeepAlive = None
    pooling: PoolingName | None = None  # tandem's; default the model file's, else mean


class EmbeddingsRequest(_Body):
    """POST /api/embeddings (legacy): one prompt, one vector, not normalized."""

    model: str = Field(min_length=1)
    prompt: str = Field(min_length=1)
    options: _EmbedOptions | None = None
    keep_alive: KeepAlive = None
    pooling: PoolingName | None = None


# ---- OpenAI ----------------------------------------------------------------------------------

class TextPart(_Body):
    type: Literal["text"]
    text: str


class OpenAIMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # null on assistant messages only
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(_Body):
    include_usage: bool | None = None


class _NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: _NamedFunction


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None  # {"name", "schema"} for json_schema


class StructuredOutputs(_Body):
    """vLLM's `structured_outputs` (coordinator/structured_output.py): at most one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # a JSON schema
    regex: str | None = Field(default=None, min_length=1)
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None, min_length=1)
    grammar: str | None = Field(default=None, min_length=1)  # llguidance's Lark
    json_object: bool | None = None


TokenId = Annotated[int, Field(ge=0, le=MAX_COUNT)]
BiasKey = Annotated[str, Field(pattern=r"^[0-9]+$")]  # a token id, in decimal
Bias = Annotated[float, Field(ge=-MAX_BIAS, le=MAX_BIAS)]


class _OpenAIGeneration(_Body):
    model: str = Field(min_length=1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=16)  # choices per prompt (openai_api.MAX_N)
    max_tokens: int | None = Field(default=None, ge=0, le=MAX_COUNT)  # 0: with echo only
    max_completion_tokens: int | None = Field(default=None, ge=0, le=MAX_COUNT)
    temperature: float | None = Field(default=None, ge=0, le=100)
    top_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 63)
    frequency_penalty: float | None = Field(default=None, ge=-100, le=100)
    presence_penalty: float | None = Field(default=None, ge=-100, le=100)
    stop: str | list[str] | None = None
    top_k: int | None = Field(default=None, ge=-1, le=MAX_COUNT)  # vLLM's; -1 and 0: off
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, ge=0.001, le=100)
    response_format: ResponseFormat | None = None
    logit_bias: dict[BiasKey, Bias] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    # vLLM's extras (common/sampling_params.py)
    min_tokens: int | None = Count
    ignore_eos: bool | None = None
    speculative: bool | None = None  # tandem's: false opts out of speculative decoding
    cache: bool | None = None  # tandem's: the response cache may (true) or may not (false) answer
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    # vLLM's structured output; one grammar source per request, response_format included
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(default=None, min_length=1)
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(default=None,
                                                                            min_length=1)
    guided_grammar: str | None = Field(default=None, min_length=1)
    user: str | None = None
    # vLLM's: the request's own prefix-cache partition within its tenant (coordinator/tenants.py)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)


class ChatCompletionRequest(_OpenAIGeneration):
    """POST /v1/chat/completions."""

    messages: list[OpenAIMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # needs logprobs
    # As Ollama's think (coordinator/thinking.py): "none"/"minimal" off, a level on; the
    # thinking is message.reasoning_content
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


class CompletionRequest(_OpenAIGeneration):
    """POST /v1/completions: a prompt, or a list of them (at most 64 choices: prompts times n)."""

    prompt: Union[Annotated[str, Field(min_length=1)], Annotated[list[int], Field(min_length=1)],
                  Annotated[list[Annotated[str, Field(min_length=1)]],
                            Field(min_length=1, max_length=64)],
                  Annotated[list[Annotated[list[int], Field(min_length=1)]],
                            Field(min_length=1, max_length=64)]]
    echo: bool | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class OpenAIEmbeddingRequest(_Body):
    """POST /v1/embeddings."""

    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None  # 1..the hidden size: truncated and re-normalized
    user: str | None = None
    pooling: PoolingName | None = None

class ResponsesInputPart(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class ResponsesInputMessage(_Body):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ResponsesInputPart]


class ResponsesFunctionCall(_Body):
    """An earlier call of the model's, sent back with its result."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str  # a JSON object, as a string


class ResponsesFunctionCallOutput(_Body):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str


class ResponsesFunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedTool(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1)


class ResponsesTextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # json_schema: required
    strict: bool | None = None


class ResponsesText(_Body):
    format: ResponsesTextFormat | None = None


class ResponsesRequest(_Body):
    """POST /v1/responses (coordinator/responses_api.py): text in, text or function calls out,
    optionally under a JSON schema."""

    model: str = Field(min_length=1)
    input: Annotated[str, Field(min_length=1)] | Annotated[
        list[Union[ResponsesInputMessage, ResponsesFunctionCall, ResponsesFunctionCallOutput]],
        Field(min_length=1)]
    instructions: str | None = None
    stream: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_COUNT)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | ResponsesNamedTool | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesText | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


# ---- vLLM's tokenizer endpoints (coordinator/token_routes.py) -----------------------------------

class TokenizeRequest(_Body):
    """POST /tokenize: exactly one of `prompt` and `messages`; `model` may be left out while
    one model is served (coordinator/token_routes.py)."""

    model_config = ConfigDict(extra="allow", json_schema_extra={
        "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})

    model: str | None = Field(default=None, min_length=1)
    prompt: str = ""
    messages: list[OpenAIMessage] = Field(default_factory=list, min_length=1)
    tools: list[Tool] | None = None
    add_special_tokens: bool = True  # BOS by the model's rule
    add_generation_prompt: bool = True  # messages only
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    """POST /detokenize (`model` as /tokenize's)."""

    model: str | None = Field(default=None, min_length=1)
    tokens: list[Annotated[int, Field(ge=0)]]


# (method, path) -> the model of its JSON body
REQUEST_BODIES: dict[tuple[str, str], type[BaseModel]] = {
    ("post", "/api/chat"): ChatRequest,
    ("post", "/api/generate"): GenerateRequest,
    ("post", "/api/show"): ModelName,
    ("post", "/api/pull"): PullRequest,
    ("post", "/api/copy"): CopyRequest,
    ("post", "/api/create"): CreateRequest,
    ("delete", "/api/delete"): ModelName,
    ("post", "/api/embed"): EmbedRequest,
    ("post", "/api/embeddings"): EmbeddingsRequest,
    ("post", "/v1/chat/completions"): ChatCompletionRequest,
    ("post", "/v1/completions"): CompletionRequest,
    ("post", "/v1/embeddings"): OpenAIEmbeddingRequest,
    ("post", "/v1/responses"): ResponsesRequest,
    ("post", "/tokenize"): TokenizeRequest,
    ("post", "/detokenize"): DetokenizeRequest,
}
