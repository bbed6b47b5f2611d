"""Path patching vs a plain-PyTorch-hook reference (direct + MLP-mediated effect), and vs total patching.

Senders: MHSA heads, Lorsa heads, SAE and transcoder features, and groups mixing them."""

from __future__ import annotations

import pytest
import torch
from helpers import LAYER, N_LAYERS, make_lorsa, make_sae, make_transcoder, random_ids, tiny_nnsight

from nnsight_lorsa import LorsaSet, SAESet, TranscoderSet, get_adapter
from nnsight_lorsa.errors import ConfigMismatchError, ShapeError
from nnsight_lorsa.patching import (
    Feature,
    LorsaHead,
    MHSAHead,
    ReplacementModel,
    TargetIndexError,
    logit_difference,
    mean_activations,
)
from nnsight_lorsa.patching.experiments import activation_patching
from nnsight_lorsa.patching.path_patching import HeadInput, path_patching

CORRECT, INCORRECT = torch.tensor([5, 7]), torch.tensor([9, 11])


def metric(logits):
    return logit_difference(logits, CORRECT, INCORRECT)


def o_proj(hf, layer):
    return hf.model.layers[layer].self_attn.o_proj


@torch.no_grad()
def reference(hf, adapter, clean, corrupt, layer, head, *, freeze=True, receiver=None, sender_delta=None,
              q_module="q_proj"):
    """Wang et al. path patching with forward hooks: sender MHSA head ``(layer, head)`` takes its
    corrupt value (or, with ``sender_delta(x_attn_out) -> delta``, the attention output of ``layer``
    is shifted), every later o_proj output is frozen to its clean value; with ``receiver=(R, h)``
    only head h's q input at layer R (its columns of ``q_module``'s output) sees the change."""
    d = adapter.head_dim
    cols = slice(head * d, (head + 1) * d)
    rec: dict = {}
    hs = [o_proj(hf, L).register_forward_hook(lambda m, a, o, L=L: rec.__setitem__(("out", L), o.clone()))
          for L in range(N_LAYERS)]
    hf(clean)
    for h in hs:
        h.remove()
    h = o_proj(hf, layer).register_forward_pre_hook(lambda m, a: rec.__setitem__("src", a[0][..., cols].clone()))
    hf(corrupt)
    h.remove()

    def patch_in(m, a):
        x = a[0].clone()
        x[..., cols] = rec["src"]
        return (x,)

    handles = []
    if sender_delta is None:
        handles.append(o_proj(hf, layer).register_forward_pre_hook(patch_in))
    else:
        handles.append(adapter.attention_module(hf, layer).register_forward_hook(
            lambda m, a, o: (o[0] + sender_delta(), *o[1:])))
    last = N_LAYERS if receiver is None else receiver[0]
    for L in range(layer + 1, last if freeze else layer + 1):
        handles.append(o_proj(hf, L).register_forward_hook(lambda m, a, o, L=L: rec[("out", L)]))
    if receiver is not None:
        q = getattr(hf.model.layers[receiver[0]].self_attn, q_module)
        handles.append(q.register_forward_hook(lambda m, a, o: rec.__setitem__("q", o.clone())))
    logits = hf(clean).logits
    for h in handles:
        h.remove()
    if receiver is None:
        return metric(logits)
    qc = slice(receiver[1] * d, (receiver[1] + 1) * d)

    def patch_q(m, a, o):
        o = o.clone()
        o[..., qc] = rec["q"][..., qc]
        return o

    h = getattr(hf.model.layers[receiver[0]].self_attn, q_module).register_forward_hook(patch_q)
    logits = hf(clean).logits
    h.remove()
    return metric(logits)


@pytest.fixture(scope="module")
def llama():
    model, hf = tiny_nnsight("llama")
    return model, hf, get_adapter(model)


def prompts():
    clean = random_ids(batch=2, seq=10, seed=1)
    corrupt = random_ids(batch=2, seq=10, seed=2)
    return clean, corrupt


