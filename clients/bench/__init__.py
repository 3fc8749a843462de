"""radixserve-bench: a serving benchmark (workloads, drivers, report, baseline)."""
