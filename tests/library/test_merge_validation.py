"""crucible.merge: input validation and all-or-nothing `add` for every merger.

A refused or failed `add` must leave the merger exactly as it was (every tensor of its state
equal, same counters), and the merger must then go on as if the bad arrival never happened: the
same state and the same merged weights as a fresh merger fed only the valid task vectors.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import Tensor

from crucible.merge import MERGERS, energy_rank, make_merger, task_vector
from crucible.merge import gs3r as gs3r_module
from crucible.merge.base import thin_svd
from crucible.merge.gs3r import separate
from crucible.merge.opcm import opcm_project
from crucible.merge.ties import ties_trim

torch.set_num_threads(1)
SHAPES = {"a.weight": (6, 5), "a.bias": (6,), "b.weight": (5, 6), "c.weight": (4, 4), "embed.weight": (7, 3)}
SOURCE = "data/bbc/finetune/model.safetensors"


def theta_0() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(100)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def task_vectors(n: int) -> list[dict[str, Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [{k: 0.1 * torch.randn(s, generator=g) for k, s in SHAPES.items()} for _ in range(n)]


def snapshot(obj):
    """A deep copy of a merger's attributes (`vars(merger)`), tensors cloned."""
    if isinstance(obj, Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return copy.deepcopy(obj)


def assert_same(a, b, path: str = "state") -> None:
    """Recursive equality: tensors equal in dtype, shape, device and every value; dicts in keys
    and their order; anything else by ==."""
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor), path
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def fed(name: str, tvs) -> object:
    merger = make_merger(name)
    for tv in tvs:
        merger.add(tv)
    return merger


def assert_continues_like_fresh(merger, name: str, tvs) -> None:
    """The merger equals a fresh one fed `tvs`, in state and in merged weights."""
    fresh = fed(name, tvs)
    assert_same(vars(merger), vars(fresh))
    assert_same(merger.merged(theta_0()), fresh.merged(theta_0()))


def poison(tv: dict[str, Tensor], param: str, bad: str) -> dict[str, Tensor]:
    out = {k: v.clone() for k, v in tv.items()}
    values = [float("nan")] * 2 if bad == "nan" else [float("inf"), float("-inf")]
    out[param].view(-1)[torch.tensor([0, 3])] = torch.tensor(values)
    return out


# ---------------------------------------------------------------------------------------------
# non-finite task vectors


@pytest.mark.parametrize("arrival", [0, 2], ids=["first", "later"])
@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("param", ["a.weight", "a.bias"])
@pytest.mark.parametrize("name", sorted(MERGERS))
def test_nonfinite_task_vector_is_refused_and_changes_nothing(name, param, bad, arrival):
    tvs = task_vectors(4)
    originals = snapshot(tvs)
    merger = fed(name, tvs[:arrival])
    before = snapshot(vars(merger))
    counts = "2 NaN, 0 inf" if bad == "nan" else "0 NaN, 2 inf"
    with pytest.raises(
        ValueError,
        match=rf"{name}\.add: task {arrival}: .*parameter "
        rf"'{re.escape(param)}' has 2 non-finite values "
        rf"\({counts}\) of {tvs[0][param].numel()}",
    ):
        merger.add(poison(tvs[arrival], param, bad))
    assert_same(vars(merger), before)
    for tv in tvs[arrival:]:
        merger.add(tv)
    assert_continues_like_fresh(merger, name, tvs)
    assert_same(tvs, originals)  # add never modifies the caller's task vectors


@pytest.mark.parametrize("name", sorted(MERGERS))
def test_error_names_the_source_file_and_every_bad_parameter(name):
    tvs = task_vectors(2)
    merger = fed(name, tvs[:1])
    bad = poison(poison(tvs[1], "a.weight", "nan"), "embed.weight", "inf")
    with pytest.raises(ValueError) as err:
        merger.add(bad, source=SOURCE)
    msg = str(err.value)
    assert f"task 1 ({SOURCE})" in msg
    assert "'a.weight' has 2 non-finite values (2 NaN, 0 inf)" in msg
    assert "'embed.weight' has 2 non-finite values (0 NaN, 2 inf)" in msg
    assert merger.num_tasks == 1


