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
``blocks.L.hook_mlp_out``, ``mlp.hook_out``      mlp_out       ``mlp_path(L)``, or         output
                                                                 ``mlp_post_norm_path(L)``
                                                                 (Gemma-2/3, OLMo-2)
sparsify SAE ``layers.L.mlp``                      mlp_out       ``mlp_path(L)``             output
``blocks.L.hook_attn_out``                         attn_out      ``attention_path(L)``, or   output
                                                                 ``attention_post_norm_path(L)``
                                                                 (Gemma-2/3, OLMo-2)
``blocks.L.hook_resid_mid``                        resid_mid     none (pre-norm residual)    —
=================================================  ============  ==========================  ======

Transcoder / CLT files (circuit-tracer's hooks, or a SAELens / llamascopium / sparsify file's hook names:
:func:`hook_record`) are stricter: :func:`check_mlp_hooks` accepts ``ln2.hook_normalized`` where
the pre-MLP norm has gain 1 and no bias (it is then the MLP input) or is an RMSNorm or a LayerNorm (``x / rms(x)``,
``(x − mean x) / σ(x)``, computed from the norm's input as the norm does: GemmaScope on Gemma-2, GPT-2 transcoders),
``hook_mlp_out`` everywhere (the MLP output; on
Gemma-2/3 ``post_feedforward_layernorm``'s output), and ``hook_resid_mid`` (the residual before the pre-MLP norm)
where the family has one; :func:`mlp_site_io` says which module's call the sets then read and which output they
replace.

Loaded modules keep the site they were trained on (``cfg.extra[<format>]["site"]``, ``SAEConfig.hook``,
``TranscoderConfig.layer``); :func:`sae_site_path` and :func:`transcoder_layer` read it back so that
``SAESet.from_pretrained`` / ``TranscoderSet.from_pretrained`` attach each file where it belongs.
This module imports no loader (the loaders import it; format detection lives in :mod:`.registry`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .._repr import FieldsRepr
from ..adapters.base import norm_gain
from ..errors import ConfigMismatchError, UnsupportedArchitectureError
from .validate import refuse

__all__ = ["ATTENTION_NORMALIZED_HOOK", "ATTENTION_OUTPUT_HOOK", "ATTENTION_SITE", "MLP_INPUT_HOOKS", "MLP_IN_HOOK",
           "MLP_OUTPUT_HOOKS", "RESID_MID_HOOK", "CENTRED_HOOKS", "HookSite", "MLPSiteIO", "centre_residual_input_",
           "attention_norm_unfolded", "check_lorsa_hooks", "check_mlp_hooks", "check_sae_record",
           "fold_attention_norm_", "has_resid_mid", "hook_record", "lorsa_reads_attention_input", "mlp_site_io",
           "layer_normalized", "rms_normalized", "sae_site_path", "site_record", "sparsify_hookpoint_site",
           "transcoder_layer", "trained_centred", "transformer_lens_hook_site", "writes_centred"]


@dataclass(frozen=True, repr=False)
class HookSite(FieldsRepr):
    """Where a hook lives: ``layer``, ``site`` name, our ``module_path`` (None without an adapter or
    where no module boundary matches) and whether it is that module's ``"input"`` or ``"output"``. Shipped by value
    where a set checks an SAE's record on a server (``repr=False``: a dataclass's generated ``__repr__`` names
    ``_thread``, outside NDIF's unpickling whitelist)."""

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
    "hook_attn_out": ("attn_out", "attention", "output"),
}


def _mlp_out_path(layer: int, adapter: Any, transformer_lens: bool) -> str:
    """The module whose output is layer ``layer``'s MLP output: TransformerLens's ``hook_mlp_out`` is taken after
    the post-MLP norm where the family has one (Gemma-2/3, OLMo-2: ``ln2_post`` runs before the hook, "that which is
    added to the residual stream"), a sparsify hookpoint is the Hugging Face MLP module itself."""
    post_norm = getattr(adapter, "mlp_post_norm_path", None)  # (an adapter-like object may have no post-norms)
    post = post_norm(layer) if transformer_lens and post_norm is not None else None
    return str(post or adapter.mlp_path(layer))


def _attn_out_path(layer: int, adapter: Any) -> str:
    """The module whose output is TransformerLens's ``blocks.L.hook_attn_out``: the attention module's, or the
    post-attention norm's where the family has one (Gemma-2/3, OLMo-2: "that which is added to the residual
    stream", as ``hook_mlp_out``)."""
    post_norm = getattr(adapter, "attention_post_norm_path", None)
    return str((post_norm(layer) if post_norm is not None else None) or adapter.attention_path(layer))


def _site(layer: int, site: str, where: str, io: str, adapter: Any, transformer_lens: bool = False) -> HookSite:
    path = None
    if adapter is not None and where:
        if where == "layer":
            path = adapter.layer_path(layer)
        elif site == "mlp_out":
            path = _mlp_out_path(layer, adapter, transformer_lens)
        elif site == "attn_out":
            path = _attn_out_path(layer, adapter)
        else:
            path = adapter.mlp_path(layer)
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
    return _site(int(m.group(1)), site, where, io, adapter, transformer_lens=True)


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
    """The site records a loader left in ``cfg.extra`` (what the module reconstructs first), each with
    ``"transformer_lens"``: whether it came from a TransformerLens hook name (SAELens, llamascopium) rather than a
    sparsify hookpoint (a Hugging Face module name)."""
    extra = getattr(module.cfg, "extra", None) or {}
    out: list[dict[str, Any]] = []
    for fmt, keys in (("saelens", ("site",)), ("sparsify", ("site",)), ("llamascopium", ("site_out", "site_in"))):
        record = extra.get(fmt)
        if isinstance(record, dict):
            out.extend({**record[k], "transformer_lens": fmt != "sparsify"} for k in keys
                       if isinstance(record.get(k), dict))
    return out


def _output_path(site: dict[str, Any], adapter: Any) -> str:
    """The module whose OUTPUT carries ``site`` (resid_pre of layer L = output of layer L−1 / the embedding)."""
    layer = site.get("layer")
    if site.get("site") == "resid_pre" and isinstance(layer, int):
        return str(adapter.layer_path(layer - 1) if layer > 0
               else getattr(adapter, "residual_start_path", adapter.embed_path))
    if site.get("io") == "output" and isinstance(layer, int) and site.get("site") == "mlp_out":
        return _mlp_out_path(layer, adapter, bool(site.get("transformer_lens", True)))
    if site.get("io") == "output" and isinstance(layer, int) and site.get("site") == "attn_out":
        return _attn_out_path(layer, adapter)
    if site.get("io") == "output" and site.get("module_path"):
        return str(site["module_path"])
    if site.get("io") == "output" and isinstance(layer, int) and site.get("site") == "resid_post":
        return str(adapter.layer_path(layer))
    raise ConfigMismatchError(f"the SAE reads site {site.get('site')!r} of layer {layer}, a module's input that no "
                              "module output of this model carries; an SAESet replaces module outputs, so it cannot "
                              "run this SAE where it was trained (at another site it would reconstruct another "
                              "tensor)")


#: TransformerLens hooks that are a module's input with no module output carrying them (``attn.hook_z``: the
#: concatenated per-head values, the output projection's input)
_MODULE_INPUT_ONLY_HOOKS = ("attn.hook_z",)


def sae_site_path(module: Any, adapter: Any) -> str | None:
    """The module path (``adapter``'s naming) whose output a loaded SAE reconstructs, from the metadata
    its file carried (SAELens / llamascopium hook names, sparsify hookpoints, ``SAEConfig.hook``);
    None when the file says nothing.

    Raises:
        ConfigMismatchError: the file names a site that is not a module output (e.g. ``hook_mlp_in``), or
            one head's slice of it (SAELens ``metadata.hook_head_index``).
    """
    saelens = (getattr(module.cfg, "extra", None) or {}).get("saelens")
    if isinstance(saelens, dict) and saelens.get("hook_head_index") is not None:
        raise ConfigMismatchError(
            f"the SAE reads head {saelens['hook_head_index']!r} of hook {saelens.get('hook_name')!r} (SAELens "
            "metadata.hook_head_index), a slice of a tensor that no module output of this model carries; an SAESet "
            "cannot run it where it was trained")
    named = _recorded_hook(module, _OUTPUT_HOOK_KEYS) or getattr(module.cfg, "hook", None)
    if _tl_suffix(named) in _MODULE_INPUT_ONLY_HOOKS:
        raise ConfigMismatchError(
            f"the SAE reads {named!r}, the per-head values that the attention's output projection reads (its input, "
            "no module output of this model); an SAESet replaces module outputs, so it cannot run this SAE where "
            "it was trained")
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


def check_sae_record(module: Any, adapter: Any) -> None:
    """Refuse an SAE whose file records a tensor that no module output carries — a module's input
    (``hook_resid_mid``, ``hook_mlp_in``, ``attn.hook_z``, …) or one head's slice — wherever a set is asked to put
    it: at any module output it would reconstruct another tensor. A hook name without a site mapping
    (``mlp.hook_post``, …) and a recorded site other than the key (an SAE moved on purpose) pass.

    Raises:
        ConfigMismatchError: as :func:`sae_site_path`.
    """
    try:
        sae_site_path(module, adapter)
    except UnsupportedArchitectureError:
        return  # no mapping for its hook name: the key the caller gives says where it runs


def transcoder_layer(module: Any) -> int | None:
    """The layer whose MLP a loaded transcoder replaces (``cfg.layer``, else the file's site record)."""
    layer = getattr(module.cfg, "layer", None)
    if isinstance(layer, int):
        return layer
    for site in _site_records(module):
        if isinstance(site.get("layer"), int):
            return int(site["layer"])
    return None


#: circuit-tracer's ``feature_input_hook`` / ``feature_output_hook`` values that carry our MLP site (the MLP
#: module's call) in every family: its ``ReplacementMLP.hook_in`` / ``hook_out`` (TransformerLens backend) and its
#: nnsight mapping's ``mlp.hook_in`` = the pre-MLP norm's output (gain included), ``mlp.hook_out`` = the MLP's output
#: (``utils/tl_nnsight_mapping.py``). Not ``hook_mlp_in``: TransformerLens's (legacy ``components/
#: transformer_block.py``: ``ln2(hook_mlp_in(resid_mid))``; 3.9's ``BlockBridge``: "pre-ln2") is the residual the
#: pre-MLP norm reads, :data:`MLP_IN_HOOK`
MLP_INPUT_HOOKS = ("mlp.hook_in",)
MLP_OUTPUT_HOOKS = ("mlp.hook_out",)
#: ``ln2.hook_normalized`` (the pre-MLP norm's ``x / rms`` or ``(x − mean) / std``, before its gain and bias) is the
#: MLP input where that norm's gain is all ones and its bias zero, else computed from the norm's input where the norm
#: is an RMSNorm or a LayerNorm (:func:`rms_normalized`, :func:`layer_normalized`);
#: ``hook_mlp_out`` is the MLP output in a family without post-norms, and
#: ``post_feedforward_layernorm``'s output on Gemma-2/3 (:func:`mlp_site_io`). Every other hook (``hook_resid_pre`` /
#: ``hook_resid_post``; anything unknown) is not our MLP site; ``hook_resid_mid`` is the pre-MLP norm's input.
NORMALIZED_HOOK = "ln2.hook_normalized"
POST_NORM_OUTPUT_HOOK = "hook_mlp_out"


RESID_MID_HOOK = "hook_resid_mid"
#: TransformerLens's ``hook_mlp_in``: the input of the pre-MLP norm — ``resid_mid``, under GPT-NeoX's parallel residual
#: ``resid_pre`` (the layer's input, which its pre-MLP norm reads), the MLP's own input without a pre-MLP norm (OLMo-2)
MLP_IN_HOOK = "hook_mlp_in"


def has_resid_mid(adapter: Any) -> bool:
    """Whether the family has a residual stream between the attention and the MLP, the input of the pre-MLP norm
    (TransformerLens ``hook_resid_mid``): every supported family but GPT-NeoX with ``use_parallel_residual``."""
    return not bool(getattr(adapter.config, "use_parallel_residual", False))


def _tl_suffix(hook: Any) -> Any:
    """``ln2.hook_normalized`` of ``blocks.3.ln2.hook_normalized``; anything else unchanged."""
    m = _TL.match(hook) if isinstance(hook, str) else None
    return hook if m is None else m.group(2)


def _extra(module: Any) -> dict[str, Any]:
    """``cfg.extra`` of a replacement module (a :class:`~nnsight_lorsa.modules.clt.CLTLayer`'s: its CLT's), or
    ``{}``."""
    extra = getattr(getattr(module, "clt", module).cfg, "extra", None)
    return extra if isinstance(extra, dict) else {}


#: a SAELens ``hf_hook_name`` that is the MLP module's input (Gemma-2/3's pre-MLP norm's output)
_HF_MLP_INPUT_SUFFIX = ".pre_feedforward_layernorm.output"


def hook_record(module: Any) -> dict[str, Any]:
    """The hook record of a transcoder / CLT (a :class:`~nnsight_lorsa.modules.clt.CLTLayer`'s through its
    ``clt``): circuit-tracer's ``feature_input_hook`` / ``feature_output_hook``, else the same keys from the hook
    names its file recorded (llamascopium ``hook_point_in`` / ``hook_point_out``, SAELens ``hook_name`` /
    ``hook_name_out``, a sparsify hookpoint that is no MLP) without their ``blocks.L.`` prefix, so that
    :func:`check_mlp_hooks` and :func:`mlp_site_io` place them by what they name; empty without any."""
    extra = _extra(module)
    record = extra.get("circuit_tracer")
    if isinstance(record, dict):
        return record
    llamascopium, saelens, sparsify = (extra.get(k) for k in ("llamascopium", "saelens", "sparsify"))
    if isinstance(llamascopium, dict) and llamascopium.get("hook_point_in") != llamascopium.get("hook_point_out"):
        return {"feature_input_hook": _tl_suffix(llamascopium.get("hook_point_in")),
                "feature_output_hook": _tl_suffix(llamascopium.get("hook_point_out"))}
    if isinstance(saelens, dict) and isinstance(saelens.get("hook_name"), str):
        out = saelens.get("hook_name_out")
        hook_in = _tl_suffix(saelens["hook_name"])
        if str(saelens.get("hf_hook_name", "")).endswith(_HF_MLP_INPUT_SUFFIX):
            # the Hugging Face tensor it was trained on, where SAELens's TransformerLens name says another: GemmaScope-2
            # transcoders (conversion_func gemma_3) name hook_mlp_in (the residual before the norm) and record
            # pre_feedforward_layernorm.output, the MLP's input (pretrained_sae_loaders.py)
            hook_in = MLP_INPUT_HOOKS[0]
        return {"feature_input_hook": hook_in,
                **({"feature_output_hook": _tl_suffix(out)} if isinstance(out, str) and out else {})}
    hookpoint = sparsify.get("hookpoint") if isinstance(sparsify, dict) else None
    # a sparsify transcoder reads its hookpoint's input: the MLP's for layers.L.mlp (sparsify_hookpoint_site), else
    # (a whole layer, an unknown module) no MLP site. No HookSite here: its dataclass repr names _thread, which NDIF's
    # unpickler refuses where this runs shipped by value (MLPSiteIO)
    if isinstance(hookpoint, str) and not re.match(r"^(?:.*\.)?(?:layers|h)\.[0-9]+\.mlp$", hookpoint):
        return {"feature_input_hook": hookpoint}
    return {}


def rms_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` before any gain, as transformers' RMSNorms compute it: ``x`` cast to fp32, times
    ``rsqrt(mean(x²) + eps)`` (``Gemma2RMSNorm._norm(x.float())``, ``LlamaRMSNorm``'s first lines); fp32, ``x``'s
    shape and device. TransformerLens's ``ln2.hook_normalized`` divides by ``sqrt(mean(x²) + eps)`` (within an ulp)."""
    x = x.to(torch.float32)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def layer_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x − mean x) / σ(x)`` before any gain and bias, as a LayerNorm computes it (``σ² = mean((x − mean x)²) +
    eps``, the biased variance; ``torch.nn.functional.layer_norm`` without weights), in fp32 (fp64 kept); ``x``'s
    shape and device. TransformerLens's ``ln2.hook_normalized`` on a LayerNorm model (``LayerNormPre`` after
    ``fold_ln``, or ``LayerNorm`` before its ``w``/``b``) is this tensor."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    xc = x - x.mean(-1, keepdim=True)
    return xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)


def _normalizing(norm: Any) -> tuple[float, bool] | None:
    """``(eps, centre)`` of a norm whose input before the gain :class:`MLPSiteIO` can compute: an RMSNorm
    (transformers' ``*RMSNorm``: ``variance_epsilon`` or ``eps``; ``centre`` False, :func:`rms_normalized`) or a
    LayerNorm (``torch.nn.LayerNorm``; ``centre`` True, :func:`layer_normalized`); None for any other."""
    if isinstance(norm, torch.nn.LayerNorm):
        return float(norm.eps), True
    if "RMSNorm" not in type(norm).__name__ or getattr(norm, "bias", None) is not None:
        return None
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return None if eps is None else (float(eps), False)


@dataclass(frozen=True, repr=False)
class MLPSiteIO(FieldsRepr):
    """Where a transcoder / CLT layer reads and writes at one layer (:func:`mlp_site_io`). Shipped by value to a
    server that lacks the package (``repr=False``: a dataclass's generated ``__repr__`` names ``_thread``, outside
    NDIF's unpickling whitelist; :class:`~nnsight_lorsa._repr.FieldsRepr` gives the same text).

    Attributes:
        input_path: the module whose call's first argument (``adapter.mlp_input``) it reads: the MLP, or the
            pre-MLP norm (``hook_resid_mid``; ``ln2.hook_normalized`` computed from the norm's input).
        output_path: the module whose output it replaces: the MLP, or Gemma-2/3's ``post_feedforward_layernorm``
            (``hook_mlp_out`` in a family with post-norms).
        eps: the norm's eps when the input is that argument normalised before the gain (``ln2.hook_normalized``
            where the gain is not 1): ``x / rms(x)`` (:func:`rms_normalized`) or, with ``centre``, ``(x − mean x) /
            σ(x)`` (:func:`layer_normalized`); None: the argument itself.
        centre: whether that normalisation is a LayerNorm's (mean subtracted first).
    """

    input_path: str
    output_path: str
    eps: float | None = None
    centre: bool = False

    def read(self, x: torch.Tensor) -> torch.Tensor:
        """The module's input from ``x``, the first argument of ``input_path``'s call: ``x``, or its normalisation
        before the gain (fp32) when ``eps`` is set: :func:`layer_normalized` with ``centre``, else
        :func:`rms_normalized`."""
        if self.eps is None:
            return x
        return layer_normalized(x, self.eps) if self.centre else rms_normalized(x, self.eps)

    def is_mlp_call(self, adapter: Any, layer: int) -> bool:
        """Whether this is the MLP module's own call (``adapter.mlp_path(layer)`` in and out, nothing computed)."""
        return self.input_path == self.output_path == adapter.mlp_path(layer) and self.eps is None


#: why ``ln2.hook_normalized`` has no site in a family without a pre-MLP norm
NO_PRE_NORM = ("the family has no pre-MLP norm (OLMo-2: the MLP reads the residual stream, its norm comes after it), "
               "so there is no normalised MLP input")


def mlp_site_io(module: Any, adapter: Any, root: Any, layer: int) -> MLPSiteIO:
    """Where ``module`` (a transcoder, CLT, or :class:`~nnsight_lorsa.modules.clt.CLTLayer`) reads and writes at
    ``layer``, by its circuit-tracer hooks (:func:`check_mlp_hooks` accepted them):

    - input: ``hook_resid_mid`` and ``hook_mlp_in`` → the pre-MLP norm's input (under a parallel residual, where
      ``hook_mlp_in`` is the layer's input, too); ``ln2.hook_normalized`` → the MLP's input where the
      norm's gain is 1, else (an RMSNorm, e.g. GemmaScope on Gemma-2's ``1 + weight`` gain) ``x / rms(x)`` of the
      norm's input, computed as the norm computes it (:func:`rms_normalized`), or (a LayerNorm: GPT-2, GPT-NeoX)
      its ``(x − mean x) / σ(x)`` (:func:`layer_normalized`); otherwise the MLP's input;
    - output: ``hook_mlp_out`` in a family with post-norms (Gemma-2/3) → ``post_feedforward_layernorm``'s output
      (``adapter.mlp_post_norm_path``); otherwise the MLP's output.

    ``root``: the model's torch module (the Hugging Face model) the adapter's paths address.

    Raises:
        UnsupportedArchitectureError: ``ln2.hook_normalized`` on a norm with a gain that is neither an RMSNorm nor a
            LayerNorm.
    """
    record = hook_record(module)
    mlp = adapter.mlp_path(layer)
    inp, eps, centre = mlp, None, False
    hook = record.get("feature_input_hook")
    if hook in (RESID_MID_HOOK, MLP_IN_HOOK):  # the pre-MLP norm's input; the MLP's own without one (OLMo-2)
        inp = adapter.mlp_norm_path(layer) or mlp
    elif hook == NORMALIZED_HOOK and adapter.mlp_norm_path(layer) is None:  # check_mlp_hooks refuses it first
        raise UnsupportedArchitectureError(f"{adapter.family}: ln2.hook_normalized at layer {layer}: {NO_PRE_NORM}")
    elif hook == NORMALIZED_HOOK and not _norm_is_identity(root, adapter, layer):
        inp = adapter.mlp_norm_path(layer)
        norm = _normalizing(root.get_submodule(inp))
        if norm is None:  # check_mlp_hooks refuses it first; never read the norm's raw input in its place
            raise UnsupportedArchitectureError(
                f"{adapter.family}: ln2.hook_normalized at layer {layer}: {inp!r} has a gain and is neither an RMSNorm "
                "nor a LayerNorm, so its input before the gain cannot be computed (docs/formats.md, circuit-tracer "
                "hooks)")
        eps, centre = norm
    out = mlp
    if record.get("feature_output_hook") == POST_NORM_OUTPUT_HOOK and adapter.mlp_post_norm_path(layer) is not None:
        out = adapter.mlp_post_norm_path(layer)
    return MLPSiteIO(inp, out, eps, centre)


def _norm_is_identity(root: Any, adapter: Any, layer: int) -> bool | None:
    """Whether layer ``layer``'s pre-MLP norm has gain exactly 1 and no (or a zero) bias, so that
    ``ln2.hook_normalized`` equals its output; None while its weights are not loaded (``meta``)."""
    norm = root.get_submodule(adapter.mlp_norm_path(layer))
    gain, bias = norm_gain(norm), getattr(norm, "bias", None)
    if any(t is not None and t.device.type == "meta" for t in (gain, bias)):
        return None
    return (gain is None or bool((gain == 1).all())) and (bias is None or not bool(bias.detach().any()))


def _hook_problem(key: str, hook: Any, root: Any, adapter: Any, layer: int) -> str | None:
    """Why ``hook`` (a ``feature_input_hook`` / ``feature_output_hook`` value) is not layer ``layer``'s MLP site,
    or None when it is (or when the file records none)."""
    if hook is None:
        return None
    if key == "feature_input_hook":
        if hook in MLP_INPUT_HOOKS:
            return None
        if hook == NORMALIZED_HOOK:
            if adapter.mlp_norm_path(layer) is None:
                return NO_PRE_NORM
            same = _norm_is_identity(root, adapter, layer)
            if same or _normalizing(root.get_submodule(adapter.mlp_norm_path(layer))) is not None:
                return None  # the MLP input, or the norm's input normalised before its gain (mlp_site_io)
            return ("its pre-MLP norm's weights are not loaded yet, so whether its gain is 1 cannot be checked "
                    "(build the set after the model's weights load)" if same is None else
                    f"{adapter.mlp_norm_path(layer)!r} has a gain ≠ 1 (or a bias) and is neither an RMSNorm nor a "
                    "LayerNorm: the MLP reads the norm's output with its gain, ln2.hook_normalized is the normalised "
                    "residual before it")
        if hook == MLP_IN_HOOK:
            return None  # read at the pre-MLP norm's input (the layer's input under a parallel residual): input_path
        if hook == RESID_MID_HOOK:
            if not has_resid_mid(adapter):
                return (f"{adapter.family} with a parallel residual has no residual stream between the attention and "
                        f"the MLP ({adapter.mlp_norm_path(layer)!r} reads the layer's input)")
            return None  # read at the pre-MLP norm's input: input_path
        return "it is not a hook that names the MLP module's input"
    if hook in MLP_OUTPUT_HOOKS:
        return None
    if hook == POST_NORM_OUTPUT_HOOK:
        return None  # the MLP output, or the post-MLP norm's output where there is one (mlp_site_io)
    return "it is not a hook that names the MLP module's output"


def check_mlp_hooks(module: Any, adapter: Any, root: Any, layers: Iterable[int]) -> None:
    """Refuse a transcoder / CLT whose file says it reads or writes another tensor than our MLP site, at each of
    ``layers`` (the layers it replaces). Our MLP site is the MLP module's call ``adapter.mlp_path(L)`` (input
    after the pre-MLP norm ``adapter.mlp_norm_path(L)`` and its gain, output before any post-norm), or the nearby
    tensors :func:`mlp_site_io` reads and writes.

    The hooks are the ones circuit-tracer's ``config.yaml`` records (``feature_input_hook`` /
    ``feature_output_hook``, kept by the loader in ``cfg.extra["circuit_tracer"]``; source: circuit-tracer
    ``utils/tl_nnsight_mapping.py``, ``replacement_model_transformerlens.py``). Accepted: input
    :data:`MLP_INPUT_HOOKS`; ``ln2.hook_normalized`` where that layer's norm has gain 1 and no bias (read from
    the loaded weights: ``norm_gain``) or is an RMSNorm or a LayerNorm (its ``x / rms(x)`` / ``(x − mean x) / σ(x)``
    before the gain and bias is computed from the norm's input: GemmaScope on Gemma-2, transcoders of GPT-2);
    ``hook_resid_mid`` (circuit-tracer's default: GPT-2 / Llama / Gemma-3
    transcoders; the residual BEFORE the norm) where the family has one (:func:`has_resid_mid`); output
    :data:`MLP_OUTPUT_HOOKS` and ``hook_mlp_out`` (on Gemma-2/3 the output of ``post_feedforward_layernorm``, which
    the sets then replace). :func:`mlp_site_io` says where the sets read and write. The record is
    :func:`hook_record`'s: circuit-tracer's, else the hook names of a SAELens / llamascopium / sparsify file; modules
    without any pass.

    Args:
        module: the transcoder / CLT (its ``cfg.extra``).
        adapter: the model's :class:`~nnsight_lorsa.adapters.base.ArchitectureAdapter`.
        root: the model's torch module (the Hugging Face model) the adapter's paths address.
        layers: the model layers whose MLP it replaces.

    A module trained on TransformerLens's centred residual (a Llamascopium file, SAELens with
    ``center_writing_weights``) reading a residual hook on a LayerNorm family has the centring folded into its
    encoder first (:func:`centre_residual_input_`).

    Raises:
        UnsupportedArchitectureError: such a hook, naming the key, the hook, the layer, the site we would use
            and why it differs; :func:`centre_residual_input_`'s refusals.
        CheckpointError: :func:`centre_residual_input_`'s (a SAELens file that does not say which residual it
            was trained on).
    """
    record = hook_record(module)
    for layer in layers if record else ():
        for key in ("feature_input_hook", "feature_output_hook"):
            why = _hook_problem(key, record.get(key), root, adapter, layer)
            if why is not None:
                io = "input" if key == "feature_input_hook" else "output"
                raise UnsupportedArchitectureError(
                    f"{adapter.family}: the {type(module).__name__} was trained with {key}: {record.get(key)!r}, "
                    f"which at layer {layer} is not our MLP site's {io} (the {io} of {adapter.mlp_path(layer)!r}): "
                    f"{why}; "
                    "attaching it there would compute something it was not trained on (docs/formats.md, "
                    "circuit-tracer hooks)")
    centre_residual_input_(module, adapter, root)  # last: a refusal above leaves the module as it was


# ------------------------------------------------------------------ a Lorsa's hooks (Llamascopium files)
#: TransformerLens's ``ln1.hook_normalized``: the pre-attention norm **before** its gain and bias (``RMSNormPre`` /
#: ``LayerNormPre`` once ``fold_ln`` folded them into ``W_Q``, ``W_K``, ``W_V``) — what Llamascopium, loading the
#: model through TransformerLens with its default processing (``backend/language_model.py``:
#: ``load_and_process_state_dict``), feeds a Lorsa whose ``hook_point_in`` names it
ATTENTION_NORMALIZED_HOOK = "ln1.hook_normalized"
#: TransformerLens's ``hook_attn_out``: the attention output added to the residual — after the post-attention norm
#: where there is one (Gemma-2/3, OLMo-2: ``components/transformer_block.py``)
ATTENTION_OUTPUT_HOOK = "hook_attn_out"
#: a Lorsa that reads the attention module's input and replaces its output (every Lorsa of this package; a
#: Llamascopium one once :func:`fold_attention_norm_` folded the norm in): ``cfg.extra["llamascopium"]["site"]``
ATTENTION_SITE = "attention"


def _lorsa_record(module: Any) -> dict[str, Any] | None:
    """The Llamascopium hook record a loader left in ``cfg.extra`` (``hook_point_in`` / ``hook_point_out``), or
    None."""
    record = _extra(module).get("llamascopium")
    return record if isinstance(record, dict) and ("hook_point_in" in record or "hook_point_out" in record) else None


def lorsa_reads_attention_input(lorsa: Any) -> bool:
    """Whether ``lorsa`` reads the attention module's input (the pre-attention norm's output, gain included) and
    writes its output — a Lorsa of this package, a file this package wrote, or a Llamascopium Lorsa whose norm
    :func:`fold_attention_norm_` folded in — rather than the TransformerLens hooks its Llamascopium file names."""
    record = _lorsa_record(lorsa)
    return record is None or record.get("site") == ATTENTION_SITE


def _attention_norm(adapter: Any, root: Any, layer: int) -> tuple[str, torch.Tensor | None, torch.Tensor | None]:
    path = adapter.attention_norm_path(layer)
    norm = root.get_submodule(path)
    bias = getattr(norm, "bias", None)
    return path, norm_gain(norm), None if bias is None else bias.detach()


def _lorsa_hook_problem(lorsa: Any, adapter: Any, root: Any, layer: int) -> tuple[type, str] | None:
    """``(error class, why)`` a Llamascopium Lorsa cannot run at layer ``layer``'s attention as its hooks say (its
    norm not yet folded in), or None."""
    record = _lorsa_record(lorsa)
    if record is None or record.get("site") == ATTENTION_SITE:
        return None
    problem = _hooks_problem(record, adapter, layer)
    if problem is not None:
        return problem
    path, gain, bias = _attention_norm(adapter, root, layer)
    if any(t is not None and t.device.type == "meta" for t in (gain, bias)):
        return ConfigMismatchError, (
            f"its input is {path!r} before the norm's gain and bias, which are folded into it from the model's "
            "weights, and those are not loaded (meta): load the model (TransformersModel(..., dispatch=True)) "
            "first; for a model that stays on meta (NDIF), fold it once where the weights are — "
            "LorsaSet.from_pretrained(loaded, directory).save(folder) — and load that folder")
    if (gain is None or bool((gain == 1).all())) and (bias is None or not bool(bias.any())):
        return None  # the norm's output is ln1.hook_normalized itself
    return ConfigMismatchError, (
        f"it reads TransformerLens's ln1.hook_normalized, {path!r} BEFORE its gain and bias, while the attention "
        "reads the norm's output: load it with LorsaSet.from_pretrained(model, directory), which folds the norm's "
        "gain and bias into its W_Q, W_K, W_V")


def _hooks_problem(record: dict[str, Any], adapter: Any, layer: int) -> tuple[type, str] | None:
    """What in a Llamascopium Lorsa's hooks layer ``layer``'s attention site cannot give, whatever the norm's
    weights: a hook of another layer, another input or output hook, a post-attention norm, no pre-attention norm."""
    family = adapter.family
    for key in ("hook_point_in", "hook_point_out"):
        m = _TL.match(record.get(key) or "")
        if m is not None and int(m.group(1)) != layer:
            return ConfigMismatchError, f"its {key} {record[key]!r} is layer {m.group(1)}, not layer {layer}"
    hook_in, hook_out = (_tl_suffix(record.get(k)) for k in ("hook_point_in", "hook_point_out"))
    if hook_out != ATTENTION_OUTPUT_HOOK:
        return UnsupportedArchitectureError, (f"its hook_point_out {record.get('hook_point_out')!r} is not the "
                                              "attention's output (hook_attn_out), which a LorsaSet replaces")
    if adapter.attention_post_norm_path(layer) is not None:
        return UnsupportedArchitectureError, (
            f"TransformerLens's hook_attn_out on {family} is the post-attention norm's output "
            f"({adapter.attention_post_norm_path(layer)!r}), which a LorsaSet does not replace (it replaces the "
            "attention module's output, before that norm)")
    if hook_in != ATTENTION_NORMALIZED_HOOK:
        return UnsupportedArchitectureError, (f"its hook_point_in {record.get('hook_point_in')!r} is not the "
                                              "attention's normalised input (ln1.hook_normalized)")
    if adapter.attention_norm_path(layer) is None:
        return UnsupportedArchitectureError, (
            f"{family} has no pre-attention norm: TransformerLens's ln1 there is the post-attention norm, so "
            "ln1.hook_normalized is no input of the attention")
    return None


def check_lorsa_hooks(lorsa: Any, adapter: Any, root: Any, layer: int) -> None:
    """Refuse a Lorsa whose Llamascopium file names hooks (``hook_point_in`` / ``hook_point_out``, kept by the
    loader in ``cfg.extra["llamascopium"]``) that layer ``layer``'s attention site does not give: the site reads the
    attention module's input (the pre-attention norm's output, gain and bias included) and replaces its output.
    Accepted: a Lorsa without such hooks or marked :data:`ATTENTION_SITE` (this package's, or folded by
    :func:`fold_attention_norm_`); ``ln1.hook_normalized`` → ``hook_attn_out`` where the pre-attention norm has gain
    1 and no bias and the family no post-attention norm.

    Raises:
        ConfigMismatchError: ``ln1.hook_normalized`` before a norm with a gain or bias, not folded (load it with
            ``LorsaSet.from_pretrained``); the norm's weights on ``meta``; a hook of another layer.
        UnsupportedArchitectureError: another input or output hook; ``hook_attn_out`` on a family with a
            post-attention norm (Gemma-2/3, OLMo-2: TransformerLens takes it after that norm); no pre-attention norm.

    Source: Llamascopium ``backend/language_model.py`` (TransformerLens with ``fold_ln``); TransformerLens
    ``components/rms_norm_pre.py``, ``components/transformer_block.py``.
    """
    problem = _lorsa_hook_problem(lorsa, adapter, root, layer)
    if problem is not None:
        error, why = problem
        raise error(f"{adapter.family}: the Lorsa for layer {layer} cannot run at its attention: {why}")


def fold_attention_norm_(lorsa: Any, adapter: Any, root: Any, layer: int) -> bool:
    """Fold layer ``layer``'s pre-attention norm into a Llamascopium Lorsa that reads TransformerLens's
    ``ln1.hook_normalized`` (the norm before its gain ``g`` and bias ``b``), so that it reads the attention module's
    input ``x = g ⊙ x̂ + b`` as every Lorsa of this package does: ``W ← diag(1/g) W``, ``b ← b − (b_norm / g) W`` for
    ``W_Q``, ``W_K``, ``W_V`` (in float64, cast back; the same values up to rounding of the model's dtype), and
    marks it :data:`ATTENTION_SITE`. Nothing for a Lorsa without such a file record, or one already marked; False
    then (and where :func:`check_lorsa_hooks` refuses it: another hook, no pre-attention norm, weights on ``meta``).

    Raises:
        ConfigMismatchError: a gain with zeros (that coordinate of ``x̂`` is lost in ``x``).

    Source: TransformerLens ``HookedTransformer.fold_layer_norm`` (the fold it undoes); Llamascopium
    ``models/lorsa.py`` (``init_from_mhsa`` from the folded ``W_Q``).
    """
    record = _lorsa_record(lorsa)
    if record is None or record.get("site") == ATTENTION_SITE or _hooks_problem(record, adapter, layer) is not None:
        return False
    path, gain, bias = _attention_norm(adapter, root, layer)
    if any(t is not None and t.device.type == "meta" for t in (gain, bias)):
        return False
    if gain is not None and bool((gain == 0).any()):
        raise ConfigMismatchError(
            f"{adapter.family}: {path!r} has {int((gain == 0).sum())} zero gains: the attention's input holds "
            "nothing of those coordinates of ln1.hook_normalized, which the Lorsa reads")
    with torch.no_grad():
        for name, value in _input_projections(lorsa, gain, bias, normalized=False).items():
            getattr(lorsa, name).copy_(value)
    record["site"] = ATTENTION_SITE
    record["attention_norm_folded"] = path
    return True


def attention_norm_unfolded(lorsa: Any, adapter: Any, root: Any, layer: int) -> dict[str, torch.Tensor]:
    """``W_Q``, ``W_K``, ``W_V``, ``b_Q``, ``b_K``, ``b_V`` of ``lorsa`` — which reads the attention's input
    ``x = g ⊙ x̂ + b`` — rewritten for TransformerLens's ``ln1.hook_normalized`` ``x̂`` (what Llamascopium feeds a
    Lorsa): ``W ← diag(g) W``, ``b_W ← b_W + b W``, in float64, cast back; the inverse of
    :func:`fold_attention_norm_`. The module is not changed.

    Raises:
        UnsupportedArchitectureError: a family without a pre-attention norm (OLMo-2), or with a post-attention norm
            (Gemma-2/3, OLMo-2: TransformerLens's ``hook_attn_out`` is after it, the Lorsa's output before).
        ConfigMismatchError: the norm's weights on ``meta``.

    Source: TransformerLens ``HookedTransformer.fold_layer_norm``; Llamascopium ``backend/language_model.py``.
    """
    if adapter.attention_norm_path(layer) is None or adapter.attention_post_norm_path(layer) is not None:
        raise UnsupportedArchitectureError(
            f"{adapter.family}: a Lorsa of layer {layer} has no TransformerLens form: "
            + ("the family has no pre-attention norm (ln1 there is the post-attention norm)"
               if adapter.attention_norm_path(layer) is None else
               f"hook_attn_out is {adapter.attention_post_norm_path(layer)!r}'s output there, the Lorsa writes the "
               "attention module's output before it"))
    path, gain, bias = _attention_norm(adapter, root, layer)
    if any(t is not None and t.device.type == "meta" for t in (gain, bias)):
        raise ConfigMismatchError(f"{adapter.family}: {path!r}'s weights are on meta: its gain cannot be folded out")
    return _input_projections(lorsa, gain, bias, normalized=True)


def _input_projections(lorsa: Any, gain: torch.Tensor | None, bias: torch.Tensor | None,
                       normalized: bool) -> dict[str, torch.Tensor]:
    """``{W_Q, W_K, W_V, b_Q, b_K, b_V}`` of ``lorsa`` rewritten across a norm's gain ``g`` and bias ``b``
    (``x = g ⊙ x̂ + b``; None: 1, 0), computed in float64 and cast back to each tensor's dtype, on its device. From
    weights ``W`` reading ``x`` to weights reading ``x̂`` (``normalized``): ``diag(g) W`` and ``b_W + b W``; the
    other way: ``diag(1/g) W`` and ``b_W − b diag(1/g) W`` (the gain without zeros)."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        device = lorsa.W_Q.device
        g = torch.ones(lorsa.cfg.d_model, dtype=torch.float64, device=device) if gain is None else \
            gain.to(device=device, dtype=torch.float64)
        shift = None if bias is None else bias.to(device=device, dtype=torch.float64)
        for w_name, b_name, spec in (("W_Q", "b_Q", "hde,d->he"), ("W_K", "b_K", "hde,d->he"),
                                     ("W_V", "b_V", "nd,d->n")):
            weight, b = getattr(lorsa, w_name), getattr(lorsa, b_name)
            w64 = weight.detach().double()
            scale = g[None, :, None] if weight.dim() == 3 else g[None, :]
            # the x-reading weights: W itself (to x̂), or W / g (from x̂)
            w_x = w64 if normalized else w64 / scale
            out[w_name] = (w64 * scale if normalized else w_x).to(weight.dtype)
            out[b_name] = b.detach().clone() if shift is None else \
                (b.detach().double() + (1 if normalized else -1) * torch.einsum(spec, w_x, shift)).to(b.dtype)
    return out

# ------------------------------------------------------------------ TransformerLens's centred residual stream
#: TransformerLens hooks whose tensor is a sum of writing weights' outputs (the residual stream and the sublayer
#: outputs added to it): mean-free over ``d_model`` once ``center_writing_weights`` centred ``W_E``, ``W_pos``,
#: ``W_O``, ``W_out`` (TransformerLens ``weight_processing.py``, LayerNorm models only)
CENTRED_HOOKS = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_mlp_in", "hook_mlp_out",
                 "hook_attn_out")


def trained_centred(module: Any) -> bool | None:
    """Whether ``module`` was trained on TransformerLens's centred residual stream (a ``HookedTransformer`` with
    ``center_writing_weights``): True for every Llamascopium file (its TransformerLens backend loads the model with
    the default processing: ``backend/language_model.py``) but one this package wrote, which says which in its
    header (``nnsight_lorsa.center_writing_weights``); a SAELens file's own record (True, False, or None where
    the file does not say: :func:`~.saelens._centred_training`); False for every other module (this package's,
    sparsify's and circuit-tracer's train on the Hugging Face model).

    Source: TransformerLens ``weight_processing.py`` (``center_writing_weights``); Llamascopium
    ``backend/language_model.py``; SAELens ``config.py`` (``model_from_pretrained_kwargs``).
    """
    record = _lorsa_record(module)
    if record is not None:  # a file this package wrote says which (CENTRED_METADATA_KEY); theirs were
        return bool(record.get("center_writing_weights", True))
    saelens = _extra(module).get("saelens")
    if not isinstance(saelens, dict):
        return False
    value = saelens.get("center_writing_weights", False)
    return value if value is None else bool(value)


def _layer_norm_family(adapter: Any, root: Any) -> bool:
    """Whether the model's norms are LayerNorms (GPT-2, GPT-NeoX), which TransformerLens's
    ``center_writing_weights`` applies to (RMSNorm models are left as they are)."""
    path = adapter.attention_norm_path(0) or adapter.mlp_norm_path(0)
    return path is not None and isinstance(root.get_submodule(path), torch.nn.LayerNorm)


#: where each format's record names the hook a module reads, and the one it writes (an SAE's ``hook_name``: both)
_INPUT_HOOK_KEYS = (("circuit_tracer", "feature_input_hook"), ("llamascopium", "hook_point_in"),
                    ("saelens", "hook_name"))
_OUTPUT_HOOK_KEYS = (("circuit_tracer", "feature_output_hook"), ("llamascopium", "hook_point_out"),
                     ("saelens", "hook_name_out"), ("saelens", "hook_name"))


def _recorded_hook(module: Any, keys: tuple[tuple[str, str], ...]) -> Any:
    """The first hook name ``module``'s file records under ``keys`` (``(format, key)`` pairs of ``cfg.extra``:
    :data:`_INPUT_HOOK_KEYS` or :data:`_OUTPUT_HOOK_KEYS`), or None."""
    extra = _extra(module)
    for fmt, key in keys:
        record = extra.get(fmt)
        if isinstance(record, dict) and isinstance(record.get(key), str):
            return record[key]
    return None


def _centre_encoder_(module: Any) -> None:
    """Fold ``x ↦ x − mean(x)`` (over ``d_in``) into ``module``'s encoder, in place: ``W_enc``'s ``d_in`` axis and a
    skip path's input axis made mean-free; an SAE subtracting ``b_dec`` before its encoder keeps
    ``(x − mean x − b_dec) W_enc + b_enc`` with ``b_enc −= mean(b_dec) · Σ_i W_enc[i]``. Computed in fp64, stored in
    the weights' dtype. Idempotent: a mean-free encoder reads ``x`` and ``x − mean(x)`` alike."""
    with torch.no_grad():
        w_enc = module.W_enc
        axis = w_enc.dim() - 2  # (d_in, d_sae), or a CLT's (n_layers, d_in, d_sae)
        w64 = w_enc.detach().double()
        if getattr(module.cfg, "apply_b_dec_to_input", False):
            shift = module.b_dec.detach().double().mean(-1, keepdim=True)
            module.b_enc.copy_((module.b_enc.detach().double() - shift * w64.sum(axis)).to(module.b_enc.dtype))
        w_enc.copy_((w64 - w64.mean(axis, keepdim=True)).to(w_enc.dtype))
        skip = getattr(module, "W_skip", None)
        if isinstance(skip, torch.Tensor):  # (…, d_out, d_in)
            s64 = skip.detach().double()
            skip.copy_((s64 - s64.mean(-1, keepdim=True)).to(skip.dtype))


def centre_residual_input_(module: Any, adapter: Any, root: Any) -> bool:
    """Make a module trained on TransformerLens's centred residual stream (:func:`trained_centred`) read the
    model's own: where its file's input hook is one of :data:`CENTRED_HOOKS` and the model's norms are
    LayerNorms (GPT-2, GPT-NeoX: TransformerLens's ``center_writing_weights`` centres ``W_E``, ``W_pos``, ``W_O``,
    ``W_out`` and their biases over ``d_model``, so its residual is the model's minus its per-token mean), the
    centring is folded into the encoder in place (``_centre_encoder_``; idempotent). Its output is left in
    TransformerLens's form: every reader of a LayerNorm model's residual subtracts the mean first, so the logits
    are those of TransformerLens's model (``evaluate`` measures FVU against the centred target:
    :func:`writes_centred`). Returns whether it folded.

    Raises:
        CheckpointError: a SAELens file that records neither ``center_writing_weights`` nor its training version
            (which residual it was trained on is unknown), naming the hook and how to say it.
        UnsupportedArchitectureError: an SAE that rescales each input by its norm (``constant_norm_rescale``):
            the norm of the centred residual is another, which no fold reproduces.

    Source: TransformerLens ``weight_processing.py`` (``center_writing_weights``, LayerNorm models only);
    Llamascopium ``backend/language_model.py``; SAELens ``saes/sae.py`` (``model_from_pretrained_kwargs``).
    """
    reads = _recorded_hook(module, _INPUT_HOOK_KEYS)
    if _tl_suffix(reads) not in CENTRED_HOOKS or not _layer_norm_family(adapter, root):
        return False
    centred = trained_centred(module)
    if centred is False:
        return False
    if centred is None:
        refuse(
            None,
            f"{adapter.family}: the {type(module).__name__} reads {reads!r}, and its SAELens cfg.json records neither "
            "model_from_pretrained_kwargs.center_writing_weights nor sae_lens_training_version, so whether it was "
            "trained on TransformerLens's centred residual (center_writing_weights, the default before SAELens "
            "3.19.2; on LayerNorm models that residual is the model's minus its mean) is unknown. Load it by its "
            "SAELens release (load(release, sae_id=...): gpt2-small-res-jb records true) or say it: "
            "load(path, config_overrides={'model_from_pretrained_kwargs': {'center_writing_weights': True}}) "
            "(or False)")
    if getattr(module.cfg, "normalize_activations", "none") == "constant_norm_rescale":
        raise UnsupportedArchitectureError(
            f"{adapter.family}: the {type(module).__name__} reads {reads!r} from TransformerLens's centred residual "
            "and rescales each input by its norm (normalize_activations: constant_norm_rescale): the model's "
            "residual keeps its mean, and the norm of the centred one is another, which no fold of the weights "
            "reproduces")
    _centre_encoder_(module)
    return True


def writes_centred(module: Any, adapter: Any, root: Any) -> bool:
    """Whether ``module``'s output is TransformerLens's centred form of the tensor it replaces (its file's output
    hook one of :data:`CENTRED_HOOKS`, trained centred, a LayerNorm family): the model's tensor minus its
    per-token mean is what it reconstructs (``evaluate``'s FVU target).

    Source: TransformerLens ``weight_processing.py`` (``center_writing_weights``).
    """
    return (_tl_suffix(_recorded_hook(module, _OUTPUT_HOOK_KEYS)) in CENTRED_HOOKS and trained_centred(module) is True
            and _layer_norm_family(adapter, root))