@torch.no_grad()
def test_path_to_logits_matches_hook_reference_and_differs_from_total(llama):
    model, hf, adapter = llama
    r = ReplacementModel(model)
    clean, corrupt = prompts()
    senders = [MHSAHead(0, 1), MHSAHead(1, 2), MHSAHead(N_LAYERS - 1, 3)]
    res = path_patching(r, clean, senders, corrupt=corrupt, metric=metric, groups_per_trace=2)
    assert res.patched.shape == (3, 2)
    torch.testing.assert_close(res.clean, metric(hf(clean).logits), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(res.corrupt, metric(hf(corrupt).logits), atol=1e-4, rtol=1e-4)
    for i, s in enumerate(senders):
        want = reference(hf, adapter, clean, corrupt, s.layer, s.head)
        torch.testing.assert_close(res.patched[i], want, atol=1e-4, rtol=1e-4)
    # total effect: no freezing = activation patching corrupt -> clean (and the hook reference)
    total = path_patching(r, clean, senders, corrupt=corrupt, metric=metric, freeze=False)
    act = activation_patching(r, corrupt, clean, senders, metric=metric)
    torch.testing.assert_close(total.patched, act.patched, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(total.patched[0], reference(hf, adapter, clean, corrupt, 0, 1, freeze=False),
                               atol=1e-4, rtol=1e-4)
    # a layer-0 head's effect is mediated by later attention: path != total; the last layer: path == total
    assert (total.patched[0] - res.patched[0]).abs().max() > 1e-2
    torch.testing.assert_close(total.patched[2], res.patched[2], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_receiver_q_input_matches_reference(llama):
    model, hf, adapter = llama
    r = ReplacementModel(model)
    clean, corrupt = prompts()
    res = path_patching(r, clean, [MHSAHead(0, 2)], corrupt=corrupt, metric=metric,
                        receivers=[HeadInput(MHSAHead(2, 1), "q")])
    want = reference(hf, adapter, clean, corrupt, 0, 2, receiver=(2, 1))
    torch.testing.assert_close(res.patched[0], want, atol=1e-4, rtol=1e-4)
    logits_only = path_patching(r, clean, [MHSAHead(0, 2)], corrupt=corrupt, metric=metric)
    assert (logits_only.patched[0] - res.patched[0]).abs().max() > 1e-3


@torch.no_grad()
def test_olmo2_receiver_q_input_is_the_normed_projection():
    """OLMo-2's QK-norm spans every head's projection: a receiver head's q input is its columns of ``q_norm``'s
    output (only that head's query changes); patching its ``q_proj`` columns would move every head's query through
    the shared denominator — another result."""
    model, hf = tiny_nnsight("olmo2")
    adapter = get_adapter(model)
    clean, corrupt = prompts()
    res = path_patching(ReplacementModel(model), clean, [MHSAHead(0, 2)], corrupt=corrupt, metric=metric,
                        receivers=[HeadInput(MHSAHead(2, 1), "q")])
    want = reference(hf, adapter, clean, corrupt, 0, 2, receiver=(2, 1), q_module="q_norm")
    torch.testing.assert_close(res.patched[0], want, atol=1e-4, rtol=1e-4)
    before_norm = reference(hf, adapter, clean, corrupt, 0, 2, receiver=(2, 1))
    assert (before_norm - want).abs().max() > 1e-3


@torch.no_grad()
def test_lorsa_sender_zero_ablation_matches_reference(llama):
    model, hf, adapter = llama
    lorsa = make_lorsa(hf, adapter)
    r = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: lorsa}))
    clean, corrupt = prompts()
    # the head most active on the last position of row 0
    captured = {}
    h = adapter.attention_module(hf, LAYER).register_forward_hook(
        lambda m, a, kw, o: captured.__setitem__("x", adapter.attention_input(a, kw)), with_kwargs=True)
    hf(clean)
    h.remove()
    _, cache = lorsa(captured["x"], return_cache=True)
    head = int(cache.z[0, -1].argmax())
    res = path_patching(r, clean, [LorsaHead(LAYER, head), MHSAHead(0, 1)], mode="zero", metric=metric)

    def delta():
        return -cache.z[..., head, None] * lorsa.W_O[head]

    want = reference(hf, adapter, clean, corrupt, LAYER, 0, sender_delta=delta)
    torch.testing.assert_close(res.patched[0], want, atol=1e-4, rtol=1e-4)
    assert (res.patched[0] - res.clean).abs().max() > 1e-4
    # an MHSA sender before the spliced Lorsa: its site is frozen via hook_out + hook_error, same as plain MHSA
    plain = path_patching(ReplacementModel(model), clean, [MHSAHead(0, 1)], mode="zero", metric=metric)
    torch.testing.assert_close(res.patched[1], plain.patched[0], atol=1e-4, rtol=1e-4)


