"""Interventions to call inside a ``model.trace`` body; each edits its target's activation in place.

>>> r = ReplacementModel(model, lorsa=lorsa_set)                       # doctest: +SKIP
>>> with model.trace(ids):                                      # doctest: +SKIP
...     ablate(r(MHSAHead(1, 2)))                               # zero an MHSA head
...     scale(r(LorsaHead(2, 17)), 2.0)                         # double a Lorsa head's z
...     logits = model.lm_head.output.save()

Several interventions in one body must come in the model's execution order (earlier layers
first; in a layer MHSA head < Lorsa head < transcoder feature < SAE feature on the layer
output): :meth:`ReplacementModel.sort` orders targets that way. Inside ``tracer.invoke`` they act on
that invoke's rows only. ``positions`` picks the positions edited (an int, slice, list or 1-D integer
tensor; None: all; negative ints count from the end as in Python; out-of-range, empty, bool and float
positions raise :class:`~nnsight_lorsa.errors.ArgumentError`, and so do positions that are padding in
some row of a padded batch once :meth:`ReplacementModel.prepare` or :func:`~..envoy.padding.padding_mask`,
first in the body, read the batch's mask); values are per position:
``(batch, n_pos[, head_dim])`` or anything broadcastable to it.
Values (means, deltas, patched-in values) may live on any device and in any dtype: each is moved to
the target's device and cast to its dtype where it is written (``steer`` / ``scale``: the sum / product is
computed in the wider dtype and rounded once, as the same edit by hand) (token ids given to ``model.trace``
may stay on the CPU: nnsight moves a trace's input tensors to the model's device).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import nnsight
import torch

from .._checks import is_int, is_real
from .._placement import f32, is_index_dtype, like, narrows_range
from ..envoy.edit_log import note_edit
from ..envoy.nnsight_internals import check_token_ids, current_worker, position_limit
from ..envoy.padding import check_not_padding, noted_padding, padding_mask
from ..envoy.replacement_model import ReplacementModel, check_replacement_model
from ..envoy.targets import Bound, Feature, LorsaHead, MHSAHead, Positions, Target, index_at, positions_index
from ..errors import ArgumentError, ConfigMismatchError, ShapeError, TraceOrderError


def _is_ids(value: Any) -> bool:
    """Token ids of one or more prompts: an integer (not bool) tensor ``(pos,)`` / ``(batch, pos)`` with
    ``pos >= 1`` (a numpy array of them too), or a non-empty list / tuple of ints."""
    if type(value).__module__ == "numpy" and getattr(value, "dtype", None) is not None:
        value = torch.as_tensor(value, device="cpu") if value.dtype.kind in "iu" else None
    if isinstance(value, torch.Tensor):
        return is_index_dtype(value.dtype) and 1 <= value.dim() <= 2 and value.shape[-1] >= 1
    return isinstance(value, (list, tuple)) and bool(value) and all(is_int(v) for v in value)


def check_prompts(prompts: Any, where: str, name: str = "prompts", model: Any = None) -> None:
    """Refuse what an experiment cannot run as prompts, before the model runs: a non-empty text, token ids
    (:func:`_is_ids`), a mapping with ``input_ids`` (a tokenizer's ``BatchEncoding``), or a non-empty list /
    tuple of texts and token ids (one prompt each). nnsight itself would take a number for a text and fail deep
    in its batching (``TypeError: can only concatenate str``), and None as an empty batch. With ``model``, each
    prompt's token ids are read against its vocabulary and its position table
    (:func:`~..envoy.nnsight_internals.check_token_ids`; a text is tokenized for its length only when the model has
    learned positions): an id outside them was torch's ``IndexError`` from inside the embedding.

    Raises:
        ArgumentError: naming ``where``, ``name`` and what was given.

    Source: ours (the forms nnsight's ``LanguageModel`` batches: ``nnsight/modeling/language.py``).
    """
    if isinstance(prompts, Mapping) and "input_ids" in prompts:
        ids = prompts["input_ids"]
        ok = _is_ids(ids) or isinstance(ids, (list, tuple)) and bool(ids) and all(
            _is_ids(row) and not isinstance(row, torch.Tensor) for row in ids)
    elif isinstance(prompts, str):
        ok = bool(prompts)
    elif isinstance(prompts, (list, tuple)) and prompts and not _is_ids(prompts):
        ok = all((isinstance(p, str) and bool(p)) or _is_ids(p) and not (isinstance(p, torch.Tensor) and p.dim() != 1)
                 for p in prompts)
    else:
        ok = _is_ids(prompts)
    if not ok:
        got = (f"a tensor of shape {tuple(prompts.shape)} dtype {prompts.dtype}" if isinstance(prompts, torch.Tensor)
               else repr(prompts)[:80] if isinstance(prompts, (str, list, tuple)) else f"a {type(prompts).__name__}")
        raise ArgumentError(f"{where}: {name} must be prompts — a non-empty text, token ids (an integer tensor (pos,) "
                            "or (batch, pos), or a list of ints), a tokenizer's output with input_ids, or a "
                            f"non-empty list of texts / token-id lists — got {got}")
    if model is not None:
        for row in _prompt_rows(prompts):
            if isinstance(row, str):
                tokenizer = getattr(model, "tokenizer", None)
                if position_limit(model) is None or not callable(tokenizer):
                    continue  # a text's ids are the tokenizer's own: only its length can be wrong
                row = tokenizer(row)["input_ids"]
            check_token_ids(torch.as_tensor(row, device="cpu"), model, f"{where}: {name}")


def _prompt_rows(prompts: Any) -> list[Any]:
    """The prompts :func:`check_prompts` accepted, one entry per tensor of ids (``(pos,)`` or ``(batch, pos)``),
    id list or text."""
    if isinstance(prompts, Mapping):
        ids = prompts["input_ids"]
        return [ids] if not isinstance(ids, (list, tuple)) or _is_ids(ids) else list(ids)
    if isinstance(prompts, (list, tuple)) and not _is_ids(prompts):
        return list(prompts)
    return [prompts]


def check_target_list(targets: Any, where: str, name: str = "targets") -> None:
    """Refuse ``targets`` unless it is a non-empty list / tuple of targets (:class:`~..envoy.targets.MHSAHead`,
    :class:`~..envoy.targets.LorsaHead`, :class:`~..envoy.targets.Feature`), before the model runs (a bare target,
    a str or a number was a raw ``TypeError`` / ``AttributeError``; an empty list ran an experiment of nothing).

    Raises:
        ConfigMismatchError: naming ``where``, ``name`` and what was given.

    Source: ours.
    """
    if isinstance(targets, (list, tuple)) and targets and all(isinstance(t, (MHSAHead, LorsaHead, Feature))
                                                              for t in targets):
        return
    raise ConfigMismatchError(f"{where}: {name} must be a non-empty list (or tuple) of MHSAHead / LorsaHead / Feature "
                              f"targets, got {targets!r}"[:300])


def check_means_mode(mode: Any, means: Any, where: str) -> None:
    """Refuse ``means`` given with a ``mode`` other than ``"mean"``: they would be ignored (a zero ablation or a
    patch run instead of the mean ablation the caller meant).

    Raises:
        ConfigMismatchError: naming ``where`` and the mode.

    Source: ours.
    """
    if means is not None and mode != "mean":
        raise ConfigMismatchError(f"{where}: means= is read only with mode='mean', got mode={mode!r}: the means would "
                                  "be ignored. Pass mode='mean' (or drop means)")


def check_positions(positions: Positions, seq: int) -> None:
    """Raise :class:`ArgumentError` unless ``positions`` selects at least one of ``seq`` positions: None
    (all), an int in ``[-seq, seq)`` (negative counts from the end, as Python indexing), a slice of ints
    selecting at least one position, or a non-empty list / 1-D integer tensor of such ints. Bools, floats
    and out-of-range indices are refused (never wrapped or dropped)."""
    if positions is None:
        return
    if isinstance(positions, slice):
        if not all(v is None or is_int(v) for v in (positions.start, positions.stop, positions.step)) \
                or positions.step == 0:
            raise ArgumentError(f"positions slice must have int bounds and a non-zero step, got {positions!r}")
        if len(range(seq)[positions]) == 0:
            raise ArgumentError(f"positions {positions!r} selects none of the {seq} positions")
        return
    if is_int(positions):
        items: list = [positions]
    elif isinstance(positions, torch.Tensor):
        if positions.dim() > 1 or not is_index_dtype(positions.dtype):
            raise ArgumentError(f"positions must be a 1-D integer tensor, got shape {tuple(positions.shape)} "
                                f"dtype {positions.dtype}")
        items = positions.reshape(-1).tolist()
    elif isinstance(positions, (list, tuple)) and all(is_int(p) for p in positions):
        items = list(positions)
    else:
        raise ArgumentError(f"positions must be None, an int, a slice, or a list / 1-D tensor of ints, "
                            f"got {positions!r}")
    if not items:
        raise ArgumentError("positions is empty: give at least one position (None: all)")
    bad = [p for p in items if not -seq <= p < seq]
    if bad:
        raise ArgumentError(f"positions {bad} are out of range for a sequence of {seq} positions "
                            f"(valid: [-{seq}, {seq}))")


def refuse_inside_trace(what: str) -> None:
    """Raise :class:`~nnsight_lorsa.errors.TraceOrderError` when experiment ``what`` (which runs its own traces:
    :func:`mean_activations`, the experiments of :mod:`.experiments`, :mod:`.path_patching`, :mod:`.circuit`) is
    called inside a ``model.trace`` / ``generate`` body — nnsight cannot run a model inside its running forward (it
    said ``ValueError: Cannot invoke while the model is already running``)."""
    try:
        current_worker(what)
    except TraceOrderError:
        return  # not inside a trace body: fine
    raise TraceOrderError(f"{what}(replacement, ...) runs its own traces and cannot be called inside a "
                          "model.trace(...) / generate(...) body: call it before or after the trace; inside a trace, "
                          "edit with ablate / scale / steer / patch on replacement(target)")


def refuse_repeats(targets: Sequence[Any], what: str) -> None:
    """Raise :class:`~nnsight_lorsa.errors.ConfigMismatchError` naming the first target listed twice in
    ``targets`` — a circuit's components, a control's pool — where each entry counts as one of ``n`` (a head listed
    twice is one head: a circuit keeping one copy while ablating the other ablates it, a draw of ``k`` from the pool
    may hold fewer than ``k``)."""
    first: dict[Any, int] = {}
    for i, t in enumerate(targets):
        if first.setdefault(t, i) != i:
            raise ConfigMismatchError(f"{what} must be distinct: {t} is listed at {first[t]} and {i}")


def _require_bound(target: Any) -> None:
    """Refuse a target that is not bound to a replacement model (:class:`ConfigMismatchError`)."""
    if not isinstance(target, Bound):
        raise ConfigMismatchError(f"bind targets first: replacement(target), got {target!r}")


def _loc(target: Bound, positions: Positions, edit: bool = True) -> tuple[Any, tuple]:
    """``(tensor, index)`` of ``target`` at ``positions`` in this trace; for an ``edit``, refused first where a
    replacement of the trace would discard it (:meth:`~.ReplacementModel.check_editable`)."""
    _require_bound(target)
    if edit:
        target.replacement.check_editable(target.target)
    tensor, cols = target.location()
    check_positions(positions, int(tensor.shape[1]))
    mask = noted_padding()  # once padding_mask() read the batch's mask
    if mask is not None and mask.shape[1] == tensor.shape[1]:
        # (not in a cached step of a generation: its positions are the rows' new tokens, none of them padding —
        # until 2026-11-29 positions=0 there was refused by the prompt's mask)
        check_not_padding(mask, positions, "positions")
    return tensor, index_at(cols, positions)


def _edited(target: Bound, positions: Positions, what: str) -> None:
    """Tell an intervened-pass attribution of this trace (``attribute(rm, tracer=tracer)``), if any, what
    was edited: its node is marked and held at the edited value in the graph."""
    note_edit(target.target, positions, what)


def _value(target: Bound, value: Any, site: torch.Tensor, name: str, *, finite: bool = True,
           to_dtype: bool = True) -> Any:
    """``value`` (a number, or a tensor / array of the target's per-position values) checked for the
    ``site`` it is written to (``tensor[idx]``): a finite number stays a number; a tensor must fit the
    target (:meth:`~nnsight_lorsa.envoy.replacement_model.ReplacementModel.check_values`), broadcast to
    ``site``'s shape and (with ``finite``) hold no NaN / inf, also once cast to ``site``'s dtype (an fp32 value
    past fp16's range is refused, not written as inf); it is moved to ``site``'s device and dtype — with
    ``to_dtype=False`` to its device only (an operand: ``site + delta`` computed in the wider dtype and rounded once
    where it is written, as the same edit made by hand on the envoy)."""
    if is_real(value):
        if finite and not math.isfinite(value):
            raise ArgumentError(f"{name} must be a finite number, got {value!r}")
        if finite and site.is_floating_point() and abs(value) > torch.finfo(site.dtype).max:
            raise ArgumentError(f"{name}={value!r} is beyond the range of the edited values' dtype {site.dtype} "
                                f"(max {torch.finfo(site.dtype).max:.6g}): it would write inf")
        return value
    if not isinstance(value, torch.Tensor):
        if isinstance(value, (bool, str, bytes)) or value is None:
            raise ArgumentError(f"{name} must be a number or a tensor, got {value!r}")
        try:
            value = torch.as_tensor(value, device="cpu")
        except (TypeError, ValueError, RuntimeError) as e:
            raise ArgumentError(f"{name} must be a number or a tensor, got {value!r} ({e})") from e
    if value.dtype == torch.bool or value.dtype.is_complex:
        raise ArgumentError(f"{name} must be a real tensor, got dtype {value.dtype}")
    target.replacement.check_values(target.target, value)
    want = tuple(site.shape)
    have = tuple(value.shape)
    if len(have) > len(want) or any(h not in (1, w) for h, w in zip(have[::-1], want[::-1], strict=False)):
        raise ShapeError(f"{name} of shape {have} does not broadcast to the edited values' shape {want} "
                         f"(batch, positions[, head_dim])")
    # The value checks read ``value`` where it lives: a host value (a steering vector built on the CPU) is
    # checked on the host and then copied once, so nothing is read back from the model's device; only a value the
    # caller put on the device is read there (the named errors below depend on it).
    if finite and not bool(torch.isfinite(value).all()):
        raise ArgumentError(f"{name} holds NaN or inf values")
    cast = value.to(dtype=site.dtype)  # the same rounding on every device
    # ints, or e.g. fp32 on fp16: the cast may turn finite values into inf (refused even without ``finite``: a
    # patch writes a source run's inf / NaN as they are, but no finite value may become inf on the way)
    if narrows_range(value.dtype, cast.dtype) and not bool(
            torch.isfinite(cast).all() if finite else (torch.isfinite(cast) | ~torch.isfinite(value)).all()):
        raise ArgumentError(f"{name} holds values beyond the range of the edited values' dtype {site.dtype} "
                            f"(max |v| = {float(value.detach().abs().max()):.6g} > {torch.finfo(site.dtype).max:.6g}): "
                            "cast to it they would be inf")
    return cast.to(device=site.device) if to_dtype else value.to(device=site.device)


def means_at(target: Bound, means: Any, positions: Positions, seq: int) -> Any:
    """``means`` at the edited ``positions``: a per-position mean (:func:`mean_activations` with
    ``per_position=True``: ``(pos,)`` per feature / Lorsa head, ``(pos, head_dim)`` per MHSA head) of a
    ``seq``-position batch is indexed at ``positions`` (so that position ``p`` gets the mean of position ``p``
    also where ``positions`` is an int, which drops the position axis); anything else is returned as it is.

    Raises:
        ShapeError: a per-position mean of another length than ``seq`` (nor 1).
        ArgumentError: a per-position mean on a padded batch (its mask read by :func:`~..envoy.padding.padding_mask`
            in this body): position ``p`` is a different token in rows padded differently (as
            ``mean_activations(per_position=True)`` refuses padded prompts).
    """
    if not isinstance(means, torch.Tensor):
        return means
    per_pos = 1 if target.replacement.width(target.target) is None else 2
    if means.dim() != per_pos or means.shape[0] == 1 and seq != 1:
        return means
    mask = noted_padding()
    if mask is not None:
        rows = (~mask).any(-1).nonzero().flatten().tolist()
        raise ArgumentError(f"per-position means of {target.target} on a padded batch (rows {rows} are padded): "
                            "position p is a different token in each row. Give prompts of one length, or one mean "
                            "for all positions (mean_activations(per_position=False))")
    if means.shape[0] != seq:
        raise ShapeError(f"per-position means of {target.target} hold {means.shape[0]} positions "
                         f"(shape {tuple(means.shape)}), the prompts {seq}: give means of prompts of this length "
                         "(mean_activations(per_position=True)) or one mean for all positions")
    return means[positions_index(positions)]


def read(target: Bound, positions: Positions = None) -> torch.Tensor:
    """The target's current value (a saved copy): ``(batch, n_pos[, head_dim])``.

    Source: ours (a saved copy of a target's value inside a trace).
    """
    tensor, idx = _loc(target, positions, edit=False)
    return tensor[idx].clone().save()


def ablate(target: Bound, mode: Literal["zero", "mean"] = "zero", means: Any = None,
           positions: Positions = None) -> None:
    """Set the target to 0 (``mode="zero"``) or to its mean (``mode="mean"``).

    ``means``: a tensor (the target's mean value) or the mapping returned by
    :func:`mean_activations` (keyed by target); a per-position mean (``per_position=True``) is taken at
    ``positions`` (:func:`means_at`: position ``p`` gets the mean of position ``p``, also for an int ``p``).

    Raises:
        ArgumentError: an MHSA head of a layer whose attention a replacement of this trace computes without an
            error term, on rows this invoke edits: the edit would be discarded
            (:meth:`.ReplacementModel.check_editable`).
        ShapeError: means that do not fit the edited values; a per-position mean of another length than the prompts.
        ConfigMismatchError: ``mode`` not ``"zero"`` / ``"mean"``; ``mode="mean"`` without ``means``, or a ``means``
            mapping without this target; ``means`` with ``mode="zero"`` (:func:`check_means_mode`).

    Source: *From Tokenization to Attribution Graphs* §10.1 (feature ablation).
    """
    if not isinstance(mode, str) or mode not in ("zero", "mean"):
        raise ConfigMismatchError(f"ablation mode must be 'zero' or 'mean', got {mode!r}")
    check_means_mode(mode, means, "ablate")
    tensor, idx = _loc(target, positions)
    if mode == "zero":
        tensor[idx] = 0
        _edited(target, positions, "ablate")
        return
    # on the target's device, in its dtype (means may come from anywhere)
    tensor[idx] = mean_fill(target, means, tensor[idx], int(tensor.shape[1]), positions)
    _edited(target, positions, "ablate")


def mean_fill(target: Bound, means: Any, site: torch.Tensor, seq: int, positions: Positions = None) -> Any:
    """The value a mean ablation writes into ``site`` (the target's values at ``positions`` of a ``seq``-position
    batch, ``(batch, n_pos[, head_dim])``): ``means[target]`` of a mapping (:func:`mean_activations`), else
    ``means`` — a per-position mean indexed at ``positions`` (:func:`means_at`) — checked as :func:`ablate` checks it
    and on ``site``'s device and dtype (a finite number stays a number).

    Raises:
        ConfigMismatchError: ``means`` None, or a mapping without ``target``.
        ShapeError: means that do not fit the edited values; a per-position mean of another length than ``seq``.
        ArgumentError: NaN / inf, or values beyond ``site``'s dtype.
    """
    if isinstance(means, Mapping):
        if target.target not in means:
            raise ConfigMismatchError(f"no mean for {target.target} (mode='mean' needs one per target: "
                                      "see mean_activations)")
        means = means[target.target]
    if means is None:
        raise ConfigMismatchError("mode='mean' needs means= (see mean_activations)")
    return like(_value(target, means_at(target, means, positions, seq), site, "means"), site)


def scale(target: Bound, alpha: Any, positions: Positions = None) -> None:
    """Multiply the target by ``alpha`` (``-alpha`` inhibits, as the feature inhibition of Lindsey et al. 2025,
    *On the Biology of a Large Language Model*): a finite number, or a tensor of per-position factors
    broadcastable to the edited values.

    Raises:
        ArgumentError: ``alpha`` not a finite number / tensor (NaN, inf, bool, string, None); bad ``positions``.
        ArgumentError: an MHSA head of a layer whose attention a replacement of this trace computes without an
            error term, on rows this invoke edits: the edit would be discarded
            (:meth:`.ReplacementModel.check_editable`).
        ShapeError: an ``alpha`` tensor that does not fit the edited values.

    Source: *From Tokenization to Attribution Graphs* §10.3 (feature steering); Lindsey et al. 2025 (inhibition).
    """
    tensor, idx = _loc(target, positions)
    site = tensor[idx]
    tensor[idx] = (site * _value(target, alpha, site, "alpha", to_dtype=False)).to(site.dtype)  # rounded once
    _edited(target, positions, "scale")


def steer(target: Bound, delta: Any, positions: Positions = None) -> None:
    """Add ``delta`` (a finite number, or a tensor: a ``head_dim`` vector for MHSA heads, per-position values
    broadcastable to the edited values) to the target.

    Raises:
        ArgumentError: ``delta`` not a finite number / tensor (NaN, inf, bool, string, None); bad ``positions``.
        ArgumentError: an MHSA head of a layer whose attention a replacement of this trace computes without an
            error term, on rows this invoke edits: the edit would be discarded
            (:meth:`.ReplacementModel.check_editable`).
        ShapeError: a ``delta`` tensor that does not fit the target or the edited values.

    Source: *From Tokenization to Attribution Graphs* §10.3 (feature steering).
    """
    tensor, idx = _loc(target, positions)
    site = tensor[idx]
    tensor[idx] = (site + _value(target, delta, site, "delta", to_dtype=False)).to(site.dtype)  # rounded once
    _edited(target, positions, "steer")


def patch(target: Bound, source_values: torch.Tensor, positions: Positions = None) -> None:
    """Overwrite the target by ``source_values`` (e.g. read from another prompt's run; activations are
    written as they are, non-finite values included; finite values that the cast to the target's dtype would turn
    into ``inf``, e.g. fp32 values past fp16's range, are an ``ArgumentError``).

    Raises:
        ShapeError: ``source_values`` that do not fit the target or the edited values.
        ArgumentError: bad ``positions``; finite ``source_values`` past the range of the target's dtype.
        ArgumentError: an MHSA head of a layer whose attention a replacement of this trace computes without an
            error term, on rows this invoke edits: the edit would be discarded
            (:meth:`.ReplacementModel.check_editable`).

    Source: *From Tokenization to Attribution Graphs* §10.2 (activation patching).
    """
    _require_bound(target)
    target.replacement.check_values(target.target, source_values)
    tensor, idx = _loc(target, positions)
    tensor[idx] = _value(target, source_values, tensor[idx], "source_values", finite=False)
    _edited(target, positions, "patch")


def mean_activations(replacement: ReplacementModel, targets: Iterable[Target], prompts: Any,
                     per_position: bool = False) -> dict[Target, torch.Tensor]:
    """Mean value of each target over a reference set ``prompts`` (token ids or text).

    Averaged over batch and positions (``per_position=False``: ``()`` or ``(head_dim,)``), or over
    the batch only (``(pos[, head_dim])``; the prompts must then share one length). Prompts of different
    lengths (padded by nnsight, or a dict input with an ``attention_mask``) are averaged over their tokens
    only: padded positions are left out (:mod:`..envoy.padding`). The means are
    averaged in at least fp32 (bf16 / fp16 values in fp32, fp64 ones in fp64) and returned on the device
    and in the dtype of the values they average (the model's, or a spliced module's); :func:`ablate` moves
    them to wherever they are written.

    Raises:
        ArgumentError: ``replacement`` is not a :class:`~nnsight_lorsa.ReplacementModel` (a set, a bare
            model or a module: wrap it, ``ReplacementModel(model, lorsas=...)``).
        ArgumentError: ``per_position`` not a bool; ``per_position=True`` on padded prompts (in the trace,
            before any target is read). ConfigMismatchError: no targets. Target errors before the model runs.
        ArgumentError: ``prompts`` nnsight cannot batch, or holding an id outside the model's vocabulary or more tokens
            than its learned positions (:func:`check_prompts`).

    Source: *From Tokenization to Attribution Graphs* §10.1 (mean ablation).
    """
    refuse_inside_trace("mean_activations")
    check_replacement_model(replacement, "mean_activations")
    check_prompts(prompts, "mean_activations", model=replacement.model)
    if isinstance(targets, Iterable) and not isinstance(targets, (str, bytes)):
        targets = list(targets)  # any iterable of targets (a set, a generator), as documented
    check_target_list(targets, "mean_activations")
    if not isinstance(per_position, bool):
        raise ArgumentError(f"mean_activations: per_position must be a bool, got {per_position!r}")
    ordered = replacement.sort(targets)
    if not ordered:
        raise ConfigMismatchError("mean_activations needs at least one target")
    for t in ordered:
        replacement.check(t)
    saved = {}
    with torch.no_grad(), replacement.model.trace(prompts):
        mask = padding_mask(replacement.model)
        if mask is not None and per_position:
            rows = (~mask).any(-1).nonzero().flatten().tolist()
            raise ArgumentError(f"mean_activations(per_position=True): rows {rows} of the prompts are padding at "
                                "some positions (prompts of different lengths): a mean per position would mix "
                                "pads in. Give prompts of one length, or per_position=False (a mean over tokens)")
        mask = nnsight.save(mask)
        replacement.prepare(ordered)
        for t in ordered:
            saved[t] = read(Bound(t, replacement))
    if mask is None:
        dims = (0,) if per_position else (0, 1)
        return {t: f32(v).mean(dims).to(v.dtype) for t, v in saved.items()}  # fp64 stays fp64
    means = {}
    for t, v in saved.items():  # over the tokens only: padded positions are no token of their row
        w = f32(v)
        keep = mask.to(w.device).reshape(*mask.shape, *(1,) * (w.dim() - 2)).to(w.dtype)
        means[t] = ((w * keep).sum((0, 1)) / keep.sum()).to(v.dtype)
    return means
