"""The finetune stage writes the same bytes whatever runs beside it and however often it is
killed: a task fine-tuned while another task trains in a second thread of the same process (as the
Prefect flow runs them) equals the task fine-tuned alone, md5 for md5; a killed run leaves `data/`
as it was (its resume state is under .crucible/, outside every DVC dependency) and its resumed
run writes the same bytes as an uninterrupted one."""

import os
import threading

import pytest
import torch
from test_finetune_stage import synthetic_tables

import tasks.stages.finetune as finetune
from tasks.runtime.io import md5_file
from tasks.stages import execute

# the fine-tune's files under data/<task>/ (its metrics are metrics/<task>/finetune.json)
OUTPUTS = ("finetune/model.safetensors", "finetune/head.safetensors", "finetune/config.json")

torch.set_num_threads(1)
TASKS = {"rotten": 0, "bbc": 1}  # task -> seed of its synthetic tables


def workspace(project_root, dest):
    from tasks.runtime.workspace import make_workspace

    root = make_workspace(project_root, dest, "tiny")
    for task, seed in TASKS.items():
        labeled, test = synthetic_tables(seed)
        (root / "data" / task).mkdir(parents=True)
        labeled.to_parquet(root / "data" / task / "labeled.parquet", index=False)
        test.to_parquet(root / "data" / task / "test.parquet", index=False)
    return root


def digests(root, task="rotten") -> dict[str, str]:
    return {
        **{name: md5_file(root / "data" / task / name) for name in OUTPUTS},
        "finetune.json": md5_file(root / "metrics" / task / "finetune.json"),
    }


def tree(folder) -> dict[str, tuple[str, int]]:
    """Every file under `folder`: relative path -> (md5, inode); a rewrite changes the inode."""
    return {
        str(p.relative_to(folder)): (md5_file(p), p.stat().st_ino) for p in sorted(folder.rglob("*")) if p.is_file()
    }


def skip_pyfunc(monkeypatch):
    """Logging the MLflow pyfunc is tested in test_finetune_stage and writes no output: skip it."""
    monkeypatch.setattr(finetune, "log_model", lambda *args, **kwargs: None)


@pytest.fixture(scope="module")
def alone(project_root, tmp_path_factory):
    """rotten fine-tuned on its own: (workspace, md5 of each output)."""
    root = workspace(project_root, tmp_path_factory.mktemp("alone"))
    with pytest.MonkeyPatch.context() as mp:
        skip_pyfunc(mp)
        execute("finetune", "rotten", root)
    return root, digests(root)


@pytest.fixture(autouse=True)
def no_pyfunc(monkeypatch):
    skip_pyfunc(monkeypatch)


def test_a_finetune_does_not_change_when_another_task_trains_beside_it(alone, project_root, tmp_path, monkeypatch):
    """Two tasks in two threads of one process, both released into training together: rotten's
    outputs equal those of rotten alone (in another workspace) byte for byte. Failed before the
    run-owned generators: dropout drew from torch's global RNG, shared by the threads."""
    root = workspace(project_root, tmp_path)
    real_train, barrier = finetune.train, threading.Barrier(len(TASKS))

    def train_together(*args, **kwargs):
        barrier.wait(timeout=120)
        return real_train(*args, **kwargs)

    monkeypatch.setattr(finetune, "train", train_together)
    errors = []

    def stage(task):
        try:  # under one holder's workspace lock, as the flow runs them (alone, each would wait for the other)
            execute("finetune", task, root, lock_token=lock.token)
        except BaseException as exc:  # surfaced below: a failing thread must fail the test
            errors.append(exc)
            barrier.abort()

    from tasks.runtime.lock import WorkspaceLock

    threads = [threading.Thread(target=stage, args=(task,)) for task in TASKS]
    with WorkspaceLock(root, "flow", timeout=0) as lock:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    assert digests(root) == alone[1]
    assert digests(root, "bbc")["finetune/model.safetensors"] != alone[1]["finetune/model.safetensors"]


class Killed(BaseException):
    """Stands for SIGKILL: not an Exception, so nothing on the way out handles it."""


def test_a_killed_finetune_leaves_data_untouched_and_resumes_to_the_same_bytes(alone, monkeypatch):
    """Killed after step 4 of 6 (checkpoints every 3 steps): `data/` (the previous outputs
    included) is unchanged and the resume state is under .crucible/; the rerun resumes from step 3
    and publishes the bytes of the uninterrupted run, then deletes the checkpoints."""
    root, expected = alone
    ckpt = finetune.checkpoint_dir(root, "rotten")
    assert ckpt.resolve().is_relative_to(root.resolve()) and not ckpt.resolve().is_relative_to(
        (root / "data").resolve()
    )
    real_train = finetune.train
    before = tree(root / "data")

    def killed_after_step_4(*args, **kwargs):
        real_train(*args, **kwargs, stop_after=4)
        raise Killed

    monkeypatch.setattr(finetune, "train", killed_after_step_4)
    with pytest.raises(Killed):
        execute("finetune", "rotten", root)
    assert tree(root / "data") == before
    assert sorted(p.name for p in ckpt.iterdir()) == ["fingerprint", "step-0000003"]

    resumed_from = []

    def resume(*args, **kwargs):
        from crucible.checkpoint import latest_checkpoint

        resumed_from.append(latest_checkpoint(kwargs["checkpoint_dir"]).name)
        return real_train(*args, **kwargs)

    monkeypatch.setattr(finetune, "train", resume)
    execute("finetune", "rotten", root)
    assert resumed_from == ["step-0000003"]
    assert digests(root) == expected
    after = tree(root / "data")
    assert all(
        after[f"rotten/{name}"][1] != before[f"rotten/{name}"][1] for name in OUTPUTS
    )  # rewritten, not left in place
    assert not ckpt.exists() and not os.path.exists(root / "data" / "rotten" / ".finetune-checkpoints")
