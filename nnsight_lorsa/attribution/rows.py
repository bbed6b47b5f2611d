"""Edge rows: which target rows to compute and in which order, how they are stored, and how they
become a :class:`.graph.Graph` (dense, or pruned while built).

*Schedule* (``max_feature_nodes``): logit rows come first; then, when the prompt has more active
features/heads than the budget, features are visited in order of their influence on the logits
estimated from the rows computed so far (circuit-tracer's influence-ordered selection,
``circuit_tracer/attribution/attribute.py``), re-estimated after every batch; otherwise every
feature row is computed in node order (:class:`RowScheduler`).

*Storage*: rows dense, or sparse (:class:`SparseRows`): a row keeps its largest ``|edges|`` up to a
fraction ``keep_mass`` of its absolute mass; the signed sum of the dropped entries is kept exactly
as the row's ``residual``, so ``Σ kept + residual`` still equals the target's value. Memory is
``12 B × kept entries`` instead of ``4 B × sources`` per row.

*Assembly*: :func:`assemble` (every visited feature and every error/embedding/bias/logit node,
dense adjacency) or :func:`assemble_pruned`: the same influence pruning as :func:`.scores.prune`
(circuit-tracer's rules, ``circuit_tracer/graph.py``) run on the stored entries — node influence,
node threshold, edge scores on the node-pruned matrix, edge threshold, dangling features and errors
removed — without ever holding a dense ``n_nodes²`` adjacency. Each kept target's edges from
everything else (dropped sources and the entries a row did not keep) are summed into its
``residual``, so ``Σ adjacency[t] + residual[t]`` is still the target's value — a real check, since
the values come from the forward and the edges from the backward passes. torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._repr import FieldsRepr
from .._typing import Float, Int
from .graph import ATTN_ERROR, BIAS, EMBEDDING, LOGIT, LORSA, MLP_ERROR, TRANSCODER, Graph
from .layout import Layout
from .scores import find_threshold, influence, influence_series


@dataclass(repr=False)
class SparseRows(FieldsRepr):
    """Rows in COO form.

    Attributes:
        row, col: ``(nnz,)`` int32 — row (computation order) and source column of each kept edge.
        val: ``(nnz,)`` the edge values.
        residual: ``(n_rows,)`` float64 — exact signed sum of each row's dropped edges.
        abs_total: ``(n_rows,)`` float64 — ``Σ |edges|`` of each full row (for row normalisation).
        n_rows, n_cols: shape of the dense equivalent.
        start: the number of the first row (``row − start`` indexes ``residual``/``abs_total``).
    """

    row: torch.Tensor
    col: torch.Tensor
    val: torch.Tensor
    residual: torch.Tensor
    abs_total: torch.Tensor
    n_rows: int
    n_cols: int
    start: int = 0

    @staticmethod
    def of(grads: Float[torch.Tensor, "n s"], keep_mass: float | None, start: int = 0) -> SparseRows:
        """Sparsify dense rows (``keep_mass`` None or ≥ 1: keep every non-zero entry); rows are
        numbered from ``start``."""
        g = grads.detach()
        a = g.abs()
        abs_total = a.double().sum(1)
        if keep_mass is None or keep_mass >= 1.0:
            keep = a > 0
        else:
            srt, order = a.sort(dim=1, descending=True)
            cum = srt.double().cumsum(1)
            keep_sorted = ((cum - srt.double()) < keep_mass * abs_total[:, None]) & (srt > 0)
            keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
        r, c = keep.nonzero(as_tuple=True)
        val = g[r, c]
        kept = torch.zeros(g.shape[0], dtype=torch.float64, device=g.device).index_add(0, r, val.double())
        # int32 copies: ``nonzero`` returns views of one (nnz, 2) int64 buffer, 16 B per entry kept alive
        return SparseRows(row=(r + start).to("cpu", torch.int32), col=c.to("cpu", torch.int32), val=val.cpu(),
                          residual=(g.double().sum(1) - kept).cpu(),
                          abs_total=abs_total.cpu(), n_rows=g.shape[0], n_cols=g.shape[1], start=start)

    @staticmethod
    def cat(chunks: list[SparseRows], n_cols: int) -> SparseRows:
        """Concatenate consecutive chunks (their ``row`` numbers global, the first starting at 0)."""
        if not chunks:
            z = torch.zeros(0, dtype=torch.int32)
            return SparseRows(z, z, torch.zeros(0), torch.zeros(0, dtype=torch.float64),
                              torch.zeros(0, dtype=torch.float64), 0, n_cols)
        return SparseRows(row=torch.cat([c.row for c in chunks]), col=torch.cat([c.col for c in chunks]),
                          val=torch.cat([c.val for c in chunks]), residual=torch.cat([c.residual for c in chunks]),
                          abs_total=torch.cat([c.abs_total for c in chunks]),
                          n_rows=sum(c.n_rows for c in chunks), n_cols=n_cols)

    def local_rows(self) -> torch.Tensor:
        """Row numbers relative to this chunk's first row."""
        return self.row - self.start

    def dense(self) -> Float[torch.Tensor, "n s"]:
        """The kept entries as a dense ``(n_rows, n_cols)`` matrix (dropped ones 0)."""
        out = torch.zeros(self.n_rows, self.n_cols, dtype=self.val.dtype)
        out[self.local_rows(), self.col] = self.val
        return out

    def row_sums(self) -> Float[torch.Tensor, " n"]:
        """``Σ kept + residual`` per row (float64): the full rows' sums."""
        return torch.zeros(self.n_rows, dtype=torch.float64).index_add(0, self.local_rows(), self.val.double()) \
            + self.residual

    def influence(self, row_node: Int[torch.Tensor, " n"], row_weight: Float[torch.Tensor, " n"],
                  keep: torch.Tensor | None = None, max_iter: int = 1000) -> Float[torch.Tensor, " s"]:
        """:func:`.scores.influence` over the stored entries (optionally only those where ``keep``),
        each row normalised by its full absolute mass (or, with ``keep``, by the kept entries' mass)."""
        r, c, v = self.local_rows(), self.col, self.val.double().abs()
        if keep is not None:
            r, c, v = r[keep], c[keep], v[keep]
            den = torch.zeros(self.n_rows, dtype=torch.float64).index_add(0, r, v)
        else:
            den = self.abs_total
        a = v / den[r].clamp_min(1e-30)

        def propagate(w: torch.Tensor) -> torch.Tensor:
            return torch.zeros(self.n_cols, dtype=torch.float64).index_add(0, c, w.double()[r] * a)

        return influence_series(propagate, row_node, row_weight.double(), self.n_cols, max_iter)


