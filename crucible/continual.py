"""Accuracy and forgetting along a sequence of task arrivals (continual learning and merging).

R is the accuracy matrix: R[j, i] = accuracy on task i after the arrival of task j (0-based, tasks
indexed by arrival), NaN where not measured (typically i > j: a task not yet arrived).

    R = [[0.90, nan ],
         [0.85, 0.80]]
    average_accuracy(R)                  -> 0.825         mean of the last row
    normalised_accuracy(R, [0.9, 0.8])   -> 0.972..       mean_i R[T-1, i] / ref_i
    backward_transfer(R)                 -> -0.05         mean_{i<T-1} R[T-1, i] - R[i, i]
    accuracy_curve(R)                    -> [0.90, 0.825] average over the arrived tasks, per arrival

Backward transfer is Lopez-Paz & Ranzato's BWT (GEM, 2017): negative is forgetting. With one task
it is undefined (NaN).
"""

from __future__ import annotations

import numpy as np


def _matrix(R) -> np.ndarray:
    R = np.asarray(R, dtype=float)
    if R.ndim != 2 or R.shape[0] != R.shape[1] or R.shape[0] == 0:
        raise ValueError(f"accuracy matrix must be square and non-empty (arrivals x tasks), got shape {R.shape}")
    if np.isnan(np.diag(R)).any() or np.isnan(R[-1]).any():
        raise ValueError("accuracy matrix: the diagonal and the last row must be measured (no NaN)")
    return R


def average_accuracy(R) -> float:
    """Mean accuracy over all tasks after the last arrival."""
    return float(_matrix(R)[-1].mean())


def normalised_accuracy(R, reference) -> float:
    """Mean over tasks of R[T-1, i] / reference[i] (e.g. each task's own fine-tuned accuracy)."""
    R = _matrix(R)
    ref = np.asarray(reference, dtype=float)
    if ref.shape != (R.shape[1],) or (ref <= 0).any():
        raise ValueError(f"reference accuracies must be {R.shape[1]} positive numbers, got {ref.tolist()}")
    return float((R[-1] / ref).mean())


def backward_transfer(R) -> float:
    """BWT = mean_{i < T-1} (R[T-1, i] - R[i, i]); NaN for a single task."""
    R = _matrix(R)
    T = R.shape[0]
    if T == 1:
        return float("nan")
    return float(np.mean([R[-1, i] - R[i, i] for i in range(T - 1)]))


def accuracy_curve(R) -> list[float]:
    """After each arrival j, the mean accuracy over the tasks arrived so far (R[j, :j+1])."""
    R = _matrix(R)
    return [float(np.mean(R[j, : j + 1])) for j in range(R.shape[0])]
