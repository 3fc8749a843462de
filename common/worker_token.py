"""The shared worker token: what a scheduler shows a worker when mutual TLS is
off (both read the same file, ``--worker-token-file``, once at start).

The scheduler sends it as ``authorization: Bearer TOKEN`` metadata on every
Worker RPC; the worker compares it in constant time. A worker without a token
accepts any caller (run it on a private network or with mutual TLS).
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

METADATA_KEY = "authorization"
SCHEME = "Bearer "


class TokenFileError(RuntimeError):
    """The token file is missing, unreadable or empty."""


def read_token(path: str) -> str:
    """The token in ``path`` (surrounding whitespace stripped)."""
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise TokenFileError(f"cannot read the worker token file {path}: {e}") from e
    if not token:
        raise TokenFileError(f"the worker token file {path} is empty")
    if any(c.isspace() for c in token) or not token.isprintable():
        raise TokenFileError(f"the worker token in {path} must be one word of printable characters")
    return token


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata a scheduler sends (none without a token)."""
    return () if token is None else ((METADATA_KEY, SCHEME + token),)


class TokenCheck:
    """The worker's side: whether a call's metadata carries the token."""

    def __init__(self, token: str) -> None:
        self._digest = hashlib.sha256(token.encode()).digest()

    def accepts(self, invocation_metadata: object) -> bool:
        presented = ""
        for key, value in invocation_metadata or ():
            if key == METADATA_KEY and isinstance(value, str):
                scheme, _, rest = value.strip().partition(" ")
                if scheme.lower() == "bearer":
                    presented = rest.strip()
        digest = hashlib.sha256(presented.encode()).digest()
        return hmac.compare_digest(digest, self._digest) and bool(presented)
