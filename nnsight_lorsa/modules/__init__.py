"""The replacement modules as plain PyTorch (torch only: no nnsight needed to import or run them).

* :class:`Lorsa` (+ :class:`LorsaConfig`, :class:`RotaryConfig`) — Low-Rank Sparse Attention: many
  rank-1-OV heads sharing grouped QK heads, top-k sparse per token (Lorsa paper §3, App. A–B).
* Sparse coders on one dictionary core (:class:`~.sparse_coder.SparseCoder`): :class:`SparseAutoencoder`,
  :class:`Transcoder`, :class:`SkipTranscoder`, :class:`CrossLayerTranscoder` (Bricken et al. 2023, *Towards
  Monosemanticity*; Ameisen et al. 2025, *Circuit Tracing*),
  with the activations :class:`ReLU`, :class:`TopK`, :class:`BatchTopK`, :class:`JumpReLU`,
  :class:`AbsTopK`, :class:`GroupMax`.
* :class:`ReplacementModule` — their shared base: :attr:`~ReplacementModule.weights_owner`, the module whose
  weights one computes with (itself; a CLT's per-layer view, :class:`~.clt.CLTLayer`: the CLT).
* :class:`HookPoint` — the identity module whose envoy exposes an internal (``hook_z``, ``hook_sae_acts_post`` …).
"""

from .activations import AbsTopK, BatchTopK, GroupMax, JumpReLU, ReLU, TopK, make_activation
from .clt import CLTConfig, CrossLayerTranscoder
from .hook_point import HookPoint
from .lorsa import Lorsa, LorsaKV
from .lorsa_config import LorsaConfig
from .replacement_module import ReplacementModule
from .rotary import RotaryConfig
from .sae import SAEConfig, SparseAutoencoder
from .transcoder import SkipTranscoder, Transcoder, TranscoderConfig

__all__ = [
    "AbsTopK", "BatchTopK", "CLTConfig", "CrossLayerTranscoder", "GroupMax", "HookPoint", "JumpReLU", "Lorsa",
    "LorsaConfig", "LorsaKV", "ReLU", "ReplacementModule", "RotaryConfig", "SAEConfig", "SkipTranscoder",
    "SparseAutoencoder", "TopK", "Transcoder", "TranscoderConfig", "make_activation",
]
