"""The settings of one attribution, validated once: :class:`AttributionOptions`.

:func:`.attribute.attribute`, :func:`.attribute.build_graph`, :func:`.budget.estimate_memory` and the
intervened-pass handle (:mod:`.intervened`) take the same keyword arguments; each call funnels them into one
:class:`AttributionOptions`, whose construction is the only place they are checked. torch only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from ..errors import ArgumentError, ConfigMismatchError
from .replacement import memory_modes
from .scores import PruneConfig


def _count(value: Any, name: str, none_ok: bool = False) -> None:
    if none_ok and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise ArgumentError(f"attribute({name}=...) must be an int{' or None' if none_ok else ''}, got {value!r}")
    if value < 1:
        raise ConfigMismatchError(f"attribute({name}=...) must be >= 1, got {value}")


@dataclass(frozen=True)
class AttributionOptions:
    """Every setting of :func:`.attribute.attribute` but the replacement, the prompt and the tracer (each
    documented there), checked when the object is made; ``prune`` is kept as a :class:`~.scores.PruneConfig`
    (or None), ``memory`` as given (a ``(patterns, node_vectors)`` pair too: :func:`.replacement.memory_modes`).

    Raises:
        ArgumentError: a count that is not an int (``batch_size``, ``max_n_logits``, ``max_feature_nodes``
            and ``max_memory`` unless None), ``desired_logit_prob`` or ``zero_positions`` / ``qk_heads`` of the
            wrong type, a non-floating ``dtype``, ``remote`` other than a bool or ``"local"``, ``progress``
            other than a bool or None.
        ConfigMismatchError: a count below 1, ``desired_logit_prob`` outside ``(0, 1]``, negative
            ``zero_positions`` / ``qk_heads``, an unknown ``memory``, a bad ``prune``.
        TypeError: an unknown setting name (:meth:`of`).
    """

    max_feature_nodes: int | None = None
    batch_size: int = 64
    logit_tokens: Any = None
    desired_logit_prob: float = 0.95
    max_n_logits: int = 10
    memory: str | tuple[str, str] = "auto"
    prune: Any = None
    dtype: torch.dtype | None = None
    progress: bool | None = None
    remote: Any = False
    max_memory: int | None = None
    zero_positions: int = 0
    qk_heads: int = 0

    def __post_init__(self) -> None:
        _count(self.batch_size, "batch_size")
        _count(self.max_n_logits, "max_n_logits")
        _count(self.max_feature_nodes, "max_feature_nodes", none_ok=True)
        _count(self.max_memory, "max_memory", none_ok=True)
        p = self.desired_logit_prob
        if not isinstance(p, (int, float)) or isinstance(p, bool):
            raise ArgumentError(f"attribute(desired_logit_prob=...) must be a number, got {p!r}")
        if not 0.0 < p <= 1.0:
            raise ConfigMismatchError(f"attribute(desired_logit_prob=...) must be in (0, 1], got {p!r}")
        if self.dtype is not None and (not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point):
            raise ArgumentError(f"attribute(dtype=...) must be a floating torch dtype or None, got {self.dtype!r}")
        if not (isinstance(self.remote, bool) or self.remote == "local"):
            raise ArgumentError(f"attribute(remote=...) must be True, False or 'local', got {self.remote!r}")
        if self.progress is not None and not isinstance(self.progress, bool):
            raise ArgumentError(f"attribute(progress=...) must be True, False or None, got {self.progress!r}")
        for name in ("zero_positions", "qk_heads"):  # zero_positions' upper bound is the prompt's length (layout)
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise (ConfigMismatchError if name == "zero_positions" else ArgumentError)(
                    f"attribute({name}=...) must be an int, got {v!r}")
            if v < 0:
                raise ConfigMismatchError(f"attribute({name}=...) must be >= 0, got {v}")
        memory_modes(self.memory)
        object.__setattr__(self, "prune", PruneConfig.of(self.prune))

    @classmethod
    def of(cls, settings: dict[str, Any]) -> AttributionOptions:
        """The options of keyword ``settings`` (names as :func:`.attribute.attribute`'s).

        Raises:
            TypeError: a name that is not a setting (as a function call with an unknown keyword would).
            ArgumentError, ConfigMismatchError: as the class.
        """
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise TypeError(f"unknown attribution setting(s) {unknown}; the settings are {sorted(names)}")
        return cls(**settings)

    @property
    def modes(self) -> tuple[str, str]:
        """``(patterns, node_vectors)`` of the ``memory`` setting (:func:`.replacement.memory_modes`)."""
        return memory_modes(self.memory)
