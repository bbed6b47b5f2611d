"""Read values of the forward pass inside one ``model.trace``: the nnsight side of activation collection.

A :class:`Site` names a value: the ``"input"`` (hidden states the module is called with), the
``"output"`` (the tensor it returns, first element of a tuple) or the ``"positions"`` (token
positions of the call, for RoPE) of the module at an envoy path (``"model.layers.1.mlp"``).
:func:`read_sites` runs the model once on a batch of token ids and returns several sites' values,
reading them in execution order and stopping the trace after the last one, so later layers are
not computed (unless the model carries edits stored by ``model.edit()``, which nnsight replays in the trace:
then the pass runs to the end, for an edit past the sites). :func:`attention_activations` is the attention
input / output / positions of one layer (what a Lorsa reads and reconstructs). Envoys are looked up with
nnsight's ``Envoy.get``.

Used by training (:class:`~nnsight_lorsa.training.ActivationSource`, the activation cache),
``analysis/`` and ``viz/``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import nnsight
import torch
from torch import nn

from .._checks import check_instance
from .._typing import Float, Int
from ..adapters.base import ArchitectureAdapter
from ..adapters.registry import get_adapter
from ..errors import ActivationCacheError, ArgumentError
from .nnsight_internals import hf_module, stored_edits

_KINDS = ("input", "output", "positions")


@dataclass(frozen=True)
class Site:
    """A value in the forward pass of the module at envoy ``path`` (below the nnsight root).

    Attributes:
        path: dotted module path, e.g. ``"model.layers.2"`` or ``"model.layers.1.mlp"``.
        kind: ``"input"`` — the hidden states the module is called with (first positional argument,
            else the ``hidden_states`` keyword), ``(batch, pos, d)``; ``"output"`` — what it returns
            (the first element of a tuple), ``(batch, pos, d)``; ``"positions"`` — the token positions
            of the call (``position_ids`` / ``cache_position``, default ``arange(pos)``), ``(batch, pos)``
            or ``(pos,)``.

    Raises:
        ArgumentError: another ``kind`` or a ``path`` that is not a string (a ``ValueError`` too).

    Source: ours (reading sites of an nnsight trace; nnsight 0.8 envoys).
    """

    path: str
    kind: str = "output"

    def __post_init__(self) -> None:
        if not isinstance(self.path, str):
            raise ArgumentError(f"Site.path must be a dotted module path (str), got {self.path!r}")
        if not isinstance(self.kind, str) or self.kind not in _KINDS:
            raise ArgumentError(f"Site({self.path!r}).kind must be one of {_KINDS}, got {self.kind!r}")

    @classmethod
    def mlp_input(cls, adapter: ArchitectureAdapter, layer: int) -> Site:
        """What layer ``layer``'s MLP reads (after the pre-MLP norm): a transcoder's input.

        Raises:
            LayerOutOfRangeError: ``layer`` outside the model. ArgumentError: ``adapter`` not an
                :class:`ArchitectureAdapter` (``get_adapter(model)``; the same for every site constructor below).

        Source: ours (reading sites of an nnsight trace; nnsight 0.8 envoys).
        """
        _check_adapter(adapter, "Site.mlp_input")
        return cls(adapter.mlp_path(adapter.check_layer(layer)), "input")

    @classmethod
    def mlp_output(cls, adapter: ArchitectureAdapter, layer: int) -> Site:
        """What layer ``layer``'s MLP returns: a transcoder's target.

        Source: ours (reading sites of an nnsight trace; nnsight 0.8 envoys).
        """
        _check_adapter(adapter, "Site.mlp_output")
        return cls(adapter.mlp_path(adapter.check_layer(layer)), "output")

    @classmethod
    def attn_input(cls, adapter: ArchitectureAdapter, layer: int) -> Site:
        """What layer ``layer``'s attention reads (after the pre-attention norm): a Lorsa's input.

        Source: ours (reading sites of an nnsight trace; nnsight 0.8 envoys).
        """
        _check_adapter(adapter, "Site.attn_input")
        return cls(adapter.attention_path(adapter.check_layer(layer)), "input")

    @classmethod
    def attn_output(cls, adapter: ArchitectureAdapter, layer: int) -> Site:
        """What layer ``layer``'s attention returns (after the output projection): a Lorsa's target.

        Source: ours (reading sites of an nnsight trace; nnsight 0.8 envoys).
        """
        _check_adapter(adapter, "Site.attn_output")
        return cls(adapter.attention_path(adapter.check_layer(layer)), "output")

    @classmethod
    def attn_positions(cls, adapter: ArchitectureAdapter, layer: int) -> Site:
        """The token positions layer ``layer``'s attention is called with (RoPE).

        Source: ours (reading sites of an nnsight trace; nnsight 0.8 envoys).
        """
        _check_adapter(adapter, "Site.attn_positions")
        return cls(adapter.attention_path(adapter.check_layer(layer)), "positions")

    @classmethod
    def resid_post(cls, adapter: ArchitectureAdapter, layer: int) -> Site:
        """The residual stream after decoder layer ``layer`` (its output).

        Source: ours (reading sites of an nnsight trace; nnsight 0.8 envoys).
        """
        _check_adapter(adapter, "Site.resid_post")
        return cls(adapter.layer_path(adapter.check_layer(layer)), "output")


def _check_adapter(adapter: Any, where: str) -> None:
    """A site constructor's ``adapter``: an :class:`ArchitectureAdapter` (the model itself, a common slip, is refused
    with the remedy)."""
    check_instance(adapter, ArchitectureAdapter, where, "adapter", " (get_adapter(model))")


def site_value(envoy: Any, site: Site, adapter: ArchitectureAdapter) -> Any:
    """Inside a trace: the proxy of ``site``'s value at ``envoy`` (the envoy of ``site.path``)."""
    if site.kind == "output":
        out = envoy.output
        return out[0] if isinstance(out, (tuple, list)) else out
    args, kwargs = envoy.inputs
    x = adapter.mlp_input(args, kwargs)  # first positional argument / hidden_states
    return x if site.kind == "input" else adapter.attention_positions(args, kwargs, x)


