"""Attribution graphs: the three exactness checks of issue 4, on tiny random models of several
families and on the trained tinyshakespeare model; engines, budgets, side effects, save/load."""

from __future__ import annotations

import pytest
import torch
from helpers import FAMILIES, TESTS, attention_call_args, attribution_setup, autograd_nodes, head_logits, random_ids, rm

from benchmarks.reference.attribution import attribute_with_hooks
from nnsight_lorsa import LorsaSet, get_adapter
from nnsight_lorsa.assets import default_lorsa_dir
from nnsight_lorsa.attribution import Graph, PruneConfig, attribute, cache_for_attribution
from nnsight_lorsa.attribution.checks import intervention_edges, replacement_logits
from nnsight_lorsa.attribution.engine import build_graph
from nnsight_lorsa.attribution.graph import ATTN_ERROR, BIAS, EMBEDDING, LOGIT, LORSA, MLP_ERROR, TRANSCODER
from nnsight_lorsa.attribution.trace import frozen_sites
from nnsight_lorsa.errors import CheckpointError, ConfigMismatchError, LayerOutOfRangeError, ShapeError


@pytest.fixture(scope="module")
def llama():
    model, hf, lorsas, tcs = attribution_setup("llama")
    ids = random_ids(1, 9, seed=5)[0]
    return model, hf, lorsas, tcs, ids, attribute(rm(model, lorsas, tcs), ids, batch_size=48)


@pytest.mark.parametrize("family", ["llama", "qwen3", "neox", "gpt2", "qwen2", "gemma2", "gemma3", "olmo2",
                                    "phi3", "gemma"])
def test_incoming_edges_sum_to_node_values(family):
    """Check 1: every feature, Lorsa-head and logit node's incoming edges sum to its value."""
    model, _, lorsas, tcs = attribution_setup(family)
    g = attribute(rm(model, lorsas, tcs), random_ids(1, 8, seed=2)[0], batch_size=40)
    kinds = g.nodes.kind[g.feature_rows]
    assert {TRANSCODER, LORSA, LOGIT} <= set(kinds.tolist())
    assert int(g.feature_rows.sum()) == len(g.feature_ids) + len(g.logit_ids)
    # fp32: the residual is rounding in sums whose terms cancel (random biases and gains make
    # Σ|edges| ~1000× a value): tiny relative to the row's mass, and < 1e-4 of the value on average
    assert g.edge_sum_error("mass").max() < 1e-6, family
    assert g.edge_sum_error().median() < 1e-5 and g.edge_sum_error().max() < 1e-3, family
    # the sums are not trivially satisfied: the edges are spread over many sources, biases included
    bias_cols = g.ids_of(BIAS)
    assert len(bias_cols) > 0 and g.densify()[:, bias_cols].abs().sum() > 0
    # values are the model's own feature activations / Lorsa z on the prompt (active nodes)
    feats = g.feature_ids
    assert torch.allclose(g.values[feats], g.nodes.activation[feats], rtol=1e-4, atol=1e-5)


def test_edge_sums_are_exact_up_to_rounding_in_float64():
    """The same graph in fp64: the sums hold to 1e-10 of the value — the fp32 residual is rounding."""
    model, hf, lorsas, tcs = attribution_setup("llama")
    hf.double()
    for m in [*lorsas.values(), *tcs.values()]:
        m.double()
    g = attribute(rm(model, lorsas, tcs), random_ids(1, 8, seed=2)[0], batch_size=40)
    assert g.densify().dtype == torch.float64
    assert g.edge_sum_error().max() < 1e-10


def test_edges_equal_interventions(llama):
    """Check 2: every token/error/bias edge and a random sample of feature edges equal the change of
    the target when the source's contribution is added once more (independent forward passes)."""
    model, _, lorsas, tcs, _, g = llama
    k = g.nodes.kind
    others = ((k == EMBEDDING) | (k == MLP_ERROR) | (k == ATTN_ERROR) | (k == BIAS)).nonzero().flatten()
    feats = g.feature_ids[torch.randperm(len(g.feature_ids), generator=torch.Generator().manual_seed(0))[:24]]
    src = torch.cat([others, feats])
    by_intervention, from_graph = intervention_edges(rm(model, lorsas, tcs), g, src)
    scale = from_graph.abs().max()
    assert scale > 0
    assert (by_intervention - from_graph).abs().max() < 1e-5 * max(1.0, float(scale))
    assert (from_graph != 0).float().mean() > 0.2


def test_replacement_with_errors_reproduces_the_logits(llama):
    """Check 3: the frozen replacement model with its error nodes gives the model's logits."""
    model, hf, lorsas, tcs, ids, _ = llama
    with torch.no_grad():
        ref = hf(ids[None]).logits
    got = replacement_logits(rm(model, lorsas, tcs), ids)
    assert (got - ref).abs().max() < 1e-5


def _graph_checks_2_3(model, hf, lorsas, tcs, ids):
    """The graph of ``ids``; check 2 (edges equal interventions: tokens / errors / biases and 24 sampled features)
    and check 3 (the frozen model with its errors gives the unembedding's output). Returns the graph, the
    replacement's logits and the largest edge checked."""
    g = attribute(rm(model, lorsas, tcs), ids, batch_size=48)
    k = g.nodes.kind
    others = ((k == EMBEDDING) | (k == MLP_ERROR) | (k == ATTN_ERROR) | (k == BIAS)).nonzero().flatten()
    feats = g.feature_ids[torch.randperm(len(g.feature_ids), generator=torch.Generator().manual_seed(0))[:24]]
    by_intervention, from_graph = intervention_edges(rm(model, lorsas, tcs), g, torch.cat([others, feats]))
    scale = float(from_graph.abs().max())
    assert scale > 0 and (by_intervention - from_graph).abs().max() < 1e-5 * max(1.0, scale)
    got = replacement_logits(rm(model, lorsas, tcs), ids)
    assert (got - head_logits(hf, ids[None])).abs().max() < 1e-5
    return g, got, scale


