"""tandem's shared engine: what the prefill and decode workers both run.

Torch-free modules (safe for the coordinator to import): config, errors, sampling_params,
tokenizer, chat_template, detokenizer, stop_strings, model_store, request, block_manager,
scheduler. Everything under models/, loaders/ and the runner needs torch.
"""
