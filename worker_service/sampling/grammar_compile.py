"""One grammar compiled by xgrammar, by kind (regex, JSON schema, EBNF,
structural tag); ``GrammarError`` carries xgrammar's message without its
source location. Shared by the worker (the join fallback) and the compile
children (grammar_zygote.py), which import nothing else of the worker."""

from __future__ import annotations

import re
from typing import Any

KINDS = ("regex", "json_schema", "ebnf", "structural_tag")

_XGR_LOCATION = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")


class GrammarError(ValueError):
    """The grammar does not compile; the message is xgrammar's."""


def _clean(error: Exception) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return _XGR_LOCATION.sub("", text)


def compile_grammar(compiler: Any, kind: str, text: str) -> Any:
    """``text`` compiled by an xgrammar ``GrammarCompiler``; GrammarError if it
    does not compile."""
    try:
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "json_schema":
            return compiler.compile_json_schema(text)
        if kind == "ebnf":
            return compiler.compile_grammar(text)
        if kind == "structural_tag":
            return compiler.compile_structural_tag(text)
    except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own
        raise GrammarError(f"{kind}: {_clean(e)}") from None
    raise GrammarError(f"unknown grammar kind {kind!r}; one of {KINDS}")
