"""``LorsaSet``: the per-layer Lorsas of one nnsight model, spliced in with ``replace``.

>>> lorsa = LorsaSet(model, {2: lorsa_layer2})           # doctest: +SKIP
>>> with model.trace(prompt):                              # doctest: +SKIP
...     site = lorsa.replace(layer=2)                      # MHSA output -> Lorsa output
...     z = site.hook_z.output.save()                      # (batch, pos, n_ov_heads)
...     site.hook_z.output[:, :, 7] = 0                    # ablate head 7
...     logits = model.lm_head.output.save()
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..adapters.base import ArchitectureAdapter
from ..adapters.registry import get_adapter
from ..errors import ConfigMismatchError, LayerOutOfRangeError, LorsaError
from ..modules.lorsa import Lorsa
from .replacement_set import load_keyed, replace_keys
from .splice import SpliceSite, splice


def _check_not_cached_step(layer: int) -> Any:
    def check(args: tuple, kwargs: dict) -> None:
        cache = kwargs.get("past_key_values")
        if cache is not None and hasattr(cache, "get_seq_length") and cache.get_seq_length(layer) > 0:
            raise LorsaError(
                "replace() runs Lorsa on whole sequences and has no KV cache: it cannot replace "
                "a cached generation step. Use model.trace on the full sequence instead of generate."
            )

    return check


class LorsaSet:
    """The Lorsas of one model, keyed by layer; ``replace(layer=L)`` splices them into a trace.

    Args:
        model: an nnsight ``TransformersModel``/``LanguageModel`` (the root envoy).
        lorsas: ``{layer: Lorsa}``; each must fit the model (``d_model``; ``cfg.layer`` if set).

    Raises:
        UnsupportedArchitectureError: the model family has no adapter.
        LayerOutOfRangeError: a layer outside ``[0, n_layers)``.
        ConfigMismatchError: a Lorsa whose ``d_model`` (or recorded layer) differs from the model's.
    """

    def __init__(self, model: Any, lorsas: Mapping[int, Lorsa] | None = None,
                 adapter: ArchitectureAdapter | None = None) -> None:
        self.model = model
        self.adapter = adapter if adapter is not None else get_adapter(model)
        self._lorsas: dict[int, Lorsa] = {}
        for layer, module in (lorsas or {}).items():
            self[layer] = module

    # ---------------------------------------------------------------- mapping
    def __setitem__(self, layer: int, module: Lorsa) -> None:
        self.adapter.check_layer(layer)
        cfg = module.cfg
        if cfg.d_model != self.adapter.d_model:
            raise ConfigMismatchError(
                f"Lorsa for layer {layer} has d_model={cfg.d_model}, the model has {self.adapter.d_model}"
            )
        if cfg.layer is not None and cfg.layer != layer:
            raise ConfigMismatchError(f"Lorsa was trained for layer {cfg.layer}, not layer {layer}")
        self._lorsas[layer] = module

    def __getitem__(self, layer: int) -> Lorsa:
        if layer not in self._lorsas:
            raise LayerOutOfRangeError(f"no Lorsa for layer {layer}; this set has layers {self.layers}")
        return self._lorsas[layer]

    def __contains__(self, layer: object) -> bool:
        return layer in self._lorsas

    def __iter__(self) -> Iterator[int]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self._lorsas)

    @property
    def layers(self) -> list[int]:
        return sorted(self._lorsas)

    def __repr__(self) -> str:
        parts = ", ".join(f"{layer}: {self._lorsas[layer].cfg.n_ov_heads} heads" for layer in self.layers)
        return f"LorsaSet({self.adapter.family}, {{{parts}}})"

    # ------------------------------------------------------------------- io
    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write ``directory/layer_{L}/`` per Lorsa (safetensors + JSON, ``formats.save`` in the
        ``"nnsight_lorsa"`` format); :meth:`from_pretrained` reads it back."""
        from pathlib import Path  # local: pathlib is not on NDIF's unpickling whitelist

        from ..formats.registry import save

        for layer in self.layers:
            save(self._lorsas[layer], Path(directory) / f"layer_{layer}")

    @classmethod
    def from_pretrained(cls, model: Any, sources: Any, *, format: str = "auto", adapter: Any = None,
                        **kwargs: Any) -> LorsaSet:
        """Load Lorsas from checkpoints (through ``formats.load``) and attach each at its layer.

        ``sources``: a directory written by :meth:`save` (one ``layer_<L>/`` per layer), one Lorsa
        checkpoint (local directory or hub repo id, e.g. ``"org/repo:name"`` for Llamascopium),
        several, or ``{layer: source}``. ``format``: ``"auto"`` (from the files), ``"nnsight_lorsa"``
        or ``"llamascopium"``; ``kwargs`` go to the reader (``device``, ``dtype``, ``weights_folded``,
        ``revision``, …). The layer is the folder's ``layer_<L>`` name, else the checkpoint's ``cfg.layer``.

        Raises:
            CheckpointError: no recognisable checkpoint (``FormatDetectionError``), a malformed one.
            ConfigMismatchError: a checkpoint that holds no Lorsa, names no layer, or a second one
                for a layer; a Lorsa that does not fit the model.
        """
        import re

        def layer_of(name: str, module: Lorsa) -> int | None:
            named = re.fullmatch(r"layer_(\d+)", name)
            return int(named.group(1)) if named else module.cfg.layer

        lorsas = load_keyed(sources, Lorsa, layer_of, format=format, noun="a Lorsa", key_name="layer", **kwargs)
        return cls(model, lorsas, adapter)

    # -------------------------------------------------------------- splicing
    def site(self, layer: int) -> SpliceSite:
        """How layer ``layer``'s attention is spliced (its path, input and output handling)."""
        adapter = self.adapter

        def call(module: torch.nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
            x = adapter.attention_input(args, kwargs)
            positions = adapter.attention_positions(args, kwargs, x)
            mask = adapter.attention_mask(args, kwargs)
            param = next(module.parameters())
            if param.device != x.device:  # e.g. a Lorsa shipped from a CPU client to a GPU server
                module.to(x.device)
            return module(x.to(param.dtype), positions, mask).to(x.dtype)

        return SpliceSite(
            site_path=adapter.attention_path(layer),
            attach_name="lorsa",
            call=call,
            get_output=adapter.attention_output,
            set_output=adapter.with_attention_output,
            check_call=_check_not_cached_step(layer),
        )

    def replace(self, layer: Any = None, *, error: bool = False) -> Any:  # checked by replace_keys
        """Replace the MHSA output of ``layer`` by its Lorsa's output, in the current trace only.

        Call inside ``model.trace(...)`` before anything at or after that layer is read. Returns
        the Lorsa's envoy (a dict ``{layer: envoy}`` for several layers; all layers of the set
        when ``layer`` is None), whose children ``hook_q, hook_k`` ``(batch, n_qk_heads, pos,
        d_qk_head)``, ``hook_v, hook_z_pre, hook_z`` ``(batch, pos, n_ov_heads)``, ``hook_out``
        ``(batch, pos, d_model)`` and ``hook_error`` can be read and edited in the same trace.

        Args:
            layer: layer index, several, or None for every layer of the set.
            error: add the exact error term ``MHSA − Lorsa`` (through ``hook_error``): the
                model's outputs are then those of the unmodified model (fp32 < 1e-5), while
                edits to the Lorsa's internals still change them (the error is held fixed).

        Raises:
            LayerOutOfRangeError: no Lorsa for ``layer`` / outside the model.
            TraceOrderError: the model already ran that layer's attention in this pass.
            TraceOrderError: called outside a trace.
            ArgumentError: a key of the wrong type (``2.0``, ``"2"`` for a layer) or an empty list.
        """
        layers, single = replace_keys(layer, int, self.layers, "LorsaSet.replace(layer=...)")
        envoys = {}
        for L in layers:
            module = self[L]
            envoys[L] = splice(self.model, self.site(L), module, error=error)
        return envoys[layers[0]] if single else envoys
