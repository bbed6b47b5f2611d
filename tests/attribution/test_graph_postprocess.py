"""Post-processing of a graph that keeps its causal blocks (issue 21: a long prompt's graph has ~10⁵–10⁷ nodes,
its dense ``n_nodes²`` matrix tens of GB to hundreds of TB): ``prune``, ``graph_scores``, node influence, the
Neuronpedia export, the plot, ``intervention_edges``' reading and ``save``/``load`` work on the stored entries
(:meth:`Graph.coo`, :meth:`Graph.edge_values`) and never build the dense matrix.

Two references: the same graph densified (bit for bit: the sparse passes see the same entries in the same
order), and the dense path as it was before (fp32 ``n²`` influence with ``normalize_rows``; the sparse path
runs in float64, so influence and scores agree to fp32 rounding — relative ``1e-5`` — and the masks exactly)."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import pytest
import torch
from helpers import attribution_setup, random_ids, rm

from benchmarks.graph_postprocess_scale import synthetic_graph
from nnsight_lorsa.attribution import Graph, attribute, graph_scores, prune, to_neuronpedia
from nnsight_lorsa.attribution.graph import (
    ATTN_ERROR,
    BIAS,
    EMBEDDING,
    LOGIT,
    LORSA,
    MLP_ERROR,
    TRANSCODER,
    BlockAdjacency,
)
from nnsight_lorsa.attribution.scores import (
    EntryRows,
    PruneResult,
    influence,
    influence_series,
    logit_weights,
    node_influence,
    normalize_rows,
    row_influence,
)

SMALL = dict(n_layers=4, d_model=64, n_heads=4, lorsa_layer=2, n_qk=8, d_qk=8, n_ov=32, lorsa_k=6, tc_k=5, n_logits=10)


@pytest.fixture(scope="module")
def graphs():
    """``{name: graph keeping its blocks}``: the full graph and a budgeted one of the tiny Llama (bias nodes,
    a Lorsa, transcoders, error nodes)."""
    model, _, lorsas, tcs = attribution_setup("llama")
    bundle, ids = rm(model, lorsas, tcs), random_ids(1, 10, seed=3)[0]
    return {"full": attribute(bundle, ids, batch_size=32), "budget": attribute(bundle, ids, batch_size=8,
                                                                               max_feature_nodes=12)}


def densified(g: Graph) -> Graph:
    """The same graph holding its dense matrix (built from a copy of the blocks: ``g`` keeps its blocks)."""
    blocks = g.block_adjacency
    assert blocks is not None
    return dataclasses.replace(g, adjacency=blocks.dense(), residual=g.residual.clone(), meta=dict(g.meta))


def dense_prune_before(g: Graph, node_threshold: float = 0.8, edge_threshold: float = 0.98):
    """``(node_mask, edge_mask, influence, (replacement, completeness))`` as ``scores.prune`` / ``graph_scores``
    computed them before the sparse path: fp32 on the dense ``(n, n)`` matrix."""
    from nnsight_lorsa.attribution.scores import find_threshold

    A, kind = g.densify(), g.nodes.kind
    ids, lw = torch.arange(g.n_nodes), logit_weights(g)
    infl = influence(A, ids, lw)
    always = (kind == EMBEDDING) | (kind == BIAS) | (kind == LOGIT) | g.nodes.intervened
    feature = (kind == TRANSCODER) | (kind == LORSA)
    error = (kind == MLP_ERROR) | (kind == ATTN_ERROR)
    nodes = (infl >= find_threshold(infl, node_threshold)) | always
    P = A * (nodes[:, None] & nodes[None, :])
    score = normalize_rows(P) * (influence(P, ids, lw) + lw)[:, None]
    edges = (score >= find_threshold(score, edge_threshold)) & (P != 0)
    for _ in range(g.n_nodes):
        before = nodes.clone()
        nodes = (nodes & (~(feature | error) | edges.any(0)) & (~feature | edges.any(1))) | always
        edges &= nodes[:, None] & nodes[None, :]
        if torch.equal(before, nodes):
            break
    from_in, from_err = float(infl[(kind == EMBEDDING) | (kind == BIAS)].sum()), float(infl[error].sum())
    # circuit-tracer's compute_graph_scores: every node, source-only ones (no row) complete; a feature node whose
    # row a budget left uncomputed (none in circuit-tracer's graphs) out
    out, rows = infl + lw, g.feature_rows | ~feature
    non_error = 1.0 - normalize_rows(A)[:, error].sum(-1)
    complete = float((non_error[rows] * out[rows]).sum() / out[rows].sum())
    return nodes, edges, infl, (from_in / (from_in + from_err), complete)


def stamp_free(d: dict) -> str:
    return re.sub(r'"create_time_ms": ?\d+', "", json.dumps(d))


@pytest.mark.parametrize("name", ["full", "budget"])
def test_block_graph_post_processing_equals_its_densified_twin_bit_for_bit(graphs, name):
    g = graphs[name]
    blocks = g.block_adjacency
    d = densified(g)
    for x, y in zip(g.coo(), d.coo(), strict=True):  # the same entries, in the same (row-major) order
        assert torch.equal(x, y)
    assert torch.equal(torch.stack(g.coo()[:2]), d.densify().nonzero().T) and g.coo()[0].numel() == g.n_edges
    assert torch.equal(node_influence(g), node_influence(d))
    assert graph_scores(g) == graph_scores(d)
    p, q = prune(g), prune(d)
    assert torch.equal(p.node_mask, q.node_mask) and torch.equal(p.edge_index, q.edge_index)
    assert torch.equal(p.node_influence, q.node_influence) and torch.equal(p.cumulative, q.cumulative)
    assert stamp_free(to_neuronpedia(g, p, slug="s")) == stamp_free(to_neuronpedia(d, q, slug="s"))
    # edge_values: any (target, source) pairs, structural zeros and never-written rows included, broadcast
    gen = torch.Generator().manual_seed(0)
    t, s = torch.randint(0, g.n_nodes, (2, 4000), generator=gen)
    assert torch.equal(g.edge_values(t, s), d.densify()[t, s])
    rows, cols = g.feature_rows.nonzero().flatten(), torch.arange(0, g.n_nodes, 3)
    assert torch.equal(g.edge_values(rows[:, None], cols[None, :]), d.densify()[rows][:, cols])
    assert g.block_adjacency is blocks  # nothing above densified the graph


@pytest.mark.parametrize("name", ["full", "budget"])
def test_sparse_scores_match_the_dense_path_before(graphs, name):
    """Against the fp32 dense code this replaces: the same kept nodes and edges; influence and scores equal
    to fp32 rounding (relative 1e-5 of the largest)."""
    g = graphs[name]
    p = prune(g)
    nodes, edges, infl, scores = dense_prune_before(densified(g))
    assert torch.equal(p.node_mask, nodes) and torch.equal(p.edge_mask, edges)
    assert torch.equal(p.edge_index, edges.nonzero().T)
    assert p.node_influence.dtype == torch.float64
    assert float((p.node_influence - infl.double()).abs().max()) <= 1e-5 * float(infl.abs().max())
    assert float(p.node_mask.sum()) < g.n_nodes and p.edge_index.shape[1] > 0  # it pruned something, kept some
    for new, old in zip(graph_scores(g), scores, strict=True):
        assert abs(new - old) <= 1e-5 * abs(old) and 0.0 < new < 1.0
    # influence is the Neumann series Σ_k w Â^k: the linear solve w Â (I − Â)⁻¹ on the dense matrix (float64)
    A = normalize_rows(densified(g).densify().double())
    lw = logit_weights(g).double()
    solved = torch.linalg.solve((torch.eye(g.n_nodes, dtype=torch.float64) - A).T, lw @ A)
    assert torch.allclose(node_influence(g), solved, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["full", "budget"])
def test_influence_over_the_weighted_rows_only_changes_no_bit(graphs, name):
    """:func:`row_influence` on a graph's entries (:class:`EntryRows`) reads only the rows that carry weight at
    each step (row-sorted entries): the same bits as the plain pass over every entry."""
    g = graphs[name]
    t, s, v = g.coo()
    n, lw = g.n_nodes, logit_weights(g)
    a = v.double().abs()
    a = a / torch.zeros(n, dtype=torch.float64).index_add(0, t, a)[t].clamp_min(1e-30)
    every = influence_series(lambda w: torch.zeros(n, dtype=torch.float64).index_add(0, s, w.double()[t] * a),
                             torch.arange(n), lw.double(), n)
    got = row_influence(EntryRows(t, s, v, n, n), torch.arange(n), lw, n)
    assert torch.equal(got, every) and bool(every.any())


def test_save_load_keeps_the_blocks(graphs, tmp_path):
    """``save`` writes the blocks (their bytes, not ``n_nodes²``), ``load`` gives them back as blocks: the same
    entries, and the loaded graph prunes to the same bits."""
    from safetensors import safe_open

    g = graphs["full"]
    blocks = g.block_adjacency
    assert blocks is not None
    path = g.save(tmp_path / "g")
    with safe_open(str(path / "graph.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        stored = f.get_tensor("adjacency_blocks")
    assert "adjacency" not in keys and {"adjacency_rows", "adjacency_blocks", "adjacency_sources"} <= keys
    assert stored.numel() == blocks.entries() < g.n_nodes ** 2
    loaded = Graph.load(path)
    assert loaded.block_adjacency is not None and g.block_adjacency is blocks
    for x, y in zip(loaded.coo(), g.coo(), strict=True):
        assert torch.equal(x, y)
    p, q = prune(loaded), prune(g)
    assert torch.equal(p.node_mask, q.node_mask) and torch.equal(p.edge_index, q.edge_index)
    assert torch.equal(loaded.densify(), blocks.dense())
    assert torch.equal(Graph.load(loaded.save(tmp_path / "dense")).adjacency, blocks.dense())  # dense: as before


@pytest.fixture
def never_dense(monkeypatch):
    """Every way to the dense ``n_nodes²`` matrix (or the ``n²`` edge mask) raises."""
    def refuse(*_a, **_k):
        raise AssertionError("the dense n_nodes² matrix was built")

    monkeypatch.setattr(BlockAdjacency, "dense", refuse)
    monkeypatch.setattr(Graph, "densify", refuse)
    monkeypatch.setattr(PruneResult, "edge_mask", property(refuse))


@pytest.mark.parametrize("tokens,shape", [(64, None), (384, SMALL)])
def test_long_prompt_graph_prunes_scores_exports_and_saves_without_the_dense_matrix(never_dense, tokens, shape,
                                                                                    tmp_path):
    """A budgeted graph at the Llama-3.1-8B shape (``synthetic_graph``: 32 layers, 64 visited features,
    every possible edge non-zero) — and a longer one of a small shape: everything a researcher runs next
    works with the dense paths closed, on ``O(stored entries)`` memory."""
    from nnsight_lorsa.viz import plot_graph

    g = synthetic_graph(tokens, 64, **({} if shape is None else {"s": shape}))
    blocks = g.block_adjacency
    assert blocks is not None
    n = g.n_nodes
    assert blocks.entries() < n * n // 4
    assert float(g.edge_sum_error("mass").max()) < 1e-5
    p = prune(g, 0.5, 0.9)
    k = p.edge_index.shape[1]
    assert 0 < k < blocks.entries() and p.node_mask[g.logit_ids].all() and 0 < int(p.node_mask.sum()) < n
    t, s = p.edge_index
    assert bool((t[1:] > t[:-1]).logical_or((t[1:] == t[:-1]) & (s[1:] > s[:-1])).all())  # target-major, sorted
    assert bool(p.node_mask[t].all() and p.node_mask[s].all())
    replacement, completeness = graph_scores(g)
    assert 0.0 <= replacement <= 1.0 and 0.0 <= completeness <= 1.0
    with warnings.catch_warnings():  # synthetic features all have index 0: ids may be shared with MLP errors
        warnings.simplefilter("ignore", UserWarning)
        export = to_neuronpedia(g, p, slug="long")
    assert len(export["links"]) == k
    weights = {(link["target"], link["source"]): link["weight"] for link in export["links"]}
    assert len(weights) <= k and all(w != 0.0 for w in weights.values())
    assert torch.equal(g.edge_values(t, s), torch.tensor([link["weight"] for link in export["links"]]))
    plot_graph(g, p, path=tmp_path / "g.png", max_edges=50)
    loaded = Graph.load(g.save(tmp_path / "g"))
    assert loaded.block_adjacency is not None
    assert torch.equal(loaded.edge_values(t, s), g.edge_values(t, s))
    assert g.block_adjacency is blocks


def test_prune_result_masks_that_do_not_fit_are_refused(graphs):
    g = graphs["budget"]
    p = prune(g)
    for bad in (dataclasses.replace(p, edge_index=p.edge_index + g.n_nodes),
                dataclasses.replace(p, edge_index=p.edge_index[:1]),
                dataclasses.replace(p, node_mask=p.node_mask[:-1])):
        with pytest.raises(ValueError, match="do not fit a graph"):
            to_neuronpedia(g, bad, slug="x")


@pytest.mark.parametrize("thresholds", [(0.8, 0.98), (1.0, 0.9), (0.5, 0.5), (0.0, 1.0)])
def test_prune_on_the_blocks_equals_prune_on_the_dense_entries(graphs, thresholds):
    """``prune`` reads a graph that keeps its blocks in place (:class:`BlockAdjacency` as the row source: no
    ``coo``, edge scores sorted in place) and a dense graph through its non-zero entries (:class:`EntryRows`):
    the same bits, at every node and edge threshold (every node kept, none but the logits, everything)."""
    for g in graphs.values():
        p, q = prune(g, *thresholds), prune(densified(g), *thresholds)
        assert torch.equal(p.node_mask, q.node_mask) and torch.equal(p.edge_index, q.edge_index)
        assert torch.equal(p.node_influence, q.node_influence) and torch.equal(p.cumulative, q.cumulative)


@pytest.mark.parametrize("chunk", [3, 2**18])
def test_in_place_threshold_equals_the_sorted_cumsum_rule(monkeypatch, chunk):
    """``find_threshold_`` (in-place sort, running sums a chunk at a time) gives the bits of the rule it
    replaces: ``sort(descending)``, ``cumsum / sum``, ``searchsorted`` — with ties, zeros, every fraction."""
    from nnsight_lorsa.attribution import scores as scores_module
    from nnsight_lorsa.attribution.scores import find_threshold, find_threshold_

    monkeypatch.setattr(scores_module, "CHUNK", chunk)
    gen = torch.Generator().manual_seed(5)
    x = torch.rand(1000, generator=gen, dtype=torch.float64) ** 3
    x[::7] = x[3]  # ties
    x[::11] = 0.0
    for fraction in (0.0, 0.3, 0.8, 0.98, 0.999999, 1.0):
        s = x.sort(descending=True).values
        cum = s.cumsum(0) / s.sum().clamp_min(1e-30)
        at = int(torch.searchsorted(cum, torch.tensor(fraction, dtype=cum.dtype)))
        want = s[min(at, s.numel() - 1)]
        assert torch.equal(find_threshold(x, fraction), want)
        y = x.clone()
        assert torch.equal(find_threshold_(y, fraction), want) and torch.equal(y, s)  # y: sorted in place


def test_row_influence_on_blocks_entries_and_the_plain_pass_is_one_bit_pattern(graphs):
    """The one influence (:func:`row_influence`) over the causal blocks, over the same graph's non-zero entries,
    and the plain pass over every entry (``index_add`` of ``w[row] · |v| / den[row]`` in row-major order) agree bit
    for bit — also on the node-pruned matrix (a node mask)."""
    from nnsight_lorsa.attribution.scores import EntryRows, find_threshold, row_influence

    for g in graphs.values():
        blocks = g.block_adjacency
        assert blocks is not None
        n, ns = g.n_nodes, blocks.n_sources
        t, s, v = g.coo()
        lw, ids = logit_weights(g), torch.arange(n)
        infl = node_influence(g)
        for mask in (None, (infl >= find_threshold(infl, 0.8)) | (g.nodes.kind == LOGIT)):
            keep = torch.ones(t.numel(), dtype=torch.bool) if mask is None else mask[t] & mask[s]
            tk, sk, a = t[keep], s[keep], v[keep].double().abs()
            den = torch.zeros(n, dtype=torch.float64).index_add(0, tk, a).clamp_min(1e-30)
            ok = torch.ones(n, dtype=torch.bool) if mask is None else mask

            def step(w, tk=tk, sk=sk, a=a, den=den, ok=ok, n=n):
                return torch.zeros(n, dtype=torch.float64).index_add(0, sk, a / den[tk] * (w.double() * ok)[tk])

            plain = influence_series(step, ids, lw.double(), n)
            on_blocks = row_influence(blocks, ids, lw, ns, mask)
            on_entries = row_influence(EntryRows(t, s, v, n, n), ids, lw, n, mask)
            assert torch.equal(on_blocks, on_entries[:ns]), mask is None
            assert torch.equal(on_entries, plain) and bool(plain.any()), mask is None


@pytest.mark.parametrize("budget", [None, 12])
def test_pruning_while_building_equals_prune_of_the_finished_graph_bit_for_bit(budget):
    """``attribute(..., prune=...)`` keeps the nodes ``prune`` keeps on the unpruned graph of the same call
    (same batches), with the same edge values bit for bit — the full graph (now the same influence function on
    the same blocks) and a feature budget (sparse rows)."""
    model, _, lorsas, tcs = attribution_setup("llama")
    bundle = rm(model, lorsas, tcs)
    for seed, seq in ((3, 10), (11, 16)):
        ids = random_ids(1, seq, seed=seed)[0]
        kw = dict(batch_size=8, max_feature_nodes=budget)
        full = attribute(bundle, ids, **kw)
        p = prune(full)
        g = attribute(bundle, ids, prune=(0.8, 0.98), **kw)
        keep = p.node_mask.nonzero().flatten()
        assert torch.equal(g.layout_ids, full.layout_ids[keep])
        assert torch.equal(g.densify(), full.densify()[keep][:, keep])
        assert float(g.edge_sum_error("mass").max()) < 1e-5


def test_block_passes_in_small_pieces_give_the_same_bits(graphs, monkeypatch):
    """The block passes bound their temporaries (:data:`blocks.CHUNK` entries: columns of a run of rows in pieces,
    rows of a cell in pieces, a buffer grown for a run longer than a piece; :data:`scores.CHUNK` for the running
    sums and entry scores): in pieces of 5 and 7 entries, the same bits as in one piece."""
    from nnsight_lorsa.attribution import blocks as blocks_module
    from nnsight_lorsa.attribution import scores as scores_module

    want = {name: (node_influence(g), graph_scores(g), prune(g)) for name, g in graphs.items()}
    monkeypatch.setattr(blocks_module, "CHUNK", 5)
    monkeypatch.setattr(scores_module, "CHUNK", 7)
    for name, g in graphs.items():
        infl, scores, p = want[name]
        q = prune(g)
        assert torch.equal(node_influence(g), infl) and graph_scores(g) == scores
        assert torch.equal(p.node_mask, q.node_mask) and torch.equal(p.edge_index, q.edge_index)


@pytest.mark.parametrize("thresholds", [(0.8, 0.98), (0.5, 0.9), (1.0, 1.0), (0.3, 0.5), (1.0, 0.3)])
def test_prune_rows_without_gathering_the_kept_edges_keeps_the_same_nodes(graphs, thresholds):
    """``prune_rows(..., keep_edges=False)`` — pruning while building, whose dangling-node loop re-reads the kept
    edges from the rows at each step instead of holding them (16-48 B each) — keeps the nodes of the loop on the
    gathered edges, on a graph's blocks and on its dense matrix's entries, and returns no edges."""
    from nnsight_lorsa.attribution.scores import find_threshold, graph_rows, prune_rows

    node_threshold, edge_threshold = thresholds
    for g in graphs.values():
        kind = g.nodes.kind
        always = (kind == EMBEDDING) | (kind == BIAS) | (kind == LOGIT) | g.nodes.intervened
        infl, ids, lw = node_influence(g), torch.arange(g.n_nodes), logit_weights(g)
        first = (infl >= find_threshold(infl, node_threshold)) | always
        for rows, n_cols in (graph_rows(g), graph_rows(densified(g))):
            kept, edges = prune_rows(rows, ids, lw, first, always, kind, edge_threshold, n_cols)
            again, none = prune_rows(rows, ids, lw, first, always, kind, edge_threshold, n_cols, keep_edges=False)
            assert torch.equal(kept, again) and none.shape == (2, 0) and edges.shape[1] > 0
            assert torch.equal(kept, prune(g, node_threshold, edge_threshold).node_mask)
