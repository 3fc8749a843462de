"""Plan execution: ``plan.py`` (the worker's plan and result types),
``convert.py`` (to and from the protocol), ``validation.py`` (a plan checked
before any of it applies), ``request_state.py`` (what the worker keeps per
request), ``model_runner.py`` (plans in order), and the computes that run a
step: ``model_compute.py`` (the real model, with ``cuda_graphs.py``) and
``simulated_compute.py`` (``--model simulated``)."""