def test_olmo2_graph_is_exact():
    """OLMo-2 (no pre-norms: the attention and the MLP read the residual stream; post-attention / post-feedforward
    RMSNorms; QK-norm over the whole projection): only the post-norms are frozen norm sites; checks 2 and 3; the hook
    engine gives the same graph."""
    model, hf, lorsas, tcs = attribution_setup("olmo2")
    roles = [s.role or s.kind for s in frozen_sites(get_adapter(model)) if s.layer == 0]
    assert roles == ["attention", "attn_post_norm", "mlp", "mlp_post_norm"]
    ids = random_ids(1, 9, seed=5)[0]
    g, _, scale = _graph_checks_2_3(model, hf, lorsas, tcs, ids)
    g2 = attribute_with_hooks(rm(model, lorsas, tcs), ids, batch_size=13)
    assert torch.allclose(g.densify(), g2.densify(), atol=1e-5 * scale)


def test_gemma2_graph_is_exact():
    """Gemma-2 (post-attention / post-feedforward RMSNorms with ``1 + weight`` gains, attention and final logit
    soft-capping, sliding-window layers shorter than the prompt): the post-norms are frozen sites; check 2 (edges
    equal interventions, tokens / errors / biases and sampled features) and check 3 (the frozen model with its
    errors gives the unembedding's output, and through the model's own soft-cap its logits); the hook engine gives
    the same graph; the target tokens' probabilities are the capped logits' (the model's)."""
    model, hf, lorsas, tcs = attribution_setup("gemma2")
    adapter = get_adapter(model)
    roles = [s.role for s in frozen_sites(adapter) if s.layer == 0]
    assert roles == ["attn_norm", "", "attn_post_norm", "mlp_norm", "", "mlp_post_norm"]
    ids = random_ids(1, 9, seed=5)[0]
    g, got, scale = _graph_checks_2_3(model, hf, lorsas, tcs, ids)
    cap = adapter.final_logit_softcap()
    with torch.no_grad():
        logits = hf(ids[None]).logits
    assert cap is not None and (torch.tanh(got / cap) * cap - logits).abs().max() < 1e-5
    assert (got - logits).abs().max() > 1e-3  # the cap bites: the graph's logits are the uncapped ones
    probs = logits[0, -1].softmax(-1)[g.nodes.index[g.logit_ids]]
    assert torch.allclose(g.logit_probs, probs, atol=1e-6)
    g2 = attribute_with_hooks(rm(model, lorsas, tcs), ids, batch_size=13)
    assert torch.allclose(g.densify(), g2.densify(), atol=1e-5 * scale)


def test_nnsight_and_hook_engines_agree(llama):
    model, _, lorsas, tcs, ids, g = llama
    g2 = attribute_with_hooks(rm(model, lorsas, tcs), ids, batch_size=13)
    assert torch.allclose(g.densify(), g2.densify(), atol=1e-5)
    assert torch.equal(g.nodes.kind, g2.nodes.kind)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "olmo2"])
def test_sdpa_frozen_attention_equals_stored_patterns(family, monkeypatch):
    """The long-prompt path (constant queries/keys: SDPA for MHSA, Lorsa pattern rows recomputed in
    chunks of nodes in every pass — several chunks here) gives the same graph (Gemma-2's soft-capped MHSA
    layers keep their patterns: SDPA cannot cap)."""
    import nnsight_lorsa.attribution.frozen as frozen

    monkeypatch.setattr(frozen, "ROW_CHUNK_ELEMENTS", 32 * 8 * 3)
    model, _, lorsas, tcs = attribution_setup(family)
    ids = random_ids(1, 8, seed=4)[0]
    # (patterns, node_vectors): the patterns alone change (the private mixed form of memory=)
    a = build_graph(rm(model, lorsas, tcs), ids, batch_size=32, memory=("store", "auto"))
    b = build_graph(rm(model, lorsas, tcs), ids, batch_size=32, memory=("sdpa", "auto"))
    assert torch.allclose(a.densify(), b.densify(), atol=1e-5 * float(a.densify().abs().max()))
    assert b.edge_sum_error("mass").max() < 1e-6


def test_attribution_leaves_the_model_untouched(llama):
    model, hf, lorsas, tcs, ids, _ = llama
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    with torch.no_grad():
        ref = hf(ids[None]).logits
    attribute(rm(model, lorsas, tcs), ids, batch_size=64)
    assert all(p.grad is None for p in hf.parameters())
    assert all(m._forward_hooks == {} and m._forward_pre_hooks == {} for m in hf.modules())
    assert all(torch.equal(v, before[k]) for k, v in hf.state_dict().items())
    with torch.no_grad():
        assert torch.equal(hf(ids[None]).logits, ref)


def test_max_feature_nodes_keeps_the_most_influential(llama):
    model, _, lorsas, tcs, ids, full = llama
    g = attribute(rm(model, lorsas, tcs), ids, batch_size=8, max_feature_nodes=12)
    assert len(g.feature_ids) == 12
    # logit rows do not depend on the budget (same sources, same edges)
    cols = g.layout_ids
    full_logits = full.densify()[full.logit_ids]
    full_cols = {int(c): i for i, c in enumerate(full.layout_ids)}
    assert torch.allclose(g.densify()[g.logit_ids], full_logits[:, [full_cols[int(c)] for c in cols]], atol=1e-6)
    # the first pick (after the logit rows) is the feature with the largest direct influence on the logits
    direct = (full.densify()[full.logit_ids].abs() / full.densify()[full.logit_ids].abs().sum(1, keepdim=True))
    top = int((full.logit_probs @ direct)[full.feature_ids].argmax())
    assert int(full.layout_ids[full.feature_ids[top]]) in set(g.layout_ids.tolist())


