"""The row stages of a budgeted attribution (issue 21, goal 4(d): the per-row cost above the floor) keep their bits:
the stored rows (:meth:`SparseRows.append`), their masked sums and influence steps (:meth:`SparseRows.abs_sums`,
:meth:`SparseRows.weighted_abs`), the ranking's sums (:meth:`RowScheduler.feature_influence`, each stored row summed
once) and the budgeted assembly (:func:`.rows.assemble`), against per-entry references — the code they replaced —
bit for bit, also with rows that span several chunks."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import attribution_setup, dense_budget_assembly, random_ids, rm
from hypothesis import event, given, settings
from hypothesis import strategies as st

from nnsight_lorsa.attribution import attribute
from nnsight_lorsa.attribution.rows import RowScheduler, SparseRows, _rows_of

ROWS = sys.modules["nnsight_lorsa.attribution.rows"]
ENGINE = sys.modules["nnsight_lorsa.attribution.engine"]


def reference_append(grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``(col, val, row ends)`` as the former :meth:`SparseRows.append` stored every non-zero entry: a 2-D nonzero."""
    keep = grads.abs() > 0
    r, c = keep.nonzero(as_tuple=True)
    return c.int(), grads[r, c], keep.sum(1).cumsum(0).tolist()


def entries(rows: SparseRows, row_mask: torch.Tensor | None = None):
    """Every stored entry ``(row, col, val)`` of ``rows`` (``row_mask``: only its rows), in storage order."""
    for block in rows.blocks:
        if not block.fill:
            continue
        row = _rows_of(block.ends, 0, block.fill) + block.row_start
        col, val = block.col[:block.fill].long(), block.val[:block.fill]
        if row_mask is not None:
            k = row_mask[row]
            row, col, val = row[k], col[k], val[k]
        yield row, col, val


def stored(draw_seed: int, n_rows: int, n_cols: int, zero_frac: float, dtype: torch.dtype,
           transpose: bool) -> tuple[SparseRows, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(draw_seed)
    rows, batches = SparseRows(n_cols), []
    for b in range(0, n_rows, 3):
        grads = torch.randn(min(3, n_rows - b), n_cols, generator=g, dtype=torch.float64)
        grads[torch.rand(grads.shape, generator=g) < zero_frac] = 0
        grads = grads.to(dtype)
        if transpose:  # a non-contiguous batch
            grads = grads.t().contiguous().t()
        batches.append(grads)
        rows.append(grads)
    return rows, batches


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), n_rows=st.integers(1, 10), n_cols=st.integers(1, 60),
       zero_frac=st.floats(0.0, 1.0), dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       transpose=st.booleans(), chunk=st.sampled_from([3, 7, 64, 2**18]), mask_frac=st.floats(0.0, 1.0))
def test_stored_rows_their_masked_sums_and_influence_steps_are_the_per_entry_references(
        seed, n_rows, n_cols, zero_frac, dtype, transpose, chunk, mask_frac):
    old = ROWS.CHUNK_ENTRIES
    ROWS.CHUNK_ENTRIES = chunk  # rows longer than a chunk: summed and stepped in pieces
    try:
        rows, batches = stored(seed, n_rows, n_cols, zero_frac, dtype, transpose)
        # the store: each batch's entries as the 2-D nonzero stored them
        cols, vals = torch.cat([b.col[:b.fill] for b in rows.blocks]), torch.cat([b.val[:b.fill] for b in rows.blocks])
        want = [reference_append(b) for b in batches]
        assert torch.equal(cols, torch.cat([c for c, _, _ in want]))
        assert torch.equal(vals, torch.cat([v for _, v, _ in want]))
        ends = [e for b in rows.blocks for e in b.ends]
        offset, want_ends = 0, []
        for _, v, e in want:
            want_ends += [offset + x for x in e]
            offset += v.numel()
        assert ends == want_ends
        g = torch.Generator().manual_seed(seed + 1)
        col_mask = torch.rand(n_cols, generator=g) >= mask_frac
        row_mask = torch.rand(rows.n_rows, generator=g) < 0.7
        # the masked sums: the former per-entry index_add over the masked copies
        den = torch.zeros(rows.n_rows, dtype=torch.float64)
        for row, col, val in entries(rows, row_mask):
            k = col_mask[col]
            den.index_add_(0, row[k], val[k].double().abs_())
        assert torch.equal(rows.abs_sums(col_mask, row_mask), den)
        # an influence step: the former per-entry mask, each entry (|v| / den) · w
        w = torch.rand(rows.n_rows, generator=g, dtype=torch.float64) * row_mask
        d = den.clamp_min(1e-30)
        step = torch.zeros(n_cols, dtype=torch.float64)
        for row, col, val in entries(rows, w != 0):
            step.index_add_(0, col, val.abs().double().div_(d[row]).mul_(w[row]).mul_(col_mask[col]))
        assert torch.equal(rows.weighted_abs(w, col_mask, d), step)
        assert torch.equal(rows.weighted_abs(w, None, d).masked_fill_(~col_mask, 0.0), step)
        dirty = torch.randn(n_cols, generator=g, dtype=torch.float64)  # a reused step vector: zeroed, then filled
        assert rows.weighted_abs(w, col_mask, d, out=dirty) is dirty and torch.equal(dirty, step)
    finally:
        ROWS.CHUNK_ENTRIES = old


