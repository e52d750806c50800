"""crucible.progress: one line per job. Off a terminal a job prints one summary line when it ends (no
carriage returns, nothing interleaved), however many jobs run at once; on a terminal jobs that run
at once each hold a line of their own and give it back when they end."""

from __future__ import annotations

import io
import re
import threading

import pytest

from crucible import progress
from crucible.progress import Progress


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class Captured:
    """What the test wrote on stderr (pytest's capture: not a terminal, as a log file or a pipe)."""

    def __init__(self, capsys):
        self.capsys = capsys

    def getvalue(self) -> str:
        return self.capsys.readouterr().err


@pytest.fixture
def stderr(monkeypatch, capsys):
    monkeypatch.delenv("CRUCIBLE_PROGRESS", raising=False)
    monkeypatch.delenv("CRUCIBLE_PROGRESS_EVERY", raising=False)
    return Captured(capsys)


def test_mode_follows_stderr_and_the_override(monkeypatch, stderr):
    assert progress.mode() == "lines"
    monkeypatch.setattr("sys.stderr", Tty())
    monkeypatch.setenv("TERM", "xterm")
    assert progress.mode() == "bars"
    monkeypatch.setenv("TERM", "dumb")
    assert progress.mode() == "lines"
    for forced in ("bars", "lines", "off"):
        monkeypatch.setenv("CRUCIBLE_PROGRESS", forced)
        assert progress.mode() == forced


def test_concurrent_jobs_off_a_terminal_print_one_whole_line_each(stderr):
    start = threading.Barrier(4)

    def job(task: str) -> None:
        start.wait()
        with Progress(total=200, desc=f"embed@{task}", unit="text") as bar:
            for _ in range(200):
                bar.update(1)
                bar.set_postfix(loss="0.5")

    threads = [threading.Thread(target=job, args=(t,)) for t in ("bbc", "rotten", "tweets", "debates")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    text = stderr.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 4
    for task in ("bbc", "rotten", "tweets", "debates"):
        [line] = [ln for ln in lines if ln.startswith(f"embed@{task}: ")]
        assert re.fullmatch(rf"embed@{task}: 200/200 text in \d+\.\d s \(.+\) loss=0\.5", line), line


def test_a_long_job_off_a_terminal_says_it_is_alive_every_interval(monkeypatch, stderr):
    monkeypatch.setenv("CRUCIBLE_PROGRESS_EVERY", "0")
    with Progress(total=3, desc="finetune@bbc", unit="step") as bar:
        for _ in range(3):
            bar.update(1)
    lines = stderr.getvalue().splitlines()
    # a line per update here (the interval is 0 s), but not at the last step: the summary says it
    assert [ln.split(" after ")[0] for ln in lines[:2]] == [f"finetune@bbc: {i}/3 step" for i in (1, 2)]
    assert len(lines) == 3 and lines[2].startswith("finetune@bbc: 3/3 step in ")


def test_a_failed_job_is_marked_stopped_and_disable_prints_nothing(stderr):
    with pytest.raises(RuntimeError):
        for i in Progress(range(10), desc="merge: methods", unit="method"):
            if i == 4:
                raise RuntimeError("boom")
    [line] = stderr.getvalue().splitlines()
    assert re.fullmatch(r"merge: methods: 4/10 method after \d+\.\d s \(.+\) \(stopped\)", line), line
    with Progress(total=5, desc="quiet", disable=True) as bar:
        bar.update(5)
    assert stderr.getvalue() == ""
    assert bar.n == 5 and bar.elapsed >= 0


def test_concurrent_bars_on_a_terminal_hold_a_line_each_and_give_it_back(monkeypatch):
    tty = Tty()
    monkeypatch.setattr("sys.stderr", tty)
    monkeypatch.setenv("CRUCIBLE_PROGRESS", "bars")
    a = Progress(total=10, desc="finetune@bbc", unit="step")
    b = Progress(total=10, desc="finetune@rotten", unit="step")
    assert (a.line, b.line) == (0, 1)
    a.update(3)
    b.update(5)
    a.close()
    c = Progress(total=10, desc="finetune@tweets", unit="step")  # takes the line a gave back
    assert c.line == 0
    b.close()
    c.close()
    assert progress._lines_taken == set()
    text = tty.getvalue()
    for name in ("finetune@bbc", "finetune@rotten", "finetune@tweets"):
        assert f"{name}:" in text  # the bar's description is the job's name
    # each bar's summary, once, when it ends: a at 3/10, b at 5/10, c at 0/10
    summaries = re.findall(r"(finetune@\w+: \d+)/10 step in ", text)
    assert sorted(summaries) == ["finetune@bbc: 3", "finetune@rotten: 5", "finetune@tweets: 0"]
