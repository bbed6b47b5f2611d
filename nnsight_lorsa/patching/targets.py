"""What an intervention acts on: MHSA heads, Lorsa heads and SAE/transcoder features.

Targets are plain frozen dataclasses (hashable, usable as dict keys)::

    MHSAHead(layer=2, head=1)            # columns head*head_dim:(head+1)*head_dim of o_proj's input
    LorsaHead(layer=2, head=17)          # hook_z[..., 17] of LorsaSet.replace(2)
    Feature("model.layers.1", 5)         # SAE feature 5 at that site (hook_sae_acts_post)
    Feature(1, 5, kind="transcoder")     # transcoder feature 5 of layer 1's MLP

A :class:`Resolver` knows the model and its replacement sets; it validates targets before any
model runs (:meth:`Resolver.check`) and, inside a trace body, finds the tensor a target lives
in (:meth:`Resolver.location`). ``resolver(target)`` gives a :class:`Bound` target, which the
functions of :mod:`.interventions` take.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..adapters.base import ArchitectureAdapter
from ..adapters.registry import get_adapter
from ..errors import ConfigMismatchError, LayerOutOfRangeError, LorsaError, ShapeError

#: names of the attention output projection, per family (its input is per-head, head-major)
OUTPUT_PROJECTIONS = ("o_proj", "dense", "c_proj", "out_proj")


class TargetIndexError(LorsaError, IndexError):
    """A head or feature index is outside ``[0, n)`` of what it indexes."""


@dataclass(frozen=True)
class MHSAHead:
    """Head ``head`` of layer ``layer``'s multi-head self-attention."""

    layer: int
    head: int


@dataclass(frozen=True)
class LorsaHead:
    """Head ``head`` (an OV head, i.e. a column of ``hook_z``) of the Lorsa of ``layer``."""

    layer: int
    head: int


@dataclass(frozen=True)
class Feature:
    """Feature ``index`` of an SAE (``site`` a module path) or transcoder (``site`` a layer)."""

    site: str | int
    index: int
    kind: Literal["sae", "transcoder"] = "sae"


Target = MHSAHead | LorsaHead | Feature
Positions = int | slice | list | torch.Tensor | None


def positions_index(positions: Positions) -> Any:
    """The index along the position axis: all positions for None."""
    if positions is None:
        return slice(None)
    if isinstance(positions, torch.Tensor):
        return positions.tolist()
    return positions


@dataclass(frozen=True)
class Bound:
    """A validated target together with the :class:`Resolver` that finds it in a trace."""

    target: Target
    resolver: Resolver

    def location(self) -> tuple[Any, tuple]:
        return self.resolver.location(self.target)

    @property
    def width(self) -> int | None:
        return self.resolver.width(self.target)


