"""Attribution memory: the memory model's arithmetic (monotone, consistent with its terms and with the
graph's structure), the batch ``max_memory`` picks, and ``zero_positions`` (circuit-tracer's BOS
convention) keeping the sums exact. Measured peaks are in ``benchmarks/attribution_vs_circuit_tracer.py``."""

from __future__ import annotations

import pytest
import torch
from helpers import attribution_setup, random_ids, rm

from nnsight_lorsa.attribution import MemoryEstimate, PruneConfig, attribute, estimate_memory
from nnsight_lorsa.attribution.budget import structural_entries
from nnsight_lorsa.attribution.graph import LORSA, MLP_ERROR, TRANSCODER
from nnsight_lorsa.attribution.trace import prepare
from nnsight_lorsa.errors import ConfigMismatchError, MemoryBudgetError


@pytest.fixture(scope="module")
def setup():
    model, _, lorsas, tcs = attribution_setup("llama")
    r, ids = rm(model, lorsas, tcs), random_ids(1, 10, seed=3)[0]
    return r, ids, attribute(r, ids, batch_size=32)


def test_structural_entry_count_matches_the_graph(setup):
    """The rows' non-zero count predicted from the structure is the full graph's, to 1 %."""
    r, ids, g = setup
    predicted = structural_entries(prepare(r, ids).layout)
    nnz = int((g.adjacency != 0).sum())
    assert abs(predicted - nnz) <= 0.01 * nnz, (predicted, nnz)


def test_estimate_is_monotone_and_consistent(setup):
    r, ids, _ = setup
    small, large = (estimate_memory(r, ids, batch_size=b) for b in (4, 64))
    assert isinstance(small, MemoryEstimate)
    t = large.terms
    assert large.host_bytes - small.host_bytes == 60 * t["frozen_per_copy"]  # linear in the batch
    assert large.device_bytes == 64 * t["frozen_per_copy"] + t["frozen_shared"]
    assert large.host_bytes == t["rows"] + max(large.device_bytes, t["pruning"]) + t["fixed"]  # CPU: one memory
    n_logits = t["n_rows"] - prepare(r, ids).layout.n_features
    assert t["rows"] == (t["n_sources"] + n_logits) ** 2 * 4  # the dense graph: N² fp32
    pruned = estimate_memory(r, ids, batch_size=64, prune=PruneConfig())
    assert pruned.terms["rows"] == 8 * pruned.terms["stored_entries"] < t["rows"]  # 8 B per stored entry
    longer = estimate_memory(r, torch.cat([ids, ids]), batch_size=64)
    assert longer.host_bytes > large.host_bytes and longer.terms["frozen_per_copy"] > t["frozen_per_copy"]
    budget = estimate_memory(r, ids, batch_size=64, max_feature_nodes=5, prune=PruneConfig())
    assert budget.terms["stored_entries"] < pruned.terms["stored_entries"]


def test_max_memory_picks_the_batch_or_refuses(setup):
    r, ids, ref = setup
    est = estimate_memory(r, ids, batch_size=8)
    g = attribute(r, ids, batch_size=64, max_memory=est.host_bytes)
    assert g.meta["batch_size"] == 8
    assert torch.allclose(g.adjacency, ref.adjacency, atol=1e-6)  # the batch changes nothing but memory
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
    assert g.adjacency[:, err0].abs().sum() > 0
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
