"""Benchmarks, run from a checkout as `python -m benchmarks.NAME` (not shipped in the wheel).

    bench_engine     decode/prefill steps per format and dispatch level, GB/s against a copy
    bench_modes      serving modes (colocated, disaggregated) on equal cores
    bench_peer       tandem serve against llama-server, alternating, same workload
    bench_attention  attention kernels       bench_linear  linear kernels
    bench_kvtransfer KV transfer backends against a memory copy
    quality          perplexity and top-1 agreement per weight format
    device_check     the prepared script for a lent GPU machine
"""
