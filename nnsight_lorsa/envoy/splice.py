"""Splice a replacement module into one site of a traced model, for the current trace only.

The shared mechanism behind ``LorsaSet.replace`` (attention), transcoders (MLP) and SAEs
(hook points). Called from inside a ``model.trace(...)`` body, :func:`splice`:

1. makes the replacement module an envoy of this trace at ``<site>.<name>`` (it and its
   :class:`HookPoint` children), without adding it to the model's modules
   (:func:`~.nnsight_internals.attach`: NDIF refuses ``setattr`` on the model's modules);
2. starts a per-trace worker (:mod:`.nnsight_internals`) that parks on the site's input and output, calls
   the replacement *observed* (its internals are served to the trace body, which can read and
   edit them), and swaps the site's output for the replacement's;
3. with ``error=True`` adds the error term ``e = site_output − replacement_clean`` through the
   module's ``hook_error`` (the error node of attribution graphs, Ameisen et al. 2025, *Circuit Tracing*: error nodes):
   ``replacement_clean`` is the replacement computed with no edits, so without edits the
   site's output is reproduced (up to fp rounding) and edits to the internals still propagate;
4. detaches the module when the worker ends — after its swap, or when nnsight unwinds it
   because the trace raised. Nothing survives the trace: no hook, no envoy, no controller.

Rows: inside ``tracer.invoke(...)`` the site is replaced for that invoke's rows only (the module computes on the
whole batch, the splice writes back the replaced rows: :func:`~.splice_chain.splice_chain`); reads from a trace
body are narrowed to its invoke's rows by nnsight as usual.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._repr import FieldsRepr
from .splice_chain import SpliceChain, splice_chain


@dataclass(frozen=True, repr=False)
class SpliceSite(FieldsRepr):
    """Where and how a replacement is spliced.

    Attributes:
        site_path: envoy path (below the nnsight root) of the module whose output is replaced,
            e.g. ``"model.layers.3.self_attn"``.
        attach_name: the name the replacement's envoy takes under the site, e.g. ``"lorsa"``.
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


def splice(root: Any, site: SpliceSite, module: nn.Module, *, error: bool = False) -> Any:
    """Replace ``site``'s output by ``module``'s for the current trace; return the module's envoy.

    Must be called inside a ``model.trace(...)`` body before the model reaches the site.
    Inside ``tracer.invoke(...)`` it replaces that invoke's rows; calling it again for the same site in the same
    trace (e.g. from another invoke) returns the same envoy, splices once and adds the caller's rows. A one-site
    :func:`~.splice_chain.splice_chain`, with the module mounted under the site's own module and its error term
    through ``module.hook_error``.

    Raises:
        TraceOrderError: called outside a trace.
        LorsaError: ``error=True`` and the module has no ``hook_error`` child.
        TraceOrderError: the model already ran the site in this forward pass, or the site
            already holds a different child under ``site.attach_name``.
    """
    def step(module: nn.Module, i: int, args: tuple, kwargs: dict, true_out: torch.Tensor, state: dict) -> torch.Tensor:
        return site.call(module, args, kwargs)

    chain = SpliceChain(
        site_paths=(site.site_path,), attach_path=site.site_path, attach_name=site.attach_name, step=step,
        get_output=site.get_output, set_output=site.set_output,
        error_hook=lambda module, i: module.get_submodule("hook_error"), check_call=site.check_call,
    )
    return splice_chain(root, chain, module, error=error)
