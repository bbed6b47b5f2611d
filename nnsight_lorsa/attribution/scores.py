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

Everything here runs on the graph's stored rows in float64 through one influence function,
:func:`row_influence` (also what pruning while building and the feature budget's selection run): on its causal
blocks in place if it keeps them (:class:`.blocks.BlockAdjacency`), else on its dense matrix's non-zero entries
(:class:`EntryRows`) — the same bits either way — never on a dense ``n_nodes²`` float matrix; :func:`influence`
is the same series on a dense rows matrix. Pruning a full graph holds the scores of the edges among the
node-pruned nodes (``8 B`` each, sorted in place) and then the kept edges (``16 B`` each): measured 1.3–2.6 B per
non-zero edge above the graph on the embedded model's full graphs (``benchmarks/graph_postprocess_scale.py``).

The model-running counterparts — circuit metrics by ablation in the real model and the exactness checks
by intervention in the frozen model — are in :mod:`.checks`. torch only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy
import torch

from .._checks import check_instance
from .._repr import FieldsRepr
from .._typing import Float, Int
from ..errors import ArgumentError, ConfigMismatchError, NonFiniteError
from .blocks import BlockAdjacency, segments
from .graph import ATTN_ERROR, BIAS, EMBEDDING, GRAPH_HINT, HOST, LOGIT, LORSA, MLP_ERROR, TRANSCODER, Graph


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
    feed: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Float[torch.Tensor, " n_cols"]:
    """``Σ_k w Â^k`` (k ≥ 1) for any storage of ``Â``: ``propagate(w)`` is ``w Â`` (row weights →
    column weights); column ``row_node[r]`` feeds row ``r`` back in, until nothing is left.

    The series is summed on the rows, then propagated once: ``(Σ_{k≥0} w_k) Â`` with ``w_0 = w`` and
    ``w_{k+1}[r] = (w_k Â)[row_node[r]]`` — the same sum as ``Σ_k (w_k Â)`` (``Â`` is linear), with one pass over
    every column instead of one per step. The steps only need ``w_k Â`` at the row nodes' columns: ``feed(w)`` may
    compute just those (any value elsewhere; None: ``propagate``) — on stored rows a step then reads only those
    columns' entries (:func:`row_influence`: the ranking of a budgeted 8B-shaped graph read every stored entry at each
    of its 15–30 steps). ``propagate`` / ``feed`` may return the same vector at every call: each result is read
    before the next call. Each ``w_k`` holds the bits the step-by-step sum fed back (the same column sums); the
    result differs from ``Σ_k (w_k Â)`` by float64 rounding only (≤ 1e-12 relative, tested).

    Raises:
        ArgumentError: the series did not terminate (a cycle: malformed adjacency).
        NonFiniteError: a step's weights went NaN / inf (non-finite entries in the rows: NaN never reaches 0, and the
            series ran to ``max_iter`` and blamed a cycle).
    """
    feed = propagate if feed is None else feed
    is_col = row_node < n_cols
    cols = row_node[is_col]
    total = row_weight.clone()  # Σ_k w_k, on the rows
    w = row_weight
    for _ in range(max_iter):
        cur = feed(w)
        w = torch.zeros_like(row_weight, dtype=cur.dtype)
        w[is_col] = cur[cols]
        if not bool(w.isfinite().all()):
            raise NonFiniteError("influence: the series' weights went NaN / inf: the adjacency's rows hold non-finite "
                                 "entries (a graph built by hand? attribute() and Graph.load refuse them)",
                                 tensor="edges")
        if not bool(w.any()):
            return propagate(total.to(cur.dtype))
        total = total.to(cur.dtype).add_(w)
    raise ArgumentError(f"influence: the series did not end in max_iter={max_iter} iterations: the adjacency has a "
                        "cycle (a row node feeds itself back); an attribution graph's adjacency is acyclic")


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
        ArgumentError: the series did not terminate (a cycle: malformed adjacency).
    """
    A = normalize_rows(rows)
    return influence_series(lambda w: w.to(A.dtype) @ A, row_node, row_weight.to(A.dtype), rows.shape[1], max_iter)


#: what a wrong-kind ``pruned`` / ``prune_result`` argument is told (``_checks.check_instance``)
PRUNED_HINT = " (prune(graph) returns one)"


@dataclass(repr=False)
class PruneResult(FieldsRepr):
    """What :func:`prune` keeps, over the graph's ``n`` nodes: ``node_mask: (n,)`` bool; ``edge_index:
    (2, k)`` int64 the kept edges ``[targets; sources]`` (between kept nodes, target-major, sources
    ascending: ``16 B`` per kept edge, never ``n²``); ``node_influence: (n,)`` float64 influence on the
    logits; ``cumulative: (n,)`` float64 each node's cumulative-influence rank score (fraction of total
    influence of nodes at least as influential; nodes of equal influence get one score, :func:`cumulative_scores`).
    :attr:`edge_mask` is the dense ``(n, n)`` bool view.

    Source: Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer ``circuit_tracer/graph.py`` (influence, pruning,
    scores).
    """

    node_mask: torch.Tensor
    edge_index: torch.Tensor
    node_influence: torch.Tensor
    cumulative: torch.Tensor

    @property
    def edge_mask(self) -> torch.Tensor:
        """``(n, n)`` bool ``[target, source]``, True at the kept edges — built from :attr:`edge_index`
        (``n²`` bytes: for small graphs; a long prompt's graph reads ``edge_index``).

        Source: Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer ``circuit_tracer/graph.py`` (influence,
        pruning, scores).
        """
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
        ConfigMismatchError: a threshold outside ``[0, 1]`` or ``keep_mass`` outside ``(0, 1]`` (NaN is outside
            both), or any of them not a real number (a ``bool``, a str, None).

    Source: Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer ``circuit_tracer/graph.py`` (influence, pruning,
    scores).
    """

    node_threshold: float = 0.8
    edge_threshold: float = 0.98
    keep_mass: float = 1.0

    def __post_init__(self) -> None:
        for name in ("node_threshold", "edge_threshold", "keep_mass"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ConfigMismatchError(f"prune: {name} must be a number, got {value!r}")
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

        Source: Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer ``circuit_tracer/graph.py`` (influence,
        pruning, scores).
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


@runtime_checkable
class RowSource(Protocol):
    """Rows of an adjacency as :func:`row_influence` reads them (``n_rows`` rows over ``n_cols`` source columns):
    :class:`EntryRows` (non-zero entries), :class:`.blocks.BlockAdjacency` (causal blocks, rows = node ids),
    :class:`.rows.SparseRows` (rows as computed)."""

    def abs_sums(self, col_mask: torch.Tensor | None = None, row_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``(n_rows,)`` float64 ``Σ |row|`` (only the columns where ``col_mask`` is True; the rows outside
        ``row_mask`` may be left out: they are never read)."""
        ...

    def weighted_abs(self, weight: torch.Tensor, den: torch.Tensor, col_mask: torch.Tensor | None = None
                     ) -> torch.Tensor:
        """``(n_cols,)`` float64 ``Σ_r weight[r] · |row r| / den[r]`` (only the columns where ``col_mask`` is True)."""
        ...


@runtime_checkable
class PrunableRows(RowSource, Protocol):
    """A :class:`RowSource` that :func:`prune_rows` can also score edge by edge: :class:`EntryRows`,
    :class:`.blocks.BlockAdjacency`, and :class:`.rows.SparseRows` (read in place through its source view)."""

    def count_edges(self, col_mask: torch.Tensor, row_mask: torch.Tensor) -> int:
        """The non-zero entries between ``row_mask`` rows and ``col_mask`` columns."""
        ...

    def edge_scores(self, factor: torch.Tensor, den: torch.Tensor, col_mask: torch.Tensor, row_mask: torch.Tensor
                    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(row, col, score)`` of those entries, score ``|v| / den[row] · factor[row]`` (float64), in the
        storage's row order, a chunk at a time."""
        ...


def row_influence(rows: RowSource, row_node: Int[torch.Tensor, " n_rows"], row_weight: Float[torch.Tensor, " n_rows"],
                  n_cols: int, node_mask: torch.Tensor | None = None, max_iter: int = 1000,
                  den: torch.Tensor | None = None) -> Float[torch.Tensor, " n_cols"]:
    """The influence ``Σ_k w Â^k`` (k ≥ 1) of every column of ``rows`` — the one implementation behind
    :func:`node_influence`, :func:`prune`, :func:`graph_scores`, pruning while building and the feature budget's
    selection (:meth:`.rows.SparseRows.influence`): ``(n_cols,)`` float64.

    ``Â`` is ``rows`` with absolute values, each row divided by its ``Σ |entries|`` (``rows.abs_sums``); row ``r``
    is the target node ``row_node[r]``, starting weights ``row_weight: (n_rows,)``. With ``node_mask: (≥ n_cols,)``
    bool only the entries between two nodes of the mask count (the node-pruned matrix: rows normalised by those
    entries, rows whose target is outside the mask carry nothing; ``den``: those sums if the caller has them,
    ``rows.abs_sums(node_mask[:n_cols])``). Each step is ``rows.weighted_abs`` over the row nodes' columns only — per
    entry ``(|v| / den[r]) · w[r]`` in float64, added per column in the storage's row order (ascending targets for a
    graph's entries and blocks: the same bits from either) — and :func:`influence_series` feeds column
    ``row_node[r]`` back in until nothing is left; the steps' row weights summed are propagated once over every
    column. A storage with ``restricted(cols)`` (sparse rows: :meth:`.rows.SparseRows.restricted`) hands over the
    entries at the row nodes' columns once, as an :class:`EntryRows`, and every step runs on those — the same terms
    in the same order, so the same bits, without reading the stored rows at each step. Memory: the storage's step
    temporaries (a chunk, a cell), the restricted entries and a few float64 vectors over the rows and columns.

    Raises:
        ArgumentError: the series did not terminate (a cycle: malformed adjacency).
    """
    col_mask = None if node_mask is None else node_mask[:n_cols]
    row_ok = None if node_mask is None else node_mask[row_node]
    den = (rows.abs_sums(col_mask, row_ok) if den is None else den).clamp_min(1e-30)

    # a storage that fills a given vector (sparse rows): one for every step — a step's result is read (the next
    # weights, the running total) before the next step overwrites it
    step: torch.Tensor | None = (torch.empty(n_cols, dtype=torch.float64, device=HOST)
                                 if getattr(rows, "fills_out", False) else None)

    # the steps' columns: the row nodes' (masked) — a storage reads only their entries (each column's sum the same
    # bits as over every column: its terms in the same order)
    fed = torch.zeros(n_cols, dtype=torch.bool, device=HOST)
    fed[row_node[row_node < n_cols]] = True
    if col_mask is not None:
        fed &= col_mask

    def weights(w: torch.Tensor) -> torch.Tensor:
        w = w.double()
        return w if row_ok is None else w * row_ok

    def propagate(w: torch.Tensor, mask: torch.Tensor | None = col_mask) -> torch.Tensor:
        if step is not None:
            return rows.weighted_abs(weights(w), den, mask, out=step)  # type: ignore[call-arg]
        return rows.weighted_abs(weights(w), den, mask)

    restricted = getattr(rows, "restricted", None)
    if restricted is None:
        return influence_series(propagate, row_node, row_weight.double(), n_cols, max_iter,
                                feed=lambda w: propagate(w, fed))
    # the steps' entries gathered once (sparse rows): each step a pass over those, not over every stored entry — the
    # same terms added per column in the same order (the storage's), so the same bits
    fed_cols = fed.nonzero().flatten()
    sub = restricted(fed_cols)
    row_cols = row_node[row_node < n_cols]
    back = torch.empty(n_cols, dtype=torch.float64, device=HOST)  # only the row nodes' columns are ever read:
    back.index_fill_(0, row_cols[~fed[row_cols]], 0.0)  # those outside the mask feed back 0, the others are written

    def feed(w: torch.Tensor) -> torch.Tensor:
        return back.index_copy_(0, fed_cols, sub.weighted_abs(weights(w), den))

    return influence_series(propagate, row_node, row_weight.double(), n_cols, max_iter, feed=feed)


class EntryRows:
    """Rows given as their non-zero entries ``(row, col, val)`` (``row``: the row's place, ``< n_rows``; ``col``:
    the source, ``< n_cols``), the :class:`RowSource` of a dense graph's :meth:`.graph.Graph.coo` and of the
    entries pruning while building keeps from sparse rows. With ``row`` ascending (as :meth:`.graph.Graph.coo` gives
    it) a step reads only the entries of the rows that carry weight (the same bits: a row of weight 0 adds
    exact zeros). Memory: the entries (not copied) + ``O(live entries)`` float64/int64 per step."""

    def __init__(self, row: Int[torch.Tensor, " k"], col: Int[torch.Tensor, " k"], val: Float[torch.Tensor, " k"],
                 n_rows: int, n_cols: int) -> None:
        self.row, self.col, self.val, self.n_rows, self.n_cols = row, col, val, n_rows, n_cols
        self.ends = None  # row-sorted entries: row r holds [ends[r - 1], ends[r])
        if row.numel() and bool((row[1:] >= row[:-1]).all()):
            self.ends = torch.bincount(row, minlength=n_rows).cumsum(0)

    def abs_sums(self, col_mask: torch.Tensor | None = None, row_mask: torch.Tensor | None = None
                 ) -> Float[torch.Tensor, " n_rows"]:
        a = self.val.abs().double()
        if col_mask is not None:
            a *= col_mask[self.col]
        return torch.zeros(self.n_rows, dtype=torch.float64, device=HOST).index_add_(0, self.row, a)

    def weighted_abs(self, weight: Float[torch.Tensor, " n_rows"], den: Float[torch.Tensor, " n_rows"],
                     col_mask: torch.Tensor | None = None) -> Float[torch.Tensor, " n_cols"]:
        out = torch.zeros(self.n_cols, dtype=torch.float64, device=HOST)
        live = weight.nonzero().flatten()
        if self.ends is None or 2 * live.numel() > self.n_rows:  # most rows carry weight: every entry
            row, col, val = self.row, self.col, self.val
        else:
            start = torch.where(live > 0, self.ends[(live - 1).clamp_min(0)], 0)
            at = segments(start, self.ends[live] - start)  # the live rows' entries, in storage order
            row, col, val = self.row[at], self.col[at], self.val[at]
        c = val.abs().to(torch.float64).div_(den[row]).mul_(weight[row])  # abs(): a copy
        if col_mask is not None:
            c *= col_mask[col]
        return out.index_add_(0, col, c)

    def count_edges(self, col_mask: torch.Tensor, row_mask: torch.Tensor) -> int:
        """The non-zero entries between ``row_mask`` rows and ``col_mask`` columns."""
        return int(((self.val != 0) & col_mask[self.col] & row_mask[self.row]).sum())

    def edge_scores(self, factor: Float[torch.Tensor, " n_rows"], den: Float[torch.Tensor, " n_rows"],
                    col_mask: torch.Tensor, row_mask: torch.Tensor
                    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(row, col, score)`` of the non-zero entries between ``row_mask`` rows and ``col_mask`` columns, score
        ``|v| / den[row] · factor[row]`` (float64), in storage order, :data:`CHUNK` entries at a time."""
        for e0 in range(0, self.val.numel(), CHUNK):
            yield scored_entries(self.row[e0:e0 + CHUNK], self.col[e0:e0 + CHUNK], self.val[e0:e0 + CHUNK], factor,
                                 den, col_mask, row_mask)


def scored_entries(row: Int[torch.Tensor, " k"], col: Int[torch.Tensor, " k"], val: Float[torch.Tensor, " k"],
                   factor: Float[torch.Tensor, " n_rows"], den: Float[torch.Tensor, " n_rows"], col_mask: torch.Tensor,
                   row_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(row, col, score)`` of the non-zero entries of a chunk between ``row_mask`` rows and ``col_mask`` columns,
    score ``|v| / den[row] · factor[row]`` (float64): the edge scores of every row store (``edge_scores``)."""
    k = (val != 0) & col_mask[col] & row_mask[row]
    row, col, val = row[k], col[k], val[k]
    return row, col, val.abs().to(torch.float64).div_(den[row]).mul_(factor[row])


#: entries per chunk of :meth:`EntryRows.edge_scores` and of :func:`find_threshold`'s running sum
CHUNK = 2**18


def graph_rows(graph: Graph) -> tuple[BlockAdjacency | EntryRows, int]:
    """``(rows, n_cols)``: the graph's adjacency as a :class:`RowSource` over its node ids — its causal blocks if it
    keeps them (read in place: no copy, no ``coo``), else the dense matrix's non-zero entries (``20 B`` per edge)."""
    blocks = graph.block_adjacency
    if blocks is not None:
        return blocks, blocks.n_sources
    n = graph.n_nodes
    t, s, v = graph.coo()
    return EntryRows(t, s, v, n, n), n


def node_influence(graph: Graph) -> Float[torch.Tensor, " n_nodes"]:
    """``(n_nodes,)`` float64 influence of every node on the logits (``w Σ_k Â^k``, k ≥ 1): :func:`row_influence` on
    the graph's causal blocks (or its dense matrix's non-zero entries: the same bits), never a dense ``n_nodes²``
    float matrix."""
    rows, n_cols = graph_rows(graph)
    n = graph.n_nodes
    out = torch.zeros(n, dtype=torch.float64, device=HOST)
    out[:n_cols] = row_influence(rows, torch.arange(n, device=HOST), logit_weights(graph), n_cols)
    return out


def prune_rows(rows: PrunableRows, row_node: Int[torch.Tensor, " n_rows"],
               row_weight: Float[torch.Tensor, " n_rows"], node_mask: torch.Tensor, always: torch.Tensor,
               kind: torch.Tensor, edge_threshold: float, n_cols: int, keep_edges: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2–3 of the pruning (module docstring) after the node threshold ``node_mask: (n_all,)`` bool, on the
    entries of ``rows`` between two of its nodes (``row_node[r]`` the target of row ``r``; ``always``, ``kind``:
    ``(n_all,)``): the node-pruned matrix's influence (:func:`row_influence` with the mask), edge scores
    ``|Â[t, s]| · (influence_t + logit weight_t)``, the edge threshold over the non-zero entries, then dangling
    features and errors dropped until stable. Returns ``(node_mask (n_all,) bool, edge_index (2, k) int64)``: the
    kept nodes, and the kept edges ``[target node; source]`` in ``rows``' order (row-major, sources ascending, for
    a graph's blocks or entries).

    ``rows``: a graph's blocks or entries, or the stored rows of pruning while building (:class:`PrunableRows`).

    Memory: the scores of the entries between kept nodes, float64 (``8 B`` each), sorted in place
    (:func:`find_threshold_`), then the kept edges (``16 B`` each) — never a per-entry copy of the rows. With
    ``keep_edges=False`` (pruning while building, which keeps every stored edge among the kept nodes) the kept edges
    are never gathered: each step of the dangling-node loop re-reads them from ``rows`` (``edge_scores``: the same
    scores, one chunk at a time), so only the scores are held — the same ``node_mask``; ``edge_index`` is then
    ``(2, 0)``.
    """
    node_mask = node_mask.clone()
    n_all = node_mask.numel()
    col_mask, row_mask = node_mask[:n_cols], node_mask[row_node]
    lw = torch.zeros(n_all, dtype=torch.float64, device=HOST)
    lw[row_node] = row_weight.double()
    infl = torch.zeros(n_all, dtype=torch.float64, device=HOST)
    den = rows.abs_sums(col_mask, row_mask).clamp_min(1e-30)
    infl[:n_cols] = row_influence(rows, row_node, row_weight, n_cols, node_mask, den=den)
    factor = (infl + lw)[row_node]
    scores = torch.empty(rows.count_edges(col_mask, row_mask), dtype=torch.float64, device=HOST)
    at = 0
    for _, _, score in rows.edge_scores(factor, den, col_mask, row_mask):
        # checked chunk by chunk (NaN sorts anywhere: the threshold, hence the kept edges, arbitrary): isfinite of the
        # whole score vector made an abs copy and two masks of it, 1.4x the pruning term (2026-11-27 to 11-28)
        if not bool(score.isfinite().all()):
            raise NonFiniteError("prune: edge scores are NaN / inf: the graph holds non-finite edges among the kept "
                                 "nodes (a graph built by hand? attribute() and Graph.load refuse them)",
                                 tensor="edges")
        scores[at:at + score.numel()] = score
        at += score.numel()
    threshold = find_threshold_(scores, edge_threshold) if scores.numel() else None
    del scores
    feature = (kind == TRANSCODER) | (kind == LORSA)
    prunable = feature | (kind == MLP_ERROR) | (kind == ATTN_ERROR)
    empty = torch.zeros(0, dtype=torch.long, device=HOST)
    if not keep_edges:  # the loop below, each step's edges re-read: those above the threshold between kept nodes
        while True:  # (the nodes only ever leave the mask: the kept edges of a step are those of the first step
            old = node_mask.clone()  # between this step's nodes)
            has_out = torch.zeros(n_all, dtype=torch.bool, device=HOST)
            has_in = torch.zeros(n_all, dtype=torch.bool, device=HOST)
            if threshold is not None:
                for row, col, score in rows.edge_scores(factor, den, col_mask, row_mask):
                    t = row_node[row]
                    k = (score >= threshold) & old[t] & old[col]
                    has_in[t[k]] = True
                    has_out[col[k]] = True
            node_mask &= ~prunable | has_out
            node_mask &= ~feature | has_in
            node_mask |= always
            if torch.equal(old, node_mask):
                return node_mask, torch.stack([empty, empty])
    edges: list[tuple[torch.Tensor, torch.Tensor]] = []
    if threshold is not None:
        for row, col, score in rows.edge_scores(factor, den, col_mask, row_mask):
            k = score >= threshold
            edges.append((row_node[row[k]], col[k]))
    t, s = (torch.cat(e) for e in zip(*edges, strict=True)) if edges else (empty, empty)
    while True:
        old = node_mask.clone()
        has_out = torch.zeros(n_all, dtype=torch.bool, device=HOST)
        has_out[s] = True
        has_in = torch.zeros(n_all, dtype=torch.bool, device=HOST)
        has_in[t] = True
        node_mask &= ~prunable | has_out
        node_mask &= ~feature | has_in
        node_mask |= always
        keep = node_mask[s] & node_mask[t]
        if not bool(keep.all()):
            t, s = t[keep], s[keep]
        if torch.equal(old, node_mask):
            return node_mask, torch.stack([t, s])


def find_threshold(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """The score above which the top scores hold ``fraction`` of the total (circuit-tracer's rule):
    :func:`find_threshold_` on a copy."""
    return find_threshold_(scores.flatten().clone(), fraction)


def find_threshold_(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """:func:`find_threshold` sorting ``scores`` (1-D, contiguous, ``≥ 0``, on the host; left sorted descending) in
    place: no index tensor, no sorted copy — the running sums :data:`CHUNK` entries at a time, sequential (each
    chunk's ``cumsum`` continues the last one's), so the same bits as ``cumsum`` over the whole sorted vector."""
    a = scores.numpy()
    numpy.negative(a, out=a)  # ascending of −x: descending of x, with no reversed copy
    a.sort()
    numpy.negative(a, out=a)
    total = scores.sum().clamp_min(1e-30)
    goal = torch.tensor(fraction, dtype=scores.dtype, device=scores.device)
    carry = torch.zeros(1, dtype=scores.dtype, device=scores.device)
    for i0 in range(0, scores.numel(), CHUNK):
        run = torch.cat([carry, scores[i0:i0 + CHUNK]]).cumsum(0)
        carry = run[-1:]
        at = int(torch.searchsorted(run[1:] / total, goal))
        if at < run.numel() - 1:
            return scores[i0 + at].clone()
    return scores[-1].clone()


def check_pruned_graph(graph: Any, pruned: Any, where: str) -> None:
    """``graph`` a :class:`~.graph.Graph` and ``pruned`` a :class:`PruneResult` of it (its node mask over the graph's
    nodes): the first check of every entry point that takes both.

    Raises:
        ArgumentError: either of another kind, or ``pruned`` of another graph (another node count); naming ``where``.

    Source: ours (this package's entry points).
    """
    check_instance(graph, Graph, where, "graph", GRAPH_HINT)
    check_instance(pruned, PruneResult, where, "pruned", PRUNED_HINT)
    if pruned.node_mask.shape != (graph.n_nodes,):
        raise ArgumentError(f"{where}: the PruneResult is over {pruned.node_mask.numel()} nodes, the graph has "
                            f"{graph.n_nodes}: prune this graph (prune(graph))")


def prune(graph: Graph, node_threshold: float | int = 0.8, edge_threshold: float | int = 0.98) -> PruneResult:
    """Influence pruning of a full graph (module docstring; circuit-tracer's ``prune_graph``,
    ``circuit_tracer/graph.py``, with bias nodes always kept like embeddings, and so are intervened nodes:
    :attr:`.graph.NodeTable.intervened`).

    Computed on the graph's stored rows (:func:`graph_rows`: its causal blocks read in place if it keeps them —
    the graph is left as it was — else its dense matrix's non-zero entries) in float64, the same steps as pruning
    while building (:func:`prune_rows`); a graph that keeps its blocks and the same graph densified give the same
    bits. Memory above the graph: node-sized float64 vectors, the block passes' temporaries (:data:`.blocks.CHUNK`
    entries), the scores of the non-zero edges among the node-pruned nodes (``8 B`` each, sorted in place:
    :func:`find_threshold_`) and the kept edges (``16 B`` each) — on the embedded model's full graphs 1.3–2.6 B per
    non-zero edge (6.6–14 B with ``node_threshold=1``), 70–72 B before; never a dense ``n_nodes²`` matrix.

    Args:
        graph: a :class:`~.graph.Graph`.
        node_threshold: fraction of the total node influence the kept nodes hold.
        edge_threshold: fraction of the total edge score the kept edges hold.

    Returns:
        :class:`PruneResult` (the kept nodes, the kept ``[target, source]`` edges as an index list).

    Raises:
        ArgumentError: (a ``ValueError``) a threshold that is not a number in ``[0, 1]`` (``True`` included);
            ``graph`` not a :class:`~.graph.Graph`.
        NonFiniteError: NaN / inf logit probabilities or edges (a graph built by hand: :func:`.attribute.attribute`
            and :meth:`.graph.Graph.load` refuse them) — their influence would be NaN, the nodes it reaches dropped.

    Source: Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer ``circuit_tracer/graph.py`` (``prune_graph``).
    """
    check_instance(graph, Graph, "prune", "graph", GRAPH_HINT)
    for name, v in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise ArgumentError(f"prune({name}=...) must be a number in [0, 1], got {v!r}")
    kind = graph.nodes.kind
    # inputs are always kept: embeddings, biases — and nodes held at an intervened value (fixed inputs with no
    # incoming edges, which the dangling-feature rule would drop); logits too
    always = (kind == EMBEDDING) | (kind == BIAS) | (kind == LOGIT) | graph.nodes.intervened
    rows, n_cols = graph_rows(graph)
    n = graph.n_nodes
    ids, lw = torch.arange(n, device=HOST), logit_weights(graph)
    infl = torch.zeros(n, dtype=torch.float64, device=HOST)
    if not bool(torch.isfinite(lw).all()):  # NaN influence would rank nowhere: nodes dropped, scores NaN, silently
        raise NonFiniteError(f"prune: the graph's logit probabilities hold NaN or inf ({graph.logit_probs.tolist()})",
                             tensor="logit_probs")
    infl[:n_cols] = row_influence(rows, ids, lw, n_cols)
    if not bool(torch.isfinite(infl).all()):
        bad = (~torch.isfinite(infl)).nonzero().flatten()
        raise NonFiniteError(f"prune: the influence of {bad.numel()} node(s) is NaN or inf (e.g. node {int(bad[0])}, "
                             f"{graph.nodes.label(int(bad[0]))}): the graph holds non-finite edges", tensor="edges")
    node_mask = (infl >= find_threshold(infl, node_threshold)) | always
    node_mask, edge_index = prune_rows(rows, ids, lw, node_mask, always, kind, float(edge_threshold), n_cols)
    return PruneResult(node_mask, edge_index, infl, cumulative_scores(infl))


def cumulative_scores(infl: Float[torch.Tensor, " n"]) -> Float[torch.Tensor, " n"]:
    """Each node's cumulative-influence rank score: the share of the total influence held by the nodes at least
    as influential as it (``Σ_{j: infl_j ≥ infl_i} infl_j / Σ infl``; circuit-tracer's ``prune_graph`` writes the
    running sum in its sort's order, which gives nodes of equal influence different scores, the first of them one
    that leaves the others out — here every node of a run of equal influence gets the run's last running sum)."""
    order = infl.sort(descending=True)
    run = order.values.cumsum(0) / infl.sum().clamp_min(1e-30)
    _, counts = torch.unique_consecutive(order.values, return_counts=True)
    ends = counts.cumsum(0) - 1  # the last running sum of each run of equal values, for every member of the run
    cumulative = torch.zeros_like(infl)
    cumulative[order.indices] = run[ends].repeat_interleave(counts)
    return cumulative


def graph_scores(graph: Graph) -> tuple[float, float]:
    """``(replacement_score, completeness_score)``, both in ``[0, 1]``, of the unpruned graph (module
    docstring; circuit-tracer's ``compute_graph_scores``, ``circuit_tracer/graph.py``), as it computes them: the
    completeness score sums over every node, the source-only ones (errors, embeddings, biases: no incoming edges,
    no error fraction) counted complete — over the nodes whose rows were computed only until 2026-11-29 (0.794
    against circuit-tracer's 0.867 on the same adjacency); a feature node whose row a budget left uncomputed (none
    in circuit-tracer's graphs) is left out. Computed on the
    graph's stored rows (:func:`graph_rows`: its causal blocks in place, or its dense matrix's non-zero entries)
    in float64: :func:`row_influence` and two absolute row sums (all sources, error sources); memory: node-sized
    vectors and one chunk's temporaries, no per-edge copy, no dense ``n_nodes²`` matrix.

    Raises:
        ArgumentError: ``graph`` not a :class:`~.graph.Graph`.

    Source: Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer ``circuit_tracer/graph.py``
    (``compute_graph_scores``).
    """
    check_instance(graph, Graph, "graph_scores", "graph", GRAPH_HINT)
    kind = graph.nodes.kind
    error = (kind == MLP_ERROR) | (kind == ATTN_ERROR)
    inputs = (kind == EMBEDDING) | (kind == BIAS)
    rows, n_cols = graph_rows(graph)
    n = graph.n_nodes
    lw = logit_weights(graph)
    mass = rows.abs_sums()
    infl = torch.zeros(n, dtype=torch.float64, device=HOST)
    infl[:n_cols] = row_influence(rows, torch.arange(n, device=HOST), lw, n_cols, den=mass)
    from_inputs, from_errors = float(infl[inputs].sum()), float(infl[error].sum())
    replacement = from_inputs / max(from_inputs + from_errors, 1e-30)
    to_errors = rows.abs_sums(error[:n_cols])
    non_error = 1.0 - to_errors / mass.clamp_min(1e-30)
    out = infl + lw.double()
    counted = graph.feature_rows | ((kind != TRANSCODER) & (kind != LORSA))  # every node with its row, or none
    completeness = float((non_error[counted] * out[counted]).sum() / out[counted].sum().clamp_min(1e-30))
    return replacement, completeness
