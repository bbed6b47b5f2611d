"""What an intervention acts on: MHSA heads, Lorsa heads and SAE/transcoder features.

Targets are plain frozen dataclasses (hashable, usable as dict keys)::

    MHSAHead(layer=2, head=1)            # columns head*head_dim:(head+1)*head_dim of o_proj's input
    LorsaHead(layer=2, head=17)          # hook_z[..., 17] of LorsaSet.replace(2)
    Feature("model.layers.1", 5)         # SAE feature 5 at that site (hook_sae_acts_post)
    Feature(1, 5, kind="transcoder")     # transcoder feature 5 of layer 1's MLP

A :class:`~.replacement_model.ReplacementModel` knows the model and its replacement sets; it
validates targets before any model runs (:meth:`~.replacement_model.ReplacementModel.check`) and,
inside a trace body, finds the tensor a target lives in
(:meth:`~.replacement_model.ReplacementModel.location`). ``replacement(target)`` gives a
:class:`Bound` target, which the interventions of :mod:`nnsight_lorsa.patching` take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from .._checks import is_int
from .._repr import FieldsRepr
from ..errors import LorsaError

#: an int field of a target: a Python int, or a numpy integer / 0-d integer tensor taken as its int (``__post_init__``)
IntLike = Any


def _ints(target: Any, *names: str) -> None:
    """Each field ``names`` of a frozen target that is an integer of another type (a numpy integer, a 0-d integer
    tensor such as ``z.argmax()``) as the Python int it is, so that equal targets are equal and hash alike; anything
    else is left for the checks (:func:`check_index`). Until 2026-11-30 ``LorsaHead(2, z.argmax())`` was refused as
    "index tensor(7) is out of range"."""
    for name in names:
        value = getattr(target, name)
        if not isinstance(value, int) and is_int(value):
            object.__setattr__(target, name, int(value))


class TargetIndexError(LorsaError, IndexError):
    """A head or feature index is outside ``[0, n)`` of what it indexes.

    Source: ours (intervention targets of this package; *From Tokenization to Attribution Graphs* §10).
    """


@dataclass(frozen=True, repr=False)  # FieldsRepr: no _thread in a request (NDIF's whitelist)
class MHSAHead(FieldsRepr):
    """Head ``head`` of layer ``layer``'s multi-head self-attention.

    Source: ours (intervention targets of this package; *From Tokenization to Attribution Graphs* §10).
    """

    layer: IntLike
    head: IntLike

    def __post_init__(self) -> None:
        _ints(self, "layer", "head")


@dataclass(frozen=True, repr=False)  # FieldsRepr: no _thread in a request (NDIF's whitelist)
class LorsaHead(FieldsRepr):
    """Head ``head`` (an OV head, i.e. a column of ``hook_z``) of the Lorsa of ``layer``.

    Source: ours (intervention targets of this package; *From Tokenization to Attribution Graphs* §10).
    """

    layer: IntLike
    head: IntLike

    def __post_init__(self) -> None:
        _ints(self, "layer", "head")


@dataclass(frozen=True, repr=False)  # FieldsRepr: no _thread in a request (NDIF's whitelist)
class Feature(FieldsRepr):
    """Feature ``index`` of an SAE (``site`` a module path) or transcoder (``site`` a layer).

    Source: ours (intervention targets of this package; *From Tokenization to Attribution Graphs* §10).
    """

    site: str | IntLike
    index: IntLike
    kind: Literal["sae", "transcoder"] = "sae"

    def __post_init__(self) -> None:
        _ints(self, "site", "index")


Target = MHSAHead | LorsaHead | Feature
Positions = int | slice | list | torch.Tensor | None


def positions_index(positions: Positions) -> Any:
    """The index along the position axis: all positions for None."""
    if positions is None:
        return slice(None)
    if isinstance(positions, torch.Tensor):
        return positions.tolist()
    return positions


@dataclass(frozen=True, repr=False)  # FieldsRepr: no _thread in a request (NDIF's whitelist)
class Bound(FieldsRepr):
    """A validated target together with the :class:`~.replacement_model.ReplacementModel` that finds
    it in a trace (typed ``Any`` here: the bundle imports this module, not the other way round).

    Source: ours (intervention targets of this package; *From Tokenization to Attribution Graphs* §10).
    """

    target: Target
    replacement: Any

    def location(self) -> tuple[Any, tuple]:
        """Inside a trace body: ``(tensor, index)`` with ``tensor[index]`` the target's value
        (:meth:`~.replacement_model.ReplacementModel.location`).

        Source: ours (intervention targets of this package; *From Tokenization to Attribution Graphs* §10).
        """
        return self.replacement.location(self.target)

    @property
    def width(self) -> int | None:
        """Size of the last axis of one position's value: ``head_dim`` for an MHSA head, None (a scalar) else.

        Source: ours (intervention targets of this package; *From Tokenization to Attribution Graphs* §10).
        """
        return self.replacement.width(self.target)


def index_at(cols: tuple, positions: Positions) -> tuple:
    """``(batch, positions, cols)`` index into a ``(batch, pos, …)`` tensor."""
    return (slice(None), positions_index(positions), *cols)


def check_index(i: Any, n: int, what: str) -> None:
    """Refuse an index ``i`` that is not an int (numpy / 0-d tensor integers are: :func:`~.._checks.is_int`) in
    ``[0, n)``, naming ``what``."""
    if not is_int(i):
        raise TargetIndexError(f"{what} index {i!r} must be an int in [0, {n}), got a {type(i).__name__}")
    if not 0 <= int(i) < n:
        raise TargetIndexError(f"{what} index {i!r} is out of range [0, {n})")
