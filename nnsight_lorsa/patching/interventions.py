"""Interventions to call inside a ``model.trace`` body; each edits its target's activation in place.

>>> r = ReplacementModel(model, lorsa=lorsa_set)                       # doctest: +SKIP
>>> with model.trace(ids):                                      # doctest: +SKIP
...     ablate(r(MHSAHead(1, 2)))                               # zero an MHSA head
...     scale(r(LorsaHead(2, 17)), 2.0)                         # double a Lorsa head's z
...     logits = model.lm_head.output.save()

Several interventions in one body must come in the model's execution order (earlier layers
first; in a layer MHSA head < Lorsa head < transcoder feature < SAE feature on the layer
output): :meth:`ReplacementModel.sort` orders targets that way. Inside ``tracer.invoke`` they act on
that invoke's rows only. ``positions`` picks the positions edited (an int, slice, list; None:
all); values are per position: ``(batch, n_pos[, head_dim])`` or anything broadcastable to it.
Values (means, deltas, patched-in values) may live on any device and in any dtype: each is moved to
the target's device and cast to its dtype where it is written (token ids given to ``model.trace``
may stay on the CPU: nnsight moves a trace's input tensors to the model's device).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch

from .._placement import like
from ..envoy.edit_log import note_edit
from ..envoy.replacement_model import ReplacementModel
from ..envoy.targets import Bound, Positions, Target, index_at
from ..errors import ConfigMismatchError


def _loc(target: Bound, positions: Positions) -> tuple[Any, tuple]:
    if not isinstance(target, Bound):
        raise ConfigMismatchError(f"bind targets first: replacement(target), got {target!r}")
    tensor, cols = target.location()
    return tensor, index_at(cols, positions)


def _edited(target: Bound, positions: Positions, what: str) -> None:
    """Tell an intervened-pass attribution of this trace (``attribute(rm, tracer=tracer)``), if any, what
    was edited: its node is marked and held at the edited value in the graph."""
    note_edit(target.target, positions, what)


def read(target: Bound, positions: Positions = None) -> torch.Tensor:
    """The target's current value (a saved copy): ``(batch, n_pos[, head_dim])``."""
    tensor, idx = _loc(target, positions)
    return tensor[idx].clone().save()


def ablate(target: Bound, mode: Literal["zero", "mean"] = "zero", means: Any = None,
           positions: Positions = None) -> None:
    """Set the target to 0 (``mode="zero"``) or to its mean (``mode="mean"``).

    ``means``: a tensor (the target's mean value) or the mapping returned by
    :func:`mean_activations` (keyed by target).
    """
    tensor, idx = _loc(target, positions)
    if mode == "zero":
        tensor[idx] = 0
        _edited(target, positions, "ablate")
        return
    if mode != "mean":
        raise ConfigMismatchError(f"ablation mode must be 'zero' or 'mean', got {mode!r}")
    if isinstance(means, Mapping):
        if target.target not in means:
            raise ConfigMismatchError(f"no mean for {target.target}")
        means = means[target.target]
    if means is None:
        raise ConfigMismatchError("mode='mean' needs means= (see mean_activations)")
    target.replacement.check_values(target.target, torch.as_tensor(means, device="cpu"))
    tensor[idx] = like(means, tensor)  # on the target's device, in its dtype (means may come from anywhere)
    _edited(target, positions, "ablate")


def scale(target: Bound, alpha: float, positions: Positions = None) -> None:
    """Multiply the target by ``alpha`` (``-alpha`` inhibits, as the feature inhibition of Lindsey et al. 2025, *On
    the Biology of a Large Language Model*)."""
    tensor, idx = _loc(target, positions)
    tensor[idx] = tensor[idx] * alpha
    _edited(target, positions, "scale")


def steer(target: Bound, delta: Any, positions: Positions = None) -> None:
    """Add ``delta`` (a number, or a ``head_dim`` vector for MHSA heads) to the target."""
    tensor, idx = _loc(target, positions)
    if isinstance(delta, torch.Tensor):
        target.replacement.check_values(target.target, delta)
        delta = delta.to(device=tensor.device, dtype=tensor.dtype)
    tensor[idx] = tensor[idx] + delta
    _edited(target, positions, "steer")


def patch(target: Bound, source_values: torch.Tensor, positions: Positions = None) -> None:
    """Overwrite the target by ``source_values`` (e.g. read from another prompt's run)."""
    target.replacement.check_values(target.target, source_values)
    tensor, idx = _loc(target, positions)
    tensor[idx] = torch.as_tensor(source_values).to(device=tensor.device, dtype=tensor.dtype)
    _edited(target, positions, "patch")


def mean_activations(replacement: ReplacementModel, targets: Iterable[Target], prompts: Any,
                     per_position: bool = False) -> dict[Target, torch.Tensor]:
    """Mean value of each target over a reference set ``prompts`` (token ids or text).

    Averaged over batch and positions (``per_position=False``: ``()`` or ``(head_dim,)``), or over
    the batch only (``(pos[, head_dim])``; the prompts must then share one length). The means are
    averaged in fp32 and returned on the device and in the dtype of the values they average (the
    model's, or a spliced module's); :func:`ablate` moves them to wherever they are written.
    """
    ordered = replacement.sort(targets)
    for t in ordered:
        replacement.check(t)
    saved = {}
    with torch.no_grad(), replacement.model.trace(prompts):
        replacement.prepare(ordered)
        for t in ordered:
            saved[t] = read(Bound(t, replacement))
    dims = (0,) if per_position else (0, 1)
    return {t: v.float().mean(dims).to(v.dtype) for t, v in saved.items()}
