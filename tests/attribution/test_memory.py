"""Attribution memory: the memory model's arithmetic (monotone, consistent with its terms and with the
graph's structure), the batch ``max_memory`` picks, and ``zero_positions`` (circuit-tracer's BOS
convention) keeping the sums exact. Measured peaks are in ``benchmarks/attribution_vs_circuit_tracer.py``."""

from __future__ import annotations

import pytest
import torch
from helpers import attribution_setup, random_ids, rm
from hypothesis import given, settings
from hypothesis import strategies as st

from nnsight_lorsa.attribution import MemoryEstimate, PruneConfig, attribute, estimate_memory
from nnsight_lorsa.attribution.budget import (
    HOST_HEAP_RETAINED_BATCHES,
    PRUNE_BLOCK_BYTES_PER_ENTRY,
    PRUNE_BYTES_PER_EDGE,
    THRESHOLD_BYTES_PER_CHUNK_ENTRY,
    structural_entries,
)
from nnsight_lorsa.attribution.graph import LORSA, MLP_ERROR, TRANSCODER
from nnsight_lorsa.attribution.scores import CHUNK as SCORES_CHUNK
from nnsight_lorsa.attribution.trace import prepare
from nnsight_lorsa.errors import (
    ConfigMismatchError,
    DenseAdjacencyError,
    MemoryBudgetError,
    UnsupportedArchitectureError,
)


@pytest.fixture(scope="module")
def setup():
    model, _, lorsas, tcs = attribution_setup("llama")
    r, ids = rm(model, lorsas, tcs), random_ids(1, 10, seed=3)[0]
    return r, ids, attribute(r, ids, batch_size=32)


def test_structural_entry_count_matches_the_graph(setup):
    """The rows' non-zero count predicted from the structure is the full graph's, to 1 %."""
    r, ids, g = setup
    predicted = structural_entries(prepare(r, ids).layout)
    nnz = int((g.densify() != 0).sum())
    assert abs(predicted - nnz) <= 0.01 * nnz, (predicted, nnz)


def test_estimate_is_monotone_and_consistent(setup):
    r, ids, _ = setup
    small, large = (estimate_memory(r, ids, batch_size=b) for b in (4, 64))
    assert isinstance(small, MemoryEstimate)
    t = large.terms
    # linear in the batch: the frozen pass's copies and, on the CPU, one batch of them the C heap keeps (glibc)
    assert t["heap_retained"] == HOST_HEAP_RETAINED_BATCHES * 64 * t["frozen_per_copy"] > 0
    assert large.host_bytes - small.host_bytes == 60 * (1 + HOST_HEAP_RETAINED_BATCHES) * t["frozen_per_copy"]
    assert large.device_bytes == 64 * t["frozen_per_copy"] + t["frozen_shared"] + t["heap_retained"]
    assert large.host_bytes == t["rows"] + max(large.device_bytes, t["pruning"]) + t["fixed"]  # CPU: one memory
    n_logits = t["n_rows"] - prepare(r, ids).layout.n_features
    # the full graph: its causal blocks, 4 B per possible edge — what the graph holds — well under N² fp32
    assert t["rows"] == 4 * t["stored_entries"]
    assert t["rows"] < 0.5 * (t["n_sources"] + n_logits) ** 2 * 4
    pruned = estimate_memory(r, ids, batch_size=64, prune=PruneConfig())
    assert pruned.terms["rows"] == t["rows"]  # keep_mass=1: the same blocks
    # pruning them: prune(graph)'s passes on the blocks, per stored entry (measured), and the larger of the edge
    # scores (8 B per stored entry, and the threshold's running sums over one chunk) and the kept graph (its blocks:
    # at most the full graph's); unpruned nothing
    p = pruned.terms
    scores = PRUNE_BYTES_PER_EDGE * t["stored_entries"] + THRESHOLD_BYTES_PER_CHUNK_ENTRY * min(SCORES_CHUNK,
                                                                                            t["stored_entries"])
    assert p["edge_scores"] == scores and p["kept_graph"] > t["rows"]
    assert p["pruning"] == int(PRUNE_BLOCK_BYTES_PER_ENTRY * t["stored_entries"]) + max(p["edge_scores"],
                                                                                         p["kept_graph"])
    assert t["pruning"] == t["kept_graph"] == t["edge_scores"] == 0
    sparse = estimate_memory(r, ids, batch_size=64, prune=PruneConfig(keep_mass=0.9))
    # 8 B per stored entry, 16 B per row (its float64 residual and mass)
    assert sparse.terms["rows"] == 8 * sparse.terms["stored_entries"] + 16 * sparse.terms["n_rows"]
    longer = estimate_memory(r, torch.cat([ids, ids]), batch_size=64)
    assert longer.host_bytes > large.host_bytes and longer.terms["frozen_per_copy"] > t["frozen_per_copy"]
    budget = estimate_memory(r, ids, batch_size=64, max_feature_nodes=5, prune=PruneConfig())
    assert budget.terms["stored_entries"] < pruned.terms["stored_entries"]


