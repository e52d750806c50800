"""crucible.merge: continual mergers against closed forms on small toys."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from crucible.merge import (
    GS3R,
    MERGERS,
    OPCM,
    TIES,
    MagMax,
    TaskArithmetic,
    WeightAverage,
    energy_rank,
    make_merger,
    merge_sequence,
    task_vector,
)
from crucible.merge.gs3r import balance_factors, retruncate, separate
from crucible.merge.opcm import opcm_project
from crucible.merge.ties import ties_disjoint_mean, ties_elect, ties_trim

torch.set_num_threads(1)
F64 = torch.float64


def orthonormal(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))
    return q


def linear_toys(n_tasks: int, seed: int = 0, dtype=F64):
    """A base nn.Linear(5, 4) and n_tasks fine-tuned copies, as state dicts."""
    torch.manual_seed(seed)
    base = nn.Linear(5, 4).to(dtype)
    theta_0 = {k: v.detach().clone() for k, v in base.state_dict().items()}
    tuned = []
    for _ in range(n_tasks):
        layer = nn.Linear(5, 4).to(dtype)
        layer.load_state_dict({k: v + 0.1 * torch.randn_like(v) for k, v in theta_0.items()})
        tuned.append({k: v.detach().clone() for k, v in layer.state_dict().items()})
    return theta_0, tuned


def disjoint_tasks(m=12, n=10, rank=3, n_tasks=3, scales=None):
    """Task vectors on mutually orthogonal row and column subspaces: tau_t = P_t diag(s_t) Q_t^T."""
    P, Q = orthonormal(m, 1), orthonormal(n, 2)
    tasks = []
    for t in range(n_tasks):
        s = torch.tensor([3.0, 2.0, 1.0][:rank], dtype=F64) * (scales[t] if scales else 1.0)
        Pt, Qt = P[:, rank * t : rank * (t + 1)], Q[:, rank * t : rank * (t + 1)]
        tasks.append((Pt, torch.diag(s), Qt))
    return tasks


def full_gs3r(**kw):
    return GS3R(**{"energy": 1.0, "rank_budget": 1.0, "dtype": F64, **kw})


# ---------------------------------------------------------------------------------------------
# GS3R


@pytest.mark.parametrize("balance,scales", [(0.0, [1.0, 4.0, 0.5]), (1.0, None)])
def test_gs3r_reproduces_disjoint_tasks_exactly(balance, scales):
    tasks = disjoint_tasks(scales=scales)
    theta_0 = {"w": torch.randn(12, 10, dtype=F64), "b": torch.randn(12, dtype=F64)}
    merger = full_gs3r(balance=balance)
    for Pt, St, Qt in tasks:
        merger.add({"w": Pt @ St @ Qt.T, "b": torch.ones(12, dtype=F64)})
    delta = merger.merged(theta_0)["w"] - theta_0["w"]
    for Pt, St, Qt in tasks:
        torch.testing.assert_close(Pt.T @ delta @ Qt, St)  # own subspace, exactly
    torch.testing.assert_close(delta, sum(P @ S @ Q.T for P, S, Q in tasks))


def test_gs3r_one_task_is_that_task():
    theta_0, (theta_1,) = linear_toys(1)
    tv = task_vector(theta_1, theta_0)
    merger = full_gs3r()
    merger.add(tv)
    assert merger._balance("weight") == {0: 1.0}
    out = merger.merged(theta_0)
    for k in theta_0:
        torch.testing.assert_close(out[k], theta_1[k])


def test_gs3r_never_overwrites_an_earlier_task():
    """A generic later task (overlapping subspaces) leaves task 0's own-subspace block intact."""
    g = torch.Generator().manual_seed(3)
    P, Q = orthonormal(12, 4)[:, :3], orthonormal(10, 5)[:, :3]
    S = torch.diag(torch.tensor([3.0, 2.0, 1.0], dtype=F64))
    merger = full_gs3r(balance=0.0)
    merger.add({"w": P @ S @ Q.T})
    for _ in range(2):
        merger.add({"w": torch.randn(12, 3, generator=g, dtype=F64) @ torch.randn(3, 10, generator=g, dtype=F64)})
    delta = merger.merged_task_vector()["w"]
    torch.testing.assert_close(P.T @ delta @ Q, S)
    U, V = merger.U["w"], merger.V["w"]
    torch.testing.assert_close(U.T @ U, torch.eye(U.shape[1], dtype=F64))
    torch.testing.assert_close(V.T @ V, torch.eye(V.shape[1], dtype=F64))


