"""Remote execution probe (2026-11-27): the client's reading of NDIF's rules against the server's own semantics.

- ``ndif_rules.module_allowed`` against an independent transcription of NDIF's ``WhitelistedModule.check`` and
  ``is_module_allowed`` (``src/ndif/services/ray/nn/security/whitelist.py`` at ``c7c84aac``, without that branch's
  "OPEN SANDBOX" standard-library allowance), on drawn dotted names;
- ``ndif_rules.pickled_modules`` / ``check_request`` against what an unpickler actually resolves -- ``find_class``
  and cloudpickle's ``subimport`` / ``dynamic_subimport``, the three hooks NDIF's ``Protector`` patches
  (``src/ndif/services/ray/nn/security/protector.py`` at ``b8950c97``) -- on drawn object graphs pickled by nnsight's
  own pickler at every protocol, and on the opcode forms Python's pickler does not emit for them (``INST``, a module
  name computed while unpickling, ``EXT`` codes from a client-side ``copyreg`` registry).

The loopback sweep (replace, internals, patching, sessions: remote saves equal the local run's) is
``test_probe_remote_workflows.py``.
"""

from __future__ import annotations

import contextlib
import copyreg
import io
import pickle
import pickletools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnsight_lorsa.ndif_rules import (
    NDIF_DESERIALIZATION_MODULES,
    NDIF_RUNTIME_MODULES,
    NotWhitelistedError,
    check_request,
    module_allowed,
    pickled_modules,
)


# ------------------------------------------------------------------ NDIF's entry semantics, transcribed independently
def _ndif_is_module_allowed(name: str, entries: tuple) -> bool:
    """NDIF's ``is_module_allowed(name, whitelist)`` = ``is_module_whitelisted`` (some entry's ``check``, which refuses
    that entry's own ``blocked_submodules`` first) and not ``is_module_blocked`` (the blocked names of *both* lists).
    Written from the server code, not from ``ndif_rules``."""

    def check(entry: tuple, n: str) -> bool:
        ename, strict, blocked = entry
        for b in blocked:
            if n == b or n.startswith(b + "."):
                return False
        if strict:
            return ename == n
        return ename == n or n.startswith(ename + ".")

    all_blocked = {b for _, _, bs in NDIF_DESERIALIZATION_MODULES for b in bs}
    blocked = any(name == b or name.startswith(b + ".") for b in all_blocked)
    return any(check(e, name) for e in entries) and not blocked


_PARTS = sorted({p for n, _, bs in NDIF_DESERIALIZATION_MODULES for m in (n, *bs) for p in m.split(".")}
                | {"x", "os", "pathlib", "torchvision", "nnsight_lorsa", "_thread", "abc", "operatorx"})
_names = st.lists(st.sampled_from(_PARTS), min_size=1, max_size=4).map(".".join)


@settings(max_examples=400, deadline=None)
@given(name=_names)
def test_module_allowed_is_ndifs_is_module_allowed(name: str) -> None:
    for entries in (NDIF_RUNTIME_MODULES, NDIF_DESERIALIZATION_MODULES):
        assert module_allowed(name, entries) == _ndif_is_module_allowed(name, entries), (name, len(entries))


# ------------------------------------------------------------------ what an unpickler resolves
class _Recorder(pickle._Unpickler):  # the pure-Python unpickler: find_class is the one hook, as on the server
    def __init__(self, data: bytes, seen: set[str]) -> None:
        super().__init__(io.BytesIO(data))
        self.seen = seen

    def find_class(self, module: str, name: str) -> Any:
        self.seen.add(module)
        return super().find_class(module, name)


def _resolved(data: bytes) -> set[str]:
    """The modules unpickling ``data`` resolves: every ``find_class`` module and every ``subimport`` /
    ``dynamic_subimport`` name (NDIF's three unpickling hooks); loading stops at the first failure."""
    import cloudpickle.cloudpickle as cp

    seen: set[str] = set()
    real_sub, real_dyn = cp.subimport, cp.dynamic_subimport

    def sub(name: str) -> Any:
        seen.add(name)
        return real_sub(name)

    def dyn(name: str, variables: Any) -> Any:
        seen.add(name)
        return real_dyn(name, variables)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cp, "subimport", sub)
        mp.setattr(cp, "dynamic_subimport", dyn)
        with contextlib.suppress(Exception):  # a crafted pickle may not load: what it resolved until then counts
            _Recorder(data, seen).load()
    return seen


