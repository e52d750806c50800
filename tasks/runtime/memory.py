"""The process's resident memory over a block of code, sampled by a thread: a stage's peak (logged to
its MLflow run) and a merge worker's per arrival."""

from __future__ import annotations

import threading

import psutil


class PeakRSS:
    """The process's resident memory over a block, sampled every 20 ms by a thread:
    `stage_peak_rss_mb` (the highest), `stage_rss_start_mb` and `stage_peak_rss_above_start_mb`.
    Under `crucible stage` / `dvc repro` the process runs one stage; under the flow's threads it is
    shared with the stages beside it, so the numbers bound this stage's from above. Children (the
    merge workers) are not included: they log their own peaks."""

    def __init__(self, every: float = 0.02):
        self.every, self.start, self.peak = every, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    @staticmethod
    def rss() -> int:
        """The process's resident set size now, in bytes."""
        return psutil.Process().memory_info().rss

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, self.rss())

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    def metrics(self) -> dict[str, float]:
        return {
            "stage_peak_rss_mb": self.peak / 2**20,
            "stage_rss_start_mb": self.start / 2**20,
            "stage_peak_rss_above_start_mb": (self.peak - self.start) / 2**20,
        }
