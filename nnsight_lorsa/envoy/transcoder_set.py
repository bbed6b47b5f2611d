"""``TranscoderSet``: per-layer (skip) transcoders of one nnsight model, spliced into MLPs with ``replace``.

Usage::

    tcs = TranscoderSet(model, {1: transcoder_layer1})
    with model.trace(prompt):
        site = tcs.replace(layer=1)                     # MLP output -> transcoder output
        acts = site.hook_sae_acts_post.output.save()    # the features, (batch, pos, d_sae)
        site.hook_sae_acts_post.output[:, :, 7] = 0     # ablate feature 7
        logits = model.lm_head.output.save()

A transcoder reads what the MLP is called with (the hidden states after the pre-MLP norm:
``adapter.mlp_input``) and replaces what the MLP returns (``adapter.mlp_output``); a file's hooks (circuit-tracer's,
or a SAELens / llamascopium transcoder's hook names: :func:`~nnsight_lorsa.formats.hook_sites.hook_record`) may
move either (:func:`~nnsight_lorsa.formats.hook_sites.mlp_site_io`): ``feature_input_hook: hook_resid_mid`` reads
what the pre-MLP norm is called with (the residual before the norm), ``ln2.hook_normalized`` on an RMSNorm with a
gain reads that residual's ``x / rms(x)`` before the gain (fp32, as the norm computes it), and
``feature_output_hook: hook_mlp_out`` on Gemma-2/3 replaces ``post_feedforward_layernorm``'s output (GemmaScope:
circuit-tracer's ``gemma`` transcoders). The splice is :func:`.splice_chain.splice_chain` over that one site, the
transcoder mounted as ``<mlp>.transcoder``; with ``error=True`` the error term is taken at that site.
Works per position, so also on KV-cached generation steps.
"""

from __future__ import annotations

from typing import Any

import torch

from .._placement import to_module
from ..errors import ConfigMismatchError, LayerOutOfRangeError
from ..formats.hook_sites import check_mlp_hooks, mlp_site_io
from ..modules.transcoder import Transcoder
from .nnsight_internals import hf_module
from .replacement_set import ReplacementSet, load_keyed
from .splice_chain import SpliceChain


