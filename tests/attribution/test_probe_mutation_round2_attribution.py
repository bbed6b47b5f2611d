"""Attribution tests added by the second mutation probe (docs/reliability.md, "Mutation probe, round 2"): each kills
a mutant of ``attribution/qk.py`` or ``attribution/export.py`` that the existing tests let pass. References in plain
torch from the model's own attention input, or invariants of the exported JSON."""

from __future__ import annotations

import torch
from helpers import attention_call_args, attribution_setup, random_ids, rm

from nnsight_lorsa import get_adapter
from nnsight_lorsa.attribution.qk import qk_attribution


def _rope(v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotate-half RoPE of ``v (d,)`` with the model's own ``cos, sin (d,)``."""
    half = v.shape[-1] // 2
    return v * cos + torch.cat([-v[half:], v[:half]]) * sin


def test_qk_norm_with_biases_the_bias_row_and_the_pairs_are_the_score():
    """A QK-normed Lorsa (Qwen3) with non-zero ``b_Q`` / ``b_K`` (a trained one's; the MHSA copy's are 0): the
    score is ``q·k / scale`` from the attention input by hand (RMS QK-norm, the model's own cos/sin), the pair
    terms sum to it, and the bias rows are ``w ⊙ b · rsqrt(mean(pre²) + eps)``, rotated (mutant: the bias row
    without the frozen QK-norm scale)."""
    model, hf, lorsas, tcs = attribution_setup("qwen3")
    hf.double()
    lor = lorsas[1]
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        lor.b_Q.copy_(torch.randn(lor.b_Q.shape, generator=g))
        lor.b_K.copy_(torch.randn(lor.b_K.shape, generator=g))
        lor.ln_q.w.mul_(1.0 + 0.5 * torch.rand(lor.ln_q.w.shape, generator=g))
    for m in [*lorsas.values(), *tcs.values()]:
        m.double()
    assert lor.cfg.qk_norm and lor.cfg.rotary is not None
    ids = random_ids(1, 8, seed=3)[0]
    head, qp, kp = 21, 6, 3
    r = qk_attribution(rm(model, lorsas, tcs), ids, layer=1, head=head, query_pos=qp, key_pos=kp)
    adapter = get_adapter(model)
    args, kwargs = attention_call_args(hf, adapter, 1, ids[None])
    x = adapter.attention_input(args, kwargs)[0].double()
    cos, sin = (t[0].double() for t in kwargs["position_embeddings"])
    grp = head // lor.cfg.group_size
    sides = []
    for W, b, norm, pos in ((lor.W_Q, lor.b_Q, lor.ln_q, qp), (lor.W_K, lor.b_K, lor.ln_k, kp)):
        W, b, w = W[grp].detach().double(), b[grp].detach().double(), norm.w[grp].detach().double()
        pre = x[pos] @ W + b
        s = torch.rsqrt(pre.pow(2).mean() + norm.eps)
        sides.append((_rope(w * pre * s, cos[pos], sin[pos]), _rope(w * b * s, cos[pos], sin[pos])))
    (q, q_bias), (k, k_bias) = sides
    score = float(q @ k) / lor.cfg.scale
    assert abs(float(q_bias.norm())) > 0.1  # not vacuous
    assert abs(r.score - score) <= 1e-6 * max(1.0, float(q.norm() * k.norm()) / lor.cfg.scale)
    assert abs(float(r.pairs.sum()) - r.score) <= 1e-9 * float(r.pairs.abs().sum())
    assert float((r.query[-1].double() - q_bias).abs().max()) <= 1e-6 * float(q_bias.abs().max())
    assert float((r.key[-1].double() - k_bias).abs().max()) <= 1e-6 * float(k_bias.abs().max())
    assert float((r.query.double().sum(0) - q).abs().max()) <= 1e-6 * float(q.abs().max())
    # the marginals: a query-side node with the whole key side, a key-side node with the whole query side
    # (mutant: ``query_marginal`` summed over the query nodes)
    qm = r.query.double() @ r.key.double().sum(0) / lor.cfg.scale
    km = r.key.double() @ r.query.double().sum(0) / lor.cfg.scale
    for got, want in ((r.query_marginal, qm), (r.key_marginal, km)):
        assert got.shape == (len(r.nodes) + 1,)
        assert float((got.double() - want).abs().max()) <= 1e-9 * float(want.abs().max())


def test_export_keys_follow_the_documented_table_and_dropped_nodes_take_their_links():
    """Neuronpedia export of a small Lorsa + transcoder graph: every exported node's ``feature`` is the module
    docstring's (Lorsa ``-2 − 2·cantor(L, h)``, bias ``-3 − 2·i``, errors ``-1`` / ``-2``), every ``(layer, feature,
    ctx_idx)`` key of a non-error node is distinct (the frontend's feature id); and after a kept node is dropped
    from the prune result by hand, no link names it (mutants: Lorsa ``-1 − 2·cantor``; edges kept with one end)."""
    import dataclasses

    from nnsight_lorsa.attribution import attribute, prune, to_neuronpedia
    from nnsight_lorsa.attribution.export import node_ids
    from nnsight_lorsa.attribution.graph import ATTN_ERROR, BIAS, LORSA, MLP_ERROR

    model, _, lorsas, tcs = attribution_setup("llama")
    g = attribute(rm(model, lorsas, tcs), random_ids(1, 5, seed=6)[0], batch_size=64)
    pr = prune(g, 1.0, 1.0)  # every node and edge kept
    d = to_neuronpedia(g, pr, slug="t")
    ids = node_ids(g)
    index = {nid: i for i, nid in enumerate(ids)}

    def cantor(x: int, y: int) -> int:
        return (x + y) * (x + y + 1) // 2 + y

    want = {LORSA: lambda l_, i: -2 - 2 * cantor(l_, i), BIAS: lambda l_, i: -3 - 2 * i,
            MLP_ERROR: lambda l_, i: -1, ATTN_ERROR: lambda l_, i: -2}
    seen_kinds = set()
    for n in d["nodes"]:
        i = index[n["node_id"]]
        kind = int(g.nodes.kind[i])
        if kind in want:
            seen_kinds.add(kind)
            assert n["feature"] == want[kind](int(g.nodes.layer[i]), int(g.nodes.index[i])), n
    assert seen_kinds == set(want)
    keys = [(n["layer"], n["feature"], n["ctx_idx"]) for n in d["nodes"] if "error" not in n["feature_type"]]
    assert len(keys) == len(set(keys))
    # drop one node that has links from the prune result by hand
    linked = {link["source"] for link in d["links"]} & {link["target"] for link in d["links"]}
    drop = index[sorted(linked)[0]]
    mask = pr.node_mask.clone()
    mask[drop] = False
    d2 = to_neuronpedia(g, dataclasses.replace(pr, node_mask=mask), slug="t")
    exported = {n["node_id"] for n in d2["nodes"]}
    assert ids[drop] not in exported
    assert all(link["source"] in exported and link["target"] in exported for link in d2["links"])
    assert len(d2["links"]) < len(d["links"])
