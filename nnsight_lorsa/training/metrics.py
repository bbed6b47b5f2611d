"""Reconstruction metrics over masked tokens: FVU, explained variance, L0, dead fraction.

FVU (fraction of variance unexplained) = ``Σ‖y − ŷ‖² / Σ‖y − ȳ‖²`` over the kept tokens, with
``ȳ`` their mean (1 − explained variance, as SAELens and the Lorsa paper report it).
"""

from __future__ import annotations

import torch

from .._typing import Float


def fvu(y: Float[torch.Tensor, "n d"], y_hat: Float[torch.Tensor, "n d"]) -> torch.Tensor:
    """Fraction of variance unexplained over rows (a scalar tensor); 1.0 predicts the mean."""
    resid = (y - y_hat).pow(2).sum()
    total = (y - y.mean(0, keepdim=True)).pow(2).sum().clamp_min(1e-30)
    return resid / total


class FVUAccumulator:
    """Streaming FVU over many batches with an exact running mean (Chan et al. merge of sums)."""

    def __init__(self) -> None:
        self.n = 0
        self.sum_y: torch.Tensor | None = None
        self.sum_y2 = 0.0
        self.sse = 0.0

    def update(self, y: Float[torch.Tensor, "n d"], y_hat: Float[torch.Tensor, "n d"]) -> None:
        y = y.double()
        self.n += y.shape[0]
        self.sum_y = y.sum(0) if self.sum_y is None else self.sum_y + y.sum(0)
        self.sum_y2 += float(y.pow(2).sum())
        self.sse += float((y - y_hat.double()).pow(2).sum())

    def value(self) -> float:
        if self.n == 0 or self.sum_y is None:
            return float("nan")
        total = self.sum_y2 - float(self.sum_y.pow(2).sum()) / self.n
        return self.sse / max(total, 1e-30)
