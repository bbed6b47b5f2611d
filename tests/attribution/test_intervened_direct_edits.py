"""``attribute(rm, tracer=tracer)`` of a traced pass whose Lorsa heads or transcoder features are edited directly on
their envoys (``hook_z``, ``hook_sae_acts_post``, a CLT's ``hook_sae_acts_post[layer]``), not through
:mod:`nnsight_lorsa.patching`.

Such an edit reports to no edit log, so the graph finds it by value (:meth:`~nnsight_lorsa.attribution.layout.
LiveNodes.held`): a node whose value in the pass differs from its encoder's pre-activation recomputed from the
pass's recorded input by more than the stated rounding bound is marked like a patching edit — held at the pass's
value, no row (``feature_rows`` False, ``values`` NaN), ``intervened`` True, named in ``graph.meta["intervened"]``,
kept by pruning, exported with ``"intervened": true``. Checked on a tiny random Llama (Lorsa at layer 1, transcoders
at 0 and 2) and the same model with a 3-layer CLT: a steered active node, an inactive node made active and the
layer's largest node scaled by a factor just above the bound are marked (and nothing else is); every computed row
sums to its node's value; the graph's logits are the trace's; beside a patching edit each is listed once. Without an
edit nothing is marked, in fp32, bf16 and fp16, and computed in another dtype than the model's (``dtype=``)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import nnsight
import pytest
import torch
from helpers import attribution_setup, demeaned_logits, make_clt, random_ids, relative, rm
from hypothesis import given, settings
from hypothesis import strategies as st

from nnsight_lorsa.attribution import Graph, PruneConfig, attribute, to_neuronpedia
from nnsight_lorsa.attribution.graph import LORSA, TRANSCODER
from nnsight_lorsa.attribution.intervened import LOGIT_GAP_BOUND
from nnsight_lorsa.attribution.layout import direct_edit_bound
from nnsight_lorsa.patching import Feature, LorsaHead

N_POS = 8
#: (kind, layer) of every node family the tests edit: the Lorsa's heads, a per-layer transcoder's features
#: (layers 0 and 2, the latter with a skip path), a CLT's features (layers 0 and 1)
SITES = [("lorsa", 1), ("transcoder", 0), ("transcoder", 2), ("clt", 0), ("clt", 1)]


def bundle_of(kind: str, dtype: torch.dtype = torch.float32):
    """The tiny Llama with its Lorsa and per-layer transcoders (``kind`` ``"lorsa"``/``"transcoder"``) or CLT
    (``"clt"``), every module in ``dtype``."""
    model, hf, lorsas, tcs = attribution_setup("llama")
    if kind == "clt":
        tcs = make_clt(n_layers=3, seed=1)
    hf.to(dtype)
    for m in [*lorsas.values(), *(tcs.values() if isinstance(tcs, dict) else [tcs])]:
        m.to(dtype)
    return model, rm(model, lorsas, tcs)


@functools.cache
def cached_bundle(kind: str, dtype: torch.dtype):
    return bundle_of(kind, dtype)


class Setups:
    """``setups[kind]``: ``(model, bundle, ids, clean graph)``. Its repr is its name: hypothesis prints the arguments
    of a falsifying example, and its pretty-printer reads a block graph's ``adjacency`` field, which raises
    ``DenseAdjacencyError`` (reported as a flaky strategy instead of the failure)."""

    def __init__(self, setups: dict) -> None:
        self._setups = setups

    def __getitem__(self, kind: str) -> tuple:
        return self._setups[kind]

    def __repr__(self) -> str:
        return "Setups(tiny Llama: Lorsa + transcoders, Lorsa + CLT)"


@pytest.fixture(scope="module")
def bundles() -> Setups:
    """``{kind: (model, bundle, ids, clean graph)}`` for the per-layer set and the CLT (fp32)."""
    ids = random_ids(1, N_POS, seed=2)[0]
    out = {}
    for kind in ("transcoder", "clt"):
        model, bundle = bundle_of(kind)
        out[kind] = (model, bundle, ids, attribute(bundle, ids, batch_size=40))
    out["lorsa"] = out["transcoder"]
    return Setups(out)


def envoy_value(spliced: dict, kind: str, layer: int):
    """The envoy output an edit of ``kind``'s nodes at ``layer`` writes: ``(1, pos, width)``."""
    if kind == "lorsa":
        return spliced["lorsas"][layer].hook_z.output
    if kind == "clt":
        return spliced["transcoders"].hook_sae_acts_post[layer].output
    return spliced["transcoders"][layer].hook_sae_acts_post.output


