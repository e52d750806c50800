"""The continual merging interface shared by every method, and the state-dict helpers it needs.

A task vector is tau_t = theta_t - theta_0: a dict from parameter name to a floating tensor, the
same keys and shapes for every task. Tasks arrive one at a time:

    merger = make_merger("gs3r", rank_budget=0.5)       # crucible.merge.make_merger
    for theta_t in finetuned_state_dicts():              # loaded lazily, one at a time
        merger.add(task_vector(theta_t, theta_0))        # the merger may drop tau_t afterwards
        merged = merger.merged(theta_0)                  # current merged weights

A merger holds only its own state (`state_tensors()`); it never keeps a reference to a task vector
it was given, nor to theta_0, so the caller's peak memory is theta_0 + one incoming task vector +
the merger state (+ the merged dict when asked for one).

Every parameter is classified once, on the first `add`, as a *matrix* (2-D and its name not
matched by the `exclude` regex, default: embeddings) or *other* (biases, norms, embeddings). The
subspace methods (OPCM, GS3R) act on matrices only and give the others a simple rule, stated in
each method's docstring; the element-wise methods (task arithmetic, average, TIES, MagMax) treat
every parameter alike.
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


def task_vector(theta_t: StateDict, theta_0: StateDict, inplace: bool = False) -> dict[str, Tensor]:
    """tau = theta_t - theta_0 over the floating tensors of theta_0, in float32.

    Non-floating entries (e.g. a BERT `position_ids` buffer) are left out: they are not weights.
    With `inplace`, float32 tensors of theta_t are overwritten by their difference (no second copy
    of the model: the incoming model becomes its task vector; pre-merge flushing for the caller).
    Raises ValueError when theta_t lacks a floating key of theta_0, has an extra floating key, or
    a shape differs; then nothing has been modified.
    """
    keys = [k for k, v in theta_0.items() if v.is_floating_point()]
    extra = sorted(k for k, v in theta_t.items() if v.is_floating_point() and k not in theta_0)
    missing = sorted(k for k in keys if k not in theta_t)
    if missing or extra:
        raise ValueError(f"task_vector: fine-tuned state dict does not match the base: missing "
                         f"{missing[:5]}{'...' if len(missing) > 5 else ''}, extra "
                         f"{extra[:5]}{'...' if len(extra) > 5 else ''}")
    out = {}
    for k in keys:
        if theta_t[k].shape != theta_0[k].shape:
            raise ValueError(f"task_vector: shape of {k!r} is {tuple(theta_t[k].shape)} in the "
                             f"fine-tuned model but {tuple(theta_0[k].shape)} in the base")
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
    values: it happens on real task vectors in float32) retry in float64, results in x's dtype."""
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
    never takes noise directions even at energy = 1. Returns 0 for a zero matrix. Raises
    ValueError unless 0 < energy <= 1.
    """
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"energy must be in (0, 1], got {energy}")
    if s.numel() == 0 or float(s[0]) <= 0.0:
        return 0
    tol = float(s[0]) * len(s) * torch.finfo(s.dtype).eps
    numerical = int((s > tol).sum())
    e = s[:numerical].double().pow(2).cumsum(0)
    k = int((e < energy * float(e[-1]) * (1 - 1e-12)).sum()) + 1
    return min(k, numerical)


class ContinualMerger(ABC):
    """Base class: validates inputs, counts tasks, assembles merged weights.

    Subclasses implement `_add(task_vector)` (update the state from the next task vector; it must
    not keep references to the given tensors), `_delta(name)` (the current merged task vector of
    one parameter) and `state_tensors()`.
    """

    name = "base"

    def __init__(self, *, exclude: str | None = DEFAULT_EXCLUDE):
        self.exclude = re.compile(exclude) if exclude else None
        self.num_tasks = 0
        self._spec: dict[str, tuple[torch.Size, torch.dtype]] = {}

    # -- public interface ---------------------------------------------------------------------

    def add(self, task_vector: StateDict) -> None:
        """Merge the next task's task vector (theta_t - theta_0) into the state.

        The first call fixes the keys, shapes and dtypes; later calls must match them exactly.
        Raises ValueError on an empty dict, a non-floating tensor, or a key/shape/dtype mismatch.
        The caller may delete the task vector as soon as this returns.
        """
        self._check(task_vector, "task vector")
        with torch.no_grad():
            self._add(task_vector)
        self.num_tasks += 1

    def merged_task_vector(self) -> dict[str, Tensor]:
        """The current merged task vector, name -> tensor (freshly allocated)."""
        self._require_tasks()
        with torch.no_grad():
            return {k: self._delta(k) for k in self._spec}

    def merged(self, theta_0: StateDict) -> dict[str, Tensor]:
        """theta_0 + the current merged task vector, in theta_0's key order and dtypes.

        theta_0 must hold every merged key with the same shape; extra non-floating entries
        (buffers such as `position_ids`) are passed through unchanged. Raises ValueError before
        any task was added, on a missing key or shape mismatch, or on an extra floating key.
        """
        self._require_tasks()
        missing = [k for k in self._spec if k not in theta_0]
        extra = [k for k, v in theta_0.items() if k not in self._spec and v.is_floating_point()]
        if missing or extra:
            raise ValueError(f"{self.name}.merged: theta_0 does not match the task vectors: "
                             f"missing {missing[:5]}, extra floating {extra[:5]}")
        out = {}
        with torch.no_grad():
            for k, w in theta_0.items():
                if k not in self._spec:
                    out[k] = w
                    continue
                if w.shape != self._spec[k][0]:
                    raise ValueError(f"{self.name}.merged: theta_0[{k!r}] has shape "
                                     f"{tuple(w.shape)}, task vectors {tuple(self._spec[k][0])}")
                out[k] = (w + self._delta(k).to(w.dtype)).to(w.dtype)
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
        """Fold one validated task vector into the state (every method defines its own rule)."""

    @abstractmethod
    def _delta(self, name: str) -> Tensor:
        """The merged update of parameter `name` from the current state."""

    def _require_tasks(self) -> None:
        if self.num_tasks == 0:
            raise ValueError(f"{self.name}: no task vector added yet")

    def _check(self, tv: StateDict, what: str) -> None:
        if not tv:
            raise ValueError(f"{self.name}.add: empty {what}")
        for k, v in tv.items():
            if not isinstance(v, Tensor) or not v.is_floating_point():
                raise ValueError(f"{self.name}.add: {what}[{k!r}] must be a floating tensor, got "
                                 f"{getattr(v, 'dtype', type(v))}")
        if not self._spec:
            self._spec = {k: (v.shape, v.dtype) for k, v in tv.items()}
            return
        missing = sorted(set(self._spec) - set(tv))
        extra = sorted(set(tv) - set(self._spec))
        if missing or extra:
            raise ValueError(f"{self.name}.add: keys of task {self.num_tasks} differ from task 0: "
                             f"missing {missing[:5]}, extra {extra[:5]}")
        for k, v in tv.items():
            shape, dtype = self._spec[k]
            if v.shape != shape or v.dtype != dtype:
                raise ValueError(f"{self.name}.add: {what}[{k!r}] of task {self.num_tasks} is "
                                 f"{tuple(v.shape)} {v.dtype}, task 0 had {tuple(shape)} {dtype}")


def merge_sequence(theta_0: StateDict, task_vectors: Iterable[StateDict],
                   merger: ContinualMerger) -> Iterator[dict[str, Tensor]]:
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
