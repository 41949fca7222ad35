"""The prefill worker process: a gRPC server around an engine in the prefill role, with KV
senders to the decode workers. See worker.py for a request's life cycle on this node."""
