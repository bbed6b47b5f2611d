"""Mount a module under a traced model's module for one trace, and take it off again.

A replacement module becomes an envoy of the running trace by being attached as a child of a
model module (nnsight mirrors it and instruments it with its controller); when its trace ends
it is detached and nnsight's per-module instrumentation is removed again, unless the module
already carried it before (a module the user wrapped elsewhere is left alone).
"""

from __future__ import annotations

from typing import Any

from nnsight.intervention.source import STATE, Controller
from torch import nn

from ..errors import TraceOrderError


def resolve_envoy(root: Any, path: str) -> Any:
    """The envoy at dotted ``path`` below the nnsight root envoy."""
    envoy = root
    for part in path.split("."):
        envoy = getattr(envoy, part)
    return envoy


def strip_nnsight(module: nn.Module) -> None:
    """Undo nnsight's per-module instrumentation (controller forward + state) on a detached module."""
    for sub in module.modules():
        if isinstance(sub.__dict__.get("forward"), Controller):
            del sub.__dict__["forward"]
        sub.__dict__.pop(STATE, None)


def attach(site_envoy: Any, name: str, module: nn.Module) -> Any:
    """Mount ``module`` as ``site_envoy.<name>`` and return its envoy (raises if the name is taken)."""
    existing = site_envoy._module._modules.get(name)
    if existing is not None and existing is not module:
        raise TraceOrderError(f"{site_envoy.path} already has a child module named {name!r}")
    if existing is None:
        setattr(site_envoy, name, module)
    return getattr(site_envoy, name)


def detach(site_envoy: Any, name: str, module: nn.Module, instrumented_before: bool) -> None:
    """Unmount ``module`` and, unless it was instrumented before :func:`attach`, strip nnsight's controllers."""
    if site_envoy._module._modules.get(name) is module:
        del site_envoy._module._modules[name]
        site_envoy._drop_envoy(name)
    # nnsight forgets the dropped envoy's own registration only; a descendant's (a hook point's)
    # would make the next trace that mounts the module alias the stale envoy (seen after
    # ``tracer.stop()``: OutOfOrderError on ``hook_z`` in the following trace)
    registry = site_envoy.interleaver.envoys
    prefix = f"{site_envoy.path}.{name}."
    for sub in module.modules():
        envoy = registry.get(id(sub))
        if envoy is not None and f"{envoy.path}.".startswith(prefix):
            del registry[id(sub)]
    if not instrumented_before:  # leave alone a module the user had wrapped by nnsight elsewhere
        strip_nnsight(module)