def test_gs3r_separation_is_orthogonal_to_held_bases():
    g = torch.Generator().manual_seed(0)
    U, V = orthonormal(8, 6)[:, :3], orthonormal(7, 7)[:, :3]
    tau = torch.randn(8, 7, generator=g, dtype=F64)
    Ut, Vt = separate(tau, U, V, energy=1.0)
    assert Ut.shape == (8, 5) and Vt.shape == (7, 4)  # the complements' dimensions
    torch.testing.assert_close(U.T @ Ut, torch.zeros(3, 5, dtype=F64))
    torch.testing.assert_close(V.T @ Vt, torch.zeros(3, 4, dtype=F64))


def test_gs3r_balance_equalises_task_norms():
    tasks = disjoint_tasks(scales=[1.0, 4.0, 0.5])
    merger = full_gs3r(balance=1.0)
    for Pt, St, Qt in tasks:
        merger.add({"w": Pt @ St @ Qt.T})
    delta = merger.merged_task_vector()["w"]
    norms = [float(torch.linalg.norm(Pt.T @ delta @ Qt)) for Pt, _, Qt in tasks]
    mean = sum(float(torch.linalg.norm(S)) for _, S, _ in tasks) / 3
    assert norms == pytest.approx([mean] * 3, rel=1e-9)
    assert balance_factors({0: 1.0, 1: 4.0}, 0.0) == {0: 1.0, 1: 1.0}
    assert balance_factors({0: 1.0, 1: 4.0}, 1.0) == pytest.approx({0: 2.5, 1: 0.625})


def test_retruncate_by_balanced_singular_value():
    sigma = torch.tensor([3.0, 1.0, 2.0, 0.1])
    owner = torch.tensor([0, 0, 1, 1])
    # scores: 3/sqrt(10)=.949, 1/sqrt(10)=.316, 2/sqrt(4.01)=.999, .1/sqrt(4.01)=.050
    assert retruncate(sigma, owner, 2).tolist() == [0, 2]
    assert retruncate(sigma, owner, 3).tolist() == [0, 1, 2]
    assert retruncate(sigma, owner, 1).tolist() == [2]
    assert retruncate(sigma, owner, 4).tolist() == [0, 1, 2, 3]
    # floor: a task with only small components still keeps its leading one
    assert retruncate(torch.tensor([5.0, 4.0, 3.0, 1e-3]), torch.tensor([0, 0, 0, 1]), 2).tolist() == [0, 3]


def test_gs3r_state_does_not_grow_with_tasks():
    g = torch.Generator().manual_seed(0)
    shapes = {
        "l0.weight": (16, 12),
        "l1.weight": (12, 16),
        "l0.bias": (16,),
        "embeddings.word_embeddings.weight": (9, 4),
    }
    merger = GS3R(energy=1.0, rank_budget=6, dtype=F64)
    sizes = {}
    for t in range(1, 9):
        tv = {
            k: (
                torch.randn(s[0], 4, generator=g, dtype=F64)  # rank 4 per task
                @ torch.randn(4, s[1], generator=g, dtype=F64)
            )
            if k.startswith("l") and len(s) == 2
            else torch.randn(s, generator=g, dtype=F64)
            for k, s in shapes.items()
        }
        merger.add(tv)
        sizes[t] = merger.state_numel()
        if t == 4:  # budget 6 >= 4 tasks: every task, the latest included, keeps a component
            assert set(merger.ranks_by_task()["l0.weight"]) == {0, 1, 2, 3}
    assert sizes[2] == sizes[4] == sizes[8]
    assert merger.ranks_used() == {"l0.weight": 6, "l1.weight": 6}
    bound = (16 + 12 + 2) * 6 * 2 + 16 + 9 * 4
    assert sizes[8] == bound
    assert sum(merger.ranks_by_task()["l0.weight"].values()) == 6


