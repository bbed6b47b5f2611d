"""Attribution of circuit-tracer transcoders / CLTs that do not read and write the MLP module's call
(``nnsight_lorsa.formats.hook_sites.mlp_site_io``): ``hook_resid_mid`` (the pre-MLP norm's input),
``ln2.hook_normalized`` on an RMSNorm with a gain (``x / rms(x)`` before the gain) and, on Gemma-2/3, ``hook_mlp_out``
(``post_feedforward_layernorm``'s output). The graphs are exact, their feature values are the activations ``replace()``
computes, an ``ln2.hook_normalized`` transcoder's graph is that of the MLP-call transcoder with the gain folded into its
encoder, and edges equal an independent autograd Jacobian of a hand-frozen Hugging Face model."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from helpers import (
    assert_same_nodes,
    circuit_tracer_hooked,
    head_logits,
    make_clt,
    make_transcoder,
    random_ids,
    rm,
    tiny_nnsight,
)

from nnsight_lorsa import CLTSet, TranscoderSet, get_adapter
from nnsight_lorsa.adapters.base import norm_gain
from nnsight_lorsa.attribution import attribute, cache_for_attribution
from nnsight_lorsa.attribution.graph import EMBEDDING, TRANSCODER, Graph
from nnsight_lorsa.errors import UnsupportedArchitectureError

LAYERS = (0, 2)
NORMALIZED, RESID_MID = "ln2.hook_normalized", "hook_resid_mid"
CASES = [("llama", NORMALIZED, "mlp.hook_out"), ("llama", RESID_MID, "mlp.hook_out"),
         ("gpt2", RESID_MID, "hook_mlp_out"), ("gemma2", NORMALIZED, "hook_mlp_out"),
         ("gemma2", RESID_MID, "hook_mlp_out"),
         ("gemma3", RESID_MID, "hook_mlp_out"), ("gemma3", NORMALIZED, "hook_mlp_out"),
         ("olmo2", RESID_MID, "hook_mlp_out"), ("gpt2", NORMALIZED, "hook_mlp_out"),
         ("neox", NORMALIZED, "mlp.hook_out")]


def _transcoders(model: Any, kind: str, hooks: tuple[str, str]) -> Any:
    """A per-layer set (a plain transcoder at layer 0, a skip transcoder at layer 2) or a 3-layer CLT."""
    if kind == "clt":
        return CLTSet(model, circuit_tracer_hooked(make_clt(), *hooks))
    return TranscoderSet(model, {0: circuit_tracer_hooked(make_transcoder(skip=False, seed=3), *hooks),
                                 2: circuit_tracer_hooked(make_transcoder(skip=True, seed=4), *hooks)})


def _replace_acts(model: Any, tcs: Any, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """``{layer: (pos, d_sae)}`` the features ``replace()`` computes on ``ids`` (``error=True``: the model's pass)."""
    layers = list(range(3)) if isinstance(tcs, CLTSet) else list(LAYERS)
    saved: list = []  # filled inside the trace (objects from outside keep what is appended)
    with model.trace(ids[None]):
        if isinstance(tcs, CLTSet):
            env = tcs.replace(error=True)
            for layer in layers:
                saved.append(env.hook_sae_acts_post[layer].output.save())
        else:
            sites = {layer: tcs.replace(layer, error=True) for layer in layers}
            for layer in layers:
                saved.append(sites[layer].hook_sae_acts_post.output.save())
    return {layer: a[0].detach() for layer, a in zip(layers, saved, strict=True)}


def _graph_acts(g: Any, layer: int, like: torch.Tensor, values: bool = False) -> torch.Tensor:
    """The graph's transcoder nodes of ``layer`` as a dense ``like``-shaped ``(pos, d_sae)`` tensor: their activations
    (layout), or with ``values`` their values (the frozen pass's targets)."""
    ids = g.ids_of(TRANSCODER)
    ids = ids[g.nodes.layer[ids] == layer]
    out = torch.zeros_like(like)
    src = g.values[ids] if values else g.nodes.activation[ids]
    out[g.nodes.pos[ids], g.nodes.index[ids]] = src.to(out.dtype)
    return out


@pytest.mark.parametrize("kind", ["tc", "clt"])
@pytest.mark.parametrize(("family", "hook_in", "hook_out"), CASES)
def test_graphs_of_transcoders_read_and_written_off_the_mlp_call_are_exact(family: str, hook_in: str,
                                                                           hook_out: str, kind: str) -> None:
    """(fp32) every computed row's edges sum to its value; the logit nodes' values are the model's demeaned logits;
    the feature nodes (their activations and the frozen pass's values) are exactly the features ``replace()`` computes
    where the file says the transcoder reads (not the MLP input); the cached engine gives the same graph."""
    model, hf = tiny_nnsight(family)
    ids = random_ids(1, 8, seed=2)[0]
    tcs = _transcoders(model, kind, (hook_in, hook_out))
    adapter = get_adapter(model)
    io = tcs.site(LAYERS[0]) if kind == "tc" else tcs.site()
    if family == "olmo2":  # no pre-MLP norm: hook_resid_mid is the MLP's input; the output is the post-norm's
        assert io.input_paths[0] == adapter.mlp_path(0) and io.site_paths[0] == adapter.mlp_post_norm_path(0)
    else:
        assert adapter.mlp_path(0) not in io.input_paths  # not the MLP call: the new path
    r = rm(model, None, tcs)
    g = attribute(r, ids, batch_size=40)
    assert g.edge_sum_error("mass").max() < 1e-5
    logits = head_logits(hf, ids[None])[0, -1]
    want = logits[g.nodes.index[g.logit_ids]] - logits.mean()
    assert torch.allclose(g.values[g.logit_ids], want, rtol=1e-5, atol=1e-5)
    acts = _replace_acts(model, tcs, ids)
    for layer, a in acts.items():
        assert (a != 0).sum() > 0
        assert torch.allclose(_graph_acts(g, layer, a), a, rtol=1e-5, atol=1e-6), layer
        assert torch.allclose(_graph_acts(g, layer, a, values=True), a, rtol=1e-4, atol=1e-5), layer
    cached = attribute(r, cache_for_attribution(r, ids), batch_size=40)
    assert torch.equal(cached.layout_ids, g.layout_ids)
    assert torch.allclose(cached.densify(), g.densify(), atol=1e-5 * float(g.densify().abs().max()))


def test_normalized_transcoder_graph_equals_the_mlp_call_transcoder_with_the_gain_folded_in() -> None:
    """Llama: an ``ln2.hook_normalized`` transcoder reads ``x / rms(x)`` before the pre-MLP norm's gain ``g``; the
    MLP-call transcoder with ``W_enc / g`` (per input dimension; ``W_skip`` likewise) reads ``g ⊙ x / rms(x)`` and
    computes the same features: the two graphs have the same nodes and the same edges (and differ without the fold)."""
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    ids = random_ids(1, 8, seed=2)[0]
    normalized = {0: make_transcoder(skip=False, seed=3), 2: make_transcoder(skip=True, seed=4)}
    folded, unfolded = {}, {}
    for layer, tc in normalized.items():
        gain = norm_gain(hf.get_submodule(adapter.mlp_norm_path(layer))).float()
        assert (gain - 1).abs().max() > 0.05  # a gain that matters
        same = make_transcoder(skip=layer == 2, seed=3 if layer == 0 else 4)
        unfolded[layer] = circuit_tracer_hooked(same, "mlp.hook_in", "mlp.hook_out")
        f = make_transcoder(skip=layer == 2, seed=3 if layer == 0 else 4)
        with torch.no_grad():
            f.W_enc.div_(gain[:, None])
            if layer == 2:
                f.W_skip.div_(gain[None, :])
        folded[layer] = circuit_tracer_hooked(f, "mlp.hook_in", "mlp.hook_out")
        circuit_tracer_hooked(tc, NORMALIZED, "mlp.hook_out")
    g = attribute(rm(model, None, TranscoderSet(model, normalized)), ids, batch_size=40)
    h = attribute(rm(model, None, TranscoderSet(model, folded)), ids, batch_size=40)
    assert torch.equal(g.nodes.kind, h.nodes.kind) and torch.equal(g.nodes.pos, h.nodes.pos)
    assert torch.equal(g.nodes.index, h.nodes.index) and torch.equal(g.nodes.layer, h.nodes.layer)
    scale = float(g.densify().abs().max())
    assert scale > 0 and (g.densify() - h.densify()).abs().max() < 1e-5 * scale
    u = attribute(rm(model, None, TranscoderSet(model, unfolded)), ids, batch_size=40)
    assert not (torch.equal(u.nodes.index, g.nodes.index) and torch.allclose(u.densify(), g.densify(), atol=1e-3))


def test_layer_norm_normalized_transcoder_graph_equals_the_mlp_call_transcoder_with_gain_and_bias_folded_in() -> None:
    """GPT-2: an ``ln2.hook_normalized`` transcoder reads ``x̂ = (x − mean x) / σ(x)`` before ``ln_2``'s gain ``g`` and
    bias ``b``; the MLP-call transcoder with ``W_enc / g`` and ``b_enc − (b / g) W_enc`` (``W_skip / g`` and its
    ``b / g`` term in ``b_dec``) reads ``g ⊙ x̂ + b`` and computes the same features: the same nodes, the same
    edges from every node but the bias nodes (``ln_2``'s bias reaches the folded encoder, ``b_enc`` differs), whose
    edges into each node sum to the same value."""
    model, hf = tiny_nnsight("gpt2")
    adapter = get_adapter(model)
    ids = random_ids(1, 8, seed=2)[0]
    normalized, folded = {}, {}
    for layer, skip, seed in ((0, False, 3), (2, True, 4)):
        norm = hf.get_submodule(adapter.mlp_norm_path(layer))
        gain, bias = norm.weight.detach().double(), norm.bias.detach().double()
        assert (gain - 1).abs().max() > 0.05 and bias.abs().max() > 0.01  # a gain and a bias that matter
        normalized[layer] = circuit_tracer_hooked(make_transcoder(skip=skip, seed=seed), NORMALIZED, "hook_mlp_out")
        f = make_transcoder(skip=skip, seed=seed)
        with torch.no_grad():
            w = f.W_enc.double()
            f.b_enc.copy_((f.b_enc.double() - (bias / gain) @ w).float())
            f.W_enc.copy_((w / gain[:, None]).float())
            if skip:
                s = f.W_skip.double()  # (d_out, d_in): skip(x) = x @ W_skip.T
                f.b_dec.copy_((f.b_dec.double() - (bias / gain) @ s.T).float())
                f.W_skip.copy_((s / gain[None, :]).float())
        folded[layer] = circuit_tracer_hooked(f, "mlp.hook_in", "hook_mlp_out")
    g = attribute(rm(model, None, TranscoderSet(model, normalized)), ids, batch_size=40)
    h = attribute(rm(model, None, TranscoderSet(model, folded)), ids, batch_size=40)
    assert torch.equal(g.nodes.kind, h.nodes.kind) and torch.equal(g.nodes.pos, h.nodes.pos)
    assert torch.equal(g.nodes.index, h.nodes.index) and torch.equal(g.nodes.layer, h.nodes.layer)
    a, b = g.densify(), h.densify()
    bias = g.ids_of(Graph.BIAS)
    other = torch.ones(a.shape[1], dtype=torch.bool)
    other[bias] = False
    scale = float(a.abs().max())
    assert scale > 0 and (a[:, other] - b[:, other]).abs().max() < 1e-5 * scale
    assert (a[:, bias].sum(1) - b[:, bias].sum(1)).abs().max() < 1e-5 * scale
    assert g.edge_sum_error("mass").max() < 1e-5


# ------------------------------------------------------------------ an independent frozen model, by hand
def _frozen_by_hand(hf: Any, family: str, tcs: dict[int, Any], reads: str, writes: str, ids: torch.Tensor,
                    monkeypatch: Any) -> tuple[dict[int, torch.Tensor], Any]:
    """The frozen replacement model as Hugging Face hooks, independent of the attribution engine: every RMSNorm's
    ``1/rms`` frozen from the clean pass (times its gain), every attention pattern frozen (eager attention patched),
    MLPs without a transcoder replaced by their clean output, each transcoder reading the pre-MLP norm's input
    (``reads="norm_input"``) or its frozen ``x / rms(x)`` (``"normalized"``) and writing, with its clean activations
    times a multiplier ``m[L] (pos, d_sae)``, its skip path, ``b_dec`` and the clean error, the MLP output
    (``writes="mlp"``) or the post-MLP norm's output (``"post_norm"``). Returns ``({layer: acts (pos, d_sae)},
    run)``; ``run(m, m_emb)`` runs the frozen forward with the multipliers and returns ``(pre-activations
    {layer: (pos, d_sae)}, unembedding output (pos, vocab))``."""
    adapter = get_adapter(hf)
    arch = importlib.import_module(type(hf).__module__)
    original = arch.eager_attention_forward
    state: dict[str, Any] = {"mode": "record", "scale": {}, "pattern": {}, "mid": {}, "mlp_out": {}, "post_out": {}}

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if state["mode"] == "record":
            out, w = original(module, query, key, value, attention_mask, *args, **kwargs)
            state["pattern"][id(module)] = w.detach()
            return out, w
        w = state["pattern"][id(module)]
        v = arch.repeat_kv(value, module.num_key_value_groups)
        return torch.matmul(w, v).transpose(1, 2).contiguous(), w

    monkeypatch.setattr(arch, "eager_attention_forward", attention)
    norms = {name: m for name, m in hf.named_modules() if type(m).__name__.endswith("RMSNorm")}
    mlp_norms = {adapter.mlp_norm_path(layer): layer for layer in tcs}
    post_norms = {adapter.mlp_post_norm_path(layer): layer for layer in tcs} if writes == "post_norm" else {}
    mlps = {adapter.mlp_path(layer): layer for layer in range(adapter.n_layers)}

    def read(layer: int, mid: torch.Tensor) -> torch.Tensor:
        if reads == "norm_input":
            return mid
        return mid * state["scale"][adapter.mlp_norm_path(layer)]

    def tc_out(layer: int) -> torch.Tensor:
        tc, x = tcs[layer], read(layer, state["mid"][layer])
        acts = state["acts"][layer] * state["m"][layer]
        skip = tc.skip(x)
        return acts @ tc.W_dec + tc.b_dec + (0.0 if skip is None else skip) + state["error"][layer]

    def norm_hook(name):
        def hook(module, args, out):
            x = args[0]
            if state["mode"] == "record":
                eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
                state["scale"][name] = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).detach()
                if name in mlp_norms:
                    state["mid"][mlp_norms[name]] = x.detach()
                if name in post_norms:
                    state["post_out"][post_norms[name]] = out.detach()
                return out
            if name in mlp_norms:
                state["mid"][mlp_norms[name]] = x  # live: the transcoder's read
            if name in post_norms:
                return tc_out(post_norms[name])
            return x * state["scale"][name] * norm_gain(module)
        return hook

    def mlp_hook(name):
        layer = mlps[name]

        def hook(module, args, out):
            if state["mode"] == "record":
                state["mlp_out"][layer] = out.detach()
                return out
            if layer in tcs and writes == "mlp":
                return tc_out(layer)
            return state["mlp_out"][layer]  # an error node (or the post-norm writer's input, replaced there)
        return hook

    def embed_hook(module, args, out):
        return out if state["mode"] == "record" else out * state["m_emb"][None, :, None]

    handles = [hf.get_submodule(name).register_forward_hook(norm_hook(name)) for name in norms]
    handles += [hf.get_submodule(name).register_forward_hook(mlp_hook(name)) for name in mlps]
    handles.append(hf.get_submodule(adapter.embed_path).register_forward_hook(embed_hook))
    lm = hf.get_output_embeddings()
    seen: list[torch.Tensor] = []
    handles.append(lm.register_forward_hook(lambda m, a, o: seen.append(o)))
    try:
        with torch.no_grad():
            hf(ids[None])
            state["acts"] = {layer: tcs[layer].encode(read(layer, state["mid"][layer]))[0] for layer in tcs}
            state["error"] = {}
            for layer, tc in tcs.items():
                x = read(layer, state["mid"][layer])
                skip = tc.skip(x)
                true = state["post_out" if writes == "post_norm" else "mlp_out"][layer]
                state["error"][layer] = true - (state["acts"][layer] @ tc.W_dec + tc.b_dec
                                                + (0.0 if skip is None else skip))
    except BaseException:
        for h in handles:
            h.remove()
        raise

    def run(m: dict[int, torch.Tensor], m_emb: torch.Tensor) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        state.update(mode="frozen", m=m, m_emb=m_emb)
        seen.clear()
        hf(ids[None])
        pre = {layer: (read(layer, state["mid"][layer]) @ tcs[layer].W_enc + tcs[layer].b_enc)[0] for layer in tcs}
        return pre, seen[-1][0]

    run.handles = handles  # type: ignore[attr-defined]
    return state["acts"], run


