"""The device and its memory: ``context.py`` (which device, selected per
thread; errors that break its context), ``dtypes.py``, ``transfer.py`` (host
<-> device copies that do not stall), ``distributed.py`` (the tensor-parallel
group), ``kv_cache.py`` (the KV page tensors)."""