def test_block_adjacency_holds_every_edge_and_refuses_a_later_source(setup):
    """The full graph keeps its causal blocks until ``adjacency`` is read: every non-zero edge is inside
    them (the dense matrix built from them has the same sums and edge count), and a row with an edge
    from a later position is refused, not dropped."""
    r, ids, _ = setup
    g = attribute(r, ids, batch_size=32)
    blocks = g.block_adjacency
    assert blocks is not None and blocks.entries() < 0.5 * g.n_nodes ** 2
    assert blocks.nbytes == estimate_memory(r, ids).terms["rows"]  # the memory model's rows term, exactly
    n_edges, err = g.n_edges, g.edge_sum_error("mass")
    with pytest.raises(DenseAdjacencyError, match=r"graph.densify\(\)"):  # never densified on a read
        _ = g.adjacency
    assert g.block_adjacency is blocks
    dense = g.densify()  # built once; the graph keeps it instead of the blocks
    assert g.block_adjacency is None and g.adjacency is dense
    assert n_edges == int((dense != 0).sum()) and torch.allclose(g.edge_sum_error("mass"), err, atol=1e-12)
    assert err.max() < 1e-6
    rows = g.feature_rows.nonzero().flatten()
    first = int(rows[(g.nodes.pos[rows] == 0)][0])  # a feature at position 0
    later = int(((g.nodes.kind == MLP_ERROR) & (g.nodes.pos == 1)).nonzero()[0])  # a source at position 1
    bad = dense[[first]].clone()
    bad[0, later] = 1.0
    fresh = type(blocks)(g.nodes.sites(), g.nodes.pos, blocks.n_sources, rows, torch.float32)
    with pytest.raises(UnsupportedArchitectureError, match="later than the target"):
        fresh.write(torch.tensor([first]), bad[:, :blocks.n_sources])


