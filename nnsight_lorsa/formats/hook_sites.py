"""Map other libraries' hook names onto our adapters' module sites.

TransformerLens / SAELens / circuit-tracer name activations ``blocks.{L}.<hook>``; EleutherAI
sparsify names Hugging Face submodules (``layers.{L}``, ``layers.{L}.mlp``). Our adapters
(:class:`~nnsight_lorsa.adapters.base.ArchitectureAdapter`) address modules by path:
``adapter.layer_path(L)`` (a decoder layer; its output is the residual stream after the block) and
``adapter.mlp_path(L)`` (its MLP; input = the normalised MLP input, output = the MLP output).

=================================================  ============  ==========================  ======
source hook                                        site          module path                 io
=================================================  ============  ==========================  ======
``blocks.L.hook_resid_post`` / sparsify ``layers.L``  resid_post  ``layer_path(L)``          output
``blocks.L.hook_resid_pre``                        resid_pre     ``layer_path(L)``           input
``blocks.L.ln2.hook_normalized``, ``hook_mlp_in``,
``mlp.hook_in``; sparsify transcoder ``layers.L.mlp``   mlp_in   ``mlp_path(L)``             input
``blocks.L.hook_mlp_out``, ``mlp.hook_out``;
sparsify SAE ``layers.L.mlp``                      mlp_out       ``mlp_path(L)``             output
``blocks.L.hook_resid_mid``                        resid_mid     none (pre-norm residual)    —
=================================================  ============  ==========================  ======
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedArchitectureError

__all__ = ["HookSite", "sparsify_hookpoint_site", "transformer_lens_hook_site"]


@dataclass(frozen=True)
class HookSite:
    """Where a hook lives: ``layer``, ``site`` name, our ``module_path`` (None without an adapter or
    where no module boundary matches) and whether it is that module's ``"input"`` or ``"output"``."""

    layer: int
    site: str
    module_path: str | None
    io: str


_TL = re.compile(r"^blocks\.(\d+)\.(.+)$")
_TL_SITES = {
    "hook_resid_post": ("resid_post", "layer", "output"),
    "hook_resid_pre": ("resid_pre", "layer", "input"),
    "ln2.hook_normalized": ("mlp_in", "mlp", "input"),
    "hook_mlp_in": ("mlp_in", "mlp", "input"),
    "mlp.hook_in": ("mlp_in", "mlp", "input"),
    "hook_mlp_out": ("mlp_out", "mlp", "output"),
    "mlp.hook_out": ("mlp_out", "mlp", "output"),
    "hook_resid_mid": ("resid_mid", "", "output"),
}


def _site(layer: int, site: str, where: str, io: str, adapter: Any) -> HookSite:
    path = None
    if adapter is not None and where:
        path = adapter.layer_path(layer) if where == "layer" else adapter.mlp_path(layer)
    return HookSite(layer, site, path, io)


def transformer_lens_hook_site(hook_name: str, adapter: Any = None) -> HookSite:
    """The site of a TransformerLens hook name (``blocks.3.hook_resid_post``; see the module table).

    Raises:
        UnsupportedArchitectureError: a hook name outside the table.
    """
    m = _TL.match(hook_name)
    if m is None or m.group(2) not in _TL_SITES:
        raise UnsupportedArchitectureError(
            f"hook {hook_name!r} has no site mapping; known: blocks.<L>.{{{', '.join(_TL_SITES)}}}")
    site, where, io = _TL_SITES[m.group(2)]
    return _site(int(m.group(1)), site, where, io, adapter)


def sparsify_hookpoint_site(hookpoint: str, *, transcode: bool, adapter: Any = None) -> HookSite:
    """The site of an EleutherAI sparsify hookpoint (``layers.3`` or ``layers.3.mlp``).

    For ``layers.L.mlp`` a transcoder reads the MLP input (site ``mlp_in``) and an SAE the MLP output.

    Raises:
        UnsupportedArchitectureError: another hookpoint.
    """
    m = re.match(r"^(?:.*\.)?(?:layers|h)\.(\d+)(\.mlp)?$", hookpoint)
    if m is None:
        raise UnsupportedArchitectureError(
            f"sparsify hookpoint {hookpoint!r} has no site mapping; known: layers.<L>, layers.<L>.mlp")
    layer = int(m.group(1))
    if m.group(2) is None:
        return _site(layer, "resid_post", "layer", "output", adapter)
    if transcode:
        return _site(layer, "mlp_in", "mlp", "input", adapter)
    return _site(layer, "mlp_out", "mlp", "output", adapter)
