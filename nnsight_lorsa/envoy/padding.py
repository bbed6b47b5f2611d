"""Padded batches: which positions of each row of a trace are tokens, and the checks that use it.

nnsight pads the prompts of one trace (a list of texts or token-id lists of different lengths, or the
invokes of one trace) to one length — on the left for a causal model, with position ids counted per row —
and a dict input may carry an ``attention_mask`` of its own (right padding included). A padded position is
no token of its row: an edit there changes nothing the row's tokens see, a read gives a pad's value, a
mean over it mixes pads in, and patching between two batches padded differently moves values between
different tokens. :func:`padding_mask`, called first in a trace body (or invoke) — by the user, by
:meth:`~.replacement_model.ReplacementModel.prepare` (:func:`arm_padding_check`) or by the experiments of
:mod:`nnsight_lorsa.patching` — reads the batch's mask and remembers it for that body: the interventions of
``nnsight_lorsa.patching`` then refuse positions that are padding in some row (:func:`check_not_padding`,
through :func:`noted_padding`). The experiments also refuse clean and corrupt prompts padded differently
(:func:`check_same_padding`) and the default metric's last position where it is padding (right padding), and
``mean_activations`` averages over the tokens only; all with :class:`~..errors.ArgumentError`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import ArgumentError, TraceOrderError
from .nnsight_internals import current_worker, ran_since_start
from .targets import Positions, positions_index

#: the attribute under which :func:`padding_mask` leaves a body's mask on its worker (nnsight's mediator)
_NOTE = "nnsight_lorsa_padding"
#: and the token ids and 2-D mask it read (:func:`noted_inputs`)
_INPUTS = "nnsight_lorsa_inputs"


def padding_mask(model: Any) -> torch.Tensor | None:
    """Inside a trace body or an invoke, before anything else is read: which positions of this body's rows
    are tokens — a ``(batch, pos)`` bool tensor (True = token, False = padding) on the input's device, from
    the 2-D ``attention_mask`` the model is called with — or None when no row is padded (no mask, a 4-D
    mask, or one of all ones). The body's interventions (``ablate``, ``scale``, ``steer``, ``patch``,
    ``read``) then refuse positions that are padding in some row (:func:`noted_padding`).

    >>> with model.trace([short_ids, long_ids]):      # doctest: +SKIP
    ...     mask = padding_mask(model)                 # (2, len(long_ids)); row 0 left-padded
    ...     ablate(r(MHSAHead(1, 0)), positions=-1)    # every row's last token: fine
    ...     ablate(r(MHSAHead(1, 0)), positions=0)     # ArgumentError: padding in row 0

    Raises:
        TraceOrderError: outside a trace body, or after the body read something the model computes (the
            model's inputs come first).

    Source: ours (nnsight's left padding of a trace's prompts).
    """
    worker = current_worker("padding_mask")
    if ran_since_start(worker, model.path) > 0:
        raise TraceOrderError("padding_mask(model) must come first in the trace body (or invoke), before anything "
                              "the model computes is read: it reads the model's inputs")
    args, kwargs = model.inputs
    mask = kwargs.get("attention_mask")
    mask = mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
    ids = kwargs.get("input_ids", args[0] if args else None)
    setattr(worker, _INPUTS, (ids if isinstance(ids, torch.Tensor) else None, mask))
    mask = None if mask is None or bool(mask.all()) else mask
    setattr(worker, _NOTE, mask)
    return mask


def arm_padding_check(model: Any) -> None:
    """In a trace body: :func:`padding_mask` unless it already ran in this body or the model has run past its
    inputs (then the body's interventions stay unchecked, as without it). What
    :meth:`~.replacement_model.ReplacementModel.prepare` calls first.

    Raises:
        TraceOrderError: outside a trace body.
    """
    worker = current_worker("ReplacementModel.prepare")
    if not hasattr(worker, _NOTE) and ran_since_start(worker, model.path) == 0:
        padding_mask(model)


def noted_padding() -> torch.Tensor | None:
    """The mask :func:`padding_mask` read in the running trace body (or invoke); None when it was not called
    there, no row is padded, or no trace body is running (an edit replayed by ``model.edit()``)."""
    try:
        worker = current_worker("an intervention")
    except TraceOrderError:
        return None
    return getattr(worker, _NOTE, None)


def noted_inputs() -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
    """The model's token ids ``(batch, pos)`` and 2-D mask (bool, or None) that :func:`padding_mask` read in the
    running trace body (or invoke) — ``(None, …)`` for inputs that are not token ids; None when it was not called
    there."""
    return getattr(current_worker("an intervention"), _INPUTS, None)


def check_not_padding(mask: torch.Tensor | None, positions: Positions, what: str) -> None:
    """Raise :class:`ArgumentError` when a position of ``positions`` (along the ``pos`` axis; None: all,
    which is not checked) is padding in some row of ``mask`` (:func:`padding_mask`; None: nothing padded).
    ``what`` names the positions' use in the message. The positions must already be valid
    (:func:`~.interventions.check_positions`).

    Raises:
        ArgumentError: names the positions and the padded rows.
    """
    if mask is None or positions is None:
        return
    cols = mask[:, positions_index(positions)].reshape(mask.shape[0], -1)
    rows = (~cols).any(-1).nonzero().flatten().tolist()
    if rows:
        raise ArgumentError(
            f"{what}: position(s) {positions!r} are padding in rows {rows} of the batch (prompts of different "
            "lengths, padded to one): no token of those rows is there, so an edit would change nothing and a read "
            "or a metric would give a pad's value. Count positions from the end on a left-padded batch (nnsight's "
            "padding for causal models: -1 is every row's last token), or give prompts of one length")


def check_same_padding(clean: torch.Tensor | None, corrupt: torch.Tensor | None, what: str) -> None:
    """Raise :class:`ArgumentError` unless the clean and corrupt batches are padded alike (both masks None,
    or equal): patching position ``p`` of a clean row into its corrupt row must move a value between the
    same token positions. ``what`` names the experiment.

    Raises:
        ArgumentError: names the rows whose padding differs.
    """
    if clean is None:
        if corrupt is None:
            return
        clean = torch.ones_like(corrupt)
    corrupt = torch.ones_like(clean) if corrupt is None else corrupt.to(clean.device)
    if clean.shape != corrupt.shape:
        raise ArgumentError(f"{what}: the clean prompts are padded to {tuple(clean.shape)}, the corrupt ones to "
                            f"{tuple(corrupt.shape)} (batch, pos): give clean and corrupt prompts of the same "
                            "length row by row")
    rows = (clean != corrupt).any(-1).nonzero().flatten().tolist()
    if rows:
        raise ArgumentError(
            f"{what}: the clean and corrupt prompts are padded differently (rows {rows}): a position of a clean "
            "row and the same position of its corrupt row are different tokens, so patching between them mixes "
            "tokens up. Give clean and corrupt prompts of the same length row by row")
