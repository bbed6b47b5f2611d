"""QK attribution against independent plain-torch references (the "QK attribution probe", docs/reliability.md).

``qk_attribution`` decomposes a Lorsa QK head's pre-softmax score ``q_i·k_j / scale`` into query-side and key-side
contributions of the prompt's graph nodes through the frozen Jacobian. Here every number is recomputed without
the attribution package's frozen machinery, on the plain Hugging Face model with PyTorch hooks, in float64:

* the score: ``q``/``k`` by hand from the attention input captured by a pre-hook (the head's QK group ``h // G``,
  ``x W + b``, per-head RMS QK-norm, RoPE with the cos/sin the model's own attention gets at that layer, scale);
* each node's query/key vector: the model run with its non-linearities frozen by hooks (every norm's scale
  from the clean input, detached; the MHSA patterns detached inside ``eager_attention_forward``; the MLP outputs
  and the Lorsa layers' attention outputs constant, as transcoder features / Lorsa heads / errors carry them),
  an additive zero leaf at every node's write site (embeddings, MLP outputs, Lorsa-layer attention outputs) and
  the biases as leaves; ``∂q_c/∂site`` by autograd, dotted with the node's own vector (``act·W_dec[f]``,
  ``z·W_O[h]``, the error ``true − reconstruction``, the embedding), a bias's ``∂q_c/∂b · b``;
* ``top_pairs`` against a full sort of the pair matrix (ties: the smaller row-major index first);
* ``attribute(..., qk_heads=n)``'s probes against direct ``qk_attribution`` calls and a hand-chosen key.
"""

from __future__ import annotations

import contextlib
import copy
import sys

import pytest
import torch
from helpers import FAMILIES, make_lorsa, make_transcoders, random_ids, rm, tiny_nnsight
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnsight_lorsa import get_adapter
from nnsight_lorsa.attribution import attribute, qk_attribution
from nnsight_lorsa.attribution.graph import ATTN_ERROR, BIAS, EMBEDDING, LOGIT, LORSA, MLP_ERROR, TRANSCODER
from nnsight_lorsa.attribution.qk import top_pairs
from nnsight_lorsa.attribution.scores import node_influence

_GEMMA_NORMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")
_OUT_PROJ = ("o_proj", "c_proj", "dense")


def _setup(family: str, layer: int, dtype: torch.dtype, with_tc: bool, upstream: bool):
    """(model, hf, lorsas, transcoders or None): a Lorsa at ``layer`` (another at layer 0 if ``upstream``),
    transcoders at 0 and 2 (a skip transcoder at 2: never upstream of a Lorsa's input here)."""
    model, hf = tiny_nnsight(family, dtype=dtype)
    adapter = get_adapter(model)
    lorsas = {layer: make_lorsa(hf.float(), adapter, layer, seed=layer)}
    if upstream and layer > 0:
        lorsas[0] = make_lorsa(hf.float(), adapter, 0, seed=7)
    hf.to(dtype)
    tcs = make_transcoders((0, 2), skip_layer=2) if with_tc else None
    for m in [*lorsas.values(), *(tcs or {}).values()]:
        m.to(dtype)
    return model, hf, lorsas, tcs


def _hidden(args, kwargs):
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def _frozen_norm(module, x: torch.Tensor) -> torch.Tensor:
    """The norm with its scale computed from the detached input: linear in ``x`` (bias included)."""
    if isinstance(module, torch.nn.LayerNorm) or hasattr(module, "normalized_shape"):
        xc = x - x.mean(-1, keepdim=True)
        s = torch.rsqrt(xc.detach().pow(2).mean(-1, keepdim=True) + module.eps)
        out = xc * s
        if module.weight is not None:
            out = out * module.weight
        return out + module.bias if module.bias is not None else out
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    s = torch.rsqrt(x.detach().pow(2).mean(-1, keepdim=True) + eps)
    gain = 1 + module.weight if type(module).__name__ in _GEMMA_NORMS else module.weight
    return x * s * gain


