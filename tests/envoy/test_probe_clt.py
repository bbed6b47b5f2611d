"""Cross-layer transcoder (CLT) probe: the module and its splice against references written from the definition.

The definition (Ameisen et al. 2025, *Circuit Tracing*; circuit-tracer's CLT): layer ``l``'s encoder reads MLP
``l``'s input, ``acts_l = σ_l(x_l W_enc[l] + b_enc[l])``; MLP ``l'``'s output is replaced by
``Σ_{l ≤ l'} acts_l W_dec_l[:, l' − l] + b_dec[l'] (+ x_l' W_skip[l']ᵀ)``. The references below are plain PyTorch:
the activation functions written out (ReLU, JumpReLU ``x · [x > θ]``, TopK ``the k largest, then ReLU``), the
module's weights read as tensors, and the splice as Hugging Face forward hooks on the MLPs (no nnsight, no
``nnsight_lorsa`` computation). Drawn: families, CLTs over 1–3 of the 3 layers, activations, skip, the model's and
the CLT's dtypes (fp32, bf16, fp16), ``error``, a Lorsa spliced with it, and 0–4 edits at the per-layer hook points.

Half-precision comparisons leave out (hypothesis ``assume``) only a draw whose selection went another way in the
splice than in the reference at a feature within a few units of rounding of its boundary (a JumpReLU threshold,
ReLU's 0, TopK's k-th / (k+1)-th value): a different rounding order, not a wrong result. A draw past its bound
without such a flip fails.
"""

from __future__ import annotations

import copy

import nnsight
import pytest
import torch
from helpers import drawn_clt, generated, hooked, make_lorsa, random_ids, tiny_nnsight, unembed
from hypothesis import assume
from hypothesis import strategies as st

from nnsight_lorsa import CLTSet, ReplacementModel, get_adapter
from nnsight_lorsa.errors import ConfigMismatchError, LayerOutOfRangeError, ShapeError
from nnsight_lorsa.modules import CrossLayerTranscoder

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ACTIVATIONS = ("relu", "jumprelu", "topk")
D = 64  # the tiny models' d_model


# ----------------------------------------------------------------------------------------- references
def act_ref(pre: torch.Tensor, kind: str, theta: torch.Tensor | None, k: int | None) -> torch.Tensor:
    """The activation from its definition (ReLU; JumpReLU ``x · [x > θ]``; TopK: the k largest kept, then ReLU)."""
    if kind == "relu":
        return pre.clamp(min=0)
    if kind == "jumprelu":
        return pre * (pre > theta.to(pre.dtype)).to(pre.dtype)
    vals, idx = pre.topk(k, dim=-1)
    return torch.zeros_like(pre).scatter(-1, idx, vals.clamp(min=0))


