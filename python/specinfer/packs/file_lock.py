"""An exclusive advisory lock on a file (fcntl.flock), shared by threads and processes alike."""
from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if absent) for the duration of the block.

    flock locks belong to an open file description, so each call opens its own: two threads of
    one process exclude each other exactly as two processes do. The lock file is never deleted;
    unlinking it while another waiter holds it open would let a third caller lock a new inode.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the description releases the lock
