"""Behavioural metrics on logits (the logit difference of Wang et al. 2023, *Interpretability in the Wild*), the
relative effect of an intervention and the normalized effect of a patch."""

from __future__ import annotations

import math
from typing import Any

import torch

from .._checks import is_int, is_real
from .._placement import is_index_dtype
from ..errors import ArgumentError, ShapeError, UndefinedNormalizationError


def _ids(ids: Any, batch: int, vocab: int, device: torch.device, name: str) -> torch.Tensor:
    """``ids`` (a token id or one per row) as ``(batch,)`` int64 on ``device``, each in ``[0, vocab)``."""
    if is_int(ids):
        t = torch.tensor(int(ids), device="cpu")
    elif isinstance(ids, torch.Tensor) and is_index_dtype(ids.dtype):
        t = ids
    elif isinstance(ids, (list, tuple)) and all(is_int(i) for i in ids):
        t = torch.tensor([int(i) for i in ids], dtype=torch.long, device="cpu")
    else:
        raise ArgumentError(f"{name} must be a token id (int) or one per row (a list / integer tensor), got {ids!r}")
    if t.dim() > 1 or (t.dim() == 1 and t.shape[0] != batch):
        raise ArgumentError(f"{name} must be one token id or {batch} (one per row), got shape {tuple(t.shape)}")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
        raise ArgumentError(f"{name} must be token ids in [0, {vocab}), got {t.tolist()}")
    t = t.to(device=device, dtype=torch.long)
    return t.expand(batch) if t.ndim == 0 else t


