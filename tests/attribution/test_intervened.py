"""The graph of an intervened forward pass, inside the trace (issue 24): ``attribute(rm, tracer=tracer)``.

Checked numerically against the unmodified model and against the same trace's saved logits: without an
edit the graph is the clean ``attribute(rm, prompt)`` graph; with an ablated Lorsa head (the embedded
tinyshakespeare model and its packaged Lorsa + transcoders) or a steered transcoder feature (a tiny
random Llama), the edited node is marked, held at its edited value with no incoming edges, every computed
row still sums to its node's value, and the graph's logits are the trace's logits, which differ from the
clean ones. Misuse ends in our named errors."""

from __future__ import annotations

import pickle

import nnsight
import pytest
import torch
from helpers import DEVICES, attribution_setup, random_ids, rm

from nnsight_lorsa.attribution import Graph, PruneConfig, attribute, cache_for_attribution, prune, to_neuronpedia
from nnsight_lorsa.attribution.graph import LORSA, TRANSCODER
from nnsight_lorsa.attribution.intervened import start
from nnsight_lorsa.attribution.options import AttributionOptions
from nnsight_lorsa.errors import (
    ArgumentError,
    ConfigMismatchError,
    ShapeError,
    TraceOrderError,
    UnsupportedGenerationError,
)
from nnsight_lorsa.patching import Feature, LorsaHead, MHSAHead, ablate, steer

PROMPT = "ROMEO:\nBut soft, what light"


