"""A `crucible run`'s log file: everything the flow and its stages log, and a failure's traceback,
in `.crucible/logs/run-<UTC time>.log`, while the console gets one `error:` line per failed stage
(flows/run_cli.py), as `crucible stage` prints it.

Prefect logs a failed task or flow run with its traceback at ERROR; during a `crucible run` those
records (loggers `prefect.*` at ERROR, and any record that carries a traceback) go to the file only.
Every other record reaches the console as before. The last `KEEP` logs are kept.
"""

from __future__ import annotations

import logging
import time
import traceback
from pathlib import Path

KEEP = 20


class _ConsoleFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("prefect") and (record.levelno >= logging.ERROR or record.exc_info):
            return False
        return True


class RunLog:
    """`with RunLog(root) as log: ...; log.record(exc)`."""

    def __init__(self, root: Path | str):
        folder = Path(root) / ".crucible" / "logs"
        folder.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        self.path = folder / f"run-{stamp}.log"
        n = 1
        while self.path.exists():
            n += 1
            self.path = folder / f"run-{stamp}-{n}.log"
        self._file: logging.FileHandler | None = None
        self._filter = _ConsoleFilter()
        self._filtered: list[logging.Handler] = []

    def __enter__(self) -> "RunLog":
        root = logging.getLogger()
        self._file = logging.FileHandler(self.path, encoding="utf-8")
        self._file.setLevel(logging.INFO)
        self._file.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
        for handler in root.handlers:
            handler.addFilter(self._filter)
            self._filtered.append(handler)
        root.addHandler(self._file)
        return self

    def record(self, exc: BaseException) -> None:
        """The exception's traceback, at the end of the log."""
        with self.path.open("a", encoding="utf-8") as out:
            out.write("\n" + "".join(traceback.format_exception(exc)))

    def __exit__(self, *exc) -> None:
        root = logging.getLogger()
        for handler in self._filtered:
            handler.removeFilter(self._filter)
        if self._file is not None:
            root.removeHandler(self._file)
            self._file.close()
        logs = sorted(self.path.parent.glob("run-*.log"), key=lambda p: p.stat().st_mtime)
        for old in logs[:-KEEP]:
            old.unlink(missing_ok=True)


def describe(exc: BaseException) -> str:
    """An error as one line: the message, without KeyError's quotes; an OSError that Python raised
    (no message of ours) as `<path>: <reason>`; MLflow's errors by their message."""
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    if isinstance(exc, OSError) and type(exc).__str__ is OSError.__str__ and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}" + (f" ({exc.filename2})" if exc.filename2 else "")
    message = getattr(exc, "message", None)
    return message if isinstance(message, str) else str(exc)
