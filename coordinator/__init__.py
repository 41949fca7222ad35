"""tandem's coordinator: the front door (HTTP APIs, chat template, tokenizer) and the global
scheduler (admission, placement, the request flow over prefill and decode workers, the worker
registry). It never imports torch.

    config.py         CoordinatorConfig
    model.py          ServedModel: config + tokenizer + fingerprint, no weights
    registry.py       workers, Registry gRPC servicer, liveness
    placement.py      which decode worker, which prefill worker or none (pure)
    admission.py      bounded queue and concurrency limit (503 when full)
    residency.py      keep_alive: when the workers drop the model's weights, and reloading them
    request_flow.py   one request through the workers, as token ids
    text_stream.py    token ids -> text (detokenizer, stop strings)
    generation.py     one admitted request at the text level, timed
    metrics.py        Prometheus series and per-request timings
    convert.py        typed values <-> worker.proto messages
    service.py        Coordinator: all of the above as one object
    prompts.py        requests -> prompt token ids (chat template, raw, context)
    model_info.py     what tags/show/ps/ListModels say about the model
    ollama_request.py / ollama_response.py / http_api.py   the Ollama HTTP API
    openai_api.py / openai_routes.py                        the OpenAI HTTP API
    http_stream.py    body limit, streams that notice a client leaving
    grpc_api.py       the client gRPC API (proto/tandem.proto) + health + reflection
    client.py         a Python client for the gRPC API
    rpc/              generated stubs of proto/tandem.proto
    server.py, __main__.py                                  the process
"""
