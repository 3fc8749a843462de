"""Incremental detokenization and stop-string trimming (pure Python + tokenizers).

Decoding token by token breaks multi-token characters and words that merge
across tokens, so text is released only once it is stable: decode the
tokens since the last emission together with the ones before it, emit what
grew past the earlier decode, and hold back an incomplete UTF-8 character
(U+FFFD at the end).
"""

from __future__ import annotations

from tokenizers import Tokenizer

CONTEXT_TOKENS = 5  # tokens decoded before the new ones, so merges are seen


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prompt_ids: list[int] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Start with a little of the prompt as context, so the first output
        # token decodes as it will within the whole text (e.g. a leading space).
        self.ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the text that became final."""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta


def trim_stop(text: str, matched: str | None, no_stop_trim: bool) -> str:
    """Cut the text at the stop string that ended it (and drop what follows),
    unless the client asked to keep it."""
    if not matched or no_stop_trim:
        return text
    at = text.find(matched)
    return text if at < 0 else text[:at]