# ---------------------------------------------------------------------------------------------
# baselines against closed forms on nn.Linear toys


def test_task_arithmetic_and_average_closed_forms():
    theta_0, tuned = linear_toys(3)
    tvs = [task_vector(t, theta_0) for t in tuned]
    ta, avg = TaskArithmetic(lam=0.4), WeightAverage()
    for tv in tvs:
        ta.add(tv)
        avg.add(tv)
    out_ta, out_avg = ta.merged(theta_0), avg.merged(theta_0)
    for k in theta_0:
        torch.testing.assert_close(out_ta[k], theta_0[k] + 0.4 * sum(tv[k] for tv in tvs))
        torch.testing.assert_close(out_avg[k], sum(t[k] for t in tuned) / 3)


def test_magmax_argmax_with_ties_to_the_later_task():
    m = MagMax()
    m.add({"w": torch.tensor([1.0, -2.0, 3.0, 0.0])})
    m.add({"w": torch.tensor([-1.0, 2.0, 0.5, 0.0])})
    torch.testing.assert_close(m.merged_task_vector()["w"], torch.tensor([-1.0, 2.0, 3.0, 0.0]))
    # brute force on Linear toys: last index of the maximal magnitude
    theta_0, tuned = linear_toys(4)
    tvs = [task_vector(t, theta_0) for t in tuned]
    m = MagMax(lam=0.7)
    for tv in tvs:
        m.add(tv)
    for k in theta_0:
        stack = torch.stack([tv[k] for tv in tvs])
        idx = len(tvs) - 1 - stack.abs().flip(0).argmax(0)
        expect = torch.gather(stack, 0, idx.unsqueeze(0))[0]
        torch.testing.assert_close(m.merged(theta_0)[k], theta_0[k] + 0.7 * expect)


def test_ties_three_steps_on_a_hand_example():
    taus = [
        torch.tensor([4.0, -1.0, 2.0, -3.0, 0.5]),
        torch.tensor([-2.0, 5.0, -1.0, 1.0, -6.0]),
        torch.tensor([1.0, 3.0, -4.0, -2.0, 0.1]),
    ]
    trimmed = [ties_trim({"w": t}, density=0.6)["w"] for t in taus]
    assert [t.tolist() for t in trimmed] == [[4, 0, 2, -3, 0], [-2, 5, 0, 0, -6], [0, 3, -4, -2, 0]]
    stack = torch.stack(trimmed)
    pos, neg = stack.clamp(min=0).sum(0), stack.clamp(max=0).sum(0)
    sign = ties_elect(pos, neg)
    assert sign.tolist() == [1, 1, -1, -1, -1]
    mean = ties_disjoint_mean(pos, neg, (stack > 0).sum(0), (stack < 0).sum(0), sign)
    assert mean.tolist() == [4.0, 4.0, -4.0, -2.5, -6.0]
    merger = TIES(density=0.6, lam=0.5)
    for t in taus:
        merger.add({"w": t})
    torch.testing.assert_close(merger.merged_task_vector()["w"], 0.5 * torch.tensor([4.0, 4.0, -4.0, -2.5, -6.0]))


def test_ties_trim_scope_global_vs_tensor():
    tv = {"a": torch.tensor([10.0, 9.0]), "b": torch.tensor([2.0, 0.5])}
    assert {k: v.tolist() for k, v in ties_trim(tv, 0.5, "global").items()} == {"a": [10.0, 9.0], "b": [0.0, 0.0]}
    assert {k: v.tolist() for k, v in ties_trim(tv, 0.5, "tensor").items()} == {"a": [10.0, 0.0], "b": [2.0, 0.0]}