def test_bad_targets_raise_before_running(llama):
    model, hf, adapter = llama
    r = ReplacementModel(model)
    clean, corrupt = prompts()
    calls = []
    h = hf.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        with pytest.raises(TargetIndexError):
            path_patching(r, clean, [MHSAHead(0, 99)], corrupt=corrupt, metric=metric)
        with pytest.raises(ConfigMismatchError):
            path_patching(r, clean, [MHSAHead(1, 0)], corrupt=corrupt, metric=metric,
                          receivers=[HeadInput(MHSAHead(1, 2), "q")])
        with pytest.raises(ConfigMismatchError):
            path_patching(r, clean, [MHSAHead(0, 0)], metric=metric)  # patch mode without corrupt
        with pytest.raises(ConfigMismatchError):
            path_patching(r, clean, [LorsaHead(1, 0)], mode="zero", metric=metric)  # no LorsaSet
        with pytest.raises(ShapeError):
            path_patching(r, clean, [MHSAHead(0, 0)], corrupt=corrupt[:, :5], metric=metric)
        with pytest.raises(ConfigMismatchError):
            path_patching(r, clean, [MHSAHead(0, 0)], mode="mean", means={}, metric=metric)
    finally:
        h.remove()
    assert not calls
    gpt2, _ = tiny_nnsight("gpt2")
    with pytest.raises(ConfigMismatchError):
        path_patching(ReplacementModel(gpt2), clean, [MHSAHead(0, 0)], corrupt=corrupt, metric=metric,
                      receivers=[HeadInput(MHSAHead(2, 0), "q")])


# ---------------------------------------------------------------- feature senders
@torch.no_grad()
def run_hooked(hf, ids, hooks):
    """``hf(ids).logits`` with ``(module, "pre" | "fwd" | "fwd_kw", fn)`` hooks installed for this call only."""
    handles = []
    for module, kind, fn in hooks:
        if kind == "pre":
            handles.append(module.register_forward_pre_hook(fn))
        else:
            handles.append(module.register_forward_hook(fn, with_kwargs=kind == "fwd_kw"))
    try:
        return hf(ids).logits
    finally:
        for h in handles:
            h.remove()


def clean_o_proj(hf, ids):
    """``{("in" | "out", layer): value}`` of every o_proj on ``ids``."""
    rec = {}
    hooks = []
    for L in range(N_LAYERS):
        hooks.append((o_proj(hf, L), "pre", lambda m, a, L=L: rec.__setitem__(("in", L), a[0].clone())))
        hooks.append((o_proj(hf, L), "fwd", lambda m, a, o, L=L: rec.__setitem__(("out", L), o.clone())))
    run_hooked(hf, ids, hooks)
    return rec


def freeze_hooks(hf, rec, layers):
    """Reference freezing: these layers' o_proj outputs are their clean values."""
    return [(o_proj(hf, L), "fwd", lambda m, a, o, L=L: rec[("out", L)]) for L in layers]


def mlp_in(adapter):
    return lambda args, kwargs, out: adapter.mlp_input(args, kwargs)


def site_out(args, kwargs, out):
    return out[0] if isinstance(out, tuple) else out


