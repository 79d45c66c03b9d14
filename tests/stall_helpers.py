"""What tests/test_stalls.py's loader workers import by name (a fork server's workers import their dataset's
module; a test module would import pytest's fixtures with it)."""
from __future__ import annotations

import threading

from torch.utils.data import IterableDataset

# a lock of a module's own: held by another thread of the parent at the instant of a fork, it stays held in
# the child forever (the class of the trainer's hang: CPython's thread-state lock in PyOS_AfterFork_Child)
LOCK = threading.Lock()


class NeedsTheLock(IterableDataset):
    """Four samples, read under LOCK (as a logging handler, an allocator or an import would take one)."""

    def __iter__(self):
        with LOCK:
            yield from range(4)
