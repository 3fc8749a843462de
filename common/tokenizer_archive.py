"""The tokenizer archive: the model's tokenizer files (tokenizer.json,
tokenizer_config.json with the chat template, ...) as one zip, streamed by
``GetTokenizer`` on both services in chunks whose last one carries the
sha256 of the whole. The worker packs it from the model, the scheduler passes
it on (or packs a local directory), clients and the scheduler unpack it."""

from __future__ import annotations

import hashlib
import io
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

TOKENIZER_JSON = "tokenizer.json"
_FIXED_TIME = (2020, 1, 1, 0, 0, 0)  # the same files make the same bytes


class ArchiveError(ValueError):
    """The archive is corrupt or not a tokenizer archive."""


class Chunk(Protocol):
    """A GetTokenizer chunk of either service's stubs."""

    data: bytes
    sha256: str


def pack(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in sorted(files):
            zf.writestr(
                zipfile.ZipInfo(name, date_time=_FIXED_TIME), files[name], zipfile.ZIP_DEFLATED
            )
    return buf.getvalue()


def pack_directory(path: Path) -> bytes:
    """The archive of a directory's files (a local --tokenizer directory)."""
    return pack({f.name: f.read_bytes() for f in sorted(path.iterdir()) if f.is_file()})


def unpack(archive: bytes) -> dict[str, bytes]:
    try:
        with zipfile.ZipFile(io.BytesIO(archive)) as zf:
            return {name: zf.read(name) for name in zf.namelist()}
    except zipfile.BadZipFile as e:
        raise ArchiveError(f"the tokenizer archive is not a zip: {e}") from e


def chunks(archive: bytes, size: int) -> Iterator[tuple[bytes, str]]:
    """(data, sha256) pieces for GetTokenizer; only the last carries the digest."""
    digest = hashlib.sha256(archive).hexdigest()
    for start in range(0, len(archive), size):
        last = start + size >= len(archive)
        yield archive[start : start + size], digest if last else ""


def join(pieces: Iterable[Chunk]) -> bytes:
    """The archive from GetTokenizer's chunks, checked against the digest."""
    pieces = list(pieces)
    data = b"".join(c.data for c in pieces)
    if not pieces or hashlib.sha256(data).hexdigest() != pieces[-1].sha256:
        raise ArchiveError("the tokenizer archive is corrupt (sha256 mismatch)")
    return data
