"""Exceptions of the sparse-attention subpackage (all :class:`~nnsight_lorsa.errors.LorsaError`)."""

from __future__ import annotations

from ..errors import CheckpointError, LorsaError, UnsupportedArchitectureError

__all__ = ["CheckpointError", "GateConfigError", "GateNotInstalledError", "HeldoutConstraintWarning",
           "UnsupportedArchitectureError", "VacuousConstraintError"]


class GateConfigError(LorsaError, ValueError):
    """A gate setting is invalid (unknown mode, non-positive temperature, ``top_k < 1``, head count)."""


class HeldoutConstraintWarning(UserWarning):
    """A sparse-attention model met its CE constraint on the training windows but not on held-out ones
    (``train_sparse_attention(..., heldout=...)``; the summary's ``heldout_violation``)."""


class GateNotInstalledError(LorsaError, RuntimeError):
    """Gated attention ran (or was queried) on an attention module that carries no ``gate``."""


class VacuousConstraintError(GateConfigError):
    """The sparse-attention constraint ``CE <= τ`` holds from step 0 by a vacuous margin: the base
    model's CE on the training windows is more than ``max_initial_slack`` of it below τ (e.g. τ measured
    on other windows), so training would close gates with no check on CE."""
