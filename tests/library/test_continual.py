"""Accuracy-matrix metrics against hand computations."""

import math

import numpy as np
import pytest

from crucible.continual import accuracy_curve, average_accuracy, backward_transfer, normalised_accuracy

NAN = float("nan")
R = [[0.9, NAN, NAN], [0.8, 0.7, NAN], [0.6, 0.75, 0.5]]


def test_closed_forms():
    assert average_accuracy(R) == pytest.approx((0.6 + 0.75 + 0.5) / 3)
    assert backward_transfer(R) == pytest.approx(((0.6 - 0.9) + (0.75 - 0.7)) / 2)
    assert normalised_accuracy(R, [0.9, 0.75, 0.5]) == pytest.approx((0.6 / 0.9 + 1 + 1) / 3)
    assert accuracy_curve(R) == pytest.approx([0.9, 0.75, (0.6 + 0.75 + 0.5) / 3])


def test_no_forgetting_and_single_task():
    same = np.array([[0.7, NAN], [0.7, 0.6]])
    assert backward_transfer(same) == 0.0
    assert math.isnan(backward_transfer([[0.8]]))
    assert average_accuracy([[0.8]]) == 0.8


def test_bad_matrices():
    with pytest.raises(ValueError, match="square"):
        average_accuracy([[0.1, 0.2]])
    with pytest.raises(ValueError, match="diagonal and the last row"):
        backward_transfer([[0.5, NAN], [NAN, 0.4]])
    with pytest.raises(ValueError, match="positive"):
        normalised_accuracy(R, [0.9, 0.0, 0.5])
