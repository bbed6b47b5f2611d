"""``SAESet``: SAEs on module outputs of one nnsight model, spliced in with ``replace``.

Usage::

    saes = SAESet(model, {"model.layers.1": sae})
    with model.trace(prompt):
        site = saes.replace("model.layers.1")           # residual stream after layer 1 -> SAE(·)
        acts = site.hook_sae_acts_post.output.save()    # the features, (batch, pos, d_sae)
        site.hook_sae_acts_post.output[:, :, 3] = 0     # ablate feature 3
        logits = model.lm_head.output.save()

A site is any module path (below the nnsight root, as envoys name it) whose OUTPUT the SAE
reconstructs: a decoder layer's output is the residual stream after that layer (a tensor in
transformers 5), an attention module's is ``(attn_output, weights)`` (the first element is
replaced). The splice is :func:`.splice_chain.splice_chain` with one site (the step reads the
site's output); the SAE is mounted as ``<site>.sae``.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..errors import ConfigMismatchError, ShapeError
from ..formats.hook_sites import centre_residual_input_, check_sae_record, sae_site_path
from ..modules.sae import SparseAutoencoder
from .nnsight_internals import hf_module
from .replacement_set import ReplacementSet, load_keyed
from .splice_chain import SpliceChain
from .transcoder_set import run_on_module


def site_output(output: Any) -> torch.Tensor:
    """The tensor a site returns: the output itself, or the first element of a tuple/list."""
    value = output[0] if isinstance(output, (tuple, list)) and output else output
    if not isinstance(value, torch.Tensor):
        raise ShapeError(f"an SAE site must return a tensor or a tuple starting with one, got {type(output).__name__}")
    return value


def with_site_output(output: Any, new: torch.Tensor) -> Any:
    """The site's return value with its tensor replaced by ``new``."""
    return (new, *output[1:]) if isinstance(output, (tuple, list)) else new


def _sae_step(module: torch.nn.Module, i: int, args: tuple, kwargs: dict, true_out: torch.Tensor,
              state: dict) -> torch.Tensor:
    return run_on_module(module, true_out)