def _values() -> st.SearchStrategy:
    import collections
    import datetime
    import decimal
    import fractions
    import functools
    import math
    import pathlib

    import torch

    def uses_fraction(x: float) -> Any:  # a function shipped by value: its module globals travel by subimport
        return fractions.Fraction(x) + math.sqrt(x)

    leaves = st.sampled_from([
        1, "s", 2.5, None, b"b", (1, 2),
        collections.OrderedDict(a=1), collections.Counter("aab"), torch.Size([2, 3]), functools.partial(max, 1),
        torch.float16, fractions.Fraction(1, 3), decimal.Decimal("1.5"), datetime.date(2026, 11, 27),
        pathlib.PurePosixPath("a/b"), uses_fraction, lambda x: math.floor(x) + collections.Counter([x])[x],
    ])
    return st.recursive(leaves, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2),
                                                                                              inner, max_size=3)
                        | st.tuples(inner, inner), max_leaves=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=_values(), protocol=st.integers(0, 5))
def test_pickled_modules_is_what_the_unpickler_resolves(obj: Any, protocol: int) -> None:
    """nnsight's pickler (cloudpickle underneath), any protocol: the opcodes read give exactly the modules the
    unpickler's hooks see, and ``check_request`` refuses exactly when one of them is outside NDIF's list."""
    from nnsight.intervention.serialization import dumps

    data = dumps(obj, protocol=protocol)
    resolved = _resolved(data)
    assert pickled_modules(data) == resolved
    refused = sorted(m for m in resolved if not module_allowed(m, NDIF_DESERIALIZATION_MODULES))
    if refused:
        with pytest.raises(NotWhitelistedError) as info:
            check_request(data)
        assert info.value.modules == refused
    else:
        assert check_request(data) == resolved


def _crafted() -> dict[str, bytes]:
    """Opcode forms Python 3's pickler does not emit for these objects, each resolving ``fractions`` (not on NDIF's
    list) when unpickled."""
    def s4(text: str) -> bytes:  # SHORT_BINUNICODE
        raw = text.encode()
        return b"\x8c" + bytes([len(raw)]) + raw

    getattr_ = s4("builtins") + s4("getattr") + b"\x93"
    return {
        # protocol 0/1 INST: "module\nname\n", the class called on the MARKed arguments (find_class first)
        "INST": b"(S'1/3'\nifractions\nFraction\n.",
        # STACK_GLOBAL whose module name is computed while unpickling: getattr("frac", "__add__")("tions")
        "computed STACK_GLOBAL": (b"\x80\x04" + getattr_ + s4("frac") + s4("__add__") + b"\x86R" + s4("tions")
                                  + b"\x85R" + s4("Fraction") + b"\x93" + s4("1/3") + b"\x85R."),
        # cloudpickle's subimport called on a computed name
        "computed subimport": (b"\x80\x04" + s4("cloudpickle.cloudpickle") + s4("subimport") + b"\x93" + getattr_
                               + s4("frac") + s4("__add__") + b"\x86R" + s4("tions") + b"\x85R" + b"\x85R."),
    }


@pytest.mark.parametrize("form", sorted(_crafted()))
def test_check_request_refuses_every_opcode_form_that_resolves_a_refused_module(form: str) -> None:
    data = _crafted()[form]
    pickletools.dis(data, out=io.StringIO())  # well formed
    assert "fractions" in _resolved(data)  # the unpickler does resolve it
    with pytest.raises(NotWhitelistedError):
        check_request(data)


@settings(max_examples=20, deadline=None)
@given(protocol=st.integers(2, 5), code=st.integers(1, 2**31 - 1))
def test_an_extension_code_of_the_clients_copyreg_registry_is_refused(protocol: int, code: int) -> None:
    """A class in the client's ``copyreg`` extension registry is pickled as an ``EXT`` code, which the server
    resolves in *its* registry (empty on CPython): whatever the client maps it to, NDIF would not unpickle it as the
    client meant. Refused before sending, even for a whitelisted class."""
    import collections

    from nnsight.intervention.serialization import dumps

    if code in copyreg._inverted_registry or ("collections", "OrderedDict") in copyreg._extension_registry:  # type: ignore[attr-defined]
        return  # taken in this process
    copyreg.add_extension("collections", "OrderedDict", code)
    try:
        data = dumps([collections.OrderedDict(a=1)], protocol=protocol)
    finally:
        copyreg.remove_extension("collections", "OrderedDict", code)
    assert any(op.name.startswith("EXT") for op, _, _ in pickletools.genops(data))
    with pytest.raises(NotWhitelistedError, match="extension code") as info:
        check_request(data)
    assert info.value.modules == [f"<copyreg extension code {code}>"]
