"""The attention gate: a binary matrix ``A`` that opens or closes each query-key edge.

Draye et al. 2025 §3.1, Eq. (1)-(3) (SPARTAN hard attention): ``A_ij ~ Bernoulli(σ(q_i·k_j/√d + b))``.
In training the sample is hard (0/1) and differentiable through a straight-through estimator
with logistic noise (a binary Gumbel-softmax: ``hard = [l + L > 0]`` with ``L ~ Logistic(0, 1)``
is exactly a ``Bernoulli(σ(l))`` draw, and the backward pass uses ``σ((l + L) / T)``). In
evaluation the gate is deterministic, ``A = [l > 0]``. The expected number of edges is
``E|A| = Σ σ(l)`` over the positions the causal/padding mask allows (Eq. 3).

The module is torch-only. One instance sits on each attention module (``self_attn.gate``, put there by
:func:`~nnsight_lorsa.sparse_attention.install_gated_attention`); the attention function
(:mod:`nnsight_lorsa.sparse_attention.attention`) calls it with the scaled scores, so under nnsight its
``.output`` is the gate matrix of that layer, readable and editable inside a trace.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .._checks import is_int, is_real
from .._typing import Bool, Float
from ..errors import GateConfigError

__all__ = ["GATE_MODES", "AttentionGate"]

#: Gate modes. ``gated``: the learned Bernoulli gate (sampled in training, ``logit > 0`` in eval);
#: ``topk``: keep the ``top_k`` largest attention weights per query (the dense baseline of paper
#: Fig. 2a); ``dense``: every allowed edge open (the unmodified attention).
GATE_MODES = ("gated", "topk", "dense")


class AttentionGate(nn.Module):
    """Per-layer gate with one learnable bias per head (Draye et al. 2025 §3.1, Eq. 1-3).

    ``forward(scores, valid) -> A`` with ``scores = q·kᵀ·scaling`` of shape
    ``(batch, heads, q_len, k_len)`` and ``valid`` the boolean mask of allowed edges (broadcastable
    to the same shape; ``True`` = the causal/padding mask lets the query see the key). ``A`` has the
    shape of ``scores``, values in ``{0, 1}`` (float, the scores' dtype) and is 0 wherever ``valid``
    is ``False``. The gate logit is ``scores + bias[head]``, computed in fp32.

    After each call the module keeps (detached, fp32, per head, summed over batch and allowed edges — of the
    query rows of :attr:`counted_queries` when set):
    ``expected_edges`` (Σσ(logit), Eq. 3), ``possible_edges`` (number of allowed edges) and
    ``expected_edges_grad`` (the same sum, *not* detached, for the sparsity loss). The attention
    function adds ``active_edges`` (non-zero entries of the gate matrix it multiplied with, i.e. after
    any edit made through nnsight). A copy (``copy.deepcopy``, pickling) keeps the detached statistics
    but not ``expected_edges_grad`` (None in the copy: a node of the original's autograd graph, which
    ``deepcopy`` refuses; the copy's own forward sets it).

    Args:
        n_heads: query heads of the attention module.
        init_bias: initial bias (nats of gate logit). Large values open every gate: with
            ``init_bias = 30`` the gated model equals the original to fp32 rounding.
        temperature: ``T`` of the straight-through backward pass (> 0).
        mode: one of :data:`GATE_MODES`.
        top_k: edges kept per query in ``topk`` mode (>= 1).

    Raises:
        GateConfigError: unknown ``mode``, ``n_heads`` not an int ``>= 1``, ``init_bias`` not a finite number,
            ``temperature`` not a number ``> 0`` or ``top_k`` not an int ``>= 1`` (until 2026-11-28 a float or
            string head count, temperature or ``top_k`` escaped as torch's / Python's ``TypeError`` / ``ValueError``,
            and a NaN ``init_bias`` closed every gate silently).
    """

    def __init__(self, n_heads: int, init_bias: float = 10.0, temperature: float = 1.0,
                 mode: str = "gated", top_k: int = 1) -> None:
        super(AttentionGate, self).__init__()
        if not is_int(n_heads) or int(n_heads) < 1:
            raise GateConfigError(f"n_heads must be an int >= 1, got {n_heads!r}")
        if not is_real(init_bias) or not math.isfinite(init_bias):
            raise GateConfigError(f"init_bias must be a finite number, got {init_bias!r}")
        if not is_real(temperature):
            raise GateConfigError(f"temperature must be a number > 0, got {temperature!r}")
        if not is_int(top_k):
            raise GateConfigError(f"top_k must be an int >= 1, got {top_k!r}")
        n_heads = int(n_heads)
        self.bias = nn.Parameter(torch.full((n_heads,), float(init_bias), device="cpu"))  # placed by install
        self.temperature = float(temperature)
        self.mode = mode
        self.top_k = int(top_k)
        self.check()
        self.expected_edges_grad: torch.Tensor | None = None
        self.expected_edges: torch.Tensor | None = None
        self.possible_edges: torch.Tensor | None = None
        self.active_edges: torch.Tensor | None = None
        #: ``(batch, positions)`` bool or None (default): the query positions whose edges the statistics count
        #: (None: every position). Set for one forward by
        #: :func:`~nnsight_lorsa.sparse_attention.install.counting_positions` (the padding of right-padded
        #: windows left out); the gate matrix itself does not depend on it.
        self.counted_queries: torch.Tensor | None = None
        #: 0-d int tensor or None (default): the keys of this call that exist — a static KV cache's filled slots,
        #: whose mask spans every preallocated slot (query ``i`` of ``q``'s own key is then ``key_extent − q + i``,
        #: not ``k − q + i``). Set per call by the gated attention forward from the call's ``position_ids``.
        self.key_extent: torch.Tensor | None = None

    def counted(self, valid: Bool[torch.Tensor, "*b"]) -> Bool[torch.Tensor, "*c"]:
        """``valid`` restricted to the real query rows — those whose own key (query ``i`` of ``q`` is position
        ``k − q + i``, or ``key_extent − q + i`` in a static cache's call) is allowed: a padded position's row is
        left out, so right padding's rows, which see the real keys before them, count no edges — and to the query
        rows of :attr:`counted_queries` (its last ``q`` positions for the ``q`` queries of ``valid``): the edges the
        statistics count.

        Raises:
            GateConfigError: :attr:`counted_queries` not ``(batch, ≥ q)`` for ``valid``'s batch and queries.
        """
        q, k = valid.shape[-2], valid.shape[-1]
        if q <= k:  # a query row whose own key is masked is padding (its real keys are not its edges to count)
            # the own keys end at the last key, or at a static cache's last filled slot (until 2026-11-29 read at
            # k − q + i there too, in unfilled slots: every row taken for padding, no edge counted)
            end = k if self.key_extent is None else self.key_extent.to(valid.device)
            own_col = (end - q + torch.arange(q, device=valid.device)).clamp(0, k - 1)
            own = valid.gather(-1, own_col.view(*([1] * (valid.dim() - 2)), q, 1).expand(*valid.shape[:-1], 1))
            valid = valid & own
        rows = self.counted_queries
        if rows is None:
            return valid
        if rows.dim() != 2 or rows.shape[1] < q or valid.shape[0] not in (1, rows.shape[0]):
            raise GateConfigError(f"counted_queries is {tuple(rows.shape)}, the attention has {valid.shape[0]} "
                                  f"windows of {q} queries: pass one (batch, positions) mask per forward")
        return valid & rows[:, -q:].to(valid.device, torch.bool)[:, None, :, None]

    def __getstate__(self) -> dict[str, Any]:
        # the last forward's differentiable edge count is a non-leaf tensor of that forward's graph: deepcopy refuses
        # it (a model deep-copied after a training forward failed), and a copy must not backpropagate into the
        # original's graph — the copy starts without it (as after an eval forward)
        state = dict(super(AttentionGate, self).__getstate__())
        state["expected_edges_grad"] = None
        return state

    @property
    def n_heads(self) -> int:
        return int(self.bias.shape[0])

    def check(self) -> None:
        """Validate ``mode``, ``temperature`` and ``top_k`` (raises :class:`GateConfigError`)."""
        if self.mode not in GATE_MODES:
            raise GateConfigError(f"unknown gate mode {self.mode!r}; expected one of {GATE_MODES}")
        if not self.temperature > 0:
            raise GateConfigError(f"temperature must be > 0, got {self.temperature}")
        if not is_int(self.top_k) or self.top_k < 1:  # 2.5 is not rounded, True is no count
            raise GateConfigError(f"top_k must be an int >= 1, got {self.top_k!r}")

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, mode={self.mode!r}, temperature={self.temperature}, top_k={self.top_k}"

    def logits(self, scores: Float[torch.Tensor, "batch heads q k"]) -> Float[torch.Tensor, "batch heads q k"]:
        """Gate logits ``scores + bias[head]`` (paper Eq. 1 inside the sigmoid), in fp32 on the scores'
        device whatever the model's dtype (a bf16/fp16 logit would quantise the gate's decision and its
        noise)."""
        if scores.shape[1] != self.n_heads:
            raise GateConfigError(f"scores have {scores.shape[1]} heads, the gate has {self.n_heads}")
        bias = self.bias.to(device=scores.device, dtype=torch.float32)
        return scores.to(torch.float32) + bias[None, :, None, None]

    def forward(self, scores: Float[torch.Tensor, "batch heads q k"],
                valid: Bool[torch.Tensor, "*b"]) -> Float[torch.Tensor, "batch heads q k"]:
        """The gate matrix ``A`` (see the class docstring) and the edge statistics of this call.

        The gate is computed in fp32 and returned in the scores' dtype (exact: its values are 0 and 1);
        the edge statistics are fp32 (a bf16 count of thousands of edges is not exact; an fp16 one
        overflows past 65504). The training noise is drawn on the scores' device.
        """
        self.check()
        valid = valid.to(scores.device).expand_as(scores)
        counted = self.counted(valid)  # the edges the statistics count (padding's query rows left out)
        logits = self.logits(scores)
        if self.mode == "gated" and torch.is_grad_enabled():
            expected = torch.sigmoid(logits).masked_fill(~counted, 0.0).sum(dim=(0, 2, 3))
            self.expected_edges_grad = expected
        else:
            with torch.no_grad():
                expected = torch.sigmoid(logits).masked_fill(~counted, 0.0).sum(dim=(0, 2, 3))
            self.expected_edges_grad = None
        self.expected_edges = expected.detach()
        self.possible_edges = counted.sum(dim=(0, 2, 3)).to(torch.float32)
        zero = torch.zeros((), dtype=scores.dtype, device=scores.device)
        if self.mode == "dense":
            return torch.where(valid, torch.ones_like(scores), zero)
        if self.mode == "topk":
            masked = scores.masked_fill(~valid, float("-inf"))
            k = min(self.top_k, scores.shape[-1])
            idx = masked.topk(k, dim=-1).indices
            keep = torch.zeros_like(valid).scatter(-1, idx, True) & valid
            return torch.where(keep, torch.ones_like(scores), zero)
        if self.training:
            u = torch.rand_like(logits).clamp(1e-6, 1.0 - 1e-6)  # fp32: 1 - 1e-6 is not 1.0
            noisy = logits + torch.log(u) - torch.log1p(-u)
            soft = torch.sigmoid(noisy / self.temperature)
            hard = (noisy > 0).to(torch.float32)
            gate = hard + (soft - soft.detach())  # straight-through: forward hard, backward soft
        else:
            gate = (logits > 0).to(torch.float32)
        return torch.where(valid, gate.to(scores.dtype), zero)
