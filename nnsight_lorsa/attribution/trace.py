"""Attribution inside ``model.trace(...)``: the clean pass and the frozen pass with batched backward.

Both passes are ordinary nnsight traces over the user's model: the clean pass saves the inputs of
the replaced modules; the frozen pass swaps every norm, attention, MLP and the unembedding output
for :class:`.replacement.FrozenReplacement`'s and then, inside the same trace, runs one backward
per batch of targets through nnsight's backward context (``with obj.backward(): M.grad``), with
the gradients injected one target per batch row. Nothing is attached to the model and no
parameter gets a ``.grad`` (``backward(inputs=[M])``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nnsight
import torch

from ..adapters.base import ArchitectureAdapter
from .layout import Layout
from .replacement import FrozenReplacement


def first_row(args: tuple, kwargs: dict, batch: int, dtype: torch.dtype) -> tuple[tuple, dict]:
    """A module call cut to batch row 0 in the model's dtype: every tensor of ≥ 2 dimensions with a
    leading ``batch`` dimension sliced to its first row (tuples of them too, e.g. RoPE's ``(cos, sin)``),
    every floating one cast to ``dtype``. The frozen pass runs the model's own modules on this: their
    row-0 output is all it needs (the errors' true outputs), and the frozen model may compute in
    another dtype than theirs."""
    def cut(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            if batch > 1 and v.dim() >= 2 and v.shape[0] == batch:
                v = v[:1]
            return v.to(dtype) if v.is_floating_point() else v
        return tuple(cut(t) for t in v) if isinstance(v, tuple) else v

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def call_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The first input of a module call (first positional, else first keyword)."""
    return args[0] if args else next(iter(kwargs.values()))


@dataclass(frozen=True)
class FrozenSite:
    """A module whose output the frozen pass replaces: ``kind`` ``"norm"`` (``role`` ``attn_norm`` /
    ``mlp_norm`` / ``final_norm``), ``"attention"``, ``"mlp"`` or ``"head"`` (the unembedding)."""

    path: str
    kind: str
    layer: int | None = None
    role: str = ""


def frozen_sites(adapter: ArchitectureAdapter) -> list[FrozenSite]:
    """The replaced modules in forward order (the embeddings are scaled in place, not replaced)."""
    sites = []
    for layer in range(adapter.n_layers):
        sites += [FrozenSite(adapter.attention_norm_path(layer), "norm", layer, "attn_norm"),
                  FrozenSite(adapter.attention_path(layer), "attention", layer),
                  FrozenSite(adapter.mlp_norm_path(layer), "norm", layer, "mlp_norm"),
                  FrozenSite(adapter.mlp_path(layer), "mlp", layer)]
    return [*sites, FrozenSite(adapter.final_norm_path, "norm", None, "final_norm"),
            FrozenSite(adapter.lm_head_path, "head")]


def frozen_output(frozen: FrozenReplacement, adapter: ArchitectureAdapter, site: FrozenSite, module: torch.nn.Module,
                  args: tuple, kwargs: dict, out: Any) -> Any:
    """What the frozen model returns at ``site``, from the module's full call ``(args, kwargs)`` and its
    (row-0) output ``out`` — shared by the nnsight and the PyTorch-hook drivers."""
    if site.kind == "norm":
        return frozen.norm(module, call_input(args, kwargs), site.layer, site.role)
    if site.kind == "head":
        return frozen.unembed(module, call_input(args, kwargs))
    assert site.layer is not None
    if site.kind == "attention":
        x = adapter.attention_input(args, kwargs)
        new = frozen.attention(site.layer, x, adapter.attention_positions(args, kwargs, x),
                               adapter.attention_output(out))
        return adapter.with_attention_output(out, new)
    new = frozen.mlp(site.layer, adapter.mlp_input(args, kwargs), adapter.mlp_output(out))
    return adapter.with_mlp_output(out, new)


def frozen_forward_body(model: Any, adapter: ArchitectureAdapter, frozen: FrozenReplacement) -> None:
    """Inside a trace over ``batch`` copies of the prompt: swap every site's output for the frozen
    replacement model's, in forward order. Every replaced module (norms, attention, MLPs, unembedding)
    runs on batch row 0 only, in the model's dtype (:func:`first_row`), so the ``batch`` copies cost
    the model's forward once plus the frozen model, which may compute in another dtype."""
    root = model._module
    batch, dtype = frozen.M.shape[0], next(root.parameters()).dtype
    for path in (adapter.embed_path, getattr(adapter, "pos_embed_path", None)):
        if path:
            emb = model.get(path)
            emb.output = frozen.embed(emb.output)
    for site in frozen_sites(adapter):
        envoy = model.get(site.path)
        args, kwargs = envoy.inputs
        envoy.inputs = first_row(args, kwargs, batch, dtype)
        envoy.output = frozen_output(frozen, adapter, site, adapter.get_module(root, site.path), args, kwargs,
                                     envoy.output)


def multiplier_dtype(module: torch.nn.Module) -> torch.dtype:
    """fp64 for an fp64 model, else fp32 (edges of a bf16/fp16 model still accumulate in fp32)."""
    return torch.float64 if next(module.parameters()).dtype == torch.float64 else torch.float32


def nnsight_backward(obj: torch.Tensor, M: torch.Tensor, consume: Callable[[torch.Tensor], None]) -> None:
    """``consume(∂obj/∂M)`` inside nnsight's backward context (``with obj.backward(): M.grad``): the
    gradient is used where it arrives, not saved (a saved value would live until the trace ends);
    the graph is kept for the next batch of targets and no parameter accumulates a ``.grad``."""
    with obj.backward(retain_graph=True, inputs=[M]):
        grad: torch.Tensor = M.grad  # type: ignore[assignment]  # served by nnsight as it arrives
        consume(grad.clone())  # a copy: autograd goes on accumulating into M.grad
    M.grad = None


def backward_rows(frozen: FrozenReplacement, M: torch.Tensor, scheduler: Any, batch_size: int,
                  backward: Callable[[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], None]], None]) -> None:
    """Inject one target per batch row (:meth:`FrozenReplacement.objective`), ``batch_size`` at a
    time, until ``scheduler`` has no more rows."""
    rows = scheduler.next_rows(batch_size)
    while rows:
        backward(frozen.objective(rows), M, functools.partial(_record, scheduler, rows))
        rows = scheduler.next_rows(batch_size)


