"""The decode worker process: a gRPC server around an engine in the decode (or colocated)
role, with a KV receiver. See worker.py for a request's life cycle on this node."""
