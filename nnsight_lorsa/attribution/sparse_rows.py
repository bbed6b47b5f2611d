"""Edge rows stored sparse: what keeps long prompts off the dense ``rows × sources`` buffer.

A computed row (a target's incoming edges over every source) keeps its largest ``|edges|`` up to
a fraction ``keep_mass`` of the row's absolute mass; the signed sum of the dropped entries is kept
exactly as the row's ``residual``, so ``Σ kept + residual`` still equals the target's value. Memory
is ``12 B × kept entries`` instead of ``4 B × sources`` per row. torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._repr import FieldsRepr
from .._typing import Float, Int
from .influence import influence_series


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
        """:func:`.influence.influence` over the stored entries (optionally only those where ``keep``),
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
