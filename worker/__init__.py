"""The worker runtime: the process around an engine, shared by prefill_node and decode_node.

    runtime.py      process-level settings (torch threads, malloc), applied once at entry
    engine_loop.py  the engine's own thread: schedule -> execute -> update, fed by the gRPC side
    node_server.py  a worker's arguments, gRPC server, registration, heartbeats, auth

It sits above engine/ and kvtransfer/ and below the node packages.
"""
