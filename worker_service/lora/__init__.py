"""Multi-LoRA serving on the worker: PEFT adapters read into memory (this
rank's shard), held by name and by adapter slot, and applied per step to the
token rows of the requests that use them, never merged into the base weights.

- peft_config.py  adapter_config.json: what is supported, the scale, targets
- targets.py      the model side: which projections, their shapes and shards
- adapter.py      LoraAdapter (per-layer A/B shards) and load_lora_adapter
- loaders.py      AdapterLoader (LoadAdapter's reader); the simulated worker's
                  config-only loader (the real model's: models/lora_loader.py)
- store.py        AdapterStore: loaded adapters by name, adapter slots, one lock
- batch.py        LoraBatch: a step's token rows grouped by adapter; the deltas
"""
