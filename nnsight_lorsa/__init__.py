"""nnsight-lorsa: Low-Rank Sparse Attention (Lorsa) and friends as nnsight envoys.

Torch-only primitives (no nnsight needed to import or run them)::

    from nnsight_lorsa import Lorsa, LorsaConfig, RotaryConfig, save_lorsa, load_lorsa

nnsight integration (imported on first use)::

    from nnsight_lorsa import LorsaSet
    lorsa = LorsaSet(model, {15: my_lorsa})
    with model.trace(prompt):
        site = lorsa.replace(layer=15)

See README.md and docs/ for the guided tour.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from ._version import __version__ as __version__
from .errors import (
    CheckpointError,
    ConfigMismatchError,
    LayerOutOfRangeError,
    LorsaError,
    ShapeError,
    TraceOrderError,
    UnsupportedArchitectureError,
)
from .modules.hook_point import HookPoint
from .modules.lorsa import Lorsa, LorsaCache
from .modules.lorsa_config import LorsaConfig
from .modules.rotary import RotaryConfig, apply_rotary, rotary_cos_sin

# name -> module that defines it; imported lazily so that `import nnsight_lorsa` needs torch only
_LAZY = {
    "LorsaSet": ".envoy.lorsa_set",
    "get_adapter": ".adapters.registry",
    "ArchitectureAdapter": ".adapters.base",
    "MHSAWeights": ".adapters.base",
    "mhsa_forward": ".adapters.base",
    "save_lorsa": ".formats.lorsa_format",
    "load_lorsa": ".formats.lorsa_format",
    "load_llamascopium_lorsa": ".formats.llamascopium",
    "save_sparse_coder": ".formats.sparse_coder_format",
    "load_sparse_coder": ".formats.sparse_coder_format",
    "load_llamascopium_sae": ".formats.llamascopium_sae",
    "load_saelens": ".formats.saelens",
    "save_saelens": ".formats.saelens",
    "load_sparsify": ".formats.sparsify",
    "save_sparsify": ".formats.sparsify",
    "load_circuit_tracer_transcoders": ".formats.circuit_tracer",
    "load_circuit_tracer_clt": ".formats.circuit_tracer",
    "save_circuit_tracer_clt": ".formats.circuit_tracer",
    "save_circuit_tracer_transcoders": ".formats.circuit_tracer",
    "Trainer": ".training.trainer",
    "TrainConfig": ".training.trainer",
    "attention_activations": ".envoy.read",
    "evaluate": ".training.evaluate",
    "SparseCoder": ".modules.sparse_coder",
    "SparseCoderConfig": ".modules.sparse_coder",
    "SparseAutoencoder": ".modules.sae",
    "SAEConfig": ".modules.sae",
    "Transcoder": ".modules.transcoder",
    "SkipTranscoder": ".modules.transcoder",
    "TranscoderConfig": ".modules.transcoder",
    "CrossLayerTranscoder": ".modules.clt",
    "CLTConfig": ".modules.clt",
    "ReLU": ".modules.activations",
    "TopK": ".modules.activations",
    "BatchTopK": ".modules.activations",
    "JumpReLU": ".modules.activations",
    "make_activation": ".modules.activations",
    "TranscoderSet": ".envoy.transcoder_set",
    "SAESet": ".envoy.sae_set",
    "CLTSet": ".envoy.clt_set",
    "ReplacementModel": ".envoy.replacement_model",
    "MHSAHead": ".envoy.targets",
    "LorsaHead": ".envoy.targets",
    "Feature": ".envoy.targets",
    "activation_patching": ".patching.experiments",
    "path_patching": ".patching.path_patching",
    "attribute": ".attribution.attribute",
    "Graph": ".attribution.graph",
    "prune": ".attribution.scores",
    "qk_attribution": ".attribution.qk",
    "install_gated_attention": ".sparse_attention.install",
    "train_sparse_attention": ".sparse_attention.train",
    "load_gates": ".sparse_attention.io",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'nnsight_lorsa' has no attribute {name!r}")


__all__ = [
    "CheckpointError", "ConfigMismatchError", "HookPoint", "LayerOutOfRangeError", "Lorsa", "LorsaCache",
    "LorsaConfig", "LorsaError", "RotaryConfig", "ShapeError", "TraceOrderError",
    "UnsupportedArchitectureError", "apply_rotary", "rotary_cos_sin", *_LAZY,
]