class RowStore:
    """Computed edge rows, in computation order: ``done[i]`` is the target of the ``i``-th row; a
    chunk of rows is stored dense, or sparse with ``keep_mass`` (a :class:`SparseRows`)."""

    def __init__(self, n_sources: int, keep_mass: float | None = None, progress: Any = None) -> None:
        self.n_sources, self.keep_mass, self.progress = n_sources, keep_mass, progress
        self.done: list[int] = []
        self.rows: list[torch.Tensor | SparseRows] = []

    def record(self, rows: list[int], grads: torch.Tensor) -> None:
        """Store ``grads: (len(rows), n_sources)``, the incoming edges of each row (dense, or sparse
        with ``keep_mass``: a :class:`SparseRows` chunk)."""
        start = len(self.done)
        self.done.extend(rows)
        self.rows.append(grads.cpu() if self.keep_mass is None else SparseRows.of(grads, self.keep_mass, start))
        if self.progress is not None:
            self.progress.update(len(rows))

    def matrix(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row_targets (n,), rows (n, n_sources))`` computed so far, in computation order (dense)."""
        rows = [c.dense() if isinstance(c, SparseRows) else c for c in self.rows]
        return torch.tensor(self.done, dtype=torch.long), torch.cat(rows) if rows else torch.zeros(
            0, self.n_sources)


class RowScheduler(RowStore):
    """Hands out batches of target rows and stores the computed edge rows.

    Target row ``r < n_features`` is feature node ``r``; ``r ≥ n_features`` is logit ``r − n_features``.

    Args:
        layout: the prompt's nodes.
        max_feature_nodes: at most this many feature rows (None: all).
        progress: a tqdm-like bar (``update(n)``) or None.
        keep_mass: store each row sparse — its largest ``|edges|`` up to this fraction of the row's
            absolute mass, plus the exact sum of the rest (``residual``) — instead of dense
            (None). Memory per row ∝ kept entries instead of the number of sources.
    """

    def __init__(self, layout: Layout, max_feature_nodes: int | None = None, progress: Any = None,
                 keep_mass: float | None = None) -> None:
        super(RowScheduler, self).__init__(layout.n_sources, keep_mass, progress)
        self.layout = layout
        self.budget = layout.n_features if max_feature_nodes is None else min(max_feature_nodes, layout.n_features)
        self._pending_logits = list(range(layout.n_features, layout.n_targets))
        self._visited = torch.zeros(layout.n_features, dtype=torch.bool)

    @property
    def n_feature_rows(self) -> int:
        return int(self._visited.sum())

    def next_rows(self, batch: int) -> list[int]:
        """The next ≤ ``batch`` target rows to compute (empty when done)."""
        if self._pending_logits:
            rows, self._pending_logits = self._pending_logits[:batch], self._pending_logits[batch:]
            return rows
        left = self.budget - self.n_feature_rows
        if left <= 0:
            return []
        n = min(batch, left)
        if self.budget == self.layout.n_features:  # everything: node order
            start = self.n_feature_rows
            picked = list(range(start, start + n))
        else:
            score = self.feature_influence().clone()
            score[self._visited] = -1.0
            picked = score.topk(n).indices.sort().values.tolist()
        self._visited[picked] = True
        return picked

    def sparse(self) -> SparseRows:
        """All rows computed so far as one :class:`SparseRows` (dense rows converted exactly)."""
        chunks: list[SparseRows] = []
        offset = 0
        for c in self.rows:
            chunks.append(c if isinstance(c, SparseRows) else SparseRows.of(c, None, offset))
            offset += chunks[-1].n_rows
        return SparseRows.cat(chunks, self.layout.n_sources)

    def row_nodes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(node (n,), logit weight (n,))`` of each computed row (node ids: sources, then logits)."""
        lay = self.layout
        targets = torch.tensor(self.done, dtype=torch.long)
        node = torch.where(targets < lay.n_features, targets, lay.n_sources + targets - lay.n_features)
        weight = torch.where(targets >= lay.n_features,
                             lay.logit_probs[(targets - lay.n_features).clamp_min(0)].double(), torch.zeros((),
                                                                                                   dtype=torch.float64))
        return node, weight

    def feature_influence(self) -> torch.Tensor:
        """Influence on the logits of every source column, from the rows computed so far."""
        node, weight = self.row_nodes()
        if self.keep_mass is not None:
            return self.sparse().influence(node, weight)[:self.layout.n_features]
        _, rows = self.matrix()
        return influence(rows, node, weight.to(rows.dtype))[:self.layout.n_features]