def feature_acts(hf, ids, module, coder, read_x):
    """The coder's features ``(batch, pos, d_sae)`` computed with plain PyTorch from ``module``'s call on ``ids``."""
    rec = {}
    run_hooked(hf, ids, [(module, "fwd_kw", lambda m, a, kw, o: rec.__setitem__("x", read_x(a, kw, o)))])
    return coder.encode(rec["x"])


def layer0_transcoder_acts(hf, adapter, tcs, clean, corrupt):
    """``(transcoder, mlp module, clean features, corrupt features)`` of layer 0's transcoder."""
    tc, mlp = tcs[0], adapter.mlp_module(hf, 0)
    return tc, mlp, feature_acts(hf, clean, mlp, tc, mlp_in(adapter)), feature_acts(hf, corrupt, mlp, tc,
                                                                                 mlp_in(adapter))


def feature_edit(module, coder, index, value, read_x):
    """Hook setting feature ``index`` to ``value`` (error term held: output += decode(edited) − decode(acts))."""
    def hook(m, args, kwargs, out):
        acts = coder.encode(read_x(args, kwargs, out))
        edited = acts.clone()
        edited[..., index] = value
        delta = coder.decode(edited) - coder.decode(acts)
        return (out[0] + delta, *out[1:]) if isinstance(out, tuple) else out + delta
    return (module, "fwd_kw", hook)


def most_changed(acts_a, acts_b):
    """The feature whose activation at the last position (where the metric reads) differs most between two runs."""
    return int((acts_a - acts_b)[:, -1].abs().sum(0).argmax())


@pytest.fixture(scope="module")
def coders(llama):
    model, hf, adapter = llama
    tcs = {0: make_transcoder(skip=False, seed=3), N_LAYERS - 1: make_transcoder(skip=False, seed=4)}
    saes = {"model.layers.0": make_sae(seed=5), f"model.layers.{N_LAYERS - 1}": make_sae(seed=6),
            "model.layers.1.input_layernorm": make_sae(seed=7), "model.layers.0.self_attn": make_sae(seed=8),
            "model.layers.0.post_attention_layernorm": make_sae(seed=9), "model.layers.0.mlp": make_sae(seed=10),
            "model.embed_tokens": make_sae(seed=11), "model.norm": make_sae(seed=12)}
    r = ReplacementModel(model, saes=SAESet(model, saes), transcoders=TranscoderSet(model, tcs))
    return r, tcs, saes