def edited_pass(model, bundle, ids: torch.Tensor, kind: str, layer: int,
                edit: Callable[[torch.Tensor], None], **options) -> tuple[Graph, torch.Tensor, torch.Tensor]:
    """The graph of a traced pass whose ``kind`` nodes at ``layer`` are edited by ``edit(value)`` on their envoy,
    the edited ``(pos, width)`` values as the pass used them, and the pass's unembedding output."""
    with model.trace(ids) as tracer:
        spliced = bundle.replace()
        handle = attribute(bundle, tracer=tracer, batch_size=40, **options)
        value = envoy_value(spliced, kind, layer)
        edit(value)
        used = value.save()
        logits = nnsight.save(model.lm_head.output)
    return handle.graph, used[0].detach(), logits


def node_kind(kind: str) -> int:
    return LORSA if kind == "lorsa" else TRANSCODER


def target_name(kind: str, layer: int, index: int) -> str:
    return str(LorsaHead(layer, index) if kind == "lorsa" else Feature(layer, index, kind="transcoder"))


def layer_nodes(graph: Graph, kind: str, layer: int) -> torch.Tensor:
    n = graph.nodes
    return (n.kind == node_kind(kind)) & (n.layer == layer)


def check_marked(graph: Graph, kind: str, layer: int, pos: int, index: int, value: float) -> int:
    """The node edited at (``pos``, ``index``) is the one marked node: held at ``value``, no row, no incoming
    edges, named in the meta as a direct edit; returns its graph index."""
    g = graph.nodes
    marked = g.intervened.nonzero().flatten()
    assert marked.numel() == 1, [(int(g.layer[i]), int(g.pos[i]), int(g.index[i])) for i in marked]
    i = int(marked[0])
    assert (int(g.kind[i]), int(g.layer[i]), int(g.pos[i]), int(g.index[i])) == (node_kind(kind), layer, pos, index)
    assert abs(float(g.activation[i]) - value) <= 1e-6 * max(1.0, abs(value))
    assert not bool(graph.feature_rows[i]) and bool(graph.values[i].isnan())
    assert not bool(graph.densify()[i].any())  # held as a fixed input: no incoming edges
    assert graph.meta["intervened"] == [f"{target_name(kind, layer, index)} at positions [{pos}] (direct edit)"]
    return i


def check_sums_and_logits(graph: Graph, logits: torch.Tensor) -> None:
    """Every computed row sums to its node's value (feature rows: to the node's activation in the pass, which is the
    value its outgoing edges carry), and the graph's logits are the trace's."""
    assert graph.edge_sum_error("mass").max() < 2e-6 and graph.edge_sum_error().median() < 1e-5
    n = graph.nodes
    rows = graph.feature_rows & (n.kind == LORSA) | graph.feature_rows & (n.kind == TRANSCODER)
    for kind in (LORSA, TRANSCODER):
        for layer in n.layer[rows & (n.kind == kind)].unique().tolist():
            at = rows & (n.kind == kind) & (n.layer == layer)
            scale = float(n.activation[(n.kind == kind) & (n.layer == layer)].abs().max())
            gap = float((graph.values[at].double() - n.activation[at].double()).abs().max())
            assert gap <= 1e-5 * scale, (kind, layer, gap / scale)
    got, want = demeaned_logits(graph, logits)
    # fp32 rounding through an edited stream: measured ≤ 1.3e-5 over the drawn edits (1e-5 for the fixed edits of
    # test_intervened.py), far below the LOGIT_GAP_BOUND of an edit the graph cannot hold
    assert relative(got, want) < 1e-4 and graph.meta["logit_gap"] < 1e-4 < LOGIT_GAP_BOUND


