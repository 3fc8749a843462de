"""Plumbing shared by the scheduler and worker services: structlog set-up,
OpenTelemetry tracing set-up, and Prometheus metric helpers.

Imports neither torch nor grpc (the scheduler core's processes use it).
"""
