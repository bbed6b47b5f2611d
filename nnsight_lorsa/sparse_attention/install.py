"""Put gates on a model's attention modules (and take them off), read their edge statistics.

Works on a Hugging Face ``*ForCausalLM`` or on an nnsight model wrapping one: each attention
module (found through the architecture adapters: Llama, Mistral, Qwen2/3, GPT-NeoX, GPT-2, Gemma-2/3) gets an
:class:`~nnsight_lorsa.modules.attention_gate.AttentionGate` child named ``gate``, and the model's
attention implementation is switched to the gated function (:mod:`.attention`; the switch and the child
through :mod:`nnsight_lorsa.adapters.transformers_internals`). No model code is copied or patched: the
model's own forward computes Q/K/V and RoPE and calls the function through transformers'
``AttentionInterface``. Under nnsight the gate of layer ``L`` is an envoy, e.g.
``model.model.layers[L].self_attn.gate.output`` (the ``(batch, heads, q, k)`` gate matrix).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._checks import is_int
from .._placement import placement
from ..adapters.registry import get_adapter
from ..adapters.transformers_internals import attn_implementation, child, remove_child, set_attn_implementation
from ..envoy.nnsight_internals import hf_module, is_envoy
from ..errors import GateConfigError, GateNotInstalledError
from ..modules.attention_gate import AttentionGate
from .attention import ATTN_IMPLEMENTATION, GATE_NAME, register_gated_attention

#: attribute on the HF model remembering the attention implementation before installation
_DENSE_ATTR = "_nnsight_lorsa_dense_attn_implementation"


def _module_device(module: nn.Module, root: nn.Module) -> torch.device:
    """The device of ``module``'s first parameter (else ``root``'s).

    Raises:
        PlacementError: that parameter is on ``meta`` (the model's weights were never loaded).
    """
    has_params = next(module.parameters(), None) is not None
    device, _ = placement(module if has_params else root, type(module).__name__)
    return device


def install_gated_attention(model: Any, *, init_bias: float = 10.0, temperature: float = 1.0,
                            mode: str = "gated", top_k: int = 1) -> dict[int, AttentionGate]:
    """Attach one :class:`AttentionGate` per layer and switch the model to gated attention.

    Draye et al. 2025 §3.1 (Eq. 1-2), footnote 1: the bias starts at ``init_bias`` so that all gates
    are open at initialisation (``init_bias = 30`` reproduces the original model to fp32 rounding;
    smaller values let the gates learn faster). Each gate is created in fp32 on its attention module's
    device (the gate computes in fp32 whatever the model's dtype).

    Args:
        model: a transformers ``*ForCausalLM`` or an nnsight model wrapping one (dispatched here
            if it was loaded lazily).
        init_bias, temperature, mode, top_k: see :class:`AttentionGate`.

    Returns:
        ``{layer: gate}``.

    Raises:
        UnsupportedArchitectureError: no adapter for the model family, or the model does not use
            transformers' attention interface.
        GateConfigError: gates are already installed, or a bad gate setting.
        PlacementError: the model's weights are on the ``meta`` device.

    Source: Draye et al. 2025, *Sparse Attention Post-Training for Mechanistic Interpretability* §3.1 (the gated
    attention layer).
    """
    if is_envoy(model) and getattr(model, "dispatched", True) is False:
        model.dispatch()  # an nnsight model loaded lazily: attach to the real weights, not the meta ones
    hf = hf_module(model)
    adapter = get_adapter(hf)
    if hasattr(hf, _DENSE_ATTR):
        raise GateConfigError("gated attention is already installed on this model (uninstall it first)")
    register_gated_attention()
    n_heads = adapter.n_heads
    modules = [adapter.attention_module(hf, layer) for layer in range(adapter.n_layers)]  # raises before any change
    # each gate on its attention module's device (a model split over devices keeps each layer's gate with it)
    gates = {layer: AttentionGate(n_heads, init_bias, temperature, mode, top_k).to(_module_device(attn, hf))
             for layer, attn in enumerate(modules)}
    for layer, attn in zip(gates, modules, strict=True):
        if child(attn, GATE_NAME) is not None:
            raise GateConfigError(f"attention module of layer {layer} already has a child named {GATE_NAME!r}")
    dense = attn_implementation(hf)
    set_attn_implementation(hf, ATTN_IMPLEMENTATION)
    setattr(hf, _DENSE_ATTR, dense)
    for layer, attn in zip(gates, modules, strict=True):
        gates[layer].train(attn.training)
        if is_envoy(model):
            from ..envoy.nnsight_internals import mount

            mount(model.get(adapter.attention_path(layer)), GATE_NAME, gates[layer])
        else:
            attn.add_module(GATE_NAME, gates[layer])
    return gates


def uninstall_gated_attention(model: Any) -> None:
    """Remove the gates and restore the attention implementation the model had before.

    Raises:
        GateNotInstalledError: the model carries no gates.
    """
    hf = hf_module(model)
    if not hasattr(hf, _DENSE_ATTR):
        raise GateNotInstalledError("gated attention is not installed on this model")
    adapter = get_adapter(hf)
    for layer in range(adapter.n_layers):
        attn = adapter.attention_module(hf, layer)
        if is_envoy(model):
            from ..envoy.nnsight_internals import unmount

            gate = child(attn, GATE_NAME)
            assert gate is not None
            unmount(model.get(adapter.attention_path(layer)), GATE_NAME, gate, True)
        else:
            remove_child(attn, GATE_NAME)
    set_attn_implementation(hf, getattr(hf, _DENSE_ATTR))
    delattr(hf, _DENSE_ATTR)


def get_gates(model: Any) -> dict[int, AttentionGate]:
    """``{layer: gate}`` of a model with gated attention installed.

    Raises:
        GateNotInstalledError: some attention module has no gate.
    """
    hf = hf_module(model)
    adapter = get_adapter(hf)
    out: dict[int, AttentionGate] = {}
    for layer in range(adapter.n_layers):
        gate = child(adapter.attention_module(hf, layer), GATE_NAME)
        if not isinstance(gate, AttentionGate):
            raise GateNotInstalledError(f"layer {layer} has no gate; call install_gated_attention(model) first")
        out[layer] = gate
    return out


@contextmanager
def counting_positions(model: Any, positions: torch.Tensor | None) -> Iterator[None]:
    """Within the block, every gate's edge statistics (expected, active and allowed edges: the sparsity term and
    the logged fractions) count only the query rows ``positions`` marks: ``(batch, seq)`` bool for the windows of
    the forward passes run inside, e.g. each right-padded window's real tokens (its padding left out). ``None``:
    every position, as outside the block. The gates' matrices, and so the model's outputs, do not change.

    Raises:
        GateNotInstalledError: no gates.
    """
    gates = list(get_gates(model).values())
    for gate in gates:
        gate.counted_queries = positions
    try:
        yield
    finally:
        for gate in gates:
            gate.counted_queries = None


def set_gate_mode(model: Any, mode: str, top_k: int | None = None) -> None:
    """Set every gate's mode (``gated`` / ``topk`` / ``dense``) and, for ``topk``, ``top_k``.

    Raises:
        GateConfigError: unknown mode or ``top_k`` not an int ≥ 1 (every gate keeps its settings);
        GateNotInstalledError: no gates.

    Source: Draye et al. 2025, *Sparse Attention Post-Training for Mechanistic Interpretability* §3.1 (the gated
    attention layer).
    """
    gates = list(get_gates(model).values())
    before = [(gate.mode, gate.top_k) for gate in gates]
    try:
        for gate in gates:
            gate.mode = mode
            if top_k is not None:
                gate.top_k = int(top_k) if is_int(top_k) else top_k  # anything else: check() refuses it
            gate.check()
    except Exception:  # nothing half-applied: every gate keeps its previous settings
        for gate, (old_mode, old_k) in zip(gates, before, strict=True):
            gate.mode, gate.top_k = old_mode, old_k
        raise


@dataclass
class EdgeStatistics:
    """Edge counts of the last forward pass, per layer and head, summed over batch and positions.

    ``expected``: Σσ(gate logit) over allowed edges (Draye et al. 2025 Eq. 3); ``active``: edges with a
    non-zero gate (after any nnsight edit); ``possible``: allowed (causal, non-padded) edges. All
    ``(n_layers, n_heads)`` float tensors.
    """

    expected: torch.Tensor
    active: torch.Tensor
    possible: torch.Tensor

    @property
    def active_fraction(self) -> float:
        """Active edges / allowed edges over all layers and heads."""
        return float(self.active.sum() / self.possible.sum().clamp_min(1))

    @property
    def expected_fraction(self) -> float:
        """Expected edges / allowed edges over all layers and heads."""
        return float(self.expected.sum() / self.possible.sum().clamp_min(1))


def edge_statistics(model: Any) -> EdgeStatistics:
    """The :class:`EdgeStatistics` of the last forward pass of ``model``.

    Raises:
        GateNotInstalledError: no gates, or the model has not run since they were installed.

    Source: Draye et al. 2025, *Sparse Attention Post-Training for Mechanistic Interpretability* §3.1 (the gated
    attention layer).
    """
    gates = get_gates(model)
    rows = []
    for layer, gate in gates.items():
        if gate.expected_edges is None or gate.active_edges is None or gate.possible_edges is None:
            raise GateNotInstalledError(f"the gate of layer {layer} has not run yet")
        rows.append((gate.expected_edges, gate.active_edges, gate.possible_edges))
    exp, act, pos = (torch.stack([r[i].float().cpu() for r in rows]) for i in range(3))
    return EdgeStatistics(expected=exp, active=act, possible=pos)


def expected_edge_fraction(model: Any) -> torch.Tensor:
    """Differentiable Σ_layers Σ_heads Σσ(logit) / Σ allowed edges of the last forward (training loss),
    fp32 on the first layer's gate's device.

    Raises:
        GateNotInstalledError: no gates, or the last forward ran without gradients or not in
            ``gated`` mode.
    """
    num: torch.Tensor | None = None
    den = 0.0
    for layer, gate in get_gates(model).items():
        if gate.expected_edges_grad is None or gate.possible_edges is None:
            raise GateNotInstalledError(f"the gate of layer {layer} did not run with gradients in 'gated' mode")
        s = gate.expected_edges_grad.sum().float()
        num = s if num is None else num + s.to(num.device)  # fp32, on the first layer's device
        den += float(gate.possible_edges.sum())
    assert num is not None
    return num / max(den, 1.0)