def demeaned_logits(graph: Graph, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(graph's logit values, the same tokens' demeaned logits at the last position of ``logits``)``."""
    ids = graph.logit_ids
    last = logits.detach()[0, -1].double()
    return graph.values[ids].double(), last[graph.nodes.index[ids]] - last.mean()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def embedded():
    """The trained tinyshakespeare Llama with its Lorsa (layer 2) and transcoders (every layer), the
    bundle, and the clean graph of PROMPT."""
    from nnsight_lorsa import LorsaSet, ReplacementModel, TranscoderSet
    from nnsight_lorsa.assets import default_lorsa_dir, default_transcoder_dir
    from nnsight_lorsa.envoy import load_model

    model = load_model()
    bundle = ReplacementModel(model, lorsas=LorsaSet.from_pretrained(model, default_lorsa_dir()),
                              transcoders=TranscoderSet.from_pretrained(model, default_transcoder_dir()))
    return model, bundle, attribute(bundle, PROMPT, batch_size=64)


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama (Lorsa at layer 1, transcoders at 0 and 2, skip at 2), a prompt, its clean graph."""
    model, _, lorsas, tcs = attribution_setup("llama")
    bundle = rm(model, lorsas, tcs)
    ids = random_ids(1, 8, seed=2)[0]
    return model, bundle, ids, attribute(bundle, ids, batch_size=40)


def same_graph(got: Graph, want: Graph) -> None:
    for field in ("kind", "layer", "pos", "index"):
        assert torch.equal(getattr(got.nodes, field), getattr(want.nodes, field)), field
    assert not bool(got.nodes.intervened.any())
    assert torch.equal(got.feature_rows, want.feature_rows)
    rows = want.feature_rows
    assert relative(got.values[rows], want.values[rows]) < 1e-5
    assert relative(got.nodes.activation, want.nodes.activation) < 1e-5
    assert relative(got.densify(), want.densify()) < 1e-4


def test_without_an_edit_the_graph_is_the_clean_graph(embedded):
    """(a) Spliced (``rm.replace()``, error terms on) and unedited, the traced pass is the model's own: its
    graph equals ``attribute(rm, prompt)``'s, node for node, and its logits are the trace's."""
    model, bundle, clean = embedded
    with model.trace(PROMPT) as tracer:
        bundle.replace()
        handle = attribute(bundle, tracer=tracer, batch_size=64)
        logits = nnsight.save(model.lm_head.output)
    graph = handle.graph
    same_graph(graph, clean)
    assert handle.graph is graph  # built once
    got, want = demeaned_logits(graph, logits)
    assert relative(got, want) < 1e-5 and graph.meta["logit_gap"] < 1e-5
    assert graph.edge_sum_error().max() < 1e-4


def test_an_ablated_lorsa_head_is_a_marked_fixed_input(embedded, tmp_path):
    """(b) A Lorsa head active at the last position, zero-ablated there: the node stays, at 0, marked and
    without a row; every computed row sums to its value; the graph's logits are the patched trace's, which
    differ from the clean ones; the mark survives save/load and the Neuronpedia export."""
    model, bundle, clean = embedded
    n = clean.nodes
    last = int(clean.tokens.numel()) - 1
    at = ((n.kind == LORSA) & (n.pos == last)).nonzero().flatten()
    top = int(at[n.activation[at].argmax()])
    layer, head = int(n.layer[top]), int(n.index[top])
    assert float(n.activation[top]) > 0.1
    with model.trace(PROMPT) as tracer:
        bundle.replace()
        handle = attribute(bundle, tracer=tracer, batch_size=64)
        ablate(bundle(LorsaHead(layer, head)), positions=last)
        logits = nnsight.save(model.lm_head.output)
    graph = handle.graph
    g = graph.nodes
    marked = g.intervened.nonzero().flatten()
    assert marked.numel() == 1
    i = int(marked[0])
    assert (int(g.kind[i]), int(g.layer[i]), int(g.pos[i]), int(g.index[i])) == (LORSA, layer, last, head)
    assert float(g.activation[i]) == 0.0
    assert not bool(graph.feature_rows[i]) and bool(graph.values[i].isnan())
    assert not bool(graph.densify()[i].any()) and not bool(graph.densify()[:, i].any())  # no edges in; 0 out
    # the unedited nodes keep rows that sum exactly, and the graph's logits are the patched trace's
    assert int(graph.feature_rows.sum()) == len(graph.feature_ids) - 1 + len(graph.logit_ids)
    assert graph.edge_sum_error().max() < 1e-4
    got, want = demeaned_logits(graph, logits)
    assert relative(got, want) < 1e-5
    assert relative(clean.values[clean.logit_ids].double(), want) > 1e-3  # the edit changed them
    assert graph.meta["intervened"] == [f"LorsaHead(layer={layer}, head={head}) at positions {last}"]
    loaded = Graph.load(graph.save(tmp_path / "g"))
    assert torch.equal(loaded.nodes.intervened, g.intervened)
    out = to_neuronpedia(loaded, slug="ablated")  # default pruning: the ablated node (no influence) stays
    flagged = [node for node in out["nodes"] if node.get("intervened")]
    assert [node["node_id"] for node in flagged] == [f"A{layer}_{head}_{last}"]
    assert sum("intervened" in node for node in to_neuronpedia(clean, slug="clean")["nodes"]) == 0


def steered_pass(model, bundle, ids: torch.Tensor, feature: int) -> tuple[Graph, torch.Tensor]:
    """The graph of a traced pass with layer-0 transcoder feature ``feature`` steered by 2 at the last position,
    and that pass's unembedding output."""
    with model.trace(ids) as tracer:
        bundle.replace()
        handle = attribute(bundle, tracer=tracer, batch_size=40)
        steer(bundle(Feature(0, feature, kind="transcoder")), 2.0, positions=int(ids.numel()) - 1)
        logits = nnsight.save(model.lm_head.output)
    return handle.graph, logits


def test_a_steered_transcoder_feature_holds_its_steered_value(tiny):
    """(c) A transcoder feature steered at the last position (tiny model, skip transcoder at layer 2): the
    node's value is the pass's (its activation + delta), marked, with no row; rows sum; logits are the
    trace's and differ from the clean ones; the features downstream take the pass's values."""
    model, bundle, ids, clean = tiny
    last = int(ids.numel()) - 1
    n = clean.nodes
    here = (n.kind == TRANSCODER) & (n.layer == 0) & (n.pos == last)
    feature = int(n.index[here][0])
    before = float(n.activation[here][0])
    graph, logits = steered_pass(model, bundle, ids, feature)
    g = graph.nodes
    i = int(g.intervened.nonzero().flatten().item())
    assert (int(g.kind[i]), int(g.layer[i]), int(g.pos[i]), int(g.index[i])) == (TRANSCODER, 0, last, feature)
    assert abs(float(g.activation[i]) - (before + 2.0)) < 1e-5 * (abs(before) + 2.0)
    assert not bool(graph.feature_rows[i]) and not bool(graph.densify()[i].any())
    assert graph.densify()[:, i].abs().sum() > 0  # it drives later nodes at its new value
    assert graph.edge_sum_error("mass").max() < 1e-6 and graph.edge_sum_error().median() < 1e-5
    got, want = demeaned_logits(graph, logits)
    assert relative(got, want) < 1e-5
    assert relative(clean.values[clean.logit_ids].double(), want) > 1e-3
    # pruned (after, and while building): the steered feature is kept as an input, with its outgoing edges
    kept = prune(graph)
    assert bool(kept.node_mask[i]) and bool(kept.edge_mask[:, i].any())
    with model.trace(ids) as tracer:
        bundle.replace()
        pruned = attribute(bundle, tracer=tracer, batch_size=40, prune=PruneConfig())
        steer(bundle(Feature(0, feature, kind="transcoder")), 2.0, positions=last)
    p = pruned.graph
    j = int(p.nodes.intervened.nonzero().flatten().item())
    assert float(p.nodes.activation[j]) == float(g.activation[i]) and bool(p.densify()[:, j].any())
    assert p.n_nodes < graph.n_nodes
    # a layer-2 feature at the last position now has the pass's activation, not the clean one
    later = (g.kind == TRANSCODER) & (g.layer == 2) & (g.pos == last)
    later_clean = (n.kind == TRANSCODER) & (n.layer == 2) & (n.pos == last)
    assert not torch.equal(g.activation[later], n.activation[later_clean])


def test_gemma2_traced_pass():
    """Gemma-2 (post-norms, soft-caps): the unedited traced pass's graph is the clean graph, and a steered
    transcoder feature's pass sums row by row, with the trace's (uncapped) logits as the logit nodes' values."""
    model, _, lorsas, tcs = attribution_setup("gemma2")
    bundle = rm(model, lorsas, tcs)
    ids = random_ids(1, 8, seed=2)[0]
    clean = attribute(bundle, ids, batch_size=40)
    with model.trace(ids) as tracer:
        bundle.replace()
        handle = attribute(bundle, tracer=tracer, batch_size=40)
    same_graph(handle.graph, clean)
    last = int(ids.numel()) - 1
    n = clean.nodes
    feature = int(n.index[(n.kind == TRANSCODER) & (n.layer == 0) & (n.pos == last)][0])
    graph, logits = steered_pass(model, bundle, ids, feature)
    assert int(graph.nodes.intervened.sum()) == 1
    assert graph.edge_sum_error("mass").max() < 1e-6 and graph.edge_sum_error().median() < 1e-5
    got, want = demeaned_logits(graph, logits)
    assert relative(got, want) < 1e-5 and relative(clean.values[clean.logit_ids].double(), want) > 1e-3


def test_inside_a_local_session(tiny):
    """Inside ``model.session()`` the trace runs at its block's end: the handle's graph is there after it."""
    model, bundle, ids, clean = tiny
    with model.session():  # noqa: SIM117  (nnsight captures each with block's own source: kept apart)
        with model.trace(ids) as tracer:
            handle = attribute(bundle, tracer=tracer, batch_size=40)
    same_graph(handle.graph, clean)


def test_misuse_raises_named_errors(tiny):
    """(d) Every misuse: named errors saying what to do."""
    model, bundle, ids, _ = tiny
    with pytest.raises(TraceOrderError, match=r"attribute\(rm, tracer=tracer\) at the top"), model.trace(ids):
        attribute(bundle, ids)  # the clean graph inside a trace: names the new spelling
    with pytest.raises(TraceOrderError, match="read it after the"), model.trace(ids) as tracer:
        _ = attribute(bundle, tracer=tracer).graph
    with pytest.raises(TraceOrderError, match="top of the trace body"), model.trace(ids) as tracer:
        nnsight.save(model.model.layers[0].output)
        attribute(bundle, tracer=tracer)
    with pytest.raises(TraceOrderError, match="already recording"), model.trace(ids) as tracer:
        attribute(bundle, tracer=tracer)
        attribute(bundle, tracer=tracer)
    with pytest.raises(ConfigMismatchError, match="layer 0 keeps its MHSA"), model.trace(ids) as tracer:
        attribute(bundle, tracer=tracer)
        ablate(bundle(MHSAHead(0, 1)))
    with pytest.raises(ArgumentError, match="not both"), model.trace(ids) as tracer:
        attribute(bundle, ids, tracer=tracer)
    with pytest.raises(ConfigMismatchError, match="no remote=, no qk_heads="), model.trace(ids) as tracer:
        attribute(bundle, tracer=tracer, qk_heads=2)
    with pytest.raises(ArgumentError, match="needs a prompt"):
        attribute(bundle)
    with pytest.raises(ArgumentError, match="needs the tracer"):
        start(bundle, None, AttributionOptions())
    with pytest.raises(TraceOrderError, match="inside a model.trace"):
        start(bundle, object(), AttributionOptions())
    with pytest.raises(UnsupportedGenerationError), model.generate(ids[None], max_new_tokens=2) as tracer:
        attribute(bundle, tracer=tracer)
    with model.trace(random_ids(2, 8, seed=2)) as tracer:  # two prompts
        two = attribute(bundle, tracer=tracer)
    with pytest.raises(ShapeError, match="one prompt"):
        _ = two.graph
    with model.trace(ids) as tracer:
        stopped = attribute(bundle, tracer=tracer)
        nnsight.save(model.model.layers[0].output)
        tracer.stop()
    with pytest.raises(TraceOrderError, match="ended before the model reached its unembedding"):
        _ = stopped.graph
    with pytest.raises(TraceOrderError, match="cannot be pickled or sent"):
        pickle.dumps(two)
    with model.trace(ids) as tracer:  # a raw edit where the graph has no node or error node: a layer's output
        raw = attribute(bundle, tracer=tracer, batch_size=40)
        model.model.layers[1].output[:, -1] += 1.0
    with pytest.raises(ConfigMismatchError, match="differ from the trace's"):
        _ = raw.graph
    # the model is usable afterwards: a clean graph as before
    assert attribute(bundle, ids, batch_size=40).summary()["lorsa_heads"] > 0


@pytest.mark.parametrize(("options", "error", "match"), [
    ({"batch_size": 0}, ConfigMismatchError, r"attribute\(batch_size=\.\.\.\) must be >= 1"),
    ({"memory": "fastest"}, ConfigMismatchError, "got 'fastest'"),
    ({"prune": (2.0, 0.5)}, ConfigMismatchError, "prune"),
    ({"batch_sizes": 4}, TypeError, r"attribute\(\) got unexpected keyword argument\(s\) \['batch_sizes'\]"),
    ({"logit_tokens": [3]}, ArgumentError, "targets="),
    ({"remote": True}, ConfigMismatchError, "no remote=, no qk_heads="),
])
def test_a_bad_option_of_the_traced_call_raises_at_the_call(tiny, options, error, match):
    """``attribute(rm, tracer=tracer, **options)`` checks its options at the call, in the trace body, before the
    recorder starts or the body goes on (the same named errors as a prompt's call; remotely they are raised before
    the request is sent: tests/test_remote.py); the model traces normally afterwards."""
    model, bundle, ids, clean = tiny
    reached: list[bool] = []
    with pytest.raises(error, match=match), model.trace(ids) as tracer:
        bundle.replace()
        attribute(bundle, tracer=tracer, **options)
        reached.append(True)
    assert reached == []
    with model.trace(ids) as tracer:  # nothing left recording: a traced pass attributes as before
        bundle.replace()
        handle = attribute(bundle, tracer=tracer, batch_size=40)
    same_graph(handle.graph, clean)


@pytest.mark.parametrize("device,dtype,bound", [
    *[pytest.param(d, torch.float32, 1e-5) if isinstance(d, str) else pytest.param(*d.values, torch.float32, 1e-5,
                                                                                   marks=d.marks) for d in DEVICES],
    pytest.param("cpu", torch.bfloat16, 0.3),  # measured 0.13: bf16 demeaned logits (~0.3) carry the logits' rounding
])
def test_on_devices_and_dtypes(device, dtype, bound):
    """The tiny model on a device (CUDA where torch sees one) or in bf16: unedited, the traced graph is the
    cached engine's graph of the same model (same nodes); a Lorsa head ablated at the last position is
    marked, rows sum (the dtype's bound, as tests/attribution/test_devices_dtypes.py) and the logits are the
    trace's within 3× the gap the unmodified model shows between its clean graph's logits and its own (bf16:
    the model's rounding; ``bound`` caps that gap)."""
    model, hf, lorsas, tcs = attribution_setup("llama")
    hf.to(device=device, dtype=dtype)
    for m in [*lorsas.values(), *tcs.values()]:
        m.to(device=device, dtype=dtype)
    bundle = rm(model, lorsas, tcs)
    ids = random_ids(1, 8, seed=7)[0]
    cached = attribute(bundle, cache_for_attribution(bundle, ids), batch_size=40)
    with model.trace(ids) as tracer:
        handle = attribute(bundle, tracer=tracer, batch_size=40)
        clean_logits = nnsight.save(model.lm_head.output)
    assert torch.equal(handle.graph.nodes.index, cached.nodes.index)
    # the unmodified model's own gap between a graph's logits and the trace's (bf16: the model's rounding)
    clean_gap = relative(*demeaned_logits(handle.graph, clean_logits.float().cpu()))
    assert clean_gap < bound
    assert relative(handle.graph.densify().double(), cached.densify().double()) < 1e-5  # the same engine
    n = cached.nodes
    head = int(n.index[(n.kind == LORSA) & (n.pos == 7)][0])
    with model.trace(ids) as tracer:
        bundle.replace()
        handle = attribute(bundle, tracer=tracer, batch_size=40)
        ablate(bundle(LorsaHead(1, head)), positions=7)
        logits = nnsight.save(model.lm_head.output)
    graph = handle.graph
    assert int(graph.nodes.intervened.sum()) == 1
    assert graph.edge_sum_error("mass").max() < (1e-6 if dtype == torch.float32 else 2e-2)
    got, want = demeaned_logits(graph, logits.float().cpu())
    assert relative(got, want) < max(1e-5, 3 * clean_gap)
    if dtype == torch.float32:  # the edit moved them (bf16: within its rounding; checked in fp32)
        assert relative(cached.values[cached.logit_ids].double(), want) > 10 * max(1e-5, 3 * clean_gap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_an_fp32_models_pass_attributed_in_half_precision(tiny, dtype):
    """``attribute(rm, tracer=tracer, dtype=torch.bfloat16 / float16)`` on an fp32 model (a documented setting):
    the graph is built — its logits carry the half-precision rounding (recorded in ``meta["logit_gap"]``), which
    used to be taken for an edit the graph cannot hold (``ConfigMismatchError`` blaming a decoder-layer edit that
    was never made) — its rows sum within that dtype's bound, and the ablated head is marked."""
    model, bundle, ids, clean = tiny
    n = clean.nodes
    head = int(n.index[(n.kind == LORSA) & (n.pos == 7)][0])
    with model.trace(ids) as tracer:
        bundle.replace()
        handle = attribute(bundle, tracer=tracer, batch_size=40, dtype=dtype)
        ablate(bundle(LorsaHead(1, head)), positions=7)
    graph = handle.graph
    assert graph.meta["dtype"] == str(dtype) and int(graph.nodes.intervened.sum()) == 1
    assert float(graph.edge_sum_error("mass").max()) < {torch.bfloat16: 2e-2, torch.float16: 3e-3}[dtype]
    assert 1e-4 < graph.meta["logit_gap"] < 0.3  # half-precision rounding, not an unheld edit

def test_edits_carried_by_error_nodes_and_a_patched_head(tiny):
    """In one trace: an MHSA head of the Lorsa layer ablated and an SAE feature at an MLP output steered —
    carried by that site's error nodes (not marked) — and a Lorsa head patched at one position to a given
    value — marked, at that value. Rows still sum, the logits are the trace's and moved; an SAE feature at a
    site with no error node (a decoder layer's output) is refused at the edit."""
    from helpers import make_sae

    from nnsight_lorsa import ReplacementModel
    from nnsight_lorsa.patching import patch

    model, bundle, ids, clean = tiny
    adapter = bundle.adapter
    saes = {adapter.mlp_path(1): make_sae(seed=1), f"{adapter.layers_path}.1": make_sae(seed=2)}
    r = ReplacementModel(model, lorsas=bundle.lorsas, transcoders=bundle.transcoders, saes=saes)
    n = clean.nodes
    head = int(n.index[(n.kind == LORSA) & (n.pos == 7)][0])
    with model.trace(ids) as tracer:
        r.replace()
        handle = attribute(r, tracer=tracer, batch_size=40)
        ablate(r(MHSAHead(1, 0)))
        patch(r(LorsaHead(1, head)), torch.full((1, 1), 0.5), positions=[7])
        steer(r(Feature(adapter.mlp_path(1), 3)), 2.0)
        logits = nnsight.save(model.lm_head.output)
    graph = handle.graph
    g = graph.nodes
    i = int(g.intervened.nonzero().flatten().item())
    assert (int(g.kind[i]), int(g.layer[i]), int(g.pos[i]), int(g.index[i])) == (LORSA, 1, 7, head)
    assert abs(float(g.activation[i]) - 0.5) < 1e-6
    assert graph.edge_sum_error("mass").max() < 1e-6
    got, want = demeaned_logits(graph, logits)
    assert relative(got, want) < 1e-5
    assert relative(clean.values[clean.logit_ids].double(), want) > 1e-3
    with pytest.raises(ConfigMismatchError, match="no error node"), model.trace(ids) as tracer:
        r.replace()
        attribute(r, tracer=tracer)
        steer(r(Feature(f"{adapter.layers_path}.1", 3)), 1.0)