@pytest.mark.parametrize(("family", "hook_in", "hook_out"), [("llama", RESID_MID, "mlp.hook_out"),
                                                             ("gemma2", NORMALIZED, "hook_mlp_out"),
                                                             ("gemma2", RESID_MID, "hook_mlp_out")])
def test_edges_equal_the_jacobian_of_a_frozen_model_built_by_hand(family: str, hook_in: str, hook_out: str,
                                                                  monkeypatch: Any) -> None:
    """The edges into the top logit and into layer-2 features from every embedding and layer-0 feature equal
    ``∂ target / ∂ multiplier`` through an independent frozen model (Hugging Face hooks, :func:`_frozen_by_hand`):
    ``hook_resid_mid`` reads (per-position, through the frozen pre-MLP norm's input) and Gemma-2 ``hook_mlp_out``
    writes (after the frozen post-MLP norm) included; the hand model's clean activations are the graph's."""
    model, hf = tiny_nnsight(family)
    ids = random_ids(1, 8, seed=2)[0]
    tcs = {0: circuit_tracer_hooked(make_transcoder(skip=False, seed=3), hook_in, hook_out),
           2: circuit_tracer_hooked(make_transcoder(skip=True, seed=4), hook_in, hook_out)}
    g = attribute(rm(model, None, TranscoderSet(model, tcs)), ids, batch_size=40)
    reads = "norm_input" if hook_in == RESID_MID else "normalized"
    writes = "post_norm" if hook_out == "hook_mlp_out" and family == "gemma2" else "mlp"
    acts, run = _frozen_by_hand(hf, family, tcs, reads, writes, ids, monkeypatch)
    try:
        for layer, a in acts.items():
            assert torch.allclose(_graph_acts(g, layer, a), a, rtol=1e-5, atol=1e-6)
        n_pos = ids.numel()
        m = {layer: torch.ones_like(a, requires_grad=True) for layer, a in acts.items()}
        m_emb = torch.ones(n_pos, requires_grad=True)
        pre, logits = run({layer: t[None] for layer, t in m.items()}, m_emb)
        logit_row = int(g.logit_ids[0])
        token = int(g.nodes.index[logit_row])
        targets = [(logit_row, logits[-1, token] - logits[-1].mean())]
        ids2 = g.ids_of(TRANSCODER)
        ids2 = ids2[g.nodes.layer[ids2] == 2]
        for row in ids2[torch.argsort(-g.values[ids2].abs())[:4]].tolist():
            targets.append((row, pre[2][int(g.nodes.pos[row]), int(g.nodes.index[row])]))
        A = g.densify()
        emb = g.ids_of(EMBEDDING)
        src0 = g.ids_of(TRANSCODER)
        src0 = src0[g.nodes.layer[src0] == 0]
        assert len(src0) > 0
        for row, value in targets:
            assert torch.allclose(value.detach(), g.values[row], rtol=1e-4, atol=1e-5)
            d_m0, d_emb = torch.autograd.grad(value, [m[0], m_emb], retain_graph=True)
            by_hand = torch.cat([d_emb[g.nodes.pos[emb]], d_m0[g.nodes.pos[src0], g.nodes.index[src0]]])
            from_graph = torch.cat([A[row, emb], A[row, src0]])
            scale = float(from_graph.abs().max())
            assert scale > 0 and (by_hand - from_graph).abs().max() < 1e-4 * scale, (row, family)
    finally:
        for h in run.handles:
            h.remove()


