"""The merge stage's worker: one merge method over the arrival sequence in a fresh Python process
(so that its time and peak memory are its own), writing the merged weights of each arrival to
`<out_dir>/<j>.safetensors` and its records to `<out_dir>/result.json`.

`start_method` starts it in the background and returns at once; `MethodRun.result()` waits for it
(the merge stage runs one method at a time). `run_method` does both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRATCH_HINT = "a merge worker's scratch file; rerun `crucible stage merge`"


def merge_worker(spec: dict) -> dict:
    """Run one method over the sequence (in this process); write merged weights; return records.

    spec: method, kwargs, theta0 (safetensors path), models (paths in arrival order), out_dir,
    save ("each" | "final"), device (where the task vectors, the merger's state and its SVDs live;
    the CPU when absent).
    """
    import torch
    from safetensors.torch import save_file

    from crucible.device import make_deterministic, resolve_device
    from crucible.merge import make_merger, task_vector
    from tasks.runtime.io import read_safetensors, rebuild_hint
    from tasks.runtime.memory import PeakRSS
    from tasks.runtime.timing import timed

    torch.set_grad_enabled(False)
    device = resolve_device(spec.get("device", "cpu"), what="merge worker device")
    make_deterministic(device)
    theta_0, _ = read_safetensors(spec["theta0"], "base encoder (theta_0)", SCRATCH_HINT)
    theta_0 = {k: v.to(device) for k, v in theta_0.items()}
    merger = make_merger(spec["method"], **spec["kwargs"])
    base = PeakRSS.rss()
    records, ranks = [], []
    last = len(spec["models"]) - 1
    for j, path in enumerate(spec["models"]):
        seconds = {}
        with PeakRSS(every=0.005) as memory:
            with timed(seconds, "load"):
                # finite=False: the parent checked each task model (read_task_model); task_vector checks
                # names, shapes and dtypes against theta_0
                theta_t = {
                    k: v.to(device)
                    for k, v in read_safetensors(path, "task model", rebuild_hint("finetune"), finite=False)[0].items()
                }
                tau = task_vector(theta_t, theta_0, inplace=True, source=str(path), base_source=spec["theta0"])
                del theta_t
            with timed(seconds, "add"):
                merger.add(tau, source=str(path))
                del tau
            with timed(seconds, "merged"):
                merged = merger.merged(theta_0, source=spec["theta0"])
        records.append(
            {
                "arrival": j,
                "load_seconds": seconds["load"],
                "add_seconds": seconds["add"],
                "merged_seconds": seconds["merged"],
                "peak_rss_mb": (memory.peak - base) / 2**20,
                "state_mb": merger.state_bytes() / 2**20,
            }
        )
        if hasattr(merger, "ranks_used"):
            ranks += [
                {"arrival": j, "param": k, "rank": r, "budget": merger.budget(k)}
                for k, r in merger.ranks_used().items()
            ]
        if spec["save"] == "each" or j == last:
            save_file(
                {k: v.cpu().contiguous() for k, v in merged.items()}, str(Path(spec["out_dir"]) / f"{j}.safetensors")
            )
        del merged
    held = {}  # components each arrival holds per matrix at the end (GS3R): where the rank budget went
    if hasattr(merger, "ranks_by_task"):
        held = {k: {str(t): n for t, n in v.items()} for k, v in merger.ranks_by_task().items()}
    return {"records": records, "ranks": ranks, "held_by_arrival": held}


def _worker_main() -> None:
    spec = json.loads(sys.stdin.read())
    result = merge_worker(spec)
    Path(spec["out_dir"], "result.json").write_text(json.dumps(result))


class MethodRun:
    """A merge worker started in the background (`start_method`); `result()` waits for it."""

    def __init__(self, method: str, proc: subprocess.Popen, out_dir: Path, stderr):
        self.method, self.proc, self.out_dir, self._stderr = method, proc, out_dir, stderr
        self._result: dict | None = None

    def result(self) -> dict:
        """The worker's records ({"records", "ranks"}) once it has exited (waited for on the first
        call); RuntimeError with the end of its stderr when it failed."""
        if self._result is None:
            code = self.proc.wait()
            self._stderr.seek(0)
            err = self._stderr.read()
            self._stderr.close()
            if code != 0:
                raise RuntimeError(f"merge method {self.method!r} failed (exit {code}):\n{err[-4000:]}")
            self._result = json.loads((self.out_dir / "result.json").read_text())
        return self._result

    def stop(self) -> None:
        """Kill the worker if it still runs (the stage failed elsewhere) and wait for it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._stderr.close()


def start_method(
    method: str,
    kwargs: dict,
    theta0: Path,
    models: list[Path],
    out_dir: Path,
    save: str,
    threads: int,
    device: str = "cpu",
) -> MethodRun:
    """merge_worker in a fresh Python process (its own peak memory), on `device`, started in the
    background with `threads` torch/BLAS threads."""
    import tempfile

    out_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "method": method,
        "kwargs": kwargs,
        "theta0": str(theta0),
        "models": [str(m) for m in models],
        "out_dir": str(out_dir),
        "save": save,
        "device": device,
    }
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        # a fixed mmap threshold: freed model-sized tensors go back to the OS, so RSS tracks live memory
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    # quiet first (tasks/runtime/quiet.py): its stderr is the error message when it fails
    code = (
        "from tasks.runtime import quiet; quiet.install(); "
        "from tasks.data.merge_worker import _worker_main; _worker_main()"
    )
    stderr = tempfile.TemporaryFile("w+")  # a file, not a pipe: nobody reads it until the worker exits
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        text=True,
        env=env,
    )
    proc.stdin.write(json.dumps(spec))
    proc.stdin.close()
    return MethodRun(method, proc, out_dir, stderr)


def run_method(
    method: str,
    kwargs: dict,
    theta0: Path,
    models: list[Path],
    out_dir: Path,
    save: str,
    threads: int,
    device: str = "cpu",
) -> dict:
    """merge_worker in a fresh Python process, waited for; raises RuntimeError with its stderr."""
    return start_method(method, kwargs, theta0, models, out_dir, save, threads, device).result()
