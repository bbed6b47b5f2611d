"""The graph builder an intervened-pass handle calls when it was made without one (``attribute_pass``, or a record
from a server): :func:`.attribute.build_graph`, registered by the package (``attribution/__init__``).

:mod:`.intervened` is imported by :mod:`.attribute` and travels to a server by value inside a remote request, so
it can name the builder neither by an import (a cycle) nor as a global (the whole engine, whose modules NDIF's
unpickling whitelist refuses, would travel with it); it looks it up here, on the client, when ``.graph`` is read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_BUILDERS: list[Callable[..., Any]] = []


def register_builder(build: Callable[..., Any]) -> None:
    """Make ``build`` (``build(replacement, cache, live=..., options=...) -> Graph``) the registered builder."""
    _BUILDERS[:] = [build]


def graph_builder() -> Callable[..., Any]:
    """The registered builder: :func:`.attribute.build_graph`, registered when ``nnsight_lorsa.attribution`` is
    imported (always before any of its modules is).

    Raises:
        TraceOrderError: none is registered (this module used outside the package).
    """
    if not _BUILDERS:
        from ..errors import TraceOrderError

        raise TraceOrderError("no attribution graph builder is registered: import nnsight_lorsa.attribution")
    return _BUILDERS[0]