# ------------------------------------------------------------------ the graph of a traced pass
TRACED_CASES = [("llama", RESID_MID, "mlp.hook_out"), ("llama", NORMALIZED, "mlp.hook_out"),
                ("gemma2", NORMALIZED, "hook_mlp_out")]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("kind", ["tc", "clt"])
@pytest.mark.parametrize(("family", "hook_in", "hook_out"), TRACED_CASES)
def test_the_graph_of_a_traced_pass_reads_and_writes_where_the_transcoder_does(family: str, hook_in: str,
                                                                               hook_out: str, kind: str) -> None:
    """``attribute(rm, tracer=tracer)`` of transcoders / CLTs off the MLP call (Llama ``hook_resid_mid`` and
    ``ln2.hook_normalized``, GemmaScope on Gemma-2): spliced and unedited, the graph is ``attribute(rm, prompt)``'s
    (same nodes, values and edges within 1e-5); (per-layer transcoders, whose features the graph holds as edited)
    with a layer-0 feature zero-ablated at the last position, that node is marked at 0, the layer-2 features are the
    ones the spliced pass computed (not the clean ones), every computed row sums to its value (mass) and the logit
    nodes are the trace's logits; (a CLT, whose features are edited on its envoy) the same with the feature zeroed on
    ``model.clt.hook_sae_acts_post[0]``, a direct edit to zero: the feature is no node, so no mark (it used to stay
    at its unedited value: the recorder kept no CLT features)."""
    import nnsight

    from nnsight_lorsa.patching import Feature, ablate

    model, _ = tiny_nnsight(family)
    adapter = get_adapter(model)
    ids = random_ids(1, 8, seed=2)[0]
    r = rm(model, None, _transcoders(model, kind, (hook_in, hook_out)))
    clean = attribute(r, ids, batch_size=40)
    with model.trace(ids) as tracer:
        r.replace()
        handle = attribute(r, tracer=tracer, batch_size=40)
    g = handle.graph
    assert_same_nodes(g, clean)
    assert torch.equal(g.feature_rows, clean.feature_rows) and not bool(g.nodes.intervened.any())
    rows = clean.feature_rows
    assert _relative(g.values[rows], clean.values[rows]) < 1e-5
    assert _relative(g.nodes.activation, clean.nodes.activation) < 1e-5
    assert _relative(g.densify(), clean.densify()) < 1e-5
    assert g.meta["logit_gap"] < 1e-5
    # an edit: the feature of layer 0 most active at the last position, zero-ablated there
    last = int(ids.numel()) - 1
    n = clean.nodes
    here = ((n.kind == TRANSCODER) & (n.layer == 0) & (n.pos == last)).nonzero().flatten()
    top = int(here[n.activation[here].abs().argmax()])
    feature = int(n.index[top])
    assert abs(float(n.activation[top])) > 0.01
    if kind == "clt":
        _check_a_clt_feature_zeroed_on_its_envoy(model, r, ids, clean, feature)
        return
    with model.trace(ids) as tracer:
        r.replace()
        handle = attribute(r, tracer=tracer, batch_size=40)
        ablate(r(Feature(0, feature, kind="transcoder")), positions=last)
        later = nnsight.save(model.get(adapter.mlp_path(2)).transcoder.hook_sae_acts_post.output)
        logits = nnsight.save(model.get(adapter.lm_head_path).output)
    e = handle.graph
    marked = e.nodes.intervened.nonzero().flatten()
    assert marked.numel() == 1
    i = int(marked[0])
    assert (int(e.nodes.kind[i]), int(e.nodes.layer[i]), int(e.nodes.pos[i]), int(e.nodes.index[i])) == (
        TRANSCODER, 0, last, feature)
    assert float(e.nodes.activation[i]) == 0.0 and not bool(e.feature_rows[i])
    acts2 = later[0].detach()
    assert torch.allclose(_graph_acts(e, 2, acts2), acts2, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(_graph_acts(clean, 2, acts2), acts2, rtol=1e-5, atol=1e-6)  # the edit reached them
    assert torch.allclose(_graph_acts(e, 2, acts2, values=True), acts2, rtol=1e-4, atol=1e-5)
    assert e.edge_sum_error("mass").max() < 1e-5
    top_logits = logits.detach()[0, -1].double()
    want = top_logits[e.nodes.index[e.logit_ids]] - top_logits.mean()
    assert _relative(e.values[e.logit_ids], want) < 1e-5 and e.meta["logit_gap"] < 1e-5
    assert _relative(clean.values[clean.logit_ids], want) > 1e-4  # the edit changed the logits


def _check_a_clt_feature_zeroed_on_its_envoy(model: Any, r: Any, ids: torch.Tensor, clean: Any, feature: int) -> None:
    """The graph of a traced pass with CLT feature ``feature`` of layer 0 zeroed at the last position on the CLT's
    envoy: no such node, no mark, every layer's CLT nodes are the pass's features, rows sum, logits are the pass's."""
    import nnsight

    last = int(ids.numel()) - 1
    saved: list = []
    with model.trace(ids) as tracer:
        clt = r.replace()["transcoders"]
        handle = attribute(r, tracer=tracer, batch_size=40)
        clt.hook_sae_acts_post[0].output[0, last, feature] = 0.0
        for layer in range(3):
            saved.append(clt.hook_sae_acts_post[layer].output.save())
        logits = nnsight.save(model.lm_head.output)
    e = handle.graph
    n = e.nodes
    assert not bool(((n.kind == TRANSCODER) & (n.layer == 0) & (n.pos == last) & (n.index == feature)).any())
    assert not bool(n.intervened.any())
    for layer, acts in enumerate(saved):
        assert torch.allclose(_graph_acts(e, layer, acts[0].detach()), acts[0].detach(), rtol=1e-5, atol=1e-6), layer
    assert e.edge_sum_error("mass").max() < 1e-5
    top_logits = logits.detach()[0, -1].double()
    want = top_logits[e.nodes.index[e.logit_ids]] - top_logits.mean()
    assert _relative(e.values[e.logit_ids], want) < 1e-5 and e.meta["logit_gap"] < 1e-5
    assert _relative(clean.values[clean.logit_ids], want) > 1e-4  # the edit changed the logits


def test_what_the_frozen_pass_cannot_read_or_write_is_refused_by_name(monkeypatch: Any) -> None:
    """A transcoder whose hooks map to modules the frozen pass does not read or write (here: a hand-made
    ``MLPSiteIO`` reading the attention norm) is refused naming the layer, its hooks and the modules — by
    ``attribute(rm, prompt)`` and by the graph of a traced pass (``attribute(rm, tracer=tracer)``) alike; GPT-NeoX
    with a parallel residual has no ``hook_resid_mid``."""
    from nnsight_lorsa.attribution import replacement as rep
    from nnsight_lorsa.formats.hook_sites import MLPSiteIO

    model, _ = tiny_nnsight("llama")
    adapter = get_adapter(model)
    tcs = TranscoderSet(model, {1: circuit_tracer_hooked(make_transcoder(seed=3), RESID_MID, "mlp.hook_out")})
    r = rm(model, None, tcs)
    ids = random_ids(1, 6, seed=2)
    bad = MLPSiteIO(adapter.attention_norm_path(1), adapter.mlp_path(1))
    with pytest.raises(UnsupportedArchitectureError, match=r"layer 1 reads the input of "
                                                           r"'model\.layers\.1\.input_layernorm'.*frozen pass"):
        rep.site_kinds(bad, adapter, 1)
    monkeypatch.setattr(rep, "mlp_site_io", lambda *a: bad)
    with pytest.raises(UnsupportedArchitectureError, match=r"layer 1.*input_layernorm.*hook_resid_mid.*not supported"):
        attribute(r, ids[0], max_feature_nodes=8)
    with (pytest.raises(UnsupportedArchitectureError, match=r"layer 1.*input_layernorm.*hook_resid_mid.*not supported"),
          model.trace(ids[:1]) as tracer):
        attribute(r, tracer=tracer)
    neox, _ = tiny_nnsight("neox")
    na = get_adapter(neox)
    assert neox.config.use_parallel_residual
    with pytest.raises(UnsupportedArchitectureError, match=r"layer 1.*parallel residual"):
        rep.site_kinds(MLPSiteIO(na.mlp_norm_path(1), na.mlp_path(1)), na, 1)


REMOTE_LOCAL = r"""
import sys, torch, nnsight
import nnsight_lorsa
from helpers import make_transcoder, random_ids, tiny_nnsight
from nnsight_lorsa import ReplacementModel, TranscoderSet
from nnsight_lorsa.attribution import attribute, cache_for_attribution
model, hf = tiny_nnsight("gemma2")
tcs = {}
for layer, seed in ((0, 3), (2, 4)):
    tc = make_transcoder(skip=layer == 2, seed=seed)
    tc.cfg.extra["circuit_tracer"] = {"feature_input_hook": "ln2.hook_normalized",
                                      "feature_output_hook": "hook_mlp_out"}
    tcs[layer] = tc
r = ReplacementModel(model, transcoders=TranscoderSet(model, tcs))
ids = random_ids(1, 7, seed=5)[0]
local = attribute(r, ids, batch_size=32)
nnsight.register(nnsight_lorsa)
remote = attribute(r, ids, batch_size=32, remote="local")
# the clean pass serialized and run back, the graph built here from its cache: the local cached graph bit for bit,
# the traced one to rounding
here = attribute(r, cache_for_attribution(r, ids), batch_size=32)
assert torch.equal(here.densify(), remote.densify()), (here.densify() - remote.densify()).abs().max()
assert torch.allclose(local.densify(), remote.densify(), atol=1e-5), (local.densify() - remote.densify()).abs().max()
cached = attribute(r, cache_for_attribution(r, ids, remote="local"), batch_size=32)
assert torch.allclose(cached.densify(), local.densify(), atol=1e-5), (cached.densify() - local.densify()).abs().max()
print("ok", int(remote.feature_rows.sum()))
"""


def test_gemmascope_attribution_under_nnsight_remote_local_simulation() -> None:
    """GemmaScope transcoders on Gemma-2 through nnsight's serializing simulation (``remote="local"``: the clean pass
    reading the pre-MLP norm's input, the frozen pass and a remote cache): the local graph, bit for bit. In a fresh
    interpreter: the test-time type-checking wrappers are not picklable."""
    import os
    import subprocess
    import sys

    from helpers import TESTS

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    done = subprocess.run([sys.executable, "-c", REMOTE_LOCAL], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1].startswith("ok")
