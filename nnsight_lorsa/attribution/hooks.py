"""The same attribution with plain PyTorch forward hooks on the Hugging Face model (no nnsight).

The reference the nnsight-traced path is benchmarked against (``benchmarks/bench_attribution.py``),
and the lower-level entry point for a bare ``transformers`` model: the frozen arithmetic is
:class:`.replacement.FrozenReplacement`, shared with :mod:`.trace`; only the way sites are reached
differs (hooks here, envoys there). Hooks are removed in a ``finally``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..adapters.base import ArchitectureAdapter
from .layout import Layout
from .replacement import FrozenReplacement
from .schedule import RowScheduler
from .trace import backward_rows, multiplier_dtype


def _autograd_backward(obj: torch.Tensor, M: torch.Tensor, consume: Callable[[torch.Tensor], None]) -> None:
    consume(torch.autograd.grad(obj, M, retain_graph=True)[0])


def install_frozen_hooks(hf: nn.Module, adapter: ArchitectureAdapter, frozen: FrozenReplacement) -> list[Any]:
    """Forward hooks that make ``hf``'s forward the frozen replacement model's; returns the handles.

    As :func:`.trace.frozen_forward_body`: the MLPs and the unembedding run on batch row 0 only (a
    pre-hook cuts their first input to it and keeps the whole one for the frozen model)."""
    get = adapter.get_module
    handles = []
    full: dict[str, torch.Tensor] = {}

    def on(path: str, fn: Any) -> None:
        handles.append(get(hf, path).register_forward_hook(fn, with_kwargs=True))

    def row0(path: str) -> None:  # run the module on batch row 0; keep the full first input
        def pre(m: nn.Module, a: tuple, k: dict) -> tuple[tuple, dict] | None:
            if not a:  # not called positionally: run it whole
                return None
            full[path] = a[0]
            return (a[0][:1], *a[1:]), k

        handles.append(get(hf, path).register_forward_pre_hook(pre, with_kwargs=True))

    def whole(path: str, a: tuple, k: dict) -> torch.Tensor:  # the full first input row0 kept (or the input)
        x = full.pop(path, None)
        return x if x is not None else (a[0] if a else next(iter(k.values())))

    on(adapter.embed_path, lambda m, a, k, o: frozen.embed(o))
    pos_path = getattr(adapter, "pos_embed_path", None)
    if pos_path:
        on(pos_path, lambda m, a, k, o: frozen.embed(o))
    for layer in range(adapter.n_layers):
        on(adapter.attention_norm_path(layer), lambda m, a, k, o, layer=layer: frozen.norm(m, a[0], layer, "attn_norm"))

        def attn(m: nn.Module, a: tuple, k: dict, o: Any, layer: int = layer) -> Any:
            x = adapter.attention_input(a, k)
            new = frozen.attention(layer, x, adapter.attention_positions(a, k, x), adapter.attention_output(o))
            return adapter.with_attention_output(o, new)

        on(adapter.attention_path(layer), attn)
        on(adapter.mlp_norm_path(layer), lambda m, a, k, o, layer=layer: frozen.norm(m, a[0], layer, "mlp_norm"))

        def mlp(m: nn.Module, a: tuple, k: dict, o: Any, path: str = adapter.mlp_path(layer), layer: int = layer
                ) -> Any:
            return adapter.with_mlp_output(o, frozen.mlp(layer, whole(path, a, k), adapter.mlp_output(o)))

        row0(adapter.mlp_path(layer))
        on(adapter.mlp_path(layer), mlp)
    on(adapter.final_norm_path, lambda m, a, k, o: frozen.norm(m, a[0], None, "final_norm"))
    row0(adapter.lm_head_path)
    on(adapter.lm_head_path, lambda m, a, k, o: frozen.unembed(m, whole(adapter.lm_head_path, a, k)))
    return handles


def attribute_with_hooks(hf: nn.Module, adapter: ArchitectureAdapter, layout: Layout, mhsa: dict[int, Any],
                         scheduler: RowScheduler, batch_size: int,
                         make: Callable[..., FrozenReplacement] = FrozenReplacement) -> torch.Tensor:
    """:func:`.trace.attribute_in_trace` with PyTorch hooks on the bare model; returns the target values."""
    device = next(hf.parameters()).device
    M = torch.ones(batch_size, layout.n_sources, device=device, dtype=multiplier_dtype(hf), requires_grad=True)
    frozen = make(layout, M, mhsa)
    handles = install_frozen_hooks(hf, adapter, frozen)
    try:
        hf(layout.tokens[None].expand(batch_size, -1).to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    backward_rows(frozen, M, scheduler, batch_size, _autograd_backward)
    return frozen.targets()[0].detach()
