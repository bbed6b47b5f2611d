"""The causal-block store of an attribution graph's adjacency (:class:`BlockAdjacency`): per target cell of
equal (site, position), one dense block over the sources that can be upstream of it, so that a graph's memory
follows its possible edges rather than ``n_nodes²``. :class:`~.graph.Graph` holds one (or a dense matrix).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .._typing import Float, Int
from ..errors import CheckpointError, ShapeError, UnsupportedArchitectureError
from .nodes import HOST, NodeTable

#: entries per temporary of the block passes (:meth:`BlockAdjacency.abs_sums`, :meth:`BlockAdjacency.weighted_abs`:
#: float64, 2 MiB)
CHUNK = 2**18


class BlockAdjacency:
    """An ``(n, n)`` adjacency stored by its causal blocks: only the entries that can be non-zero.

    A target's value in the frozen replacement model depends only on sources upstream of it: at an
    earlier site (:meth:`NodeTable.sites`; the residual stream is written in order) and at a position
    ``≤`` its own (causal attention), plus the bias nodes (no position; kept for every target).
    Everything else in circuit-tracer's dense ``n_nodes²`` matrix is a structural zero — the rows of
    errors, embeddings and biases, the columns of later layers and later positions: about 80 % of it
    on a 4-layer model. The target rows are grouped into *cells* of equal (site, position) — all rows
    of a cell have the same possible sources — with one dense ``(rows, possible sources)`` block per
    cell: ``4 B`` (fp32) per possible edge instead of ``4 B · n²``. A cell's columns (:meth:`cols`)
    are the sources at an earlier site ordered by (position, node) — so the columns of cell ``(s, p)``
    are a prefix of that order — then the bias nodes. Exact: every entry that could be non-zero is
    stored, and each row is checked as it is written to have nothing outside its block (else
    :class:`~nnsight_lorsa.errors.UnsupportedArchitectureError`); :meth:`dense` gives the ``(n, n)`` matrix.

    Args:
        site: ``(n,)`` int64 each node's site (:meth:`NodeTable.sites`: ``-1`` a source of every
            target); ``n`` nodes, sources first.
        pos: ``(n,)`` int64 each node's position.
        n_sources: the columns that can be sources (the first ``n_sources`` nodes).
        rows: ``(r,)`` int64 the node ids of the rows that will be written (targets).
        dtype: the edges' dtype.

    Source: ours (the causal-block storage of the adjacency; circuit-tracer keeps it dense).
    """

    def __init__(self, site: torch.Tensor, pos: torch.Tensor, n_sources: int, rows: torch.Tensor,
                 dtype: torch.dtype) -> None:
        self.n, self.n_sources, self.dtype = int(site.numel()), n_sources, dtype
        self._src_site, self._src_pos = site[:n_sources], pos[:n_sources]
        self._free = (self._src_site < 0).nonzero().flatten()  # biases: a source of every target
        rows = rows.long()
        row_site, row_pos = site[rows], pos[rows]
        key = row_site * (int(pos.max()) + 2 if self.n else 1) + row_pos
        uniq, cell = key.unique(return_inverse=True)
        self._cell_of_row = torch.full((self.n,), -1, dtype=torch.long, device=HOST)
        self._cell_of_row[rows] = cell
        order = cell.argsort(stable=True)
        counts = torch.bincount(cell, minlength=uniq.numel())
        self.cell_rows = list(rows[order].split(counts.tolist()))  # each cell's rows, ascending node ids
        self._slot = torch.zeros(self.n, dtype=torch.long, device=HOST)  # a row's place in its cell's block
        for r in self.cell_rows:
            self._slot[r] = torch.arange(r.numel(), device=HOST)
        starts = torch.cat([torch.zeros(1, dtype=torch.long, device=HOST), counts.cumsum(0)[:-1]])
        first = order[starts] if rows.numel() else order
        self.cell_site, self.cell_pos = row_site[first], row_pos[first]
        # per target site: the sources at earlier sites by (position, node); a cell takes a prefix
        self._upstream: dict[int, torch.Tensor] = {}
        k = torch.zeros(len(self.cell_rows), dtype=torch.long, device=HOST)
        for s in self.cell_site.unique().tolist():
            src = ((self._src_site >= 0) & (self._src_site < s)).nonzero().flatten()
            src = src[self._src_pos[src].argsort(stable=True)]
            self._upstream[s] = src
            at = (self.cell_site == s).nonzero().flatten()
            k[at] = torch.searchsorted(self._src_pos[src].contiguous(), self.cell_pos[at].contiguous(), right=True)
        self._prefix = k
        # host copies for the per-batch writes (a Python int per cell, not a tensor read per call)
        self._site_of_cell: list[int] = self.cell_site.tolist()
        self._prefix_of_cell: list[int] = k.tolist()
        self.blocks: list[torch.Tensor | None] = [None] * len(self.cell_rows)
        self._runs: tuple[int, list[tuple[int, int, int]]] | None = None  # _row_runs of that many written cells

    # ------------------------------------------------------------------ structure
    def cols(self, cell: int) -> torch.Tensor:
        """``(c,)`` int64 the source columns of cell ``cell``'s block, in the block's order.

        Source: ours (the causal-block storage of the adjacency; circuit-tracer keeps it dense).
        """
        return torch.cat([self._upstream[self._site_of_cell[cell]][:self._prefix_of_cell[cell]], self._free])

    def n_cols(self) -> torch.Tensor:
        """``(n_cells,)`` the number of columns of each cell's block (without building them).

        Source: ours (the causal-block storage of the adjacency; circuit-tracer keeps it dense).
        """
        return self._prefix + self._free.numel()

    def entries(self) -> int:
        """Stored entries once every row is written (``Σ`` rows × columns over the cells).

        Source: ours (the causal-block storage of the adjacency; circuit-tracer keeps it dense).
        """
        sizes = torch.tensor([r.numel() for r in self.cell_rows], dtype=torch.long, device=HOST)
        return int((sizes * self.n_cols()).sum())

    @property
    def shape(self) -> tuple[int, int]:
        """``(n, n)``, as the dense matrix it stands for.

        Source: ours (the causal-block storage of the adjacency; circuit-tracer keeps it dense).
        """
        return (self.n, self.n)

    @property
    def nbytes(self) -> int:
        """Bytes of the written blocks (the edges).

        Source: ours (the causal-block storage of the adjacency; circuit-tracer keeps it dense).
        """
        return sum(b.numel() * b.element_size() for b in self.blocks if b is not None)

    @property
    def index_nbytes(self) -> int:
        """Bytes of the block index: each target site's source list and the two ``(n,)`` int64 row maps.

        Source: ours (the causal-block storage of the adjacency; circuit-tracer keeps it dense).
        """
        return 8 * (sum(u.numel() for u in self._upstream.values()) + self._cell_of_row.numel() + self._slot.numel())

    # ------------------------------------------------------------------ writing
    def write(self, rows: torch.Tensor, grads: Float[torch.Tensor, "b s"]) -> None:
        """Store ``grads[i]`` as row ``rows[i]`` (node ids of this adjacency's rows; ``grads``: the
        ``n_sources`` columns).

        Raises:
            ShapeError: a row that is not one of this adjacency's, or ``grads`` of another column count.
            UnsupportedArchitectureError: a row has a non-zero entry outside its block — an edge from a
                later position or site, which a causal decoder's frozen replacement model cannot have.

        Source: ours (the causal-block storage of the adjacency; circuit-tracer keeps it dense).
        """
        rows = rows.to(HOST, torch.long)
        g = grads.detach().to(HOST)  # the rows of a batch, from the model's device
        cells = self._cell_of_row[rows]
        cell_list: list[int] = cells.tolist()  # the one host read of the batch's cells
        if min(cell_list, default=0) < 0 or g.shape[1] != self.n_sources:
            raise ShapeError(f"BlockAdjacency.write: rows {rows.tolist()} / {g.shape[1]} columns do not fit this "
                             f"adjacency ({self.n_sources} columns; rows of its own nodes)")
        at_of: dict[int, list[int]] = {}  # each cell's batch rows, ascending (as cells.unique(), nonzero())
        for i, cell in enumerate(cell_list):
            at_of.setdefault(cell, []).append(i)
        kept = torch.zeros((), dtype=torch.long, device=HOST)
        for cell in sorted(at_of):
            at = torch.tensor(at_of[cell], dtype=torch.long, device=HOST)
            cols = self.cols(cell)
            part = g[at[:, None], cols[None, :]]
            block = self.blocks[cell]
            if block is None:
                block = self.blocks[cell] = torch.zeros(self.cell_rows[cell].numel(), cols.numel(), dtype=self.dtype,
                                                        device=HOST)
            block[self._slot[rows[at]]] = part.to(self.dtype)
            kept += part.count_nonzero()
        if bool(kept != g.count_nonzero()):  # a non-zero entry outside the blocks: find it, refuse the rows
            for i, cell in enumerate(cells.tolist()):
                outside = g[i].clone()
                outside[self.cols(cell)] = 0
                if bool(outside.any()):
                    src = int(outside.nonzero()[0])
                    raise UnsupportedArchitectureError(
                        f"attribution row of node {int(rows[i])} (site {int(self.cell_site[cell])}, position "
                        f"{int(self.cell_pos[cell])}) has an edge from source {src} (site {int(self._src_site[src])}, "
                        f"position {int(self._src_pos[src])}): later than the target. The full graph's block "
                        "storage assumes a causal decoder; sparse rows store any edge: "
                        "prune=PruneConfig(..., keep_mass=0.999)")

    # ------------------------------------------------------------------ reading
    def items(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(rows (r,), cols (c,), block (r, c))`` of every written cell: ``A[rows[i], cols[j]] = block[i, j]``.

        Source: ours (the causal-block storage of the adjacency; circuit-tracer keeps it dense).
        """
        for cell, block in enumerate(self.blocks):
            if block is not None:
                yield self.cell_rows[cell], self.cols(cell), block

    def coo(self) -> tuple[Int[torch.Tensor, " k"], Int[torch.Tensor, " k"], Float[torch.Tensor, " k"]]:
        """``(row, col, val)``: the ``k`` non-zero stored entries in row-major order (``row`` ascending, then
        ``col``; int64, int64, the blocks' dtype) — the order, and so the values, of ``dense().nonzero()``
        without the ``(n, n)`` matrix. Memory ``20 B · k`` (+ one cell's block copy at a time).

        Source: ours (the causal-block storage of the adjacency; circuit-tracer keeps it dense).
        """
        parts = []
        for rows, cols, block in self.items():
            perm = cols.argsort()
            b = block[:, perm]
            i, j = b.nonzero(as_tuple=True)  # row-major within the cell, columns ascending
            parts.append((rows[i], cols[perm][j], b[i, j]))
        if not parts:
            return (torch.zeros(0, dtype=torch.long, device=HOST), torch.zeros(0, dtype=torch.long, device=HOST),
                    torch.zeros(0, dtype=self.dtype, device=HOST))
        row, col, val = (torch.cat(t) for t in zip(*parts, strict=True))
        # a row lies in one cell, its entries contiguous and in column order: put the rows' runs in row order
        zero = torch.zeros(1, dtype=torch.long, device=HOST)
        start = torch.cat([zero, (row[1:] != row[:-1]).nonzero().flatten() + 1])
        size = torch.cat([start[1:], torch.tensor([row.numel()], device=HOST)]) - start
        by_row = row[start].argsort()
        order = segments(start[by_row], size[by_row])
        return row[order], col[order], val[order]

    def _row_runs(self) -> list[tuple[int, int, int]]:
        """``(cell, first slot, end slot)``: the written rows in ascending node order, as runs of consecutive rows of
        one cell (a cell's rows ascend; where the nodes are ordered by site and position a cell is one run)."""
        written = [c for c, b in enumerate(self.blocks) if b is not None]
        cached = self._runs
        if cached is not None and cached[0] == len(written):  # blocks are only ever added: the same cells
            return cached[1]
        if not written:
            return []
        rows = torch.cat([self.cell_rows[c] for c in written])
        cell = torch.cat([torch.full((self.cell_rows[c].numel(),), c, dtype=torch.long, device=HOST) for c in written])
        order = rows.argsort()
        cell, slot = cell[order], self._slot[rows[order]]
        cut = ((cell[1:] != cell[:-1]).nonzero().flatten() + 1).tolist()
        runs = [(int(cell[a]), int(slot[a]), int(slot[b - 1]) + 1)
                for a, b in zip([0, *cut], [*cut, rows.numel()], strict=True)]
        self._runs = (len(written), runs)
        return runs

    def _sorted_columns(self) -> Callable[[int], torch.Tensor]:
        """``perm(cell)``: the order of cell ``cell``'s columns (:meth:`cols`) that sorts them ascending — from one
        ``argsort`` per site (a cell's columns are a prefix of its site's list, then the bias nodes), not one per
        cell."""
        order: dict[int, torch.Tensor] = {}  # the last site's only: cells of one site come together
        free_last = not self._free.numel() or not self.n_sources or bool(
            (self._free.min() > (self._src_site >= 0).nonzero().max()) if bool((self._src_site >= 0).any()) else True)

        def perm(cell: int) -> torch.Tensor:
            site, k = int(self.cell_site[cell]), int(self._prefix[cell])
            if not free_last:
                return self.cols(cell).argsort()
            if site not in order:
                order.clear()
                order[site] = self._upstream[site].argsort()
            up = order[site]
            return torch.cat([up[up < k], torch.arange(k, k + self._free.numel(), device=HOST)])

        return perm

    def abs_sums(self, col_mask: torch.Tensor | None = None, row_mask: torch.Tensor | None = None
                 ) -> Float[torch.Tensor, " n"]:
        """``(n,)`` float64 ``Σ_s |A[t, s]|`` of every node ``t`` (only the sources ``s`` where the bool
        ``col_mask: (n_sources,)`` is True, if given; 0 for rows never written, and for rows outside the bool
        ``row_mask: (n,)`` if given), each summed in ascending source order — the order, and so the bits, of
        ``index_add`` over :meth:`coo`'s entries. Temporaries: one cell's block in float64 at a time (at most
        :data:`CHUNK` entries).

        Source: ours (the causal-block storage of the adjacency; circuit-tracer keeps it dense).
        """
        out = torch.zeros(self.n, dtype=torch.float64, device=HOST)
        sorting = self._sorted_columns()
        for cell, block in enumerate(self.blocks):
            if block is None:
                continue
            rows = self.cell_rows[cell]
            at = None if row_mask is None else row_mask[rows].nonzero().flatten()
            if at is not None and not at.numel():
                continue
            cols = self.cols(cell)
            perm = sorting(cell)
            if col_mask is not None:
                perm = perm[col_mask[cols[perm]]]
            if not perm.numel():
                continue
            if at is not None and at.numel() < rows.numel():
                block, rows = block[at], rows[at]
            step = max(1, CHUNK // perm.numel())
            for r0 in range(0, rows.numel(), step):
                part = block[r0:r0 + step][:, perm]
                out[rows[r0:r0 + step]] = torch.cumsum(part.abs_(), 1, dtype=torch.float64)[:, -1]
        return out

    def weighted_abs(self, weight: Float[torch.Tensor, " n"], den: Float[torch.Tensor, " n"],
                     col_mask: torch.Tensor | None = None) -> Float[torch.Tensor, " s"]:
        """One influence step: ``(n_sources,)`` float64 ``Σ_t weight[t] · |A[t, s]| / den[t]`` (``weight``, ``den``:
        ``(n,)`` float64 over the nodes; only the sources where ``col_mask`` is True, if given), each entry
        ``(|v| / den[t]) · weight[t]`` in float64 and each source's terms added one by one in ascending target
        order — the arithmetic, and so the bits, of ``index_add`` over :meth:`coo`'s entries (a zero entry adds an
        exact 0). Only the rows of non-zero weight are read: per run of rows of one cell, their contributions
        (``rows × cols`` float64, at most :data:`CHUNK` entries at a time) behind the running sums, summed down
        the rows with ``cumsum`` (sequential).

        Source: ours (the causal-block storage of the adjacency; circuit-tracer keeps it dense).
        """
        out = torch.zeros(self.n_sources, dtype=torch.float64, device=HOST)
        buffer = torch.empty(CHUNK, dtype=torch.float64, device=HOST)  # reused by every part
        for cell, s0, s1 in self._row_runs():
            rows = self.cell_rows[cell][s0:s1]
            w = weight[rows]
            live = w.nonzero().flatten()
            if not live.numel():
                continue
            cols = self.cols(cell)  # per run, not kept: all cells' column lists would be Σ cols × 8 B
            keep = None if col_mask is None else col_mask[cols].nonzero().flatten()
            if keep is not None:
                cols = cols[keep]
            block = self.blocks[cell]
            assert block is not None
            every = live.numel() == rows.numel()
            w, d, live = w[live][:, None], den[rows[live]][:, None], live + s0
            step = max(1, CHUNK // (live.numel() + 1))
            for c0 in range(0, cols.numel(), step):
                at = cols[c0:c0 + step]
                if keep is not None:
                    part = block[live[:, None], keep[None, c0:c0 + step]]
                elif every:
                    part = block[s0:s1, c0:c0 + step]  # a view: copied below
                else:
                    part = block[live, c0:c0 + step]
                if (live.numel() + 1) * at.numel() > buffer.numel():  # a cell of more than CHUNK rows
                    buffer = torch.empty((live.numel() + 1) * at.numel(), dtype=torch.float64, device=HOST)
                acc = buffer[:(live.numel() + 1) * at.numel()].view(live.numel() + 1, at.numel())
                acc[0] = out[at]
                acc[1:].copy_(part).abs_().div_(d).mul_(w)
                out[at] = acc.cumsum_(0)[-1]
        return out

    def _masked_parts(self, col_mask: torch.Tensor, row_mask: torch.Tensor
                      ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(rows (r,), cols (c,), sub (r, c))``: the blocks between ``row_mask`` rows and ``col_mask`` columns,
        columns ascending, rows ascending across the parts (each a copy of at most :data:`CHUNK` entries)."""
        sorting = self._sorted_columns()
        for cell, s0, s1 in self._row_runs():
            rows = self.cell_rows[cell][s0:s1]
            rk = row_mask[rows].nonzero().flatten()
            if not rk.numel():
                continue
            cols = self.cols(cell)
            perm = sorting(cell)
            perm = perm[col_mask[cols[perm]]]
            cols = cols[perm]
            if not perm.numel():
                continue
            block = self.blocks[cell]
            assert block is not None
            step = max(1, CHUNK // perm.numel())
            for r0 in range(0, rk.numel(), step):
                at = rk[r0:r0 + step]
                yield rows[at], cols, block[(at + s0)[:, None], perm[None, :]]

    def count_edges(self, col_mask: torch.Tensor, row_mask: torch.Tensor) -> int:
        """The non-zero entries between ``row_mask: (n,)`` rows and ``col_mask: (n_sources,)`` columns (bool).

        Source: ours (the causal-block storage of the adjacency; circuit-tracer keeps it dense).
        """
        return sum(int(sub.count_nonzero()) for _, _, sub in self._masked_parts(col_mask, row_mask))

    def edge_scores(self, factor: Float[torch.Tensor, " n"], den: Float[torch.Tensor, " n"], col_mask: torch.Tensor,
                    row_mask: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(target (k,) int64, source (k,) int64, score (k,) float64)`` of the non-zero entries between
        ``row_mask`` rows and ``col_mask`` columns, score ``|v| / den[t] · factor[t]`` (``factor``, ``den``:
        ``(n,)`` float64), row-major with sources ascending (:meth:`coo`'s order), a part at a time.

        Source: ours (the causal-block storage of the adjacency; circuit-tracer keeps it dense).
        """
        for rows, cols, sub in self._masked_parts(col_mask, row_mask):
            i, j = sub.nonzero(as_tuple=True)
            t = rows[i]
            yield t, cols[j], sub[i, j].abs().to(torch.float64).div_(den[t]).mul_(factor[t])

    def gather(self, rows: Int[torch.Tensor, "..."], cols: Int[torch.Tensor, "..."]) -> Float[torch.Tensor, "..."]:
        """``A[rows, cols]`` (the two broadcast together; 0 outside the blocks and in rows never written),
        in the blocks' dtype, read from the blocks: memory of the result + one ``(n,)`` index per target site
        queried.

        Raises:
            IndexError: a node id outside ``[0, n)``.

        Source: ours (the causal-block storage of the adjacency; circuit-tracer keeps it dense).
        """
        rows, cols = torch.broadcast_tensors(rows.to(HOST, torch.long), cols.to(HOST, torch.long))
        shape, rows, cols = rows.shape, rows.flatten(), cols.flatten()
        out = torch.zeros(rows.numel(), dtype=self.dtype, device=HOST)
        cell = self._cell_of_row[rows]
        where = torch.full((rows.numel(),), -1, dtype=torch.long, device=HOST)  # the column's place in its block
        free_at = torch.full((self.n,), -1, dtype=torch.long, device=HOST)
        free_at[self._free] = torch.arange(self._free.numel(), device=HOST)
        asked = ((cell >= 0) & (cols < self.n_sources)).nonzero().flatten()  # a stored row, a source column
        asked_site = self.cell_site[cell[asked]]
        for s in asked_site.unique().tolist():
            up = self._upstream[s]
            at_up = torch.full((self.n,), -1, dtype=torch.long, device=HOST)
            at_up[up] = torch.arange(up.numel(), device=HOST)
            q = asked[asked_site == s]
            j, prefix = at_up[cols[q]], self._prefix[cell[q]]
            f = free_at[cols[q]]
            where[q] = torch.where((j >= 0) & (j < prefix), j, torch.where(f >= 0, prefix + f, -1))
        hit = (where >= 0).nonzero().flatten()
        hit = hit[cell[hit].argsort(stable=True)]  # grouped by cell: one gather per block
        cells, counts = cell[hit].unique_consecutive(return_counts=True)
        for c, q in zip(cells.tolist(), hit.split(counts.tolist()), strict=True):
            block = self.blocks[c]
            if block is not None:
                out[q] = block[self._slot[rows[q]], where[q]]
        return out.view(shape)

    def dense(self) -> Float[torch.Tensor, "n n"]:
        """The ``(n, n)`` matrix (``4 B · n²`` at fp32; zeros outside the blocks).

        Source: ours (the causal-block storage of the adjacency; circuit-tracer keeps it dense).
        """
        out = torch.zeros(self.n, self.n, dtype=self.dtype, device=HOST)
        for rows, cols, block in self.items():
            out[rows[:, None], cols[None, :]] = block
        return out

    def row_sums(self, rows: torch.Tensor, absolute: bool = False) -> Float[torch.Tensor, " r"]:
        """``(r,)`` float64 ``Σ_s A[t, s]`` (or ``Σ_s |A[t, s]|``) of the node ids ``rows``.

        Source: ours (the causal-block storage of the adjacency; circuit-tracer keeps it dense).
        """
        sums = torch.zeros(self.n, dtype=torch.float64, device=HOST)
        for r, _, block in self.items():
            sums[r] = (block.abs() if absolute else block).sum(1, dtype=torch.float64)
        return sums[rows.long()]

    def count_nonzero(self) -> int:
        """Number of non-zero entries over the stored blocks.

        Source: ours (the causal-block storage of the adjacency; circuit-tracer keeps it dense).
        """
        return sum(int((b != 0).sum()) for b in self.blocks if b is not None)

    # ------------------------------------------------------------------ files
    def to_tensors(self) -> dict[str, torch.Tensor]:
        """What :meth:`Graph.save` writes: ``adjacency_rows`` ``(r,)`` int64 the written rows cell by cell,
        ``adjacency_blocks`` ``(Σ rows × cols,)`` their blocks flattened in the same order, ``adjacency_sources``
        ``(1,)`` int64 — the blocks' bytes once more (a copy), never ``n²``.

        Source: ours (the causal-block storage of the adjacency; circuit-tracer keeps it dense).
        """
        written = [c for c, b in enumerate(self.blocks) if b is not None]
        rows = [self.cell_rows[c] for c in written]
        vals = [b.flatten() for b in self.blocks if b is not None]
        return {"adjacency_rows": torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long, device=HOST),
                "adjacency_blocks": torch.cat(vals) if vals else torch.zeros(0, dtype=self.dtype, device=HOST),
                "adjacency_sources": torch.tensor([self.n_sources], dtype=torch.long, device=HOST)}

    @classmethod
    def from_tensors(cls, nodes: NodeTable, t: dict[str, torch.Tensor]) -> BlockAdjacency:
        """The blocks :meth:`to_tensors` wrote, over the graph's ``nodes`` (their sites and positions give
        every cell's columns again).

        Raises:
            CheckpointError: (a ``ValueError``) the values do not fill the blocks of those rows exactly.

        Source: ours (the causal-block storage of the adjacency; circuit-tracer keeps it dense).
        """
        flat = t["adjacency_blocks"]
        out = cls(nodes.sites(), nodes.pos, int(t["adjacency_sources"]), t["adjacency_rows"].long(), flat.dtype)
        sizes = [r.numel() * int(c) for r, c in zip(out.cell_rows, out.n_cols(), strict=True)]
        if sum(sizes) != flat.numel():
            raise CheckpointError(f"tensor 'adjacency_blocks' has {flat.numel()} values; the blocks of "
                                  f"'adjacency_rows' take {sum(sizes)}")
        for c, part in enumerate(flat.split(sizes)):
            out.blocks[c] = part.view(out.cell_rows[c].numel(), -1).clone()
        return out


def segments(start: Int[torch.Tensor, " m"], size: Int[torch.Tensor, " m"]) -> Int[torch.Tensor, " k"]:
    """``cat([arange(start[i], start[i] + size[i]) for i])`` (int64, ``k = Σ size``) without a Python loop."""
    return torch.repeat_interleave(start + size - size.cumsum(0), size) + torch.arange(int(size.sum()), device=HOST)
