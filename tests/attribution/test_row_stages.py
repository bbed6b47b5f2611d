"""The row stages of a budgeted attribution (issue 21, goal 4(d): the per-row cost above the floor) keep their bits:
the stored rows (:meth:`SparseRows.append`), their masked sums and influence steps (:meth:`SparseRows.abs_sums`,
:meth:`SparseRows.weighted_abs`), the ranking's sums (:meth:`RowScheduler.feature_influence`, each stored row summed
once) and the budgeted assembly (:func:`.rows.assemble`), against per-entry references — the code they replaced —
bit for bit, also with rows that span several chunks."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import attribution_setup, random_ids, rm
from hypothesis import given, settings
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


def reference_assembly(layout, scheduler) -> tuple[torch.Tensor, torch.Tensor]:
    """``(adjacency, residual)`` of the budgeted graph as the former per-entry masks built them (dense)."""
    targets = torch.tensor(scheduler.done)
    nf, ns, nl = layout.n_features, layout.n_sources, layout.n_logits
    visited = torch.zeros(nf, dtype=torch.bool)
    visited[targets[targets < nf]] = True
    keep_src = torch.cat([visited, torch.ones(ns - nf, dtype=torch.bool)])
    node_ids = torch.cat([keep_src.nonzero().flatten(), torch.arange(ns, ns + nl)])
    index = torch.full((ns + nl,), -1, dtype=torch.long)
    index[node_ids] = torch.arange(node_ids.numel())
    row_at = index[scheduler.position(scheduler.done)]
    sp = scheduler.sparse()
    adjacency = torch.zeros(node_ids.numel(), node_ids.numel(), dtype=sp.blocks[0].val.dtype)
    residual = torch.zeros(node_ids.numel(), dtype=torch.float64)
    for row, col, val in entries(sp):
        k = keep_src[col]
        adjacency[row_at[row[k]], index[col[k]]] = val[k]
        residual.index_add_(0, row_at[row[~k]], val[~k].double())
    return adjacency, residual.to(adjacency.dtype)


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
        want, want_residual = reference_assembly(seen["layout"], seen["scheduler"])
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
