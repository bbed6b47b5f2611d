"""``attribute(rm, tracer=tracer)`` of a traced pass whose MLPs are replaced by a cross-layer transcoder (CLT), with
CLT features edited.

A CLT's features are edited on the CLT's envoy (``model.clt.hook_sae_acts_post[layer]``, in layer order) or, since
2026-11-29, through :mod:`nnsight_lorsa.patching` (``Feature(layer, index, kind="transcoder")``: the same edit).
Such an edit, like any edit made directly on an envoy, enters the graph through the node values and error nodes, and
is found by value and marked (docs/attribution.md, "Attributing an intervened pass"; unmarked until 2026-11-26): every
CLT node holds the feature as the pass used it (a steered one its steered value, held as a marked fixed input; an
ablated one is no node), including the later layers' features the edit moved, while the edited feature decodes into
every later MLP; every computed row sums to its value and the graph's logits are the edited pass's. Checked against
the same trace's saved features and logits (tiny random Llama, a Lorsa at layer 1, a 3-layer CLT)."""

from __future__ import annotations

import nnsight
import pytest
import torch
from helpers import assert_same_nodes, attribution_setup, demeaned_logits, make_clt, random_ids, relative, rm

from nnsight_lorsa.attribution import Graph, attribute
from nnsight_lorsa.attribution.graph import TRANSCODER
from nnsight_lorsa.patching import Feature, ablate, steer

N_LAYERS = 3


def graph_acts(graph: Graph, layer: int, like: torch.Tensor) -> torch.Tensor:
    """The graph's CLT nodes of ``layer`` as a dense ``like``-shaped ``(pos, d_sae)`` tensor of their activations."""
    n = graph.nodes
    at = ((n.kind == TRANSCODER) & (n.layer == layer)).nonzero().flatten()
    out = torch.zeros_like(like)
    out[n.pos[at], n.index[at]] = n.activation[at].to(out.dtype)
    return out


@pytest.fixture(scope="module")
def clt_tiny():
    """A tiny random Llama with a Lorsa at layer 1 and a CLT over its 3 MLPs, a prompt and the prompt's clean graph."""
    model, _, lorsas, _ = attribution_setup("llama")
    bundle = rm(model, lorsas, make_clt(n_layers=N_LAYERS, seed=1))
    ids = random_ids(1, 8, seed=2)[0]
    return model, bundle, ids, attribute(bundle, ids, batch_size=40)


def top_feature(clean: Graph, layer: int, pos: int) -> tuple[int, float]:
    n = clean.nodes
    here = ((n.kind == TRANSCODER) & (n.layer == layer) & (n.pos == pos)).nonzero().flatten()
    top = int(here[n.activation[here].abs().argmax()])
    return int(n.index[top]), float(n.activation[top])


def edited_pass(model, bundle, ids: torch.Tensor, layer: int, feature: int, value: float | None
                ) -> tuple[Graph, list[torch.Tensor], torch.Tensor]:
    """The graph of a traced pass with CLT feature ``feature`` of ``layer`` set to ``value`` (None: + 2.0) at the last
    position on the CLT's envoy, the pass's features of every layer ``(pos, d_sae)`` and its unembedding output."""
    last = int(ids.numel()) - 1
    saved: list = []
    with model.trace(ids) as tracer:
        clt = bundle.replace()["transcoders"]
        handle = attribute(bundle, tracer=tracer, batch_size=40)
        for at in range(N_LAYERS):
            acts = clt.hook_sae_acts_post[at].output
            if at == layer:
                if value is None:
                    acts[0, last, feature] += 2.0
                else:
                    acts[0, last, feature] = value
            saved.append(acts.save())
        logits = nnsight.save(model.lm_head.output)
    return handle.graph, [a[0].detach() for a in saved], logits


