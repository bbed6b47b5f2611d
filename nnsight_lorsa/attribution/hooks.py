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
from .trace import backward_rows, first_row, frozen_output, frozen_sites, multiplier_dtype


def _autograd_backward(obj: torch.Tensor, M: torch.Tensor, consume: Callable[[torch.Tensor], None]) -> None:
    consume(torch.autograd.grad(obj, M, retain_graph=True)[0])


def install_frozen_hooks(hf: nn.Module, adapter: ArchitectureAdapter, frozen: FrozenReplacement) -> list[Any]:
    """Hooks that make ``hf``'s forward the frozen replacement model's; returns the handles.

    As :func:`.trace.frozen_forward_body`: a pre-hook keeps each replaced module's full call and
    runs the module on batch row 0 in the model's dtype (:func:`.trace.first_row`); its forward hook
    returns the frozen model's output, computed from the full call."""
    get = adapter.get_module
    handles = []
    calls: dict[str, tuple[tuple, dict]] = {}
    batch, dtype = frozen.M.shape[0], next(hf.parameters()).dtype

    def on(path: str, fn: Any) -> None:  # fn(module, full args, full kwargs, row-0 output) -> output
        def pre(m: nn.Module, a: tuple, k: dict) -> tuple[tuple, dict]:
            calls[path] = (a, k)
            return first_row(a, k, batch, dtype)

        def post(m: nn.Module, a: tuple, k: dict, o: Any) -> Any:
            full_a, full_k = calls.pop(path)
            return fn(m, full_a, full_k, o)

        module = get(hf, path)
        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))

    for path in (adapter.embed_path, getattr(adapter, "pos_embed_path", None)):
        if path:
            handles.append(get(hf, path).register_forward_hook(lambda m, a, o: frozen.embed(o)))
    for site in frozen_sites(adapter):
        on(site.path, lambda m, a, k, o, site=site: frozen_output(frozen, adapter, site, m, a, k, o))
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
