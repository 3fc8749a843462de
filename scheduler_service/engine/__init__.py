"""The core process: the Scheduler's loop (loop.py) between the pipe from the
API process and the Execute streams to the worker group, with worker-loss
recovery, request tracing and stop strings. ``main.core_main`` is its entry
point, spawned by the API process (scheduler_service/api/core_client.py)."""
