"""The file tier's store: KV pages in local files, one file a page, named
by the page's chained block hash (the scheduler's ``chain_page_hashes``, the
same hash its KV events and the gateway's cache-aware routing use), so a
restarted worker process, or another unit on the same node, finds a prefix
it never computed.

Layout: ``<root>/<fingerprint tag>/<hash as 16 hex digits>.kv``. The tag is
a digest of everything that makes a page's bytes mean something
(``KvLayout``: model identity, dtype, page size, layers, KV heads, head dim,
tensor-parallel rank and size), so a different model or layout looks in
another folder and never reads these pages; the header repeats the full
digest, so a file copied into the wrong folder is refused too.

A file is a fixed header (magic, version, layout digest, block hash,
payload length, blake2b-128 of the payload) and the payload, the page's
bytes exactly. Every read checks all of it: a missing, truncated, corrupt,
foreign or misnamed file is a miss (None, logged), never bytes. Writes go
to a unique temporary name in the same folder, then ``os.replace``: a
reader sees the whole old file, the whole new one or none; a writer that
died mid-way leaves only a temporary file, which no read opens and the
next eviction pass removes once it is old.

Size cap: the folder is kept under ``max_bytes``. Each process counts what
it wrote since it last looked; when the count says the cap is passed it
scans the folder and unlinks the least recently used files (by mtime: a
write of an existing page and every successful read touch it) down to 90%
of the cap (so the folder may pass the cap by what other processes wrote
since this one last looked; the next pass of any of them brings it back).
A file that fails its read is unlinked, so a later write replaces it. Two
processes on one folder are safe: names are unique per
write, replace is atomic, an unlink under an open reader leaves its
descriptor readable, and every file-not-found on the way is a miss or a
no-op.

Pure numpy and the standard library (no torch, no gRPC): a page is any
C-contiguous buffer of ``page_nbytes`` bytes (a numpy array, or a CPU
tensor's ``.numpy()`` view); ``read`` returns uint8 bytes for the caller to
view in its dtype, ``read_into`` fills the caller's buffer in place.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import astuple, dataclass
from pathlib import Path

import numpy as np
import structlog

logger = structlog.get_logger(__name__)

MAGIC = b"RSKV"
VERSION = 1
# magic, version, reserved, layout digest (16), block hash, payload bytes, payload digest (16)
_HEADER = struct.Struct("<4sHH16sqQ16s")
HEADER_SIZE = _HEADER.size
SUFFIX = ".kv"
_TMP_PREFIX = ".tmp-"
_TMP_MAX_AGE_S = 600.0  # a temporary file this old belongs to a dead writer
_LOW_WATER = 0.9


@dataclass(frozen=True, slots=True)
class KvLayout:
    """What a page's bytes depend on: a page written under one layout is
    never read under another."""

    model: str  # the model's identity (name and revision, or a weights digest)
    dtype: str  # the KV pages' dtype, e.g. "bfloat16", "float8_e4m3fn"
    page_size: int
    num_layers: int
    num_kv_heads: int  # this rank's heads
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1

    def digest(self) -> bytes:
        text = "\x1f".join(str(v) for v in astuple(self))
        return hashlib.blake2b(text.encode(), digest_size=16).digest()

    @property
    def tag(self) -> str:
        return self.digest().hex()


def _payload_digest(buf: memoryview) -> bytes:
    return hashlib.blake2b(buf, digest_size=16).digest()


def _key(block_hash: int) -> str:
    return f"{block_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def _hash_of(name: str) -> int | None:
    if not name.endswith(SUFFIX) or len(name) != 16 + len(SUFFIX):
        return None
    try:
        v = int(name[:16], 16)
    except ValueError:
        return None
    return v - (1 << 64) if v >= 1 << 63 else v


class KvFileStore:
    def __init__(self, root: str | Path, layout: KvLayout, page_nbytes: int, max_bytes: int):
        """``page_nbytes``: one page's bytes over all of this rank's layers;
        ``max_bytes``: the folder's cap (files and headers)."""
        if page_nbytes <= 0 or max_bytes < page_nbytes + HEADER_SIZE:
            raise ValueError("the file tier needs room for at least one page")
        self.layout = layout
        self.page_nbytes = page_nbytes
        self.max_bytes = max_bytes
        self.dir = Path(root) / layout.tag
        self.dir.mkdir(parents=True, exist_ok=True)
        self._digest = layout.digest()
        self._file_bytes = HEADER_SIZE + page_nbytes
        self._lock = threading.Lock()  # the estimate (writer threads)
        self._estimate = max_bytes  # the folder's bytes as last seen plus own writes: look first
        self.hits = self.misses = self.writes = self.evicted = 0

    def path(self, block_hash: int) -> Path:
        return self.dir / (_key(block_hash) + SUFFIX)

    # --------------------------------------------------------------- write
    def write(self, block_hash: int, page: np.ndarray | memoryview | bytes) -> bool:
        """Store ``page`` under ``block_hash`` (atomically); True if it is on
        disk now (written, or already there: then only its recency is
        renewed). False, logged, if the write failed."""
        buf = memoryview(page).cast("B")
        if buf.nbytes != self.page_nbytes:
            raise ValueError(f"a page of {buf.nbytes} bytes, the store holds {self.page_nbytes}")
        final = self.path(block_hash)
        try:
            os.utime(final)
            return True  # the same prefix's page: same bytes (a bad file is unlinked by its read)
        except OSError:
            pass
        header = _HEADER.pack(
            MAGIC, VERSION, 0, self._digest, block_hash, buf.nbytes, _payload_digest(buf)
        )
        tmp = self.dir / f"{_TMP_PREFIX}{os.getpid()}-{threading.get_ident()}-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(buf)
            os.replace(tmp, final)
        except OSError as e:
            logger.warning("kv file write failed", block_hash=block_hash, error=str(e))
            with contextlib.suppress(OSError):
                tmp.unlink()
            return False
        self.writes += 1
        with self._lock:
            self._estimate += self._file_bytes
            over = self._estimate >= self.max_bytes
        if over:
            self.evict()
        return True

    # ---------------------------------------------------------------- read
    def read(self, block_hash: int) -> np.ndarray | None:
        """The page stored under ``block_hash`` (uint8, ``page_nbytes``), or
        None: missing, truncated, corrupt, or written under another layout."""
        out = np.empty(self.page_nbytes, np.uint8)
        return out if self.read_into(block_hash, out) else None

    def read_into(self, block_hash: int, out: np.ndarray | memoryview) -> bool:
        """Fill ``out`` (``page_nbytes`` writable bytes) with the page; False
        on a miss (``out`` then holds anything: the caller must not use it)."""
        dst = memoryview(out).cast("B")
        if dst.nbytes != self.page_nbytes:
            raise ValueError(f"a buffer of {dst.nbytes} bytes for a {self.page_nbytes}-byte page")
        path = self.path(block_hash)
        why = self._read_checked(path, block_hash, dst)
        if why is not None:
            self.misses += 1
            if why == "missing":
                logger.debug("kv file miss", block_hash=block_hash, reason=why)
            else:  # garbage in this folder: say so, and let a later write replace it
                logger.warning("kv file miss", block_hash=block_hash, reason=why)
                _unlink(str(path))
            return False
        self.hits += 1
        with contextlib.suppress(OSError):  # evicted since: the bytes read are whole
            os.utime(path)
        return True

    def _read_checked(self, path: Path, block_hash: int, dst: memoryview) -> str | None:
        """None when ``dst`` holds the page, else why not."""
        try:
            with open(path, "rb", buffering=0) as f:
                head = f.read(HEADER_SIZE)
                if len(head) != HEADER_SIZE:
                    return "truncated header"
                magic, version, reserved, digest, stored_hash, n, check = _HEADER.unpack(head)
                if magic != MAGIC or version != VERSION or reserved:
                    return "not a kv file"
                if digest != self._digest:
                    return "another model or layout"
                if stored_hash != block_hash:
                    return "another block"
                if n != self.page_nbytes:
                    return "wrong page size"
                got = 0
                while got < n:
                    k = f.readinto(dst[got:])
                    if not k:
                        return "truncated payload"
                    got += k
                if f.read(1):
                    return "trailing bytes"
        except FileNotFoundError:
            return "missing"
        except OSError as e:
            return f"unreadable: {e}"
        if _payload_digest(dst) != check:
            return "checksum mismatch"
        return None

    # --------------------------------------------------------------- probe
    def contains(self, hashes: Iterable[int]) -> list[bool]:
        """Whether a file exists for each hash (not checked: a read may still
        miss)."""
        return [self.path(h).exists() for h in hashes]

    def stored_hashes(self) -> np.ndarray:
        """Every block hash with a file here (int64): what a worker reports
        when a session opens, so the scheduler can prefetch from them."""
        found: list[int] = []
        try:
            with os.scandir(self.dir) as it:
                for entry in it:
                    h = _hash_of(entry.name)
                    if h is not None:
                        found.append(h)
        except FileNotFoundError:
            pass
        return np.array(found, dtype=np.int64)

    # ---------------------------------------------------------------- evict
    def evict(self) -> int:
        """Bring the folder under 90% of the cap, least recently used files
        first; remove dead writers' temporary files. Returns files removed."""
        now = time.time()
        files: list[tuple[float, int, str]] = []
        total = 0
        try:
            with os.scandir(self.dir) as it:
                for entry in it:
                    try:
                        st = entry.stat()
                    except FileNotFoundError:
                        continue
                    if entry.name.startswith(_TMP_PREFIX):
                        if now - st.st_mtime > _TMP_MAX_AGE_S:
                            _unlink(entry.path)
                        continue
                    if _hash_of(entry.name) is None:
                        continue
                    files.append((st.st_mtime, st.st_size, entry.path))
                    total += st.st_size
        except FileNotFoundError:
            return 0
        removed = 0
        target = int(self.max_bytes * _LOW_WATER)
        if total > self.max_bytes:
            files.sort()
            for _, size, path in files:
                if total <= target:
                    break
                if _unlink(path):
                    removed += 1
                total -= size
        self.evicted += removed
        with self._lock:
            self._estimate = total
        return removed

    def clear(self) -> None:
        """Remove every page of this layout."""
        with os.scandir(self.dir) as it:
            for entry in it:
                if _hash_of(entry.name) is not None or entry.name.startswith(_TMP_PREFIX):
                    _unlink(entry.path)
        with self._lock:
            self._estimate = 0


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