def test_a_feature_budget_keeps_every_row_summing_to_its_value(llama):
    """With ``max_feature_nodes`` below the active features, edges from features never visited are not nodes:
    their exact sum is the row's residual, so Σ edges + residual = value (was: silently dropped, rows off
    by up to 24 % of their mass on this model)."""
    model, _, lorsas, tcs, ids, full = llama
    g = attribute(rm(model, lorsas, tcs), ids, batch_size=8, max_feature_nodes=12)
    assert len(g.feature_ids) < len(full.feature_ids)
    assert float(g.edge_sum_error("mass").max()) < 1e-5
    assert float(full.edge_sum_error("mass").max()) < 1e-5
    assert g.residual is not None and float(g.residual.abs().max()) > 1e-4  # edges were dropped, and kept count


def test_custom_logit_tokens_and_progress(llama):
    model, _, lorsas, tcs, ids, _ = llama
    g = attribute(rm(model, lorsas, tcs), ids, targets=[3, 7], progress=True)
    assert g.nodes.index[g.logit_ids].tolist() == [3, 7]
    assert g.edge_sum_error("mass").max() < 1e-6


def test_bad_input_raises_before_running(llama):
    model, hf, lorsas, tcs, ids, _ = llama
    with pytest.raises(LayerOutOfRangeError):
        attribute(rm(model, {7: lorsas[1]}), ids)
    with pytest.raises(ConfigMismatchError, match="batch_size"):
        attribute(rm(model), ids, batch_size=0)
    with pytest.raises(TypeError, match="engine"):  # the engine follows from the input
        attribute(rm(model), ids, engine="hooks")
    with pytest.raises(ConfigMismatchError, match="memory"):
        attribute(rm(model), ids, memory="dense")
    with pytest.raises(ConfigMismatchError, match="patterns"):
        build_graph(rm(model), ids, memory=("dense", "grid"))
    with pytest.raises(ConfigMismatchError, match="node_threshold"):
        attribute(rm(model), ids, prune=PruneConfig(node_threshold=1.5))
    with pytest.raises(ShapeError):
        attribute(rm(model), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ConfigMismatchError, match="logit tokens"):
        attribute(rm(model), ids, targets=[10_000])
    with pytest.raises(ConfigMismatchError, match="mapping"):
        attribute(rm(model, transcoders=[tcs[0]]), ids)


def test_graph_save_load_round_trip(llama, tmp_path):
    *_, g = llama
    g.save(tmp_path / "g")
    h = Graph.load(tmp_path / "g")
    assert torch.equal(h.densify(), g.densify()) and h.nodes.bias_names == g.nodes.bias_names
    assert torch.equal(h.layout_ids, g.layout_ids) and h.meta == g.meta
    assert h.nodes.label(int(h.ids_of(BIAS)[0])).startswith("bias ")
    (tmp_path / "g" / "graph.json").write_text('{"format": "other"}')
    with pytest.raises(CheckpointError, match="format"):
        Graph.load(tmp_path / "g")
    with pytest.raises(CheckpointError, match="missing"):
        Graph.load(tmp_path / "nothing")


def test_trained_model_graph_is_exact():
    """The trained tinyshakespeare Llama with its trained Lorsa (layer 2): edges sum to values."""
    from nnsight_lorsa.envoy import load_model

    model = load_model()
    lorsas = LorsaSet.from_pretrained(model, default_lorsa_dir())
    g = attribute(rm(model, lorsas), "ROMEO:\nBut soft, what light", batch_size=64)
    assert g.summary()["lorsa_heads"] > 0
    assert g.edge_sum_error().max() < 1e-4  # relative to each node's value, fp32


@pytest.mark.parametrize("family", ["llama", "qwen3", "neox", "olmo2", "phi3"])
def test_qk_pairs_sum_to_the_attention_score(family):
    """QK attribution: node pairs sum to the Lorsa head's score, which is the Lorsa's own q·k/scale."""
    from nnsight_lorsa.attribution.qk import qk_attribution

    model, hf, lorsas, tcs = attribution_setup(family)
    hf.double()
    for m in [*lorsas.values(), *tcs.values()]:
        m.double()
    ids = random_ids(1, 8, seed=2)[0]
    r = qk_attribution(rm(model, lorsas, tcs), ids, layer=1, head=37, query_pos=6, key_pos=2)
    adapter = get_adapter(model)
    args, kwargs = attention_call_args(hf, adapter, 1, ids[None])
    x = adapter.attention_input(args, kwargs)
    lor = lorsas[1]
    with torch.no_grad():
        q, k = lor.qk(x, adapter.attention_positions(args, kwargs, x))
    g = 37 // lor.cfg.group_size
    ref = float(q[0, g, 6] @ k[0, g, 2]) / lor.cfg.scale
    # the Lorsa's own QK-norm runs in fp32 (as transformers'), hence 1e-6 against it
    assert abs(r.score - ref) < 1e-6 * max(1.0, abs(ref))
    assert abs(float(r.pairs.sum()) - r.score) < 1e-10 * max(1.0, float(r.pairs.abs().sum()))
    # nodes after the query/key positions or at later layers contribute nothing
    late = (r.nodes.pos > 6) | (r.nodes.layer >= 1) & (r.nodes.kind != BIAS)
    assert r.query[:-1][late].abs().max() == 0
    assert r.query_marginal.shape == (len(r.nodes) + 1,) and len(r.top_pairs(5)) == 5


def test_qk_attribution_bad_input():
    from nnsight_lorsa.attribution.qk import qk_attribution

    model, _, lorsas, tcs = attribution_setup("llama")
    ids = random_ids(1, 6, seed=2)[0]
    with pytest.raises(LayerOutOfRangeError, match="no Lorsa"):
        qk_attribution(rm(model, lorsas), ids, layer=0, head=0, query_pos=3, key_pos=1)
    with pytest.raises(ShapeError, match="key_pos"):
        qk_attribution(rm(model, lorsas), ids, layer=1, head=0, query_pos=1, key_pos=3)
    with pytest.raises(ShapeError, match="head"):
        qk_attribution(rm(model, lorsas), ids, layer=1, head=10_000, query_pos=3, key_pos=1)


