"""The continual merging interface shared by every method, and the state-dict helpers it needs.

A task vector is tau_t = theta_t - theta_0: a dict from parameter name to a floating tensor, the
same keys and shapes for every task. Tasks arrive one at a time:

    merger = make_merger("gs3r", rank_budget=0.5)       # crucible.merge.make_merger
    for path in finetuned_paths:                          # loaded lazily, one at a time
        tau = task_vector(load(path), theta_0, source=path)
        merger.add(tau, source=path)                     # the merger may drop tau_t afterwards
        merged = merger.merged(theta_0)                  # current merged weights

A merger holds only its own state (`state_tensors()`); it never keeps a reference to a task vector
it was given, nor to theta_0, so the caller's peak memory is theta_0 + one incoming task vector +
the merger state (+ the merged dict when asked for one).

Every parameter is classified once, on the first `add`, as a *matrix* (2-D and its name not
matched by the `exclude` regex, default: embeddings) or *other* (biases, norms, embeddings). The
subspace methods (OPCM, GS3R) act on matrices only and give the others a simple rule, stated in
each method's docstring; the element-wise methods (task arithmetic, average, TIES, MagMax) treat
every parameter alike.

Inputs are checked before anything is changed: `task_vector`, `add` and `merged` raise ValueError
naming the parameter (and the `source` file when the caller passes one) for a NaN or inf, a
missing or extra key, a shape, dtype or device that differs from the earlier arrivals, or a
non-floating tensor. `add` is all-or-nothing: when it raises, for any reason (a refused input, an
SVD that fails, running out of memory), the merger's state is exactly what it was before the call.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from typing import Iterable, Iterator, Mapping

import torch
from torch import Tensor

DEFAULT_EXCLUDE = r"embed"
"""Parameters whose name matches this regex are never treated as matrices (token, position and
type embeddings are 2-D but a row is a token, not an input direction)."""

StateDict = Mapping[str, Tensor]


def nonfinite_report(x: Tensor) -> str | None:
    """None when every entry of x is finite, else e.g. '3 non-finite values (2 NaN, 1 inf) of 12'."""
    if x.numel() == 0:
        return None
    # one reduction, no mask: min and max propagate NaN, and an inf is one of them (~25x faster
    # than isfinite(x).all() on CPU, which matters at one pass per model per arrival)
    lo, hi = torch.aminmax(x.detach())
    if math.isfinite(float(lo)) and math.isfinite(float(hi)):
        return None
    n_nan, n_inf = int(torch.isnan(x).sum()), int(torch.isinf(x).sum())
    return f"{n_nan + n_inf} non-finite values ({n_nan} NaN, {n_inf} inf) of {x.numel()}"


def check_finite(tensors: StateDict, where: str) -> None:
    """Raise ValueError naming every parameter of `tensors` holding a NaN or inf (and how many).

    `where` starts the message: the function and the file or task the tensors come from.
    """
    bad = [(k, r) for k, v in tensors.items() if (r := nonfinite_report(v)) is not None]
    if not bad:
        return
    listed = "; ".join(f"{k!r} has {r}" for k, r in bad[:5])
    more = f"; and {len(bad) - 5} more parameters" if len(bad) > 5 else ""
    raise ValueError(
        f"{where}: non-finite weights: parameter {listed}{more}. Weights must be "
        f"finite: a NaN or inf usually means the fine-tuning diverged or the file "
        f"is corrupt"
    )


def _label(where: str, source: str | None) -> str:
    return f"{where} ({source})" if source else where


def task_vector(
    theta_t: StateDict,
    theta_0: StateDict,
    inplace: bool = False,
    *,
    source: str | None = None,
    base_source: str | None = None,
) -> dict[str, Tensor]:
    """tau = theta_t - theta_0 over the floating tensors of theta_0, in float32.

    Non-floating entries (e.g. a BERT `position_ids` buffer) are left out: they are not weights.
    With `inplace`, float32 tensors of theta_t are overwritten by their difference (no second copy
    of the model: the incoming model becomes its task vector; pre-merge flushing for the caller).
    `source` and `base_source` (e.g. the files theta_t and theta_0 were loaded from) are named in
    error messages. Raises ValueError when theta_t lacks a floating key of theta_0, has an extra
    floating key, a shape differs, a tensor of theta_t is not floating, or a tensor of either
    holds a NaN or inf; then nothing has been modified.
    """
    fine, base = _label("task_vector: fine-tuned model", source), _label("task_vector: base model", base_source)
    keys = [k for k, v in theta_0.items() if v.is_floating_point()]
    extra = sorted(k for k, v in theta_t.items() if v.is_floating_point() and k not in theta_0)
    missing = sorted(k for k in keys if k not in theta_t)
    if missing or extra:
        raise ValueError(
            f"{fine} does not match the base: missing "
            f"{missing[:5]}{'...' if len(missing) > 5 else ''}, extra "
            f"{extra[:5]}{'...' if len(extra) > 5 else ''}"
        )
    for k in keys:
        if theta_t[k].shape != theta_0[k].shape:
            raise ValueError(
                f"{fine}: shape of {k!r} is {tuple(theta_t[k].shape)} in the "
                f"fine-tuned model but {tuple(theta_0[k].shape)} in the base"
            )
        if not theta_t[k].is_floating_point():
            raise ValueError(f"{fine}: {k!r} must be a floating tensor, got {theta_t[k].dtype}")
    check_finite({k: theta_t[k] for k in keys}, fine)
    check_finite({k: theta_0[k] for k in keys}, base)
    out = {}
    for k in keys:
        if inplace and theta_t[k].dtype == torch.float32:
            out[k] = theta_t[k].sub_(theta_0[k].float())
        else:
            out[k] = theta_t[k].float() - theta_0[k].float()
    return out


def global_norm(tensors: Iterable[Tensor]) -> float:
    """Frobenius norm of a whole state dict's values, sqrt(sum ||x||^2)."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def thin_svd(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Thin SVD; when LAPACK does not converge (ill-conditioned input, many repeated singular
    values: it happens on real task vectors in float32) retry in float64, results in x's dtype.

    Raises ValueError when x holds a NaN or inf (no SVD exists; LAPACK would only say it failed).
    """
    report = nonfinite_report(x)
    if report is not None:
        raise ValueError(f"thin_svd: the {tuple(x.shape)} matrix has {report}")
    try:
        return torch.linalg.svd(x, full_matrices=False)
    except torch.linalg.LinAlgError:
        if x.dtype == torch.float64:
            raise
        u, s, vh = torch.linalg.svd(x.double(), full_matrices=False)
        return u.to(x.dtype), s.to(x.dtype), vh.to(x.dtype)


def energy_rank(s: Tensor, energy: float) -> int:
    """Smallest k with sum_{i<k} s_i^2 >= energy * sum_i s_i^2, for singular values s (descending).

    Capped at the numerical rank (s_i > max(s) * len(s) * eps), so an exactly low-rank matrix
    never takes noise directions even at energy = 1. Returns 0 for an empty or all-zero spectrum
    (a zero matrix). Raises ValueError unless 0 < energy <= 1, and unless s is a 1-D tensor of
    finite, non-negative values in descending order (what an SVD returns for a finite matrix).
    """
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"energy must be in (0, 1], got {energy}")
    if s.ndim != 1:
        raise ValueError(f"energy_rank: singular values must be a 1-D tensor, got shape {tuple(s.shape)}")
    if s.numel() == 0:
        return 0
    report = nonfinite_report(s)
    if report is not None:
        raise ValueError(
            f"energy_rank: singular values must be finite, got {report} (the decomposed matrix had non-finite entries)"
        )
    if float(s.min()) < 0.0 or bool((s[1:] > s[:-1]).any()):
        raise ValueError(
            f"energy_rank: singular values must be non-negative and descending, got "
            f"{s[:8].tolist()}{'...' if s.numel() > 8 else ''}"
        )
    if float(s[0]) == 0.0:
        return 0
    tol = float(s[0]) * len(s) * torch.finfo(s.dtype).eps
    numerical = max(1, int((s > tol).sum()))  # s[0] > tol unless len(s) * eps >= 1
    e = s[:numerical].double().pow(2).cumsum(0)
    k = int((e < energy * float(e[-1]) * (1 - 1e-12)).sum()) + 1
    return min(k, numerical)


Spec = tuple[torch.Size, torch.dtype, torch.device]


class ContinualMerger(ABC):
    """Base class: validates inputs, counts tasks, assembles merged weights.

    Subclasses implement `_add(task_vector)` (update the state from the next task vector; it must
    not keep references to the given tensors, and when it raises it must leave the state exactly
    as it found it), `_delta(name)` (the current merged task vector of one parameter) and
    `state_tensors()`. `_add` runs only on validated input (keys, shapes, dtypes, devices as
    fixed by the first arrival, every value finite), with `self._spec` already describing it.
    """

    name = "base"

    def __init__(self, *, exclude: str | None = DEFAULT_EXCLUDE):
        self.exclude = re.compile(exclude) if exclude else None
        self.num_tasks = 0
        self._spec: dict[str, Spec] = {}

    # -- public interface ---------------------------------------------------------------------

    def add(self, task_vector: StateDict, *, source: str | None = None) -> None:
        """Merge the next task's task vector (theta_t - theta_0) into the state.

        The first call fixes the keys, shapes, dtypes and devices; later calls must match them
        exactly. `source` (e.g. the file theta_t came from) is named in error messages beside the
        arrival index. Raises ValueError on an empty dict, a non-floating tensor, a NaN or inf, or
        a key/shape/dtype/device mismatch. All-or-nothing: on any exception the state is
        unchanged. The caller may delete the task vector as soon as this returns.
        """
        spec = self._check(task_vector, source)
        first = not self._spec
        if first:
            self._spec = spec  # _add may need it (is_matrix, budgets); withdrawn if _add fails
        try:
            with torch.no_grad():
                self._add(task_vector)
        except BaseException:
            if first:
                self._spec = {}
            raise
        self.num_tasks += 1

    def merged_task_vector(self) -> dict[str, Tensor]:
        """The current merged task vector, name -> tensor (freshly allocated)."""
        self._require_tasks()
        with torch.no_grad():
            return {k: self._delta(k) for k in self._spec}

    def merged(self, theta_0: StateDict, *, source: str | None = None) -> dict[str, Tensor]:
        """theta_0 + the current merged task vector, in theta_0's key order and dtypes.

        theta_0 must hold every merged key as a finite floating tensor of the same shape; extra
        non-floating entries (buffers such as `position_ids`) are passed through unchanged.
        `source` (theta_0's file) is named in error messages. Raises ValueError before any task
        was added, on a missing key, a shape mismatch, a non-floating or non-finite merged
        tensor, or an extra floating key.
        """
        self._require_tasks()
        where = _label(f"{self.name}.merged: theta_0", source)
        missing = [k for k in self._spec if k not in theta_0]
        extra = [k for k, v in theta_0.items() if k not in self._spec and v.is_floating_point()]
        if missing or extra:
            raise ValueError(
                f"{where} does not match the task vectors: missing {missing[:5]}, extra floating {extra[:5]}"
            )
        for k, (shape, _, _) in self._spec.items():
            w = theta_0[k]
            if w.shape != shape:
                raise ValueError(f"{where}: {k!r} has shape {tuple(w.shape)}, the task vectors {tuple(shape)}")
            if not w.is_floating_point():
                raise ValueError(f"{where}: {k!r} must be a floating tensor, got {w.dtype}")
        check_finite({k: theta_0[k] for k in self._spec}, where)
        out = {}
        with torch.no_grad():
            for k, w in theta_0.items():
                out[k] = w if k not in self._spec else (w + self._delta(k).to(w.dtype)).to(w.dtype)
        return out

    @abstractmethod
    def state_tensors(self) -> dict[str, Tensor]:
        """Every tensor the merger holds, by a descriptive name (for memory accounting)."""

    def state_numel(self) -> int:
        return sum(t.numel() for t in self.state_tensors().values())

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state_tensors().values())

    # -- helpers for subclasses -------------------------------------------------------------------

    def is_matrix(self, name: str) -> bool:
        """A 2-D parameter not matched by `exclude`: handled by the subspace methods."""
        shape = self._spec[name][0]
        return len(shape) == 2 and not (self.exclude and self.exclude.search(name))

    @abstractmethod
    def _add(self, task_vector: StateDict) -> None:
        """Fold one validated task vector into the state (every method defines its own rule);
        all-or-nothing: if it raises, the state must be exactly as before."""

    @abstractmethod
    def _delta(self, name: str) -> Tensor:
        """The merged update of parameter `name` from the current state."""

    def _require_tasks(self) -> None:
        if self.num_tasks == 0:
            raise ValueError(f"{self.name}: no task vector added yet")

    def _check(self, tv: StateDict, source: str | None) -> dict[str, Spec]:
        """Validate one arrival against the spec of the earlier ones; return its spec. Changes
        nothing."""
        where = _label(f"{self.name}.add: task {self.num_tasks}", source)
        if not tv:
            raise ValueError(f"{where}: empty task vector")
        for k, v in tv.items():
            if not isinstance(v, Tensor) or not v.is_floating_point():
                raise ValueError(
                    f"{where}: parameter {k!r} must be a floating tensor, got {getattr(v, 'dtype', type(v))}"
                )
        spec = {k: (v.shape, v.dtype, v.device) for k, v in tv.items()}
        if self._spec:
            missing = sorted(set(self._spec) - set(tv))
            extra = sorted(set(tv) - set(self._spec))
            if missing or extra:
                raise ValueError(
                    f"{where}: keys differ from task 0: missing {missing[:5]}"
                    f"{'...' if len(missing) > 5 else ''}, extra {extra[:5]}"
                    f"{'...' if len(extra) > 5 else ''}"
                )
            for k, (shape, dtype, device) in spec.items():
                shape_0, dtype_0, device_0 = self._spec[k]
                if shape != shape_0:
                    raise ValueError(f"{where}: parameter {k!r} has shape {tuple(shape)}, task 0 had {tuple(shape_0)}")
                if dtype != dtype_0:
                    raise ValueError(f"{where}: parameter {k!r} has dtype {dtype}, task 0 had {dtype_0}")
                if device != device_0:
                    raise ValueError(f"{where}: parameter {k!r} is on {device}, task 0 was on {device_0}")
        check_finite(tv, where)
        return spec


def merge_sequence(
    theta_0: StateDict, task_vectors: Iterable[StateDict], merger: ContinualMerger
) -> Iterator[dict[str, Tensor]]:
    """Feed task vectors one by one; yield the merged weights after each arrival.

    `task_vectors` should be lazy (a generator loading theta_t and returning task_vector(theta_t,
    theta_0)) so that only one incoming task vector is alive at a time; this function drops its
    reference before yielding. The caller decides whether to keep each yielded dict (for a
    forgetting curve, evaluate it and let it go).
    """
    for tv in task_vectors:
        merger.add(tv)
        del tv
        yield merger.merged(theta_0)
