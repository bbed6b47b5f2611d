"""Gated attention as a transformers attention function, run inside the model's own modules.

Draye et al. 2025 §3.1, Eq. (2): ``SparseAttention(Q, K, V) = [A ⊙ softmax(QKᵀ/√d)] V`` — the softmax
is the model's ordinary one (causal and padding mask included) and is *not* renormalised after
the gate. The function has the signature of transformers' attention interface
(``AttentionInterface``; the model calls it after its own Q/K/V projections, RoPE and KV cache)
and is registered under the name :data:`ATTN_IMPLEMENTATION`; the model keeps its code, weights
and module tree, plus one :class:`~nnsight_lorsa.modules.attention_gate.AttentionGate` child per attention module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._placement import f32, narrows_range
from .._typing import Float
from ..errors import GateNotInstalledError

#: Name under which the function (and the eager float mask) is registered with transformers.
ATTN_IMPLEMENTATION = "nnsight_lorsa_gated"
#: Attribute of the attention module that holds its :class:`~nnsight_lorsa.modules.attention_gate.AttentionGate`.
GATE_NAME = "gate"


def _valid_mask(attention_mask: torch.Tensor | None, q_len: int, k_len: int, device: torch.device,
                causal: bool) -> torch.Tensor:
    """Boolean ``(batch|1, 1, q, k)`` mask of allowed edges from a transformers mask (float/bool/None)."""
    if attention_mask is None:
        if not causal:
            return torch.ones(1, 1, q_len, k_len, dtype=torch.bool, device=device)
        # queries are the last q_len positions of the k_len keys (prefill: q_len == k_len)
        q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
        return (torch.arange(k_len, device=device)[None, :] <= q_pos)[None, None]
    mask = attention_mask[..., :k_len]
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def gated_attention_forward(
    module: nn.Module,
    query: Float[torch.Tensor, "batch heads q d"],
    key: Float[torch.Tensor, "batch kv_heads k d"],
    value: Float[torch.Tensor, "batch kv_heads k dv"],
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Float[torch.Tensor, "batch q heads dv"], Float[torch.Tensor, "batch heads q k"]]:
    """Attention ``(A ⊙ softmax(QKᵀ·scaling + mask)) V`` with ``A = module.gate(QKᵀ·scaling, allowed)``.

    Draye et al. 2025 §3.1, Eq. (2). Shapes follow transformers' attention interface: ``query``
    ``(batch, heads, q, d)``, ``key``/``value`` ``(batch, kv_heads, k, d)`` (grouped-query attention:
    ``heads`` a multiple of ``kv_heads``, each KV head repeated for its group as in ``repeat_kv``),
    ``attention_mask`` the additive float mask ``(batch, 1, q, k)`` (0 allowed, dtype-min masked),
    a boolean one (``True`` allowed) or ``None`` (causal). ``scaling`` defaults to ``d**-0.5``.
    A ``softcap`` keyword (Gemma-2's ``attn_logit_softcapping``, passed by its attention module) caps the
    scaled scores to ``softcap · tanh(scores / softcap)`` before the mask, as transformers' Gemma-2 eager code;
    the gate sees the capped scores. Softmax runs in float32 and is cast back, as in the Llama/GPT-NeoX eager code.

    Precision: in bf16, fp32 and fp64 the scores ``QKᵀ·scaling`` are formed in the model's dtype, bit for bit
    transformers' eager attention. In fp16 (the one dtype whose range, ±65504, is narrower than fp32's) they are
    formed in fp32 (:func:`~nnsight_lorsa._placement.f32`, as the Lorsa's and the MHSA's explicit patterns): the
    unscaled fp16 ``q·k`` of large queries and keys passes 65504 and would be ``inf`` (the softmax NaN, the logits
    NaN) where the model's SDPA attention, which accumulates scores in fp32, is finite. The gate then sees fp32
    scores and returns an fp32 gate matrix (its ``.output`` under nnsight); the mask is applied at fp32's minimum
    (an fp16 additive mask's -65504 does not mask a score past it), and the softmax and ``A ⊙ softmax`` are rounded
    once to fp16 before ``@ V``, as eager rounds them.

    Returns:
        ``(output (batch, q, heads, dv), weights (batch, heads, q, k))`` with ``weights = A ⊙ softmax``, both in
        ``query``'s dtype.

    Raises:
        GateNotInstalledError: ``module`` has no
            :class:`~nnsight_lorsa.modules.attention_gate.AttentionGate` child named ``gate``.
    """
    gate = getattr(module, GATE_NAME, None)
    if gate is None:
        raise GateNotInstalledError(
            f"{type(module).__name__} has no '{GATE_NAME}' submodule but runs with attention implementation "
            f"{ATTN_IMPLEMENTATION!r}; call nnsight_lorsa.sparse_attention.install_gated_attention(model) first"
        )
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:  # GQA: expand the KV heads to the query heads (transformers' repeat_kv)
        key = key.repeat_interleave(n_rep, dim=1)
        value = value.repeat_interleave(n_rep, dim=1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    widen = narrows_range(torch.float32, query.dtype)  # fp16: q·k past 65504 would be inf
    scores = (torch.matmul(f32(query), f32(key).transpose(2, 3)) if widen
              else torch.matmul(query, key.transpose(2, 3))) * scaling
    softcap = kwargs.get("softcap")
    if softcap is not None:  # Gemma-2: capped before the mask
        scores = torch.tanh(scores / softcap) * softcap
    valid = _valid_mask(attention_mask, query.shape[2], key.shape[2], query.device,
                        bool(getattr(module, "is_causal", True)))
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        logits = scores + attention_mask[..., : key.shape[2]]
        if widen:  # an fp16 mask's -65504 does not mask an fp32 score past 65504
            logits = logits.masked_fill(~valid, torch.finfo(scores.dtype).min)
    else:
        logits = scores.masked_fill(~valid, torch.finfo(scores.dtype).min)
    probs = nn.functional.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    # a static KV cache: keys in every preallocated slot, the filled ones up to the longest row's last position
    # (a row of a padded batch is as long as the batch; the mask is read on the device, no host sync)
    positions = kwargs.get("position_ids")
    k_len, q_len = key.shape[2], query.shape[2]
    gate.key_extent = (torch.clamp(positions.max() + 1, max=k_len)
                       if isinstance(positions, torch.Tensor) and positions.numel() and k_len > q_len else None)
    gate_matrix = gate(scores, valid)
    with torch.no_grad():
        gate.active_edges = ((gate_matrix != 0) & gate.counted(valid)).sum(dim=(0, 2, 3)).to(torch.float32)
    weights = gate_matrix.to(probs.dtype) * probs
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return out, weights


def register_gated_attention() -> None:
    """Register :func:`gated_attention_forward` (and the eager float mask) with transformers, once.

    Idempotent. Afterwards ``model.set_attn_implementation(ATTN_IMPLEMENTATION)`` makes every
    attention module of a model call the gated function.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, gated_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, eager_mask)
