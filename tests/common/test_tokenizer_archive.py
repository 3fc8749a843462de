"""The tokenizer archive GetTokenizer streams (common/tokenizer_archive.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from common import tokenizer_archive as ta


@dataclass
class Piece:
    data: bytes
    sha256: str


FILES = {"tokenizer.json": b'{"a": 1}' * 500, "tokenizer_config.json": b"{}"}


def test_pack_is_deterministic_and_unpacks_to_the_same_files(tmp_path):
    archive = ta.pack(FILES)
    assert ta.pack(dict(reversed(FILES.items()))) == archive
    assert ta.unpack(archive) == FILES
    for name, data in FILES.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "sub").mkdir()  # directories are not files of the archive
    assert ta.pack_directory(tmp_path) == archive


def test_chunks_join_back_and_only_the_last_carries_the_digest():
    archive = ta.pack(FILES)
    pieces = [Piece(d, s) for d, s in ta.chunks(archive, 100)]
    assert len(pieces) > 2 and all(p.sha256 == "" for p in pieces[:-1]) and pieces[-1].sha256
    assert ta.join(pieces) == archive


def test_a_damaged_or_empty_stream_is_refused():
    pieces = [Piece(d, s) for d, s in ta.chunks(ta.pack(FILES), 100)]
    pieces[1] = Piece(b"x" + pieces[1].data[1:], "")
    with pytest.raises(ta.ArchiveError, match="sha256"):
        ta.join(pieces)
    with pytest.raises(ta.ArchiveError):
        ta.join([])
    with pytest.raises(ta.ArchiveError, match="not a zip"):
        ta.unpack(b"not a zip at all")
