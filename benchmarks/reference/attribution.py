"""The reference attribution engine: attribution with plain PyTorch forward hooks on the Hugging Face model.
The nnsight engine (``nnsight_lorsa.attribution.trace``) is tested against it (same graph,
``tests/attribution/test_attribution.py``) and benchmarked against it (``benchmarks/bench_attribution.py``). The frozen
arithmetic is :class:`~nnsight_lorsa.attribution.replacement.FrozenReplacement`, shared with the
nnsight engine; only the way the frozen pass reaches each site differs (hooks here, envoys there).
The clean pass is the package's (one ``model.trace``). Hooks are removed in a ``finally``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nnsight_lorsa.adapters.base import ArchitectureAdapter
from nnsight_lorsa.attribution.engine import FrozenPass, build_graph
from nnsight_lorsa.attribution.graph import Graph
from nnsight_lorsa.attribution.replacement import FrozenReplacement
from nnsight_lorsa.attribution.rows import RowScheduler
from nnsight_lorsa.attribution.trace import (
    Prepared,
    autograd_backward,
    backward_rows,
    first_row,
    frozen_output,
    frozen_sites,
    multiplier_dtype,
)


def install_frozen_hooks(hf: nn.Module, adapter: ArchitectureAdapter, frozen: FrozenReplacement) -> list[Any]:
    """Hooks that make ``hf``'s forward the frozen replacement model's; returns the handles.

    As ``trace.frozen_forward_body``: a pre-hook keeps each replaced module's full call and runs the
    module on batch row 0 in the model's dtype (``trace.first_row``); its forward hook returns the
    frozen model's output, computed from the full call."""
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


def hooks_pass(hf: nn.Module) -> FrozenPass:
    """The frozen pass over ``batch_size`` copies with PyTorch hooks on the bare model ``hf`` (filling
    the scheduler with edge rows; autograd backward outside any trace); returns the target values."""
    def run(prepared: Prepared, scheduler: RowScheduler, batch_size: int,
            make: Callable[..., FrozenReplacement]) -> torch.Tensor:
        layout = prepared.layout
        device = next(hf.parameters()).device
        M = torch.ones(batch_size, layout.n_sources, device=device, dtype=multiplier_dtype(hf, prepared.dtype),
                       requires_grad=True)
        frozen = make(layout, M, prepared.mhsa)
        handles = install_frozen_hooks(hf, prepared.adapter, frozen)
        try:
            hf(layout.tokens[None].expand(batch_size, -1).to(device), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        backward_rows(frozen, M, scheduler, batch_size, autograd_backward)
        return frozen.targets()[0].detach()

    return run


def attribute_with_hooks(replacement: Any, prompt: Any, **options: Any) -> Graph:
    """``attribute(replacement, prompt, **options)`` with the frozen pass in PyTorch hooks (a prompt
    only; ``remote`` is not supported). ``options`` as ``attribute``'s, ``memory`` also a
    ``(patterns, node_vectors)`` pair."""
    return build_graph(replacement, prompt, frozen_pass=hooks_pass(replacement.model._module), engine="hooks",
                       **options)