def test_max_memory_picks_the_batch_or_refuses(setup):
    r, ids, ref = setup
    est = estimate_memory(r, ids, batch_size=8)
    g = attribute(r, ids, batch_size=64, max_memory=est.host_bytes)
    assert g.meta["batch_size"] == 8
    assert torch.allclose(g.densify(), ref.densify(), atol=1e-6)  # the batch changes nothing but memory
    with pytest.raises(MemoryBudgetError, match="max_memory"):
        attribute(r, ids, max_memory=est.terms["rows"] // 2)


def test_zero_positions_drops_the_first_features_and_keeps_sums_exact(setup):
    r, ids, full = setup
    g = attribute(r, ids, batch_size=32, zero_positions=1)
    feats = (g.nodes.kind == TRANSCODER) | (g.nodes.kind == LORSA)
    assert int(feats.sum()) > 0 and not bool((g.nodes.pos[feats] == 0).any())
    assert bool((full.nodes.pos[full.feature_ids] == 0).any())
    assert g.edge_sum_error("mass").max() < 1e-6  # position 0's MLP/Lorsa output is in its error nodes
    # the other features' values and the logits are unchanged
    assert torch.allclose(g.values[g.logit_ids], full.values[full.logit_ids], atol=1e-5)
    err0 = ((g.nodes.kind == MLP_ERROR) & (g.nodes.pos == 0)).nonzero().flatten()
    assert g.densify()[:, err0].abs().sum() > 0
    with pytest.raises(ConfigMismatchError, match="zero_positions"):
        attribute(r, ids, zero_positions=len(ids))


def test_batched_qk_tracing_inside_attribute_sums_to_the_scores(setup, tmp_path):
    """``attribute(..., qk_heads=n)``: the top Lorsa heads' scores decomposed in one batched pass; each
    decomposition sums to its attention score (relative to the pairs' mass), equals the one-head
    ``qk_attribution``, and is saved, loaded and exported with the graph."""
    from nnsight_lorsa.attribution import Graph, qk_attribution, to_neuronpedia
    from nnsight_lorsa.attribution import prune as prune_graph

    r, ids, _ = setup
    g = attribute(r, ids, batch_size=32, qk_heads=3)
    qk = g.qk
    assert qk["probe"].shape == (3, 5) and qk["pair_index"].shape == (3, 10, 2)
    assert float(qk["pair_sum_error"].max()) < 1e-5
    # the marginals sum to the score too
    assert torch.allclose(qk["query_marginal"].sum(1).double(), qk["score"], rtol=1e-4, atol=1e-5)
    node, layer, group, q, k = qk["probe"][0].tolist()
    head = int(g.nodes.index[node])
    one = qk_attribution(r, ids, layer=layer, head=head, query_pos=q, key_pos=k)
    assert abs(one.score - float(qk["score"][0])) < 1e-5 * max(1.0, abs(one.score))
    assert abs(float(one.pairs.abs().max()) - float(qk["pair_value"][0].abs().max())) < 1e-5
    back = Graph.load(g.save(tmp_path / "g"))
    assert all(torch.equal(back.qk[k_], v) for k_, v in qk.items())
    data = to_neuronpedia(g, prune_graph(g), slug="qk")
    assert len(data["qk_tracing"]) == 3 and data["qk_tracing"][0]["pairs"]


def test_sparse_rows_across_blocks_and_chunks(monkeypatch):
    """Rows stored across several blocks and read in chunks that split rows: the same matrix, row sums
    and influence as the dense rows (``scores.influence``)."""
    from nnsight_lorsa.attribution import rows as rows_module
    from nnsight_lorsa.attribution.scores import influence

    monkeypatch.setattr(rows_module, "BLOCK_ENTRIES", 16)
    monkeypatch.setattr(rows_module, "CHUNK_ENTRIES", 7)
    g = torch.Generator().manual_seed(0)
    n_rows, n_cols = 9, 12
    dense = torch.randn(n_rows, n_cols, generator=g) * (torch.rand(n_rows, n_cols, generator=g) > 0.4)
    dense[3] = 0  # an empty row
    sp = rows_module.SparseRows(n_cols)
    for a, b in ((0, 2), (2, 5), (5, 9)):
        sp.append(dense[a:b])
    assert len(sp.blocks) > 1 and sp.nnz == int((dense != 0).sum())
    assert torch.equal(sp.dense(), dense)
    assert torch.allclose(sp.row_sums(), dense.double().sum(1))
    pruned = rows_module.SparseRows(n_cols)  # kept mass < 1: the dropped entries' sum is each row's residual
    pruned.append(dense, keep_mass=0.5)  # (mutation probe 2026-11-28: row_sums without it passed)
    assert pruned.nnz < sp.nnz and torch.allclose(pruned.row_sums(), dense.double().sum(1))
    # an acyclic graph: row r is node r + 3 (columns 0..2 are sources only); the last rows carry weight
    row_node = torch.arange(n_rows) + 3
    dag = dense * (torch.arange(n_cols)[None] < row_node[:, None])
    sp = rows_module.SparseRows(n_cols)
    sp.append(dag)
    weight = torch.zeros(n_rows, dtype=torch.float64)
    weight[-2:] = torch.tensor([0.7, 0.3], dtype=torch.float64)
    assert torch.allclose(sp.influence(row_node, weight), influence(dag.double(), row_node, weight))
    mask = torch.ones(n_cols, dtype=torch.bool)
    mask[4] = False
    restricted = dag.double() * (mask[None] & mask[row_node][:, None])
    assert torch.allclose(sp.influence(row_node, weight, node_mask=mask), influence(restricted, row_node, weight))


def test_no_reference_cycle_holds_the_frozen_pass_graph(setup, monkeypatch):
    """After ``attribute``, nothing that only a full garbage collection would free holds an autograd graph (nnsight's
    backward tracers keep the objective in a reference cycle: it is detached after its backward), so the
    engine's young-generation collection is enough to free the frozen pass before the assembly. Here the
    engine's collection is a no-op and the cycles are inspected instead."""
    import gc

    from nnsight_lorsa.attribution import engine

    class NoCollection:
        @staticmethod
        def collect(generation: int = 2) -> int:
            return 0

    r, ids, _ = setup
    monkeypatch.setattr(engine, "gc", NoCollection)
    gc.collect()
    flags = gc.get_debug()
    gc.disable()
    try:
        attribute(r, ids, batch_size=4, max_feature_nodes=6)
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        held = [o for o in gc.garbage if isinstance(o, torch.Tensor) and o.grad_fn is not None]
        n_garbage = len(gc.garbage)
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
        gc.enable()
    assert n_garbage > 0  # the tracers' cycles are there (the check looks at something)
    assert not held, f"{len(held)} tensors with an autograd graph held by reference cycles"


def blocked_rows(monkeypatch, chunk: int, seed: int):
    """``(SparseRows, dense (14, 25), generator)``: random rows with an empty one (5), appended in four batches into
    blocks of 40 entries read in chunks of ``chunk`` — rows longer than a chunk, several blocks."""
    from nnsight_lorsa.attribution import rows as rows_module

    monkeypatch.setattr(rows_module, "BLOCK_ENTRIES", 40)
    monkeypatch.setattr(rows_module, "CHUNK_ENTRIES", chunk)
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(14, 25, generator=g) * (torch.rand(14, 25, generator=g) > 0.3)
    dense[5] = 0
    sp = rows_module.SparseRows(25)
    for a, b in ((0, 3), (3, 4), (4, 9), (9, 14)):
        sp.append(dense[a:b])
    assert len(sp.blocks) > 1 and int((dense != 0).sum(1).max()) > 7
    return sp, dense, g


@pytest.mark.parametrize("chunk", [7, 64])
def test_weighted_abs_is_the_per_entry_sum_in_storage_order(monkeypatch, chunk):
    """``SparseRows.weighted_abs`` (one influence step, in place over the rows of non-zero weight only) equals,
    bit for bit, ``Σ scale[row]·|val|`` accumulated over every stored entry in storage order — the sum the
    influence steps took before: rows longer than a chunk (7), runs of several short rows in one chunk (64:
    one repeated weight vector), rows in several blocks, an empty row, rows of weight 0, with and without a
    column mask."""
    sp, dense, g = blocked_rows(monkeypatch, chunk, seed=1)
    n_rows, n_cols = dense.shape
    scale = torch.rand(n_rows, generator=g, dtype=torch.float64)
    scale[[1, 7, 12]] = 0  # rows 9-11 (one block) and 2-4 (two) are runs of three weighted rows
    mask = torch.rand(n_cols, generator=g) > 0.3
    for col_mask in (None, mask):
        ref = torch.zeros(n_cols, dtype=torch.float64)
        for row, col, val in sp.chunks():
            contrib = scale[row] * val.double().abs()
            ref.index_add_(0, col, contrib if col_mask is None else contrib * col_mask[col])
        assert torch.equal(sp.weighted_abs(scale, col_mask), ref)


def test_pruned_graph_with_small_chunks_equals_dense_pruning(setup, monkeypatch):
    from nnsight_lorsa.attribution import prune
    from nnsight_lorsa.attribution import rows as rows_module

    monkeypatch.setattr(rows_module, "CHUNK_ENTRIES", 4999)
    r, ids, full = setup
    pr = prune(full)
    g = attribute(r, ids, batch_size=32, prune=(0.8, 0.98))
    assert torch.equal(g.layout_ids, full.layout_ids[pr.node_mask])
    keep = pr.node_mask.nonzero().flatten()
    assert torch.allclose(g.densify(), full.densify()[keep][:, keep], atol=1e-6)
    assert g.edge_sum_error("mass").max() < 1e-6


@settings(max_examples=60, deadline=None)
@given(n_rows=st.integers(1, 6), n_cols=st.integers(1, 40), density=st.floats(0.0, 1.0),
       keep_mass=st.floats(0.05, 0.999), seed=st.integers(0, 2**16), half=st.booleans())
def test_sparse_rows_keep_mass_partitions_each_row(n_rows, n_cols, density, keep_mass, seed, half):
    """``SparseRows.append(grads, keep_mass)`` on generated rows: the stored entries and the dropped ones
    partition each row (stored ``dense()`` + dropped = the row, bit for bit); the stored ones are the shortest
    prefix of the row's ``|edges|`` in descending order whose mass reaches ``keep_mass`` of the row's (ties
    aside); the residual is the dropped entries' sum (``math.fsum`` of them, to float64 rounding); ``abs_total``
    is the row's ``Σ |edges|``; and the same rows appended twice give the same bits."""
    import math

    from nnsight_lorsa.attribution.rows import SparseRows

    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if half else torch.float32
    grads = (torch.randn(n_rows, n_cols, generator=g) * (torch.rand(n_rows, n_cols, generator=g) < density)
             ).to(dtype)
    sp, again = SparseRows(n_cols), SparseRows(n_cols)
    sp.append(grads, keep_mass)
    again.append(grads.clone(), keep_mass)
    stored = sp.dense()
    assert stored.dtype == dtype
    kept = stored != 0
    dropped = torch.where(kept, 0, grads)
    assert torch.equal(torch.where(kept, stored, dropped), grads)
    assert torch.equal(sp.residual, again.residual) and torch.equal(sp.dense(), again.dense())
    for r in range(n_rows):
        row = grads[r].double()
        mass = row.abs()
        total = math.fsum(mass.tolist())
        assert sp.abs_total[r].item() == pytest.approx(total, rel=1e-12, abs=1e-300)
        want = math.fsum(dropped[r].double().tolist())
        assert sp.residual[r].item() == pytest.approx(want, rel=1e-12, abs=1e-12 * total)
        kept_mass = math.fsum(mass[kept[r]].tolist())
        assert kept_mass >= keep_mass * total * (1 - 1e-12)  # the kept mass reaches the fraction ...
        if kept[r].any():  # ... and without its smallest kept entry it would not
            smallest = mass[kept[r]].min().item()
            assert kept_mass - smallest < keep_mass * total * (1 + 1e-12)
            assert bool((mass[~kept[r]] <= smallest).all())


@pytest.mark.parametrize("budget", [None, 6])
def test_pruning_on_sparse_rows_equals_prune_of_the_unpruned_graph(setup, monkeypatch, budget):
    """Pruning while building on sparse rows (``SparseRows``: a feature budget with ``prune=``; for the full graph the
    store forced sparse here, every non-zero entry kept) keeps, bit for bit, the nodes and edges ``prune`` keeps on
    the unpruned graph — an independent path: its causal blocks — with the rows stored across several blocks and
    read in chunks that split rows; the residuals keep every row's sum. It reads the stored rows in place: the
    scored edges come through ``SparseRows.edge_scores`` (one chunk at a time), no entry is copied out of them."""
    from nnsight_lorsa.attribution import prune
    from nnsight_lorsa.attribution import rows as rows_module

    r, ids, full = setup
    unpruned = full if budget is None else attribute(r, ids, batch_size=32, max_feature_nodes=budget)
    monkeypatch.setattr(rows_module, "BLOCK_ENTRIES", 1000)
    monkeypatch.setattr(rows_module, "CHUNK_ENTRIES", 97)
    if budget is None:
        init = rows_module.RowScheduler.__init__

        def sparse_store(self, layout, *a, **k):
            init(self, layout, *a, **k)
            self._make_blocks, self.rows = None, rows_module.SparseRows(layout.n_sources)

        monkeypatch.setattr(rows_module.RowScheduler, "__init__", sparse_store)
    scored = []
    edge_scores = rows_module.SparseRows.edge_scores

    def spied(self, *a, **k):
        for part in edge_scores(self, *a, **k):
            scored.append(part[0].numel())
            yield part

    monkeypatch.setattr(rows_module.SparseRows, "edge_scores", spied)
    g = attribute(r, ids, batch_size=32, max_feature_nodes=budget, prune=(0.8, 0.98))
    stored = g.meta["pruned"]["stored_entries"]
    assert stored > 10 * 97 and scored and max(scored) <= 97  # the store's chunks, scored where they lie
    pr = prune(unpruned)
    keep = pr.node_mask.nonzero().flatten()
    assert 0 < keep.numel() < unpruned.n_nodes
    assert torch.equal(g.layout_ids, unpruned.layout_ids[pr.node_mask])
    assert torch.equal(g.densify(), unpruned.densify()[keep][:, keep])
    assert g.residual.abs().sum() > 0 and g.edge_sum_error("mass").max() < 1e-6


@pytest.mark.parametrize("chunk", [7, 64])
def test_sparse_rows_read_by_row_mask_are_the_entries_of_those_rows(monkeypatch, chunk):
    """``SparseRows.chunks(row_mask)`` reads exactly the entries of the mask's rows, in storage order (rows longer than
    a chunk, several blocks, an empty row), and the pruning's reads on the store — ``abs_sums``, ``count_edges``,
    ``edge_scores`` — equal, bit for bit on the mask's rows, ``EntryRows`` over a copy of those entries (the former
    path)."""
    from nnsight_lorsa.attribution.scores import EntryRows

    sp, dense, g = blocked_rows(monkeypatch, chunk, seed=2)
    n_rows, n_cols = dense.shape
    row_mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1], dtype=torch.bool)  # gaps inside a chunk
    col_mask = torch.rand(n_cols, generator=g) > 0.3
    every = [torch.cat(t) for t in zip(*sp.chunks(), strict=True)]
    k = row_mask[every[0]]
    parts = list(sp.chunks(row_mask))
    assert max(p[0].numel() for p in parts) <= chunk
    masked = [torch.cat(t) for t in zip(*parts, strict=True)]
    assert all(torch.equal(m, e[k]) for m, e in zip(masked, every, strict=True))
    entries = EntryRows(*masked, n_rows, n_cols)
    den = sp.abs_sums(col_mask, row_mask)
    assert torch.equal(den[row_mask], entries.abs_sums(col_mask)[row_mask]) and not bool(den[~row_mask].any())
    assert sp.count_edges(col_mask, row_mask) == entries.count_edges(col_mask, row_mask) > 0
    factor = torch.rand(n_rows, generator=g, dtype=torch.float64)
    den = den.clamp_min(1e-30)
    got, want = ([torch.cat(t) for t in zip(*src.edge_scores(factor, den, col_mask, row_mask), strict=True)]
                 for src in (sp, entries))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("kind", ["transcoders", "clt"])
