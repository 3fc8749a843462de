"""Checks of a landed join (prefill/decode disaggregation, decode unit): a
request whose prompt's KV was received from a prefill unit into pages the
scheduler names. The worker takes those pages as the slot's table without
computing anything; the first token (sampled by the prefill unit) is the
slot's last sampled token, which its first decode computes."""

from __future__ import annotations

from worker_service.execution.plan import Join


def landed_join_problem(
    j: Join,
    *,
    num_pages: int,
    page_size: int,
    vocab_size: int,
    max_context: int,
    two_pools: bool,
) -> str | None:
    """What is wrong with join ``j`` as a landed join (None: nothing, or it
    is a plain join)."""
    what = f"join of {j.rid}"
    if j.last_token is None:
        return f"{what}: kv_pages without last_token" if j.kv_pages else None
    if two_pools:
        return f"{what}: a landed join on a worker with a sliding-window pool (not supported)"
    if j.pooling:
        return f"{what}: an embedding request cannot land (it never decodes)"
    if not 0 <= j.last_token < vocab_size:
        return f"{what}: last_token {j.last_token} outside the vocabulary [0, {vocab_size})"
    n = len(j.prefix_ids)
    if n != j.prompt_len:
        return (
            f"{what}: a landed join's prefix_ids must be its whole prompt ({n} != {j.prompt_len})"
        )
    if n + 1 > max_context:
        return f"{what}: {n} prompt tokens and a sampled one exceed the context ({max_context})"
    pages = j.kv_pages
    need = -(-n // page_size)
    if len(pages) < need:
        return f"{what}: {len(pages)} kv_pages of {page_size} cannot hold {n} prompt positions"
    if len(pages) > need + 1:
        return f"{what}: {len(pages)} kv_pages for {n} prompt positions (at most {need + 1})"
    bad = [p for p in pages if not 0 <= p < num_pages][:5]
    if bad:
        return f"{what}: kv_pages outside the pool [0, {num_pages}): {bad}"
    if len(set(pages)) != len(pages):
        return f"{what}: kv_pages names a page twice"
    return None
