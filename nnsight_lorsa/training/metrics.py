"""Metrics over masked tokens: FVU, explained variance, L0, dead fraction, and the next-token CE.

FVU (fraction of variance unexplained) = ``Σ‖y − ŷ‖² / Σ‖y − ȳ‖²`` over the kept tokens, with
``ȳ`` their mean (1 − explained variance, as SAELens and the Lorsa paper report it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._typing import Float


def next_token_ce(logits: Float[torch.Tensor, "batch pos vocab"], ids: torch.Tensor,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy (nats) of ``logits`` for the targets ``ids[:, 1:]`` over the
    predictions ``mask[:, 1:]`` keeps (all when None), and their count.

    The sum is a 0-d fp32 tensor on the logits' device, differentiable (``float()`` it for a report);
    ``ids`` ``(batch, pos)`` and ``mask`` ``(batch, pos)`` bool are moved there (a model split over
    devices puts its logits on the last). The one CE of the package: the evaluations' ``ce_*``
    (:func:`~.evaluate.evaluate`) and sparse-attention training's constraint and τ.
    """
    targets = ids[:, 1:].to(logits.device)
    pred = logits[:, :-1]
    if mask is not None:
        keep = mask[:, 1:].to(logits.device, torch.bool)
        pred, targets = pred[keep], targets[keep]
    pred, targets = pred.reshape(-1, pred.shape[-1]).float(), targets.reshape(-1)
    return F.cross_entropy(pred, targets, reduction="sum"), int(targets.numel())


def fvu(y: Float[torch.Tensor, "n d"], y_hat: Float[torch.Tensor, "n d"]) -> torch.Tensor:
    """Fraction of variance unexplained over rows (a scalar tensor); 1.0 predicts the mean.

    Computed in (at least) fp32 on ``y``'s device (``y_hat`` is moved there): bf16 / fp16 inputs
    are upcast first.
    """
    if y.dtype not in (torch.float32, torch.float64):
        y = y.float()
    y_hat = y_hat.to(device=y.device, dtype=y.dtype)
    resid = (y - y_hat).pow(2).sum()
    total = (y - y.mean(0, keepdim=True)).pow(2).sum().clamp_min(1e-30)
    return resid / total


class FVUAccumulator:
    """Streaming FVU over many batches: the running mean and sum of squared deviations merged batch by batch in
    fp64 (Chan, Golub & LeVeque 1979, the pairwise update), so the total variance is never the difference of two
    large sums (``Σ‖y‖² − ‖Σy‖²/n`` cancels when the mean is large against the spread: 1.5% off at an offset of
    1e7 with unit spread, where this is exact to ~1e-9). ``value()`` is NaN before any update.
    """

    def __init__(self) -> None:
        self.n = 0
        self.mean: torch.Tensor | None = None  # (d,) fp64, on the first batch's device
        self.m2 = 0.0  # Σ over rows and dimensions of (y - mean)², the merged total
        self.sse = 0.0

    def update(self, y: Float[torch.Tensor, "n d"], y_hat: Float[torch.Tensor, "n d"]) -> None:
        y = y.double()
        n_b = y.shape[0]
        if n_b == 0:
            return
        mean_b = y.mean(0)
        m2_b = float((y - mean_b).pow(2).sum())
        self.sse += float((y - y_hat.double().to(y.device)).pow(2).sum())
        if self.mean is None:
            self.n, self.mean, self.m2 = n_b, mean_b, m2_b
            return
        total, mean = self.n + n_b, self.mean.to(y.device)
        delta = mean_b - mean
        self.m2 += m2_b + float(delta.pow(2).sum()) * self.n * n_b / total
        self.mean = mean + delta * (n_b / total)
        self.n = total

    def value(self) -> float:
        if self.n == 0 or self.mean is None:
            return float("nan")
        return self.sse / max(self.m2, 1e-30)


class ShrinkageAccumulator:
    """SAELens's shrinkage and density metrics over many batches (``sae_lens/evals.py``,
    ``get_sparsity_and_variance_metrics``), with their names:

    * ``l2_norm_in`` / ``l2_norm_out``: mean ``‖y‖`` / ``‖ŷ‖`` per token;
    * ``l2_ratio``: mean ``‖ŷ‖ / ‖y‖`` per token (``‖y‖ < 1e-4`` divides by 1, as SAELens);
    * ``relative_reconstruction_bias``: ``E‖ŷ‖² / E⟨y, ŷ⟩`` (Rajamanoharan et al. 2024,
      arXiv:2404.16014 eq. 10; 1 = unbiased, < 1 = shrinkage), over all tokens at once (SAELens
      averages per-batch ratios: equal for one batch);
    * ``feature_density``: per feature, the fraction of tokens where it is non-zero (``!= 0``, so
      signed AbsTopK features count).
    """

    def __init__(self, n_latents: int) -> None:
        self.n = 0
        self.sums = {"l2_norm_in": 0.0, "l2_norm_out": 0.0, "l2_ratio": 0.0, "out_sq": 0.0, "dot": 0.0}
        self.fires = torch.zeros(n_latents, dtype=torch.float64, device="cpu")  # host-side counts

    def update(self, y: Float[torch.Tensor, "n d"], y_hat: Float[torch.Tensor, "n d"],
               acts: Float[torch.Tensor, "n f"]) -> None:
        y, y_hat = y.double(), y_hat.double()
        norm_in, norm_out = y.norm(dim=-1), y_hat.norm(dim=-1)
        self.n += y.shape[0]
        self.sums["l2_norm_in"] += float(norm_in.sum())
        self.sums["l2_norm_out"] += float(norm_out.sum())
        self.sums["l2_ratio"] += float((norm_out / torch.where(norm_in.abs() < 1e-4, 1.0, norm_in)).sum())
        self.sums["out_sq"] += float(norm_out.pow(2).sum())
        self.sums["dot"] += float((y * y_hat).sum())
        self.fires += (acts != 0).sum(0).to(self.fires)

    def value(self) -> dict[str, float | list[float]]:
        """``{"l2_norm_in", "l2_norm_out", "l2_ratio", "relative_reconstruction_bias", "feature_density"}``
        (NaN / empty-set densities of 0 before any update)."""
        n = max(self.n, 1)
        nan = float("nan")
        return {"l2_norm_in": self.sums["l2_norm_in"] / n if self.n else nan,
                "l2_norm_out": self.sums["l2_norm_out"] / n if self.n else nan,
                "l2_ratio": self.sums["l2_ratio"] / n if self.n else nan,
                "relative_reconstruction_bias": self.sums["out_sq"] / self.sums["dot"] if self.sums["dot"] else nan,
                "feature_density": (self.fires / n).tolist()}