def _rope(v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE on the first ``cos.shape[-1]`` coordinates of ``v`` (the rest passed through)."""
    r = cos.shape[-1]
    rot, rest = v[..., :r], v[..., r:]
    half = torch.cat([-rot[..., r // 2:], rot[..., :r // 2]], -1)
    return torch.cat([rot * cos + half * sin, rest], -1)


def _side(lorsa, x: torch.Tensor, group: int, pos: int, rope, side: str, with_input: bool = True) -> torch.Tensor:
    """The head's query (``side="q"``) or key at ``pos`` from the attention input ``x (P, d)``; ``with_input``
    False: the bias part alone (``x`` replaced by 0, the QK-norm scale still the prompt's)."""
    W = (lorsa.W_Q if side == "q" else lorsa.W_K)[group].detach()
    b = (lorsa.b_Q if side == "q" else lorsa.b_K)[group].detach()
    full = x[pos] @ W + b
    v = full if with_input else b
    if lorsa.cfg.qk_norm:
        norm = lorsa.ln_q if side == "q" else lorsa.ln_k
        s = torch.rsqrt(full.detach().pow(2).mean() + norm.eps)
        v = norm.w[group].detach() * v * s
    if rope is not None:
        cos, sin = rope
        v = _rope(v, cos[pos], sin[pos])
    return v


@contextlib.contextmanager
def _frozen_reference_hooks(hf, adapter, lorsas, tcs, record: dict):
    """Hooks that run ``hf`` as the frozen replacement model's linear map and record what the reference needs."""
    handles = []
    patched = []
    n_layers = adapter.n_layers
    try:
        # the MHSA patterns: q and k detached inside the eager attention of the model's modeling module
        mod = sys.modules[type(adapter.attention_module(hf, 0)).__module__]
        orig = mod.eager_attention_forward

        def frozen_attention(module, query, key, value, *args, **kwargs):
            return orig(module, query.detach(), key.detach(), value, *args, **kwargs)

        mod.eager_attention_forward = frozen_attention
        patched.append((mod, orig))
        for name, m in hf.named_modules():
            if "norm" in type(m).__name__.lower() and ("q_norm" not in name and "k_norm" not in name):
                def norm_hook(module, args, out, name=name):
                    y = _frozen_norm(module, args[0])
                    assert torch.allclose(y, out, rtol=1e-5, atol=1e-6), name  # the frozen norm is the norm
                    return y
                handles.append(m.register_forward_hook(norm_hook))
        for path in (adapter.embed_path, getattr(adapter, "pos_embed_path", None)):
            if path:
                def emb_hook(module, args, out, path=path):
                    leaf = torch.zeros_like(out, requires_grad=True)
                    record.setdefault("emb", []).append((leaf, out.detach()))
                    return out + leaf
                handles.append(adapter.get_module(hf, path).register_forward_hook(emb_hook))
        for layer in range(n_layers):
            attn = adapter.attention_module(hf, layer)

            def attn_pre(module, args, kwargs, layer=layer):
                record[("attn_in", layer)] = _hidden(args, kwargs)
                pe = kwargs.get("position_embeddings")
                record[("rope", layer)] = None if pe is None else (pe[0][0].detach(), pe[1][0].detach())

            handles.append(attn.register_forward_pre_hook(attn_pre, with_kwargs=True))
            if layer in lorsas:
                def attn_post(module, args, out, layer=layer):
                    leaf = torch.zeros_like(out[0], requires_grad=True)
                    record[("attn_leaf", layer)] = leaf
                    record[("attn_out", layer)] = out[0].detach()
                    return (out[0].detach() + leaf, *out[1:])
                handles.append(attn.register_forward_hook(attn_post))
            mlp = adapter.get_module(hf, adapter.mlp_path(layer))

            def mlp_pre(module, args, layer=layer):
                record[("mlp_in", layer)] = args[0].detach()

            def mlp_post(module, args, out, layer=layer):
                leaf = torch.zeros_like(out, requires_grad=True)
                record[("mlp_leaf", layer)] = leaf
                record[("mlp_out", layer)] = out.detach()
                return out.detach() + leaf
            handles += [mlp.register_forward_pre_hook(mlp_pre), mlp.register_forward_hook(mlp_post)]
        yield
    finally:
        for h in handles:
            h.remove()
        for m, o in patched:
            m.eager_attention_forward = o


def _bias_params(hf, adapter, layer: int) -> dict[str, list[torch.Tensor]]:
    """``{bias node name: [parameters]}`` of one layer's MHSA and norm biases (the names the graph uses)."""
    attn = adapter.attention_module(hf, layer)
    out: dict[str, list[torch.Tensor]] = {f"L{layer}.attn.b_V": [], f"L{layer}.attn.b_O": []}
    for name, p in attn.named_parameters():
        if name.endswith("bias") and "norm" not in name:
            out[f"L{layer}.attn.b_O" if name.split(".")[0] in _OUT_PROJ else f"L{layer}.attn.b_V"].append(p)
    for key, path in (("attn_norm", adapter.attention_norm_path(layer)), ("mlp_norm", adapter.mlp_norm_path(layer))):
        b = getattr(adapter.get_module(hf, path), "bias", None) if path else None
        out[f"L{layer}.{key}.bias"] = [] if b is None else [b]
    return out


def reference(hf, adapter, lorsas, tcs, ids: torch.Tensor, layer: int, group: int, qp: int, kp: int, nodes):
    """float64 ``(score, query (n+1, d_qk), key (n+1, d_qk), q, k)`` for the NodeTable ``nodes`` (the last rows: the
    ``b_Q``/``b_K`` terms), from hooks on a float64 copy of ``hf``; and the hand scores of every key ``≤ qp``."""
    hf = copy.deepcopy(hf).double()
    lorsas = {k_: copy.deepcopy(v).double() for k_, v in lorsas.items()}
    tcs = {k_: copy.deepcopy(v).double() for k_, v in (tcs or {}).items()}
    assert all(not hasattr(tc, "W_skip") for l_, tc in tcs.items() if l_ < layer)  # a skip path would be linear
    record: dict = {}
    with torch.enable_grad(), _frozen_reference_hooks(hf, adapter, lorsas, tcs, record):
        hf(ids[None])
        x = record[("attn_in", layer)][0]
        rope = record[("rope", layer)]
        lorsa = lorsas[layer]
        q = _side(lorsa, x, group, qp, rope, "q")
        k = _side(lorsa, x, group, kp, rope, "k")
        scores = torch.stack([_side(lorsa, x, group, qp, rope, "q") @ _side(lorsa, x, group, j, rope, "k")
                              for j in range(qp + 1)]).detach() / lorsa.cfg.scale
        P = ids.numel()
        n_layers = adapter.n_layers
        # every node's vector at its site
        emb = [(leaf, val[0]) for leaf, val in record["emb"]]
        sites, vectors = [], {}
        biases = {}
        for l_ in range(n_layers):
            biases.update(_bias_params(hf, adapter, l_))
            if l_ in lorsas:
                lo = lorsas[l_]
                xin = record[("attn_in", l_)].detach()
                with torch.no_grad():
                    z = lo.activation(lo.compute_z_pre(xin))[0][0]  # (P, n_ov)
                    out = lo.decode(z[None])[0]
                vectors[("lorsa", l_)] = (z, lo.W_O.detach(), record[("attn_out", l_)][0] - out,
                                          lo.b_D.detach())
                sites.append(("attn", l_))
            if l_ in tcs:
                tc = tcs[l_]
                with torch.no_grad():
                    acts = tc.encode(record[("mlp_in", l_)])[0]
                    rec = acts @ tc.W_dec + tc.b_dec
                vectors[("tc", l_)] = (acts, tc.W_dec.detach(), record[("mlp_out", l_)][0] - rec, tc.b_dec.detach())
            else:
                vectors[("tc", l_)] = (None, None, record[("mlp_out", l_)][0], None)
        leaves = [leaf for leaf, _ in emb]
        leaves += [record[("attn_leaf", l_)] for l_ in sorted(lorsas)]
        leaves += [record[("mlp_leaf", l_)] for l_ in range(n_layers)]
        names = sorted(k_ for k_, v in biases.items() if v)
        params = [p for n_ in names for p in biases[n_]]
        sides = []
        for vec, bias_part in ((q, _side(lorsa, x, group, qp, rope, "q", False)),
                               (k, _side(lorsa, x, group, kp, rope, "k", False))):
            rows = torch.zeros(len(nodes) + 1, vec.numel(), dtype=torch.float64)
            rows[-1] = bias_part.detach()
            for c in range(vec.numel()):
                grads = torch.autograd.grad(vec[c], leaves + params, retain_graph=True, allow_unused=True)
                grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves + params, strict=True)]
                ge = grads[:len(emb)]
                ga = dict(zip(sorted(lorsas), grads[len(emb):len(emb) + len(lorsas)], strict=True))
                gm = grads[len(emb) + len(lorsas):len(emb) + len(lorsas) + n_layers]
                gp = grads[len(leaves):]
                bias_val = {}
                i = 0
                for n_ in sorted(k_ for k_, v in biases.items() if v):
                    bias_val[n_] = sum(float((g * p.detach()).sum()) for g, p in
                                       zip(gp[i:i + len(biases[n_])], biases[n_], strict=True))
                    i += len(biases[n_])
                for lo_l in lorsas:
                    bias_val[f"L{lo_l}.lorsa.b_D"] = float((ga[lo_l][0] @ vectors[("lorsa", lo_l)][3]).sum())
                for l_ in tcs:
                    bias_val[f"L{l_}.transcoder.b_dec"] = float((gm[l_][0] @ vectors[("tc", l_)][3]).sum())
                for a in range(len(nodes)):
                    kind, l_, p_, idx = (int(t[a]) for t in (nodes.kind, nodes.layer, nodes.pos, nodes.index))
                    if kind == EMBEDDING:
                        val = sum(float(g[0, p_] @ v[p_]) for g, (_, v) in zip(ge, emb, strict=True))
                    elif kind == TRANSCODER:
                        acts, W, _, _ = vectors[("tc", l_)]
                        val = float(acts[p_, idx] * (gm[l_][0, p_] @ W[idx]))
                    elif kind == MLP_ERROR:
                        val = float(gm[l_][0, p_] @ vectors[("tc", l_)][2][p_])
                    elif kind == LORSA:
                        z, W, _, _ = vectors[("lorsa", l_)]
                        val = float(z[p_, idx] * (ga[l_][0, p_] @ W[idx]))
                    elif kind == ATTN_ERROR:
                        val = float(ga[l_][0, p_] @ vectors[("lorsa", l_)][2][p_])
                    elif kind == BIAS:
                        val = bias_val.get(nodes.bias_names[idx], 0.0)
                    else:
                        raise AssertionError(kind)
                    rows[a, c] = val
            # the reference is complete: its rows sum to the vector
            assert torch.allclose(rows.sum(0), vec.detach(), rtol=1e-9, atol=1e-9 * float(rows.abs().sum()))
            sides.append(rows)
    assert x.shape[0] == P
    return float(q.detach() @ k.detach()) / lorsa.cfg.scale, sides[0], sides[1], scores


