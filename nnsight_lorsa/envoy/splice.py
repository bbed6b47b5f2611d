"""Splice a replacement module into one site of a traced model, for the current trace only.

The shared mechanism behind ``LorsaSet.replace`` (attention), transcoders (MLP) and SAEs
(hook points). Called from inside a ``model.trace(...)`` body, :func:`splice`:

1. attaches the replacement module as a child of the site's module (``<site>.<name>``), so
   it and its :class:`HookPoint` children are envoys of this trace;
2. starts a per-trace worker (:mod:`.worker`) that parks on the site's input and output, calls
   the replacement *observed* (its internals are served to the trace body, which can read and
   edit them), and swaps the site's output for the replacement's;
3. with ``error=True`` adds the error term ``e = site_output − replacement_clean`` through the
   module's ``hook_error`` (the error node of attribution graphs, seed ``004_…`` §9.4):
   ``replacement_clean`` is the replacement computed with no edits, so without edits the
   site's output is reproduced (up to fp rounding) and edits to the internals still propagate;
4. detaches the module when the worker ends — after its swap, or when nnsight unwinds it
   because the trace raised. Nothing survives the trace: no hook, no child module, no controller.

Values are whole-batch (all invokes of the trace) like ``model.edit()``; reads from a trace
body are narrowed to its invoke's rows by nnsight as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from nnsight.intervention.source import STATE, Controller
from torch import nn

from .._repr import FieldsRepr
from ..errors import LorsaError, TraceOrderError
from .worker import current_worker, find_worker, spawn_worker


@dataclass(frozen=True, repr=False)
class SpliceSite(FieldsRepr):
    """Where and how a replacement is spliced.

    Attributes:
        site_path: envoy path (below the nnsight root) of the module whose output is replaced,
            e.g. ``"model.layers.3.self_attn"``.
        attach_name: child name the replacement is mounted under, e.g. ``"lorsa"``.
        call: ``(module, args, kwargs) -> Tensor``: run the replacement on the site's call
            inputs (``args``/``kwargs`` of the site module's call).
        get_output: the tensor to replace, from the site module's return value.
        set_output: the site's return value with that tensor replaced.
        check_call: optional ``(args, kwargs) -> None`` raising on unsupported calls.
    """

    site_path: str
    attach_name: str
    call: Callable[[nn.Module, tuple, dict], torch.Tensor]
    get_output: Callable[[Any], torch.Tensor]
    set_output: Callable[[Any, torch.Tensor], Any]
    check_call: Callable[[tuple, dict], None] | None = None


def resolve_envoy(root: Any, path: str) -> Any:
    """The envoy at dotted ``path`` below the nnsight root envoy."""
    envoy = root
    for part in path.split("."):
        envoy = getattr(envoy, part)
    return envoy


def _strip_nnsight(module: nn.Module) -> None:
    """Undo nnsight's per-module instrumentation (controller forward + state) on a detached module."""
    for sub in module.modules():
        if isinstance(sub.__dict__.get("forward"), Controller):
            del sub.__dict__["forward"]
        sub.__dict__.pop(STATE, None)


def _attach(site_envoy: Any, name: str, module: nn.Module) -> Any:
    existing = site_envoy._module._modules.get(name)
    if existing is not None and existing is not module:
        raise TraceOrderError(f"{site_envoy.path} already has a child module named {name!r}")
    if existing is None:
        setattr(site_envoy, name, module)
    return getattr(site_envoy, name)


def _detach(site_envoy: Any, name: str, module: nn.Module, instrumented_before: bool) -> None:
    if site_envoy._module._modules.get(name) is module:
        del site_envoy._module._modules[name]
        site_envoy._drop_envoy(name)
    if not instrumented_before:  # leave alone a module the user had wrapped by nnsight elsewhere
        _strip_nnsight(module)


def splice(root: Any, site: SpliceSite, module: nn.Module, *, error: bool = False) -> Any:
    """Replace ``site``'s output by ``module``'s for the current trace; return the module's envoy.

    Must be called inside a ``model.trace(...)`` body before the model reaches the site.
    Calling it again for the same site in the same trace (e.g. from a second invoke) returns
    the same envoy and splices once.

    Raises:
        ValueError: called outside a trace.
        TraceOrderError: the model already ran the site in this forward pass, or the site
            already holds a different child under ``site.attach_name``.
    """
    if error and not isinstance(getattr(module, "hook_error", None), nn.Module):
        raise LorsaError(f"{type(module).__name__} has no hook_error child module: it cannot carry an error term")
    me = current_worker("splice")
    interleaver = me.interleaver
    site_envoy = resolve_envoy(root, site.site_path)
    tag = ("nnsight_lorsa.splice", site.site_path, site.attach_name)
    if find_worker(interleaver, tag) is not None:
        return getattr(site_envoy, site.attach_name)
    location = f"{site_envoy.path}.input"
    if interleaver.counts.get(location, 0) - me.counts_at_start.get(location, 0) > 0:
        raise TraceOrderError(
            f"cannot replace {site.site_path}: the model already ran it in this forward pass; "
            "call replace() before reading anything at or after that site"
        )
    instrumented_before = STATE in module.__dict__
    envoy = _attach(site_envoy, site.attach_name, module)
    body = _make_body(site, module, site_envoy, interleaver, f"{envoy.path}.", error, instrumented_before)
    try:
        spawn_worker(interleaver, body, tag)
    except BaseException:
        _detach(site_envoy, site.attach_name, module, instrumented_before)
        raise
    return envoy


def _make_body(site: SpliceSite, module: nn.Module, site_envoy: Any, interleaver: Any, prefix: str,
               error: bool, instrumented_before: bool) -> Callable[[], None]:
    """The worker's body: park on the site's input and output, run the replacement, swap."""

    def body() -> None:
        try:
            args, kwargs = site_envoy.inputs
            if site.check_call is not None:
                site.check_call(args, kwargs)
            original = site_envoy.output
            true_out = site.get_output(original)
            clean = None
            # workers served alongside this one at the site's output may have parked since the
            # interleaver last indexed who waits where; re-index so the module's internals reach them
            interleaver._reindex_parked()
            if error and any(p is not None and p.startswith(prefix) for p in interleaver.parked):
                # some worker may edit the module's internals: the error term must come from
                # an unedited pass, run with this trace stood down (nothing served or edited)
                was = interleaver.interleaving
                interleaver.interleaving = False
                try:
                    clean = site.call(module, args, kwargs)
                finally:
                    interleaver.interleaving = was
            live = site.call(module, args, kwargs)  # observed: internals served to the trace
            if error:
                err = true_out - (live if clean is None else clean)
                live = live + module.get_submodule("hook_error")(err.detach())
            site_envoy.output = site.set_output(original, live)
        finally:
            _detach(site_envoy, site.attach_name, module, instrumented_before)

    return body
