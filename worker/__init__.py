"""The worker runtime: the process around an engine, shared by prefill_node and decode_node.

    runtime.py      process-level settings (torch and native-kernel threads, malloc), applied once at entry
    engine_loop.py  the engine's own thread: schedule -> execute -> update, fed by the gRPC side
    flags.py        the flags shared with `tandem run`/`tandem serve`, and a worker's parser
    config.py       WorkerConfig: built once from those flags, holding the EngineConfig
    node_server.py  a worker's entry point, gRPC server, registration, heartbeats, auth

It sits above engine/ and kvtransfer/ and below the node packages.
"""