def _case(draw):
    family = draw(st.sampled_from(FAMILIES))
    layer = draw(st.integers(0, 2))
    P = draw(st.integers(2, 7))
    qp = draw(st.integers(0, P - 1))
    kp = draw(st.sampled_from([0, qp, draw(st.integers(0, qp))]))
    return dict(family=family, layer=layer, P=P, qp=qp, kp=kp, seed=draw(st.integers(0, 50)),
                fp64=draw(st.booleans()), with_tc=draw(st.booleans()), upstream=draw(st.booleans()),
                head=draw(st.integers(0, 63)), batch_size=draw(st.sampled_from([None, 5, 13])))


def _check_against_reference(c):
    dtype = torch.float64 if c["fp64"] else torch.float32
    model, hf, lorsas, tcs = _setup(c["family"], c["layer"], dtype, c["with_tc"], c["upstream"])
    adapter = get_adapter(model)
    ids = random_ids(1, c["P"], seed=c["seed"])[0]
    r = qk_attribution(rm(model, lorsas, tcs), ids, layer=c["layer"], head=c["head"], query_pos=c["qp"],
                       key_pos=c["kp"], batch_size=c.get("batch_size"))
    lorsa = lorsas[c["layer"]]
    group = c["head"] // (lorsa.cfg.n_ov_heads // lorsa.cfg.n_qk_heads)
    assert r.probe.group == group
    score, query, key, _ = reference(hf, adapter, lorsas, tcs, ids, c["layer"], group, c["qp"], c["kp"], r.nodes)
    # fp64: the model's own fp32 RoPE tables and norms (transformers computes them in fp32) bound the agreement
    tol = 1e-6 if c["fp64"] else 1e-4
    # 1. the score is the Lorsa's pre-softmax score of that head and pair (to rounding of |q|·|k|)
    size = float(query.sum(0).norm() * key.sum(0).norm()) / lorsa.cfg.scale
    assert abs(r.score - score) <= (1e-6 if c["fp64"] else 2e-5) * max(1.0, size), (r.score, score, c)
    # 2. every node's query and key vector, and so every pair term
    for got, want, what in ((r.query, query, "query"), (r.key, key, "key")):
        err = (got.double() - want).abs().max(1).values
        worst = int(err.argmax())
        assert float(err.max()) <= tol * max(1.0, float(want.abs().max())), (what, r.label(worst), c,
                                                                              got[worst], want[worst])
    pairs = query @ key.T / lorsa.cfg.scale
    assert float((r.pairs.double() - pairs).abs().max()) <= tol * max(1.0, float(pairs.abs().max()))


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_qk_attribution_equals_the_plain_torch_reference(data):
    """The score and every node's query/key contribution against hand computations (module docstring)."""
    _check_against_reference(_case(data.draw))