def active(clean: Graph, kind: str, layer: int) -> list[tuple[int, int, float]]:
    """``(pos, index, activation)`` of the clean graph's nodes of ``kind`` at ``layer``."""
    n = clean.nodes
    at = layer_nodes(clean, kind, layer).nonzero().flatten()
    return [(int(n.pos[i]), int(n.index[i]), float(n.activation[i])) for i in at]


def width(bundle, kind: str, layer: int) -> int:
    if kind == "lorsa":
        return bundle.lorsas[layer].cfg.n_ov_heads
    return (bundle.transcoders.clt if kind == "clt" else bundle.transcoders[layer]).cfg.d_sae


@pytest.mark.parametrize("kind,layer", SITES)
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_a_steered_active_node_is_marked(bundles, kind, layer, data):
    """An active node (drawn among the clean graph's), steered by a drawn delta on its envoy: marked, held at its
    steered value; rows sum; logits are the trace's."""
    model, bundle, ids, clean = bundles[kind]
    pos, index, before = data.draw(st.sampled_from(active(clean, kind, layer)), label="node")
    delta = data.draw(st.floats(0.25, 3.0) | st.floats(-3.0, -0.25), label="delta")

    def edit(value: torch.Tensor) -> None:
        value[0, pos, index] += delta

    graph, used, logits = edited_pass(model, bundle, ids, kind, layer, edit)
    assert abs(float(used[pos, index]) - (before + delta)) < 1e-5 * (abs(before) + abs(delta))
    check_marked(graph, kind, layer, pos, index, float(used[pos, index]))
    check_sums_and_logits(graph, logits)


@pytest.mark.parametrize("kind,layer", SITES)
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_a_node_activated_by_an_edit_is_marked(bundles, kind, layer, data):
    """A node the encoder had inactive (not in the clean graph), set to a drawn positive value on its envoy: a marked
    node at that value (not a computed node whose row sums to its pre-activation)."""
    model, bundle, ids, clean = bundles[kind]
    pos = data.draw(st.integers(0, N_POS - 1), label="pos")
    on = {i for p, i, _ in active(clean, kind, layer) if p == pos}
    index = data.draw(st.sampled_from([i for i in range(width(bundle, kind, layer)) if i not in on]), label="index")
    new = data.draw(st.floats(0.5, 4.0), label="value")

    def edit(value: torch.Tensor) -> None:
        value[0, pos, index] = new

    graph, used, logits = edited_pass(model, bundle, ids, kind, layer, edit)
    check_marked(graph, kind, layer, pos, index, new)
    check_sums_and_logits(graph, logits)


@pytest.mark.parametrize("kind,layer", SITES)
def test_a_node_scaled_just_above_the_bound_is_marked(bundles, kind, layer, tmp_path):
    """The layer's largest node scaled by ``1 + 4 × bound`` (fp32: a change of ~4e-6 of the layer's scale) is
    marked; pruned (while building) it is kept as an input, and the export flags it."""
    model, bundle, ids, clean = bundles[kind]
    pos, index, before = max(active(clean, kind, layer), key=lambda t: abs(t[2]))
    factor = 1 + 4 * direct_edit_bound(torch.float32)

    def edit(value: torch.Tensor) -> None:
        value[0, pos, index] *= factor

    graph, used, logits = edited_pass(model, bundle, ids, kind, layer, edit)
    assert float(used[pos, index]) != before
    i = check_marked(graph, kind, layer, pos, index, float(used[pos, index]))
    check_sums_and_logits(graph, logits)
    pruned, _, _ = edited_pass(model, bundle, ids, kind, layer, edit, prune=PruneConfig())
    p = pruned.nodes
    j = int(p.intervened.nonzero().flatten().item())
    assert (int(p.layer[j]), int(p.pos[j]), int(p.index[j])) == (layer, pos, index)
    assert float(p.activation[j]) == float(graph.nodes.activation[i])
    flagged = [node for node in to_neuronpedia(Graph.load(graph.save(tmp_path / "g")), slug="direct")["nodes"]
               if node.get("intervened")]
    assert len(flagged) == 1 and flagged[0]["ctx_idx"] == pos


