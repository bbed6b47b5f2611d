"""Scores of an attribution graph, as pure tensor math on the graph: influence, pruning and the graph's
replacement/completeness scores (nothing here runs a model).

*Influence* (circuit-tracer's pruning rule, Ameisen et al. 2025, *Circuit Tracing*; ``circuit_tracer/graph.py``):
with ``Â``
the adjacency with absolute values, each row normalised to sum 1 (row = target, column = source),
a node's influence is its total weight in ``w (Â + Â² + Â³ + …)``, where ``w`` puts the logits'
probabilities on the logit rows. The graph is acyclic, so the series terminates. The matrix may be
stored *by rows* (``row_node[r]``: the node row ``r`` is the target of; rows never computed count as
zero), as while a graph is built.

*Pruning* (:func:`prune`; :class:`PruneConfig` prunes while :func:`.attribute.attribute` builds):
keep the nodes holding ``node_threshold`` of the total influence (embeddings, biases and logits
always), then the edges whose score ``|Â[t, s]| · (influence_t + logit weight_t)`` on the
node-pruned matrix holds ``edge_threshold`` of the total, then drop features left without an
incoming or outgoing edge and errors without an outgoing one, until stable.

*Scores* (:func:`graph_scores`, circuit-tracer's ``compute_graph_scores``): the *replacement score*
is the fraction of the logits' influence that starts at embeddings and biases rather than error
nodes; the *completeness score* the influence-weighted fraction of each computed row's
normalised incoming mass that does not come from error nodes.

Everything here runs on a graph's non-zero edges (:meth:`.graph.Graph.coo`: read from its causal blocks
if it keeps them) with sparse products in float64 — memory ``O(edges)``, never the dense ``n_nodes²``
matrix of a long prompt's graph; :func:`influence` is the same series on a dense rows matrix.

The model-running counterparts — circuit metrics by ablation in the real model and the exactness checks
by intervention in the frozen model — are in :mod:`.checks`. torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._repr import FieldsRepr
from .._typing import Float, Int
from ..errors import ArgumentError, ConfigMismatchError
from .blocks import segments
from .graph import ATTN_ERROR, BIAS, EMBEDDING, HOST, LOGIT, LORSA, MLP_ERROR, TRANSCODER, Graph


def normalize_rows(rows: Float[torch.Tensor, "n m"]) -> Float[torch.Tensor, "n m"]:
    """``|rows|`` with each row divided by its sum (rows summing to 0 stay 0)."""
    a = rows.abs()
    return a / a.sum(-1, keepdim=True).clamp_min(1e-10)


def influence_series(
    propagate: Callable[[torch.Tensor], torch.Tensor],
    row_node: Int[torch.Tensor, " n_rows"],
    row_weight: Float[torch.Tensor, " n_rows"],
    n_cols: int,
    max_iter: int = 1000,
) -> Float[torch.Tensor, " n_cols"]:
    """``Σ_k w Â^k`` (k ≥ 1) for any storage of ``Â``: ``propagate(w)`` is ``w Â`` (row weights →
    column weights); column ``row_node[r]`` feeds row ``r`` back in, until nothing is left.

    Raises:
        RuntimeError: the series did not terminate (a cycle: malformed adjacency).
    """
    is_col = row_node < n_cols
    cur = propagate(row_weight)
    total = cur.clone()
    for _ in range(max_iter):
        w = torch.zeros_like(row_weight, dtype=cur.dtype)
        w[is_col] = cur[row_node[is_col]]
        if not bool(w.any()):
            return total
        cur = propagate(w)
        total += cur
    raise RuntimeError(f"influence did not converge in {max_iter} iterations (is the adjacency acyclic?)")


def influence(
    rows: Float[torch.Tensor, "n_rows n_cols"],
    row_node: Int[torch.Tensor, " n_rows"],
    row_weight: Float[torch.Tensor, " n_rows"],
    max_iter: int = 1000,
) -> Float[torch.Tensor, " n_cols"]:
    """Influence ``Σ_k w Â^k`` (k ≥ 1) of every column node of dense ``rows`` (``(n_rows, n_cols)``; in its
    dtype, ``n_rows · n_cols`` memory), starting from ``row_weight`` on the rows (the logit probabilities on
    logit rows, 0 elsewhere). A graph's influence is :func:`node_influence` (sparse, no dense matrix).

    Raises:
        RuntimeError: the series did not terminate (a cycle: malformed adjacency).
    """
    A = normalize_rows(rows)
    return influence_series(lambda w: w.to(A.dtype) @ A, row_node, row_weight.to(A.dtype), rows.shape[1], max_iter)


@dataclass(repr=False)
class PruneResult(FieldsRepr):
    """What :func:`prune` keeps, over the graph's ``n`` nodes: ``node_mask: (n,)`` bool; ``edge_index:
    (2, k)`` int64 the kept edges ``[targets; sources]`` (between kept nodes, target-major, sources
    ascending: ``16 B`` per kept edge, never ``n²``); ``node_influence: (n,)`` float64 influence on the
    logits; ``cumulative: (n,)`` float64 each node's cumulative-influence rank score (fraction of total
    influence of nodes at least as influential). :attr:`edge_mask` is the dense ``(n, n)`` bool view."""

    node_mask: torch.Tensor
    edge_index: torch.Tensor
    node_influence: torch.Tensor
    cumulative: torch.Tensor

    @property
    def edge_mask(self) -> torch.Tensor:
        """``(n, n)`` bool ``[target, source]``, True at the kept edges — built from :attr:`edge_index`
        (``n²`` bytes: for small graphs; a long prompt's graph reads ``edge_index``)."""
        n = self.node_mask.numel()
        out = torch.zeros(n, n, dtype=torch.bool, device=HOST)
        out[self.edge_index[0], self.edge_index[1]] = True
        return out


@dataclass(frozen=True)
class PruneConfig:
    """Prune while building (``attribute(..., prune=PruneConfig(...))``): the graph comes back with
    only the nodes and edges :func:`prune` with these thresholds would keep, assembled from sparse
    rows (no dense ``n_nodes²`` adjacency; :func:`.rows.assemble_pruned`).

    Attributes:
        node_threshold: keep the most influential nodes holding this fraction of the total influence
            on the logits (circuit-tracer's default 0.8).
        edge_threshold: then the highest-scoring edges holding this fraction of the total edge score
            (default 0.98).
        keep_mass: store each computed row's largest ``|edges|`` up to this fraction of its absolute
            mass (default 1: every non-zero edge, the result equal to dense pruning); the rest of the
            row is summed exactly into ``graph.residual``. Smaller saves host memory on long prompts.

    Raises:
        ConfigMismatchError: a threshold outside ``[0, 1]`` or ``keep_mass`` outside ``(0, 1]``.
    """

    node_threshold: float = 0.8
    edge_threshold: float = 0.98
    keep_mass: float = 1.0

    def __post_init__(self) -> None:
        for name in ("node_threshold", "edge_threshold"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigMismatchError(f"prune: {name} must be in [0, 1], got {getattr(self, name)}")
        if not 0.0 < self.keep_mass <= 1.0:
            raise ConfigMismatchError(f"keep_mass must be in (0, 1], got {self.keep_mass}")

    @classmethod
    def of(cls, prune: PruneConfig | tuple[float, float] | None) -> PruneConfig | None:
        """``prune`` as a config: a config itself, a ``(node_threshold, edge_threshold)`` pair, or None.

        Raises:
            ConfigMismatchError: anything else, or bad values.
        """
        if prune is None or isinstance(prune, PruneConfig):
            return prune
        if isinstance(prune, tuple) and len(prune) == 2 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in prune):
            return cls(float(prune[0]), float(prune[1]))
        raise ConfigMismatchError(f"prune must be a PruneConfig or (node_threshold, edge_threshold), got {prune!r}")


def logit_weights(graph: Graph) -> torch.Tensor:
    """``(n_nodes,)``: the logit probabilities on logit nodes, 0 elsewhere."""
    w = torch.zeros(graph.n_nodes, dtype=graph.values.dtype, device=HOST)
    w[graph.logit_ids] = graph.logit_probs.to(w.dtype)
    return w


def node_influence(graph: Graph) -> Float[torch.Tensor, " n_nodes"]:
    """``(n_nodes,)`` float64 influence of every node on the logits (``w Σ_k Â^k``, k ≥ 1), from the graph's
    non-zero edges (:meth:`.graph.Graph.coo`: the causal blocks or the dense matrix, the same entries):
    :func:`coo_influence`, memory ``O(edges)``, never a dense ``n_nodes²`` matrix."""
    t, s, v = graph.coo()
    n = graph.n_nodes
    return coo_influence(t, s, v, torch.arange(n, device=HOST), logit_weights(graph), n, n)


def coo_influence(row: Int[torch.Tensor, " k"], col: Int[torch.Tensor, " k"], val: Float[torch.Tensor, " k"],
                  row_node: Int[torch.Tensor, " n_rows"], row_weight: Float[torch.Tensor, " n_rows"], n_rows: int,
                  n_cols: int) -> Float[torch.Tensor, " n_cols"]:
    """:func:`influence` of the entries ``(row, col, val)`` (``row``: the row's place in ``row_node``), each
    row normalised by the ``|val|`` of its entries: ``(n_cols,)`` float64. A Neumann series of sparse
    mat-vec products (:func:`influence_series`: over an acyclic graph it ends after at most one step per
    site), in float64: ``O(k)`` memory and time per step — with ``row`` ascending (as :meth:`.graph.Graph.coo`
    gives it) only the entries of the rows that carry weight at that step. Deterministic: the same entries in
    the same order give the same bits (:meth:`.graph.Graph.coo` gives a graph's in row-major order, dense or
    blocks); skipping a row of weight 0 adds nothing and keeps the order of the rest, so it changes no bit.

    Raises:
        RuntimeError: the series did not terminate (a cycle: malformed adjacency).
    """
    a = val.double().abs()
    a = a / torch.zeros(n_rows, dtype=torch.float64, device=HOST).index_add(0, row, a)[row].clamp_min(1e-30)
    ends = None  # row-sorted entries: row r holds [ends[r - 1], ends[r])
    if row.numel() and bool((row[1:] >= row[:-1]).all()):
        ends = torch.bincount(row, minlength=n_rows).cumsum(0)

    def propagate(w: torch.Tensor) -> torch.Tensor:
        w = w.double()
        out = torch.zeros(n_cols, dtype=torch.float64, device=HOST)
        live = w.nonzero().flatten()
        if ends is None or 2 * live.numel() > n_rows:  # most rows carry weight: every entry
            return out.index_add_(0, col, w[row] * a)
        start = torch.where(live > 0, ends[(live - 1).clamp_min(0)], 0)
        at = segments(start, ends[live] - start)  # the live rows' entries, in storage order
        return out.index_add_(0, col[at], w[row[at]] * a[at])

    return influence_series(propagate, row_node, row_weight.double(), n_cols)


def prune_entries(row: Int[torch.Tensor, " k"], col: Int[torch.Tensor, " k"], val: Float[torch.Tensor, " k"],
                  row_node: Int[torch.Tensor, " n_rows"], row_weight: Float[torch.Tensor, " n_rows"],
                  node_mask: torch.Tensor, always: torch.Tensor, kind: torch.Tensor, edge_threshold: float,
                  n_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2–3 of the pruning (module docstring) on the entries among the node-pruned graph's nodes:
    ``row`` the row's place in ``row_node`` (its target node), ``col`` the source node (``< n_cols``);
    ``node_mask``, ``always``, ``kind``: ``(n_all,)`` over the nodes. Edge scores ``|Â[t, s]| · (influence_t +
    logit weight_t)`` on the node-pruned matrix, the edge threshold over the non-zero entries, then dangling
    features and errors dropped until stable. Returns ``(node_mask (n_all,), kept (k,) bool)``; ``O(k)``.
    """
    node_mask = node_mask.clone()
    n_all, n_rows = node_mask.numel(), row_node.numel()
    entry_node = row_node[row]
    lw = torch.zeros(n_all, dtype=torch.float64, device=HOST)
    lw[row_node] = row_weight.double()
    alive = val != 0
    infl = torch.zeros(n_all, dtype=torch.float64, device=HOST)
    infl[:n_cols] = coo_influence(row[alive], col[alive], val[alive], row_node, row_weight, n_rows, n_cols)
    den = torch.zeros(n_rows, dtype=torch.float64, device=HOST).index_add(0, row[alive], val[alive].double().abs())
    score = torch.zeros(val.numel(), dtype=torch.float64, device=HOST)
    score[alive] = val[alive].double().abs() / den[row[alive]].clamp_min(1e-30) * (infl + lw)[entry_node[alive]]
    edge = alive & (score >= find_threshold(score[alive], edge_threshold)) if bool(alive.any()) else alive
    feature = (kind == TRANSCODER) | (kind == LORSA)
    prunable = feature | (kind == MLP_ERROR) | (kind == ATTN_ERROR)
    while True:
        old = node_mask.clone()
        has_out = torch.zeros(n_all, dtype=torch.bool, device=HOST)
        has_out[col[edge]] = True
        has_in = torch.zeros(n_all, dtype=torch.bool, device=HOST)
        has_in[entry_node[edge]] = True
        node_mask &= ~prunable | has_out
        node_mask &= ~feature | has_in
        node_mask |= always
        edge &= node_mask[col] & node_mask[entry_node]
        if torch.equal(old, node_mask):
            return node_mask, edge


def find_threshold(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """The score above which the top scores hold ``fraction`` of the total (circuit-tracer's rule)."""
    s = scores.flatten().sort(descending=True).values
    cum = s.cumsum(0) / s.sum().clamp_min(1e-30)
    at = torch.searchsorted(cum, torch.tensor(fraction, dtype=cum.dtype, device=cum.device))
    return s[min(int(at), s.numel() - 1)]


def prune(graph: Graph, node_threshold: float | int = 0.8, edge_threshold: float | int = 0.98) -> PruneResult:
    """Influence pruning of a full graph (module docstring; circuit-tracer's ``prune_graph``,
    ``circuit_tracer/graph.py``, with bias nodes always kept like embeddings, and so are intervened nodes:
    :attr:`.graph.NodeTable.intervened`).

    Computed on the graph's non-zero edges (:meth:`.graph.Graph.coo`, read from its causal blocks if it
    keeps them; the graph is left as it was) in float64: memory ``O(edges)`` (50–70 B per non-zero
    edge at the peak), never a dense ``n_nodes²`` matrix — the same steps as pruning while building
    (:func:`prune_entries`). A graph that keeps its blocks and the same graph densified give the same bits.

    Args:
        graph: a :class:`~.graph.Graph`.
        node_threshold: fraction of the total node influence the kept nodes hold.
        edge_threshold: fraction of the total edge score the kept edges hold.

    Returns:
        :class:`PruneResult` (the kept nodes, the kept ``[target, source]`` edges as an index list).

    Raises:
        ArgumentError: (a ``ValueError``) a threshold that is not a number in ``[0, 1]`` (``True`` included).
    """
    for name, v in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise ArgumentError(f"prune({name}=...) must be a number in [0, 1], got {v!r}")
    kind = graph.nodes.kind
    # inputs are always kept: embeddings, biases — and nodes held at an intervened value (fixed inputs with no
    # incoming edges, which the dangling-feature rule would drop); logits too
    always = (kind == EMBEDDING) | (kind == BIAS) | (kind == LOGIT) | graph.nodes.intervened
    tgt, src, val = graph.coo()
    n = graph.n_nodes
    ids, lw = torch.arange(n, device=HOST), logit_weights(graph)
    infl = coo_influence(tgt, src, val, ids, lw, n, n)
    node_mask = (infl >= find_threshold(infl, node_threshold)) | always
    among = node_mask[tgt] & node_mask[src]
    tgt, src, val = tgt[among], src[among], val[among]
    node_mask, edge = prune_entries(tgt, src, val, ids, lw, node_mask, always, kind, float(edge_threshold), n)
    order = infl.sort(descending=True)
    cumulative = torch.zeros_like(infl)
    cumulative[order.indices] = order.values.cumsum(0) / infl.sum().clamp_min(1e-30)
    return PruneResult(node_mask, torch.stack([tgt[edge], src[edge]]), infl, cumulative)


def graph_scores(graph: Graph) -> tuple[float, float]:
    """``(replacement_score, completeness_score)``, both in ``[0, 1]``, of the unpruned graph (module
    docstring; circuit-tracer's ``compute_graph_scores``, ``circuit_tracer/graph.py``). Computed on the
    graph's non-zero edges (:meth:`.graph.Graph.coo`, from its causal blocks if it keeps them) in float64:
    memory ``O(edges)``, no dense ``n_nodes²`` matrix."""
    kind = graph.nodes.kind
    error = (kind == MLP_ERROR) | (kind == ATTN_ERROR)
    inputs = (kind == EMBEDDING) | (kind == BIAS)
    t, s, v = graph.coo()
    n = graph.n_nodes
    lw = logit_weights(graph)
    infl = coo_influence(t, s, v, torch.arange(n, device=HOST), lw, n, n)
    from_inputs, from_errors = float(infl[inputs].sum()), float(infl[error].sum())
    replacement = from_inputs / max(from_inputs + from_errors, 1e-30)
    a = v.double().abs()
    mass = torch.zeros(n, dtype=torch.float64, device=HOST).index_add(0, t, a)
    e = error[s]
    to_errors = torch.zeros(n, dtype=torch.float64, device=HOST).index_add(0, t[e], a[e])
    non_error = 1.0 - to_errors / mass.clamp_min(1e-30)
    out = infl + lw.double()
    rows = graph.feature_rows
    completeness = float((non_error[rows] * out[rows]).sum() / out[rows].sum().clamp_min(1e-30))
    return replacement, completeness
