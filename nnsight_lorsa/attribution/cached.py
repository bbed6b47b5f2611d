"""Attribution over cached tensors: the frozen replacement model as plain tensor code.

:func:`attribute` runs the frozen model *inside* the model's forward (nnsight envoys or hooks swap
each site's output). The same graph can be computed from tensors alone:
:func:`cache_for_attribution` saves, in one nnsight trace, everything the frozen model takes from
the prompt (:class:`AttributionCache`: the residual stream's start, token positions, the inputs the
layout needs, every replaced module's true output for its error nodes, the last logits), and
:func:`attribute_from_cache` then builds the graph from that cache and the weights — the norms,
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

import functools
from typing import Any

import torch

from ..adapters.base import ArchitectureAdapter
from ..adapters.registry import get_adapter
from ..errors import ConfigMismatchError, ShapeError
from .attribute import _as_dict, check_options, compute_graph, replacement_modules, tokenize
from .clean import AttributionCache, clean_pass, layout_of
from .graph import Graph
from .hooks import _autograd_backward
from .precision import copies_in, weights_in
from .replacement import FrozenReplacement
from .schedule import RowScheduler
from .trace import backward_rows, multiplier_dtype


@torch.no_grad()
def cache_for_attribution(model: Any, prompt: Any, *, lorsas: Any = None, transcoders: Any = None,
                          remote: Any = False) -> AttributionCache:
    """One clean ``model.trace`` saving the :class:`~.clean.AttributionCache` of ``prompt`` for the
    given replacement layers, in full (``remote`` as in :func:`.attribute.attribute`).

    Raises:
        UnsupportedArchitectureError, LayerOutOfRangeError, ShapeError: bad model, layers or prompt.
    """
    adapter = get_adapter(model)
    lor, tcs = _as_dict(lorsas, "LorsaSet"), _as_dict(transcoders, "TranscoderSet")
    for layer in [*lor, *tcs]:
        adapter.check_layer(layer)
    return clean_pass(model, adapter, tokenize(model, prompt), list(lor), list(tcs), remote=remote, full=True)


def frozen_forward_cached(root: torch.nn.Module, adapter: ArchitectureAdapter, frozen: FrozenReplacement,
                          cache: AttributionCache, batch: int) -> None:
    """The frozen forward over ``batch`` copies of the cached prompt, wired as the family's decoder
    blocks: ``h += attn(norm₁ h); h += mlp(norm₂ h)``, or GPT-NeoX's parallel residual
    ``h += attn(norm₁ h) + mlp(norm₂ h)``; then the final norm and the unembedding."""
    get = adapter.get_module
    parallel = bool(getattr(adapter.config, "use_parallel_residual", False))
    assert cache.embeddings is not None, "a full cache (cache_for_attribution) is needed"
    h = frozen.embed(cache.embeddings.expand(batch, -1, -1))
    for layer in range(adapter.n_layers):
        x = frozen.norm(get(root, adapter.attention_norm_path(layer)), h, layer, "attn_norm")
        a = frozen.attention(layer, x, cache.positions, cache.attn_out.get(layer, x))
        after = h if parallel else h + a
        y = frozen.norm(get(root, adapter.mlp_norm_path(layer)), after, layer, "mlp_norm")
        h = after + frozen.mlp(layer, y, cache.mlp_out[layer]) + (a if parallel else 0.0)
    x = frozen.norm(get(root, adapter.final_norm_path), h, None, "final_norm")
    frozen.unembed(get(root, adapter.lm_head_path), x)


def _check_cache(cache: AttributionCache, adapter: ArchitectureAdapter, lorsas: dict[int, Any],
                 transcoders: dict[int, Any]) -> None:
    """Raise before anything runs if the cache lacks a tensor the replacement layers need, or has
    one of the wrong shape."""
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


def attribute_from_cache(
    model: Any,
    cache: AttributionCache,
    *,
    lorsas: Any = None,
    transcoders: Any = None,
    max_feature_nodes: int | None = None,
    batch_size: int = 64,
    logit_tokens: Any = None,
    desired_logit_prob: float = 0.95,
    max_n_logits: int = 10,
    progress: bool = False,
    patterns: str = "auto",
    node_vectors: str = "auto",
    prune_to: tuple[float, float] | None = None,
    keep_mass: float | None = None,
    dtype: torch.dtype | None = None,
) -> Graph:
    """:func:`.attribute.attribute` from an :class:`AttributionCache`, without running the model.

    ``model``: the nnsight model or the bare Hugging Face one (its norms, attention weights and
    unembedding are used; its forward is not). ``dtype``: the frozen model's compute dtype (default
    the model's); ``torch.float32`` for a bf16/fp16 model makes the edge sums exact to fp32 rounding
    (the Lorsas, transcoders and attention weights are used as copies in that dtype). Other arguments
    as :func:`.attribute.attribute`.

    Raises:
        ConfigMismatchError: bad options, or a cache without the replacement layers' tensors.
        ShapeError: cache tensors of the wrong shape.
    """
    check_options(batch_size=batch_size, patterns=patterns, node_vectors=node_vectors, prune_to=prune_to,
                  keep_mass=keep_mass)
    adapter = get_adapter(model)
    root = getattr(model, "_module", model)
    lor, tcs = _as_dict(lorsas, "LorsaSet"), _as_dict(transcoders, "TranscoderSet")
    _check_cache(cache, adapter, lor, tcs)
    if dtype is not None and dtype != next(root.parameters()).dtype:
        cache, lor, tcs = _in_dtype(cache, dtype), copies_in(lor, dtype), copies_in(tcs, dtype)
    modules, mhsa = replacement_modules(model, adapter, lor, tcs)
    if dtype is not None:
        mhsa = {layer: weights_in(w, dtype) for layer, w in mhsa.items()}
    layout = layout_of(cache, modules, adapter, logit_tokens=logit_tokens, desired_logit_prob=desired_logit_prob,
                       max_n_logits=max_n_logits)
    make = functools.partial(FrozenReplacement, patterns=patterns, node_vectors=node_vectors, dtype=dtype)
    device = next(root.parameters()).device

    def run(scheduler: RowScheduler) -> torch.Tensor:
        m_dtype = multiplier_dtype(root) if dtype is None else torch.promote_types(multiplier_dtype(root), dtype)
        M = torch.ones(batch_size, layout.n_sources, device=device, dtype=m_dtype, requires_grad=True)
        frozen = make(layout, M, mhsa)
        frozen_forward_cached(root, adapter, frozen, cache, batch_size)
        backward_rows(frozen, M, scheduler, batch_size, _autograd_backward)
        return frozen.targets()[0].detach()

    meta = {"model_type": adapter.config.model_type, "lorsa_layers": sorted(lor), "transcoder_layers": sorted(tcs),
            "batch_size": batch_size, "max_feature_nodes": max_feature_nodes, "engine": "cache",
            "patterns": patterns, "node_vectors": node_vectors, "dtype": str(dtype or next(root.parameters()).dtype)}
    return compute_graph(layout, run, max_feature_nodes=max_feature_nodes, progress=progress, prune_to=prune_to,
                         keep_mass=keep_mass, prompt="", meta=meta)


def _in_dtype(cache: AttributionCache, dtype: torch.dtype) -> AttributionCache:
    """The cache with its floating tensors in ``dtype``."""
    def cast(t: Any) -> Any:
        return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return AttributionCache(tokens=cache.tokens, embeddings=cast(cache.embeddings), positions=cache.positions,
                            last_logits=cast(cache.last_logits),
                            **{name: {k: cast(v) for k, v in getattr(cache, name).items()}
                               for name in ("attn_in", "attn_out", "mlp_in", "mlp_out")})
