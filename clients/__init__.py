"""Clients of radixserve and the workloads the benchmarks drive through them."""
