"""Attribution tests added by the fourth mutation probe (docs/reliability.md, "Mutation probe, round 4"): each kills
a mutant of the attribution core (``scores.py``, ``rows.py``) that the existing tests let pass. References in plain
torch — circuit-tracer's documented ``find_threshold`` rule, the cumulative score's stated formula, a dense influence
series solved in float64 — or the pruning's stated invariants."""

from __future__ import annotations

import sys

import nnsight
import pytest
import torch
from helpers import attribution_setup, random_ids, rm
from hypothesis import given, settings
from hypothesis import strategies as st

from nnsight_lorsa.attribution import attribute, prune
from nnsight_lorsa.attribution.graph import ATTN_ERROR, BIAS, LORSA, MLP_ERROR, TRANSCODER
from nnsight_lorsa.attribution.scores import cumulative_scores, find_threshold
from nnsight_lorsa.errors import ConfigMismatchError

ENGINE = sys.modules["nnsight_lorsa.attribution.engine"]


@pytest.fixture(scope="module")
def tiny():
    model, _, lorsas, tcs = attribution_setup("llama")
    return rm(model, lorsas, tcs)


def circuit_tracers_threshold(scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """circuit-tracer's ``find_threshold`` (``circuit_tracer/graph.py``): the sorted scores' entry at
    ``searchsorted(cumsum / sum, fraction)`` (left: the first running share ``≥ fraction``), capped at the last."""
    s = scores.flatten().sort(descending=True).values
    share = s.cumsum(0) / s.sum()
    return s[min(int(torch.searchsorted(share, torch.tensor(fraction, dtype=s.dtype))), s.numel() - 1)]


@settings(max_examples=30, deadline=None)
@given(values=st.lists(st.integers(1, 8), min_size=1, max_size=12), k=st.integers(0, 96))
def test_a_running_share_exactly_on_the_fraction_stops_there(values, k):
    """Integer scores, and fractions that a running share meets exactly (a share of ``k / total``, exact in float64
    for these sums): the threshold is circuit-tracer's — the top scores whose share first reaches the fraction, not
    one entry further (mutant: ``searchsorted(..., right=True)``, the cumulative rule ``≤`` for ``<``)."""
    s = torch.tensor(values, dtype=torch.float64)
    total = int(s.sum())
    fraction = min(k, total) / total
    assert float(find_threshold(s, fraction)) == float(circuit_tracers_threshold(s, fraction))
    assert float(find_threshold(torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64), 0.5)) == 2.0


@settings(max_examples=30, deadline=None)
@given(values=st.lists(st.integers(0, 5), min_size=1, max_size=15))
def test_cumulative_scores_are_the_share_of_nodes_at_least_as_influential(values):
    """``cumulative_scores``' stated formula ``Σ_{j: infl_j ≥ infl_i} infl_j / Σ infl`` on drawn influences with
    ties: every member of a run of equal influence gets the run's whole share (mutant: the run's first running sum)."""
    infl = torch.tensor(values, dtype=torch.float64) / 4
    want = torch.stack([infl[infl >= v].sum() for v in infl]) / infl.sum().clamp_min(1e-30)
    torch.testing.assert_close(cumulative_scores(infl), want, rtol=1e-12, atol=0.0)


def test_pruned_graphs_keep_no_dangling_feature_or_error(tiny):
    """The pruning's stated rule (module docstring of ``scores``; circuit-tracer's ``prune_graph``): after the edge
    threshold, features without a kept incoming edge and features / errors without a kept outgoing edge are dropped
    until stable, and every kept edge joins two kept nodes. Low edge thresholds, where the tiny graph has such nodes
    (mutants: dangling features kept; attention errors never pruned)."""
    g = attribute(tiny, random_ids(1, 10, seed=3)[0], batch_size=32)
    kind = g.nodes.kind
    feature = (kind == TRANSCODER) | (kind == LORSA)
    error = (kind == MLP_ERROR) | (kind == ATTN_ERROR)
    dropped_features = dropped_attn_errors = 0
    for node_threshold, edge_threshold in ((0.8, 0.3), (0.8, 0.5), (0.9, 0.7), (1.0, 0.2)):
        p = prune(g, node_threshold=node_threshold, edge_threshold=edge_threshold)
        t, s = p.edge_index
        assert bool((p.node_mask[t] & p.node_mask[s]).all())
        has_in = torch.zeros_like(p.node_mask)
        has_in[t] = True
        has_out = torch.zeros_like(p.node_mask)
        has_out[s] = True
        kept = p.node_mask & ~g.nodes.intervened
        assert not bool((kept & feature & ~has_in).any()), (node_threshold, edge_threshold)
        assert not bool((kept & (feature | error) & ~has_out).any()), (node_threshold, edge_threshold)
        unpruned = prune(g, node_threshold=node_threshold, edge_threshold=1.0).node_mask
        dropped_features += int((unpruned & feature & ~p.node_mask).sum())
        dropped_attn_errors += int((unpruned & (kind == ATTN_ERROR) & ~p.node_mask).sum())
    assert dropped_features and dropped_attn_errors  # the rule had something to drop


