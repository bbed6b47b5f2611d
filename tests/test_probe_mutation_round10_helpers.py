"""Mutation probe, round 10 (``_checks.py``, the type checks of public arguments): each test here was seen failing
with a hand-made mutant and passing without (docs/reliability.md, "Mutation probe, round 10: architecture adapters,
SAELens releases and small helpers"). The reference is each function's documented rule."""

from __future__ import annotations

import pytest

from nnsight_lorsa._checks import is_int, is_real

np = pytest.importorskip("numpy")


def test_is_int_takes_python_and_numpy_integers_never_a_bool_a_float_or_a_string():
    for value in (0, -3, 7, np.int64(5), np.int32(-2), np.uint8(2)):
        assert is_int(value), value
    for value in (True, False, 1.0, 2.5, np.float64(2.0), "3", None, [1], np.array([1, 2])):
        assert not is_int(value), value


def test_is_real_takes_python_and_numpy_real_scalars_never_a_bool_an_array_or_a_complex():
    for value in (0, 3, -1.5, float("inf"), np.float32(0.5), np.float64(2.0), np.int64(3), np.uint16(4)):
        assert is_real(value), value
    for value in (True, np.bool_(True), np.bool_(False), np.array([1.0, 2.0]), np.array([[3]]), 1 + 2j,
                  np.complex64(1), "1.0", None, [1.0]):
        assert not is_real(value), value