def test_continual_ties_equals_batch_ties():
    theta_0, tuned = linear_toys(5)
    tvs = [task_vector(t, theta_0) for t in tuned]
    merger = TIES(density=0.3, lam=1.0)
    for tv in tvs:
        merger.add(tv)
    trimmed = [ties_trim(tv, 0.3) for tv in tvs]
    for k in theta_0:
        stack = torch.stack([t[k] for t in trimmed])
        sign = torch.where(stack.sum(0) >= 0, 1.0, -1.0).to(F64)
        agree = (torch.sign(stack) == sign) & (stack != 0)
        expect = (stack * agree).sum(0) / agree.sum(0).clamp(min=1)
        torch.testing.assert_close(merger.merged(theta_0)[k], theta_0[k] + expect)


def test_opcm_projection_matches_direct_formula():
    g = torch.Generator().manual_seed(0)
    M = torch.randn(6, 5, generator=g, dtype=F64)
    tau = torch.randn(6, 5, generator=g, dtype=F64)
    U, s, Vh = torch.linalg.svd(M, full_matrices=False)
    k = energy_rank(s, 0.7)
    energy = torch.cumsum(s**2, 0) / (s**2).sum()
    assert k == int((energy < 0.7).sum()) + 1  # the smallest k holding 70% of the energy
    assert 1 <= k < 5  # so the projection below removes some directions and keeps others
    PU, PV = U[:, :k] @ U[:, :k].T, Vh[:k].T @ Vh[:k]
    block = tau - PU @ tau @ PV
    torch.testing.assert_close(opcm_project(tau, M, 0.7, remove_diagonal=False), block)
    diag = sum(torch.outer(U[:, i], U[:, i]) @ tau @ torch.outer(Vh[i], Vh[i]) for i in range(k, 5))
    torch.testing.assert_close(opcm_project(tau, M, 0.7, remove_diagonal=True), block - diag)
    # hand example: merged = diag(3, 2, .1, .05) keeps e1, e2 at alpha = .9
    M = torch.diag(torch.tensor([3.0, 2.0, 0.1, 0.05], dtype=F64))
    ones = torch.ones(4, 4, dtype=F64)
    expect = ones.clone()
    expect[:2, :2] = 0
    torch.testing.assert_close(opcm_project(ones, M, 0.9, remove_diagonal=False), expect)
    expect[2, 2] = expect[3, 3] = 0
    torch.testing.assert_close(opcm_project(ones, M, 0.9, remove_diagonal=True), expect)


def test_opcm_rescales_to_the_mean_task_vector_norm():
    theta_0, tuned = linear_toys(2)
    tv1, tv2 = (task_vector(t, theta_0) for t in tuned)
    merger = OPCM(alpha=0.5)
    merger.add(tv1)
    merger.add(tv2)
    norm = lambda d: float(torch.sqrt(sum(v.pow(2).sum() for v in d.values())))  # noqa: E731
    raw = {"weight": tv1["weight"] + opcm_project(tv2["weight"], tv1["weight"], 0.5), "bias": tv1["bias"] + tv2["bias"]}
    target = (norm(tv1) + norm(tv2)) / 2
    out = merger.merged_task_vector()
    for k in raw:
        torch.testing.assert_close(out[k], raw[k] * target / norm(raw))
    assert norm(out) == pytest.approx(target)


# ---------------------------------------------------------------------------------------------
# every method on identical task vectors, and the shared contract


def test_identical_task_vectors_follow_each_definition():
    theta_0, (theta_1,) = linear_toys(1)
    tau = task_vector(theta_1, theta_0)
    T = 4
    expect = {
        "task_arithmetic": {k: 0.3 * T * v for k, v in tau.items()},
        "weight_average": tau,
        "magmax": tau,
        "ties": ties_trim(tau, 0.2),
        "opcm": {"weight": tau["weight"]},  # weights only: OPCM adds biases unprojected
        "gs3r": tau,
    }
    assert set(expect) == set(MERGERS)
    for name in MERGERS:
        merger = full_gs3r() if name == "gs3r" else make_merger(name)
        for _ in range(T):
            merger.add({k: tau[k].clone() for k in expect[name]})
        out = merger.merged_task_vector()
        for k in expect[name]:
            torch.testing.assert_close(out[k], expect[name][k], msg=f"{name} {k}")


