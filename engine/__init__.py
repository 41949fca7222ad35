"""tandem's inference core: the one engine both workers run, with a role (prefill, decode or
colocated), as vLLM and SGLang do.

    config.py          EngineConfig, CacheConfig, SchedulerConfig, weight formats
    request.py         Request and its states       block_manager.py  the paged KV pool
    scheduler.py       one token budget per pass    kv_connector.py   the KV transfer contract
    llm_engine.py      schedule -> execute -> update; step_output.py what a step returns,
                       step_logprobs.py its logprobs, kv_cache_sizing.py the cache's dtype and
                       blocks, draft_loading.py a speculative draft model
    model_runner.py, forward_batch.py, models/, loaders/, weights.py, rope.py   the forward pass
    sampler.py, grammar.py, embedding.py, generation.py, cuda_graphs.py, device.py

Torch-free modules (request, block_manager, scheduler, kv_connector, config) are importable
without torch; everything under models/, loaders/ and the runner needs it. It imports only
kernels/ and common/.
"""