@pytest.mark.parametrize("mode", ["patch", "zero", "mean"])
@torch.no_grad()
def test_transcoder_feature_sender_matches_hook_reference(llama, coders, mode):
    model, hf, adapter = llama
    r, tcs, _ = coders
    clean, corrupt = prompts()
    tc, mlp, a_clean, a_corrupt = layer0_transcoder_acts(hf, adapter, tcs, clean, corrupt)
    i = most_changed(a_clean, a_corrupt) if mode == "patch" else most_changed(a_clean, 0 * a_clean)
    feat = Feature(0, i, kind="transcoder")
    means = mean_activations(r, [feat], corrupt) if mode == "mean" else None
    res = path_patching(r, clean, [feat], corrupt=corrupt if mode == "patch" else None, mode=mode, means=means,
                        metric=metric)
    value = {"patch": a_corrupt[..., i], "zero": 0.0, "mean": means[feat] if means else None}[mode]
    torch.testing.assert_close(res.clean, metric(hf(clean).logits), atol=1e-5, rtol=1e-5)
    # layer 0's MLP feeds layers 1, 2: their attention outputs are frozen to the clean ones
    rec = clean_o_proj(hf, clean)
    want = metric(run_hooked(hf, clean, [feature_edit(mlp, tc, i, value, mlp_in(adapter)),
                                         *freeze_hooks(hf, rec, range(1, N_LAYERS))]))
    torch.testing.assert_close(res.patched[0], want, atol=1e-5, rtol=1e-5)
    assert (res.patched[0] - res.clean).abs().max() > 1e-3  # the edit moves the metric
    # total effect: no freezing = the hook edit alone (and for mode="patch" = activation patching)
    total = path_patching(r, clean, [feat], corrupt=corrupt if mode == "patch" else None, mode=mode, means=means,
                          metric=metric, freeze=False)
    free = metric(run_hooked(hf, clean, [feature_edit(mlp, tc, i, value, mlp_in(adapter))]))
    torch.testing.assert_close(total.patched[0], free, atol=1e-5, rtol=1e-5)
    assert (total.patched[0] - res.patched[0]).abs().max() > 1e-3  # later attention mediates part of it
    if mode == "patch":
        act = activation_patching(r, corrupt, clean, [feat], metric=metric)
        torch.testing.assert_close(total.patched, act.patched, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_sae_feature_sender_matches_hook_reference_to_logits_and_receivers(llama, coders):
    model, hf, adapter = llama
    r, _, saes = coders
    clean, corrupt = prompts()
    rec = clean_o_proj(hf, clean)
    # the residual stream after layer 0 (= hook_resid_pre of layer 1) feeds layer 1's attention on;
    # layer 1's attention norm feeds layer 1's attention only (to the logits it has no unfrozen path);
    # layer 0's attention output, MLP norm and MLP output: layer 1's attention on; the embedding: every layer's
    # attention (a receiver in layer 0 sees it); the final norm: none (nothing frozen)
    cases = [("model.embed_tokens", 0, (0,)), ("model.norm", N_LAYERS, ()),
             ("model.layers.0", 1, (1, 2)), ("model.layers.0.self_attn", 1, ()),
             ("model.layers.0.post_attention_layernorm", 1, ()), ("model.layers.0.mlp", 1, ()),
             ("model.layers.1.input_layernorm", 1, (1,))]
    for site, first, layers in cases:
        sae, module = saes[site], hf.get_submodule(site)
        a_clean = feature_acts(hf, clean, module, sae, site_out)
        a_corrupt = feature_acts(hf, corrupt, module, sae, site_out)
        i = most_changed(a_clean, a_corrupt)
        feat = Feature(site, i)
        edit = feature_edit(module, sae, i, a_corrupt[..., i], site_out)
        res = path_patching(r, clean, [feat], corrupt=corrupt, metric=metric)
        want = metric(run_hooked(hf, clean, [edit, *freeze_hooks(hf, rec, range(first, N_LAYERS))]))
        torch.testing.assert_close(res.patched[0], want, atol=1e-5, rtol=1e-5)
        if site != "model.layers.1.input_layernorm":
            assert (res.patched[0] - res.clean).abs().max() > 1e-3
        for R in layers:  # only layer R's value inputs (all heads) see the change
            v_proj = hf.model.layers[R].self_attn.v_proj
            seen = {}
            run_hooked(hf, clean, [edit, *freeze_hooks(hf, rec, range(first, R)),
                                   (v_proj, "fwd", lambda m, a, o, seen=seen: seen.__setitem__("v", o.clone()))])
            want_r = metric(run_hooked(hf, clean, [(v_proj, "fwd", lambda m, a, o, seen=seen: seen["v"])]))
            got = path_patching(r, clean, [feat], corrupt=corrupt, metric=metric,
                                receivers=[HeadInput(MHSAHead(R, h), "v") for h in range(adapter.n_heads)])
            torch.testing.assert_close(got.patched[0], want_r, atol=1e-5, rtol=1e-5)
            assert (got.patched[0] - got.clean).abs().max() > 1e-3
    # the layer-0 output feature moves the logits through the residual stream; the norm feature cannot
    assert (res.patched[0] - res.clean).abs().max() < 1e-5


@torch.no_grad()
def test_a_receiver_before_the_first_attention_after_a_final_norm_sender_is_refused(llama, coders):
    """No attention runs after the final norm: a receiver in the last layer is refused by name (it was accepted with
    the sender placed one layer early, and its result was the clean metric)."""
    r, _, _ = coders
    clean, corrupt = prompts()
    with pytest.raises(ConfigMismatchError, match="must be in a later layer"):
        path_patching(r, clean, [Feature("model.norm", 0)], corrupt=corrupt, metric=metric,
                      receivers=[HeadInput(MHSAHead(N_LAYERS - 1, 0), "v")])


@torch.no_grad()
def test_feature_in_last_layer_path_equals_activation_patching(llama, coders):
    model, hf, adapter = llama
    r, tcs, saes = coders
    clean, corrupt = prompts()
    last = N_LAYERS - 1
    tc_acts = [feature_acts(hf, x, adapter.mlp_module(hf, last), tcs[last], mlp_in(adapter)) for x in (clean, corrupt)]
    site = f"model.layers.{last}"
    sae_acts = [feature_acts(hf, x, hf.get_submodule(site), saes[site], site_out) for x in (clean, corrupt)]
    feats = [Feature(last, most_changed(*tc_acts), kind="transcoder"), Feature(site, most_changed(*sae_acts))]
    pp = path_patching(r, clean, feats, corrupt=corrupt, metric=metric)
    act = activation_patching(r, corrupt, clean, feats, metric=metric)
    torch.testing.assert_close(pp.patched, act.patched, atol=1e-5, rtol=1e-5)
    assert (pp.patched - pp.clean).abs().amax(-1).min() > 1e-3


@torch.no_grad()
def test_groups_mixing_heads_and_features_match_hook_reference(llama, coders):
    """A group freezes every attention site after its earliest sender except the senders themselves."""
    model, hf, adapter = llama
    r, tcs, _ = coders
    clean, corrupt = prompts()
    tc, mlp, a_clean, a_corrupt = layer0_transcoder_acts(hf, adapter, tcs, clean, corrupt)
    i = most_changed(a_clean, a_corrupt)
    d = adapter.head_dim
    rec, bad = clean_o_proj(hf, clean), clean_o_proj(hf, corrupt)
    group = (Feature(0, i, kind="transcoder"), MHSAHead(1, 2))
    res = path_patching(r, clean, [group, group[:1], group[1:]], corrupt=corrupt, metric=metric)

    def head_only(m, a):  # layer 1's heads frozen to clean, but head 2 (the sender) corrupt
        x = rec[("in", 1)].clone()
        x[..., 2 * d:3 * d] = bad[("in", 1)][..., 2 * d:3 * d]
        return (x,)

    want = metric(run_hooked(hf, clean, [feature_edit(mlp, tc, i, a_corrupt[..., i], mlp_in(adapter)),
                                         (o_proj(hf, 1), "pre", head_only), *freeze_hooks(hf, rec, [2])]))
    torch.testing.assert_close(res.patched[0], want, atol=1e-5, rtol=1e-5)
    assert (res.patched[0] - res.patched[1]).abs().max() > 1e-3
    assert (res.patched[0] - res.patched[2]).abs().max() > 1e-3
    torch.testing.assert_close(res.patched[2], reference(hf, adapter, clean, corrupt, 1, 2), atol=1e-5, rtol=1e-5)

    # a Lorsa head with an SAE feature before it (zero mode): hook_z frozen but the head, hook_error frozen
    lorsa = make_lorsa(hf, adapter)
    rl = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: lorsa}), saes=r.saes)
    sae, site = r.saes["model.layers.0"], hf.get_submodule("model.layers.0")
    j = most_changed(feature_acts(hf, clean, site, sae, site_out), 0)
    captured = {}
    run_hooked(hf, clean, [(adapter.attention_module(hf, LAYER), "fwd_kw",
                            lambda m, a, kw, o: captured.__setitem__("x", (adapter.attention_input(a, kw), o[0])))])
    _, cache = lorsa(captured["x"][0], return_cache=True)
    head = int(cache.z[0, -1].argmax())
    out = captured["x"][1] - cache.z[..., head, None] * lorsa.W_O[head]
    pp = path_patching(rl, clean, [(Feature("model.layers.0", j), LorsaHead(LAYER, head))], mode="zero", metric=metric)
    want = metric(run_hooked(hf, clean, [feature_edit(site, sae, j, 0.0, site_out),
                                         (adapter.attention_module(hf, LAYER), "fwd", lambda m, a, o: (out, *o[1:])),
                                         *freeze_hooks(hf, rec, range(LAYER + 1, N_LAYERS))]))
    torch.testing.assert_close(pp.patched[0], want, atol=1e-5, rtol=1e-5)
    assert (pp.patched[0] - pp.clean).abs().max() > 1e-3