@pytest.mark.parametrize("kind", ["transcoder", "clt"])
@pytest.mark.parametrize("dtype,option", [
    (torch.float32, None), (torch.bfloat16, None), (torch.float16, None), (torch.bfloat16, torch.float32),
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16)], ids=str)
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_without_an_edit_nothing_is_marked(kind, dtype, option, seed):
    """An unedited spliced pass (drawn prompts), the model in fp32, bf16 or fp16, the graph computed in the model's
    dtype or another (``dtype=``): no node is marked (the rounding between the pass's values and their
    recomputation stays below the bound); a steer of the Lorsa's largest head by half the layer's scale (far above
    the bound in every dtype) is marked alone."""
    model, bundle = cached_bundle(kind, dtype)
    ids = random_ids(1, N_POS, seed=seed)[0]
    options = {} if option is None else {"dtype": option}
    graph, used, _ = edited_pass(model, bundle, ids, "lorsa", 1, lambda value: None, **options)
    assert not bool(graph.nodes.intervened.any()) and graph.meta["intervened"] == []
    pos, head = divmod(int(used.float().abs().argmax()), used.shape[1])
    top = float(used[pos, head])

    def edit(value: torch.Tensor) -> None:
        value[0, pos, head] += 0.5 * abs(top)

    graph, _, _ = edited_pass(model, bundle, ids, "lorsa", 1, edit, **options)
    g = graph.nodes
    marked = g.intervened.nonzero().flatten()
    assert marked.numel() == 1
    assert (int(g.kind[marked[0]]), int(g.pos[marked[0]]), int(g.index[marked[0]])) == (LORSA, pos, head)


def test_a_direct_edit_beside_a_patching_edit(bundles):
    """A transcoder feature steered through :mod:`nnsight_lorsa.patching` and, later in the pass, a Lorsa head
    steered on ``hook_z``: both marked, the patched one listed once (as the patching edit, not again as a direct
    edit, though its value too differs from its encoder's), the direct one after it; rows sum, logits are the
    trace's."""
    from nnsight_lorsa.patching import steer

    model, bundle, ids, clean = bundles["transcoder"]
    pos_f, feature, _ = active(clean, "transcoder", 0)[0]
    pos_h, head, _ = active(clean, "lorsa", 1)[-1]
    with model.trace(ids) as tracer:
        spliced = bundle.replace()
        handle = attribute(bundle, tracer=tracer, batch_size=40)
        steer(bundle(Feature(0, feature, kind="transcoder")), 1.5, positions=pos_f)
        spliced["lorsas"][1].hook_z.output[0, pos_h, head] += 1.0
        logits = nnsight.save(model.lm_head.output)
    graph = handle.graph
    g = graph.nodes
    marked = [(int(g.kind[i]), int(g.layer[i]), int(g.pos[i]), int(g.index[i])) for i in g.intervened.nonzero()[:, 0]]
    assert sorted(marked) == sorted([(TRANSCODER, 0, pos_f, feature), (LORSA, 1, pos_h, head)])
    assert graph.meta["intervened"] == [f"{Feature(0, feature, kind='transcoder')} at positions {pos_f}",
                                        f"{LorsaHead(1, head)} at positions [{pos_h}] (direct edit)"]
    assert not bool(graph.feature_rows[g.intervened].any()) and bool(graph.values[g.intervened].isnan().all())
    check_sums_and_logits(graph, logits)
