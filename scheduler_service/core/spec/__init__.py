"""Speculative decoding on the scheduler's side: draft sources, a request's
adaptive draft length, drafted rows in a plan, and settling their results."""
