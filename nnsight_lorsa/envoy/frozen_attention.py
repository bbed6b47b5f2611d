"""Frozen attention for interventions: every attention pattern held at its value on the unedited prompt.

circuit-tracer's ``feature_intervention(..., freeze_attention=True)`` (``circuit_tracer/replacement_model/
replacement_model_transformerlens.py``, ``setup_intervention_with_freeze``: the ``hook_pattern`` of every layer
cached on a clean run and written back under the edit) in an nnsight trace: an edit then moves the logits through
the attention's OV circuits and the MLPs only — the patterns (QK circuits) stay where they were, as in the frozen
linear model attribution graphs are computed on (Ameisen et al. 2025, *Circuit Tracing*, §"Validating
attribution graphs": interventions with frozen attention). Norms and MLPs run live (circuit-tracer's default).

A :class:`FrozenAttention` holds each layer's attention input on the unedited prompt (recorded by
:func:`nnsight_lorsa.patching.freeze_attention`); :meth:`~.replacement_model.ReplacementModel.prepare` with
``frozen=`` starts one worker of the trace (:func:`install`) that, at every layer, before the trace body's edits
there:

* MHSA: adds to the output projection's input (the heads' ``z``, head-major) the difference
  ``(A_clean − A_live) v(x)`` of the patterns made from the recorded input and from the live one ``x``, both
  recomputed from the layer's weights (:func:`~..adapters.base.mhsa_qk`, :func:`~..adapters.base.qk_pattern`; the
  model's mask, RoPE positions, soft cap, sliding window), the values ``v`` the live ones — so ``z`` becomes
  ``A_clean · v(x)`` up to the recomputation's rounding, and an edit of an :class:`~.targets.MHSAHead` (at the same
  input) acts on the frozen ``z``. Where the live input equals the recorded one bit for bit (nothing upstream moved)
  nothing is added: an unedited frozen trace is the model's own, bit for bit;
* Lorsa: a Lorsa spliced in the same trace (``LorsaSet.replace`` after the worker started) computes its queries
  and keys from the recorded input (``Lorsa.forward(..., qk_input=...)``), its values from the live one — in its
  live and its clean pass, so its error term and an edit of its heads both see the frozen patterns.

Everything runs under ``torch.no_grad``: the correction carries no gradient. One forward pass (``model.trace``);
``model.generate`` is refused (circuit-tracer freezes the first token's only).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch

from ..adapters.base import ArchitectureAdapter, MHSAWeights, mhsa_mask, mhsa_qk, mhsa_values, qk_pattern
from ..errors import ArgumentError, ShapeError, TraceOrderError
from .edit_log import EDIT_LOG_TAG
from .nnsight_internals import (
    current_worker,
    enclosing,
    find_worker,
    hf_module,
    invoke_rows,
    is_splice,
    park_or_end,
    ran_since_start,
    serve_first,
    serve_last,
    skip_gate,
    spawn_worker,
    traced_method,
)
from .padding import noted_inputs

#: the tag of the frozen-attention worker of a trace (:func:`frozen_in`)
FROZEN_TAG = ("nnsight_lorsa.frozen_attention",)

#: the most pattern elements (query × key × heads × rows) one step of the correction holds, per pattern
CHUNK_ELEMENTS = 1 << 25
#: the most elements of a parameter :func:`fingerprint` copies to fp64 at once (fixed: the order of the sums counts)
FINGERPRINT_CHUNK = 1 << 24


class FrozenAttention:
    """Each layer's attention input on an unedited prompt: the patterns an intervened trace's attention is frozen at
    (:func:`nnsight_lorsa.patching.freeze_attention` records it; ``ReplacementModel.prepare(targets, frozen=...)``
    applies it).

    Attributes:
        inputs: ``{layer: (batch, pos, d_model)}`` — the hidden states each attention module was called with, in
            the model's dtype, on its layer's device.
        targets: the intervention targets whose replacements were spliced when it was recorded (with ``error``
            False they change the unedited pass, so an intervened trace must splice the same ones).
        error: the replacement model's ``error`` flag when it was recorded.
        fingerprint: :func:`fingerprint` of the model it was recorded on (where it ran: on NDIF the server's).
        ids: the token ids ``(batch, pos)`` and the 2-D attention mask (or None) it was recorded on
            (:func:`~.padding.noted_inputs`), or None where the model was not called with token ids.

    Source: circuit-tracer ``replacement_model_transformerlens.py`` (``setup_intervention_with_freeze``).
    """

    def __init__(self, inputs: Mapping[int, torch.Tensor], targets: frozenset, error: bool,
                 fingerprint: torch.Tensor, ids: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> None:
        # made by freeze_attention; a hand-made one is checked for its kinds (a named error, not a TypeError deep in
        # a trace)
        if not (isinstance(inputs, Mapping) and inputs and all(
                isinstance(k, int) and isinstance(v, torch.Tensor) and v.dim() == 3 for k, v in inputs.items())):
            raise ArgumentError(f"FrozenAttention(inputs=...) must be a non-empty {{layer: (batch, pos, d_model) "
                                f"tensor}}, got {type(inputs).__name__}: make it with freeze_attention(rm, prompts)")
        if not isinstance(targets, (frozenset, set)) or not isinstance(error, bool) or not isinstance(
                fingerprint, torch.Tensor) or not (ids is None or isinstance(ids, tuple) and len(ids) == 2):
            raise ArgumentError("FrozenAttention(targets=, error=, fingerprint=, ids=): a set of targets, a bool, a "
                                "tensor and None or (token ids, mask); make it with freeze_attention(rm, prompts)")
        self.inputs = dict(inputs)
        self.targets = targets
        self.error = error
        self.fingerprint = fingerprint
        self.ids = ids

    def check_prompts(self, noted: tuple[torch.Tensor | None, torch.Tensor | None] | None,
                      rows: tuple[int, int] | None) -> None:
        """Refuse a trace of other prompts than recorded: ``noted`` the token ids and mask the trace body read
        (:func:`~.padding.noted_inputs`; ``rows``: its invoke's ``(start, size)`` of the batch, None: all).

        Raises:
            ArgumentError: other token ids or padding (a record of other prompts of the same shape would hold the
                patterns of those prompts: the unedited frozen trace was 59% off the model's logits).

        Source: ours (the record's check against the trace it is applied in).
        """
        if self.ids is None or noted is None or noted[0] is None:
            return
        ids, mask = self.ids
        if rows is not None and ids.shape[0] != noted[0].shape[0]:
            ids = ids[rows[0]:rows[0] + rows[1]]
            mask = None if mask is None else mask[rows[0]:rows[0] + rows[1]]
        mask, other_mask = (None if m is None or bool(m.all()) else m.cpu() for m in (mask, noted[1]))  # all tokens
        same = ids.shape == noted[0].shape and torch.equal(ids.cpu(), noted[0].cpu()) and (
            (mask is None and other_mask is None)
            or (mask is not None and other_mask is not None and torch.equal(mask, other_mask)))
        if not same:
            what = (f"of shape {tuple(ids.shape)}, this trace's {tuple(noted[0].shape)}"
                    if ids.shape != noted[0].shape else "with other token ids" if not torch.equal(
                        ids.cpu(), noted[0].cpu()) else "with other padding")
            raise ArgumentError(
                f"prepare(frozen=...): this FrozenAttention was recorded on other prompts ({what}); its patterns are "
                "those prompts'. Record it with freeze_attention on the prompts of this trace")

    def __repr__(self) -> str:
        shape = next(iter(self.inputs.values())).shape if self.inputs else ()
        return (f"FrozenAttention(layers={sorted(self.inputs)}, shape={tuple(shape)}, targets={len(self.targets)}, "
                f"error={self.error})")

    def input_of(self, layer: int, x: torch.Tensor, where: str) -> torch.Tensor:
        """The recorded input of ``layer`` on ``x``'s device and dtype, checked against the live one ``x``.

        Raises:
            ShapeError: the live input has another shape (another prompt, batch or invoke layout than recorded).

        Source: ours (the record's check against the trace it is applied in).
        """
        rec = self.inputs[layer]
        if rec.shape != x.shape:
            raise ShapeError(
                f"{where}: frozen attention was recorded on inputs of shape {tuple(rec.shape)}, this trace runs "
                f"{tuple(x.shape)} at layer {layer}: record it (freeze_attention) on the same prompts, in the same "
                "batch, as the intervened trace")
        return rec.to(device=x.device, dtype=x.dtype)


def fingerprint(model: Any, adapter: ArchitectureAdapter) -> torch.Tensor:
    """A checksum of a Hugging Face model's weights, to tell the model a :class:`FrozenAttention` was recorded on:
    ``(Σ_i (i + 1) · Σ p_i, Σ_i Σ p_i²)`` over every parameter (sorted by name), in fp64, on the CPU — computed where
    the model runs (on NDIF in the request, from the server's weights; one read of the weights, ~5 ms for 16 GB on a
    GPU). Until 2026-11-30 the first attention's only: weights changed after recording in a later layer (an in-place
    edit, a fine-tune) were not seen, and the unedited frozen trace was 5.1e-4 off the model's own pass. ``adapter`` is
    kept for the signature (the model family is the model's)."""
    total = torch.zeros(2, dtype=torch.float64, device="cpu")
    for i, (_, p) in enumerate(sorted(model.named_parameters(), key=lambda kv: kv[0])):
        for chunk in p.detach().reshape(-1).split(FINGERPRINT_CHUNK):  # fp64 copies of at most a chunk
            c = chunk.double()
            total += torch.stack([(i + 1) * c.sum(), c.pow(2).sum()]).cpu()
    return total


def frozen_in(interleaver: Any) -> FrozenAttention | None:
    """The :class:`FrozenAttention` a running trace applies (its worker's), or None."""
    worker = find_worker(interleaver, FROZEN_TAG)
    return None if worker is None else worker.frozen


def install(root: Any, adapter: ArchitectureAdapter, frozen: FrozenAttention,
            projection_path: Any) -> None:
    """Inside a trace body, before anything is spliced or read: freeze every attention pattern at ``frozen``'s (see
    the module docstring). ``projection_path(layer)``: the path of the layer's attention output projection. Called
    twice with the same record in one trace (another invoke), it does nothing.

    Raises:
        TraceOrderError: called outside a trace body, or after the model ran the first layer's attention.
        ArgumentError: inside ``model.generate``; with gradients enabled (the correction carries none: the
            gradients would be neither model's); in a trace that ``attribute(rm, tracer=tracer)`` records (its graph
            would be of the live patterns); a Lorsa already spliced in this trace (its patterns would stay live:
            call ``prepare(..., frozen=...)`` first); another :class:`FrozenAttention` already applied in it;
            ``frozen`` recorded on a model with other weights or on other prompts (token ids, padding).
    """
    me = current_worker("ReplacementModel.prepare(frozen=...)")
    interleaver = me.interleaver
    model = hf_module(root)
    if not torch.equal(fingerprint(model, adapter), frozen.fingerprint):
        raise ArgumentError("prepare(frozen=...): this FrozenAttention was recorded on a model with other weights "
                            "(their checksum differs); record it on this model as it is now")
    if traced_method(interleaver) == "generate":
        raise ArgumentError("prepare(frozen=...) inside model.generate: frozen attention holds the patterns of one "
                            "forward pass over the recorded prompt; run it in model.trace(prompt)")
    if find_worker(interleaver, EDIT_LOG_TAG) is not None:
        raise ArgumentError(
            "prepare(frozen=...) in a trace that attribute(rm, tracer=tracer) records: the graph is of the live "
            "pass's patterns, not of the record's. Attribute an intervened trace without frozen attention, or read "
            "the frozen trace's logits only")
    frozen.check_prompts(noted_inputs(), invoke_rows(me))
    existing = find_worker(interleaver, FROZEN_TAG)
    if existing is not None:
        if existing.frozen is not frozen:
            raise ArgumentError("prepare(frozen=...): another FrozenAttention is already applied in this trace; a "
                                "trace freezes its attention at one record")
        return
    lorsas = [m.chain.site_paths[0] for m in interleaver.mediators
              if is_splice(m) and m.alive and getattr(m, "chain", None) is not None and m.chain.attach_name == "lorsa"]
    if lorsas:
        raise ArgumentError(f"prepare(frozen=...): a Lorsa is already spliced in this trace at {lorsas[0]}, with its "
                            "patterns live; call prepare(targets, frozen=...) first in the body, before any replace()")
    layers = sorted(frozen.inputs)
    # the envoy's path (``model.model.layers.0.self_attn``), which the run's counts use; the adapter's module path
    # (``model.layers.0.self_attn``) was never counted: until 2026-11-30 a late prepare was taken and froze nothing
    if layers and ran_since_start(me, root.get(adapter.attention_path(layers[0])).path) > 0:
        raise TraceOrderError("prepare(frozen=...): the model already ran the first layer's attention in this "
                              "forward pass; call it first in the trace body")
    attns = {layer: root.get(adapter.attention_path(layer)) for layer in layers}
    projs = {layer: root.get(projection_path(layer)) for layer in layers}
    gates = {layer: enclosing(root, adapter.attention_path(layer), attns[layer].path) for layer in layers}

    def body() -> None:
        for n, layer in enumerate(layers):
            if n:  # (spawned last: the first time it is there already)
                serve_last(worker)  # the values as the body's edits and the splices left them
            gate = gates[layer]
            if gate is not None:
                more, skipped = park_or_end(partial(skip_gate, root.get(gate).path))
                if not more:
                    return
                if skipped:  # the decoder layer does not run: nothing to freeze there
                    continue
            more, call = park_or_end(partial(getattr, attns[layer], "inputs"))
            if not more:
                return
            args, kwargs = call
            x = adapter.attention_input(args, kwargs)
            clean = frozen.input_of(layer, x, f"at {adapter.attention_path(layer)}")
            more, skipped = park_or_end(partial(skip_gate, attns[layer].path))
            if not more:
                return
            if skipped:  # its output is the trace's
                continue
            moved = not torch.equal(x, clean)  # else the patterns are the clean ones: nothing to add
            if not moved and not torch.is_grad_enabled():
                continue
            delta = None
            if moved:
                with torch.no_grad():
                    delta = z_correction(adapter.mhsa_weights(model, layer), x, clean,
                                         adapter.attention_positions(args, kwargs, x),
                                         adapter.attention_mask(args, kwargs))
            serve_first(worker)  # before the trace body's edits of the heads (MHSAHead at the same input)
            more, pcall = park_or_end(partial(getattr, projs[layer], "inputs"))
            if not more:
                return
            pargs, pkwargs = pcall
            z = pargs[0]
            if torch.is_grad_enabled() and z.requires_grad:  # a backward through it is refused, by name
                new = NoFrozenGradient.apply(z, delta, adapter.attention_path(layer))
            elif delta is None:
                continue
            else:
                new = (z.to(delta.dtype) + delta.to(z.device)).to(z.dtype)
            projs[layer].inputs = ((new, *pargs[1:]), pkwargs)

    worker = spawn_worker(interleaver, body, FROZEN_TAG)
    worker.frozen = frozen


class NoFrozenGradient(torch.autograd.Function):
    """``z + delta`` (``delta`` None: ``z``) in ``z``'s dtype, whose backward raises: the frozen model's gradient of
    ``z`` is ``A_clean · dv`` (no pattern term), which neither ``z``'s own gradient (the live patterns') nor a
    detached sum gives — so a backward through a frozen attention is refused by name rather than silently wrong
    (until 2026-11-30 the sum was detached: no gradient through those values). The frozen model's gradients are the
    attribution graph's (:func:`nnsight_lorsa.attribute`)."""

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor, delta: torch.Tensor | None, where: str) -> torch.Tensor:
        ctx.where = where
        if delta is None:
            return z.clone()
        return (z.to(delta.dtype) + delta.to(z.device)).to(z.dtype)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise ArgumentError(
            f"a backward pass reached the frozen attention at {ctx.where}: its gradient (the frozen model's, "
            "A_clean · dv) is not computed here, and the live one would be wrong. Run frozen-attention traces under "
            "torch.no_grad(); the frozen model's gradients are the attribution graph's (attribute)")


def z_correction(w: MHSAWeights, x: torch.Tensor, clean: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor | None) -> torch.Tensor:
    """``(A_clean − A_live) v(x)`` per head, as the output projection's input ``(batch, pos, n_heads·head_dim)``
    (head-major), in fp32 (fp64 kept): the patterns from ``clean`` and ``x`` (:func:`~..adapters.base.mhsa_qk`,
    :func:`~..adapters.base.qk_pattern`), the values from ``x``. ``mask``: the model's ``(batch | 1, 1, pos, pos)``
    mask (bool, or additive float) or None (causal; the sliding window of ``w`` either way); a query that may attend
    nowhere keeps itself (a padded row: finite, meaningless). Heads in chunks of at most :data:`CHUNK_ELEMENTS`
    pattern elements.

    Source: ours (circuit-tracer writes the cached ``hook_pattern`` back; here the difference of two recomputed
    patterns is added to the model's own ``z``, so an unedited input adds exactly 0)."""
    work = torch.promote_types(x.dtype, torch.float32)
    b, s, _ = x.shape
    pos = positions.to(x.device)
    q_c, k_c = mhsa_qk(w, clean, pos)
    q_l, k_l = mhsa_qk(w, x, pos)
    v = mhsa_values(w, x).to(work)  # (b, h, s, e)
    allowed = mhsa_mask(w, s, x.device)[None, None]
    if mask is not None:
        m = mask.to(x.device)
        allowed = allowed & (m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2)[..., -s:]
    eye = torch.eye(s, dtype=torch.bool, device=x.device)
    allowed = allowed | (~allowed.any(-1, keepdim=True) & eye)
    h = q_c.shape[1]
    step = max(1, CHUNK_ELEMENTS // max(1, b * s * s))
    out = torch.empty(b, h, s, v.shape[-1], dtype=work, device=x.device)
    for h0 in range(0, h, step):
        sl = slice(h0, min(h, h0 + step))
        diff = qk_pattern(w, q_c[:, sl], k_c[:, sl], allowed).to(work) - qk_pattern(w, q_l[:, sl], k_l[:, sl],
                                                                                  allowed).to(work)
        out[:, sl] = diff @ v[:, sl]
    return out.transpose(1, 2).reshape(b, s, h * v.shape[-1])


def check_frozen(value: Any, where: str) -> FrozenAttention | None:
    """``value`` if it is None or a :class:`FrozenAttention`, else an :class:`~..errors.ArgumentError` naming
    ``where``."""
    if value is None or isinstance(value, FrozenAttention):
        return value
    raise ArgumentError(f"{where}: frozen must be a FrozenAttention (patching.freeze_attention(replacement, "
                        f"prompts)) or None, got a {type(value).__name__}")
