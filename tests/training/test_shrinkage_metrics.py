"""SAELens's shrinkage / density metrics (``ShrinkageAccumulator``) against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from nnsight_lorsa.training.metrics import ShrinkageAccumulator


def test_shrinkage_by_hand() -> None:
    y = torch.tensor([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0]])       # norms 5, 0, 1
    y_hat = torch.tensor([[1.5, 2.0], [0.0, 1.0], [2.0, 0.0]])   # norms 2.5, 1, 2
    acts = torch.tensor([[1.0, 0.0, 0.0], [0.0, -2.0, 0.0], [3.0, 0.0, 0.0]])
    acc = ShrinkageAccumulator(3)
    acc.update(y[:2], y_hat[:2], acts[:2])  # two batches give the same as one
    acc.update(y[2:], y_hat[2:], acts[2:])
    v = acc.value()
    assert v["l2_norm_in"] == pytest.approx((5 + 0 + 1) / 3)
    assert v["l2_norm_out"] == pytest.approx((2.5 + 1 + 2) / 3)
    # ‖y‖ = 0 < 1e-4 divides by 1 (SAELens): ratios 0.5, 1, 2
    assert v["l2_ratio"] == pytest.approx((0.5 + 1.0 + 2.0) / 3)
    # E‖ŷ‖² / E<y, ŷ> = (6.25 + 1 + 4) / (12.5 + 0 + 2)
    assert v["relative_reconstruction_bias"] == pytest.approx(11.25 / 14.5)
    # != 0 counts the negative (AbsTopK) activation too
    assert v["feature_density"] == pytest.approx([2 / 3, 1 / 3, 0.0])


def test_shrinkage_empty_is_nan() -> None:
    v = ShrinkageAccumulator(2).value()
    assert math.isnan(v["l2_ratio"]) and math.isnan(v["relative_reconstruction_bias"])
    assert v["feature_density"] == [0.0, 0.0]
