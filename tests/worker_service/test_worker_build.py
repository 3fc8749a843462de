"""How build_worker lays out memory: the KV pool is sized from what is left
once everything else that lives on the device exists."""

from __future__ import annotations

from worker_service import worker as worker_module
from worker_service.config import WorkerConfig
from worker_service.device.kv_cache import KvCache
from worker_service.worker import build_worker


def test_the_kv_pool_is_sized_after_the_attention_backend_and_the_sampler(monkeypatch):
    order: list[str] = []

    def recorded(name, fn):
        def call(*args, **kwargs):
            order.append(name)
            return fn(*args, **kwargs)

        return call

    class RecordedKv(KvCache):
        def __init__(self, *args, **kwargs) -> None:
            order.append("KvCache")
            super().__init__(*args, **kwargs)

    for name in ("_attention", "Sampler", "size_kv_pools"):
        monkeypatch.setattr(worker_module, name, recorded(name, getattr(worker_module, name)))
    monkeypatch.setattr(worker_module, "KvCache", RecordedKv)
    worker = build_worker(WorkerConfig(model="random:smollm2-135m", kv_memory="64MiB"))
    assert order.index("size_kv_pools") > max(order.index("_attention"), order.index("Sampler"))
    assert order.index("KvCache") > order.index("size_kv_pools")
    assert worker.num_pages > 0


def test_the_worker_reports_the_memory_it_holds_and_its_grammar_backend():
    worker = build_worker(WorkerConfig(model="random:smollm2-135m", kv_memory="64MiB"))
    params = sum(p.numel() for p in worker.runner.compute.model.parameters())
    assert worker.weight_bytes >= params * 2 and worker.weight_bytes > 100 << 20
    kv = worker.kv_cache_bytes
    assert 60 << 20 <= kv <= 68 << 20  # the 64 MiB asked for, one scratch page more
    assert worker.graph_bytes == 0  # no CUDA graphs on the CPU
    assert worker.grammar_backend == "none"  # a random model has no vocabulary to compile over
    simulated = build_worker(WorkerConfig(model="simulated", num_pages=8))
    assert (simulated.weight_bytes, simulated.kv_cache_bytes) == (0, 0)
    assert simulated.grammar_backend == "xgrammar"