def _execution_order(root: nn.Module) -> dict[tuple[str, str], int]:
    """Rank of each module's input (entered) and output (left) in a depth-first walk, children
    in registration order: the order in which a trace must read the sites."""
    order: dict[tuple[str, str], int] = {}

    def visit(module: nn.Module, prefix: str) -> None:
        order[(prefix, "input")] = len(order)
        for name, child in module.named_children():
            visit(child, f"{prefix}.{name}" if prefix else name)
        order[(prefix, "output")] = len(order)

    visit(root, "")
    return order


@torch.no_grad()
def read_sites(model: Any, sites: Mapping[str, Site], input_ids: Int[torch.Tensor, "batch pos"],
               attention_mask: torch.Tensor | None = None,
               adapter: ArchitectureAdapter | None = None) -> dict[str, torch.Tensor]:
    """The values of every site on ``input_ids`` from one ``model.trace`` (sites read in execution
    order; the trace stops after the last one, unless the model carries edits stored by ``model.edit()``: nnsight
    replays them in the trace, and one past the sites needs the rest of the forward pass):
    ``{name: (batch, pos, d)}`` (positions: ``(batch, pos)`` or ``(pos,)``). Names mapping to the same
    :class:`Site` share one tensor.

    Args:
        model: nnsight-wrapped model. sites: ``{name: Site}``. input_ids: ``(batch, pos)`` token ids.
        attention_mask: optional ``(batch, pos)``, 1 = real token. adapter: default ``get_adapter(model)``.

    Raises:
        ActivationCacheError: a site path that is not a module of the model.
    """
    adapter = get_adapter(model) if adapter is None else adapter
    order = _execution_order(hf_module(model))
    for name, s in sites.items():
        if (s.path, "input" if s.kind == "positions" else s.kind) not in order:
            raise ActivationCacheError(f"site {name!r}: {s.path!r} is not a module of the model")

    def rank(s: Site) -> tuple[int, int]:
        return order[(s.path, "input" if s.kind == "positions" else s.kind)], s.kind == "positions"

    inputs: dict[str, Any] = {"input_ids": input_ids}
    if attention_mask is not None:
        inputs["attention_mask"] = attention_mask
    saved: dict[Site, Any] = {}
    with model.trace(inputs, use_cache=False) as tracer:
        for s in sorted(set(sites.values()), key=rank):
            saved[s] = nnsight.save(site_value(model.get(s.path), s, adapter))
        if not stored_edits(model):  # edits stored by model.edit() run in this trace: one past the sites needs the rest
            tracer.stop()
    return {name: saved[s] for name, s in sites.items()}


@dataclass
class AttentionActivations:
    """One layer's attention activations on a batch of token ids.

    Attributes:
        x: ``(batch, pos, d_model)`` attention input hidden states (after the pre-attention norm).
        y: ``(batch, pos, d_model)`` attention output (after the output projection).
        positions: ``(batch, pos)`` or ``(pos,)`` token positions (for RoPE).
    """

    x: Float[torch.Tensor, "batch pos d_model"]
    y: Float[torch.Tensor, "batch pos d_model"]
    positions: Int[torch.Tensor, "..."]


@torch.no_grad()
def attention_activations(model: Any, layer: int, input_ids: Int[torch.Tensor, "batch pos"],
                          attention_mask: torch.Tensor | None = None,
                          adapter: ArchitectureAdapter | None = None) -> AttentionActivations:
    """Layer ``layer``'s attention input, output and positions from one ``model.trace`` that stops
    right after the attention (later layers are not computed).

    Raises:
        LayerOutOfRangeError: ``layer`` outside the model.
    """
    adapter = get_adapter(model) if adapter is None else adapter
    values = read_sites(model, {"x": Site.attn_input(adapter, layer), "y": Site.attn_output(adapter, layer),
                                "positions": Site.attn_positions(adapter, layer)},
                        input_ids, attention_mask, adapter)
    return AttentionActivations(**values)
