"""The model worker service (issue 3): weights, KV pages, attention, sampling.

It never imports ``scheduler_service``; the two meet only in ``protos/``.
"""
