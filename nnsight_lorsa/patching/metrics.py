"""Behavioural metrics on logits (the logit difference of Wang et al. 2023, *Interpretability in the Wild*) and the
relative effect of an intervention."""

from __future__ import annotations

from typing import Any

import torch


def _ids(ids: Any, batch: int, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(ids, device=device).long()
    return t.expand(batch) if t.ndim == 0 else t


def logit_difference(logits: torch.Tensor, correct_ids: Any, incorrect_ids: Any, position: int = -1) -> torch.Tensor:
    """``logit[correct] − logit[incorrect]`` at ``position``, per batch row: ``(batch,)``, in fp32 on
    the logits' device (the ids may be on any device).

    Args:
        logits: ``(batch, pos, vocab)``.
        correct_ids, incorrect_ids: a token id or one per row ``(batch,)``.
    """
    last = logits[:, position, :].float()
    rows = torch.arange(last.shape[0], device=last.device)
    n = last.shape[0]
    return last[rows, _ids(correct_ids, n, last.device)] - last[rows, _ids(incorrect_ids, n, last.device)]


def relative_effect(baseline: torch.Tensor | float, intervened: torch.Tensor | float) -> torch.Tensor:
    """``(baseline − intervened) / baseline``: 1 means the intervention removed the behaviour, 0 no effect.

    In fp32 on ``baseline``'s device (``intervened`` is moved there; numbers go to the CPU)."""
    b = baseline.to(torch.float32) if isinstance(baseline, torch.Tensor) else torch.tensor(float(baseline),
                                                                                            device="cpu")
    return (b - torch.as_tensor(intervened).to(device=b.device, dtype=torch.float32)) / b
