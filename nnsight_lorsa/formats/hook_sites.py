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

Loaded modules keep the site they were trained on (``cfg.extra[<format>]["site"]``, ``SAEConfig.hook``,
``TranscoderConfig.layer``); :func:`sae_site_path` and :func:`transcoder_layer` read it back so that
``SAESet.from_pretrained`` / ``TranscoderSet.from_pretrained`` attach each file where it belongs.
This module imports no loader (the loaders import it; format detection lives in :mod:`.registry`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigMismatchError, UnsupportedArchitectureError

__all__ = ["HookSite", "check_mlp_hooks", "sae_site_path", "site_record", "sparsify_hookpoint_site",
           "transcoder_layer", "transformer_lens_hook_site"]


@dataclass(frozen=True)
class HookSite:
    """Where a hook lives: ``layer``, ``site`` name, our ``module_path`` (None without an adapter or
    where no module boundary matches) and whether it is that module's ``"input"`` or ``"output"``."""

    layer: int
    site: str
    module_path: str | None
    io: str

    def as_dict(self) -> dict[str, Any]:
        """The record a loader keeps in ``cfg.extra[<format>]["site"]``."""
        return {"layer": self.layer, "site": self.site, "module_path": self.module_path, "io": self.io}


_TL = re.compile(r"^blocks\.([0-9]+)\.(.+)$")
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
    m = re.match(r"^(?:.*\.)?(?:layers|h)\.([0-9]+)(\.mlp)?$", hookpoint)
    if m is None:
        raise UnsupportedArchitectureError(
            f"sparsify hookpoint {hookpoint!r} has no site mapping; known: layers.<L>, layers.<L>.mlp")
    layer = int(m.group(1))
    if m.group(2) is None:
        return _site(layer, "resid_post", "layer", "output", adapter)
    if transcode:
        return _site(layer, "mlp_in", "mlp", "input", adapter)
    return _site(layer, "mlp_out", "mlp", "output", adapter)


def site_record(hook: Any, adapter: Any = None, *, sparsify_transcode: bool | None = None) -> dict[str, Any] | None:
    """:meth:`HookSite.as_dict` of a TransformerLens hook name (or, with ``sparsify_transcode`` set,
    a sparsify hookpoint); None for a non-string or a hook outside the module table."""
    if not isinstance(hook, str):
        return None
    try:
        if sparsify_transcode is None:
            return transformer_lens_hook_site(hook, adapter).as_dict()
        return sparsify_hookpoint_site(hook, transcode=sparsify_transcode, adapter=adapter).as_dict()
    except UnsupportedArchitectureError:
        return None


# ------------------------------------------------------------------ loaded modules -> sites
def _site_records(module: Any) -> list[dict[str, Any]]:
    """The site records a loader left in ``cfg.extra`` (what the module reconstructs first)."""
    extra = getattr(module.cfg, "extra", None) or {}
    out: list[dict[str, Any]] = []
    for fmt, keys in (("saelens", ("site",)), ("sparsify", ("site",)), ("llamascopium", ("site_out", "site_in"))):
        record = extra.get(fmt)
        if isinstance(record, dict):
            out.extend(record[k] for k in keys if isinstance(record.get(k), dict))
    return out


def _output_path(site: dict[str, Any], adapter: Any) -> str:
    """The module whose OUTPUT carries ``site`` (resid_pre of layer L = output of layer L−1 / the embedding)."""
    layer = site.get("layer")
    if site.get("site") == "resid_pre" and isinstance(layer, int):
        return str(adapter.layer_path(layer - 1) if layer > 0 else adapter.embed_path)
    if site.get("io") == "output" and site.get("module_path"):
        return str(site["module_path"])
    if site.get("io") == "output" and isinstance(layer, int) and site.get("site") in ("resid_post", "mlp_out"):
        return str(adapter.layer_path(layer) if site["site"] == "resid_post" else adapter.mlp_path(layer))
    raise ConfigMismatchError(f"the SAE reads site {site.get('site')!r} of layer {layer} (a module input); an "
                              "SAESet replaces module outputs: pass {site_path: checkpoint} explicitly")


def sae_site_path(module: Any, adapter: Any) -> str | None:
    """The module path (``adapter``'s naming) whose output a loaded SAE reconstructs, from the metadata
    its file carried (SAELens / llamascopium hook names, sparsify hookpoints, ``SAEConfig.hook``);
    None when the file says nothing.

    Raises:
        ConfigMismatchError: the file names a site that is not a module output (e.g. ``hook_mlp_in``).
    """
    records = _site_records(module)
    if records:
        return _output_path(records[0], adapter)
    hook = getattr(module.cfg, "hook", None)
    if not isinstance(hook, str) or not hook:
        return None
    if _TL.match(hook):
        site = transformer_lens_hook_site(hook, adapter)
        return _output_path({"layer": site.layer, "site": site.site, "module_path": site.module_path,
                             "io": site.io}, adapter)
    return hook


def transcoder_layer(module: Any) -> int | None:
    """The layer whose MLP a loaded transcoder replaces (``cfg.layer``, else the file's site record)."""
    layer = getattr(module.cfg, "layer", None)
    if isinstance(layer, int):
        return layer
    for site in _site_records(module):
        if isinstance(site.get("layer"), int):
            return int(site["layer"])
    return None


#: TransformerLens MLP-side hooks that are not the MLP module's call in a family with post-norms (Gemma-2):
#: ``ln2.hook_normalized`` is the pre-MLP norm before its ``(1 + weight)`` gain, ``hook_resid_mid`` the residual
#: before the norm, ``hook_mlp_out`` the output after ``post_feedforward_layernorm`` (circuit-tracer's Gemma-2
#: mapping; GemmaScope transcoders read and write these)
_POST_NORM_FOREIGN = {"feature_input_hook": ("ln2.hook_normalized", "hook_resid_mid"),
                      "feature_output_hook": ("hook_mlp_out",)}


def check_mlp_hooks(module: Any, adapter: Any) -> None:
    """Refuse a transcoder / CLT whose file says it reads or writes a tensor our MLP site does not carry, for a
    family with post-norms (``adapter.mlp_post_norm_path`` set: Gemma-2). Our MLP site is the MLP module's call
    (input after ``pre_feedforward_layernorm``'s gain, output before ``post_feedforward_layernorm``); circuit-tracer's
    Gemma-2 transcoders (GemmaScope) read ``ln2.hook_normalized`` and write ``hook_mlp_out`` (after the post-norm),
    recorded in ``cfg.extra["circuit_tracer"]`` by the loader. Modules without that record pass.

    Raises:
        UnsupportedArchitectureError: such a hook, naming it and the two sites.
    """
    record = (getattr(module.cfg, "extra", None) or {}).get("circuit_tracer")
    if not isinstance(record, dict) or adapter.mlp_post_norm_path(0) is None:
        return
    for key, foreign in _POST_NORM_FOREIGN.items():
        hook = record.get(key)
        if hook in foreign:
            raise UnsupportedArchitectureError(
                f"{adapter.family}: the {type(module).__name__} was trained with {key}: {hook!r}, which in "
                f"{adapter.family} is not the MLP module's {'input' if key == 'feature_input_hook' else 'output'}: "
                f"our MLP site is the {adapter.mlp_name!r} module's call (input: {adapter.mlp_norm_name}'s output, "
                f"gain included; output: before {adapter.mlp_post_norm_path(0)!r} and its peers); "
                "attaching it there would compute something it was not trained on (docs/adapters.md, Gemma-2)")
