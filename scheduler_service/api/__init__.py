"""The API process: the public gRPC server (sglang.grpc.scheduler), request
validation and tokenization, one coroutine per client stream, metrics, KV
events and auth. It reaches the core process only through the pipe of
``core_client.py``, which spawns it (scheduler_service/engine/)."""
