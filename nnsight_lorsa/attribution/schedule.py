"""Which target rows of the adjacency to compute, in which order (``max_feature_nodes``).

Logit rows come first. Then, when the prompt has more active features/heads than the budget,
features are visited in order of their influence on the logits estimated from the rows computed
so far (circuit-tracer's influence-ordered selection), re-estimated after every batch; otherwise
every feature row is computed in node order. torch only.
"""

from __future__ import annotations

from typing import Any

import torch

from .influence import influence
from .layout import Layout
from .sparse_rows import SparseRows


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
