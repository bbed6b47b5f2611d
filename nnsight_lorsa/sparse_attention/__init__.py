"""Sparse-attention post-training (Draye et al. 2025, *Sparse Attention Post-Training for Mechanistic
Interpretability*): gated attention inside the model's own modules.

``install_gated_attention(model)`` gives every attention module a learnable gate
``A_ij ~ Bernoulli(σ(q_i·k_j/√d + b))`` multiplying the (not renormalised) softmax weights;
``set_gate_mode`` switches it (learned, top-k baseline, dense) and ``edge_statistics`` counts the edges
of the last forward pass; ``train_sparse_attention`` minimises the expected number of edges under
``CE <= τ`` (GECO) and ``evaluate_sparse`` measures held-out CE and edges; ``save_sparse_model`` /
``load_gates`` keep a normal Hugging Face directory plus the gates (the format registry's
``"sparse_attention"`` gate files). See docs/sparse_attention.md.

The rest lives in the submodules: :mod:`.install` (``uninstall_gated_attention``, ``get_gates``,
``EdgeStatistics``), :mod:`.train` (``SparseAttentionTrainer``, step by step with checkpoints),
:mod:`.io` (``save_gates``, ``load_sparse_model``), :mod:`.geco`, :mod:`.attention` (the attention
function); the gate module is :class:`nnsight_lorsa.modules.attention_gate.AttentionGate`, the gate files
:mod:`nnsight_lorsa.formats.gate_format`, the errors (``GateConfigError``, ``GateNotInstalledError``,
``VacuousConstraintError``, ``HeldoutConstraintWarning``) :mod:`nnsight_lorsa.errors`.
"""

from __future__ import annotations

from .install import edge_statistics, install_gated_attention, set_gate_mode
from .io import load_gates, save_sparse_model
from .train import SparseTrainConfig, evaluate_sparse, train_sparse_attention

__all__ = [
    "SparseTrainConfig",
    "edge_statistics",
    "evaluate_sparse",
    "install_gated_attention",
    "load_gates",
    "save_sparse_model",
    "set_gate_mode",
    "train_sparse_attention",
]
