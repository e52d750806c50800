"""Wall-clock timing of a block of code: a stage's timings go to its MLflow run, never to a
DVC-tracked file (they change from run to run)."""

from __future__ import annotations

import time
from contextlib import contextmanager


@contextmanager
def timed(seconds: dict, key: str):
    """Wall seconds of the block into seconds[key] (a stage's timings go to its MLflow run, never to a
    DVC-tracked file: they change from run to run)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[key] = time.perf_counter() - start


class Clock:
    """Seconds since it was made (a stage reports them beside its result)."""

    def __init__(self):
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start
