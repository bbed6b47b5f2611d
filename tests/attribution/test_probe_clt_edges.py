"""Cross-layer transcoder (CLT) attribution probe: every edge into a CLT feature or a logit against the autograd
Jacobian of a frozen replacement model built by hand.

The frozen model is written here from the definition (Ameisen et al. 2025, *Circuit Tracing*; docs/attribution.md,
"What a graph is"), as Hugging Face hooks on the unmodified model: every attention pattern and every RMSNorm's
``1/rms`` (LayerNorm's ``1/σ``, its centring live) frozen at the prompt's values (eager attention patched), MLP
``l < n_layers`` replaced by
``Σ_{s ≤ l} m_s ⊙ acts_s · W_dec_s[:, l − s] + b_dec[l] + x_l W_skip[l]ᵀ + m_err[l] ⊙ error_l`` with the clean
features ``acts_s = σ(x_s W_enc[s] + b_enc[s])`` held fixed and ``error_l`` the clean MLP output minus the clean
reconstruction, MLP ``l ≥ n_layers`` by ``m_err[l] ⊙`` its clean output, the embedding scaled by ``m_emb``. An
edge ``s → t`` is ``∂t/∂m_s`` at ``m = 1`` (``t`` a feature's pre-activation ``x_l' W_enc[l'] + b_enc[l']`` or a
demeaned logit). No ``nnsight_lorsa`` computation runs in the reference (the adapter gives module paths; the CLT's
weights are read as tensors) but a Lorsa's QK pattern, taken from its own ``attention_pattern`` (the Lorsa's
patterns are probed elsewhere).
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from helpers import drawn_clt, generated, make_lorsa, pattern_holding_attention, random_ids, rm, tiny_nnsight
from hypothesis import strategies as st

from nnsight_lorsa import CLTSet, get_adapter
from nnsight_lorsa.attribution import attribute
from nnsight_lorsa.attribution.graph import ATTN_ERROR, EMBEDDING, LORSA, MLP_ERROR, TRANSCODER
from nnsight_lorsa.modules import CrossLayerTranscoder

FAMILIES = ("llama", "qwen2", "qwen3", "gpt2")
D = 64


def build_clt(n_layers: int, kind: str, skip: bool, seed: int, d_sae: int = 24) -> CrossLayerTranscoder:
    return drawn_clt(n_layers, d_sae, kind, skip, seed, D)


def act_ref(pre: torch.Tensor, clt: CrossLayerTranscoder, layer: int) -> torch.Tensor:
    kind = clt.cfg.activation
    if kind == "relu":
        return pre.clamp(min=0)
    if kind == "jumprelu":
        theta = clt.activation[layer].threshold.detach()
        return pre * (pre > theta).to(pre.dtype)
    vals, idx = pre.topk(clt.cfg.activation_params["k"], dim=-1)
    return torch.zeros_like(pre).scatter(-1, idx, vals.clamp(min=0))


def frozen_by_hand(hf: Any, clt: CrossLayerTranscoder, ids: torch.Tensor, monkeypatch: Any, edit: Any = None,
                   lorsa: Any = None, reads: str = "mlp"):
    """Returns ``(the pass's features {layer: (pos, d_sae)}, run, handles)``; ``run(m, m_err, m_emb)`` runs the
    frozen model and returns ``({layer: pre-activations (pos, d_sae)}, unembedding output (pos, vocab))``.

    The pass is the CLT spliced with error terms (``true + recon(edited) − recon(clean)`` at each MLP, the clean
    features those of the unedited encoder on the pass's own input), with ``edit = (layer, pos, feature, delta)``
    added to one feature (None: no edit); the error nodes are the pass's MLP outputs minus the reconstruction of the
    pass's features.

    ``lorsa``: a Lorsa replacing attention layer 1's output, with its error term: in the frozen model its QK pattern
    (from the Lorsa's own ``attention_pattern`` on the clean input) and its top-k choice are fixed; its heads are
    nodes, so its output is ``(m_lorsa ⊙ z_clean) W_O + b_D + m_attn_err ⊙ error``, and ``run`` also returns the live
    ``z_pre = A v (pos, n_ov)`` (values ``x W_Vᵀ + b_V`` of the live input; each group of ``n_ov / n_qk``
    consecutive OV heads shares a QK head), the heads' rows.

    ``reads``: what layer ``l``'s encoder (and skip path) reads — ``"mlp"``: the MLP's input (the frozen pre-MLP
    norm's output); ``"resid_mid"``: the pre-MLP norm's input (circuit-tracer ``hook_resid_mid``), live;
    ``"normalized"``: that input times the norm's frozen ``1/rms``, without the gain (``ln2.hook_normalized``)."""
    arch = importlib.import_module(type(hf).__module__)
    st_: dict[str, Any] = {"mode": "record", "pattern": {}, "scale": {}, "x": {}, "mlp_out": {}, "acts": {},
                           "clean": {}, "mid": {}}
    n, n_model = clt.n_layers, hf.config.num_hidden_layers
    W_enc, b_enc, b_dec = clt.W_enc.detach(), clt.b_enc.detach(), clt.b_dec.detach()
    W_dec = [getattr(clt, f"W_dec_{layer}").detach() for layer in range(n)]
    W_skip = None if clt.W_skip is None else clt.W_skip.detach()

    monkeypatch.setattr(arch, "eager_attention_forward",
                        pattern_holding_attention(arch, lambda: st_["mode"] == "record", st_["pattern"]))
    adapter = get_adapter(hf)

    def lorsa_hook(module, args, kwargs, output):
        x = adapter.attention_input(args, kwargs)
        v = x @ lorsa.W_V.detach().T + lorsa.b_V.detach()
        if st_["mode"] == "record":
            st_["l_pattern"] = lorsa.attention_pattern(x.detach(), positions=adapter.attention_positions(
                args, kwargs, x), attn_mask=adapter.attention_mask(args, kwargs)).detach()
        A = st_["l_pattern"]
        b, p, n_ov = v.shape
        n_qk = A.shape[1]
        z_pre = torch.einsum("bhij,bjhg->bihg", A, v.view(b, p, n_qk, n_ov // n_qk)).reshape(b, p, n_ov)
        true = adapter.attention_output(output)
        if st_["mode"] == "record":
            k = lorsa.cfg.top_k
            vals, idx = z_pre.topk(k, dim=-1)
            st_["l_mask"] = torch.zeros_like(z_pre).scatter(-1, idx, (vals > 0).to(z_pre.dtype))
            z = z_pre * st_["l_mask"]
            st_["l_z"] = z.detach()
            st_["l_err"] = (true - (z @ lorsa.W_O.detach() + lorsa.b_D.detach())).detach()
            return output  # the error term: the pass is the model's own
        st_["l_zpre"] = z_pre
        z = st_["l_z"] * st_["m_lorsa"]  # the heads are nodes: held at their clean values (paths through them cut)
        new = z @ lorsa.W_O.detach() + lorsa.b_D.detach() + st_["m_aerr"][None, :, None] * st_["l_err"]
        return adapter.with_attention_output(output, new)

    def recon(layer: int, acts: dict, x: torch.Tensor) -> torch.Tensor:
        out = b_dec[layer] + sum(acts[s] @ W_dec[s][:, layer - s] for s in range(layer + 1))
        return out if W_skip is None else out + x @ W_skip[layer].T

    def norm_hook(name):
        layer_norm = isinstance(hf.get_submodule(name), torch.nn.LayerNorm)  # GPT-2: centred, with a bias

        def hook(module, args, out):
            x = args[0]
            if name in mid_norms:
                st_["mid"][mid_norms[name]] = x if st_["mode"] == "frozen" else x.detach()  # resid_mid
            if layer_norm:
                x = x - x.mean(-1, keepdim=True)  # linear: live
            if st_["mode"] == "record":
                eps = module.eps if layer_norm else module.variance_epsilon
                st_["scale"][name] = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
                return out
            y = (x.float() * st_["scale"][name]).to(x.dtype) * module.weight
            return y + module.bias if layer_norm else y
        return hook

    mid_norms = {adapter.mlp_norm_path(layer): layer for layer in range(n)}

    def read(layer: int, mlp_in: torch.Tensor) -> torch.Tensor:
        if reads == "mlp" or layer >= n:
            return mlp_in
        mid = st_["mid"][layer]
        if reads == "resid_mid":
            return mid
        return (mid.float() * st_["scale"][adapter.mlp_norm_path(layer)]).to(mid.dtype)

    def mlp_hook(layer):
        def hook(module, args, out):
            x = read(layer, args[0])
            if st_["mode"] == "record":
                x = x.detach()
                if layer < n:
                    clean = act_ref(x @ W_enc[layer] + b_enc[layer], clt, layer)
                    st_["clean"][layer] = clean
                    acts = clean.clone()
                    if edit is not None and edit[0] == layer:
                        acts[0, edit[1], edit[2]] += edit[3]
                    st_["acts"][layer] = acts
                    out = out + (recon(layer, st_["acts"], x) - recon(layer, st_["clean"], x))
                st_["x"][layer], st_["mlp_out"][layer] = x, out.detach()
                return out
            st_["live_x"][layer] = x
            err = st_["m_err"][layer][None, :, None] * st_["error"][layer]
            if layer >= n:
                return err
            acts = {s: st_["acts"][s] * st_["m"][s] for s in range(layer + 1)}
            return recon(layer, acts, x) + err
        return hook

    handles = [m.register_forward_hook(norm_hook(name)) for name, m in hf.named_modules()
               if type(m).__name__.endswith("RMSNorm") or isinstance(m, torch.nn.LayerNorm)]
    handles += [hf.get_submodule(adapter.mlp_path(layer)).register_forward_hook(mlp_hook(layer))
                for layer in range(n_model)]
    if lorsa is not None:
        handles.append(adapter.attention_module(hf, 1).register_forward_hook(lorsa_hook, with_kwargs=True))
    handles.append(hf.get_submodule(adapter.residual_start_path).register_forward_hook(
        lambda m, a, o: o if st_["mode"] == "record" else o * st_["m_emb"][None, :, None]))
    seen: list = []
    handles.append(hf.get_output_embeddings().register_forward_hook(lambda m, a, o: seen.append(o)))
    with torch.no_grad():
        hf(ids[None])
    acts = st_["acts"]
    st_["error"] = {layer: st_["mlp_out"][layer] - (recon(layer, acts, st_["x"][layer]) if layer < n else 0)
                    for layer in range(n_model)}

    def run(m: dict, m_err: dict, m_emb: torch.Tensor, m_lorsa: Any = None, m_aerr: Any = None):
        st_.update(mode="frozen", m=m, m_err=m_err, m_emb=m_emb, live_x={}, m_lorsa=m_lorsa, m_aerr=m_aerr)
        seen.clear()
        hf(ids[None])
        pre = {layer: (st_["live_x"][layer] @ W_enc[layer] + b_enc[layer])[0] for layer in range(n)}
        if lorsa is not None:
            pre["lorsa"] = st_["l_zpre"][0]
        return pre, seen[-1][0]

    run.lorsa_z = (lambda: st_["l_z"][0]) if lorsa is not None else None  # type: ignore[attr-defined]

    return {layer: a[0] for layer, a in acts.items()}, run, handles


@generated(2, 200, family=st.sampled_from(FAMILIES), n_layers=st.integers(1, 3),
           kind=st.sampled_from(("relu", "jumprelu", "topk")), skip=st.booleans(), seed=st.integers(0, 2**16),
           seq=st.integers(2, 7), with_lorsa=st.booleans(), reads=st.sampled_from(("mlp", "resid_mid", "normalized")))
def test_clt_edges_equal_the_jacobian_of_a_frozen_model_built_by_hand(family, n_layers, kind, skip, seed, seq,
                                                                      with_lorsa, reads):
    """``attribute`` of a CLT over the first ``n_layers`` MLPs (the rest error nodes) on tiny Llama / Qwen2 / Qwen3 /
    GPT-2 (fp32): the feature nodes are the clean active features with their activations; each computed row's value is
    the target's (pre-activation / demeaned logit); the edges into the top logit and into the 4 largest features of
    every layer ≥ 1 from every embedding, every CLT feature of an earlier layer (its decoders into every MLP in between,
    the paths through the frozen attention included) and every MLP error node of an earlier layer equal the
    Jacobian, within 1e-4 of the row's largest edge. ``with_lorsa``: a Lorsa also replaces attention layer 1's
    output (one graph with both): its head nodes are the clean ``z``, the edges into its 4 largest heads (from the
    embeddings and layer 0's features and error nodes, through its live values and frozen pattern) and from its heads
    and error nodes into every later target equal the Jacobian too. ``reads``: the CLT reads (and its skip path
    reads) the MLP's input, or, as a circuit-tracer file recording ``hook_resid_mid`` / ``ln2.hook_normalized`` says,
    the pre-MLP norm's input or that input times the norm's frozen ``1/rms``."""
    model, hf = tiny_nnsight(family)
    ids = random_ids(1, seq, seed=seed)[0]
    clt = build_clt(n_layers, kind, skip, seed)
    if reads != "mlp":  # a circuit-tracer file's hooks (docs/attribution.md, "Transcoders off the MLP call")
        clt.cfg.extra["circuit_tracer"] = {
            "feature_input_hook": {"resid_mid": "hook_resid_mid", "normalized": "ln2.hook_normalized"}[reads],
            "feature_output_hook": "hook_mlp_out" if family == "gpt2" else "mlp.hook_out"}
    lorsa = None
    if with_lorsa:
        with torch.random.fork_rng():
            torch.manual_seed(seed)  # make_lorsa draws b_D from the global generator
            lorsa = make_lorsa(hf, get_adapter(hf), 1, seed=seed)
    g = attribute(rm(model, None if lorsa is None else {1: lorsa}, CLTSet(model, clt)), ids, batch_size=64)
    with pytest.MonkeyPatch.context() as monkeypatch:
        check_edges(hf, clt, g, ids, seq, n_layers, monkeypatch, lorsa=lorsa, reads=reads)


@generated(2, 200, family=st.sampled_from(FAMILIES), n_layers=st.integers(1, 3),
           kind=st.sampled_from(("relu", "jumprelu", "topk")), skip=st.booleans(), seed=st.integers(0, 2**16),
           seq=st.integers(2, 7), edit=st.tuples(st.integers(0, 2), st.integers(0, 6), st.integers(0, 23),
                                                 st.sampled_from((2.0, -0.5, 5.0))))
def test_intervened_clt_edges_equal_the_jacobian_of_the_edited_pass(family, n_layers, kind, skip, seed, seq, edit):
    """``attribute(rm, tracer=tracer)`` of a traced pass (``error=True``) with one CLT feature (active or not) moved
    by ``delta`` on the CLT's envoy: the node set is the pass's features (the edited one at its edited value), and the
    edges equal the Jacobian of the frozen model of that pass built by hand (its features, its error nodes), within
    1e-4 of the row's largest edge."""
    model, hf = tiny_nnsight(family)
    ids = random_ids(1, seq, seed=seed)[0]
    clt = build_clt(n_layers, kind, skip, seed)
    edit = (edit[0] % n_layers, edit[1] % seq, edit[2], edit[3])
    bundle = rm(model, None, CLTSet(model, clt))
    with model.trace(ids) as tracer:
        site = bundle.replace(error=True)["transcoders"]
        handle = attribute(bundle, tracer=tracer, batch_size=64)
        for layer in range(n_layers):
            acts = site.hook_sae_acts_post[layer].output
            if layer == edit[0]:
                acts[0, edit[1], edit[2]] += edit[3]
    with pytest.MonkeyPatch.context() as monkeypatch:
        check_edges(hf, clt, handle.graph, ids, seq, n_layers, monkeypatch, edit)


def check_edges(hf, clt, g, ids, seq, n_layers, monkeypatch, edit=None, lorsa=None, reads="mlp") -> None:
    """The node activations and the edges of ``g`` against :func:`frozen_by_hand` (see the tests)."""
    acts, run, handles = frozen_by_hand(hf, clt, ids, monkeypatch, edit, lorsa, reads)
    try:
        nodes = g.nodes

        def dense_of(kind: int, layer: int, like: torch.Tensor) -> torch.Tensor:
            at = ((nodes.kind == kind) & (nodes.layer == layer)).nonzero().flatten()
            dense = torch.zeros_like(like)
            dense[nodes.pos[at], nodes.index[at]] = nodes.activation[at].to(like.dtype)
            return dense

        # activations to fp32 rounding at the scale of the layer's largest (a small one is a cancellation of
        # terms that size: 0.011354 against 0.011356 beside activations of 1.5 on an AVX-512 CPU, past an atol of 1e-6)
        def near(got: torch.Tensor, want: torch.Tensor) -> bool:
            return torch.allclose(got, want, rtol=1e-5, atol=5e-6 * max(float(want.abs().max()), 1.0))

        for layer, a in acts.items():  # the node set and activations: the pass's active features
            assert near(dense_of(TRANSCODER, layer, a), a), layer
        if lorsa is not None:
            z = run.lorsa_z()
            assert near(dense_of(LORSA, 1, z), z)
        n_model = hf.config.num_hidden_layers
        m = {layer: torch.ones(seq, clt.cfg.d_sae, requires_grad=True) for layer in range(n_layers)}
        m_err = {layer: torch.ones(seq, requires_grad=True) for layer in range(n_model)}
        m_emb = torch.ones(seq, requires_grad=True)
        m_lorsa = torch.ones(seq, lorsa.cfg.n_ov_heads, requires_grad=True) if lorsa is not None else None
        m_aerr = torch.ones(seq, requires_grad=True) if lorsa is not None else None
        pre, logits = run({k: v[None] for k, v in m.items()}, m_err, m_emb,
                          None if m_lorsa is None else m_lorsa[None], m_aerr)
        # targets: (row, value, the layer of the MLPs it follows, whether it follows attention layer 1's Lorsa)
        row = int(g.logit_ids[0])
        token = int(nodes.index[row])
        targets = [(row, logits[-1, token] - logits[-1].mean(), n_model, True)]
        feats, heads = g.ids_of(TRANSCODER), g.ids_of(LORSA)
        for layer in range(1, n_layers):
            here = feats[(nodes.layer[feats] == layer) & g.feature_rows[feats]]  # computed rows (not an edited one)
            for r in here[torch.argsort(-g.values[here].abs())[:4]].tolist():
                targets.append((r, pre[layer][int(nodes.pos[r]), int(nodes.index[r])], layer, layer >= 1))
        if lorsa is not None:
            for r in heads[torch.argsort(-g.values[heads].abs())[:4]].tolist():
                targets.append((r, pre["lorsa"][int(nodes.pos[r]), int(nodes.index[r])], 1, False))
        A = g.densify()
        emb, errs, aerrs = g.ids_of(EMBEDDING), g.ids_of(MLP_ERROR), g.ids_of(ATTN_ERROR)
        leaves = [m_emb, *m.values(), *m_err.values()] + ([m_lorsa, m_aerr] if lorsa is not None else [])
        for r, value, layer, after_lorsa in targets:
            # the two passes round differently: a value that cancels its terms (a logit of 0.3 from edges of
            # |sum| 9206, seed 820) carries fp32 rounding of the terms, not of itself: 1e-6 of their magnitude
            scale = float(A[r].abs().sum())
            assert torch.allclose(value.detach(), g.values[r], rtol=1e-4, atol=1e-5 + 1e-6 * scale), (r, float(value))
            grads = [torch.zeros_like(t) if d is None else d
                     for t, d in zip(leaves, torch.autograd.grad(value, leaves, retain_graph=True, allow_unused=True),
                                     strict=True)]
            d_emb, d_m, d_err = grads[0], grads[1:1 + n_layers], grads[1 + n_layers:1 + n_layers + n_model]
            src = feats[nodes.layer[feats] < layer]
            err = errs[nodes.layer[errs] < layer]
            by_hand = [d_emb[nodes.pos[emb]],
                       torch.stack([d_m[int(nodes.layer[s])][int(nodes.pos[s]), int(nodes.index[s])] for s in src])
                       if len(src) else torch.zeros(0),
                       torch.stack([d_err[int(nodes.layer[e])][int(nodes.pos[e])] for e in err])
                       if len(err) else torch.zeros(0)]
            from_graph = [A[r, emb], A[r, src], A[r, err]]
            if lorsa is not None and after_lorsa:
                by_hand += [grads[-2][nodes.pos[heads], nodes.index[heads]], grads[-1][nodes.pos[aerrs]]]
                from_graph += [A[r, heads], A[r, aerrs]]
            by_hand_t, from_graph_t = torch.cat(by_hand), torch.cat(from_graph)
            scale = float(from_graph_t.abs().max())
            assert scale > 0
            gap = float((by_hand_t - from_graph_t).abs().max())
            assert gap <= 1e-4 * scale, (r, layer, gap, scale)
    finally:
        for h in handles:
            h.remove()
