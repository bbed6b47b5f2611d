"""The influence series summed on the rows, then propagated once (:func:`.scores.influence_series`), and its steps
over the row nodes' columns only (on sparse rows, their entries gathered once per series:
:meth:`.rows.SparseRows.restricted`): the same influence as the step-by-step series (the former code: one pass over
every stored entry per step) to float64 rounding, the restricted steps the same bits as the full pass, and a ranking
that reads each stored entry once in its pass over every column (issue 21, goal 4(d): the ranking of the 8B-shaped
all-layer graph, ~6 s of 35 s at 1024 tokens, read every stored entry at each of its steps)."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nnsight_lorsa.attribution.rows import SparseRows, _SparseSource
from nnsight_lorsa.attribution.scores import EntryRows, influence_series, row_influence

ROWS = sys.modules["nnsight_lorsa.attribution.rows"]


def former_series(step, row_node: torch.Tensor, row_weight: torch.Tensor, n_cols: int) -> torch.Tensor:
    """The step-by-step series the collapsed one replaced: ``Σ_k (w_k Â)``, every column at every step."""
    is_col = row_node < n_cols
    cur = step(row_weight)
    total = cur.clone()
    for _ in range(1000):
        w = torch.zeros_like(row_weight)
        w[is_col] = cur[row_node[is_col]]
        if not bool(w.any()):
            return total
        cur = step(w)
        total += cur
    raise AssertionError("a cycle")


def layered_rows(seed: int, n_layers: int, per_layer: int, rows_per_layer: int, n_logits: int, density: float,
                 dtype: torch.dtype):
    """A graph's stored rows as a budgeted attribution makes them: sources in layers (a row of layer ``l`` reads the
    sources of layers ``< l``), feature rows at some of the sources, logit rows reading every source; in a shuffled
    computation order. ``(rows, row_node, row_weight, n_cols, dense)``."""
    g = torch.Generator().manual_seed(seed)
    n_cols = n_layers * per_layer
    layer_of = torch.arange(n_cols) // per_layer
    picks = [torch.randperm(per_layer, generator=g)[:rows_per_layer] + layer * per_layer
             for layer in range(1, n_layers)]
    feature_nodes = torch.cat(picks) if picks else torch.zeros(0, dtype=torch.long)
    nodes = torch.cat([feature_nodes, n_cols + torch.arange(n_logits)])
    nodes = nodes[torch.randperm(nodes.numel(), generator=g)]
    dense = torch.zeros(nodes.numel(), n_cols, dtype=torch.float64)
    for r, node in enumerate(nodes.tolist()):
        upto = n_cols if node >= n_cols else int(layer_of[node]) * per_layer
        vals = torch.randn(upto, generator=g, dtype=torch.float64)
        vals[torch.rand(upto, generator=g) > density] = 0
        dense[r, :upto] = vals
    dense = dense.to(dtype)
    rows = SparseRows(n_cols)
    for b in range(0, nodes.numel(), 3):
        rows.append(dense[b:b + 3])
    weight = torch.where(nodes >= n_cols, torch.rand(nodes.numel(), generator=g, dtype=torch.float64), 0.0)
    return rows, nodes, weight, n_cols, dense.double()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), n_layers=st.integers(1, 6), per_layer=st.integers(1, 40),
       rows_per_layer=st.integers(0, 6), n_logits=st.integers(1, 3), density=st.floats(0.0, 1.0),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), masked=st.booleans())
def test_the_collapsed_series_is_the_step_by_step_series_to_float64_rounding(
        seed, n_layers, per_layer, rows_per_layer, n_logits, density, dtype, masked):
    """On sparse rows, with and without a node mask: the former series within ``1e-12`` of the largest influence;
    sparse rows and the same rows' entries, given the same row masses, the same bits."""
    rows_per_layer = min(rows_per_layer, per_layer)
    rows, nodes, weight, n_cols, dense = layered_rows(seed, n_layers, per_layer, rows_per_layer, n_logits, density,
                                                      dtype)
    g = torch.Generator().manual_seed(seed + 1)
    mask = torch.rand(n_cols + n_logits, generator=g) < 0.7 if masked else None
    if mask is not None:
        mask[n_cols:] = True
    col_mask = None if mask is None else mask[:n_cols]
    row_ok = torch.ones(nodes.numel(), dtype=torch.bool) if mask is None else mask[nodes]
    a = dense.abs() * (1.0 if col_mask is None else col_mask.double())
    den = a.sum(1).clamp_min(1e-30)

    def step(w):
        return ((w * row_ok) / den) @ a

    want = former_series(step, nodes, weight, n_cols)
    got = rows.influence(nodes, weight, mask)
    r, c = dense.nonzero(as_tuple=True)
    # the same row masses for both (sparse rows keep each full row's as a pairwise sum at append)
    sums = rows.abs_sums(torch.ones(n_cols, dtype=torch.bool) if col_mask is None else col_mask)
    on_sparse = row_influence(_SparseSource(rows), nodes, weight, n_cols, mask, den=sums)
    on_entries = row_influence(EntryRows(r, c, dense[r, c], nodes.numel(), n_cols), nodes, weight, n_cols, mask,
                               den=sums)
    scale = float(want.abs().max()) if want.numel() else 0.0
    assert float((got - want).abs().max()) <= 1e-12 * max(scale, 1e-300) if want.numel() else True
    assert torch.equal(on_sparse, on_entries)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), n_rows=st.integers(1, 12), n_cols=st.integers(1, 300),
       zero_frac=st.floats(0.0, 1.0), dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       n_kept=st.integers(0, 12), with_den=st.booleans(), chunk=st.sampled_from([3, 7, 2**18]))
