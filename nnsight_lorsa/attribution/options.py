"""The settings of one attribution, validated once: :class:`AttributionOptions`.

:func:`.attribute.attribute`, :func:`.engine.build_graph`, :func:`.budget.estimate_memory` and the
intervened-pass handle (:mod:`.intervened`) take the same keyword arguments; each call funnels them into one
:class:`AttributionOptions`, whose construction is the only place they are checked. torch only.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from .._checks import check_remote
from ..errors import ArgumentError, ConfigMismatchError
from .logit_targets import RENAMED, Targets, check_targets
from .replacement import memory_modes
from .scores import PruneConfig


def _count(value: Any, name: str, none_ok: bool = False) -> None:
    if none_ok and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise ArgumentError(f"attribute({name}=...) must be an int{' or None' if none_ok else ''}, got {value!r}")
    if value < 1:
        raise ConfigMismatchError(f"attribute({name}=...) must be >= 1, got {value}")


def refuse_renamed(settings: dict[str, Any], where: str) -> None:
    """Refuse keyword ``settings`` that are not settings of ``where`` (the function named in the error): an old
    spelling (:data:`.logit_targets.RENAMED`) with the new one, any other name as Python refuses an unknown keyword.

    Raises:
        ArgumentError: ``logit_tokens``, ``desired_logit_prob`` or ``max_n_logits`` (now ``targets=``); another
            name (a ``TypeError``, as Python refuses an unknown keyword).
    """
    old = sorted(set(settings) & set(RENAMED))
    if old:
        raise ArgumentError(f"{where}({old[0]}=...) is gone: the logit targets are one setting now, "
                            f"{RENAMED[old[0]]} (None: the top logits to cumulative probability 0.95, at most 10)")
    if settings:
        raise ArgumentError(f"{where}() got unexpected keyword argument(s) {sorted(settings)}")


@dataclass(frozen=True)
class AttributionOptions:
    """Every setting of :func:`.attribute.attribute` but the replacement, the prompt and the tracer (each
    documented there), checked when the object is made; ``prune`` is kept as a :class:`~.scores.PruneConfig`
    (or None), ``targets`` as :func:`.logit_targets.check_targets` returns it (None as ``LogitTargets()``,
    token ids or strings as a tuple), ``memory`` as given (a ``(patterns, node_vectors)`` pair too:
    :func:`.replacement.memory_modes`).

    Raises:
        ArgumentError: a count that is not an int (``batch_size``, ``update_interval``, ``max_feature_nodes``
            and ``max_memory`` unless None), ``targets`` or ``zero_positions`` / ``qk_heads`` of the wrong type
            (:func:`.logit_targets.check_targets`), a non-floating ``dtype``, ``remote`` other than a bool or
            ``"local"``, ``progress`` other than a bool or None; an old setting name (:meth:`of`).
        ConfigMismatchError: a count below 1, empty or negative ``targets``, negative ``zero_positions`` /
            ``qk_heads``, an unknown ``memory``, a bad ``prune``.
        TypeError: an unknown setting name (:meth:`of`).
    """

    max_feature_nodes: int | None = None
    batch_size: int = 64
    update_interval: int = 4
    targets: Targets = None
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
        _count(self.update_interval, "update_interval")
        _count(self.max_feature_nodes, "max_feature_nodes", none_ok=True)
        _count(self.max_memory, "max_memory", none_ok=True)
        object.__setattr__(self, "targets", check_targets(self.targets))
        if self.dtype is not None and (not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point):
            raise ArgumentError(f"attribute(dtype=...) must be a floating torch dtype or None, got {self.dtype!r}")
        check_remote(self.remote, "attribute")
        if self.progress is not None and not isinstance(self.progress, bool):
            raise ArgumentError(f"attribute(progress=...) must be True, False or None, got {self.progress!r}")
        for name in ("zero_positions", "qk_heads"):  # zero_positions' upper bound is the prompt's length (layout)
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ArgumentError(f"attribute({name}=...) must be an int, got {v!r}")
            if v < 0:
                raise ConfigMismatchError(f"attribute({name}=...) must be >= 0, got {v}")
        memory_modes(self.memory)
        object.__setattr__(self, "prune", PruneConfig.of(self.prune))

    @classmethod
    def of(cls, settings: dict[str, Any], where: str | None = None) -> AttributionOptions:
        """The options of keyword ``settings`` (names as :func:`.attribute.attribute`'s); ``where``: the function
        whose call they are (its name in the errors, an unknown name refused as that call would refuse it).

        Raises:
            ArgumentError: (a ``TypeError``) a name that is not a setting (as a function call with an unknown keyword
                would); an old setting name (:func:`refuse_renamed`); as the class.
            ConfigMismatchError: as the class.
        """
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - names)
        refuse_renamed({k: settings[k] for k in unknown if k in RENAMED or where is not None}, where or "attribute")
        if unknown:
            raise ArgumentError(f"unknown attribution setting(s) {unknown}; the settings are {sorted(names)}")
        return cls(**settings)

    @property
    def modes(self) -> tuple[str, str]:
        """``(patterns, node_vectors)`` of the ``memory`` setting (:func:`.replacement.memory_modes`)."""
        return memory_modes(self.memory)