def run_on_module(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` with ``x`` cast to the module's device and dtype (the splice casts the result back)."""
    return module(to_module(x, module))


class TranscoderSet(ReplacementSet[int, Transcoder]):
    """The transcoders of one model, keyed by layer; ``replace(layer=L)`` splices them into a trace.

    Args:
        model: an nnsight ``TransformersModel``/``LanguageModel``.
        transcoders: ``{layer: Transcoder | SkipTranscoder}``.

    Raises:
        UnsupportedArchitectureError: the model family has no adapter, or a transcoder file's hooks name
            a tensor the set cannot read or write (``hook_resid_mid`` under GPT-NeoX's parallel residual;
            ``ln2.hook_normalized`` where the norm is a LayerNorm with a gain; ``hook_resid_post``, unknown hooks:
            :func:`~nnsight_lorsa.formats.hook_sites.check_mlp_hooks`).
        LayerOutOfRangeError: a layer outside ``[0, n_layers)``.
        ConfigMismatchError: ``d_in``/``d_out`` differ from the model's ``d_model``, or the
            transcoder records another layer.

    Source: Dunefsky et al. 2024, *Transcoders Find Interpretable LLM Feature Circuits*; nnsight 0.8
    ``docs/patterns/sae-and-auxiliary-modules.md``.
    """

    key_type = int
    what = "transcoder"
    module_type = Transcoder
    slot = "transcoders"

    def wrong_kind(self, key: Any, module: Any) -> str:
        return (f"TranscoderSet holds Transcoder / SkipTranscoder modules; got a {type(module).__name__} for layer "
                f"{key!r} (SAEs go in an SAESet, a cross-layer transcoder in a CLTSet)")

    def __init__(self, model: Any, transcoders: dict[int, Transcoder] | None = None, adapter: Any = None) -> None:
        super(TranscoderSet, self).__init__(model, transcoders, adapter)

    def check(self, key: Any, module: Transcoder) -> int:
        """Validate ``(key, module)`` for this model and return the normalised key.

        Raises:
            ConfigMismatchError: a transcoder whose ``d_in`` / ``d_out`` differ from the model's ``d_model``, or
                trained for another layer.
            LayerOutOfRangeError: ``key`` not a layer in ``[0, n_layers)``.

        Source: ours (the shared contract of this package's replacement sets).
        """
        layer = self.adapter.check_layer(key)
        d = self.adapter.d_model
        cfg = module.cfg
        if cfg.d_in != d or module.d_out != d:
            raise ConfigMismatchError(
                f"transcoder for layer {layer} maps d_in={cfg.d_in} -> d_out={module.d_out}; the MLPs map {d} -> {d}"
            )
        if getattr(cfg, "layer", None) not in (None, layer):
            raise ConfigMismatchError(f"transcoder was trained for layer {cfg.layer}, not layer {layer}")
        check_mlp_hooks(module, self.adapter, hf_module(self.model), (layer,))
        return layer

    def missing(self, key: Any) -> Exception:
        return LayerOutOfRangeError(f"no transcoder for layer {key!r}; this set has layers {list(self)}")

    def site_path(self, key: int) -> str:
        """The layer's MLP, where its transcoder runs (the module whose output it replaces is :meth:`site`'s
        ``site_paths[0]``: the MLP, or Gemma-2/3's ``post_feedforward_layernorm`` for ``hook_mlp_out``).

        Source: Dunefsky et al. 2024, *Transcoders Find Interpretable LLM Feature Circuits*; nnsight 0.8
        ``docs/patterns/sae-and-auxiliary-modules.md``.
        """
        return self.adapter.mlp_path(key)

    @property
    def layers(self) -> list[int]:
        """The layers that have a transcoder, in key order.

        Source: Dunefsky et al. 2024, *Transcoders Find Interpretable LLM Feature Circuits*; nnsight 0.8
        ``docs/patterns/sae-and-auxiliary-modules.md``.
        """
        return list(self)

    def feature_module(self, target: Any) -> Transcoder:
        """The transcoder at layer ``target.site``.

        Raises:
            LayerOutOfRangeError: ``target.site`` is not an int layer, or the set has no transcoder there.

        Source: Dunefsky et al. 2024, *Transcoders Find Interpretable LLM Feature Circuits*; nnsight 0.8
        ``docs/patterns/sae-and-auxiliary-modules.md``.
        """
        if not isinstance(target.site, int):
            raise LayerOutOfRangeError(f"a transcoder feature's site is a layer (int), got {target.site!r}")
        return self[target.site]

    def site(self, layer: int) -> SpliceChain:
        """How layer ``layer``'s MLP is spliced (its path, input and output handling).

        Source: Dunefsky et al. 2024, *Transcoders Find Interpretable LLM Feature Circuits*; nnsight 0.8
        ``docs/patterns/sae-and-auxiliary-modules.md``.
        """
        adapter = self.adapter
        io = mlp_site_io(self[layer], adapter, hf_module(self.model), layer)

        def step(module: torch.nn.Module, i: int, args: tuple, kwargs: dict, true_out: torch.Tensor,
                 state: dict) -> torch.Tensor:
            # the first argument of io.input_path's call (x / rms(x) of it for ln2.hook_normalized on an RMSNorm)
            return run_on_module(module, io.read(adapter.mlp_input(args, kwargs)))

        return SpliceChain(
            site_paths=(io.output_path,),
            attach_path=adapter.mlp_path(layer),
            attach_name="transcoder",
            step=step,
            get_output=adapter.mlp_output,
            set_output=adapter.with_mlp_output,
            error_hook=lambda module, i: module.get_submodule("hook_error"),
            input_paths=(io.input_path,),
        )

    def replace(self, layer: Any = None, *, error: bool = False) -> Any:  # checked by replace_keys
        """Replace the MLP output of ``layer`` by its transcoder's output, in the current trace only (where a
        circuit-tracer file's hooks say so, ``post_feedforward_layernorm``'s output: :meth:`site`).

        Inside ``tracer.invoke(...)``: for that invoke's rows only (other invokes keep the site's own output;
        :func:`~.splice_chain.splice_chain`, *Rows*).

        Call inside ``model.trace(...)`` before anything at or after that layer's MLP is read.
        Returns the transcoder's envoy (a dict ``{layer: envoy}`` for several layers; all layers
        of the set when ``layer`` is None), whose children ``hook_sae_acts_pre``,
        ``hook_sae_acts_post`` (the features, ``(batch, pos, d_sae)``), ``hook_sae_recons`` (the
        output, ``(batch, pos, d_model)``) and ``hook_error`` can be read and edited in the trace.

        Args:
            layer: layer index, several, or None for every layer of the set.
            error: add the exact error term ``MLP − transcoder`` (through ``hook_error``): the
                model's outputs are then the unmodified model's (bit for bit,
                every dtype), while edits to the
                features still change them (the error is held fixed).

        Raises:
            LayerOutOfRangeError: no transcoder for ``layer``.
            TraceOrderError: the model already ran that layer's MLP in this pass.
            TraceOrderError: called outside a trace.
            InvokeRowsError: (in the run) its internals read or edited from an invoke that did not call it.
            ArgumentError: a key of the wrong type (``2.0``, ``"2"`` for a layer) or an empty list.

        Source: Dunefsky et al. 2024, *Transcoders Find Interpretable LLM Feature Circuits*; nnsight 0.8
        ``docs/patterns/sae-and-auxiliary-modules.md``.
        """
        return super(TranscoderSet, self).replace(layer, error=error)

    @classmethod
    def from_pretrained(cls, model: Any, sources: Any, *, format: str = "auto", adapter: Any = None,
                        **kwargs: Any) -> TranscoderSet:
        """Load transcoders from checkpoint files and attach each at the layer its file names.

        ``sources``: a checkpoint directory (or hub repo id), several,
        or ``{layer: directory}``; a directory may hold several (a sparsify run, a circuit-tracer
        set). A Hugging Face repo id (``"owner/name"``, ``"owner/name:folder"``; a string that is no local
        path) is downloaded first — a set published by :meth:`~.replacement_set.ReplacementSet.push_to_hub`
        or single checkpoints — with ``revision=``, ``subfolder=``, ``local_files_only=`` (docs/hub.md).
        Each goes through ``formats.load``. ``format``: ``"auto"`` (from the files,
        :func:`~..formats.registry.detect_format`), ``"saelens"``, ``"sparsify"``, ``"llamascopium"``,
        ``"nnsight_lorsa"``, ``"circuit_tracer"``; ``kwargs`` go to the reader (``norm_scaling_factor``,
        ``device``, ``dtype``, …).
        The layer of each transcoder is read from its file (``TranscoderConfig.layer``, SAELens /
        llamascopium hook names, sparsify hookpoints, circuit-tracer layer files).

        Raises:
            ConfigMismatchError: a file names no layer (pass ``{layer: directory}``), a width that is
                not the model's, two transcoders for one layer; a file that holds an SAE.
            LayerOutOfRangeError: a layer the model does not have.
            CheckpointError, UnsupportedArchitectureError: from the loaders.

        Source: Dunefsky et al. 2024, *Transcoders Find Interpretable LLM Feature Circuits*; nnsight 0.8
        ``docs/patterns/sae-and-auxiliary-modules.md``.
        """

        from ..adapters.registry import get_adapter
        from ..formats.hook_sites import transcoder_layer

        adapter = get_adapter(model) if adapter is None else adapter
        out = cls(model, {}, adapter)

        def layer_of(name: str, module: Transcoder) -> int | None:
            named = out.key_of_folder(name)
            return named if named is not None else transcoder_layer(module)

        out.update(load_keyed(model, sources, Transcoder, layer_of, format=format, noun="a transcoder",
                              hint=" (use SAESet)", key_name="layer", adapter=adapter, d_model=adapter.d_model,
                              **kwargs))
        return out