def near_boundary(pre: torch.Tensor, kind: str, theta: torch.Tensor | None, k: int | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """``(*batch, d_sae)``: features within 8 units of rounding of ``dtype`` (at the row's scale) of the point
    where their selection changes."""
    tol = 8 * torch.finfo(dtype).eps * pre.abs().amax(-1, keepdim=True).clamp(min=1)
    if kind == "relu":
        return pre.abs() <= tol
    if kind == "jumprelu":
        return (pre - theta.to(pre.dtype)).abs() <= tol
    near_zero = pre.abs() <= tol  # the ReLU after the top k
    if k >= pre.shape[-1]:
        return near_zero
    kth = pre.topk(k, dim=-1).values[..., -1:]
    return near_zero | ((pre - kth).abs() <= tol)


def params_of(clt: CrossLayerTranscoder) -> dict:
    """The CLT's weights as plain tensors (what the references compute with)."""
    c = clt.cfg
    theta = [getattr(clt.activation[layer], "threshold", None) for layer in range(c.n_layers)]
    return {"W_enc": clt.W_enc.detach(), "b_enc": clt.b_enc.detach(), "b_dec": clt.b_dec.detach(),
            "W_dec": [getattr(clt, f"W_dec_{layer}").detach() for layer in range(c.n_layers)],
            "W_skip": None if clt.W_skip is None else clt.W_skip.detach(),
            "theta": [None if t is None else t.detach() for t in theta],
            "k": c.activation_params.get("k"), "kind": c.activation}


def decode_ref(p: dict, acts: list[torch.Tensor], layer: int, x: torch.Tensor | None) -> torch.Tensor:
    """MLP ``layer``'s reconstruction: every earlier-or-equal layer's decoder into it, ``b_dec``, the skip path."""
    out = p["b_dec"][layer].to(acts[0].dtype).expand(*acts[0].shape[:-1], -1)
    for source in range(layer + 1):
        out = out + acts[source] @ p["W_dec"][source][:, layer - source].to(acts[0].dtype)
    if p["W_skip"] is not None:
        out = out + x @ p["W_skip"][layer].T.to(x.dtype)
    return out


def build_clt(n_layers: int, d_sae: int, kind: str, skip: bool, seed: int, d_model: int = D) -> CrossLayerTranscoder:
    return drawn_clt(n_layers, d_sae, kind, skip, seed, d_model)


# ----------------------------------------------------------------------------------------- the module
@generated(12, 300, n_layers=st.integers(1, 4), d_model=st.integers(2, 24), d_sae=st.integers(2, 40),
           kind=st.sampled_from(ACTIVATIONS), skip=st.booleans(), dtype=st.sampled_from(list(DTYPES)),
           batch=st.lists(st.integers(1, 4), min_size=1, max_size=2), seed=st.integers(0, 2**16))
def test_the_module_computes_the_definition(n_layers, d_model, d_sae, kind, skip, dtype, batch, seed):
    """Per layer and stacked: ``hook_sae_acts_pre`` = ``x W_enc + b_enc`` (fp64 reference of the same values, within
    the dtype's rounding of the row's scale), the features = the activation's definition applied to that
    pre-activation (exact; a TopK tie at the k-th value compared as the sorted values), each reconstruction = the
    fp64 sum of every earlier-or-equal layer's decoder of those features + ``b_dec`` + skip; ``forward`` equals the
    per-layer calls; ``by_layer`` views read the same weights."""
    dt = DTYPES[dtype]
    clt = build_clt(n_layers, d_sae, kind, skip, seed, d_model).to(dt)
    p = params_of(clt)
    g = torch.Generator().manual_seed(seed + 1)
    xs = torch.randn(n_layers, *batch, d_model, generator=g).to(dt)
    eps = torch.finfo(dt).eps
    acts, pres = [], []
    for layer in range(n_layers):
        feats, pre = clt.encode_layer_and_pre(xs[layer], layer)
        want = xs[layer].double() @ p["W_enc"][layer].double() + p["b_enc"][layer].double()
        scale = (xs[layer].double().abs() @ p["W_enc"][layer].double().abs() + p["b_enc"][layer].double().abs())
        # an inner product of d_model + 1 terms rounds within (d_model + 1) · eps/2 of the terms' absolute sum (Higham,
        # "Accuracy and Stability of Numerical Algorithms" §3.1); 2 · eps failed the CI sweep: d_model 24, fp32, the
        # package bit-equal to plain torch's x @ W_enc + b_enc at 2.1 · eps · scale
        gamma = max(2.0, (d_model + 1) / 2) * eps
        assert ((pre.double() - want).abs() <= gamma * scale + 1e-30).all(), (layer, dtype)
        ref = act_ref(pre, kind, p["theta"][layer], p["k"])
        if kind == "topk" and not torch.equal(feats, ref):  # a tie at the k-th value: either is the definition
            assert torch.equal(feats.sort(-1).values, ref.sort(-1).values)
        else:
            assert torch.equal(feats, ref), (layer, kind)
        assert torch.equal(clt.encode_layer(xs[layer], layer), feats)
        acts.append(feats)
        pres.append(pre)
    for layer in range(n_layers):
        got = clt.reconstruct_layer(acts, layer, xs[layer])
        a64 = [a.double() for a in acts]
        want = decode_ref({**p, "W_dec": [w.double() for w in p["W_dec"]], "b_dec": p["b_dec"].double(),
                           "W_skip": None if p["W_skip"] is None else p["W_skip"].double()}, a64, layer,
                          xs[layer].double())
        mass = sum(a.abs() @ p["W_dec"][s][:, layer - s].double().abs() for s, a in enumerate(a64[:layer + 1]))
        mass = mass + p["b_dec"][layer].double().abs()
        if p["W_skip"] is not None:
            mass = mass + xs[layer].double().abs() @ p["W_skip"][layer].double().abs().T
        assert ((got.double() - want).abs() <= 4 * (layer + 2) * eps * mass + 1e-30).all(), (layer, dtype)
    out = clt(xs)
    per_layer = torch.stack([clt.reconstruct_layer(acts, layer, xs[layer]) for layer in range(n_layers)])
    if kind != "topk":
        assert torch.equal(out, per_layer)
    views = clt.by_layer()
    for layer, view in views.items():
        assert torch.equal(view.W_enc, p["W_enc"][layer]) and torch.equal(view.b_dec, p["b_dec"][layer])
        decs = view.decoders()
        assert sorted(decs) == list(range(layer, n_layers))
        for target, W in decs.items():
            assert torch.equal(W, p["W_dec"][layer][:, target - layer])


# ----------------------------------------------------------------------------------------- the splice
HOOKS = ("pre", "post", "recons")
EDITS = st.lists(st.tuples(st.integers(0, 2), st.sampled_from(HOOKS), st.sampled_from(("set", "scale", "add")),
                           st.sampled_from((0.0, -1.5, 2.0, 7.0)), st.integers(0, 1000), st.integers(-1, 5)),
                 max_size=4)


def apply_edit(t: torch.Tensor, op: str, value: float, unit: int, pos: int) -> None:
    """In place: ``t[:, pos, unit]`` (``pos=-1``: every position) set to / scaled by / added ``value``."""
    at = (slice(None), slice(None) if pos < 0 else pos, unit)
    if op == "set":
        t[at] = value
    elif op == "scale":
        t[at] = t[at] * value
    else:
        t[at] = t[at] + value


def reference_logits(hf, family: str, clt: CrossLayerTranscoder, ids: torch.Tensor, edits: list, error: bool,
                     lorsa=None) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The splice as forward hooks on the MLPs (and the Lorsa's attention, spliced without error terms): returns
    the unembedding output, each layer's pre-activations and features (after the edits)."""
    adapter = get_adapter(hf)
    p = params_of(clt)
    n, cdt = clt.n_layers, clt.W_enc.dtype
    state: dict = {"acts": [], "clean": [], "pre": [], "scale": 0.0, "z": []}

    def hook(module, args, out, layer):
        x = args[0].to(cdt)
        pre = x @ p["W_enc"][layer] + p["b_enc"][layer]
        clean = act_ref(pre, p["kind"], p["theta"][layer], p["k"])
        state["pre"].append(pre.detach().clone())
        pre_e = pre.clone()
        for e in edits:
            if e[0] == layer and e[1] == "pre":
                apply_edit(pre_e, *e[2:])
        acts = act_ref(pre_e, p["kind"], p["theta"][layer], p["k"])
        for e in edits:
            if e[0] == layer and e[1] == "post":
                apply_edit(acts, *e[2:])
        state["acts"].append(acts)
        state["clean"].append(clean)
        rec = decode_ref(p, state["acts"], layer, x)
        for e in edits:
            if e[0] == layer and e[1] == "recons":
                apply_edit(rec, *e[2:])
        state["scale"] = max(state["scale"], float(rec.abs().max()), float(out.abs().max()))
        if not error:
            return rec.to(out.dtype)
        clean_rec = decode_ref(p, state["clean"], layer, x)
        return (out.float() + (rec.float() - clean_rec.float())).to(out.dtype)

    handles = [hf.get_submodule(adapter.mlp_path(layer)).register_forward_hook(
        lambda m, a, o, layer=layer: hook(m, a, o, layer)) for layer in range(n)]
    seen: list = []
    handles.append(hf.get_output_embeddings().register_forward_hook(lambda m, a, o: seen.append(o)))
    try:
        with torch.no_grad():
            if lorsa is not None and not error:
                with hooked(hf, adapter, {1: lorsa}, edit=lambda z: state["z"].append(z.detach().clone()) or z):
                    hf(ids)
            else:
                hf(ids)
    finally:
        for h in handles:
            h.remove()
    return seen[0], state["pre"], state["acts"], state["scale"], state["z"]


def traced(model, family, clt, ids, edits, error, lorsa=None):
    """The same through ``CLTSet.replace`` / ``ReplacementModel.replace`` and edits on the CLT's envoy."""
    n = clt.n_layers
    pres, acts, zs = [], [], []
    with model.trace(ids):
        if lorsa is None:
            site = CLTSet(model, clt).replace(error=error)
        else:
            both = ReplacementModel(model, lorsas={1: lorsa}, transcoders=clt).replace(error=error)
            site, lorsa_site = both["transcoders"], both["lorsas"][1]
        for layer in range(n):
            if lorsa is not None and layer == 1:  # attention layer 1 runs between MLPs 0 and 1
                zs.append(lorsa_site.hook_z.output.clone().save())
            pre = site.hook_sae_acts_pre[layer].output
            pres.append(pre.clone().save())
            for e in edits:
                if e[0] == layer and e[1] == "pre":
                    apply_edit(pre, *e[2:])
            post = site.hook_sae_acts_post[layer].output
            for e in edits:
                if e[0] == layer and e[1] == "post":
                    apply_edit(post, *e[2:])
            acts.append(post.clone().save())
            rec = site.hook_sae_recons[layer].output
            for e in edits:
                if e[0] == layer and e[1] == "recons":
                    apply_edit(rec, *e[2:])
        if lorsa is not None and n == 1:
            zs.append(lorsa_site.hook_z.output.clone().save())
        logits = nnsight.save(unembed(model).output)
    return logits, pres, acts, zs


def flipped_near_boundary(clt, pres_a, pres_b, dtype) -> bool:
    """Whether some layer's selection differs between two runs' pre-activations at a feature near its boundary."""
    p = params_of(clt)
    for layer, (a, b) in enumerate(zip(pres_a, pres_b, strict=True)):
        a, b = a.to(b.dtype), b
        on_a = act_ref(a, p["kind"], p["theta"][layer], p["k"]) != 0
        on_b = act_ref(b, p["kind"], p["theta"][layer], p["k"]) != 0
        differ = on_a != on_b
        if differ.any():
            near = near_boundary(b.double(), p["kind"], p["theta"][layer], p["k"], dtype)
            near |= near_boundary(a.double(), p["kind"], p["theta"][layer], p["k"], dtype)
            if (differ & near).any():
                return True
    return False


def _models():
    cache: dict = {}

    def get(family: str, dtype: torch.dtype):
        if (family, dtype) not in cache:
            cache[(family, dtype)] = tiny_nnsight(family, dtype=dtype)
        return cache[(family, dtype)]
    return get


MODELS = _models()
FAMILIES = ("llama", "gpt2", "neox", "qwen3", "gemma2")


def run_case(family, model_dtype, clt_dtype, n_layers, kind, skip, error, edits, with_lorsa, seed, seq):
    mdt = DTYPES[model_dtype]
    cdt = mdt if clt_dtype == "model" else DTYPES[clt_dtype]
    model, hf = MODELS(family, mdt)
    clt = build_clt(n_layers, 32, kind, skip, seed).to(cdt)
    edits = [(e[0] % n_layers, e[1], e[2], e[3], e[4] % (D if e[1] == "recons" else 32),
              e[5] if e[5] < seq else -1) for e in edits]
    ids = random_ids(1, seq, seed=seed)
    lorsa = None
    if with_lorsa:
        with torch.random.fork_rng():
            torch.manual_seed(seed)  # make_lorsa draws b_D from the global generator
            lorsa = make_lorsa(hf, get_adapter(hf), 1, seed=seed).to(mdt)
    want, pre_ref, acts_ref, scale, z_ref = reference_logits(hf, family, clt, ids, edits, error, lorsa)
    got, pre_got, acts_got, z_got = traced(model, family, clt, ids, edits, error, lorsa)
    got, pre_got, acts_got = got.detach(), [t.detach() for t in pre_got], [t.detach() for t in acts_got]
    lorsa_flip = bool(z_ref) and bool(z_got) and not torch.equal(z_ref[0] != 0, z_got[0].detach() != 0)

    def exact() -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """The same hooks' splice in fp64 (model, CLT and Lorsa of the same values): the definition's logits, each
        layer's pre-activations and features."""
        hf64 = copy.deepcopy(hf).double()
        lorsa64 = None if lorsa is None else copy.deepcopy(lorsa).double()
        logits, pres, acts, *_ = reference_logits(hf64, family, copy.deepcopy(clt).double(), ids, edits, error,
                                                  lorsa64)
        return logits, pres, acts
    return clt, mdt, cdt, want, got, pre_ref, pre_got, acts_ref, acts_got, scale, lorsa_flip, exact


@generated(4, 1000, family=st.sampled_from(FAMILIES), model_dtype=st.sampled_from(list(DTYPES)),
           clt_dtype=st.sampled_from(["model", "fp32", "bf16"]), n_layers=st.integers(1, 3),
           kind=st.sampled_from(ACTIVATIONS), skip=st.booleans(), error=st.booleans(), edits=EDITS,
           with_lorsa=st.booleans(), seed=st.integers(0, 2**16), seq=st.integers(1, 7))
def test_the_splice_with_edits_equals_the_definition_by_hooks(family, model_dtype, clt_dtype, n_layers, kind, skip,
                                                              error, edits, with_lorsa, seed, seq):
    """``replace(error=)`` of a CLT over the first ``n_layers`` MLPs (1–3 of 3; the rest stay the model's), with a
    Lorsa at layer 1 or not, and edits of ``hook_sae_acts_pre`` / ``_post`` / ``hook_sae_recons`` in layer order:
    each layer's pre-activations, features and the logits equal the hooks' reference within
    ``4 · eps(coarser dtype)`` (fp32: 2e-5) of the largest of the logits, the MLP outputs and the
    reconstructions (an edit to 49 rounds at 49's scale) and 1; without edits and with ``error=True`` the logits are
    the plain model's bit for bit."""
    clt, mdt, cdt, want, got, pre_ref, pre_got, acts_ref, acts_got, scale, lorsa_flip, exact = run_case(
        family, model_dtype, clt_dtype, n_layers, kind, skip, error, edits, with_lorsa, seed, seq)
    assert got.dtype == want.dtype and got.shape == want.shape
    if error and not edits:
        assert torch.equal(got, want)
        return
    eps = max(torch.finfo(mdt).eps, torch.finfo(cdt).eps)
    eps = 4 * eps if eps > 1e-6 else 2e-5  # fp32: the earlier probes' 2e-5 of the scale (other rounding orders)
    bound = eps * max(float(want.abs().max()), scale, 1.0)
    gap = float((got.float() - want.float()).abs().max())
    acts_close = all(torch.allclose(a.float(), b.float(), rtol=0, atol=eps * max(1.0, scale, float(b.abs().max())))
                     for a, b in zip(acts_got, acts_ref, strict=True))
    pre_close = all(float((a.float() - b.float()).abs().max()) <= eps * max(1.0, scale, float(b.abs().max()))
                    for a, b in zip(pre_got, pre_ref, strict=True))  # (the pre-activations' bound, asserted below)
    if gap > bound or not acts_close or not pre_close:  # (until 2026-11-28 a flip seen only in the pre-activations
        # failed the draw: seed 439, a bf16 CLT and a Lorsa whose top-k chose other heads at layer 1)
        assume(not flipped_near_boundary(clt, pre_got, pre_ref, cdt))
        assume(not lorsa_flip)  # the Lorsa's top-k chose other heads (its rounding: probed in test_probe_internals_*)
        # Two roundings of the same splice: an edit's reconstruction and the error term are each rounded in the
        # CLT's dtype, in another order in the hooks than in the package, and the encoder of the next layer
        # multiplies that difference (the CI sweep's llama fp32 model, bf16 CLT, 3 layers, a layer-0 feature set to
        # 0: layer 1's pre-activations 0.115 apart against a bound of 0.109, the package 0.050 from the fp64
        # definition and the hooks 0.070). Then the package must be at least as close to the fp64 definition as
        # the hooks' reference in the same dtype is, within the bound, in every quantity.
        logits64, pre64, acts64 = exact()
        pairs = [(got, want, logits64, max(float(want.abs().max()), scale, 1.0))]
        pairs += [(a, b, c, max(1.0, scale, float(b.abs().max())))
                  for a, b, c in zip(pre_got, pre_ref, pre64, strict=True)]
        pairs += [(a, b, c, max(1.0, scale, float(b.abs().max())))
                  for a, b, c in zip(acts_got, acts_ref, acts64, strict=True)]
        for i, (a, b, c, s) in enumerate(pairs):
            ours, hooks = float((a.double() - c).abs().max()), float((b.double() - c).abs().max())
            assert ours <= hooks + eps * s, (i, ours, hooks, eps * s)
        return
    for layer in range(n_layers):
        s = max(1.0, scale, float(pre_ref[layer].abs().max()))
        assert float((pre_got[layer].float() - pre_ref[layer].float()).abs().max()) <= eps * s, layer
        s = max(1.0, scale, float(acts_ref[layer].abs().max()))
        assert float((acts_got[layer].float() - acts_ref[layer].float()).abs().max()) <= eps * s, layer


@pytest.mark.parametrize("layer", [0, 1, 2])
@pytest.mark.parametrize("error", [False, True])
def test_a_feature_edit_moves_exactly_the_mlps_it_writes_to(layer, error):
    """A layer-``layer`` feature steered by +5 at one position (fp32 Llama, 3-layer CLT): the MLP outputs of the
    layers before ``layer`` are bit-equal to the unedited run's at every position; at ``layer`` and after they move
    at that position (the feature's decoders into them, and what follows); the positions before it are untouched
    everywhere (causal)."""
    model, hf = MODELS("llama", torch.float32)
    clt = build_clt(3, 32, "jumprelu", False, 7)
    ids = random_ids(1, 6, seed=3)
    pos = 3

    def run(edit: bool):
        outs = []
        with model.trace(ids):
            site = CLTSet(model, clt).replace(error=error)
            for at in range(3):
                if edit and at == layer:
                    site.hook_sae_acts_post[at].output[0, pos, 5] += 5.0
                outs.append(model.get(get_adapter(model).mlp_path(at)).output.save())
        return [o.detach() for o in outs]

    clean, edited = run(False), run(True)
    for at in range(3):
        if at < layer:
            assert torch.equal(clean[at], edited[at]), at
        else:
            assert not torch.equal(clean[at][0, pos], edited[at][0, pos]), at
        assert torch.equal(clean[at][0, :pos], edited[at][0, :pos]), at
    # the edited layer's own MLP output moves by exactly the feature's decoder row into it
    delta = edited[layer][0, pos] - clean[layer][0, pos]
    want = 5.0 * clt.W_dec(layer)[5, 0].detach()
    assert torch.allclose(delta, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------- misuse
def test_misfitting_clts_are_refused_by_name():
    """A CLT of the wrong ``d_model``, one spanning more layers than the model, a per-layer transcoder in a CLTSet:
    ``ConfigMismatchError`` naming what; a layer outside the CLT: ``LayerOutOfRangeError``; features of the wrong
    width or of fewer layers than decoding needs: ``ShapeError``."""
    model, _ = MODELS("llama", torch.float32)
    with pytest.raises(ConfigMismatchError, match="d_model=32"):
        CLTSet(model, build_clt(2, 8, "relu", False, 0, d_model=32))
    with pytest.raises(ConfigMismatchError, match="spans 4 layers"):
        CLTSet(model, build_clt(4, 8, "relu", False, 0))
    clt = build_clt(2, 8, "relu", True, 0)
    for bad in (2, -1, True):  # (a float is refused by the test-time type hook first)
        with pytest.raises(LayerOutOfRangeError):
            clt.encode_layer(torch.zeros(3, D), bad)
    with pytest.raises(ShapeError, match="layers 0..1"):
        clt.decode_layer([torch.zeros(3, 8)], 1)
    with pytest.raises(ShapeError, match=r"acts\[1\] of shape \(\*batch, d_sae=8\), got \(3, 9\)"):
        clt.decode_layer([torch.zeros(3, 8), torch.zeros(3, 9)], 1)
    with pytest.raises(ShapeError, match="skip"):
        clt.reconstruct_layer([torch.zeros(3, 8)], 0)
    with pytest.raises(ShapeError):
        clt.encode_layer(torch.zeros(3, D + 1), 0)
    with pytest.raises(ShapeError):
        clt(torch.zeros(3, 2, D))  # 3 layers of inputs for a 2-layer CLT


def test_reading_a_later_layer_first_is_a_named_error():
    """Reading layer 1's features before layer 0's in one trace (out of the order the model runs them): nnsight's
    ``OutOfOrderError`` naming layer 0's hook point (docs/reliability.md, "Known limits"), and the model is left
    without hooks or modules."""
    from nnsight.intervention.interleaver import OutOfOrderError

    model, hf = MODELS("llama", torch.float32)
    clt = build_clt(2, 8, "relu", False, 0)
    before = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in hf.modules())
    names = sorted(n for n, _ in hf.named_modules())
    with pytest.raises(OutOfOrderError, match=r"clt\.hook_sae_acts_post\.0\.output"), model.trace(random_ids(1, 4)):
        site = CLTSet(model, clt).replace()
        site.hook_sae_acts_post[1].output.save()
        site.hook_sae_acts_post[0].output.save()
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in hf.modules()) == before
    assert sorted(n for n, _ in hf.named_modules()) == names


@pytest.mark.parametrize("fmt", ["nnsight_lorsa", "circuit_tracer"])
def test_saved_clts_that_do_not_fit_the_model_are_refused_by_name(fmt, tmp_path):
    """A CLT saved in our format or circuit-tracer's, loaded onto the 3-layer, 64-wide model with
    ``CLTSet.from_pretrained``: one of another ``d_model`` names the file and the width, one of 4 layers the layer
    counts (``ConfigMismatchError``); a fitting one comes back with a bit-equal forward."""
    from nnsight_lorsa.formats.registry import save

    model, _ = MODELS("llama", torch.float32)
    save(build_clt(2, 8, "jumprelu", False, 0, d_model=32), tmp_path / "narrow", format=fmt)
    with pytest.raises(ConfigMismatchError, match=r"narrow.*32.*d_model is 64"):
        CLTSet.from_pretrained(model, tmp_path / "narrow")
    save(build_clt(4, 8, "jumprelu", False, 0), tmp_path / "deep", format=fmt)
    with pytest.raises(ConfigMismatchError, match="spans 4 layers, the model has 3"):
        CLTSet.from_pretrained(model, tmp_path / "deep")
    clt = build_clt(3, 8, "jumprelu", False, 0)
    save(clt, tmp_path / "fits", format=fmt)
    xs = torch.randn(3, 2, 5, D, generator=torch.Generator().manual_seed(0))
    assert torch.equal(CLTSet.from_pretrained(model, tmp_path / "fits").clt(xs), clt(xs))
