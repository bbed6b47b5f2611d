"""The clean pass: one trace of the unmodified model saving what the frozen replacement model takes
from the prompt, as an :class:`AttributionCache`, and the layout (the graph's nodes) built from it.

:func:`.attribute.attribute` runs it lean — the inputs the layout needs, the last logits and the
attention positions — and takes the error nodes' true outputs from its own frozen pass;
:func:`.cached.cache_for_attribution` runs it ``full`` (the residual stream's start and every replaced
module's output too), so that :func:`.cached.attribute_from_cache` needs no model forward at all.
torch + nnsight only (runs remotely).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import nnsight
import torch

from .._repr import FieldsRepr
from ..adapters.base import ArchitectureAdapter
from .layout import Layout, build_layout


@dataclass(repr=False)
class AttributionCache(FieldsRepr):
    """What the frozen replacement model takes from one prompt (batch row 0 of a clean forward).

    Attributes:
        tokens: ``(pos,)`` int64 input ids.
        positions: token positions the attention was called with, ``(1, pos)`` or ``(pos,)``.
        last_logits: ``(vocab,)`` the logits at the last position (the logit targets).
        embeddings: ``(1, pos, d_model)`` the residual stream's start (token + position embeddings);
            None from a lean pass.
        attn_in: ``{layer: (1, pos, d_model)}`` attention input of each layer with a Lorsa (its
            active heads); ``attn_out`` its output (error nodes; empty from a lean pass).
        mlp_in: ``{layer: (1, pos, d_model)}`` MLP input of each layer with a transcoder.
        mlp_out: ``{layer: (1, pos, d_model)}`` every layer's MLP output (error nodes; empty from a
            lean pass).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    last_logits: torch.Tensor
    embeddings: torch.Tensor | None = None
    attn_in: dict[int, torch.Tensor] = field(default_factory=dict)
    attn_out: dict[int, torch.Tensor] = field(default_factory=dict)
    mlp_in: dict[int, torch.Tensor] = field(default_factory=dict)
    mlp_out: dict[int, torch.Tensor] = field(default_factory=dict)


@torch.no_grad()
def clean_pass(model: Any, adapter: ArchitectureAdapter, ids: torch.Tensor, lorsa_layers: list[int],
               tc_layers: list[int], *, remote: Any = False, full: bool = False) -> AttributionCache:
    """One ``model.trace`` of the unmodified model on ``ids: (pos,)`` (``remote`` as in
    :func:`.attribute.attribute`); ``full`` also saves the embeddings and the replaced modules'
    outputs (a lean pass downloads only what the layout needs)."""
    pos_path = getattr(adapter, "pos_embed_path", None)
    with model.trace(ids[None], use_cache=False, remote=remote):
        emb = None
        if full:
            emb = model.get(adapter.embed_path).output
            if pos_path:
                emb = emb + model.get(pos_path).output
        attn_in: dict[int, Any] = {}
        attn_out: dict[int, Any] = {}
        mlp_in: dict[int, Any] = {}
        mlp_out: dict[int, Any] = {}
        positions = None
        for layer in range(adapter.n_layers):
            attn = model.get(adapter.attention_path(layer))
            if layer == 0 or layer in lorsa_layers:
                args, kwargs = attn.inputs
                x = adapter.attention_input(args, kwargs)
                if layer == 0:
                    positions = adapter.attention_positions(args, kwargs, x)
                if layer in lorsa_layers:
                    attn_in[layer] = x
                    if full:
                        attn_out[layer] = adapter.attention_output(attn.output)
            mlp = model.get(adapter.mlp_path(layer))
            if layer in tc_layers:
                args, kwargs = mlp.inputs
                mlp_in[layer] = adapter.mlp_input(args, kwargs)
            if full:
                mlp_out[layer] = adapter.mlp_output(mlp.output)
        last = model.get(adapter.lm_head_path).output[0, -1]
        # one saved value: on a remote server the dicts above are not the caller's
        saved = nnsight.save((emb, positions, attn_in, attn_out, mlp_in, mlp_out, last))
    emb, positions, attn_in, attn_out, mlp_in, mlp_out, last = saved
    return AttributionCache(tokens=ids.cpu(), positions=positions, last_logits=last, embeddings=emb,
                            attn_in=dict(attn_in), attn_out=dict(attn_out), mlp_in=dict(mlp_in),
                            mlp_out=dict(mlp_out))


def layout_of(cache: AttributionCache, modules: dict[str, Any], adapter: ArchitectureAdapter, *,
              logit_tokens: Any = None, desired_logit_prob: float = 0.95, max_n_logits: int = 10) -> Layout:
    """The prompt's nodes (:func:`.layout.build_layout`) from a clean pass's cache."""
    return build_layout(cache.tokens, {layer: (x, cache.positions) for layer, x in cache.attn_in.items()},
                        cache.mlp_in, cache.last_logits, modules, n_layers=adapter.n_layers,
                        logit_tokens=logit_tokens, desired_logit_prob=desired_logit_prob, max_n_logits=max_n_logits)
