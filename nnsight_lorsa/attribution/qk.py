"""QK attribution for a Lorsa head: which node pairs make query ``i`` attend to key ``j``.

With the attention-input norm and the QK-norm scales frozen, a Lorsa QK head's query
``q_i = RoPE_i(w_q ⊙ (x_i W_Q + b_Q)·σ_q,i)`` and key ``k_j`` are linear in the residual-stream
contributions of the graph's nodes (Kamath et al. 2025; Llamascopium QK tracing; open in
circuit-tracer, issue #53). So ``q_i = Σ_a q^(a) + q^bias`` and ``k_j = Σ_b k^(b) + k^bias``, where
``q^(a) = ∂q_i/∂M_a`` is node ``a``'s contribution (through frozen MHSA layers where there is no
Lorsa) and ``q^bias`` the ``b_Q`` term; the attention score is the sum of the pair terms

    score_ij = q_i·k_j / attn_scale = Σ_{a,b} q^(a)·k^(b) / attn_scale   (a, b ∈ nodes ∪ {bias}),

exactly. The marginals ``Σ_b`` (query side) and ``Σ_a`` (key side) say how much each node on one
side contributes given the whole other side. Computed in one nnsight trace: ``2·d_qk`` backward
rows (one per query/key coordinate) through the frozen model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._repr import FieldsRepr
from ..errors import LayerOutOfRangeError, ShapeError
from ..modules.rotary import apply_rotary, rotary_cos_sin
from .graph import NodeTable
from .layout import Layout
from .replacement import FrozenReplacement
from .rows import FixedRows
from .trace import attribute_in_trace, prepare


@dataclass(repr=False)
class QKProbe(FieldsRepr):
    """Which score to decompose: Lorsa at ``layer``, QK group ``group``, query ``query_pos``, key ``key_pos``."""

    layer: int
    group: int
    query_pos: int
    key_pos: int


def _frozen_side(frozen: FrozenReplacement, lorsa: Any, x: torch.Tensor, positions: torch.Tensor, probe: QKProbe,
                 side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(vector (batch, d_qk), bias part (d_qk,))`` of the query (``side="q"``) or key at its position."""
    g = probe.group
    pos = probe.query_pos if side == "q" else probe.key_pos
    W = (lorsa.W_Q if side == "q" else lorsa.W_K)[g].to(x.dtype)
    b = (lorsa.b_Q if side == "q" else lorsa.b_K)[g].to(x.dtype)
    pre = x[:, pos] @ W + b  # (batch, d_qk)
    bias = b[None]
    if lorsa.cfg.qk_norm:
        norm = lorsa.ln_q if side == "q" else lorsa.ln_k
        key = f"L{probe.layer}.lorsa.{side}norm.{g}.{pos}"
        scale = frozen.const(key, lambda: torch.rsqrt(pre.pow(2).mean(-1, keepdim=True) + norm.eps))
        pre, bias = norm.w[g].to(x.dtype) * pre * scale, norm.w[g].to(x.dtype) * bias * scale[:1]
    if lorsa.cfg.rotary is not None:
        p = positions.reshape(-1, positions.shape[-1])[0, pos:pos + 1]
        cos, sin = rotary_cos_sin(lorsa.cfg.rotary, p)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)

        def rot(v: torch.Tensor) -> torch.Tensor:
            return apply_rotary(v[:, None, None, :], cos, sin, lorsa.cfg.rotary.interleaved)[:, 0, 0]

        pre, bias = rot(pre), rot(bias)
    return pre, bias[0]


class QKFrozenReplacement(FrozenReplacement):
    """The frozen forward that, at the probed Lorsa layer, records the query and key vectors."""

    def __init__(self, layout: Layout, M: torch.Tensor, mhsa: dict[int, Any], probe: QKProbe) -> None:
        super(QKFrozenReplacement, self).__init__(layout, M, mhsa)
        self.probe = probe
        self.q: torch.Tensor | None = None
        self.k: torch.Tensor | None = None
        self.q_bias: torch.Tensor | None = None
        self.k_bias: torch.Tensor | None = None

    def attention(self, layer: int, x: torch.Tensor, positions: torch.Tensor, true_out: torch.Tensor) -> torch.Tensor:
        if layer == self.probe.layer:
            lorsa = self.layout.layers[layer].lorsa
            self.q, self.q_bias = _frozen_side(self, lorsa, x, positions, self.probe, "q")
            self.k, self.k_bias = _frozen_side(self, lorsa, x, positions, self.probe, "k")
        return super(QKFrozenReplacement, self).attention(layer, x, positions, true_out)

    def target_pieces(self) -> list[torch.Tensor]:
        """The query's coordinates ``(batch, d_qk)``, then the key's."""
        assert self.q is not None and self.k is not None
        return [self.q, self.k]