class FixedRows(RowStore):
    """Every one of ``n`` target rows, in order (no logits first, no budget): for probes such as
    the query/key coordinates of :mod:`.qk`."""

    def __init__(self, n: int, n_sources: int) -> None:
        super(FixedRows, self).__init__(n_sources)
        self.n = n

    def next_rows(self, batch: int) -> list[int]:
        start = len(self.done)
        return list(range(start, min(start + batch, self.n)))


def assemble(layout: Layout, scheduler: RowScheduler, values: torch.Tensor, prompt: str, meta: dict[str, Any]) -> Graph:
    """The :class:`Graph` over the visited features and every error/embedding/bias/logit node."""
    targets = torch.tensor(scheduler.done, dtype=torch.long)
    nf, ns = layout.n_features, layout.n_sources
    visited = torch.zeros(nf, dtype=torch.bool)
    visited[targets[targets < nf]] = True
    keep_src = torch.cat([visited, torch.ones(ns - nf, dtype=torch.bool)])
    src_ids = keep_src.nonzero().flatten()
    n_logits = layout.n_logits
    node_ids = torch.cat([src_ids, torch.arange(ns, ns + n_logits)])
    new_index = torch.full((ns + n_logits,), -1, dtype=torch.long)
    new_index[node_ids] = torch.arange(node_ids.numel())
    n, k = node_ids.numel(), src_ids.numel()
    row_at = new_index[torch.where(targets < nf, targets, ns + targets - nf)]
    first = scheduler.rows[0] if scheduler.rows else None
    dtype = values.dtype if first is None else (first.val if isinstance(first, SparseRows) else first).dtype
    adjacency = torch.zeros(n, n, dtype=dtype)
    start = 0
    for chunk in scheduler.rows:  # chunk by chunk: no (rows, sources) copy of all rows at once
        dense = chunk.dense() if isinstance(chunk, SparseRows) else chunk
        # the kept sources are the first columns, in order: a row scatter, no (rows × sources) index grid
        adjacency[row_at[start:start + dense.shape[0]], :k] = dense if k == ns else dense[:, src_ids]
        start += dense.shape[0]
    all_values = torch.full((ns + n_logits,), float("nan"), dtype=dtype)
    all_values[:nf] = values[:nf].cpu()
    all_values[ns:] = values[nf:].cpu()
    computed = torch.zeros(n, dtype=torch.bool)
    computed[row_at] = True
    return Graph(tokens=layout.tokens, nodes=layout.nodes.select(node_ids), adjacency=adjacency,
                 values=all_values[node_ids], logit_probs=layout.logit_probs, feature_rows=computed,
                 layout_ids=node_ids, prompt=prompt, meta=meta)


