"""A request's grammar (kind, text) as the worker protocol's ``Grammar``: sent
with the request's sampling parameters by the core process (worker_codec.py)
and ahead of the request by the API process (api/grammar_check.py)."""

from __future__ import annotations

from protos import worker_pb2 as pb

GRAMMAR_KINDS_TO_PROTO = {
    "regex": pb.GRAMMAR_KIND_REGEX,
    "json_schema": pb.GRAMMAR_KIND_JSON_SCHEMA,
    "ebnf": pb.GRAMMAR_KIND_EBNF,
    "structural_tag": pb.GRAMMAR_KIND_STRUCTURAL_TAG,
}


def grammar_to_proto(grammar: tuple[str, str], m: pb.Grammar) -> None:
    kind, text = grammar
    m.kind = GRAMMAR_KINDS_TO_PROTO[kind]
    m.text = text