@pytest.mark.parametrize("seq", [6, 11])
def test_node_grids_term_is_the_bytes_of_the_grids_the_frozen_pass_keeps(kind, seq, monkeypatch):
    """``estimate_memory(...).terms["node_grids"]`` equals, byte for byte, the node-vector grids the frozen pass
    keeps (``frozen.GridNodes``, counted as they are made) with ``memory="fast"``: a Lorsa's ``w_o`` grid, a
    transcoder's encoder grid and one decoder grid per replaced MLP it writes into — a cross-layer transcoder's
    layer ``l`` writes into every layer ``≥ l``, each under its own key (counted once per layer until 2026-11-26:
    a 26-layer CLT keeps 351 decoder grids, not 26)."""
    from test_attribution_offload import clt_bundle

    import nnsight_lorsa.attribution.frozen as frozen
    import nnsight_lorsa.attribution.replacement as replacement

    model, _, lorsas, tcs = attribution_setup("llama")
    rep = rm(model, lorsas, tcs) if kind == "transcoders" else clt_bundle(model, lorsas)
    ids = random_ids(1, seq, seed=seq)[0]
    kept: dict[int, int] = {}
    original = frozen.GridNodes.__init__

    def counted(self, slots, grid):
        kept[id(self)] = grid.numel() * grid.element_size()
        original(self, slots, grid)

    monkeypatch.setattr(frozen.GridNodes, "__init__", counted)
    assert replacement.GridNodes is frozen.GridNodes
    attribute(rep, ids, batch_size=4, memory="fast")
    est = estimate_memory(rep, ids, batch_size=4, memory="fast")
    assert kept and est.terms["node_grids"] == sum(kept.values())