# ---------------------------------------------------------------------------------------------
# failures inside the update (SVD, re-truncation) roll back


DECOMPOSITIONS = ("svd", "eigh")  # what the mergers factor with (GS3R: eigh of Gram matrices, OPCM: SVD)


def _patch(monkeypatch, wrap) -> None:
    for name in DECOMPOSITIONS:
        monkeypatch.setattr(torch.linalg, name, wrap(getattr(torch.linalg, name)))


def _count_decompositions(monkeypatch, fn, *args) -> int:
    calls = [0]

    def counting(real):
        def call(*a, **kw):
            calls[0] += 1
            return real(*a, **kw)

        return call

    with monkeypatch.context() as m:
        _patch(m, counting)
        fn(*args)
    return calls[0]


@pytest.mark.parametrize("arrival", [0, 1, 2], ids=["first", "second", "third"])
@pytest.mark.parametrize("mode", ["once", "from_then_on"])
@pytest.mark.parametrize("name", ["gs3r", "opcm"])
def test_svd_failure_inside_add_leaves_the_state_unchanged(monkeypatch, name, mode, arrival):
    """Fail the k-th matrix decomposition (SVD or eigh) of one add, for every k: with a
    RuntimeError once (propagates at once), or with LinAlgError from then on (after the float64
    retry also ran)."""
    tvs = task_vectors(3)
    n_calls = _count_decompositions(monkeypatch, fed(name, tvs[:arrival]).add, tvs[arrival])
    if name == "opcm" and arrival == 0:
        assert n_calls == 0  # the first arrival is copied, no SVD: nothing to inject
        return
    assert n_calls >= 3  # one decomposition or more per matrix: failures hit after some are done
    for k in range(1, n_calls + 1):
        merger = fed(name, tvs[:arrival])
        before = snapshot(vars(merger))
        calls = [0]

        def failing(real):
            def call(*args, **kw):
                calls[0] += 1
                if calls[0] == k or (mode == "from_then_on" and calls[0] > k):
                    if mode == "once":
                        raise RuntimeError("injected")
                    raise torch.linalg.LinAlgError("injected: did not converge")
                return real(*args, **kw)

            return call

        with monkeypatch.context() as m:
            _patch(m, failing)
            with pytest.raises((RuntimeError, torch.linalg.LinAlgError)):
                merger.add(tvs[arrival])
        assert_same(vars(merger), before, f"state after decomposition {k} of {n_calls} failed")
        merger.add(tvs[arrival])
        assert_continues_like_fresh(merger, name, tvs[: arrival + 1])


def test_gs3r_retruncation_failure_restores_dropped_components(monkeypatch):
    """A failure after a matrix was re-truncated (components of earlier tasks dropped) restores
    those components exactly; the test checks that the second arrival does drop some."""
    tvs = task_vectors(2)
    merger = fed("gs3r", tvs[:1])
    held, after = merger.ranks_by_task(), fed("gs3r", tvs).ranks_by_task()
    assert all(after[k][0] < held[k][0] for k in held)  # budget 2: task 0 keeps 1 of its 2
    before = snapshot(vars(merger))
    real, calls = gs3r_module.retruncate, [0]

    def fails_second(*args):
        calls[0] += 1
        if calls[0] == 2:
            raise MemoryError("injected")
        return real(*args)

    monkeypatch.setattr(gs3r_module, "retruncate", fails_second)
    with pytest.raises(MemoryError):
        merger.add(tvs[1])
    assert calls[0] == 2
    assert_same(vars(merger), before)
    monkeypatch.setattr(gs3r_module, "retruncate", real)
    merger.add(tvs[1])
    assert_continues_like_fresh(merger, "gs3r", tvs)


