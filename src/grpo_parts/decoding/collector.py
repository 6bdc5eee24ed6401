"""Python's cyclic garbage collector paused for one decode loop."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for one decode loop, restored after (left off where
    the caller had turned it off). A decode step creates tensors freed by reference counting, not
    cycles, yet allocating them triggers collections of everything the process holds: in the main
    job a full collection inside a decode step cost more than the step, and the speculative
    sampler's measured step times, which choose its draft sizes, took it for the cost of
    speculating (docs/results.md; the log's "Robust step-time corrections, collector paused")."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