def test_auto_keeps_a_cross_layer_transcoders_decoder_grids_to_the_budget_together(monkeypatch):
    """``memory="auto"`` keeps a cross-layer transcoder layer's decoder grids (one per replaced MLP it writes into)
    only while all of them fit :data:`.frozen.GRID_BUDGET_BYTES` together, and gathers them otherwise — each was
    held to the budget alone, so a 26-layer CLT could keep 351 grids of up to 256 MiB. With the budget at one
    grid, layers 0 and 1 (three and two decoder grids) gather and layer 2 (one) keeps its grid, as every encoder
    grid; the graph equals the all-grid graph, and ``node_grids`` is what was kept."""
    from test_attribution_offload import clt_bundle

    import nnsight_lorsa.attribution.frozen as frozen

    model, _, _, _ = attribution_setup("llama")
    rep = clt_bundle(model, {})  # the CLT alone: every grid is a transcoder's
    ids = random_ids(1, 9, seed=3)[0]
    layout = prepare(rep, ids).layout
    assert [layout.decoder_targets(lay.layer) for lay in layout.layers] == [3, 2, 1]
    one = [9 * int(torch.bincount(lay.tc_pos).max()) * 64 * 4 for lay in layout.layers]  # (pos, width, d) fp32
    budget = max(one)
    assert 2 * min(one) > budget
    kept: dict[str, list[int]] = {"fast": [], "auto": []}
    original = frozen.GridNodes.__init__
    mode = ["fast"]

    def counted(self, slots, grid):
        kept[mode[0]].append(grid.numel() * grid.element_size())
        original(self, slots, grid)

    monkeypatch.setattr(frozen.GridNodes, "__init__", counted)
    monkeypatch.setattr(frozen, "GRID_BUDGET_BYTES", budget)
    fast = attribute(rep, ids, batch_size=4, memory="fast")
    mode[0] = "auto"
    auto = attribute(rep, ids, batch_size=4, memory="auto")
    assert len(kept["fast"]) == 3 + 6 and len(kept["auto"]) == 3 + 1  # encoders + decoders (all, or layer 2's)
    assert torch.equal(auto.layout_ids, fast.layout_ids)
    A, F = auto.densify(), fast.densify()
    assert float((A - F).abs().max()) <= 1e-5 * float(F.abs().max())
    for memory in ("fast", "auto"):
        assert estimate_memory(rep, ids, batch_size=4, memory=memory).terms["node_grids"] == sum(kept[memory])
