"""The cached engine: attribution from an :class:`~.trace.AttributionCache` of tensors, the frozen
replacement model as plain tensor code.

The nnsight engine (:mod:`.trace`) runs the frozen model *inside* the model's forward (envoys swap
each site's output). The same graph can be computed from tensors alone:
:func:`.engine.cache_for_attribution` saves, in one nnsight trace, everything the frozen model
takes from the prompt (the residual stream's start, token positions, the inputs the layout needs,
every replaced module's true output for its error nodes, the last logits), and
:func:`.attribute.attribute` given that cache builds the graph from it and the weights — the norms,
attention and unembedding of the model, the Lorsas and transcoders — wiring
:class:`.replacement.FrozenReplacement`'s sites into decoder blocks itself (sequential residual,
or GPT-NeoX's parallel one), with one autograd backward per batch of targets. No model forward runs;
the cache can come from anywhere (a remote trace, disk). Same arithmetic, same graph (tested).

Because no model code runs on the residual stream, the frozen model can also run in another dtype
than the model's: ``dtype=torch.float32`` for a bf16 model gives edges whose sums hold to fp32
rounding instead of bf16's (the constants — norm scales, patterns, errors — still come from the
model's own bf16 forward, so the graph is that of the bf16 model, computed exactly).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

import torch

from ..adapters.base import ArchitectureAdapter
from ..errors import ConfigMismatchError, ShapeError
from .replacement import FrozenReplacement
from .trace import AttributionCache, Prepared, autograd_backward, backward_rows, multiplier_dtype


def frozen_forward_cached(root: torch.nn.Module, adapter: ArchitectureAdapter, frozen: FrozenReplacement,
                          cache: AttributionCache, batch: int) -> None:
    """The frozen forward over ``batch`` copies of the cached prompt, wired as the family's decoder
    blocks: ``h += attn(norm₁ h); h += mlp(norm₂ h)`` (Gemma-2: ``h += post₁(attn(norm₁ h));
    h += post₂(mlp(norm₂ h))``), or GPT-NeoX's parallel residual ``h += attn(norm₁ h) + mlp(norm₂ h)``; then the
    final norm and the unembedding."""
    get = adapter.get_module
    parallel = bool(getattr(adapter.config, "use_parallel_residual", False))
    assert cache.embeddings is not None, "a full cache (cache_for_attribution) is needed"
    h = frozen.embed(cache.embeddings.to(frozen.M.device).expand(batch, -1, -1))
    for layer in range(adapter.n_layers):
        # each layer runs where its weights are (a model over several devices): the stream and the cached
        # tensors go there; a cache loaded on the CPU goes to the model's device
        at = device_of(get(root, adapter.attention_path(layer)), h.device)
        h = h.to(at)
        x = frozen_norm_at(frozen, root, adapter.attention_norm_path(layer), h, layer, "attn_norm")
        a = frozen.attention(layer, x, cache.positions.to(at), cache.attn_out.get(layer, x).to(at))
        a = frozen_norm_at(frozen, root, adapter.attention_post_norm_path(layer), a, layer, "attn_post_norm")
        after = h if parallel else h + a
        y = frozen_norm_at(frozen, root, adapter.mlp_norm_path(layer), after, layer, "mlp_norm")
        m = frozen.mlp(layer, y, cache.mlp_out[layer].to(at))
        if layer in cache.mlp_post_out:  # a traced pass: the post-norm's output as it ran, the writes' reference
            frozen.post_refs[layer] = cache.mlp_post_out[layer]
        h = after + frozen_norm_at(frozen, root, adapter.mlp_post_norm_path(layer), m, layer, "mlp_post_norm") + (
            a if parallel else 0.0)
    lm_head = get(root, adapter.lm_head_path)
    x = frozen.norm(get(root, adapter.final_norm_path), h.to(device_of(lm_head, h.device)), None, "final_norm")
    frozen.unembed(lm_head, x)


def frozen_norm_at(frozen: FrozenReplacement, root: torch.nn.Module, path: str | None, out: torch.Tensor, layer: int,
              role: str) -> torch.Tensor:
    """``out`` through the frozen norm at ``path`` (a post-norm: Gemma-2, OLMo-2; a pre-norm), or as it is
    (``path`` None: no such norm in the family, e.g. OLMo-2's pre-norms)."""
    return out if path is None else frozen.norm(ArchitectureAdapter.get_module(root, path), out, layer, role)


def device_of(module: torch.nn.Module, default: torch.device) -> torch.device:
    """The device of ``module``'s first parameter (``default`` without parameters)."""
    p = next(module.parameters(), None)
    return default if p is None else p.device


def check_cache(cache: AttributionCache, adapter: ArchitectureAdapter, lorsas: dict[int, Any],
                 transcoders: dict[int, Any]) -> None:
    """Raise before anything runs if the cache lacks a tensor the replacement layers need, or has
    one of the wrong shape.

    Raises:
        ConfigMismatchError: a tensor of a replacement layer is missing (a cache made for other layers).
        ShapeError: a tensor is not ``(1, pos, d_model)``.
    """
    n, d = cache.tokens.numel(), adapter.d_model
    need: list[tuple[str, torch.Tensor | None]] = [("embeddings", cache.embeddings)]
    need += [(f"mlp_out[{layer}]", cache.mlp_out.get(layer)) for layer in range(adapter.n_layers)]
    need += [(f"{name}[{layer}]", getattr(cache, name).get(layer)) for layer in lorsas
             for name in ("attn_in", "attn_out")]
    need += [(f"mlp_in[{layer}]", cache.mlp_in.get(layer)) for layer in transcoders]
    missing = [name for name, t in need if t is None]
    if missing:
        raise ConfigMismatchError(f"the cache was made for other replacement layers: no {missing}")
    for name, t in need:
        if t is not None and tuple(t.shape) != (1, n, d):
            raise ShapeError(f"cache.{name} must be (1, {n}, {d}), got {tuple(t.shape)}")


def attribute_cached(root: torch.nn.Module, prepared: Prepared, cache: AttributionCache, scheduler: Any,
                     batch_size: int, make: Callable[..., FrozenReplacement],
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """The frozen pass from ``cache`` over ``batch_size`` copies (no model forward), filling ``scheduler``
    with edge rows as :func:`.trace.attribute_in_trace`; returns the target values ``(n_targets,)``.
    ``root``: the Hugging Face model (its norms, attention weights and unembedding are used)."""
    device = next(root.parameters()).device
    M = torch.ones(batch_size, prepared.layout.n_sources, device=device, dtype=multiplier_dtype(root, dtype),
                   requires_grad=True)
    frozen = make(prepared.layout, M, prepared.mhsa)
    frozen_forward_cached(root, prepared.adapter, frozen, cache, batch_size)
    backward_rows(frozen, M, scheduler, batch_size, autograd_backward)
    return frozen.targets()[0].detach()


def in_dtype(cache: AttributionCache, dtype: torch.dtype) -> AttributionCache:
    """The cache with its floating tensors in ``dtype``: every field's, the per-layer dicts' included (each field
    read from the dataclass: a list of the dict fields here forgot none so far, but would forget the next)."""
    def cast(t: Any) -> Any:
        if isinstance(t, dict):
            return {k: cast(v) for k, v in t.items()}
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return AttributionCache(**{f.name: cast(getattr(cache, f.name)) for f in fields(cache)})
