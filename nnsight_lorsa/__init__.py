"""nnsight-lorsa: look inside attention with nnsight — Lorsa, transcoders and SAEs as envoys.

The workflows in twenty names (everything else lives in the subpackages, each with its own
``__all__``: :mod:`.modules`, :mod:`.adapters`, :mod:`.envoy`, :mod:`.formats`, :mod:`.training`,
:mod:`.attribution`, :mod:`.patching`, :mod:`.analysis`, :mod:`.viz`, :mod:`.sparse_attention`,
:mod:`.remote`, :mod:`.errors`)::

    from nnsight_lorsa import LorsaSet, ReplacementModel, attribute, load

    lorsas = LorsaSet.from_pretrained(model, "checkpoints/lorsa")   # or load(path) for one module
    with model.trace(prompt):
        site = lorsas.replace(layer=15)                  # MHSA output -> Lorsa output, this trace only
        z = nnsight.save(site.hook_z.output)             # (batch, pos, n_ov_heads)
    graph = attribute(ReplacementModel(model, lorsas=lorsas), prompt)

* modules (torch only): :class:`Lorsa`, :class:`LorsaConfig`, :class:`SparseAutoencoder`,
  :class:`Transcoder`, :class:`CrossLayerTranscoder`;
* nnsight glue: :class:`LorsaSet`, :class:`TranscoderSet`, :class:`SAESet`, :class:`CLTSet`, and
  :class:`ReplacementModel` (a model and its replacements: the argument of attribution, patching,
  analysis and remote); :func:`get_adapter` (the model family's adapter);
* files: :func:`load` / :func:`save` (ours, Llamascopium, SAELens, sparsify, circuit-tracer);
* attribution: :func:`attribute` → :class:`Graph`;
* training: :class:`Trainer`, :class:`TrainConfig`, :class:`TokenDataset`, :func:`evaluate`;
* :class:`LorsaError`, the base class of every error raised here (all in :mod:`.errors`).

``import nnsight_lorsa`` needs torch only: names that need nnsight load on first use.
See README.md and docs/ (docs/architecture.md for the layout).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from ._version import __version__ as __version__
from .errors import LorsaError
from .formats.registry import (  # eager: nnsight mounts a `save` on every object, which a lazy name would lose to
    load,
    save,
)
from .modules.clt import CrossLayerTranscoder
from .modules.lorsa import Lorsa
from .modules.lorsa_config import LorsaConfig
from .modules.sae import SparseAutoencoder
from .modules.transcoder import Transcoder

# name -> module that defines it; imported on first use so that `import nnsight_lorsa` needs torch only
_LAZY = {
    "LorsaSet": ".envoy.lorsa_set",
    "TranscoderSet": ".envoy.transcoder_set",
    "SAESet": ".envoy.sae_set",
    "CLTSet": ".envoy.clt_set",
    "ReplacementModel": ".envoy.replacement_model",
    "get_adapter": ".adapters.registry",
    "attribute": ".attribution.attribute",
    "Graph": ".attribution.graph",
    "Trainer": ".training.trainer",
    "TrainConfig": ".training.trainer",
    "TokenDataset": ".training.dataset",
    "evaluate": ".training.evaluate",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'nnsight_lorsa' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "CLTSet", "CrossLayerTranscoder", "Graph", "Lorsa", "LorsaConfig", "LorsaError", "LorsaSet", "ReplacementModel",
    "SAESet", "SparseAutoencoder", "TokenDataset", "TrainConfig", "Trainer", "Transcoder", "TranscoderSet",
    "attribute", "evaluate", "get_adapter", "load", "save",
]
