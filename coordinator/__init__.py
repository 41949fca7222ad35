"""tandem's coordinator: the front door (HTTP APIs, chat template, tokenizer) and the global
scheduler (admission, placement, the request flow over prefill and decode workers, the worker
registry). It never imports torch.

    The core (no transport):
    config.py             CoordinatorConfig
    model.py              ServedModel: config + tokenizer + fingerprint, no weights
    model_catalog.py      the models served, by every name a request may use
    registry.py           workers, Registry gRPC servicer, liveness; a view per model
    placement.py          which decode worker, which prefill worker or none (pure)
    admission.py          bounded queue and concurrency limit (503 when full)
    residency.py          keep_alive: when the workers drop the model's weights, and reloading
    model_pool.py         one model's workers, admission, request flow and keep_alive
    request_flow.py       one request through the workers, as token ids
    text_stream.py        token ids -> text (detokenizer, stop strings)
    generation.py         one admitted request at the text level, timed
    logprobs.py           log probabilities in each API's shape
    metrics.py            Prometheus series and per-request timings
    convert.py            typed values <-> worker.proto messages
    service.py            Coordinator: all of the above as one object, with its background tasks

    Shared by the APIs:
    prompts.py            requests -> prompt token ids (chat template, raw, context)
    model_info.py         what tags/show/ps/ListModels say about each model
    tool_calls.py         tool-capable templates, call formats, the call parser
    structured_output.py  the APIs' format / response_format -> the workers' GrammarSpec
    access.py             the API key, the Host names served and the browser origins (CORS)
    api_tls.py            TLS of the HTTP and gRPC client APIs

    HTTP:
    routes.py             the route table: every method, path and handler
    http_api.py           the FastAPI app: error handlers, access checks, the table's routes
    ollama_request.py     Ollama's request bodies -> typed requests
    ollama_response.py    Ollama's response and NDJSON chunk shapes
    ollama_routes.py      Ollama's handlers (/, /api/version, tags, ps, show, chat, generate)
    openai_api.py         OpenAI's request parsing and response shapes (pure)
    openai_routes.py      OpenAI's handlers (/v1/models, chat completions, completions)
    model_routes.py       /api/pull, /api/copy, /api/create, /api/delete over the model store
    embedding_routes.py   /api/embed, /api/embeddings, /v1/embeddings
    token_routes.py       /tokenize, /detokenize, /tokenizer_info (vLLM's)
    ops_routes.py         /metrics, /health, /version, /internal/workers
    connection_limits.py  header/body/idle timeouts, connection caps (uvicorn's h11 protocol)
    http_stream.py        body limit, streams that notice a client leaving
    http_errors.py        an error in the shape of the API its path belongs to
    request_schemas.py    the request bodies as pydantic models, for the docs and the fuzzer
    openapi.py            /openapi.json with those bodies and each route's answers

    gRPC and the process:
    grpc_api.py           the client gRPC API (proto/tandem.proto) + health + reflection
    client.py             a Python client for the gRPC API (stubs: common/rpc/)
    server.py             the transports (Registry and client gRPC, HTTP) around one Coordinator
    __main__.py           the command line
"""
