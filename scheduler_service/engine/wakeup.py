"""Wakeup: lets gRPC threads wake the core loop while it waits on the API
process's pipe (a self-pipe: its read end is waited on beside the pipe)."""

from __future__ import annotations

import contextlib
import os


class Wakeup:
    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def fileno(self) -> int:
        return self._r

    def set(self) -> None:
        """From any thread: the loop's next wait returns at once."""
        with contextlib.suppress(BlockingIOError):  # full: a wakeup is pending anyway
            os.write(self._w, b"!")

    def clear(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)