@dataclass(repr=False)
class QKAttribution(FieldsRepr):
    """The decomposition of one Lorsa attention score.

    Attributes:
        nodes: the :class:`NodeTable` of the candidate source nodes (every non-logit node of the
            prompt; most contribute 0 on one side).
        query: ``(n_nodes + 1, d_qk)`` each node's contribution to ``q_i``, last row the ``b_Q`` term.
        key: ``(n_nodes + 1, d_qk)`` likewise for ``k_j``.
        pairs: ``(n_nodes + 1, n_nodes + 1)`` ``query @ key.T / attn_scale`` — sums to ``score``.
        score: the attention score ``q_i·k_j / attn_scale`` (pre-softmax logit).
        probe: which head / positions.
    """

    nodes: NodeTable
    query: torch.Tensor
    key: torch.Tensor
    pairs: torch.Tensor
    score: float
    probe: QKProbe

    @property
    def query_marginal(self) -> torch.Tensor:
        """``(n_nodes + 1,)`` ``q^(a)·k_j / attn_scale``."""
        return self.pairs.sum(1)

    @property
    def key_marginal(self) -> torch.Tensor:
        """``(n_nodes + 1,)`` ``q_i·k^(b) / attn_scale``."""
        return self.pairs.sum(0)

    def label(self, i: int) -> str:
        return "bias (b_Q/b_K)" if i == len(self.nodes) else self.nodes.label(i)

    def top_pairs(self, n: int = 10) -> list[tuple[str, str, float]]:
        """The ``n`` largest ``|pair|`` terms as ``(query node, key node, value)``."""
        flat = self.pairs.flatten()
        idx = flat.abs().topk(min(n, flat.numel())).indices
        m = self.pairs.shape[1]
        return [(self.label(int(i) // m), self.label(int(i) % m), float(flat[i])) for i in idx]


def qk_attribution(replacement: Any, prompt: Any, *, layer: int, head: int, query_pos: int, key_pos: int,
                   batch_size: int | None = None) -> QKAttribution:
    """Decompose Lorsa OV head ``head``'s attention score from ``query_pos`` to ``key_pos``
    (its QK group ``head // group_size``) into pairs of graph nodes; see the module docstring.

    Args:
        replacement: a :class:`~nnsight_lorsa.envoy.replacement_model.ReplacementModel` with a Lorsa
            at ``layer`` (its transcoders, if any, make transcoder features candidate nodes).
        prompt: text or ``(pos,)`` token ids.
        layer, head: the Lorsa layer and OV head; query_pos, key_pos: token positions.
        batch_size: backward rows per pass (default ``2·d_qk``: one pass).

    Returns:
        :class:`QKAttribution` (``pairs`` in pre-softmax score units, summing to ``score``).

    Raises:
        LayerOutOfRangeError: no Lorsa at ``layer``.
        ShapeError: a head or position out of range, or ``key_pos > query_pos`` (causal).
    """
    model = replacement.model
    prepared = prepare(replacement, prompt)
    layout, mhsa, adapter = prepared.layout, prepared.mhsa, prepared.adapter
    lorsa = layout.layers[adapter.check_layer(layer)].lorsa
    if lorsa is None:
        raise LayerOutOfRangeError(f"no Lorsa at layer {layer}")
    if not 0 <= head < lorsa.cfg.n_ov_heads:
        raise ShapeError(f"head {head} out of range [0, {lorsa.cfg.n_ov_heads})")
    n = layout.n_pos
    if not (0 <= key_pos <= query_pos < n):
        raise ShapeError(f"need 0 <= key_pos <= query_pos < {n}, got key_pos={key_pos}, query_pos={query_pos}")
    probe = QKProbe(layer, head // lorsa.cfg.group_size, query_pos, key_pos)
    d = lorsa.cfg.d_qk_head
    rows = FixedRows(2 * d, layout.n_sources)
    extra: dict[str, Any] = {}

    def make(layout_: Layout, M: torch.Tensor, mhsa_: dict[int, Any]) -> FrozenReplacement:
        frozen = QKFrozenReplacement(layout_, M, mhsa_, probe)
        extra["frozen"] = frozen
        return frozen

    values = attribute_in_trace(model, adapter, layout, mhsa, rows, batch_size or 2 * d, make=make)
    frozen = extra["frozen"]
    _, grads = rows.matrix()
    q_bias = frozen.q_bias.detach().to(grads.dtype).cpu()
    k_bias = frozen.k_bias.detach().to(grads.dtype).cpu()
    query = torch.cat([grads[:d].T, q_bias[None]])
    key = torch.cat([grads[d:].T, k_bias[None]])
    scale = float(lorsa.cfg.scale)
    pairs = query @ key.T / scale
    score = float(values[:d].double() @ values[d:].double()) / scale
    nodes = layout.nodes.select(torch.arange(layout.n_sources))
    return QKAttribution(nodes=nodes, query=query, key=key, pairs=pairs, score=score, probe=probe)