@pytest.mark.parametrize("layer", [0, 1])
def test_a_clt_feature_steered_on_its_envoy_takes_the_passs_value(clt_tiny, layer):
    """A CLT feature of layer 0 (decoding into MLPs 0, 1 and 2) or 1 (into 1 and 2), steered by +2 at the last
    position: its node holds the steered value (it used to hold the feature's unedited encoding, the edit carried
    only by the error nodes), marked as a direct edit, with no row (until 2026-11-26 it was unmarked, its row summing
    to the encoder's unedited output, not its value); every CLT node is the pass's feature, the later layers' moved
    by the edit; it drives the later layers' features; rows sum; the graph's logits are the edited pass's."""
    model, bundle, ids, clean = clt_tiny
    last = int(ids.numel()) - 1
    feature, before = top_feature(clean, layer, last)
    assert abs(before) > 0.01
    graph, acts, logits = edited_pass(model, bundle, ids, layer, feature, None)
    g = graph.nodes
    i = ((g.kind == TRANSCODER) & (g.layer == layer) & (g.pos == last) & (g.index == feature)).nonzero().flatten()
    assert i.numel() == 1
    i = int(i[0])
    assert abs(float(g.activation[i]) - (before + 2.0)) < 1e-5 * (abs(before) + 2.0)
    # a direct (envoy) edit, found by value: held at the pass's value and marked, no row (it used to keep a row summing
    # to the encoder's unedited value)
    assert not bool(graph.feature_rows[i]) and bool(graph.values[i].isnan()) and not bool(graph.densify()[i].any())
    assert g.intervened.nonzero().flatten().tolist() == [i]
    assert graph.meta["intervened"] == [
        f"Feature(site={layer}, index={feature}, kind='transcoder') at positions [{last}] (direct edit)"]
    for at in range(N_LAYERS):  # every CLT node is the feature the pass computed (and used)
        assert torch.allclose(graph_acts(graph, at, acts[at]), acts[at], rtol=1e-5, atol=1e-6), at
    moved = acts[N_LAYERS - 1]
    assert not torch.allclose(graph_acts(clean, N_LAYERS - 1, moved), moved, rtol=1e-5, atol=1e-6)
    dense = graph.densify()
    for at in range(layer + 1, N_LAYERS):  # the steered feature drives the features of every later layer
        later = (g.kind == TRANSCODER) & (g.layer == at) & (g.pos == last)
        assert dense[later, i].abs().sum() > 0, at
    assert graph.edge_sum_error("mass").max() < max(1e-6, 2 * float(clean.edge_sum_error("mass").max()))  # 1.2e-6
    assert graph.edge_sum_error().median() < 1e-5
    got, want = demeaned_logits(graph, logits)
    assert relative(got, want) < 1e-5 and graph.meta["logit_gap"] < 1e-5
    assert relative(clean.values[clean.logit_ids], want) > 1e-3  # the edit changed them


def test_a_clt_feature_ablated_on_its_envoy_leaves_the_graph(clt_tiny):
    """A CLT feature of layer 0 active at the last position, zeroed there on the envoy: it is no node of the graph
    (an unmarked edit: a zero feature is no node; it used to stay at its unedited value), the later layers' nodes
    are the pass's features, rows sum and the graph's logits are the edited pass's."""
    model, bundle, ids, clean = clt_tiny
    last = int(ids.numel()) - 1
    feature, before = top_feature(clean, 0, last)
    assert abs(before) > 0.01
    graph, acts, logits = edited_pass(model, bundle, ids, 0, feature, 0.0)
    g = graph.nodes
    assert not bool(((g.kind == TRANSCODER) & (g.layer == 0) & (g.pos == last) & (g.index == feature)).any())
    for at in range(N_LAYERS):
        assert torch.allclose(graph_acts(graph, at, acts[at]), acts[at], rtol=1e-5, atol=1e-6), at
    assert graph.edge_sum_error("mass").max() < max(1e-6, 2 * float(clean.edge_sum_error("mass").max()))  # 1.2e-6
    assert graph.edge_sum_error().median() < 1e-5
    got, want = demeaned_logits(graph, logits)
    assert relative(got, want) < 1e-5 and graph.meta["logit_gap"] < 1e-5
    assert relative(clean.values[clean.logit_ids], want) > 1e-4


@pytest.mark.parametrize("edit", ["steer", "ablate"])
def test_a_clt_feature_edited_through_patching_gives_the_graph_of_the_envoy_edit(clt_tiny, edit):
    """``steer`` / ``ablate`` of a CLT feature through :mod:`nnsight_lorsa.patching` inside an attributed trace (a
    named error until 2026-11-29: a CLT's features were no patching targets): the same graph as the same edit made on
    the CLT's envoy (:func:`edited_pass`) — the same nodes, edges, values and logits."""
    model, bundle, ids, clean = clt_tiny
    last = int(ids.numel()) - 1
    feature, before = top_feature(clean, 0, last)
    want, _, want_logits = edited_pass(model, bundle, ids, 0, feature, None if edit == "steer" else 0.0)
    with model.trace(ids) as tracer:
        bundle.replace()
        handle = attribute(bundle, tracer=tracer, batch_size=40)
        target = bundle(Feature(0, feature, kind="transcoder"))
        if edit == "steer":
            steer(target, 2.0, positions=last)
        else:
            ablate(target, positions=last)
        logits = nnsight.save(model.lm_head.output)
    graph = handle.graph
    assert torch.equal(logits, want_logits)
    assert graph.nodes.intervened.sum() == 1 and len(graph.meta["intervened"]) == 1
    assert graph.edge_sum_error("mass").max() < max(1e-6, 2 * float(clean.edge_sum_error("mass").max()))
    if edit == "ablate":  # a patching edit is a marked node whatever its value (an envoy edit to 0: no node)
        i = int(graph.nodes.intervened.nonzero().item())
        assert float(graph.nodes.activation[i]) == 0.0 and not bool(graph.densify()[i].any())
        keep = torch.ones(len(graph.nodes.kind), dtype=torch.bool)
        keep[i] = False
        for name in ("kind", "layer", "pos", "index"):
            assert torch.equal(getattr(graph.nodes, name)[keep], getattr(want.nodes, name)), name
        assert relative(graph.densify()[keep][:, keep], want.densify()) < 1e-5
    else:
        assert_same_nodes(graph, want)
        assert relative(graph.densify(), want.densify()) < 1e-5
