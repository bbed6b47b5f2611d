"""Cross-layer transcoder (CLT) attribution probe: every edge into a CLT feature or a logit against the autograd
Jacobian of a frozen replacement model built by hand.

The frozen model is written here from the definition (Ameisen et al. 2025, *Circuit Tracing*; docs/attribution.md,
"What a graph is"), as Hugging Face hooks on the unmodified model: every attention pattern and every RMSNorm's
``1/rms`` frozen at the prompt's values (eager attention patched), MLP ``l < n_layers`` replaced by
``Σ_{s ≤ l} m_s ⊙ acts_s · W_dec_s[:, l − s] + b_dec[l] + x_l W_skip[l]ᵀ + m_err[l] ⊙ error_l`` with the clean
features ``acts_s = σ(x_s W_enc[s] + b_enc[s])`` held fixed and ``error_l`` the clean MLP output minus the clean
reconstruction, MLP ``l ≥ n_layers`` by ``m_err[l] ⊙`` its clean output, the embedding scaled by ``m_emb``. An
edge ``s → t`` is ``∂t/∂m_s`` at ``m = 1`` (``t`` a feature's pre-activation ``x_l' W_enc[l'] + b_enc[l']`` or a
demeaned logit). No ``nnsight_lorsa`` code runs in the reference; the CLT's weights are read as tensors.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from helpers import generated, random_ids, rm, tiny_nnsight
from hypothesis import strategies as st

from nnsight_lorsa import CLTSet
from nnsight_lorsa.attribution import attribute
from nnsight_lorsa.attribution.graph import EMBEDDING, MLP_ERROR, TRANSCODER
from nnsight_lorsa.modules import CLTConfig, CrossLayerTranscoder

FAMILIES = ("llama", "qwen2", "qwen3")
D = 64


def build_clt(n_layers: int, kind: str, skip: bool, seed: int, d_sae: int = 24) -> CrossLayerTranscoder:
    params = {"k": 4} if kind == "topk" else {}
    clt = CrossLayerTranscoder(CLTConfig(d_in=D, d_sae=d_sae, n_layers=n_layers, activation=kind,
                                         activation_params=params, skip=skip))
    g = torch.Generator().manual_seed(seed)
    clt.reset_parameters(g)
    with torch.no_grad():
        for name, p in clt.named_parameters():
            if name.endswith("threshold"):
                p.copy_(0.4 * torch.rand(p.shape, generator=g))
            elif name == "W_skip":
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            else:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return clt


def act_ref(pre: torch.Tensor, clt: CrossLayerTranscoder, layer: int) -> torch.Tensor:
    kind = clt.cfg.activation
    if kind == "relu":
        return pre.clamp(min=0)
    if kind == "jumprelu":
        theta = clt.activation[layer].threshold.detach()
        return pre * (pre > theta).to(pre.dtype)
    vals, idx = pre.topk(clt.cfg.activation_params["k"], dim=-1)
    return torch.zeros_like(pre).scatter(-1, idx, vals.clamp(min=0))


def frozen_by_hand(hf: Any, clt: CrossLayerTranscoder, ids: torch.Tensor, monkeypatch: Any):
    """Returns ``(clean acts {layer: (pos, d_sae)}, run, handles)``; ``run(m, m_err, m_emb)`` runs the frozen model
    and returns ``({layer: pre-activations (pos, d_sae)}, unembedding output (pos, vocab))``."""
    arch = importlib.import_module(type(hf).__module__)
    original = arch.eager_attention_forward
    st_: dict[str, Any] = {"mode": "record", "pattern": {}, "scale": {}, "x": {}, "mlp_out": {}}
    n, n_model = clt.n_layers, hf.config.num_hidden_layers
    W_enc, b_enc, b_dec = clt.W_enc.detach(), clt.b_enc.detach(), clt.b_dec.detach()
    W_dec = [getattr(clt, f"W_dec_{layer}").detach() for layer in range(n)]
    W_skip = None if clt.W_skip is None else clt.W_skip.detach()

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if st_["mode"] == "record":
            out, w = original(module, query, key, value, attention_mask, *args, **kwargs)
            st_["pattern"][id(module)] = w.detach()
            return out, w
        w = st_["pattern"][id(module)]
        v = arch.repeat_kv(value, module.num_key_value_groups)
        return torch.matmul(w, v).transpose(1, 2).contiguous(), w

    monkeypatch.setattr(arch, "eager_attention_forward", attention)

    def recon(layer: int, acts: dict, x: torch.Tensor) -> torch.Tensor:
        out = b_dec[layer] + sum(acts[s] @ W_dec[s][:, layer - s] for s in range(layer + 1))
        return out if W_skip is None else out + x @ W_skip[layer].T

    def norm_hook(name):
        def hook(module, args, out):
            x = args[0]
            if st_["mode"] == "record":
                st_["scale"][name] = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
                return out
            return (x.float() * st_["scale"][name]).to(x.dtype) * module.weight
        return hook

    def mlp_hook(layer):
        def hook(module, args, out):
            if st_["mode"] == "record":
                st_["x"][layer], st_["mlp_out"][layer] = args[0].detach(), out.detach()
                return out
            st_["live_x"][layer] = args[0]
            err = st_["m_err"][layer][None, :, None] * st_["error"][layer]
            if layer >= n:
                return err
            acts = {s: st_["acts"][s] * st_["m"][s] for s in range(layer + 1)}
            return recon(layer, acts, args[0]) + err
        return hook

    handles = [m.register_forward_hook(norm_hook(name)) for name, m in hf.named_modules()
               if type(m).__name__.endswith("RMSNorm")]
    handles += [hf.model.layers[layer].mlp.register_forward_hook(mlp_hook(layer)) for layer in range(n_model)]
    handles.append(hf.model.embed_tokens.register_forward_hook(
        lambda m, a, o: o if st_["mode"] == "record" else o * st_["m_emb"][None, :, None]))
    seen: list = []
    handles.append(hf.lm_head.register_forward_hook(lambda m, a, o: seen.append(o)))
    with torch.no_grad():
        hf(ids[None])
    acts = {layer: act_ref(st_["x"][layer] @ W_enc[layer] + b_enc[layer], clt, layer) for layer in range(n)}
    st_["acts"] = acts
    st_["error"] = {layer: st_["mlp_out"][layer] - (recon(layer, acts, st_["x"][layer]) if layer < n else 0)
                    for layer in range(n_model)}

    def run(m: dict, m_err: dict, m_emb: torch.Tensor):
        st_.update(mode="frozen", m=m, m_err=m_err, m_emb=m_emb, live_x={})
        seen.clear()
        hf(ids[None])
        pre = {layer: (st_["live_x"][layer] @ W_enc[layer] + b_enc[layer])[0] for layer in range(n)}
        return pre, seen[-1][0]

    return {layer: a[0] for layer, a in acts.items()}, run, handles


@generated(2, 60, family=st.sampled_from(FAMILIES), n_layers=st.integers(1, 3),
           kind=st.sampled_from(("relu", "jumprelu", "topk")), skip=st.booleans(), seed=st.integers(0, 2**16),
           seq=st.integers(2, 7))
def test_clt_edges_equal_the_jacobian_of_a_frozen_model_built_by_hand(family, n_layers, kind, skip, seed, seq):
    """``attribute`` of a CLT over the first ``n_layers`` MLPs (the rest error nodes) on tiny Llama / Qwen2 / Qwen3
    (fp32): the feature nodes are the clean active features with their activations; each computed row's value is the
    target's (pre-activation / demeaned logit); the edges into the top logit and into the 4 largest features of every
    layer ≥ 1 from every embedding, every CLT feature of an earlier layer (its decoders into every MLP in between,
    the paths through the frozen attention included) and every MLP error node of an earlier layer equal the
    Jacobian, within 1e-4 of the row's largest edge."""
    model, hf = tiny_nnsight(family)
    ids = random_ids(1, seq, seed=seed)[0]
    clt = build_clt(n_layers, kind, skip, seed)
    g = attribute(rm(model, None, CLTSet(model, clt)), ids, batch_size=64)
    with pytest.MonkeyPatch.context() as monkeypatch:
        check_edges(hf, clt, g, ids, seq, n_layers, monkeypatch)


