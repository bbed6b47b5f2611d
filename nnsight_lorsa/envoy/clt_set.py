"""``CLTSet``: a cross-layer transcoder spliced into every MLP of one nnsight model with ``replace``.

Usage::

    clt = CLTSet(model, cross_layer_transcoder)
    with model.trace(prompt):
        site = clt.replace()                              # MLP outputs -> CLT reconstructions
        acts0 = site.hook_sae_acts_post[0].output.save()  # layer-0 features (batch, pos, d_sae)
        site.hook_sae_acts_post[0].output[:, :, 5] = 0    # removed from every layer it writes to
        logits = model.lm_head.output.save()

The CLT's layer ``l`` encoder reads MLP ``l``'s input (``adapter.mlp_input``; a circuit-tracer file's hooks may name
the pre-MLP norm's input or its ``x / rms(x)``, and on Gemma-2/3 ``post_feedforward_layernorm``'s output as the
replaced one: :func:`~nnsight_lorsa.formats.hook_sites.mlp_site_io`); MLP ``l'``'s output
is replaced by ``Σ_{l ≤ l'} decoder_{l→l'}(acts_l) + b_dec[l']`` (Ameisen et al. 2025, *Circuit Tracing*,
cross-layer transcoders). This needs
one worker that visits the MLPs in order and carries the features forward:
:func:`.splice_chain.splice_chain` over ``adapter.mlp_path(0 … n_layers−1)`` (or the post-MLP norms), the CLT mounted at
the root as ``model.clt``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .._checks import check_flag
from .._placement import set_offload, to_module
from ..adapters.base import ArchitectureAdapter
from ..adapters.registry import get_adapter
from ..errors import ConfigMismatchError
from ..formats.hook_sites import check_mlp_hooks, mlp_site_io
from ..modules.clt import CrossLayerTranscoder
from .nnsight_internals import hf_module
from .replacement_set import ReplacementSet, check_load_placement, site_placement
from .splice_chain import SpliceChain

#: the one key of a CLTSet
KEY = "clt"


class CLTSet(ReplacementSet[str, CrossLayerTranscoder]):
    """A :class:`CrossLayerTranscoder` bound to a model whose first ``n_layers`` MLPs it replaces.

    CLT layer ``l`` is model layer ``l``. A :class:`~.replacement_set.ReplacementSet` with one key,
    ``"clt"`` (the mapping, placement, copy and labels of every set); ``replace()`` returns the CLT's
    one envoy.

    Args:
        model: an nnsight ``TransformersModel``/``LanguageModel``.
        clt: the cross-layer transcoder. It is moved (in place) to the device of the first MLP it
            replaces once the model's weights are loaded; its dtype is kept.

    Raises:
        UnsupportedArchitectureError: the model family has no adapter, or the CLT file's hooks name a tensor the
            set cannot read or write (``hook_resid_mid`` under GPT-NeoX's parallel residual; ``ln2.hook_normalized``
            where the norm is a LayerNorm with a gain; ``hook_resid_post``, unknown hooks:
            :func:`~nnsight_lorsa.formats.hook_sites.check_mlp_hooks`).
        ConfigMismatchError: not a CrossLayerTranscoder; its ``d_model`` differs from the model's, or it
            spans more layers than the model has.
        PlacementError: a CLT on the meta device for a model whose weights are loaded.

    Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); nnsight 0.8 envoys
    (``docs/patterns/sae-and-auxiliary-modules.md``).
    """

    attach_name = "clt"
    key_type = str
    what = "cross-layer transcoder"
    module_type = CrossLayerTranscoder
    slot = "transcoders"
    spans_layers = True

    def __init__(self, model: Any, clt: CrossLayerTranscoder, adapter: ArchitectureAdapter | None = None) -> None:
        super(CLTSet, self).__init__(model, {KEY: clt}, adapter)

    @property
    def clt(self) -> CrossLayerTranscoder:
        """The cross-layer transcoder.

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); nnsight 0.8 envoys
        (``docs/patterns/sae-and-auxiliary-modules.md``).
        """
        return self[KEY]

    def wrong_kind(self, key: Any, module: Any) -> str:
        return (f"CLTSet holds one CrossLayerTranscoder, got a {type(module).__name__} "
                "(per-layer transcoders go in a TranscoderSet)")

    def check(self, key: Any, module: CrossLayerTranscoder) -> str:
        """Validate ``(key, module)`` for this model and return the normalised key.

        Raises:
            ConfigMismatchError: a key other than ``"clt"``, a CLT whose ``d_in`` is not the model's ``d_model``, or
                one with more layers than the model.

        Source: ours (the shared contract of this package's replacement sets).
        """
        if key != KEY:
            raise ConfigMismatchError(f"a CLTSet holds one CLT under the key {KEY!r}, got {key!r}")
        if module.cfg.d_in != self.adapter.d_model:
            raise ConfigMismatchError(f"CLT has d_model={module.cfg.d_in}, the model has {self.adapter.d_model}")
        if module.n_layers > self.adapter.n_layers:
            raise ConfigMismatchError(f"CLT spans {module.n_layers} layers, the model has {self.adapter.n_layers}")
        check_mlp_hooks(module, self.adapter, hf_module(self.model), range(module.n_layers))
        return KEY

    def missing(self, key: Any) -> Exception:
        return ConfigMismatchError(f"a CLTSet holds one CLT under the key {KEY!r}, not {key!r}")

    def site_path(self, key: str = KEY) -> str:
        return self.adapter.mlp_path(0)  # the CLT runs where its first MLP does

    def n_latents(self, key: str = KEY) -> int:
        """``n_layers · d_sae``: every layer's features.

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); nnsight 0.8 envoys
        (``docs/patterns/sae-and-auxiliary-modules.md``).
        """
        return int(self.clt.n_layers * self.clt.cfg.d_sae)

    def feature_module(self, target: Any) -> Any:
        """The CLT, whose layer ``target.site`` has the features a ``Feature(layer, index, kind="transcoder")``
        indexes (``cfg.d_sae`` per layer).

        Raises:
            LayerOutOfRangeError: ``target.site`` is not a layer of the CLT.

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders; circuit-tracer's
        ``feature_intervention`` on CLT features).
        """
        self.clt._check_layer(target.site)
        return self.clt

    def feature_key(self, target: Any) -> str:
        """The set's one key: one splice computes every layer's features.

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders).
        """
        return KEY

    def feature_hook(self, envoy: Any, target: Any) -> Any:
        """``envoy.hook_sae_acts_post[target.site]``: layer ``target.site``'s features ``(batch, pos, d_sae)``. An
        edit there changes every MLP output ``l' ≥ target.site`` (its decoders write to all of them).

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders).
        """
        return envoy.hook_sae_acts_post[int(target.site)]

    def feature_output_path(self, target: Any) -> str | None:
        """The module whose output layer ``target.site``'s step replaces (the MLP, or Gemma-2/3's post-MLP norm).

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders).
        """
        return self.site().site_paths[int(target.site)]

    def by_layer(self) -> dict[int, Any]:
        """``{layer: CLTLayer}``: each layer of the CLT seen as a transcoder
        (:meth:`~nnsight_lorsa.modules.clt.CrossLayerTranscoder.by_layer`).

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); nnsight 0.8 envoys
        (``docs/patterns/sae-and-auxiliary-modules.md``).
        """
        return dict(self.clt.by_layer())

    def envoys(self, spliced: dict[str, Any]) -> Any:
        return spliced[KEY]

    @classmethod
    def from_pretrained(cls, model: Any, path_or_repo_id: Any, *, format: str = "auto", adapter: Any = None,
                        **kwargs: Any) -> CLTSet:
        """Load a cross-layer transcoder (through ``formats.load``: ours or circuit-tracer's) and bind it.

        ``path_or_repo_id``: a checkpoint directory or hub repo id; ``format``: ``"auto"`` (from the
        files), ``"nnsight_lorsa"`` or ``"circuit_tracer"``; ``kwargs`` go to the reader (``device``,
        ``dtype`` (default: the model's), ``revision``, …), but ``offload=True``, as for every set
        (:func:`~.replacement_set.load_keyed`), marks the CLT offloaded before the set places it: it stays on
        the host and never occupies its site's device whole.

        Raises:
            CheckpointError: no recognisable checkpoint, a malformed one.
            ConfigMismatchError: the checkpoint holds no CLT, or one that does not fit the model.
            ArgumentError: ``offload`` not a bool; a bad ``dtype`` or ``device`` (``formats.load``).
            PlacementError: a ``device`` this machine lacks, or ``meta`` (before anything is read).

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); nnsight 0.8 envoys
        (``docs/patterns/sae-and-auxiliary-modules.md``).
        """
        from ..formats.registry import load

        offload = check_flag(kwargs.pop("offload", False), "offload", "from_pretrained")
        check_load_placement(kwargs)
        adapter = get_adapter(model) if adapter is None else adapter
        if kwargs.get("dtype") is None:
            kwargs["dtype"] = site_placement(model, "")[1]
        clt = load(path_or_repo_id, format=format, d_model=adapter.d_model, **kwargs)
        if not cls.holds(clt):
            raise ConfigMismatchError(f"{path_or_repo_id}: holds a {type(clt).__name__}, not a cross-layer transcoder")
        set_offload(clt, offload)
        return cls(model, clt, adapter)

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write the CLT to ``directory`` (``formats.save``, the ``"nnsight_lorsa"`` format);
        :meth:`from_pretrained` reads it back.

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); nnsight 0.8 envoys
        (``docs/patterns/sae-and-auxiliary-modules.md``).
        """
        from ..formats.registry import save

        save(self.clt, directory)

    def folder(self, key: str) -> str:
        """``"."``: :meth:`save` writes the CLT at the set's top (its card lists it there).

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); nnsight 0.8 envoys
        (``docs/patterns/sae-and-auxiliary-modules.md``).
        """
        return "."

    def subset(self, keys: Any = None, transform: Any = None) -> CLTSet:
        """This CLT (it spans every MLP, so ``keys`` selects nothing), passed through ``transform``.

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); nnsight 0.8 envoys
        (``docs/patterns/sae-and-auxiliary-modules.md``).
        """
        return CLTSet(self.model, self.clt if transform is None else transform(self.clt), self.adapter)

    def label(self, key: str) -> str:
        return ".clt"

    def __repr__(self) -> str:
        return f"CLTSet({self.adapter.family}, n_layers={self.clt.n_layers}, d_sae={self.clt.cfg.d_sae})"

    def site(self, key: str = KEY) -> SpliceChain:
        """The chain of MLP sites ``0 … n_layers−1`` and the per-layer step.

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); nnsight 0.8 envoys
        (``docs/patterns/sae-and-auxiliary-modules.md``).
        """
        adapter, root = self.adapter, hf_module(self.model)
        ios = [mlp_site_io(self.clt, adapter, root, layer) for layer in range(self.clt.n_layers)]

        def step(module: Any, layer: int, args: tuple, kwargs: dict, true_out: torch.Tensor,
                 acts: dict) -> torch.Tensor:
            # the first argument of the input module's call (the MLP's, or the pre-MLP norm's for hook_resid_mid /
            # ln2.hook_normalized on an RMSNorm: x / rms(x) of it); the CLT's device and dtype
            xm = to_module(ios[layer].read(adapter.mlp_input(args, kwargs)), module)
            acts[layer] = module.encode_layer(xm, layer)
            return module.reconstruct_layer([acts[source] for source in range(layer + 1)], layer, xm)

        return SpliceChain(
            site_paths=tuple(io.output_path for io in ios),
            attach_path="",
            attach_name=self.attach_name,
            step=step,
            get_output=adapter.mlp_output,
            set_output=adapter.with_mlp_output,
            error_hook=lambda module, layer: module.get_submodule(f"hook_error.{layer}"),
            input_paths=tuple(io.input_path for io in ios),
        )

    def replace(self, key: Any = None, *, error: bool = False) -> Any:
        """Replace the output of every MLP ``0 … n_layers−1`` by the CLT's, in the current trace only.

        Inside ``tracer.invoke(...)``: for that invoke's rows only (other invokes keep the site's own output;
        :func:`~.splice_chain.splice_chain`, *Rows*).

        Call inside ``model.trace(...)`` before anything at or after layer 0's MLP is read.
        Returns the CLT's envoy (``model.clt``), whose per-layer children
        ``hook_sae_acts_pre[l]``, ``hook_sae_acts_post[l]`` (layer ``l``'s features,
        ``(batch, pos, d_sae)``), ``hook_sae_recons[l]`` (MLP ``l``'s replacement) and
        ``hook_error[l]`` can be read and edited in layer order. An edit to layer ``l``'s
        features changes every MLP output ``l' ≥ l``.

        Args:
            key: None or ``"clt"`` (the set's one key).
            error: add at every MLP the exact error term ``MLP_l − CLT_l`` computed without edits
                (through ``hook_error[l]``): the model's outputs are then the unmodified model's,
                while edits to the features still change them (the errors are held fixed).

        Raises:
            TraceOrderError: the model already ran one of the MLPs in this pass.
            TraceOrderError: called outside a trace.
            InvokeRowsError: (in the run) its internals read or edited from an invoke that did not call it.

        Source: Ameisen et al. 2025, *Circuit Tracing* (cross-layer transcoders); nnsight 0.8 envoys
        (``docs/patterns/sae-and-auxiliary-modules.md``).
        """
        check_flag(error, "error", "CLTSet.replace")
        return self.splice_one(KEY, self[KEY if key is None else key], error)