# ---------------------------------------------------------------------------------------------
# keys, shapes, dtypes


@pytest.mark.parametrize("name", sorted(MERGERS))
def test_mismatched_arrivals_name_the_parameter_and_change_nothing(name):
    tvs = task_vectors(2)
    merger = make_merger(name)
    with pytest.raises(
        ValueError,
        match=rf"{name}\.add: task 0: parameter 'a.bias' must be a "
        r"floating tensor, got torch.int64",
    ):
        merger.add({**tvs[0], "a.bias": torch.ones(6, dtype=torch.int64)})
    with pytest.raises(ValueError, match="empty task vector"):
        merger.add({})
    assert_same(vars(merger), vars(make_merger(name)))
    merger.add(tvs[0])
    before = snapshot(vars(merger))
    cases = [
        ({k: v for k, v in tvs[1].items() if k != "a.bias"}, r"missing \['a.bias'\], extra \[\]"),
        ({**tvs[1], "d.weight": torch.ones(2, 2)}, r"missing \[\], extra \['d.weight'\]"),
        ({**tvs[1], "b.weight": torch.ones(6, 5)}, r"parameter 'b.weight' has shape \(6, 5\), task 0 had \(5, 6\)"),
        (
            {**tvs[1], "a.bias": torch.ones(6, dtype=torch.float64)},
            r"parameter 'a.bias' has dtype torch.float64, task 0 had torch.float32",
        ),
        (
            {**tvs[1], "c.weight": torch.ones(4, 4, dtype=torch.int32)},
            r"parameter 'c.weight' must be a floating tensor",
        ),
    ]
    for tv, pattern in cases:
        with pytest.raises(ValueError, match=rf"{name}\.add: task 1: .*{pattern}"):
            merger.add(tv)
        assert_same(vars(merger), before)
    merger.add(tvs[1])
    assert_continues_like_fresh(merger, name, tvs)


@pytest.mark.parametrize("name", sorted(MERGERS))
def test_merged_validates_theta_0(name):
    merger = fed(name, task_vectors(2))
    base = theta_0()
    before = snapshot(vars(merger))
    path = "models/base/model.safetensors"
    bad = {**base, "a.bias": base["a.bias"].clone()}
    bad["a.bias"][2] = float("nan")
    with pytest.raises(
        ValueError,
        match=rf"{name}\.merged: theta_0 \({re.escape(path)}\): .*"
        r"'a.bias' has 1 non-finite values \(1 NaN, 0 inf\)",
    ):
        merger.merged(bad, source=path)
    with pytest.raises(ValueError, match=r"missing \['c.weight'\]"):
        merger.merged({k: v for k, v in base.items() if k != "c.weight"})
    with pytest.raises(ValueError, match=r"extra floating \['d.weight'\]"):
        merger.merged({**base, "d.weight": torch.zeros(2)})
    with pytest.raises(
        ValueError,
        match=r"'b.weight' has shape \(6, 5\), the task vectors "
        r"\(5, 6\)",
    ):
        merger.merged({**base, "b.weight": torch.zeros(6, 5)})
    with pytest.raises(ValueError, match=r"'a.bias' must be a floating tensor"):
        merger.merged({**base, "a.bias": torch.zeros(6, dtype=torch.int64)})
    assert_same(vars(merger), before)
    out = merger.merged({**base, "position_ids": torch.arange(3)})  # buffers pass through
    assert torch.equal(out["position_ids"], torch.arange(3))