@pytest.mark.slow
@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_qk_attribution_equals_the_plain_torch_reference_sweep(data):
    _check_against_reference(_case(data.draw))


# ---------------------------------------------------------------- 3. top_pairs


def _reference_top(pairs: torch.Tensor, k: int) -> list[int]:
    """Row-major indices of the ``k`` largest ``|pairs|``: larger first, equal ones by smaller index."""
    flat = pairs.flatten().abs().tolist()
    return sorted(range(len(flat)), key=lambda i: (-flat[i], i))[:k]


@settings(max_examples=150, deadline=None)
@given(n_q=st.integers(1, 12), n_k=st.integers(1, 12), d=st.integers(1, 4), k=st.integers(1, 30),
       chunk=st.integers(1, 13), scale=st.sampled_from([1.0, 2.0, 0.5]), fp64=st.booleans(), seed=st.integers(0, 99))
def test_top_pairs_are_the_k_largest_with_ties_by_index(n_q, n_k, d, k, chunk, scale, fp64, seed):
    """``top_pairs``: exactly the ``k`` largest ``|pair|`` (small integer vectors: exact products, many ties, the
    smaller row-major (query, key) index first), their signed values, and the pairs' sum and absolute sum, for
    any chunk size; ``QKAttribution.top_pairs`` picks the same."""
    from nnsight_lorsa.attribution.graph import NodeTable
    from nnsight_lorsa.attribution.qk import QKAttribution, QKProbe

    g = torch.Generator().manual_seed(seed)
    dtype = torch.float64 if fp64 else torch.float32
    query = torch.randint(-2, 3, (n_q, d), generator=g).to(dtype)
    key = torch.randint(-2, 3, (n_k, d), generator=g).to(dtype)
    pairs = query.double() @ key.double().T / scale
    want = _reference_top(pairs, k)
    idx, val, total, mass = top_pairs(query, key, scale, k, chunk)
    assert [int(a) * n_k + int(b) for a, b in idx.tolist()] == want
    assert val.tolist() == [float(pairs.flatten()[i]) for i in want]
    assert total == float(pairs.sum()) and mass == float(pairs.abs().sum())
    # the method on a decomposition (its nodes: one per query row; the last row / column is the bias term)
    key = torch.randint(-2, 3, (n_q, d), generator=g).to(dtype)  # both sides over the same nodes
    pairs = query.double() @ key.double().T / scale
    nodes = NodeTable.make(EMBEDDING, -1, torch.arange(n_q - 1), 0)
    r = QKAttribution(nodes=nodes, query=query, key=key, pairs=(query @ key.T) / scale, score=0.0,
                      probe=QKProbe(0, 0, 0, 0))
    assert r.top_pairs(k) == [(r.label(i // n_q), r.label(i % n_q), float(pairs.flatten()[i]))
                              for i in _reference_top(pairs, k)]


# ---------------------------------------------------------------- 4. qk_for_graph (attribute(..., qk_heads=n))


def _hand_scores(hf, adapter, lorsa, ids: torch.Tensor, layer: int, group: int, qp: int) -> torch.Tensor:
    """float64 scores of query ``qp`` against every key ``≤ qp`` from the attention input a plain pre-hook sees."""
    hf = copy.deepcopy(hf).double()
    lorsa = copy.deepcopy(lorsa).double()
    seen = {}

    def pre(module, args, kwargs):
        pe = kwargs.get("position_embeddings")
        seen.update(x=_hidden(args, kwargs)[0], rope=None if pe is None else (pe[0][0], pe[1][0]))

    handle = adapter.attention_module(hf, layer).register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad():
            hf(ids[None])
            q = _side(lorsa, seen["x"], group, qp, seen["rope"], "q")
            return torch.stack([q @ _side(lorsa, seen["x"], group, j, seen["rope"], "k")
                                for j in range(qp + 1)]) / lorsa.cfg.scale
    finally:
        handle.remove()


def _node_key(nodes, i: int, zero_positions: int):
    """A node's identity across two layouts of one prompt; a feature / head before ``zero_positions`` is carried
    by its position's error node there."""
    kind, layer, pos, idx = (int(t[i]) for t in (nodes.kind, nodes.layer, nodes.pos, nodes.index))
    if kind == BIAS:
        return ("bias", nodes.bias_names[idx])
    if kind in (TRANSCODER, LORSA) and pos < zero_positions:
        return (MLP_ERROR if kind == TRANSCODER else ATTN_ERROR, layer, pos, -1)
    return (kind, layer, pos, idx)


def _check_qk_for_graph(c):
    dtype = torch.float64 if c["fp64"] else torch.float32
    model, hf, lorsas, tcs = _setup(c["family"], c["layer"], dtype, c["with_tc"], c["upstream"])
    adapter = get_adapter(model)
    ids = random_ids(1, c["P"], seed=c["seed"])[0]
    r = rm(model, lorsas, tcs)
    z = min(c["zero_positions"], c["P"] - 1)
    g = attribute(r, ids, batch_size=64, qk_heads=c["n_heads"], zero_positions=z)
    qk = g.qk
    # the heads: by influence on the logits (ties: the smaller node id), distinct (layer, QK group, query)
    heads = g.ids_of(LORSA).tolist()
    infl = node_influence(g)
    chosen, seen = [], set()
    for i in sorted(heads, key=lambda i: (-float(infl[i]), i)):
        layer, pos, head = int(g.nodes.layer[i]), int(g.nodes.pos[i]), int(g.nodes.index[i])
        key = (layer, head // lorsas[layer].cfg.group_size, pos)
        if key not in seen:
            seen.add(key)
            chosen.append([i, *key])
    chosen = chosen[:c["n_heads"]]
    if not chosen:
        assert not qk
        return
    assert qk["probe"][:, [0, 1, 2, 3]].tolist() == chosen
    tol = 1e-9 if c["fp64"] else 1e-4
    sources = {_node_key(g.nodes, i, 0): i for i in range(g.n_nodes) if int(g.nodes.kind[i]) != LOGIT}
    for n, (node, layer, group, qp, kp) in enumerate(qk["probe"].tolist()):
        lorsa = lorsas[layer]
        # the key: the one the head attends to most from the query (hand-computed pattern row)
        scores = _hand_scores(hf, adapter, lorsa, ids, layer, group, qp)
        top2 = scores.topk(min(2, scores.numel())).values
        if top2.numel() < 2 or float(top2[0] - top2[1]) > 1e-3:
            assert kp == int(scores.argmax()), (kp, scores)
        # against the hand score: the model's own norms and RoPE tables are fp32 even in an fp64 model
        hand_tol = 1e-6 if c["fp64"] else 1e-4
        assert abs(float(qk["score"][n]) - float(scores[kp])) <= hand_tol * max(1.0, float(scores.abs().max()))
        # the stored decomposition is the direct call's, its nodes mapped onto the graph's
        direct = qk_attribution(r, ids, layer=layer, head=int(g.nodes.index[node]), query_pos=qp, key_pos=kp)
        assert abs(direct.score - float(qk["score"][n])) <= tol * max(1.0, abs(direct.score))
        to = torch.zeros(len(direct.nodes) + 1, g.n_nodes + 1, dtype=torch.float64)
        for a in range(len(direct.nodes)):
            b = sources.get(_node_key(direct.nodes, a, z))
            if b is not None:
                to[a, b] = 1.0
        to[-1, -1] = 1.0
        Q, K = to.T @ direct.query.double(), to.T @ direct.key.double()
        scale = lorsa.cfg.scale
        q_total, k_total = direct.query.double().sum(0), direct.key.double().sum(0)
        mass = float((direct.query.double() @ direct.key.double().T).abs().sum()) / scale
        for name, want in (("query_marginal", Q @ k_total / scale), ("key_marginal", K @ q_total / scale)):
            assert float((qk[name][n].double() - want).abs().max()) <= tol * max(1.0, mass), name
        pairs = Q @ K.T / scale
        k = qk["pair_value"].shape[1]
        want_idx = _reference_top(pairs, k)
        m = g.n_nodes + 1
        want_pairs = [[i // m if i // m < g.n_nodes else g.n_nodes, i % m] for i in want_idx]
        got_pairs = qk["pair_index"][n].tolist()[:len(want_idx)]
        # near-equal pair terms may swap between the two computations' rounding: compare values, then indices
        got_v = qk["pair_value"][n].double()[:len(want_idx)]
        want_v = pairs.flatten()[want_idx]
        assert float((got_v - want_v).abs().max()) <= tol * max(1.0, mass)
        if c["fp64"]:
            assert got_pairs == want_pairs
        assert float(qk["pair_sum_error"][n]) < (1e-10 if c["fp64"] else 1e-5)


def _graph_case(draw):
    return dict(family=draw(st.sampled_from(FAMILIES)), layer=draw(st.integers(1, 2)), P=draw(st.integers(3, 7)),
                seed=draw(st.integers(0, 50)), fp64=draw(st.booleans()), with_tc=draw(st.booleans()),
                upstream=draw(st.booleans()), zero_positions=draw(st.integers(0, 2)), n_heads=draw(st.integers(1, 4)))


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_qk_for_graph_equals_direct_qk_attribution(data):
    """``attribute(..., qk_heads=n, zero_positions=z)``: the heads chosen (influence order, distinct (layer, QK
    group, query)), each key (the hand pattern's argmax), score, marginals and top pairs equal a direct
    ``qk_attribution`` of the same pair, its nodes mapped onto the graph's (a feature before ``z``: its error
    node)."""
    _check_qk_for_graph(_graph_case(data.draw))


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_qk_for_graph_equals_direct_qk_attribution_sweep(data):
    _check_qk_for_graph(_graph_case(data.draw))


def test_qk_heads_tied_in_influence_are_taken_in_node_order(monkeypatch):
    """Heads of equal influence are taken by node id (``argsort`` alone orders ties in no documented way: on the CPU
    it scrambles ~50 equal values), so the traced heads of a graph do not depend on the sort's backend."""
    from nnsight_lorsa.attribution import scores

    monkeypatch.setattr(scores, "node_influence", lambda g: torch.zeros(g.n_nodes, dtype=torch.float64))
    model, hf, lorsas, tcs = _setup("llama", 2, torch.float32, True, True)
    g = attribute(rm(model, lorsas, tcs), random_ids(1, 8, seed=4)[0], batch_size=64, qk_heads=3)
    chosen, seen = [], set()
    for i in g.ids_of(LORSA).tolist():
        key = (int(g.nodes.layer[i]), int(g.nodes.index[i]) // 8, int(g.nodes.pos[i]))
        if key not in seen:
            seen.add(key)
            chosen.append([i, *key])
    assert len(g.ids_of(LORSA)) > 40
    assert g.qk["probe"][:, :4].tolist() == chosen[:3]