@pytest.mark.parametrize("name", sorted(MERGERS))
def test_state_is_constant_in_the_number_of_tasks(name):
    theta_0, tuned = linear_toys(8)
    merger = make_merger(name, **({"rank_budget": 2} if name == "gs3r" else {}))
    sizes = []
    for t, theta_t in enumerate(tuned, 1):
        merger.add(task_vector(theta_t, theta_0))
        if t in (2, 4, 8):
            sizes.append(merger.state_numel())
    assert sizes[0] == sizes[1] == sizes[2] > 0


@pytest.mark.parametrize("name", sorted(MERGERS))
def test_errors_on_mismatched_inputs(name):
    merger = make_merger(name)
    with pytest.raises(ValueError, match="no task vector"):
        merger.merged({"w": torch.zeros(3, 2)})
    merger.add({"w": torch.ones(3, 2), "b": torch.ones(3)})
    with pytest.raises(ValueError, match="missing"):
        merger.add({"w": torch.ones(3, 2)})
    with pytest.raises(ValueError, match="extra"):
        merger.add({"w": torch.ones(3, 2), "b": torch.ones(3), "c": torch.ones(1)})
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        merger.add({"w": torch.ones(2, 3), "b": torch.ones(3)})
    with pytest.raises(ValueError, match="floating"):
        merger.add({"w": torch.ones(3, 2, dtype=torch.int64), "b": torch.ones(3)})
    with pytest.raises(ValueError, match="theta_0"):
        merger.merged({"w": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match="shape"):
        merger.merged({"w": torch.zeros(2, 3), "b": torch.zeros(3)})
    assert merger.num_tasks == 1  # failed adds leave the state alone


def test_factory_and_argument_errors():
    with pytest.raises(ValueError, match="valid"):
        make_merger("fisher")
    with pytest.raises(ValueError, match="rank_budget"):
        GS3R(rank_budget=0)
    with pytest.raises(ValueError, match="energy"):
        GS3R(energy=1.5)
    with pytest.raises(ValueError, match="density"):
        TIES(density=0.0)
    with pytest.raises(TypeError):
        make_merger("magmax", alpha=0.5)


def test_task_vector_checks_keys_and_passes_buffers_through():
    theta_0, (theta_1,) = linear_toys(1)
    theta_0["position_ids"] = torch.arange(4)
    theta_1["position_ids"] = torch.arange(4)
    tv = task_vector(theta_1, theta_0)
    assert set(tv) == {"weight", "bias"}
    merger = WeightAverage()
    merger.add(tv)
    out = merger.merged(theta_0)
    assert out["position_ids"] is theta_0["position_ids"]
    torch.testing.assert_close(out["weight"], theta_1["weight"])
    with pytest.raises(ValueError, match="missing"):
        task_vector({"weight": theta_1["weight"]}, theta_0)
    with pytest.raises(ValueError, match="shape"):
        task_vector({**theta_1, "bias": torch.zeros(5, dtype=F64)}, theta_0)


def test_merge_sequence_yields_after_each_arrival():
    theta_0, tuned = linear_toys(3)
    seen = []

    def lazy():
        for theta_t in tuned:
            seen.append(1)
            yield task_vector(theta_t, theta_0)

    outs = []
    for t, merged in enumerate(merge_sequence(theta_0, lazy(), WeightAverage()), 1):
        assert len(seen) == t  # the next task is loaded only after this one is merged
        outs.append(merged)
    for t, merged in enumerate(outs, 1):
        torch.testing.assert_close(merged["weight"], sum(x["weight"] for x in tuned[:t]) / t)


def test_task_vector_in_place_reuses_the_incoming_tensors():
    theta_0, (theta_1,) = linear_toys(1)
    theta_1 = {k: v.float() for k, v in theta_1.items()}
    theta_0 = {k: v.float() for k, v in theta_0.items()}
    expected = task_vector(theta_1, theta_0)
    ptrs = {k: v.data_ptr() for k, v in theta_1.items()}
    tv = task_vector(theta_1, theta_0, inplace=True)
    for k in expected:
        torch.testing.assert_close(tv[k], expected[k])
        assert tv[k].data_ptr() == ptrs[k]  # no second copy of the model
    with pytest.raises(ValueError, match="missing"):  # an error modifies nothing
        bad = {"weight": theta_0["weight"].clone() + 1}
        task_vector(bad, theta_0, inplace=True)
    torch.testing.assert_close(bad["weight"], theta_0["weight"] + 1)


def test_svd_falls_back_when_lapack_does_not_converge(monkeypatch):
    """Real float32 task vectors made LAPACK's SVD fail to converge: retry in float64."""
    from crucible.merge.base import thin_svd

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(30, 6, generator=gen)
    real_svd = torch.linalg.svd

    def float32_fails(a, *args, **kw):
        if a.dtype == torch.float32:
            raise torch.linalg.LinAlgError("did not converge")
        return real_svd(a, *args, **kw)

    monkeypatch.setattr(torch.linalg, "svd", float32_fails)
    u, s, vh = thin_svd(x)
    assert u.dtype == torch.float32
    torch.testing.assert_close(u @ torch.diag(s) @ vh, x, atol=1e-5, rtol=1e-5)


def test_separation_residual_matches_an_svd_of_the_residual():
    """The residual basis from the Gram matrix's eigendecomposition: orthonormal, orthogonal to the
    held basis, the held directions dropped, the span an SVD of the projected basis gives."""
    from crucible.merge import gs3r as g

    gen = torch.Generator().manual_seed(0)
    held = torch.linalg.qr(torch.randn(30, 3, generator=gen))[0]
    basis = torch.linalg.qr(torch.cat([held[:, :2], torch.randn(30, 4, generator=gen)], 1))[0]
    got = g._orthonormal_residual(basis, held, 1e-4)
    x = basis.double() - held.double() @ (held.double().T @ basis.double())
    u, s, _ = torch.linalg.svd(x, full_matrices=False)
    expected = u[:, s > 1e-4].float()
    assert got.shape == expected.shape == (30, 4)  # the 2 held directions are dropped
    torch.testing.assert_close(got.T @ got, torch.eye(4), atol=1e-5, rtol=0)
    assert float((held.T @ got).abs().max()) < 1e-5
    torch.testing.assert_close(got @ got.T, expected @ expected.T, atol=1e-5, rtol=0)  # same span


def test_top_singular_matches_the_svd():
    """GS3R's top-energy triplets from the Gram matrix: the SVD's values, spans and energy rank, for
    a tall and a wide matrix; exactly low-rank input takes no noise direction at energy 1."""
    from crucible.merge.base import energy_rank
    from crucible.merge.gs3r import top_singular

    gen = torch.Generator().manual_seed(0)
    for shape in ((40, 12), (12, 40)):
        x = torch.randn(*shape, generator=gen) * torch.logspace(0, -2, shape[1])
        p, s, q = top_singular(x, 0.9)
        u, sv, vh = torch.linalg.svd(x.double(), full_matrices=False)
        k = energy_rank(sv, 0.9)
        assert p.shape == (shape[0], k) and q.shape == (shape[1], k) and s.shape == (k,)
        torch.testing.assert_close(s.double(), sv[:k], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(p.T @ p, torch.eye(k), atol=1e-5, rtol=0)
        torch.testing.assert_close((p @ p.T).double(), u[:, :k] @ u[:, :k].T, atol=1e-4, rtol=0)
        torch.testing.assert_close((q @ q.T).double(), vh[:k].T @ vh[:k], atol=1e-4, rtol=0)
    low = torch.randn(20, 3, generator=gen, dtype=F64) @ torch.randn(3, 15, generator=gen, dtype=F64)
    p, s, q = top_singular(low, 1.0)
    assert s.numel() == 3
    torch.testing.assert_close(p @ torch.diag(s) @ q.T, low)
    with pytest.raises(ValueError, match="NaN"):
        top_singular(torch.full((3, 2), float("nan")), 0.9)
