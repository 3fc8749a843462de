"""The one place that knows both protobuf messages and the scheduler's dataclasses.

``worker``: the scheduler <-> worker protocol (radixserve.worker.v1);
``public``: the public API (sglang.grpc.scheduler, smg-grpc-proto's stubs).
"""