def test_prune_and_scores(llama):
    from nnsight_lorsa.attribution import graph_scores, prune

    *_, g = llama
    pr = prune(g)
    kind = g.nodes.kind
    assert pr.node_mask[(kind == EMBEDDING) | (kind == LOGIT) | (kind == BIAS)].all()
    kept_features = pr.node_mask & ((kind == TRANSCODER) | (kind == LORSA))
    assert 0 < int(kept_features.sum()) < len(g.feature_ids)
    # kept edges join kept nodes, and every kept feature has an incoming and an outgoing kept edge
    t, s = pr.edge_mask.nonzero(as_tuple=True)
    assert pr.node_mask[t].all() and pr.node_mask[s].all()
    f = kept_features.nonzero().flatten()
    assert pr.edge_mask[f].any(1).all() and pr.edge_mask[:, f].any(0).all()
    looser = prune(g, node_threshold=0.95, edge_threshold=0.99)
    assert looser.node_mask.sum() >= pr.node_mask.sum()
    replacement, completeness = graph_scores(g)
    assert 0 < replacement < 1 and 0 < completeness <= 1
    with pytest.raises(ValueError, match="node_threshold"):
        prune(g, node_threshold=1.5)


def test_circuit_metrics_match_single_ablations(llama):
    from nnsight_lorsa import TranscoderSet
    from nnsight_lorsa.attribution import circuit_metrics, prune
    from nnsight_lorsa.attribution.checks import spearman
    from nnsight_lorsa.patching import Feature, LorsaHead, ReplacementModel, ablate

    model, hf, lorsas, tcs, ids, g = llama
    lset, tset = LorsaSet(model, lorsas), TranscoderSet(model, tcs)
    pr = prune(g)
    cm = circuit_metrics(rm(model, lset, tset), g, pr)
    assert len(cm.effects) == len(cm.nodes) > 0
    token = int(g.nodes.index[g.logit_ids[g.logit_probs.argmax()]])
    with torch.no_grad():
        base = hf(ids[None]).logits[0, -1]
    assert abs(cm.baseline - float(base[token] - base.mean())) < 1e-4
    # the first node's single-ablation effect, recomputed by hand with the patching API
    i = int(cm.nodes[0])
    n = g.nodes
    target = LorsaHead(int(n.layer[i]), int(n.index[i])) if int(n.kind[i]) == LORSA else \
        Feature(int(n.layer[i]), int(n.index[i]), "transcoder")
    r = ReplacementModel(model, lorsas=lset, transcoders=tset)
    with torch.no_grad(), model.trace(ids[None]):
        r.prepare([target])
        ablate(r(target), positions=int(n.pos[i]))
        last = model.lm_head.output[0, -1].save()
    assert abs(float(cm.effects[0]) - (cm.baseline - float(last[token] - last.mean()))) < 1e-4
    assert cm.completeness == pytest.approx(1 - cm.ablated / cm.baseline)
    assert spearman(torch.tensor([1.0, 2, 3, 4]), torch.tensor([10.0, 20, 30, 40])) == pytest.approx(1.0)
    assert spearman(torch.tensor([1.0, 2, 3, 4]), torch.tensor([4.0, 3, 2, 1])) == pytest.approx(-1.0)


def test_graph_plot(llama, tmp_path):
    from nnsight_lorsa.attribution import prune
    from nnsight_lorsa.viz.graph_plot import plot_graph

    *_, g = llama
    fig = plot_graph(g, prune(g), path=tmp_path / "g.png")
    assert (tmp_path / "g.png").stat().st_size > 10_000
    assert len(fig.axes[0].collections) >= 3  # one scatter per node kind present


@pytest.mark.parametrize("skip", [False, True])
def test_cross_layer_transcoder_graph_is_exact(skip):
    """A CLT's features write into every later MLP: one node each, edges still sum to values, and
    the replacement model with errors is the model."""
    from nnsight_lorsa.modules.clt import CLTConfig, CrossLayerTranscoder

    model, hf, lorsas, _ = attribution_setup("llama")
    clt = CrossLayerTranscoder(CLTConfig(d_in=64, d_sae=96, n_layers=3, activation="topk",
                                         activation_params={"k": 5}, skip=skip))
    g_ = torch.Generator().manual_seed(1)
    with torch.no_grad():
        clt.b_dec.copy_(0.1 * torch.randn(clt.b_dec.shape, generator=g_))
        clt.b_enc.copy_(0.1 * torch.randn(clt.b_enc.shape, generator=g_))
        if skip:
            clt.W_skip.copy_(0.05 * torch.randn(clt.W_skip.shape, generator=g_))
    ids = random_ids(1, 7, seed=3)[0]
    g = attribute(rm(model, lorsas, clt), ids, batch_size=32)
    assert g.summary()["features"] == 3 * 7 * 5
    assert g.edge_sum_error("mass").max() < 1e-6 and g.edge_sum_error().median() < 1e-5
    # a layer-0 feature's direct effect on a layer-2 feature includes its layer-2 decoder write
    src = g.ids_of(TRANSCODER)[g.nodes.layer[g.ids_of(TRANSCODER)] == 0]
    by_intervention, from_graph = intervention_edges(rm(model, lorsas, clt), g, src[:6])
    assert (by_intervention - from_graph).abs().max() < 1e-5 * max(1.0, float(from_graph.abs().max()))
    with torch.no_grad():
        ref = hf(ids[None]).logits
    assert (replacement_logits(rm(model, lorsas, clt), ids) - ref).abs().max() < 1e-5
    # the cross-layer writes are in the edges: silencing layer 0's decoders into layers 1-2 changes
    # the edges out of layer-0 features (into later features and logits), not the edges into them
    with torch.no_grad():
        clt.W_dec(0)[:, 1:] = 0
    h = attribute(rm(model, lorsas, clt), ids, batch_size=32)
    logits_rows = g.logit_ids
    assert not torch.allclose(g.densify()[logits_rows][:, src], h.densify()[logits_rows][:, src], atol=1e-4)
    assert torch.allclose(g.densify()[src], h.densify()[src], atol=1e-5)



