"""The worker's gRPC face: ``server.py`` (the server, its health and metrics
endpoints), ``servicer.py`` (the Worker service's RPCs), ``session.py`` (which
Execute stream owns the worker), ``call_guard.py`` (the interceptor: token,
undecodable requests, bounded calls), ``call_budget.py`` (the thread budget
behind those bounds), ``request_decoding.py`` (the lenient deserializer).
Plans it receives are run by ``execution/``."""
