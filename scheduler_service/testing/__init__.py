"""Test and benchmark aids that are not part of the running service: the
in-process simulated worker, the oracle of the scheduler core's tests."""
