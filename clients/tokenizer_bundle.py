"""The model's tokenizer as the server ships it (GetTokenizer: a zip of
tokenizer.json, tokenizer_config.json with the chat template, ...)."""

from __future__ import annotations

import json
from collections.abc import Iterable

import jinja2
from tokenizers import Tokenizer

from common import tokenizer_archive


class TokenizerBundle:
    def __init__(self, files: dict[str, bytes]) -> None:
        if "tokenizer.json" not in files:
            raise ValueError("the server's tokenizer bundle has no tokenizer.json")
        self.tokenizer = Tokenizer.from_str(files["tokenizer.json"].decode())
        cfg = json.loads(files.get("tokenizer_config.json", b"{}"))
        self.config = cfg
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and "chat_template.jinja" in files:
            template = files["chat_template.jinja"].decode()
        self.chat_template = template
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))

    @classmethod
    def from_chunks(cls, chunks: Iterable[tokenizer_archive.Chunk]) -> TokenizerBundle:
        """From GetTokenizer's stream (ValueError if it is corrupt)."""
        return cls(tokenizer_archive.unpack(tokenizer_archive.join(chunks)))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def chat_text(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt")
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of the messages through the chat template (special tokens
        in the template are parsed, no BOS is added twice)."""
        return self.tokenizer.encode(self.chat_text(messages), add_special_tokens=False).ids


def _token_text(tok: object) -> str:
    if isinstance(tok, dict):
        return str(tok.get("content", ""))
    return str(tok or "")


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