@pytest.fixture(scope="module")
def tiny():
    model, _, lorsas, tcs = attribution_setup("llama")
    return rm(model, lorsas, tcs)


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), seq=st.integers(4, 14), budget=st.integers(1, 30), chunk=st.sampled_from([5, 64]),
       zero_positions=st.integers(0, 2))
def test_the_budgeted_graph_and_its_ranking_are_the_per_entry_references_bit_for_bit(
        tiny, seed, seq, budget, chunk, zero_positions):
    """The assembly (rows in pieces of ``chunk`` entries) gives the reference's adjacency and residuals; each ranking
    is :meth:`SparseRows.influence` over every stored row (the former code) bit for bit, and the ranking's masked sums
    read each stored row once (the former code read every stored row at every ranking)."""
    seen: dict = {"read": 0, "rankings": []}
    original_rank, original_sums, original_assemble = (RowScheduler.feature_influence, SparseRows.abs_sums,
                                                       ENGINE.assemble)

    def ranking(self):
        out = original_rank(self)
        node, weight = self.row_nodes()
        seen["ranking_sums"] = False  # the reference's own sums: not counted
        full = self.sparse().influence(node, weight, self._rank_mask)[:self.layout.n_features]
        seen["rankings"].append((out.clone(), full))  # (next_rows ranks ``out`` in place)
        seen["ranking_sums"] = True
        return out

    def sums(self, col_mask=None, row_mask=None):
        if col_mask is not None and seen.get("ranking_sums", True):
            seen["read"] += self.n_rows if row_mask is None else int(row_mask.sum())
        return original_sums(self, col_mask, row_mask)

    def assemble(layout, scheduler, *a, **k):
        seen["layout"], seen["scheduler"] = layout, scheduler
        return original_assemble(layout, scheduler, *a, **k)

    old = ROWS.CHUNK_ENTRIES
    RowScheduler.feature_influence, SparseRows.abs_sums, ENGINE.assemble = ranking, sums, assemble
    try:
        g = attribute(tiny, random_ids(1, seq, seed=seed)[0], batch_size=2, max_feature_nodes=budget,
                      update_interval=1, zero_positions=zero_positions)
        seen["ranking_sums"] = False
        want, want_residual = dense_budget_assembly(seen["layout"], seen["scheduler"], entries)
        ROWS.CHUNK_ENTRIES = chunk  # the same rows assembled again, in pieces of ``chunk`` entries
        graph = ROWS.assemble(seen["layout"], seen["scheduler"], torch.zeros(seen["layout"].n_targets), "", {})
    finally:
        RowScheduler.feature_influence, SparseRows.abs_sums, ENGINE.assemble = (original_rank, original_sums,
                                                                                original_assemble)
        ROWS.CHUNK_ENTRIES = old
    for cached, full in seen["rankings"]:
        assert torch.equal(cached, full)
    n_rows = seen["scheduler"].sparse().n_rows
    if zero_positions and seen["rankings"]:  # the ranking leaves out the first positions' errors: masked sums
        assert seen["read"] > 0
    assert seen["read"] <= n_rows  # each stored row's ranking sum once (0 when every node is ranked: no mask)
    assert torch.equal(g.densify(), want) and torch.equal(g.residual, want_residual)
    assert torch.equal(graph.densify(), want) and torch.equal(graph.residual, want_residual)


