"""Reliability tools, run from a checkout as `python -m reliability.NAME` (not shipped).

    chaos (chaos_cluster, chaos_scenarios)  kill, freeze and cut real processes at each phase
    fault_proxy      a userspace TCP proxy that delays, drops, corrupts and cuts KV messages
    soak             above-capacity load with slow readers and disconnects; RSS sampled
    fuzz (fuzz_http, fuzz_inputs)           loaders, KV frames, protobuf, the HTTP schema
    model_factory    tiny random models (GGUF and Hugging Face) for tools and tests
"""
