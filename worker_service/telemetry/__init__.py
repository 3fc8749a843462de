"""The worker's step telemetry: ``metrics.py`` (Prometheus), ``step_tracing.py``
(the executing thread's side of step spans), ``span_process.py`` (the process
that makes and exports them) and ``span_encoding.py`` (its OTLP encoder)."""
