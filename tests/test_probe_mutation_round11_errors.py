"""Mutation probe, round 11 (docs/reliability.md): the named errors' documented hierarchy and what their messages and
attributes carry. Each test was seen failing with a one-line mutant of ``errors.py`` that the default tests let
through. References: the documented rules (docs/reliability.md "Where the checks live": each named class "also
subclasses the built-in it stands for"; the classes' docstrings; docs/formats.md, docs/attribution.md) and Python's own
exceptions."""

from __future__ import annotations

import pytest

from nnsight_lorsa import errors

#: (class, a documented base) — each a rule a caller's ``except`` relies on, with where it is written
DOCUMENTED_BASES = [
    ("ArgumentError", TypeError),  # reliability.md: "`ArgumentError` is a `TypeError` and a `ValueError`"
    ("ArgumentError", ValueError),
    ("ShapeError", ValueError),  # reliability.md: "`ShapeError` / `CheckpointError` / `TooFewTokensError` are
    ("CheckpointError", ValueError),  # `ValueError`s"
    ("TooFewTokensError", ValueError),
    ("UnsupportedArchitectureError", NotImplementedError),  # reliability.md
    ("NotReadyError", RuntimeError),  # reliability.md; its docstring: "Still a ``RuntimeError``"
    ("LayerOutOfRangeError", IndexError),  # an index outside [0, n_layers): Python's IndexError (round 9, #41)
    ("SaveError", OSError),  # formats.md: "a `LorsaError` and an `OSError`"; docstring: "Still an ``OSError``"
    ("MemoryBudgetError", "ConfigMismatchError"),  # attribution.md: "`MemoryBudgetError` (a `ConfigMismatchError`)"
    ("ActivationCacheError", "CheckpointError"),  # a malformed cache is a malformed checkpoint (its docstring)
    ("VacuousConstraintError", "GateConfigError"),  # a sparse-attention setting (τ) that is invalid
    ("GateConfigError", ValueError),
    ("MissingDependencyError", ImportError),  # what `except ImportError` around an optional package expects
]


@pytest.mark.parametrize(("name", "base"), DOCUMENTED_BASES,
                         ids=[f"{n}-{b if isinstance(b, str) else b.__name__}" for n, b in DOCUMENTED_BASES])
def test_each_named_error_subclasses_what_the_docs_say_it_is(name, base):
    cls = getattr(errors, name)
    parent = getattr(errors, base) if isinstance(base, str) else base
    assert issubclass(cls, parent)
    assert issubclass(cls, errors.LorsaError)
    try:  # what callers write: the documented base catches it
        raise cls("x")
    except parent as e:
        assert type(e) is cls


def test_a_placement_error_is_a_config_mismatch_and_a_value_error_not_a_runtime_error():
    """``PlacementError`` is where a module or tensor cannot run (a device or dtype): a ``ConfigMismatchError`` ("a
    replacement module does not fit the model", the class it refines) and so a ``ValueError``; code that catches
    ``RuntimeError`` around a forward (CUDA errors) must not swallow it as one."""
    assert errors.PlacementError.__mro__[1] is errors.ConfigMismatchError
    assert issubclass(errors.PlacementError, ValueError)
    assert not issubclass(errors.PlacementError, RuntimeError)


def test_the_errors_with_attributes_keep_their_message_and_name_what_failed():
    """``NonFiniteError`` / ``RankFailedError`` / ``ServerVersionError``: "The message names the step and the
    tensor" — the message is the exception's text, and the attributes hold what was given, each under its own
    name (the client's version is the client's)."""
    e = errors.NonFiniteError("step 3: the loss is nan", step=3, tensor="loss")
    assert str(e) == "step 3: the loss is nan" and e.args == ("step 3: the loss is nan",)
    assert (e.step, e.tensor) == (3, "loss")
    r = errors.RankFailedError("rank 1 failed at step 2", step=2, ranks=[1])
    assert str(r) == "rank 1 failed at step 2" and (r.step, r.ranks) == (2, [1])
    s = errors.ServerVersionError("versions differ", "host:1", client_version="0.5.0", server_version="0.4.9")
    assert str(s) == "versions differ"
    assert (s.host, s.client_version, s.server_version) == ("host:1", "0.5.0", "0.4.9")