class Resolver:
    """Validates targets against a model and its replacement sets, and locates them in a trace.

    Args:
        model: the nnsight model (root envoy).
        lorsa: a :class:`~nnsight_lorsa.LorsaSet` (for :class:`LorsaHead` targets).
        saes: an :class:`~nnsight_lorsa.SAESet` (for ``Feature(kind="sae")``).
        transcoders: a :class:`~nnsight_lorsa.TranscoderSet` (for ``Feature(kind="transcoder")``).
        error: splice Lorsas/SAEs/transcoders with their error term (default True), so that an
            unedited run reproduces the model and only the edit changes it.
    """

    def __init__(self, model: Any, *, lorsa: Any = None, saes: Any = None, transcoders: Any = None,
                 error: bool = True, adapter: ArchitectureAdapter | None = None) -> None:
        self.model = model
        self.adapter = adapter if adapter is not None else get_adapter(model)
        self.lorsa = lorsa
        self.saes = saes
        self.transcoders = transcoders
        self.error = error

    def __call__(self, target: Target) -> Bound:
        self.check(target)
        return Bound(target, self)

    def bind_all(self, targets: Iterable[Target]) -> list[Bound]:
        return [self(t) for t in targets]

    # ------------------------------------------------------------ validation
    def output_projection_path(self, layer: int) -> str:
        attn_path = self.adapter.attention_path(layer)
        attn = self.adapter.get_module(self.model._module, attn_path)
        for name in OUTPUT_PROJECTIONS:
            if isinstance(getattr(attn, name, None), torch.nn.Module):
                return f"{attn_path}.{name}"
        raise ConfigMismatchError(f"{attn_path} has none of the output projections {OUTPUT_PROJECTIONS}")

    def check(self, target: Any) -> None:
        """Raise if ``target`` does not exist in this model / these sets (nothing runs).

        Raises:
            LayerOutOfRangeError: the layer is outside the model, or the set has no module there.
            TargetIndexError: the head/feature index is outside its range.
            ConfigMismatchError: unknown SAE site, no set for the target's kind, unknown target type.
        """
        if isinstance(target, MHSAHead):
            self.adapter.check_layer(target.layer)
            self.output_projection_path(target.layer)
            _check_index(target.head, self.adapter.n_heads, f"MHSA head of layer {target.layer}")
        elif isinstance(target, LorsaHead):
            if self.lorsa is None:
                raise ConfigMismatchError(f"{target} needs a LorsaSet: Resolver(model, lorsa=...)")
            n = self.lorsa[target.layer].cfg.n_ov_heads  # LayerOutOfRangeError when missing
            _check_index(target.head, n, f"Lorsa head of layer {target.layer}")
        elif isinstance(target, Feature):
            n = self._coder(target).cfg.d_sae
            _check_index(target.index, n, f"{target.kind} feature at {target.site!r}")
        else:
            raise ConfigMismatchError(f"not an intervention target: {target!r}")

    def _coder(self, target: Feature) -> Any:
        if target.kind == "sae":
            if self.saes is None:
                raise ConfigMismatchError(f"{target} needs an SAESet: Resolver(model, saes=...)")
            return self.saes[target.site]
        if target.kind == "transcoder":
            if self.transcoders is None:
                raise ConfigMismatchError(f"{target} needs a TranscoderSet: Resolver(model, transcoders=...)")
            if not isinstance(target.site, int):
                raise LayerOutOfRangeError(f"a transcoder feature's site is a layer (int), got {target.site!r}")
            return self.transcoders[target.site]
        raise ConfigMismatchError(f"Feature kind must be 'sae' or 'transcoder', got {target.kind!r}")

    def width(self, target: Target) -> int | None:
        """Size of the last axis of one position's value: ``head_dim`` for MHSA heads, None (scalar) else."""
        return self.adapter.head_dim if isinstance(target, MHSAHead) else None

    def check_values(self, target: Target, values: torch.Tensor) -> None:
        """Raise :class:`ShapeError` if ``values`` cannot be one target's per-position value(s)."""
        if not isinstance(values, torch.Tensor):
            return
        width = self.width(target)
        if width is None:
            if values.ndim > 2:
                raise ShapeError(f"values for {target} are scalars per (batch, pos): got shape {tuple(values.shape)}")
        elif values.ndim == 0 or values.shape[-1] != width or values.ndim > 3:
            raise ShapeError(f"values for {target} must end in head_dim={width}: got shape {tuple(values.shape)}")

    # ------------------------------------------------------------ ordering
    def order(self, target: Target) -> tuple[float, float]:
        """Where the model computes ``target`` (layer, step): interventions in one trace body must
        run in this order (nnsight serves module values in execution order)."""
        if isinstance(target, MHSAHead):
            return (float(target.layer), 1.0)
        if isinstance(target, LorsaHead):
            return (float(target.layer), 1.5)
        if target.kind == "transcoder":
            return (float(target.site), 2.5)
        path = str(target.site)
        a = self.adapter
        if path == a.embed_path:
            return (-1.0, 0.0)
        m = re.match(rf"{re.escape(a.layers_path)}\.(\d+)(\.(.*))?$", path)
        if m is None:
            return (float(a.n_layers), 0.0)
        layer, sub = int(m.group(1)), m.group(3) or ""
        if path == a.attention_norm_path(layer):  # computed before the layer's attention
            return (float(layer), 0.5)
        if path == a.mlp_norm_path(layer):  # between the attention and the MLP
            return (float(layer), 2.0)
        step = 1.6 if sub.startswith(a.attention_name) else 2.6 if a.mlp_name and sub.startswith(a.mlp_name) else 3.0
        return (float(layer), step)

    def sort(self, targets: Iterable[Target]) -> list[Target]:
        return sorted(targets, key=self.order)

    # ------------------------------------------------------------ in a trace
    def prepare(self, targets: Iterable[Target]) -> None:
        """Inside a trace body, before any intervention: splice every Lorsa / SAE / transcoder the
        targets need. A Lorsa must be spliced before anything inside its attention is read (e.g. an
        MHSA head of the same layer); splicing is idempotent within one trace."""
        for t in self.sort(set(targets)):
            if isinstance(t, LorsaHead):
                self.lorsa.replace(t.layer, error=self.error)
            elif isinstance(t, Feature):
                (self.saes if t.kind == "sae" else self.transcoders).replace(t.site, error=self.error)

    def location(self, target: Target) -> tuple[Any, tuple]:
        """Inside a trace body: ``(tensor, index)`` such that ``tensor[index]`` is the target's value.

        MHSA heads: the output projection's input ``(batch, pos, n_heads*head_dim)`` and the head's
        columns; Lorsa heads: ``hook_z`` output and the head; features: ``hook_sae_acts_post``.
        The index is ``(..., positions?, cols)`` without the position axis; see :func:`index_at`.
        """
        if isinstance(target, MHSAHead):
            d = self.adapter.head_dim
            proj = resolve_envoy(self.model, self.output_projection_path(target.layer))
            return proj.input, (slice(target.head * d, (target.head + 1) * d),)
        if isinstance(target, LorsaHead):
            site = self.lorsa.replace(target.layer, error=self.error)
            return site.hook_z.output, (target.head,)
        coder_set = self.saes if target.kind == "sae" else self.transcoders
        site = coder_set.replace(target.site, error=self.error)
        return site.hook_sae_acts_post.output, (target.index,)


def resolve_envoy(root: Any, path: str) -> Any:
    """The envoy at dotted ``path`` below the nnsight root envoy."""
    envoy = root
    for part in path.split("."):
        envoy = getattr(envoy, part)
    return envoy


def index_at(cols: tuple, positions: Positions) -> tuple:
    """``(batch, positions, cols)`` index into a ``(batch, pos, …)`` tensor."""
    return (slice(None), positions_index(positions), *cols)


def _check_index(i: Any, n: int, what: str) -> None:
    if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n:
        raise TargetIndexError(f"{what} index {i!r} is out of range [0, {n})")
