"""The public API's protobuf messages (smg-grpc-proto's sglang.grpc.scheduler)
<-> the scheduler's dataclasses: requests in (public.py), responses out
(responses.py), KV events out (kv_events.py). The worker protocol's
counterpart is scheduler_service/engine/worker_codec.py."""
