"""Every public name says where it comes from: a ``Source:`` line in its docstring (the standard: "Public
docstrings give shapes, units, dtypes/devices, errors and source").

The public API is every class and function in the ``__all__`` of the top level and of each public subpackage (and
of :mod:`nnsight_lorsa.remote`, :mod:`nnsight_lorsa.errors`), plus the public methods and properties those classes
define in this package. A method without a docstring of its own is judged by the one it inherits
(:func:`inspect.getdoc`), so documenting an override's base once covers it. ``Source:`` names a paper section, the
peer file mirrored, or ``ours`` with why.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

PUBLIC = ("nnsight_lorsa", "nnsight_lorsa.adapters", "nnsight_lorsa.analysis", "nnsight_lorsa.attribution",
          "nnsight_lorsa.envoy", "nnsight_lorsa.formats", "nnsight_lorsa.modules", "nnsight_lorsa.patching",
          "nnsight_lorsa.sparse_attention", "nnsight_lorsa.training", "nnsight_lorsa.viz", "nnsight_lorsa.remote",
          "nnsight_lorsa.errors")
SOURCE = re.compile(r"^\s*Source:\s*\S", re.MULTILINE)


def _ours(obj: Any) -> bool:
    return getattr(obj, "__module__", "").startswith("nnsight_lorsa")


def public_api() -> dict[str, Any]:
    """``{"module.qualname": object}`` for every public class and function, and the public methods and properties
    those classes define in this package."""
    found: dict[str, Any] = {}
    for package in PUBLIC:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)) or not _ours(obj):
                continue  # constants (FORMATS, DEFAULT_FORMAT, ...) carry no docstring of their own
            key = f"{obj.__module__}.{obj.__qualname__}"
            found[key] = obj
            if not inspect.isclass(obj):
                continue
            for attr, member in vars(obj).items():
                if attr.startswith("_"):
                    continue
                func = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
                if inspect.isfunction(func) and _ours(func):
                    found[f"{key}.{attr}"] = func
    return found


def test_public_api_is_found():
    api = public_api()
    assert "nnsight_lorsa.modules.lorsa.Lorsa" in api and "nnsight_lorsa.modules.lorsa.Lorsa.forward" in api
    assert len(api) > 400


def test_every_public_name_has_a_source_line():
    missing = sorted(key for key, obj in public_api().items() if not SOURCE.search(inspect.getdoc(obj) or ""))
    assert not missing, (f"{len(missing)} public names without a 'Source:' line in their docstring:\n"
                         + "\n".join(missing))