def test_cross_layer_transcoder_views_copy_and_place_as_one_module():
    """A CLT is seen by attribution as one ``CLTLayer`` view per layer (``CLTSet.by_layer``, no kind test):
    ``dtype=`` copies the views into one shared copy of the CLT (the user's stays untouched) and gives the
    fp32 graph to fp32 rounding; a CLT on the meta device is refused by the placement check naming it."""
    from nnsight_lorsa.attribution.replacement import check_placement, copies_in, layer_modules
    from nnsight_lorsa.envoy.nnsight_internals import hf_module
    from nnsight_lorsa.errors import PlacementError
    from nnsight_lorsa.modules.clt import CLTConfig, CLTLayer, CrossLayerTranscoder

    model, _, lorsas, _ = attribution_setup("llama")
    clt = CrossLayerTranscoder(CLTConfig(d_in=64, d_sae=96, n_layers=3, activation="topk",
                                         activation_params={"k": 5}, skip=True))
    with torch.no_grad():
        clt.W_skip.copy_(0.05 * torch.randn(clt.W_skip.shape, generator=torch.Generator().manual_seed(2)))
    r = rm(model, lorsas, clt)
    _, views = layer_modules(r)
    assert sorted(views) == [0, 1, 2] and all(isinstance(v, CLTLayer) and v.clt is clt for v in views.values())
    assert sorted(views[1].decoders(1)) == [1, 2] and torch.equal(views[1].W_enc, clt.W_enc[1])
    copies = copies_in(views, torch.float64)
    assert len({id(c.clt) for c in copies.values()}) == 1 and copies[0].clt is not clt
    assert copies[2].b_dec.dtype == torch.float64 and clt.b_dec.dtype == torch.float32
    ids = random_ids(1, 7, seed=3)[0]
    g32 = attribute(r, ids, batch_size=32)
    g64 = attribute(r, ids, batch_size=32, dtype=torch.float64)
    assert clt.W_enc.dtype == torch.float32
    a, b = g32.densify(), g64.densify().float()
    assert torch.equal(g32.nodes.index, g64.nodes.index)
    assert (a - b).abs().max() <= 1e-5 * float(b.abs().max())
    assert g64.edge_sum_error("mass").max() < 1e-6  # the values come from the fp32 model
    meta = CrossLayerTranscoder(CLTConfig(d_in=64, d_sae=96, n_layers=3), device="meta")  # (CLTSet refuses it
    with pytest.raises(PlacementError, match="transcoder at layer 0 is on meta"):  # too; the check itself:)
        check_placement(hf_module(model), {}, meta.by_layer())