def check_edges(hf, clt, g, ids, seq, n_layers, monkeypatch) -> None:
    acts, run, handles = frozen_by_hand(hf, clt, ids, monkeypatch)
    try:
        nodes = g.nodes
        for layer, a in acts.items():  # the node set and activations: the clean active features
            at = ((nodes.kind == TRANSCODER) & (nodes.layer == layer)).nonzero().flatten()
            dense = torch.zeros_like(a)
            dense[nodes.pos[at], nodes.index[at]] = nodes.activation[at].to(a.dtype)
            assert torch.allclose(dense, a, rtol=1e-5, atol=1e-6), layer
        n_model = hf.config.num_hidden_layers
        m = {layer: torch.ones(seq, clt.cfg.d_sae, requires_grad=True) for layer in range(n_layers)}
        m_err = {layer: torch.ones(seq, requires_grad=True) for layer in range(n_model)}
        m_emb = torch.ones(seq, requires_grad=True)
        pre, logits = run({k: v[None] for k, v in m.items()}, m_err, m_emb)
        row = int(g.logit_ids[0])
        token = int(nodes.index[row])
        targets = [(row, logits[-1, token] - logits[-1].mean(), n_model)]
        feats = g.ids_of(TRANSCODER)
        for layer in range(1, n_layers):
            here = feats[nodes.layer[feats] == layer]
            for r in here[torch.argsort(-g.values[here].abs())[:4]].tolist():
                targets.append((r, pre[layer][int(nodes.pos[r]), int(nodes.index[r])], layer))
        A = g.densify()
        emb = g.ids_of(EMBEDDING)
        errs = g.ids_of(MLP_ERROR)
        checked = 0
        for r, value, layer in targets:
            assert torch.allclose(value.detach(), g.values[r], rtol=1e-4, atol=1e-5), (r, float(value))
            src = feats[nodes.layer[feats] < layer]
            err = errs[nodes.layer[errs] < layer]
            grads = torch.autograd.grad(value, [m_emb, *m.values(), *m_err.values()], retain_graph=True,
                                        allow_unused=True)
            d_emb, d_m, d_err = grads[0], grads[1:1 + n_layers], grads[1 + n_layers:]
            zero = torch.zeros(seq)
            by_hand = torch.cat([
                d_emb[nodes.pos[emb]],
                torch.stack([d_m[int(nodes.layer[s])][int(nodes.pos[s]), int(nodes.index[s])]
                             if d_m[int(nodes.layer[s])] is not None else torch.tensor(0.0) for s in src])
                if len(src) else torch.zeros(0),
                torch.stack([(d_err[int(nodes.layer[e])] if d_err[int(nodes.layer[e])] is not None
                              else zero)[int(nodes.pos[e])] for e in err]) if len(err) else torch.zeros(0)])
            from_graph = torch.cat([A[r, emb], A[r, src], A[r, err]])
            scale = float(from_graph.abs().max())
            assert scale > 0
            gap = float((by_hand - from_graph).abs().max())
            assert gap <= 1e-4 * scale, (r, layer, gap, scale)
            checked += 1
        assert checked == len(targets)
    finally:
        for h in handles:
            h.remove()