class SAESet(ReplacementSet[str, SparseAutoencoder]):
    """The SAEs of one model, keyed by site path; ``replace(site)`` splices them into a trace.

    Args:
        model: an nnsight ``TransformersModel``/``LanguageModel``.
        saes: ``{site_path: SparseAutoencoder}``, e.g. ``{"model.layers.3": sae}``.

    Raises:
        ConfigMismatchError: the model has no module at a site path, or the site is one whose
            width is known (a decoder layer, its attention or MLP, the embedding) and differs
            from the SAE's ``d_in``. Other sites are checked when the trace runs (:class:`ShapeError`).

    Source: nnsight 0.8 ``docs/patterns/sae-and-auxiliary-modules.md`` (an SAE spliced into a trace).
    """

    key_type = str
    what = "SAE"
    module_type = SparseAutoencoder
    slot = "saes"

    def wrong_kind(self, key: Any, module: Any) -> str:
        return (f"SAESet holds SparseAutoencoder modules; got a {type(module).__name__} for site {key!r} "
                "(transcoders go in a TranscoderSet, Lorsas in a LorsaSet)")

    def __init__(self, model: Any, saes: dict[str, SparseAutoencoder] | None = None, adapter: Any = None) -> None:
        super(SAESet, self).__init__(model, saes, adapter)

    def known_width(self, path: str) -> int | None:
        """``d_model`` for the residual-width sites of the adapter, None for others.

        Source: nnsight 0.8 ``docs/patterns/sae-and-auxiliary-modules.md`` (an SAE spliced into a trace).
        """
        a = self.adapter
        layer = rf"{re.escape(a.layers_path)}\.[0-9]+"
        parts = (a.attention_name, a.mlp_name)
        pattern = rf"{layer}(\.({'|'.join(re.escape(p) for p in parts if p)}))?"
        if re.fullmatch(pattern, path) or path in (a.embed_path, a.residual_start_path):
            return a.d_model
        return None

    def check(self, key: Any, module: SparseAutoencoder) -> str:
        """Validate ``(key, module)`` for this model and return the normalised key. An SAE trained on
        TransformerLens's centred residual (a Llamascopium file, SAELens with ``center_writing_weights``) reading a
        residual hook of a LayerNorm family has the centring folded into its encoder, in place
        (:func:`~..formats.hook_sites.centre_residual_input_`).

        Raises:
            ConfigMismatchError: a key that is not a module path of the model, or an SAE whose ``d_in`` is not the
                site's known width; an SAE whose file records a tensor that no module output carries (a module's
                input: ``hook_resid_mid``, ``hook_mlp_in``, ``attn.hook_z``; one head's slice), at any key — it
                would reconstruct another tensor there. A key other than the recorded site (an SAE moved to
                another layer on purpose) is placed as given.
            CheckpointError: a SAELens SAE on such a hook whose file does not say which residual it was trained on.
            UnsupportedArchitectureError: such an SAE rescaling each input by its norm (``constant_norm_rescale``).

        Source: ours (the shared contract of this package's replacement sets).
        """
        if not isinstance(key, str) or not key:
            raise ConfigMismatchError(f"an SAE site is a module path (str), got {key!r}")
        try:
            hf_module(self.model).get_submodule(key)
        except AttributeError as e:
            raise ConfigMismatchError(f"{type(hf_module(self.model)).__name__} has no module at {key!r}: {e}") from e
        width = self.known_width(key)
        if width is not None and module.cfg.d_in != width:
            raise ConfigMismatchError(f"SAE for {key} has d_in={module.cfg.d_in}; that site's output has width {width}")
        check_sae_record(module, self.adapter)
        centre_residual_input_(module, self.adapter, hf_module(self.model))
        return key

    def site_path(self, key: str) -> str:
        return key

    def site(self, path: str) -> SpliceChain:
        """How the output of ``path`` is spliced.

        Source: nnsight 0.8 ``docs/patterns/sae-and-auxiliary-modules.md`` (an SAE spliced into a trace).
        """
        return SpliceChain(
            site_paths=(path,),
            attach_path=path,
            attach_name="sae",
            step=_sae_step,
            get_output=site_output,
            set_output=with_site_output,
            error_hook=lambda module, i: module.get_submodule("hook_error"),
            reads_output=True,
        )

    def replace(self, site: Any = None, *, error: bool = False) -> Any:  # checked by replace_keys
        """Replace the output of ``site`` by its SAE's reconstruction, in the current trace only.

        Inside ``tracer.invoke(...)``: for that invoke's rows only (other invokes keep the site's own output;
        :func:`~.splice_chain.splice_chain`, *Rows*).

        Call inside ``model.trace(...)`` before anything at or after the site is read. Returns
        the SAE's envoy (a dict ``{site: envoy}`` for several; all sites when None), whose
        children ``hook_sae_acts_pre``, ``hook_sae_acts_post`` (features ``(batch, pos, d_sae)``),
        ``hook_sae_recons`` (the reconstruction) and ``hook_error`` can be read and edited.

        Args:
            site: a site path of the set, several, or None for all.
            error: add the exact error term ``x − SAE(x)`` (through ``hook_error``): the model's
                outputs are then the unmodified model's (bit for bit,
                every dtype), while edits to the
                features still change them (the error is held fixed).

        Raises:
            ConfigMismatchError: no SAE at ``site``.
            ShapeError: (when the trace runs) the site's output is not ``(…, d_in)``.
            TraceOrderError: the model already ran the site in this pass.
            TraceOrderError: called outside a trace.
            InvokeRowsError: (in the run) its internals read or edited from an invoke that did not call it.
            ArgumentError: a key of the wrong type (``2.0``, ``"2"`` for a layer) or an empty list.

        Source: nnsight 0.8 ``docs/patterns/sae-and-auxiliary-modules.md`` (an SAE spliced into a trace).
        """
        return super(SAESet, self).replace(site, error=error)

    def missing(self, key: Any) -> Exception:
        return ConfigMismatchError(f"no SAE at site {key!r}; this set has {list(self)}")

    @classmethod
    def from_pretrained(cls, model: Any, sources: Any, *, format: str = "auto", adapter: Any = None,
                        **kwargs: Any) -> SAESet:
        """Load SAEs from checkpoint files and attach each at the site its file names.

        ``sources``: a checkpoint directory (or hub repo id), several,
        or ``{site_path: directory}``; a directory may hold several (a sparsify run, a circuit-tracer
        set). Each goes through ``formats.load``. ``format``: ``"auto"`` (from the files,
        :func:`~..formats.registry.detect_format`), ``"saelens"``, ``"sparsify"``, ``"llamascopium"``,
        ``"nnsight_lorsa"``, ``"circuit_tracer"``; ``kwargs`` go to the reader (``norm_scaling_factor``,
        ``device``, ``dtype``, …).
        The site of each SAE is read from its file (SAELens / llamascopium hook names such as
        ``blocks.3.hook_resid_post``, sparsify hookpoints, our ``SAEConfig.hook``) and mapped to this
        model's module paths (``hook_resid_pre`` of layer L is the output of layer L−1).

        Raises:
            ConfigMismatchError: a file names no site (pass ``{site_path: directory}``), a site that is
                not a module output, a site of another width; a file that holds a transcoder.
            CheckpointError, UnsupportedArchitectureError: from the loaders.

        Source: nnsight 0.8 ``docs/patterns/sae-and-auxiliary-modules.md`` (an SAE spliced into a trace).
        """
        from ..adapters.registry import get_adapter

        adapter = get_adapter(model) if adapter is None else adapter
        out = cls(model, {}, adapter)

        def site_of(name: str, module: SparseAutoencoder) -> str | None:
            named = out.key_of_folder(name)
            return named if named is not None else sae_site_path(module, adapter)

        out.update(load_keyed(model, sources, SparseAutoencoder, site_of, format=format, noun="an SAE",
                              hint=" (use TranscoderSet)", key_name="hook site", adapter=adapter,
                              d_model=adapter.d_model, **kwargs))
        return out