REMOTE_LOCAL_ATTRIBUTION = r"""
import sys, torch, nnsight
import nnsight_lorsa
from helpers import random_ids, tiny_nnsight
from helpers import attribution_setup, make_transcoders
from helpers import make_lorsa
from nnsight_lorsa import ReplacementModel, get_adapter
from nnsight_lorsa.attribution import attribute, cache_for_attribution
from nnsight_lorsa.attribution.engine import build_graph
model, hf = tiny_nnsight(sys.argv[1])
lorsas = {1: make_lorsa(hf, get_adapter(model), 1)}
tcs = make_transcoders((0, 2))
r = ReplacementModel(model, lorsas=lorsas, transcoders=tcs)
ids = random_ids(1, 7, seed=5)[0]
local = attribute(r, ids, batch_size=32)
nnsight.register(nnsight_lorsa)
remote = attribute(r, ids, batch_size=32, remote="local")
# the clean pass serialized and run back, the graph built here from its cache: the local cached graph bit for bit,
# the traced one to rounding
here = attribute(r, cache_for_attribution(r, ids), batch_size=32)
assert torch.equal(here.densify(), remote.densify()), (here.densify() - remote.densify()).abs().max()
assert torch.allclose(local.densify(), remote.densify(), atol=1e-5), (local.densify() - remote.densify()).abs().max()
gathered = build_graph(r, ids, batch_size=32, memory=("auto", "gather"), remote="local")
assert torch.allclose(gathered.densify(), local.densify(), atol=1e-5), (gathered.densify() - local.densify()).abs()
assert torch.equal(local.nodes.kind, remote.nodes.kind)
cache = cache_for_attribution(r, ids, remote="local")
cached = attribute(ReplacementModel(hf, lorsas=lorsas, transcoders=tcs), cache, batch_size=32)
assert torch.allclose(cached.densify(), local.densify(), atol=1e-5), (cached.densify() - local.densify()).abs()
print("ok", int(remote.feature_rows.sum()))
"""


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_attribution_under_nnsight_remote_local_simulation(family):
    """The clean pass serialized by nnsight (our code by value) and run back, the graph built here from its cache:
    the local cached graph bit for bit, the traced one to 1e-5 (Gemma-2: its adapter and post-norm sites travel
    too). In a fresh interpreter: the test-time type-checking wrappers are
    not picklable."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    done = subprocess.run([sys.executable, "-c", REMOTE_LOCAL_ATTRIBUTION, family], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith("ok")


def test_pruned_while_built_equals_dense_pruning(llama):
    """prune=: the graph assembled from sparse rows keeps exactly the nodes dense pruning keeps,
    with the same edges among them; the edges of dropped nodes go into the residual, so the sums
    still hold; dropping small entries (keep_mass < 1) moves them into the residual too."""
    from nnsight_lorsa.attribution import prune

    model, _, lorsas, tcs, ids, full = llama
    pr = prune(full)
    g = attribute(rm(model, lorsas, tcs), ids, batch_size=48, prune=(0.8, 0.98))
    assert torch.equal(g.layout_ids, full.layout_ids[pr.node_mask])
    keep = pr.node_mask.nonzero().flatten()
    assert torch.allclose(g.densify(), full.densify()[keep][:, keep], atol=1e-6)
    assert g.residual.abs().sum() > 0
    assert g.edge_sum_error("mass").max() < 1e-6 and g.edge_sum_error().median() < 1e-5
    h = attribute(rm(model, lorsas, tcs), ids, batch_size=48, prune=PruneConfig(0.8, 0.98, keep_mass=0.9))
    assert h.meta["pruned"]["stored_entries"] < 0.7 * g.meta["pruned"]["stored_entries"]
    assert h.edge_sum_error("mass").max() < 1e-6
    with pytest.raises(ConfigMismatchError, match="keep_mass"):
        attribute(rm(model), ids, prune=PruneConfig(0.8, 0.98, keep_mass=0.0))


def test_position_slots_take_groups_in_any_order():
    """``PositionSlots`` over unsorted group ids (a Lorsa head's OV index) writes and reads like a loop."""
    from nnsight_lorsa.attribution.frozen import PositionSlots

    g = torch.Generator().manual_seed(0)
    groups = torch.tensor([3, 0, 3, 1, 0, 3, 2])
    slots = PositionSlots(groups, 5)
    vec = torch.randn(7, 6, generator=g)
    coeff = torch.randn(2, 7, generator=g)
    x = torch.randn(2, 5, 6, generator=g)
    grid = slots.grid(vec)
    want = torch.zeros(2, 5, 6).index_add(1, groups, coeff[:, :, None] * vec[None])
    assert torch.allclose(slots.write(coeff, grid), want, atol=1e-6)
    assert torch.allclose(slots.read(x, grid), (x[:, groups] * vec[None]).sum(-1), atol=1e-6)


def test_position_slots_filled_in_order_are_the_vectors_themselves():
    """Nodes that fill the grid in order (a TopK coder: ``k`` per position, sorted) use the vectors as the grid,
    with no scatter or gather: the same writes, reads and gradients, bit for bit, as the scattered grid."""
    from nnsight_lorsa.attribution.frozen import PositionSlots

    g = torch.Generator().manual_seed(1)
    pos = torch.arange(4).repeat_interleave(3)
    fast, slow = PositionSlots(pos, 4), PositionSlots(pos, 4)
    slow.identity = False  # the general path: zero grid, scatter, gather
    assert fast.identity and not PositionSlots(pos.flip(0), 4).identity
    assert not PositionSlots(torch.tensor([0, 0, 1, 2, 2]), 3).identity  # uneven groups: padded
    vec = torch.randn(12, 5, generator=g)
    coeff = torch.randn(2, 12, generator=g, requires_grad=True)
    x = torch.randn(2, 4, 5, generator=g, requires_grad=True)
    outs = []
    for slots in (fast, slow):
        grid = slots.grid(vec)
        w, r = slots.write(coeff, grid), slots.read(x, grid)
        outs.append((grid, w, r, *torch.autograd.grad((w * w).sum() + (r * r).sum(), (coeff, x))))
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def test_objective_injects_only_the_targeted_sites(llama):
    """``FrozenReplacement.objective`` (backward from the targeted sites only) gives the same
    gradient as injecting through all targets, and a batch of lowest-layer targets never reaches
    the unembedding."""
    from benchmarks.reference.attribution import install_frozen_hooks
    from nnsight_lorsa.attribution.replacement import FrozenReplacement
    from nnsight_lorsa.attribution.trace import prepare

    model, hf, lorsas, tcs, ids, _ = llama
    prepared = prepare(rm(model, lorsas, tcs), ids)
    layout, mhsa, adapter = prepared.layout, prepared.mhsa, prepared.adapter
    M = torch.ones(4, layout.n_sources, requires_grad=True)
    frozen = FrozenReplacement(layout, M, mhsa)
    handles = install_frozen_hooks(hf, adapter, frozen)
    try:
        hf(layout.tokens[None].expand(4, -1), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    T = frozen.targets()
    n0 = frozen.target_pieces()[0].shape[1]
    for rows in ([0, n0 - 1, n0, layout.n_targets - 1], [1, 2, 0, 1]):
        ref = torch.autograd.grad(T[torch.arange(4), torch.tensor(rows)].sum(), M, retain_graph=True)[0]
        got = torch.autograd.grad(frozen.objective(rows), M, retain_graph=True)[0]
        assert torch.equal(got, ref)
    seen = autograd_nodes(frozen.objective([0, 1, 2, 3]).grad_fn)
    assert frozen.target_pieces()[-1].grad_fn not in seen  # the logits' graph is not traversed
    with pytest.raises(IndexError):
        frozen.objective([layout.n_targets])


def test_gathered_node_vectors_equal_the_grid(monkeypatch):
    """Gathered node vectors (rows gathered chunk by chunk in every pass, a custom autograd
    function; ``memory="lean"``'s) give the grid's graph — transcoders, a Lorsa and a CLT — and their
    own edges still sum. The node vectors alone change (the private mixed form of ``memory=``)."""
    import nnsight_lorsa.attribution.frozen as frozen
    from nnsight_lorsa.modules.clt import CLTConfig, CrossLayerTranscoder

    monkeypatch.setattr(frozen, "NODE_CHUNK_ELEMENTS", 32 * 64 * 3)  # several chunks per site
    model, _, lorsas, tcs = attribution_setup("llama")
    ids = random_ids(1, 8, seed=6)[0]
    grid = build_graph(rm(model, lorsas, tcs), ids, batch_size=32, memory=("auto", "grid"))
    gath = build_graph(rm(model, lorsas, tcs), ids, batch_size=32, memory=("auto", "gather"))
    assert torch.allclose(gath.densify(), grid.densify(), atol=1e-5 * float(grid.densify().abs().max()))
    assert gath.edge_sum_error("mass").max() < 1e-6
    clt = CrossLayerTranscoder(CLTConfig(d_in=64, d_sae=96, n_layers=3, activation="topk", activation_params={"k": 5}))
    a = build_graph(rm(model, lorsas, clt), ids, batch_size=32, memory=("auto", "grid"))
    b = build_graph(rm(model, lorsas, clt), ids, batch_size=32, memory=("auto", "gather"))
    assert torch.allclose(a.densify(), b.densify(), atol=1e-5 * float(a.densify().abs().max()))
    with pytest.raises(ConfigMismatchError, match="node_vectors"):
        build_graph(rm(model, lorsas, tcs), ids, memory=("auto", "dense"))


def test_gathered_writes_and_reads_match_the_grid(monkeypatch):
    """Forward and backward of the gathered writer/reader equal the grid's (fp64, several chunks)."""
    import nnsight_lorsa.attribution.frozen as node_io
    from nnsight_lorsa.attribution.frozen import PositionSlots

    monkeypatch.setattr(node_io, "NODE_CHUNK_ELEMENTS", 3 * 5 * 2)
    g = torch.Generator().manual_seed(0)
    W = torch.randn(11, 5, dtype=torch.float64, generator=g)
    idx = torch.tensor([3, 7, 3, 0, 10, 7, 1])
    pos = torch.tensor([0, 0, 1, 2, 2, 2, 4])
    grid = node_io.GridNodes(PositionSlots(pos, 6), PositionSlots(pos, 6).grid(W[idx]))
    gath = node_io.GatheredNodes(W, idx, PositionSlots(pos, 6), torch.float64)
    coeff = torch.randn(3, 7, dtype=torch.float64, generator=g, requires_grad=True)
    x = torch.randn(3, 6, 5, dtype=torch.float64, generator=g, requires_grad=True)
    for fn, inp in ((lambda io: io.write(coeff), coeff), (lambda io: io.read(x), x)):
        out_g, out_h = fn(grid), fn(gath)
        assert torch.allclose(out_g, out_h)
        up = torch.randn(out_g.shape, dtype=torch.float64, generator=g)
        assert torch.allclose(torch.autograd.grad(out_g, inp, up)[0], torch.autograd.grad(out_h, inp, up)[0])
    assert node_io.choose("auto", 10, 8, torch.float32) == "grid"
    assert node_io.choose("auto", 2**20, 4096, torch.bfloat16) == "gather"


@pytest.mark.parametrize("family", ["llama", "qwen3", "neox", "neox_sequential", "gpt2", "qwen2", "gemma2",
                                    "gemma3", "olmo2", "phi3", "gemma"])
def test_attribution_from_a_cache_equals_the_traced_graph(family):
    """``attribute(replacement, cache)``: the frozen model wired as plain tensor code from a cache of
    one clean trace (no model forward) gives the traced graph — sequential and parallel (NeoX)
    residuals, GPT-2's position embeddings; and it runs on the bare Hugging Face model."""
    model, hf, lorsas, tcs = attribution_setup("neox" if family == "neox_sequential" else family)
    if family == "neox_sequential":
        hf.config.use_parallel_residual = False
        for layer in hf.gpt_neox.layers:
            layer.use_parallel_residual = False
    ids = random_ids(1, 8, seed=7)[0]
    traced = attribute(rm(model, lorsas, tcs), ids, batch_size=40)
    cache = cache_for_attribution(rm(model, lorsas, tcs), ids)
    calls = []
    handle = hf.register_forward_hook(lambda *a: calls.append(1))
    try:
        cached = attribute(rm(hf, lorsas, tcs), cache, batch_size=40)
    finally:
        handle.remove()
    assert not calls  # the model's forward never ran
    assert torch.equal(cached.layout_ids, traced.layout_ids)
    assert torch.allclose(cached.densify(), traced.densify(), atol=1e-5 * float(traced.densify().abs().max()))
    assert cached.edge_sum_error("mass").max() < 1e-6


def test_attribution_from_a_bad_cache_raises(llama):
    model, hf, lorsas, tcs, ids, _ = llama
    cache = cache_for_attribution(rm(model, lorsas), ids)  # made without the transcoder layers
    with pytest.raises(ConfigMismatchError, match="mlp_in"):
        attribute(rm(model, lorsas, tcs), cache)
    with pytest.raises(ConfigMismatchError, match="remote"):
        attribute(rm(model, lorsas), cache, remote=True)
    cache.mlp_out[0] = cache.mlp_out[0][:, :-1]
    with pytest.raises(ShapeError, match="mlp_out"):
        attribute(rm(model, lorsas), cache)
    with pytest.raises(ConfigMismatchError, match="memory"):
        attribute(rm(model, lorsas), cache, memory="dense")


def feature_activations(graph: Graph) -> dict[tuple[int, int, int, int], float]:
    """``{(kind, layer, position, feature): activation}`` of a graph's feature nodes."""
    n = graph.nodes
    f = (n.kind == LORSA) | (n.kind == TRANSCODER)
    rows = zip(n.kind[f], n.layer[f], n.pos[f], n.index[f], n.activation[f], strict=True)
    return {(int(k), int(a), int(b), int(c)): float(v) for k, a, b, c, v in rows}


#: the fp32 traced graph of a bf16 model against the one from its cache (linearised at the bf16 forward's stream), as
#: a fraction of the largest edge: where the two streams differ most — Gemma's scaled embeddings and GELU, OLMo-2's
#: norms after each sublayer — the linearisation point, not rounding, decides the gap (measured on seed 7: Gemma
#: 4.4e-3, Gemma-2 4.8e-3, Gemma-3 3.8e-3, OLMo-2 1.4e-2, where the bf16 graph itself is as far from the cache's:
#: 0.9-2.4x; Llama 6.7e-4, the others 3.4e-4-1.8e-3, the bf16 graph 15-180x farther)
STREAM_GAP = {"gemma": 1e-2, "gemma2": 1e-2, "gemma3": 1e-2, "olmo2": 3e-2}


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_models_traced_and_exact_from_a_cache_in_fp32(family):
    """A bf16 model: the traced graph runs (biased families used to mix fp32 bias terms into bf16
    attention) with sums to ~1 % of a row's mass; ``dtype=torch.float32`` — traced (nnsight and
    hooks) or from a cache — computes the same model's graph with sums exact to fp32 rounding, on
    copies (the user's modules stay bf16), its nodes the bf16 graph's (on the newer families up to
    1 % of the features, at a selection boundary: the fp32 copies encode the bf16 stream). The traced
    fp32 graph is the cache's to :data:`STREAM_GAP` of the largest edge (3e-3 elsewhere) and, where
    the bf16 graph has the same nodes and rounding dominates, 3x nearer to it than the bf16 graph."""
    model, hf, lorsas, tcs = attribution_setup(family)
    hf.to(torch.bfloat16)
    for m in [*lorsas.values(), *tcs.values()]:
        m.to(torch.bfloat16)
    ids = random_ids(1, 8, seed=7)[0]
    traced = attribute(rm(model, lorsas, tcs), ids, batch_size=40)
    assert traced.edge_sum_error("mass").max() < 5e-2
    cache = cache_for_attribution(rm(model, lorsas, tcs), ids)
    exact = attribute(rm(model, lorsas, tcs), cache, batch_size=40, dtype=torch.float32)
    assert exact.densify().dtype == torch.float32 and exact.edge_sum_error("mass").max() < 1e-6
    assert exact.edge_sum_error("mass").max() < traced.edge_sum_error("mass").max() / 100
    if family in ("llama", "neox", "gpt2", "qwen2"):
        assert torch.equal(exact.layout_ids, traced.layout_ids)
    else:  # the fp32 copies select features from the bf16 stream: those at a selection boundary may differ (Phi-3,
        # seed 7: 4 of 855 — two JumpReLU features at 0.0501 against the threshold 0.05, a Lorsa top-k swap)
        ours, theirs = feature_activations(exact), feature_activations(traced)
        differ = set(ours) ^ set(theirs)
        assert len(differ) <= 0.01 * len(ours), {f: {**theirs, **ours}[f] for f in differ}
    # the traced path in fp32 too (both engines): exact sums, and the cache's graph up to where the
    # two linearise (the traced one at its own fp32 stream, the cache at the bf16 forward's): ~1e-3 of
    # the largest edge, against 1e-2–1e-1 for the bf16 graph
    scale = float(exact.densify().abs().max())
    same_nodes = traced.densify().shape == exact.densify().shape
    for engine, run in (("nnsight", attribute), ("hooks", attribute_with_hooks)):
        fp32 = run(rm(model, lorsas, tcs), ids, batch_size=40, dtype=torch.float32)
        assert fp32.edge_sum_error("mass").max() < 1e-6, engine
        gap = float((fp32.densify() - exact.densify()).abs().max())
        assert gap < STREAM_GAP.get(family, 3e-3) * scale, (engine, gap / scale)
        if same_nodes and family not in STREAM_GAP:
            assert gap < float((traced.densify() - exact.densify()).abs().max()) / 3, engine
    assert all(p.dtype == torch.bfloat16 for m in [hf, *lorsas.values(), *tcs.values()] for p in m.parameters())


def test_every_engine_computes_an_fp64_graph_of_an_fp32_model_in_fp64():
    """``dtype=torch.float64`` on an fp32 model: the nnsight engine, the hook reference and the cached engine all
    store fp64 edges whose sums are exact to fp64 rounding (the hook reference accumulated its edges in fp32: 1e-7
    of the mass); the two traced engines agree to fp64 rounding, the cached one (linearised at the fp32 forward's
    stream, the cache's) to fp32's."""
    model, _, lorsas, tcs = attribution_setup("llama")
    ids = random_ids(1, 8, seed=7)[0]
    r = rm(model, lorsas, tcs)
    graphs = {"nnsight": attribute(r, ids, batch_size=40, dtype=torch.float64),
              "hooks": attribute_with_hooks(r, ids, batch_size=40, dtype=torch.float64),
              "cache": attribute(r, cache_for_attribution(r, ids), batch_size=40, dtype=torch.float64)}
    for engine, g in graphs.items():
        assert g.coo()[2].dtype == torch.float64 and g.edge_sum_error("mass").max() < 1e-12, engine
    scale = float(graphs["nnsight"].densify().abs().max())
    for engine, bound in (("hooks", 1e-12), ("cache", 1e-6)):
        assert float((graphs[engine].densify() - graphs["nnsight"].densify()).abs().max()) < bound * scale, engine

def test_attribute_inside_a_trace_body_names_what_to_do(llama):
    """``attribute`` / ``estimate_memory`` run their own traces: inside a trace body they raise our
    TraceOrderError (was nnsight's ``AttributeError: 'NoneType' object has no attribute 'event'``), and the
    model is left as it was; inside ``model.session()`` they work."""
    from helpers import module_state

    from nnsight_lorsa.attribution import estimate_memory
    from nnsight_lorsa.errors import TraceOrderError

    model, hf, lorsas, tcs, ids, full = llama
    before = module_state(hf)
    for fn in (attribute, estimate_memory):
        with pytest.raises(TraceOrderError, match=rf"{fn.__name__}\(replacement, prompt\) runs its own traces"), \
                model.trace(ids[None]):
            fn(rm(model, lorsas, tcs), ids)
    assert module_state(hf) == before
    graphs = []
    with model.session():
        graphs.append(attribute(rm(model, lorsas, tcs), ids, batch_size=64))
    assert torch.equal(graphs[0].densify(), full.densify())
