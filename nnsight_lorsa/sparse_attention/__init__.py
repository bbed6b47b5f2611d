"""Sparse-attention post-training (Draye et al. 2025, *Sparse Attention Post-Training for Mechanistic
Interpretability*): gated attention inside the model's own modules.

``install_gated_attention(model)`` gives every attention module a learnable gate
``A_ij ~ Bernoulli(σ(q_i·k_j/√d + b))`` multiplying the (not renormalised) softmax weights;
``train_sparse_attention`` minimises the expected number of edges under ``CE <= τ`` (GECO);
``save_sparse_model`` / ``load_gates`` keep a normal Hugging Face directory plus the gates.
See docs/sparse_attention.md.
"""

from __future__ import annotations

from .attention import ATTN_IMPLEMENTATION, gated_attention_forward, register_gated_attention
from .errors import GateConfigError, GateNotInstalledError, VacuousConstraintError
from .gate import GATE_MODES, AttentionGate
from .geco import GECO
from .install import (
    EdgeStatistics,
    edge_statistics,
    expected_edge_fraction,
    get_gates,
    install_gated_attention,
    set_gate_mode,
    uninstall_gated_attention,
)
from .io import GateConfig, load_gates, load_sparse_model, save_gates, save_sparse_model
from .train import SparseAttentionTrainer, SparseTrainConfig, evaluate_sparse, train_sparse_attention

__all__ = [
    "ATTN_IMPLEMENTATION",
    "GATE_MODES",
    "GECO",
    "AttentionGate",
    "EdgeStatistics",
    "GateConfig",
    "GateConfigError",
    "GateNotInstalledError",
    "SparseAttentionTrainer",
    "SparseTrainConfig",
    "edge_statistics",
    "evaluate_sparse",
    "expected_edge_fraction",
    "gated_attention_forward",
    "get_gates",
    "install_gated_attention",
    "load_gates",
    "load_sparse_model",
    "register_gated_attention",
    "save_gates",
    "save_sparse_model",
    "set_gate_mode",
    "train_sparse_attention",
    "uninstall_gated_attention",
    "VacuousConstraintError",
]
