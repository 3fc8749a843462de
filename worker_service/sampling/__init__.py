"""The worker's sampler: ``rows.py`` (what a step samples from and gives back),
``sampler.py`` (one call per step), ``processors.py`` (bias, penalties,
min-new masking), ``filters.py`` (top-k/p, min-p, the draw, seeded uniforms),
``logprobs.py`` (raw logprobs, also of prompts)."""