def test_bad_feature_senders_raise_before_running(llama, coders):
    model, hf, adapter = llama
    r, _, _ = coders
    clean, corrupt = prompts()
    calls = []
    h = hf.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        with pytest.raises(TargetIndexError):  # d_sae = 128
            path_patching(r, clean, [Feature(0, 128, kind="transcoder")], corrupt=corrupt, metric=metric)
        with pytest.raises(TargetIndexError):
            path_patching(r, clean, [MHSAHead(0, 0), (Feature("model.layers.0", -1), MHSAHead(1, 0))],
                          corrupt=corrupt, metric=metric)
        with pytest.raises(ConfigMismatchError, match="later layer"):  # layer 1's MLP runs after its attention
            path_patching(r, clean, [Feature(0, 3, kind="transcoder")], corrupt=corrupt, metric=metric,
                          receivers=[HeadInput(MHSAHead(0, 1), "q")])
        with pytest.raises(ConfigMismatchError, match="later layer"):  # after layer 1 = before layer 2
            path_patching(r, clean, [Feature("model.layers.0", 3), (Feature(f"model.layers.{N_LAYERS - 1}", 3),)],
                          corrupt=corrupt, metric=metric, receivers=[HeadInput(MHSAHead(N_LAYERS - 1, 1), "k")])
        with pytest.raises(ConfigMismatchError, match="later layer"):
            path_patching(r, clean, [(MHSAHead(0, 0), Feature(0, 3, kind="transcoder"))], corrupt=corrupt,
                          metric=metric, receivers=[HeadInput(MHSAHead(0, 2), "v")])
        with pytest.raises(ConfigMismatchError, match="no SAE at site"):
            path_patching(r, clean, [Feature("model.layers.1", 0)], corrupt=corrupt, metric=metric)
        with pytest.raises(ConfigMismatchError, match="means"):
            path_patching(r, clean, [Feature(0, 3, kind="transcoder")], mode="mean", means={}, metric=metric)
        with pytest.raises(ConfigMismatchError, match="TranscoderSet"):
            path_patching(ReplacementModel(model), clean, [Feature(0, 3, kind="transcoder")], mode="zero",
                          metric=metric)
        inner = ReplacementModel(model, saes=SAESet(model, {"model.layers.1.self_attn.q_proj": make_sae()}))
        with pytest.raises(ConfigMismatchError, match="cannot place"):  # inside the attention module
            path_patching(inner, clean, [Feature("model.layers.1.self_attn.q_proj", 0)], mode="zero", metric=metric)
        both = ReplacementModel(model, saes=SAESet(model, {"model.layers.0.mlp": make_sae()}),
                                transcoders=r.transcoders)
        with pytest.raises(ConfigMismatchError, match="separate calls"):  # both replace layer 0's MLP output
            path_patching(both, clean, [Feature("model.layers.0.mlp", 0), Feature(0, 3, kind="transcoder")],
                          mode="zero", metric=metric)
        lr = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: make_lorsa(hf, adapter)}),
                              transcoders=r.transcoders)
        with pytest.raises(ConfigMismatchError, match="cannot be frozen around an MHSA head"):
            path_patching(lr, clean, [(Feature(0, 3, kind="transcoder"), MHSAHead(LAYER, 0)), LorsaHead(LAYER, 0)],
                          mode="zero", metric=metric)
    finally:
        h.remove()
    assert not calls
