"""Every private or internal nnsight name the package relies on (``nnsight_internals.PRIVATE_NAMES``) is
still there, with the kind it had in nnsight 0.8.1; a failure names ``nnsight.__version__`` and the name.

The instance attributes are checked on live instances: a tiny ``NNsight`` model (an envoy, its
interleaver), a fresh ``Mediator``, ``Batcher`` and ``RemoteBackend``, and a tracer after a trace."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import nnsight
import pytest
import torch
from torch import nn

from nnsight_lorsa._placement import torch_module
from nnsight_lorsa.envoy import nnsight_internals
from nnsight_lorsa.envoy.nnsight_internals import PRIVATE_NAMES, hf_module, is_envoy

KINDS = {"class", "callable", "property", "constant", "instance attribute", "local", "in source"}


def _resolve(dotted: str) -> Any:
    """The module, class or function at ``dotted`` (the longest importable module prefix, then attributes)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


def _instances() -> dict[str, Any]:
    """A live instance of each class whose instance attributes PRIVATE_NAMES names."""
    from nnsight.intervention.backends.remote import RemoteBackend
    from nnsight.intervention.batching import Batcher
    from nnsight.intervention.interleaver import Mediator

    model = nnsight.NNsight(nn.Linear(2, 2))
    with model.trace(torch.zeros(1, 2)) as tracer:
        pass
    return {
        "nnsight.intervention.envoy.Envoy": model,
        "nnsight.intervention.interleaver.Interleaver": model.interleaver,
        "nnsight.intervention.interleaver.Mediator": Mediator(None, {}, {}),
        "nnsight.intervention.batching.Batcher": Batcher(model),
        "nnsight.intervention.backends.remote.RemoteBackend": RemoteBackend("pin:model"),
        "nnsight.tracing.tracer.Tracer": tracer,
        "nnsight.tracing.tracer.Tracer.Info": tracer.info,
    }


@pytest.fixture(scope="module")
def instances():
    return _instances()


def _check(owner: str, name: str, kind: str, instances: dict[str, Any]) -> str | None:
    """None when ``owner``'s ``name`` is there as ``kind``, else what is wrong."""
    try:
        obj = _resolve(owner)
    except (ImportError, AttributeError) as e:
        return f"{owner} cannot be imported ({type(e).__name__}: {e})"
    if kind == "instance attribute":
        inst = instances[owner]
        assert isinstance(inst, obj), f"the test's instance for {owner} is a {type(inst).__name__}"
        try:  # static: an Envoy's __getattr__ would answer from the wrapped module
            inspect.getattr_static(inst, name)
        except AttributeError:
            return f"a {owner} instance has no attribute {name!r}"
        return None
    if kind == "local":
        code = getattr(obj, "__code__", None)
        return None if code is not None and name in code.co_varnames else f"{owner} has no local variable {name!r}"
    if kind == "in source":
        return None if name in inspect.getsource(obj) else f"{owner}'s source no longer spells {name!r}"
    try:
        static = inspect.getattr_static(obj, name)
    except AttributeError:
        return f"{owner} has no attribute {name!r}"
    value = getattr(obj, name)
    ok = {"class": isinstance(value, type),
          "callable": callable(value) and not isinstance(value, type),
          "property": isinstance(static, property),
          "constant": isinstance(value, str)}[kind]
    return None if ok else f"{owner}.{name} is no longer a {kind} (it is a {type(static).__name__})"


def test_the_list_is_well_formed():
    assert PRIVATE_NAMES, "PRIVATE_NAMES is empty"
    for owner, name, kind in PRIVATE_NAMES:
        assert owner.startswith("nnsight.") and name and kind in KINDS, (owner, name, kind)
    assert len(set(PRIVATE_NAMES)) == len(PRIVATE_NAMES), "an entry is listed twice"


@pytest.mark.parametrize(("owner", "name", "kind"), PRIVATE_NAMES, ids=[f"{o}.{n}" for o, n, _ in PRIVATE_NAMES])
def test_private_name_is_there(owner, name, kind, instances):
    problem = _check(owner, name, kind, instances)
    assert problem is None, (
        f"nnsight {nnsight.__version__}: {problem} — nnsight_lorsa relies on {owner} {name!r} ({kind}), "
        "checked against nnsight 0.8.1; update nnsight_lorsa/envoy/nnsight_internals.py (the one module "
        "that uses nnsight's private names) and its PRIVATE_NAMES")


def test_a_changed_name_fails_naming_the_version_and_the_name(instances):
    problem = _check("nnsight.intervention.envoy.Envoy", "_module_renamed", "instance attribute", instances)
    assert problem is not None and "_module_renamed" in problem
    assert _check("nnsight.intervention.interleaver.Interleaver", "_reindex_parked", "property", instances)
    assert _check("nnsight.intervention.nowhere", "x", "class", instances)


def test_the_private_uses_are_listed():
    """Each private name the module reads off nnsight's objects (``x._name`` or ``"_name"``) is in
    PRIVATE_NAMES: a new use must be listed, and so pinned."""
    import re

    source = inspect.getsource(nnsight_internals)
    used = set(re.findall(r"\.(_[a-z][a-z_]*)\b", source)) | set(re.findall(r"\"(_[a-z][a-z_]*)\"", source))
    used -= {"_modules"}  # torch's (nn.Module), not nnsight's
    listed = {name for _, name, _ in PRIVATE_NAMES}
    assert used and used <= listed, f"not in PRIVATE_NAMES: {sorted(used - listed)}"


def test_hf_module_and_the_public_route_agree():
    """``hf_module`` (``Envoy._module``) and ``_placement.torch_module`` (``envoy.get_submodule("")``, the
    route of the layers below envoy) give the same module; a plain module is its own."""
    linear = nn.Linear(2, 2)
    model = nnsight.NNsight(linear)
    assert hf_module(model) is linear and torch_module(model) is linear
    assert hf_module(linear) is linear and torch_module(linear) is linear
    assert is_envoy(model) and not is_envoy(linear)
    config = object()
    assert hf_module(config) is config and torch_module(config) is config