# --- pruning while building: the stored rows' reads of prune_rows and the kept graph's assembly ---------------------


def reference_count_edges(rows: SparseRows, col_mask: torch.Tensor, row_mask: torch.Tensor) -> int:
    """The former :meth:`SparseRows.count_edges`: per chunk of the mask's rows, three per-entry masks."""
    n = 0
    for row, col, val in rows.chunks(row_mask):
        n += int(((val != 0) & col_mask[col] & row_mask[row]).sum())
    return n


def reference_edge_scores(rows: SparseRows, factor, den, col_mask, row_mask):
    """The former :meth:`SparseRows.edge_scores`: :func:`.scores.scored_entries` on each chunk of the mask's rows."""
    from nnsight_lorsa.attribution.scores import scored_entries

    for row, col, val in rows.chunks(row_mask):
        yield scored_entries(row, col, val, factor, den, col_mask, row_mask)


def reference_sparse_pruned(rows: SparseRows, row_node, first, node_mask, kept, empty_dtype, nodes):
    """The former :func:`.rows._sparse_pruned`: per-entry row/column indices, masks and masked copies per chunk."""
    n_all = node_mask.numel()
    index = ROWS._graph_index(kept, n_all)
    dtype = rows.blocks[0].val.dtype if rows.blocks else empty_dtype
    outside = rows.residual.clone()
    row_kept = node_mask[row_node]
    for row, col, val in rows.chunks(row_kept):
        k = ~first[col]
        outside.index_add_(0, row[k], val[k].double())

    def among(row, col, val):
        edge = node_mask[col]
        dropped = first[col] & ~edge
        outside.index_add_(0, row[dropped], val[dropped].double())
        return edge

    live = row_kept.nonzero().flatten()
    at = index[row_node]
    adjacency, n_src = ROWS._kept_blocks(nodes, kept, rows.n_cols, at[live], dtype)
    group = max(1, ROWS.CHUNK_ENTRIES // max(n_src, 1))
    slot = torch.full((row_node.numel(),), -1, dtype=torch.long)
    for g0 in range(0, live.numel(), group):
        part = live[g0:g0 + group]
        mask = torch.zeros(row_node.numel(), dtype=torch.bool)
        mask[part] = True
        slot[part] = torch.arange(part.numel())
        dense = torch.zeros(part.numel(), n_src, dtype=dtype)
        for row, col, val in rows.chunks(mask):
            edge = among(row, col, val)
            dense[slot[row[edge]], index[col[edge]]] = val[edge]
        adjacency.write(at[part], dense)
    residual = torch.zeros(kept.numel(), dtype=torch.float64)
    residual[index[row_node[row_kept]]] = outside[row_kept]
    return adjacency, residual


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits (``torch.equal`` takes ``-0.0`` for ``+0.0`` and no NaN for itself)."""
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


class Reads:
    """Counts the per-entry row indices (:func:`.rows._rows_of`, every :meth:`SparseRows.chunks` step makes one: 8 B
    an entry) made while it is active."""

    def __init__(self):
        self.entries = 0

    def __enter__(self):
        self.original = ROWS._rows_of

        def counted(ends, e0, e1):
            self.entries += e1 - e0
            return self.original(ends, e0, e1)

        ROWS._rows_of = counted
        return self

    def __exit__(self, *exc):
        ROWS._rows_of = self.original


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), n_rows=st.integers(1, 10), n_cols=st.integers(1, 60),
       zero_frac=st.floats(0.0, 1.0), dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       chunk=st.sampled_from([3, 7, 64, 2**18]), mask_frac=st.floats(0.0, 1.0))
def test_the_pruning_reads_of_the_stored_rows_are_the_per_entry_references_without_a_row_index(
        seed, n_rows, n_cols, zero_frac, dtype, chunk, mask_frac):
    """``count_edges`` and ``edge_scores`` (the edge threshold and the dangling-node loop of :func:`prune_rows`) give
    the former per-chunk code's count and ``(row, col, score)`` bit for bit, rows across several chunks; the count
    makes no per-entry row index (the former code made one for every entry of the mask's rows)."""
    old = ROWS.CHUNK_ENTRIES
    ROWS.CHUNK_ENTRIES = chunk
    try:
        rows, _ = stored(seed, n_rows, n_cols, zero_frac, dtype, False)
        g = torch.Generator().manual_seed(seed + 2)
        col_mask = torch.rand(n_cols, generator=g) >= mask_frac
        row_mask = torch.rand(rows.n_rows, generator=g) < 0.7
        with Reads() as reads:
            count = rows.count_edges(col_mask, row_mask)
        assert count == reference_count_edges(rows, col_mask, row_mask)
        assert reads.entries == 0
        factor = torch.rand(rows.n_rows, generator=g, dtype=torch.float64)
        den = rows.abs_sums(col_mask, row_mask).clamp_min(1e-30)
        got = list(rows.edge_scores(factor, den, col_mask, row_mask))
        want = list(reference_edge_scores(rows, factor, den, col_mask, row_mask))
        assert max((r.numel() for r, _, _ in got), default=0) <= chunk
        for a, b in zip((torch.cat(t) for t in zip(*got, strict=True)), (torch.cat(t) for t in zip(*want, strict=True)),
                        strict=True) if got else ():
            assert same(a, b)
        if not got:
            assert sum(r.numel() for r, _, _ in want) == 0
        assert sum(r.numel() for r, _, _ in got) == count
    finally:
        ROWS.CHUNK_ENTRIES = old


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 10_000), seq=st.integers(4, 14), keep_mass=st.sampled_from([0.5, 0.9, 0.99, 1.0]),
       budget=st.sampled_from([None, 6, 20]), node_threshold=st.sampled_from([0.5, 0.8, 1.0]),
       edge_threshold=st.sampled_from([0.5, 0.98]), chunk=st.sampled_from([3, 5, 64]))
