"""``CLTSet``: a cross-layer transcoder spliced into every MLP of one nnsight model with ``replace``.

Usage::

    clt = CLTSet(model, cross_layer_transcoder)
    with model.trace(prompt):
        site = clt.replace()                              # MLP outputs -> CLT reconstructions
        acts0 = site.hook_sae_acts_post[0].output.save()  # layer-0 features (batch, pos, d_sae)
        site.hook_sae_acts_post[0].output[:, :, 5] = 0    # removed from every layer it writes to
        logits = model.lm_head.output.save()

The CLT's layer ``l`` encoder reads MLP ``l``'s input (``adapter.mlp_input``); MLP ``l'``'s output
is replaced by ``Σ_{l ≤ l'} decoder_{l→l'}(acts_l) + b_dec[l']`` (Ameisen et al. 2025, *Circuit Tracing*,
cross-layer transcoders). This needs
one worker that visits the MLPs in order and carries the features forward:
:func:`.splice_chain.splice_chain` over ``adapter.mlp_path(0 … n_layers−1)``, the CLT mounted at
the root as ``model.clt``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .._placement import place, to_module
from ..adapters.base import ArchitectureAdapter
from ..adapters.registry import get_adapter
from ..errors import ConfigMismatchError
from ..modules.clt import CrossLayerTranscoder
from .replacement_set import check_flag, site_placement
from .splice_chain import SpliceChain, splice_chain


class CLTSet:
    """A :class:`CrossLayerTranscoder` bound to a model whose first ``n_layers`` MLPs it replaces.

    CLT layer ``l`` is model layer ``l``.

    Args:
        model: an nnsight ``TransformersModel``/``LanguageModel``.
        clt: the cross-layer transcoder.

    Raises:
        UnsupportedArchitectureError: the model family has no adapter.
        ConfigMismatchError: the CLT's ``d_model`` differs from the model's, or it spans more
            layers than the model has.
    """

    attach_name = "clt"

    def __init__(self, model: Any, clt: CrossLayerTranscoder, adapter: ArchitectureAdapter | None = None) -> None:
        self.model = model
        self.adapter = adapter if adapter is not None else get_adapter(model)
        if not isinstance(clt, CrossLayerTranscoder):
            raise ConfigMismatchError(f"CLTSet holds one CrossLayerTranscoder, got a {type(clt).__name__} "
                                      "(per-layer transcoders go in a TranscoderSet)")
        if clt.cfg.d_in != self.adapter.d_model:
            raise ConfigMismatchError(f"CLT has d_model={clt.cfg.d_in}, the model has {self.adapter.d_model}")
        if clt.n_layers > self.adapter.n_layers:
            raise ConfigMismatchError(f"CLT spans {clt.n_layers} layers, the model has {self.adapter.n_layers}")
        self.clt = clt
        self.place()  # the CLT runs where its first MLP does (the splice moves outputs to each MLP's device)

    @classmethod
    def from_pretrained(cls, model: Any, path_or_repo_id: Any, *, format: str = "auto", adapter: Any = None,
                        **kwargs: Any) -> CLTSet:
        """Load a cross-layer transcoder (through ``formats.load``: ours or circuit-tracer's) and bind it.

        ``path_or_repo_id``: a checkpoint directory or hub repo id; ``format``: ``"auto"`` (from the
        files), ``"nnsight_lorsa"`` or ``"circuit_tracer"``; ``kwargs`` go to the reader (``device``,
        ``dtype``, ``revision``, …).

        Raises:
            CheckpointError: no recognisable checkpoint, a malformed one.
            ConfigMismatchError: the checkpoint holds no CLT, or one that does not fit the model.
        """
        from ..formats.registry import load

        adapter = get_adapter(model) if adapter is None else adapter
        if kwargs.get("dtype") is None:
            kwargs["dtype"] = site_placement(model, "")[1]
        clt = load(path_or_repo_id, format=format, d_model=adapter.d_model, **kwargs)
        if not isinstance(clt, CrossLayerTranscoder):
            raise ConfigMismatchError(f"{path_or_repo_id}: holds a {type(clt).__name__}, not a cross-layer transcoder")
        return cls(model, clt, adapter)

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write the CLT to ``directory`` (``formats.save``, the ``"nnsight_lorsa"`` format);
        :meth:`from_pretrained` reads it back."""
        from ..formats.registry import save

        save(self.clt, directory)

    # the replacement-set contract (ReplacementSet's mapping, copy and labels): one key, the CLT
    key_type = str

    def items(self) -> list[tuple[str, CrossLayerTranscoder]]:
        return [("clt", self.clt)]

    def subset(self, keys: Any = None, transform: Any = None) -> CLTSet:
        """This CLT (it spans every MLP, so ``keys`` selects nothing), passed through ``transform``."""
        return CLTSet(self.model, self.clt if transform is None else transform(self.clt), self.adapter)

    def label(self, key: str) -> str:
        return ".clt"

    def place(self) -> None:
        """Move the CLT (in place) to the device of the first MLP it replaces (after moving the model)."""
        device, _ = site_placement(self.model, self.adapter.mlp_path(0))
        if device is not None:
            place(self.clt, device, self.adapter.mlp_path(0))

    def __repr__(self) -> str:
        return f"CLTSet({self.adapter.family}, n_layers={self.clt.n_layers}, d_sae={self.clt.cfg.d_sae})"

    def site(self) -> SpliceChain:
        """The chain of MLP sites ``0 … n_layers−1`` and the per-layer step."""
        adapter = self.adapter

        def step(module: torch.nn.Module, layer: int, args: tuple, kwargs: dict, true_out: torch.Tensor,
                 acts: dict) -> torch.Tensor:
            assert isinstance(module, CrossLayerTranscoder)
            xm = to_module(adapter.mlp_input(args, kwargs), module)  # the CLT's device and dtype
            acts[layer] = module.encode_layer(xm, layer)
            return module.reconstruct_layer([acts[source] for source in range(layer + 1)], layer, xm)

        return SpliceChain(
            site_paths=tuple(adapter.mlp_path(layer) for layer in range(self.clt.n_layers)),
            attach_path="",
            attach_name=self.attach_name,
            step=step,
            get_output=adapter.mlp_output,
            set_output=adapter.with_mlp_output,
            error_hook=lambda module, layer: module.get_submodule(f"hook_error.{layer}"),
        )

    def replace(self, *, error: bool = False) -> Any:
        """Replace the output of every MLP ``0 … n_layers−1`` by the CLT's, in the current trace only.

        Call inside ``model.trace(...)`` before anything at or after layer 0's MLP is read.
        Returns the CLT's envoy (``model.clt``), whose per-layer children
        ``hook_sae_acts_pre[l]``, ``hook_sae_acts_post[l]`` (layer ``l``'s features,
        ``(batch, pos, d_sae)``), ``hook_sae_recons[l]`` (MLP ``l``'s replacement) and
        ``hook_error[l]`` can be read and edited in layer order. An edit to layer ``l``'s
        features changes every MLP output ``l' ≥ l``.

        Args:
            error: add at every MLP the exact error term ``MLP_l − CLT_l`` computed without edits
                (through ``hook_error[l]``): the model's outputs are then the unmodified model's,
                while edits to the features still change them (the errors are held fixed).

        Raises:
            TraceOrderError: the model already ran one of the MLPs in this pass.
            TraceOrderError: called outside a trace.
        """
        return splice_chain(self.model, self.site(), self.clt, error=check_flag(error, "error", "CLTSet.replace"))
