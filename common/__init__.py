"""tandem's torch-free shared layer: what the coordinator, the workers and the CLI all need.

It imports nothing of tandem's but itself (and never torch), so every other package may
import it.

    errors.py          the error types every layer raises and maps to API statuses
    sampling_params.py SamplingParams: Ollama's options, validated ranges
    logprobs.py        LogprobSpec and the shapes of returned log-probabilities
    tokenizer.py       Tokenizer from a GGUF vocabulary or tokenizer.json
    chat_template.py   jinja2 chat templates rendered as Hugging Face renders them
    chat_template_choice.py  which template a model renders (flag, stored, shipped, own);
                       chat_templates/ holds the shipped ones (SmolLM2 with tools)
    detokenizer.py     incremental detokenization that never splits a UTF-8 character
    stop_strings.py    stop strings across token boundaries
    grammar_compile.py structured-output specs -> llguidance grammars (checked, not masked)
    block_hash.py      chained block hashes (prefix cache keys, prefix-aware routing)
    model_config.py    ModelConfig: a model's shape
    model_files.py     a model path's format and config from metadata alone
    gguf_metadata.py   GGUF header reader   hf_config.py   config.json reader
    model_identity.py  the model fingerprint that workers and coordinators compare
    model_store.py     names -> model files ($TANDEM_HOME); model_pull.py fetches them
    cluster_auth.py    the internal plane's credentials and call proofs (refused_calls.py counts refusals)
    grpc_guard.py      malformed protobuf -> INVALID_ARGUMENT on every gRPC server
    grpc_server.py     every gRPC server: no SO_REUSEPORT, a bind error naming the port
    rpc/               generated stubs of proto/worker.proto and proto/tandem.proto
    wire.py            typed values <-> worker.proto messages shared by both sides
"""