def test_the_kept_graph_of_pruning_while_building_is_the_per_entry_reference_bit_for_bit(
        tiny, seed, seq, keep_mass, budget, node_threshold, edge_threshold, chunk):
    """:func:`.rows._sparse_pruned` (the kept graph's adjacency and residuals from the stored rows) gives the former
    per-entry code's blocks and residuals bit for bit — on the rows as built, and again in pieces of ``chunk`` entries
    (rows across several chunks) — and makes no per-entry row index nor any :meth:`SparseRows.chunks` pass (the former
    code read the kept rows through ``chunks`` once for the residuals and once per group of rows)."""
    from nnsight_lorsa.attribution import PruneConfig

    seen: dict = {}
    original = ROWS._sparse_pruned

    def spied(*a):
        seen["args"] = a
        with Reads() as reads:
            seen["out"] = original(*a)
        seen["reads"] = reads.entries
        return seen["out"]

    ROWS._sparse_pruned = spied
    try:
        g = attribute(tiny, random_ids(1, seq, seed=seed)[0], batch_size=3, max_feature_nodes=budget,
                      prune=PruneConfig(node_threshold, edge_threshold, keep_mass=keep_mass))
    finally:
        ROWS._sparse_pruned = original
    if "args" not in seen:  # every row, every entry: the full graph's blocks (_block_pruned), not this path
        assert keep_mass >= 1.0 and budget is None
        event("the full graph's blocks")
        return
    event("sparse rows")
    rows = seen["args"][0]
    assert seen["reads"] == 0
    want_adj, want_res = reference_sparse_pruned(*seen["args"])
    got_adj, got_res = seen["out"]
    assert same(got_adj.dense(), want_adj.dense()) and same(got_res, want_res)
    assert same(g.densify(), want_adj.dense()) and same(g.residual, want_res.to(g.residual.dtype))
    old = ROWS.CHUNK_ENTRIES
    ROWS.CHUNK_ENTRIES = chunk  # the same stored rows read in pieces of ``chunk`` entries
    try:
        with Reads() as reads:
            adj, res = original(*seen["args"])
        assert reads.entries == 0
        want_adj, want_res = reference_sparse_pruned(*seen["args"])
    finally:
        ROWS.CHUNK_ENTRIES = old
    assert rows.nnz > chunk or rows.nnz == 0
    assert same(adj.dense(), want_adj.dense()) and same(res, want_res) and same(res, got_res)