def _record(scheduler: Any, rows: list[int], grad: torch.Tensor) -> None:
    scheduler.record(rows, grad[:len(rows)].detach())


def attribute_in_trace(model: Any, adapter: ArchitectureAdapter, layout: Layout, mhsa: dict[int, Any],
                       scheduler: Any, batch_size: int,
                       make: Callable[..., FrozenReplacement] = FrozenReplacement, remote: Any = False) -> torch.Tensor:
    """Run the frozen pass over ``batch_size`` copies of the prompt in one ``model.trace`` and fill
    ``scheduler`` (a :class:`RowScheduler`, or anything with ``next_rows``/``record``) with edge
    rows; returns the target values ``(n_targets,)`` of the frozen model. ``make(layout, M, mhsa)``
    builds the frozen forward (a subclass records other targets, e.g. :mod:`.qk`). ``remote`` is
    passed to ``model.trace`` (``True``: NDIF; ``"local"``: nnsight's serializing simulation): the
    scheduler then runs on the server and its rows come back as a saved value."""
    ids = layout.tokens[None].expand(batch_size, -1).to(model.device)
    with model.trace(ids, use_cache=False):
        M = torch.ones(batch_size, layout.n_sources, device=model.device, dtype=multiplier_dtype(model._module),
                       requires_grad=True)
        frozen = make(layout, M, mhsa)
        frozen_forward_body(model, adapter, frozen)
        T = frozen.targets()
        backward_rows(frozen, M, scheduler, batch_size, nnsight_backward)
        result = nnsight.save((T[0].detach(), scheduler.done, scheduler.rows))
    values, scheduler.done, scheduler.rows = result
    return values


def frozen_logits(model: Any, adapter: ArchitectureAdapter, layout: Layout, mhsa: dict[int, Any],
                  M: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits (batch, pos, vocab), targets (batch, n_targets))`` of the frozen replacement model
    with multipliers ``M`` (default: ones, batch 1) — with every multiplier 1 it is the model itself
    (error nodes included); raising ``M[b, s]`` by 1 adds source ``s``'s contribution once more, the
    intervention that checks an edge. The frozen constants come from a first forward with ``M = 1``."""
    constants: dict[str, torch.Tensor] = {}
    ones = torch.ones(1, layout.n_sources, dtype=multiplier_dtype(model._module))
    for mult in (ones, ones if M is None else M):
        ids = layout.tokens[None].expand(mult.shape[0], -1).to(model.device)
        with torch.no_grad(), model.trace(ids, use_cache=False):
            frozen = FrozenReplacement(layout, mult.to(model.device, ones.dtype), mhsa, constants)
            frozen_forward_body(model, adapter, frozen)
            logits = nnsight.save(model.get(adapter.lm_head_path).output)
            T = nnsight.save(frozen.targets())
    return logits, T
