"""Progress of a long loop: one line per running job, and one line when it ends.

    with Progress(total=n, desc="finetune@bbc", unit="step") as bar:
        ...
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")

What it prints, on stderr, depends on where stderr goes (CRUCIBLE_PROGRESS=bars|lines|off forces one):

- a terminal ("bars"): a tqdm bar on a line of its own while the job runs. Jobs that run at the same
  time in one process (the flow runs embed@bbc and embed@rotten side by side in threads) each take the
  lowest free line, so their bars never share one. When a job ends its bar goes and its summary line
  is printed above the bars still running.
- anything else ("lines": a log file, CI, `2> file`): no bar, whose carriage returns would fill a log;
  the same summary line when the job ends, and a line every CRUCIBLE_PROGRESS_EVERY seconds (default
  60) while a long job runs, so a log shows that it is alive.
- "off": nothing.

A summary line reads `finetune@bbc: 6/6 step in 8.1 s (0.74 step/s) ex_s=7.4 loss=0.6890`.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Iterable, Iterator

MODES = ("bars", "lines", "off")
_lock = threading.Lock()
_lines_taken: set[int] = set()  # the terminal lines that running bars hold (0 = the first below the text)


def mode() -> str:
    """'bars', 'lines' or 'off': CRUCIBLE_PROGRESS if set, else bars on a terminal, lines elsewhere."""
    forced = os.environ.get("CRUCIBLE_PROGRESS", "").strip().lower()
    if forced in MODES:
        return forced
    try:
        tty = sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # a replaced or closed stream
        tty = False
    return "bars" if tty and os.environ.get("TERM") != "dumb" else "lines"


def _every() -> float:
    try:
        return float(os.environ.get("CRUCIBLE_PROGRESS_EVERY", "60"))
    except ValueError:
        return 60.0


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def _rate(n: float, seconds: float, unit: str) -> str:
    if n <= 0 or seconds <= 0:
        return ""
    per_second = n / seconds
    return f"{per_second:.2f} {unit}/s" if per_second >= 1 else f"{1 / per_second:.2f} s/{unit}"


class Progress:
    """A progress bar or a summary line (see the module's doc). Use it like tqdm: `update(k)`,
    `set_postfix(**values)`, `close()`, as a context manager, or wrapped around an iterable."""

    def __init__(
        self,
        iterable: Iterable | None = None,
        *,
        total: int | None = None,
        desc: str = "",
        unit: str = "it",
        initial: int = 0,
        disable: bool = False,
    ):
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except TypeError:
                total = None
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.n = self._start_n = initial
        self.postfix: dict[str, object] = {}
        self.start = self._last_line = time.perf_counter()
        self.mode = "off" if disable else mode()
        self.line: int | None = None
        self._bar = None
        self._closed = False
        self._end: float | None = None
        if self.mode == "bars":
            from tqdm.auto import tqdm

            with _lock:
                self.line = min(set(range(len(_lines_taken) + 1)) - _lines_taken)
                _lines_taken.add(self.line)
            self._bar = tqdm(
                total=total,
                initial=initial,
                desc=desc,
                unit=unit,
                position=self.line,
                leave=False,
                dynamic_ncols=True,
                file=sys.stderr,
            )

    @property
    def elapsed(self) -> float:
        """Seconds since the start; after close(), up to the close."""
        return (self._end if self._end is not None else time.perf_counter()) - self.start

    def update(self, k: int = 1) -> None:
        self.n += k
        if self._bar is not None:
            self._bar.update(k)
        elif self.mode == "lines" and self.n != self.total and time.perf_counter() - self._last_line >= _every():
            # (not at the last step: the summary at close says it)
            self._last_line = time.perf_counter()
            self._write(self.summary(running=True))

    def set_postfix(self, **values) -> None:
        self.postfix = values
        if self._bar is not None:
            self._bar.set_postfix(**values)

    def summary(self, running: bool = False, stopped: bool = False) -> str:
        """The job as one line: what is done, in what time, at what rate, and the postfix values."""
        done = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        seconds = self.elapsed
        when = f"after {_duration(seconds)}" if running or stopped else f"in {_duration(seconds)}"
        rate = _rate(self.n - self._start_n, seconds, self.unit)
        extra = " ".join(f"{k}={v}" for k, v in self.postfix.items())
        head = f"{self.desc}: " if self.desc else ""
        tail = " (stopped)" if stopped else ""
        return (
            f"{head}{done} {self.unit} {when}" + (f" ({rate})" if rate else "") + (f" {extra}" if extra else "") + tail
        )

    def close(self, stopped: bool = False) -> None:
        if self._closed:
            return
        self._closed = True
        self._end = time.perf_counter()
        if self._bar is not None:
            self._bar.close()
            with _lock:
                _lines_taken.discard(self.line)
        if self.mode != "off":
            self._write(self.summary(stopped=stopped))

    def _write(self, line: str) -> None:
        from tqdm import tqdm

        tqdm.write(line, file=sys.stderr)  # above any running bars, never through one of them
        sys.stderr.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(stopped=exc_type is not None)

    def __iter__(self) -> Iterator:
        if self.iterable is None:
            raise TypeError("Progress: no iterable to iterate over")
        ok = False
        try:
            for item in self.iterable:
                yield item
                self.update(1)
            ok = True
        finally:
            self.close(stopped=not ok)

    def __del__(self):  # a bar dropped without close() must not keep its terminal line
        try:
            if not self._closed and self._bar is not None:
                self._bar.close()
                with _lock:
                    _lines_taken.discard(self.line)
        except Exception:
            pass