def dense_ranking(rows: torch.Tensor, node: torch.Tensor, weight: torch.Tensor, keep: torch.Tensor,
                  n_sources: int) -> torch.Tensor:
    """Influence ``Σ_{k≥1} w Â^k`` over ``keep``'s nodes, in float64 from the dense stored rows ``(r, n_sources)``
    (target ``node[r]``, logit weight ``weight[r]``): ``Â`` the rows' ``|edges|`` between kept nodes, each row divided
    by its sum; the row weights' series solved as ``w (I − B)^{-1}`` with ``B[r, r'] = Â[r, node[r']]``."""
    a = rows.abs().double() * keep[:n_sources][None, :] * keep[node][:, None]
    a = a / a.sum(1, keepdim=True).clamp_min(1e-300)
    fed = node < n_sources
    b = torch.zeros(len(node), len(node), dtype=torch.float64)
    b[:, fed] = a[:, node[fed]]
    total = torch.linalg.solve((torch.eye(len(node), dtype=torch.float64) - b).T, weight.double())
    return total @ a


@pytest.mark.parametrize("zero_positions", [0, 1])
def test_the_budget_ranking_is_the_influence_without_bias_nodes_and_early_errors(tiny, zero_positions, monkeypatch):
    """A feature budget ranks the unvisited features by their influence over circuit-tracer's nodes: no bias nodes,
    no error nodes at the first ``zero_positions`` positions (``RowScheduler.feature_influence``'s docstring) —
    against a dense float64 solve of the stored rows (mutants: the bias nodes kept in the rows' masses; the errors
    at ``pos ≤ zero_positions`` left out)."""
    seen: dict = {}
    original = ENGINE.assemble

    def wrapped(layout, scheduler, *a, **k):
        seen["layout"], seen["scheduler"] = layout, scheduler
        return original(layout, scheduler, *a, **k)

    monkeypatch.setattr(ENGINE, "assemble", wrapped)
    attribute(tiny, random_ids(1, 10, seed=5)[0], batch_size=4, max_feature_nodes=10, zero_positions=zero_positions)
    lay, sch = seen["layout"], seen["scheduler"]
    nodes = lay.nodes
    assert bool((nodes.kind == BIAS).any())
    error = (nodes.kind == MLP_ERROR) | (nodes.kind == ATTN_ERROR)
    keep = ~((nodes.kind == BIAS) | (error & (nodes.pos < zero_positions)))
    _, rows = sch.matrix()
    node, weight = sch.row_nodes()
    want = dense_ranking(rows, node, weight, keep, lay.n_sources)[:lay.n_features]
    got = sch.feature_influence()
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12 * float(want.abs().max()))


def test_summary_counts_every_kind_and_the_top_biases_sit_after_the_last_layer():
    """``Graph.summary()`` counts each node kind as the node table holds it (errors: MLP and attention errors), and
    the final-norm bias node (GPT-2's ``ln_f.bias``) sits at layer ``n_layers``, after every layer's nodes, as the
    logits do (mutants: attention errors not counted; the top bias at the last layer)."""
    model, _, lorsas, tcs = attribution_setup("gpt2")
    g = attribute(rm(model, lorsas, tcs), random_ids(1, 6, seed=2)[0], batch_size=32)
    kind, s = g.nodes.kind, g.summary()
    assert bool((kind == ATTN_ERROR).any())
    assert s["errors"] == sum(int((kind == k).sum()) for k in (MLP_ERROR, ATTN_ERROR))
    assert s["lorsa_heads"] == int((kind == LORSA).sum()) and s["features"] == int((kind == TRANSCODER).sum())
    assert sum(v for k, v in s.items() if k != "edges") == g.n_nodes
    n_layers = model.config.n_layer
    top = [i for i in (kind == BIAS).nonzero().flatten().tolist() if g.nodes.label(i).startswith("bias final_norm")]
    assert top and all(int(g.nodes.layer[i]) == n_layers for i in top)


def test_an_unheld_edit_a_hundredth_of_the_logits_scale_is_refused():
    """``attribute(rm, tracer=tracer)`` refuses a graph whose logits differ from the trace's by more than rounding
    (documented bound 1e-3 of their scale, fp32): a raw edit of a decoder layer's output (no node, no error node holds
    it) small enough that the demeaned logits move by about 1e-2 of their scale — measured here in plain nnsight, two
    traces of the model — is refused, not taken as rounding (mutant: the bound at 1e-1)."""
    model, _, lorsas, tcs = attribution_setup("llama")
    bundle, ids = rm(model, lorsas, tcs), random_ids(1, 8, seed=2)[0]
    g = attribute(bundle, ids, batch_size=40)
    tok, eps = g.nodes.index[g.logit_ids], 4e-4
    with model.trace(ids[None]):
        clean = nnsight.save(model.lm_head.output[0, -1])
    with model.trace(ids[None]):
        model.model.layers[1].output[:, -1] += eps
        edited = nnsight.save(model.lm_head.output[0, -1])
    clean, edited = clean.detach().double(), edited.detach().double()
    a, b = clean - clean.mean(), edited - edited.mean()
    gap = float((a[tok] - b[tok]).abs().max() / b[tok].abs().max())
    assert 2e-3 < gap < 5e-2, gap
    with model.trace(ids) as tracer:
        raw = attribute(bundle, tracer=tracer, batch_size=40)
        model.model.layers[1].output[:, -1] += eps
    with pytest.raises(ConfigMismatchError, match="differ from the trace's"):
        _ = raw.graph

