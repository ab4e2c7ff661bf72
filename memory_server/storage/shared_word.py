"""One 64-bit integer that every process of this machine sees at once: a small memory-mapped file."""

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

log = logging.getLogger("memory_server")


class SharedWord:
    """An integer in an 8-byte file, mapped into memory: reading it costs ~0.2 µs and no system
    call, and a change made by any process that maps the file (or writes it) is seen by all of them
    at the next read (the pages of a shared mapping are the file's own page cache). Changes take an
    exclusive lock on the file, so that two processes changing it at once cannot lose one change.

    For what a request checks every time and changes rarely (HeadHint, the key cache's revocation
    count): a `stat` or a database query in its place lets go of the interpreter's lock, and under
    load getting it back waits for another thread."""

    SIZE = 8

    def __init__(self, path: Path | str):
        import fcntl
        import mmap

        self._fcntl = fcntl
        self.path = str(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < self.SIZE:
                os.ftruncate(fd, self.SIZE)  # zeros
            self._map = mmap.mmap(fd, self.SIZE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        # One aligned 8-byte word, read and written whole (a single load or store on the processors
        # this runs on): a reader never sees half of a write.
        self._word = np.frombuffer(self._map, dtype=np.int64, count=1)

    @classmethod
    def open(cls, path: Path | str, purpose: str) -> "SharedWord | None":
        """The word at `path`, or None where it cannot be had (a platform without `fcntl` and
        `mmap`, a file this user may not write): `purpose` says in the warning what is lost."""
        if os.name != "posix":
            return None
        try:
            return cls(path)
        except OSError as exc:
            log.warning("cannot map %s (%s): %s", path, exc.strerror or exc, purpose)
            return None

    def read(self) -> int:
        return int(self._word[0])

    def raise_to(self, value: int) -> None:
        """Set the word to `value` if that is more (never lower it)."""
        if value <= self.read():
            return
        with self._locked():
            if value > self._word[0]:
                self._word[0] = value

    def add(self, amount: int = 1) -> int:
        """Add to the word; returns the new value."""
        with self._locked():
            self._word[0] += amount
            return int(self._word[0])

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._fcntl.flock(self._fd, self._fcntl.LOCK_EX)
        try:
            yield
        finally:
            self._fcntl.flock(self._fd, self._fcntl.LOCK_UN)

    def close(self) -> None:
        del self._word  # the map cannot close while a view of it is alive
        self._map.close()
        os.close(self._fd)