def assemble_pruned(layout: Layout, scheduler: RowScheduler, values: torch.Tensor, *, node_threshold: float,
                    edge_threshold: float, prompt: str, meta: dict[str, Any]) -> Graph:
    """The pruned :class:`Graph` of the rows in ``scheduler`` (see the module docstring)."""
    nf, ns, nl = layout.n_features, layout.n_sources, layout.n_logits
    sp = scheduler.sparse()
    scheduler.rows = [sp]  # the chunks' copies can go (12 B per stored entry)
    row_node, lw_row = scheduler.row_nodes()
    kind = layout.nodes.kind
    n_all = ns + nl
    visited = torch.zeros(n_all, dtype=torch.bool)
    visited[row_node] = True
    in_graph = visited.clone()
    in_graph[nf:] = True  # errors, embeddings, biases, logits are always graph nodes
    rows_local = sp.local_rows()
    entry_node = row_node.to(torch.int32)[rows_local]  # int32 per stored entry, as the columns
    in_graph_entry = in_graph[sp.col]
    # 1. node influence on the graph (unvisited features are not graph nodes, as in the dense path)
    infl_src = sp.influence(row_node, lw_row, keep=in_graph_entry)
    infl = torch.cat([infl_src, torch.zeros(nl, dtype=torch.float64)])
    infl[~in_graph] = 0
    always = (kind == EMBEDDING) | (kind == BIAS) | (kind == LOGIT)
    node_mask = in_graph & ((infl >= find_threshold(infl[in_graph], node_threshold)) | always)
    # 2. edge scores on the node-pruned matrix
    lw = torch.zeros(n_all, dtype=torch.float64)
    lw[row_node] = lw_row
    alive = node_mask[sp.col] & node_mask[entry_node] & (sp.val != 0)
    infl_pruned = torch.cat([sp.influence(row_node, lw_row, keep=alive), torch.zeros(nl, dtype=torch.float64)])
    den = torch.zeros(sp.n_rows, dtype=torch.float64).index_add(0, rows_local[alive], sp.val[alive].double().abs())
    score = torch.zeros(sp.val.numel(), dtype=torch.float64)
    score[alive] = sp.val[alive].double().abs() / den[rows_local[alive]].clamp_min(1e-30) * (
        infl_pruned + lw)[entry_node[alive]]
    edge = alive & (score >= find_threshold(score[alive], edge_threshold)) if bool(alive.any()) else alive
    # 3. dangling features / errors, until stable
    feature = (kind == TRANSCODER) | (kind == LORSA)
    prunable = feature | (kind == MLP_ERROR) | (kind == ATTN_ERROR)
    while True:
        old = node_mask.clone()
        has_out = torch.zeros(n_all, dtype=torch.bool)
        has_out[sp.col[edge]] = True
        has_in = torch.zeros(n_all, dtype=torch.bool)
        has_in[entry_node[edge]] = True
        node_mask &= ~prunable | has_out
        node_mask &= ~feature | has_in
        node_mask |= always & in_graph
        edge &= node_mask[sp.col] & node_mask[entry_node]
        if torch.equal(old, node_mask):
            break
    # 4. the kept nodes' graph: every stored edge among them, the rest of each row in its residual
    kept = node_mask.nonzero().flatten()
    index = torch.full((n_all,), -1, dtype=torch.long)
    index[kept] = torch.arange(kept.numel())
    n = kept.numel()
    among = node_mask[sp.col] & node_mask[entry_node]
    adjacency = torch.zeros(n, n, dtype=sp.val.dtype)
    adjacency[index[entry_node[among]], index[sp.col[among]]] = sp.val[among]
    outside = torch.zeros(sp.n_rows, dtype=torch.float64).index_add(
        0, rows_local[~among], sp.val[~among].double()) + sp.residual
    residual = torch.zeros(n, dtype=torch.float64)
    computed = torch.zeros(n, dtype=torch.bool)
    row_kept = node_mask[row_node]
    residual[index[row_node[row_kept]]] = outside[row_kept]
    computed[index[row_node[row_kept]]] = True
    all_values = torch.full((n_all,), float("nan"), dtype=values.dtype)
    all_values[:nf] = values[:nf].cpu()
    all_values[ns:] = values[nf:].cpu()
    meta = {**meta, "pruned": {"node_threshold": node_threshold, "edge_threshold": edge_threshold,
                               "keep_mass": scheduler.keep_mass, "stored_entries": int(sp.val.numel())}}
    return Graph(tokens=layout.tokens, nodes=layout.nodes.select(kept), adjacency=adjacency, values=all_values[kept],
                 logit_probs=layout.logit_probs, feature_rows=computed, layout_ids=kept, prompt=prompt, meta=meta,
                 residual=residual.to(adjacency.dtype))
