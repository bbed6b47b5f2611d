"""Type checks of public arguments, shared by the entry points.

Of the standard library only ``operator``, ``math`` and ``collections.abc`` are imported: these run where the modules
run, an NDIF server included, whose deserializer admits whitelisted modules only (those three are, ``numbers`` is not:
``ndif_rules.module_allowed``); of the
package only :mod:`.errors` (the checks raise :class:`~.errors.ArgumentError`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Collection, Mapping
from typing import Any

from .errors import ArgumentError


def is_int(value: Any) -> bool:
    """An integer (Python or numpy: anything ``operator.index`` takes), never a bool."""
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("torch.bool", "bool"):  # (a 0-d bool tensor)
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def is_real(value: Any) -> bool:
    """A real number (Python int / float, or a numpy scalar of an integer or float dtype), never a bool."""
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    dtype = getattr(value, "dtype", None)
    return (type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0
            and getattr(dtype, "kind", "") in ("i", "u", "f"))


def is_collection(value: Any) -> bool:
    """A collection of items where a list is documented: a list, tuple, range, set, 1-D tensor or array — not a str
    or bytes (read as characters), a mapping, or a one-shot iterator (no length: checking it would consume it)."""
    return isinstance(value, Collection) and not isinstance(value, (str, bytes, Mapping))


def check_instance(value: Any, kind: type, where: str, name: str, hint: str = "") -> None:
    """Refuse ``value`` unless it is a ``kind``: the first check of an entry point whose argument ``name`` is read
    by its attributes (a ``Graph``, a ``PruneResult``), so that a tensor, None or arguments passed in the wrong
    order are a named error, not an ``AttributeError`` from deep inside.

    Raises:
        ArgumentError: naming ``where``, ``name``, the kind expected and the one given, then ``hint``.

    Source: ours (this package's entry points).
    """
    if not isinstance(value, kind):
        raise ArgumentError(f"{where}({name}=...) must be a {kind.__name__}, got a {type(value).__name__}{hint}")


def check_flag(value: Any, name: str, what: str) -> bool:
    """``value`` if it is a ``bool`` (``error=True``), else :class:`ArgumentError` naming ``what(name=...)`` (a
    ``"no"`` or a ``0`` would read as a truth value)."""
    if not isinstance(value, bool):
        raise ArgumentError(f"{what}({name}=...) must be True or False, got {value!r} ({type(value).__name__})")
    return value


def check_int(who: str, name: str, value: Any, *, least: int = 1) -> None:
    """``value`` an ``int`` (not a bool) ≥ ``least``, else :class:`ArgumentError` naming ``<who>.<name>``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        rule = "a positive int" if least == 1 else f"an int >= {least}"
        raise ArgumentError(f"{who}.{name} must be {rule}, got {value!r}")


def check_real(who: str, name: str, value: Any, *, positive: bool = False, upper: float | None = None,
               upper_open: bool = False, signed: bool = False) -> None:
    """``value`` a finite real number (int or float, not a bool), ``> 0`` if ``positive``, any sign if ``signed``,
    else ``≥ 0``, and at most ``upper`` (below it if ``upper_open``); else :class:`ArgumentError` naming
    ``<who>.<name>``."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ArgumentError(f"{who}.{name} must be a finite number, got {value!r}")
    if signed:
        return
    low_ok = value > 0 if positive else value >= 0
    high_ok = upper is None or (value < upper if upper_open else value <= upper)
    if not (low_ok and high_ok):
        lo = "(0" if positive else "[0"
        hi = "inf)" if upper is None else (f"{upper:g})" if upper_open else f"{upper:g}]")
        raise ArgumentError(f"{who}.{name} must be in {lo}, {hi}, got {value!r}")


#: the attribute a :class:`~nnsight_lorsa.training.trainer.Trainer` sets on the module it trains in place — its
#: working copy in the normalised training space (``(s_in, s_out)``); :meth:`~nnsight_lorsa.training.trainer.Trainer.
#: folded` gives the copy acting on raw activations, without it
TRAINING_SPACE = "_nnsight_lorsa_training_space"


def refuse_training_space(module: Any, where: str) -> None:
    """Refuse a module a Trainer is training in place (:data:`TRAINING_SPACE`): its weights act on normalised
    activations (``x · s_in -> y · s_out``), so spliced, evaluated or saved as it is it computes the wrong outputs
    without a word (a researcher's probe of 2026-11-30: a transcoder's FVU 0.887 / CE 4.362 where its folded copy's
    were 0.491 / 4.008).

    Raises:
        ArgumentError: names ``where``, the module and the scale factors, and points to ``trainer.folded()``.
    """
    scales = getattr(module, TRAINING_SPACE, None)
    if scales is not None:
        raise ArgumentError(
            f"{where}: this {type(module).__name__} is a Trainer's working module, trained in place in its normalised "
            f"space (inputs × s_in = {scales[0]:.4g}, outputs × s_out = {scales[1]:.4g}): on raw activations its "
            "outputs are wrong. Use trainer.folded() — a copy acting on raw activations — to splice, evaluate or "
            "save it")


def check_remote(value: Any, where: str) -> None:
    """``remote`` of a call that runs a trace: True (NDIF), False (here) or ``"local"`` (the remote code path run here).

    Raises:
        ArgumentError: anything else, naming ``where`` (a truthy str or number would send the trace remote).
    """
    if not (isinstance(value, bool) or value == "local"):
        raise ArgumentError(f"{where}(remote=...) must be True, False or 'local', got {value!r}")
