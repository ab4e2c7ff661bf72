"""Reading files ahead of use, so that later random reads find them in the page cache."""

import os
from pathlib import Path


def read_whole(file: Path | str) -> int:
    """Read a file start to end in large sequential reads (into one reused buffer, nothing kept);
    returns the bytes read. A file that vanished or cannot be read counts 0: whoever uses it later
    says what is wrong."""
    done = 0
    try:
        with open(file, "rb", buffering=0) as handle:
            buffer = bytearray(min(4 << 20, max(1, os.fstat(handle.fileno()).st_size)))
            while count := handle.readinto(buffer):
                done += count
    except OSError:
        pass
    return done
