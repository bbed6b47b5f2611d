"""Recording frozen attention for an intervened trace (docs/patching.md, "Frozen attention").

:func:`freeze_attention` runs the unedited prompt once and keeps each layer's attention input; an intervened trace
of the same prompt with ``replacement.prepare(targets, frozen=...)`` then holds every attention pattern (MHSA and
Lorsa) at its value there (:mod:`nnsight_lorsa.envoy.frozen_attention`).
"""

from __future__ import annotations

from typing import Any

import nnsight
import torch

from .._checks import check_remote
from ..envoy.frozen_attention import FrozenAttention, fingerprint
from ..envoy.nnsight_internals import hf_module
from ..envoy.padding import noted_inputs
from ..envoy.replacement_model import check_replacement_model
from ..envoy.targets import Feature, LorsaHead, MHSAHead
from ..errors import ConfigMismatchError
from .interventions import check_prompts, refuse_inside_trace


def freeze_attention(replacement: Any, prompts: Any, targets: Any = (), *, remote: Any = False) -> FrozenAttention:
    """Record the attention patterns of ``prompts``' unedited pass, for an intervened trace of the same prompts.

    Runs one trace (``torch.no_grad``) with the replacements ``targets`` need spliced
    (``replacement.prepare(targets)``: with ``error`` True the pass is the model's own, bit for bit) and keeps every
    layer's attention input ``(batch, pos, d_model)`` in the model's dtype on the layer's device — ``n_layers ·
    batch · pos · d_model`` numbers; the patterns are recomputed from them where needed. Use it as
    ``replacement.prepare(targets, frozen=record)`` first in a ``model.trace`` of the same prompts::

        record = freeze_attention(rm, ids)
        with model.trace(ids):
            rm.prepare([f], frozen=record)
            ablate(rm(f), positions=3)          # moves the logits through OV circuits and MLPs only
            logits = nnsight.save(model.lm_head.output)

    Args:
        replacement: a :class:`~nnsight_lorsa.envoy.replacement_model.ReplacementModel`.
        prompts: what ``model.trace`` takes (texts, token ids ``(batch, pos)``, a tokenizer's output).
        targets: the intervention targets of the trace it is for (needed where ``replacement.error`` is False: the
            replacements they splice change the unedited pass; default none).
        remote: passed to ``model.trace`` (``True``: the pass runs on NDIF and the inputs come back, ``n_layers ·
            batch · pos · d_model`` numbers in the model's dtype; docs/remote.md).

    Returns:
        a :class:`~nnsight_lorsa.envoy.frozen_attention.FrozenAttention`.

    Raises:
        TraceOrderError: called inside a trace body (it runs its own).
        ArgumentError: prompts nnsight cannot batch, or token ids outside the model's vocabulary / positions;
            ``remote`` not True, False or ``"local"``.
        ConfigMismatchError: ``targets`` not a list / tuple of targets, or a target the model does not have.

    Source: circuit-tracer ``replacement_model_transformerlens.py`` (``setup_intervention_with_freeze``, the
    ``hook_pattern`` cache of ``feature_intervention(..., freeze_attention=True)``).
    """
    r = check_replacement_model(replacement, "freeze_attention")
    refuse_inside_trace("freeze_attention")
    check_remote(remote, "freeze_attention")
    if not isinstance(targets, (list, tuple)) or not all(isinstance(t, (MHSAHead, LorsaHead, Feature))
                                                         for t in targets):
        raise ConfigMismatchError(f"freeze_attention: targets must be a list or tuple of MHSAHead / LorsaHead / "
                                  f"Feature, got {targets!r}")
    for t in targets:
        r.check(t)
    check_prompts(prompts, "freeze_attention", model=r.model)
    adapter = r.adapter
    with torch.no_grad(), r.model.trace(prompts, remote=remote):
        r.prepare(targets)  # reads the model's inputs first (arm_padding_check): the token ids recorded below
        ids = noted_inputs()
        checksum = fingerprint(hf_module(r.model), adapter)  # where the model runs: the server's
        layer_inputs = {}
        for layer in range(adapter.n_layers):
            args, kwargs = r.model.get(adapter.attention_path(layer)).inputs
            layer_inputs[layer] = adapter.attention_input(args, kwargs).detach().clone()
        # one saved value: on a server a dict of the caller's is not filled (its copy there is)
        saved = nnsight.save((ids, checksum, layer_inputs))
    ids, checksum, inputs = saved
    seen = None if ids is None or ids[0] is None else ids
    return FrozenAttention(inputs, frozenset(targets), r.error, checksum, seen)