def test_task_vector_refuses_nonfinite_weights_and_names_the_file():
    base = theta_0()
    tuned = {k: v + 0.1 for k, v in base.items()}
    bad = {**tuned, "a.weight": tuned["a.weight"].clone()}
    bad["a.weight"][0, :3] = float("inf")
    kept = snapshot(bad)
    with pytest.raises(
        ValueError,
        match=rf"task_vector: fine-tuned model \({re.escape(SOURCE)}\)"
        r": .*'a.weight' has 3 non-finite values "
        r"\(0 NaN, 3 inf\)",
    ):
        task_vector(bad, base, inplace=True, source=SOURCE)
    assert_same(bad, kept)  # refused before anything was overwritten
    bad_base = {**base, "embed.weight": base["embed.weight"].clone()}
    bad_base["embed.weight"][1, 1] = float("nan")
    with pytest.raises(
        ValueError,
        match=r"task_vector: base model \(base.safetensors\): .*"
        r"'embed.weight' has 1 non-finite",
    ):
        task_vector(tuned, bad_base, base_source="base.safetensors")
    with pytest.raises(ValueError, match=r"'a.bias' must be a floating tensor"):
        task_vector({**tuned, "a.bias": torch.ones(6, dtype=torch.int64)}, base)
    with pytest.raises(
        ValueError,
        match=r"shape of 'a.bias' is \(5,\) in the fine-tuned model "
        r"but \(6,\) in the base",
    ):
        task_vector({**tuned, "a.bias": torch.ones(5)}, base)


# ---------------------------------------------------------------------------------------------
# helpers that take tensors


def test_energy_rank_on_nonfinite_zero_and_edge_spectra():
    inf, nan = float("inf"), float("nan")
    with pytest.raises(ValueError, match=r"finite, got 1 non-finite values \(0 NaN, 1 inf\)"):
        energy_rank(torch.tensor([inf, 1.0]), 0.9)  # was IndexError
    with pytest.raises(ValueError, match=r"\(1 NaN, 0 inf\)"):
        energy_rank(torch.tensor([nan, 1.0]), 0.9)
    with pytest.raises(ValueError, match="non-finite"):
        energy_rank(torch.tensor([2.0, 1.0, nan]), 1.0)
    with pytest.raises(ValueError, match="descending"):
        energy_rank(torch.tensor([1.0, 2.0]), 0.9)
    with pytest.raises(ValueError, match="non-negative"):
        energy_rank(torch.tensor([1.0, -0.5]), 0.9)
    with pytest.raises(ValueError, match="1-D"):
        energy_rank(torch.ones(2, 2), 0.9)
    with pytest.raises(ValueError, match="energy"):
        energy_rank(torch.ones(2), 0.0)
    assert energy_rank(torch.zeros(5), 0.9) == 0  # a zero matrix has rank 0 at any energy
    assert energy_rank(torch.zeros(5), 1.0) == 0
    assert energy_rank(torch.zeros(0), 0.9) == 0
    assert energy_rank(torch.tensor([3.0, 0.0, 0.0]), 1.0) == 1  # capped at the numerical rank
    assert energy_rank(torch.ones(4), 0.5) == 2
    assert energy_rank(torch.tensor([3e38, 1e38]), 0.9) == 1  # s^2 overflows float32, not float64
    assert energy_rank(torch.tensor([1e-30, 1e-31]), 0.999) == 2


def test_tensor_helpers_refuse_nonfinite_input():
    x = torch.randn(5, 4)
    x[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"thin_svd: the \(5, 4\) matrix has 1 non-finite"):
        thin_svd(x)
    with pytest.raises(ValueError, match=r"top_singular: the \(5, 4\) matrix has 1 non-finite"):
        separate(x, torch.zeros(5, 0), torch.zeros(4, 0), 0.9)
    with pytest.raises(ValueError, match=r"opcm_project.*'tau' has 1 non-finite"):
        opcm_project(x, torch.randn(5, 4), 0.5)
    with pytest.raises(ValueError, match=r"opcm_project.*'merged_tv' has 1 non-finite"):
        opcm_project(torch.randn(5, 4), x, 0.5)
    with pytest.raises(ValueError, match=r"ties_trim.*'w' has 1 non-finite"):
        ties_trim({"w": x}, 0.5)