def test_a_step_on_the_restricted_entries_is_the_full_pass_bit_for_bit(
        seed, n_rows, n_cols, zero_frac, dtype, n_kept, with_den, chunk):
    """A step over few columns on :meth:`SparseRows.restricted`'s entries (gathered once per series; rows
    binary-searched or read in one pass through a column table, in pieces of ``chunk`` entries) against the pass over
    every entry (:meth:`SparseRows.weighted_abs`, zero-weight rows left out): the same bits at those columns."""
    g = torch.Generator().manual_seed(seed)
    grads = torch.randn(n_rows, n_cols, generator=g, dtype=torch.float64)
    grads[torch.rand(grads.shape, generator=g) < zero_frac] = 0
    rows = SparseRows(n_cols)
    for b in range(0, n_rows, 4):
        rows.append(grads[b:b + 4].to(dtype))
    scale = torch.rand(n_rows, generator=g, dtype=torch.float64)
    scale[torch.rand(n_rows, generator=g) < 0.3] = 0
    den = torch.rand(n_rows, generator=g, dtype=torch.float64) + 0.5 if with_den else None
    col_mask = torch.zeros(n_cols, dtype=torch.bool)
    col_mask[torch.randperm(n_cols, generator=g)[:n_kept]] = True
    cols = col_mask.nonzero().flatten()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ROWS, "CHUNK_ENTRIES", chunk)
        want = rows.weighted_abs(scale, col_mask, den)[cols]
        for reads in (10**18, 0):  # every block read in one pass; every row searched
            mp.setattr(ROWS, "SEARCH_READS", reads)
            sub = rows.restricted(cols)
            assert sub.n_cols == cols.numel() and sub.n_rows == n_rows
            got = sub.weighted_abs(scale, torch.ones(n_rows, dtype=torch.float64) if den is None else den)
            assert torch.equal(got, want), reads


@pytest.mark.parametrize("n_layers", [3, 8])
def test_a_ranking_reads_each_stored_entry_once_outside_its_searches(n_layers, monkeypatch):
    """The influence of long stored rows (an all-layer graph's ranking): the entries its passes read (``_add_runs``)
    are the stored rows' once — the steps run on the row nodes' columns' entries, gathered once
    (:meth:`SparseRows.restricted`); the former series read the weighted rows' every entry at each of its
    ``n_layers``-deep steps."""
    rows, nodes, weight, n_cols, _ = layered_rows(0, n_layers, 3000, 3, 2, 1.0, torch.float32)
    read = {"entries": 0}
    original = SparseRows._add_runs

    def counted(out, block, runs, buffer):
        read["entries"] += runs[-1][1] - runs[0][0]
        return original(out, block, runs, buffer)

    monkeypatch.setattr(SparseRows, "_add_runs", staticmethod(counted))
    infl = row_influence(_SparseSource(rows), nodes, weight, n_cols)
    assert bool(infl.any())
    assert read["entries"] <= rows.nnz, (read["entries"], rows.nnz)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), n_layers=st.integers(1, 6), per_layer=st.integers(1, 40),
       rows_per_layer=st.integers(0, 6), n_logits=st.integers(1, 3), density=st.floats(0.0, 1.0),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), masked=st.booleans(),
       search=st.booleans())
def test_the_ranking_on_restricted_steps_is_the_ranking_on_full_passes_bit_for_bit(
        seed, n_layers, per_layer, rows_per_layer, n_logits, density, dtype, masked, search):
    """:func:`row_influence` on sparse rows (its steps on the entries :meth:`SparseRows.restricted` gathers once)
    against the same series whose every step is a masked pass over the stored rows (the code before 2026-11-27's
    second session): the same bits — the feature budget's ranking picks the same rows."""
    rows_per_layer = min(rows_per_layer, per_layer)
    rows, nodes, weight, n_cols, _ = layered_rows(seed, n_layers, per_layer, rows_per_layer, n_logits, density, dtype)
    g = torch.Generator().manual_seed(seed + 2)
    mask = torch.rand(n_cols + n_logits, generator=g) < 0.7 if masked else None
    if mask is not None:
        mask[n_cols:] = True
    col_mask = None if mask is None else mask[:n_cols]
    row_ok = None if mask is None else mask[nodes]
    den = rows.abs_sums(col_mask, row_ok).clamp_min(1e-30)
    fed = torch.zeros(n_cols, dtype=torch.bool)
    fed[nodes[nodes < n_cols]] = True
    if col_mask is not None:
        fed &= col_mask

    def step(w, m):
        w = w.double() if row_ok is None else w.double() * row_ok
        return rows.weighted_abs(w, m, den)

    want = influence_series(lambda w: step(w, col_mask), nodes, weight, n_cols, feed=lambda w: step(w, fed))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ROWS, "SEARCH_READS", 0 if search else 10**18)
        got = row_influence(_SparseSource(rows), nodes, weight, n_cols, mask)
    assert torch.equal(got, want)