def logit_difference(logits: torch.Tensor, correct_ids: Any, incorrect_ids: Any, position: int = -1) -> torch.Tensor:
    """``logit[correct] − logit[incorrect]`` at ``position``, per batch row: ``(batch,)``, in fp32 on
    the logits' device (the ids may be on any device).

    Args:
        logits: ``(batch, pos, vocab)``.
        correct_ids, incorrect_ids: a token id or one per row ``(batch,)``, each in ``[0, vocab)``.
        position: an int in ``[-pos, pos)`` (negative counts from the end).

    Raises:
        ShapeError: ``logits`` not ``(batch, pos, vocab)``.
        ArgumentError: ids that are not token ids of this vocabulary (floats, bools, negative, ``>= vocab``,
            the wrong count), or ``position`` not an int in range.

    Source: *From Tokenization to Attribution Graphs* §4.4 (logit difference); Wang et al. 2023, *Interpretability in
    the Wild*.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ShapeError(f"logit_difference: logits must be (batch, pos, vocab), got {got}")
    b, seq, vocab = logits.shape
    if not is_int(position) or not -seq <= position < seq:
        raise ArgumentError(f"logit_difference: position must be an int in [-{seq}, {seq}), got {position!r}")
    correct = _ids(correct_ids, b, vocab, logits.device, "correct_ids")
    incorrect = _ids(incorrect_ids, b, vocab, logits.device, "incorrect_ids")
    last = logits[:, position, :].float()
    rows = torch.arange(last.shape[0], device=last.device)
    return last[rows, correct] - last[rows, incorrect]


def relative_effect(baseline: torch.Tensor | float, intervened: torch.Tensor | float, *,
                    rounding: float | None = None) -> torch.Tensor:
    """``(baseline − intervened) / baseline``: 1 means the intervention removed the behaviour, 0 no effect.

    In fp32 on ``baseline``'s device (``intervened`` is moved there; numbers go to the CPU). Undefined where the
    baseline is 0 or rounding-sized (``|baseline| <= NORMALIZATION_TOLERANCE · rounding · max(|baseline|,
    |intervened|)``, :func:`check_gap`'s rule): refused there, as :func:`normalized_effect` refuses (until 2026-11-27
    ``±inf``, NaN or a quotient of rounding noise). ``rounding``: the eps of the logits' dtype the metrics come from
    (``torch.finfo(dtype).eps``, e.g. ``2**-7`` for a bf16 model: the experiments' results pass theirs); default the
    eps of the coarser of the inputs' dtypes, at least fp32's (until 2026-11-28 always fp32's, so a bf16 model's
    rounding-sized baseline gave a quotient of noise).

    Raises:
        UndefinedNormalizationError: naming the rows (elements) and both values where the baseline is 0 or
            rounding-sized.
        ArgumentError: ``baseline`` or ``intervened`` not a real number or real tensor (bools, strings, None,
            non-finite numbers); ``rounding`` not a finite number in ``[0, 1)``.

    Source: *From Tokenization to Attribution Graphs* §10.4 (relative effect).
    """
    for name, value in (("baseline", baseline), ("intervened", intervened)):
        if isinstance(value, torch.Tensor):
            if value.dtype == torch.bool or value.dtype.is_complex:
                raise ArgumentError(f"relative_effect: {name} must be a real tensor, got dtype {value.dtype}")
        elif not is_real(value) or not math.isfinite(value):
            raise ArgumentError(f"relative_effect: {name} must be a finite number or a tensor, got {value!r}")
    if rounding is None:
        rounding = max([torch.finfo(torch.float32).eps] + [
            torch.finfo(v.dtype).eps for v in (baseline, intervened)
            if isinstance(v, torch.Tensor) and v.dtype.is_floating_point])
    elif not is_real(rounding) or not 0 <= rounding < 1:
        raise ArgumentError(f"relative_effect: rounding must be a number in [0, 1) (a dtype's eps), got {rounding!r}")
    b = baseline.to(torch.float32) if isinstance(baseline, torch.Tensor) else torch.tensor(float(baseline),
                                                                                            device="cpu")
    i = torch.as_tensor(intervened).to(device=b.device, dtype=torch.float32)
    check_gap(b, torch.zeros_like(b), float(rounding), "relative_effect", ("the baseline", "0"),
              torch.maximum(b.abs(), i.abs()), "an effect relative to a zero baseline is undefined; read the "
              "difference baseline − intervened")
    return (b - i) / b


def metric_rounding(logits: torch.Tensor) -> float:
    """The rounding of metrics read from ``logits``: the eps of the logits' dtype (``2**-7`` for bf16), at least
    fp32's, the dtype the experiments' metrics are in (:func:`~.experiments.make_metric`); an fp64 model's metrics
    are rounded to fp32 all the same. What the experiments' results carry as ``rounding``."""
    return max(torch.finfo(logits.dtype).eps, torch.finfo(torch.float32).eps)


#: clean and corrupt metrics closer than this many units of the logits' rounding (``finfo(logits dtype).eps`` times
#: the larger ``|metric|``) leave :func:`normalized_effect` undefined
NORMALIZATION_TOLERANCE = 4


def check_gap(first: torch.Tensor, second: torch.Tensor, rounding: float, what: str,
              names: tuple[str, str] = ("clean", "corrupt"), scale: torch.Tensor | None = None,
              advice: str = "drop those prompts (their corrupt prompt does not move the metric) or read the "
                            "unnormalized difference") -> torch.Tensor:
    """``first − second`` (fp32, any shape), refused where it is 0 or rounding: a denominator with
    ``|first − second| <= NORMALIZATION_TOLERANCE · rounding · scale`` (``scale`` default ``max(|first|, |second|)``;
    ``rounding``: the eps of the logits' dtype the metrics come from, e.g. ``2**-7`` for bf16) would give ±inf, NaN or
    a huge quotient of rounding noise. The one check of :func:`normalized_effect`, :func:`relative_effect` and
    :func:`~.circuit.circuit_size`.

    Raises:
        UndefinedNormalizationError: naming ``what``, the rows (flat indices), both values (``names``) and ``advice``.
    """
    gap = first - second
    scale = torch.maximum(first.abs(), second.abs()) if scale is None else scale
    flat = (gap.abs() <= NORMALIZATION_TOLERANCE * rounding * scale).flatten()
    if bool(flat.any()):
        rows = flat.nonzero().flatten().tolist()
        a, b = first.flatten(), second.expand_as(first).flatten()
        shown = ", ".join(f"{float(a[i]):.6g} vs {float(b[i]):.6g}" for i in rows[:5])
        raise UndefinedNormalizationError(
            f"{what}: {names[0]} and {names[1]} are equal within the logits' rounding at rows {rows} ({shown}"
            f"{', …' if len(rows) > 5 else ''}): a ratio over ({names[0]} − {names[1]}) is undefined there; {advice}")
    return gap


def normalized_effect(numerator: torch.Tensor, clean: torch.Tensor, corrupt: torch.Tensor, rounding: float,
                      what: str) -> torch.Tensor:
    """``numerator / (clean − corrupt)`` per prompt (``numerator``: ``(n_groups, batch)``; ``clean``, ``corrupt``:
    ``(batch,)``; fp32 like them): the share of the clean–corrupt gap a patch moves (Wang et al. 2023's normalized
    logit difference; Heimersheim & Nanda 2024, "How to use and interpret activation patching").

    The ratio is undefined where the gap is 0 and meaningless where it is rounding: a row with
    ``|clean − corrupt| <= NORMALIZATION_TOLERANCE · rounding · max(|clean|, |corrupt|)`` (``rounding``: the eps of
    the logits' dtype the metrics come from, e.g. ``2**-7`` for bf16) is refused rather than returned as ±inf, NaN or
    a huge quotient of rounding noise (:func:`check_gap`); drop those prompts (their corrupt prompt does not change the
    metric) or read the unnormalized difference (``numerator``).

    Raises:
        UndefinedNormalizationError: naming ``what``, the rows and their clean and corrupt metrics.
    """
    return numerator / check_gap(clean, corrupt, rounding, what, ("the clean", "corrupt metrics"))[None]
