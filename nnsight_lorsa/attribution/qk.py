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
from typing import TYPE_CHECKING, Any

import torch

from .._checks import check_int, is_int
from .._placement import resident, to_module
from .._repr import FieldsRepr
from ..errors import ArgumentError, LayerOutOfRangeError, ShapeError
from ..modules.rotary import apply_rotary, rotary_cos_sin
from .graph import HOST, NodeTable
from .layout import Layout
from .offload import LORSA_OV
from .replacement import FrozenReplacement, first, on
from .rows import FixedRows
from .trace import attribute_in_trace, prepare

if TYPE_CHECKING:
    from .offload import RowsPlace


@dataclass(repr=False)
class QKProbe(FieldsRepr):
    """Which score to decompose: Lorsa at ``layer``, QK group ``group``, query ``query_pos``, key ``key_pos``
    (-1: the key the head attends to most from ``query_pos``, resolved in the frozen pass)."""

    layer: int
    group: int
    query_pos: int
    key_pos: int = -1


def _frozen_side(frozen: FrozenReplacement, lorsa: Any, x: torch.Tensor, positions: torch.Tensor, probe: QKProbe,
                 side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(vector (batch, d_qk), bias part (d_qk,))`` of the query (``side="q"``) or key at its position."""
    g = probe.group
    pos = probe.query_pos if side == "q" else probe.key_pos
    W = on((lorsa.W_Q if side == "q" else lorsa.W_K)[g], x)  # the Lorsa's weights where the site's input is
    b = on((lorsa.b_Q if side == "q" else lorsa.b_K)[g], x)
    pre = x[:, pos] @ W + b  # (batch, d_qk)
    bias = b[None]
    if lorsa.cfg.qk_norm:
        norm = lorsa.ln_q if side == "q" else lorsa.ln_k
        key = f"L{probe.layer}.lorsa.{side}norm.{g}.{pos}"
        scale = frozen.const(key, lambda: torch.rsqrt(pre.pow(2).mean(-1, keepdim=True) + norm.eps))
        w_norm = on(norm.w[g], x)
        pre, bias = w_norm * pre * scale, w_norm * bias * scale[:1]
    if lorsa.cfg.rotary is not None:
        p = positions.reshape(-1, positions.shape[-1])[0, pos:pos + 1]
        cos, sin = rotary_cos_sin(lorsa.cfg.rotary, p, dtype=torch.promote_types(x.dtype, torch.float32))
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)

        def rot(v: torch.Tensor) -> torch.Tensor:
            return apply_rotary(v[:, None, None, :], cos, sin, lorsa.cfg.rotary.interleaved)[:, 0, 0]

        pre, bias = rot(pre), rot(bias)
    return pre, bias[0]


class QKFrozenReplacement(FrozenReplacement):
    """The frozen forward that, at each probed Lorsa layer, records every probe's query and key vectors;
    its targets are ``[q_1, k_1, q_2, k_2, …]`` (``d_qk`` coordinates each)."""

    def __init__(self, layout: Layout, M: torch.Tensor, mhsa: dict[int, Any], probes: list[QKProbe],
                 dtype: torch.dtype | None = None, offload_rows: RowsPlace = "host") -> None:
        super(QKFrozenReplacement, self).__init__(layout, M, mhsa, dtype=dtype, offload_rows=offload_rows)
        self.probes = probes
        self.sides: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * len(probes)

    def attention(self, layer: int, x: torch.Tensor, positions: torch.Tensor, true_out: torch.Tensor) -> torch.Tensor:
        lorsa = self.layout.layers[layer].lorsa
        for i, probe in enumerate(self.probes):
            if probe.layer != layer:
                continue
            if probe.key_pos < 0:  # the key the head attends to most: from the prompt copy (row 0)
                # where the Lorsa is (offloaded: its q/k weights on the site's device)
                with torch.no_grad(), resident(lorsa, x.device, LORSA_OV):
                    xm = to_module(x[:1], lorsa)
                    pattern = lorsa.attention_pattern(xm, None, first(positions).to(xm.device))
                probe.key_pos = int(pattern[0, probe.group, probe.query_pos].argmax())
            q, q_bias = _frozen_side(self, lorsa, x, positions, probe, "q")
            k, k_bias = _frozen_side(self, lorsa, x, positions, probe, "k")
            self.sides[i] = (q, q_bias, k, k_bias)
        return super(QKFrozenReplacement, self).attention(layer, x, positions, true_out)

    def target_pieces(self) -> list[torch.Tensor]:
        """Each probe's query coordinates ``(batch, d_qk)``, then its key's."""
        out = []
        for side in self.sides:
            assert side is not None
            out += [side[0], side[2]]
        return [t.to(self.M.device) for t in out]


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

    Source: Lorsa paper (He et al. 2025) §3.1 (QK heads); Kamath et al. 2025 (QK attribution); Llamascopium
    ``src/llamascopium/circuits/attribution.py`` (QK tracing).
    """

    nodes: NodeTable
    query: torch.Tensor
    key: torch.Tensor
    pairs: torch.Tensor
    score: float
    probe: QKProbe

    @property
    def query_marginal(self) -> torch.Tensor:
        """``(n_nodes + 1,)`` ``q^(a)·k_j / attn_scale``.

        Source: Lorsa paper (He et al. 2025) §3.1 (QK heads); Kamath et al. 2025 (QK attribution); Llamascopium
        ``src/llamascopium/circuits/attribution.py`` (QK tracing).
        """
        return self.pairs.sum(1)

    @property
    def key_marginal(self) -> torch.Tensor:
        """``(n_nodes + 1,)`` ``q_i·k^(b) / attn_scale``.

        Source: Lorsa paper (He et al. 2025) §3.1 (QK heads); Kamath et al. 2025 (QK attribution); Llamascopium
        ``src/llamascopium/circuits/attribution.py`` (QK tracing).
        """
        return self.pairs.sum(0)

    def label(self, i: int) -> str:
        """Label of pair side ``i``: a node's label, or ``"bias (b_Q/b_K)"`` for ``i == len(nodes)``.

        Source: Lorsa paper (He et al. 2025) §3.1 (QK heads); Kamath et al. 2025 (QK attribution); Llamascopium
        ``src/llamascopium/circuits/attribution.py`` (QK tracing).
        """
        return "bias (b_Q/b_K)" if i == len(self.nodes) else self.nodes.label(i)

    def top_pairs(self, n: int = 10) -> list[tuple[str, str, float]]:
        """The ``n`` largest ``|pair|`` terms as ``(query node, key node, value)``, largest first; equal ones
        by the smaller row-major (query node, key node) index (:func:`top_abs`).

        Source: Lorsa paper (He et al. 2025) §3.1 (QK heads); Kamath et al. 2025 (QK attribution); Llamascopium
        ``src/llamascopium/circuits/attribution.py`` (QK tracing).

        Raises:
            ArgumentError: ``n`` not an int ``>= 0``.
        """
        check_int("QKAttribution.top_pairs", "n", n, least=0)
        flat = self.pairs.flatten()
        idx = top_abs(flat, n)
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
        ArgumentError: ``replacement`` not a ReplacementModel; ``batch_size`` not None or an int ≥ 1; ``layer``,
            ``head``, ``query_pos`` or ``key_pos`` not an int (``True`` was head 1) — before the model runs.

    Source: Lorsa paper (He et al. 2025) §3.1 (QK heads); Kamath et al. 2025 (QK attribution); Llamascopium
    ``src/llamascopium/circuits/attribution.py`` (QK tracing).
    """
    from ..envoy.replacement_model import check_replacement_model

    check_replacement_model(replacement, "qk_attribution")
    for name, value in (("layer", layer), ("head", head), ("query_pos", query_pos), ("key_pos", key_pos)):
        if not is_int(value):
            raise ArgumentError(f"qk_attribution({name}=...) must be an int, got {value!r}")
    if batch_size is not None and (not is_int(batch_size) or batch_size < 1):  # 0 ran as the default
        raise ArgumentError(f"qk_attribution(batch_size=...) must be None or an int >= 1, got {batch_size!r}")
    prepared = prepare(replacement, prompt)
    layout, adapter = prepared.layout, prepared.adapter
    lorsa = layout.layers[adapter.check_layer(layer)].lorsa
    if lorsa is None:
        raise LayerOutOfRangeError(f"no Lorsa at layer {layer}")
    if not 0 <= head < lorsa.cfg.n_ov_heads:
        raise ShapeError(f"head {head} out of range [0, {lorsa.cfg.n_ov_heads})")
    n = layout.n_pos
    if not (0 <= key_pos <= query_pos < n):
        raise ShapeError(f"need 0 <= key_pos <= query_pos < {n}, got key_pos={key_pos}, query_pos={query_pos}")
    probe = QKProbe(layer, head // lorsa.cfg.group_size, query_pos, key_pos)
    [(query, key, score)] = trace_probes(replacement, prepared, [probe], batch_size or 2 * lorsa.cfg.d_qk_head)
    nodes = layout.nodes.select(torch.arange(layout.n_sources, device=HOST))
    return QKAttribution(nodes=nodes, query=query, key=key, pairs=query @ key.T / float(lorsa.cfg.scale),
                         score=score, probe=probe)


def trace_probes(replacement: Any, prepared: Any, probes: list[QKProbe], batch_size: int,
                 dtype: torch.dtype | None = None, offload_rows: RowsPlace = "host"
                 ) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """Every probe's ``(query (n_sources + 1, d_qk), key (n_sources + 1, d_qk), score)`` (as
    :class:`QKAttribution`'s; last rows the ``b_Q``/``b_K`` terms) from one frozen pass: ``2·d_qk``
    backward rows per probe, ``batch_size`` at a time. ``prepared``: the prompt's
    :class:`~.trace.Prepared`; a probe's ``key_pos`` -1 is resolved (in place) to the key its head
    attends to most. ``dtype``: what the frozen model computes in (None: the model's), the one ``prepared``'s
    replacement modules and MHSA weights were copied into (:func:`.trace.prepare`). ``offload_rows``: where the
    offloaded modules' active rows live (``"host"`` / ``"device"`` / the kept blocks' keys:
    :class:`.replacement.FrozenReplacement`)."""
    layout, mhsa, adapter = prepared.layout, prepared.mhsa, prepared.adapter
    dims = [layout.layers[p.layer].lorsa.cfg.d_qk_head for p in probes]
    rows = FixedRows(2 * sum(dims), layout.n_sources)
    extra: dict[str, Any] = {}

    def make(layout_: Layout, M: torch.Tensor, mhsa_: dict[int, Any]) -> FrozenReplacement:
        frozen = QKFrozenReplacement(layout_, M, mhsa_, probes, dtype, offload_rows)
        extra["frozen"] = frozen
        return frozen

    values = attribute_in_trace(replacement.model, adapter, layout, mhsa, rows, batch_size, make=make, dtype=dtype)
    frozen = extra["frozen"]
    _, grads = rows.matrix()
    out = []
    start = 0
    for probe, d, side in zip(probes, dims, frozen.sides, strict=True):
        lorsa = layout.layers[probe.layer].lorsa
        q_bias, k_bias = side[1].detach().to(HOST, grads.dtype), side[3].detach().to(HOST, grads.dtype)
        query = torch.cat([grads[start:start + d].T, q_bias[None]])
        key = torch.cat([grads[start + d:start + 2 * d].T, k_bias[None]])
        scale = float(lorsa.cfg.scale)
        qv, kv = values[start:start + d].double(), values[start + d:start + 2 * d].double()
        score = float(qv @ kv) / scale
        out.append((query, key, score))
        start += 2 * d
    return out


#: ``Graph.qk`` tensor names (``graph.safetensors`` keys ``qk.<name>``)
QK_FIELDS = ("probe", "score", "pair_sum_error", "pair_index", "pair_value", "query_marginal", "key_marginal")


def top_abs(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``min(k, n)`` largest ``|values|`` of a 1-D tensor, largest first; equal magnitudes by the
    smaller index (NaN counted as ``+inf``). ``topk`` alone picks among ties in no documented order (on the CPU
    not the first ones), so which of several equal pair terms a graph stores would depend on the backend."""
    k = min(k, values.numel())
    if k <= 0:
        return torch.zeros(0, dtype=torch.long, device=values.device)
    mag = values.abs()
    mag = torch.where(mag.isnan(), torch.full_like(mag, float("inf")), mag)
    kth = mag.topk(k).values[-1]
    above = (mag > kth).nonzero().flatten()
    ties = (mag == kth).nonzero().flatten()[:k - above.numel()]  # nonzero: ascending indices
    idx = torch.cat([above, ties]).sort().values
    return idx[mag[idx].sort(descending=True, stable=True).indices]


def top_pairs(query: torch.Tensor, key: torch.Tensor, scale: float, k: int, chunk: int = 1024
              ) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """The ``k`` largest ``|query_a·key_b| / scale`` pair terms ``((k, 2) indices, (k,) values)``, largest first,
    equal ones by the smaller row-major ``(a, b)`` (:func:`top_abs`), and the sums ``Σ pairs`` and ``Σ |pairs|`` —
    in query chunks, without the ``(n+1)²`` pair matrix."""
    m = key.shape[0]
    best_v = query.new_zeros(0)
    best_i = torch.zeros(0, dtype=torch.long, device=query.device)  # row-major flat indices, ascending
    total, mass = 0.0, 0.0
    for a0 in range(0, query.shape[0], chunk):
        block = query[a0:a0 + chunk] @ key.T / scale
        total += float(block.double().sum())
        mass += float(block.double().abs().sum())
        flat = block.flatten()
        top = top_abs(flat, k).sort().values  # this chunk's indices all follow the earlier chunks'
        best_v, best_i = torch.cat([best_v, flat[top]]), torch.cat([best_i, top + a0 * m])
        keep = top_abs(best_v, k)
        best_v, best_i = best_v[keep], best_i[keep]
        order = best_i.sort().indices  # ascending again: ties in the next merge go to the smaller index
        best_v, best_i = best_v[order], best_i[order]
    keep = top_abs(best_v, k)
    best_v, best_i = best_v[keep], best_i[keep].to(HOST)
    return torch.stack([best_i // m, best_i % m], 1), best_v, total, mass


def qk_for_graph(replacement: Any, prepared: Any, graph: Any, n_heads: int, k: int, batch_size: int,
                 dtype: torch.dtype | None = None, offload_rows: RowsPlace = "host") -> dict[str, torch.Tensor]:
    """Batched QK tracing of the graph's ``n_heads`` most influential Lorsa heads (distinct ``(layer, QK
    head, query)``, equal influence by node id; each at the key its head attends to most), as ``Graph.qk``
    tensors (:data:`QK_FIELDS`): ``probe (n, 5)`` = (graph node, layer, QK head, query pos, key pos);
    ``score (n,)``; ``pair_sum_error (n,)`` = ``|Σ pairs − score| / Σ |pairs|`` (the exactness check);
    ``pair_index (n, k, 2)`` = the ``k`` largest pair terms' (query-side, key-side) graph nodes (``-1``: a node
    not in the graph; ``n_nodes``: the ``b_Q``/``b_K`` term; equal terms by the smaller prompt-node index,
    :func:`top_pairs`), ``pair_value (n, k)``; ``query_marginal`` / ``key_marginal (n, n_nodes + 1)``
    over the graph's nodes (last: the bias term); traced in ``dtype`` as the graph (:func:`trace_probes`), the
    offloaded modules' rows where the graph's pass kept them (``offload_rows``, ``graph.meta["offload_rows"]``).
    Llamascopium's ``circuits/attribution.py`` does the same."""
    from .scores import node_influence

    heads = graph.ids_of(graph.LORSA)
    if n_heads <= 0 or heads.numel() == 0:
        return {}
    infl = node_influence(graph)[heads]
    order = heads[infl.argsort(descending=True, stable=True)]  # equal influence: the smaller node id first
    layout = prepared.layout
    probes: list[QKProbe] = []
    nodes: list[int] = []
    seen = set()
    for i in order.tolist():
        layer, pos, head = int(graph.nodes.layer[i]), int(graph.nodes.pos[i]), int(graph.nodes.index[i])
        group = head // layout.layers[layer].lorsa.cfg.group_size
        if (layer, group, pos) not in seen:
            seen.add((layer, group, pos))
            probes.append(QKProbe(layer, group, pos))
            nodes.append(i)
        if len(probes) == n_heads:
            break
    traced = trace_probes(replacement, prepared, probes, batch_size, dtype, offload_rows)
    n_nodes = graph.n_nodes
    to_graph = torch.full((layout.n_sources + 1,), -1, dtype=torch.long, device=HOST)
    is_src = graph.layout_ids < layout.n_sources
    to_graph[graph.layout_ids[is_src]] = is_src.nonzero().flatten()
    to_graph[-1] = n_nodes
    out: dict[str, list[torch.Tensor]] = {name: [] for name in QK_FIELDS}
    for node, probe, (query, key, score) in zip(nodes, probes, traced, strict=True):
        scale = float(layout.layers[probe.layer].lorsa.cfg.scale)
        idx, val, total, mass = top_pairs(query, key, scale, k)
        out["probe"].append(torch.tensor([node, probe.layer, probe.group, probe.query_pos, probe.key_pos], device=HOST))
        out["score"].append(torch.tensor(score, dtype=torch.float64, device=HOST))
        out["pair_sum_error"].append(torch.tensor(abs(total - score) / max(mass, 1e-30), dtype=torch.float64,
                                                 device=HOST))
        out["pair_index"].append(torch.nn.functional.pad(to_graph[idx], (0, 0, 0, k - idx.shape[0]), value=-1))
        out["pair_value"].append(torch.nn.functional.pad(val, (0, k - val.shape[0])))
        for name, side, other in (("query_marginal", query, key), ("key_marginal", key, query)):
            m = side @ other.sum(0) / scale  # Σ over the other side
            row = torch.zeros(n_nodes + 1, dtype=m.dtype, device=HOST)
            keep = to_graph >= 0
            row[to_graph[keep]] = m[keep]
            out[name].append(row)
    return {name: torch.stack(v) for name, v in out.items()}
