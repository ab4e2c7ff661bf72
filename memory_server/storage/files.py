"""Reading files ahead of use, so that later random reads find them in the page cache."""

import os
import subprocess
import sys
from pathlib import Path


def read_whole(file: Path | str) -> int:
    """Read a file start to end in large sequential reads (into one reused buffer, nothing kept);
    returns the bytes read. A file that vanished or cannot be read counts 0: whoever uses it later
    says what is wrong. Not for a file this process holds POSIX locks on: see read_whole_elsewhere."""
    done = 0
    try:
        with open(file, "rb", buffering=0) as handle:
            buffer = bytearray(min(4 << 20, max(1, os.fstat(handle.fileno()).st_size)))
            while count := handle.readinto(buffer):
                done += count
    except OSError:
        pass
    return done


def read_whole_elsewhere(file: Path | str) -> int:
    """read_whole in a child process: the page cache is shared, POSIX locks are not. Closing any
    descriptor of a file drops every POSIX (fcntl) lock its process holds on it, and SQLite locks
    its database file that way: a warm-up that opened and closed memory.db in the server process
    left the server's open connections without their shared lock, and the next process to close
    the database (`memory-server keys create`) checkpointed and deleted the WAL under them ("database
    disk image is malformed", writes no other process could see). Costs one interpreter start
    (57-72 ms on a slowed 2-core box)."""
    try:
        # This module as a script: the standard library alone, no site-packages to import.
        done = subprocess.run([sys.executable, "-I", "-S", __file__, str(file)], capture_output=True, text=True,
                              timeout=600, check=True)
        return int(done.stdout)
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


if __name__ == "__main__":
    print(read_whole(sys.argv[1]))
