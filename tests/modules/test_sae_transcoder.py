"""SAEs, (skip) transcoders and cross-layer transcoders: modules vs formulas, and in-trace replacement."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import (
    D,
    head_logits,
    hooked,
    make_clt,
    make_lorsa,
    make_sae,
    make_transcoder,
    module_state,
    random_ids,
    tiny_nnsight,
    unembed,
)

from nnsight_lorsa import (
    CLTSet,
    CrossLayerTranscoder,
    LorsaError,
    LorsaSet,
    SAESet,
    TranscoderSet,
    get_adapter,
)
from nnsight_lorsa.errors import (
    CheckpointError,
    ConfigMismatchError,
    LayerOutOfRangeError,
    ShapeError,
    TraceOrderError,
)
from nnsight_lorsa.modules import (
    BatchTopK,
    CLTConfig,
    JumpReLU,
    ReLU,
    SAEConfig,
    TopK,
    TranscoderConfig,
    make_activation,
)

FAMILIES = ("llama", "neox", "gpt2", "gemma2", "olmo2", "phi3", "gemma")
LAYER = 1



def dense_ref(coder, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit formula: ``acts = σ((x − b_dec?) W_enc + b_enc)``, ``out = acts W_dec + b_dec (+ x W_skipᵀ)``."""
    cfg = coder.cfg
    xin = x - coder.b_dec if getattr(cfg, "apply_b_dec_to_input", False) else x
    pre = xin @ coder.W_enc + coder.b_enc
    if cfg.activation == "relu":
        acts = pre.clamp_min(0)
    elif cfg.activation == "jumprelu":
        acts = torch.where(pre > coder.activation.threshold, pre, 0.0)
    else:  # topk: the k largest per row, ReLU'd
        k = cfg.activation_params["k"]
        kth = pre.topk(k, -1).values[..., -1:]
        acts = torch.where(pre >= kth, pre, 0.0).clamp_min(0)
    out = acts @ coder.W_dec + coder.b_dec
    if hasattr(coder, "W_skip"):
        out = out + x @ coder.W_skip.T
    return acts, out


# ----------------------------------------------------------------- modules
@pytest.mark.parametrize("activation,params", [("relu", {}), ("topk", {"k": 5}), ("jumprelu", {})])
@pytest.mark.parametrize("centre", [True, False])
@torch.no_grad()
def test_sae_matches_formula(activation, params, centre):
    sae = make_sae(d_in=24, d_sae=40, activation=activation, activation_params=params, apply_b_dec_to_input=centre)
    x = torch.randn(3, 7, 24)
    acts, out = dense_ref(sae, x)
    assert torch.allclose(sae.encode(x), acts, atol=1e-6)
    assert torch.allclose(sae.decode(acts), acts @ sae.W_dec + sae.b_dec, atol=1e-6)
    assert torch.allclose(sae(x), out, atol=1e-5)
    assert sae.W_enc.shape == (24, 40) and sae.W_dec.shape == (40, 24) and sae.b_dec.shape == (24,)
    assert torch.allclose(sae(x[0, 0][None]), out[0, 0][None], atol=1e-5)  # any batch shape


@pytest.mark.parametrize("skip", [False, True])
@torch.no_grad()
def test_transcoders_match_formula(skip):
    tc = make_transcoder(skip=skip, d_in=24, d_out=16, d_sae=40)
    x = torch.randn(2, 5, 24)
    acts, out = dense_ref(tc, x)
    assert tc.W_dec.shape == (40, 16) and (not skip or tc.W_skip.shape == (16, 24))
    assert torch.allclose(tc.encode(x), acts, atol=1e-6)
    assert torch.allclose(tc(x), out, atol=1e-5)
    assert ((tc.encode(x) > 0).sum(-1) <= 8).all()


@torch.no_grad()
def test_fold_decoder_norm_and_batchtopk_export_keep_outputs():
    sae = make_sae(d_in=16, d_sae=32)  # jumprelu
    with torch.no_grad():  # decoder norms far from 1 (mutation probe 2026-11-28: near-unit norms let a fold that
        sae.W_dec.mul_(torch.linspace(0.3, 3.0, 32)[:, None])  # divided the threshold pass)
    x = torch.randn(16, 16)
    before = sae(x)
    sae.fold_decoder_norm_()
    assert torch.allclose(sae.W_dec.norm(dim=-1), torch.ones(32), atol=1e-6)
    assert torch.allclose(sae(x), before, atol=1e-5)
    btk = make_sae(d_in=16, d_sae=32, activation="batchtopk", activation_params={"k": 4})
    btk.train()
    btk(torch.randn(64, 16))
    btk.eval()
    before = btk(x)
    btk.to_jumprelu_()
    assert isinstance(btk.activation, JumpReLU) and btk.cfg.activation == "jumprelu"
    assert torch.equal(btk(x), before)
    with pytest.raises(CheckpointError, match="not 'batchtopk'"):
        btk.to_jumprelu_()


def clt_reference(clt: CrossLayerTranscoder, xs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CLT of Ameisen et al. 2025 (*Circuit Tracing*) term by term: every (source, target) pair decoded on its
    own."""
    n = clt.n_layers
    acts = []
    for layer in range(n):
        pre = xs[layer] @ clt.W_enc[layer] + clt.b_enc[layer]
        acts.append(torch.where(pre > clt.activation[layer].threshold, pre, 0.0))
    outs = []
    for target in range(n):
        out = clt.b_dec[target].expand_as(xs[target]).clone()
        for source in range(target + 1):
            out = out + acts[source] @ getattr(clt, f"W_dec_{source}")[:, target - source, :]
        if clt.W_skip is not None:
            out = out + xs[target] @ clt.W_skip[target].T
        outs.append(out)
    return torch.stack(acts), torch.stack(outs)


@pytest.mark.parametrize("skip", [False, True])
@torch.no_grad()
def test_clt_matches_formula_and_layout(skip):
    clt = make_clt(n_layers=4, skip=skip)
    assert [getattr(clt, f"W_dec_{layer}").shape for layer in range(4)] == [(48, 4 - layer, D) for layer in range(4)]
    assert clt.W_enc.shape == (4, D, 48) and clt.b_dec.shape == (4, D)
    xs = torch.randn(4, 2, 5, D)
    acts, outs = clt_reference(clt, xs)
    assert (acts > 0).any() and (acts == 0).any()
    assert torch.allclose(clt.encode(xs), acts, atol=1e-6)
    assert torch.allclose(clt(xs), outs, atol=1e-5)
    per_layer = [clt.encode_layer(xs[layer], layer) for layer in range(4)]
    assert torch.allclose(clt.reconstruct_layer(per_layer, 2, xs[2]), outs[2], atol=1e-5)


def test_module_bad_input():
    sae = make_sae()
    with pytest.raises(ShapeError, match=r"\(\*batch, 64\)"):
        sae(torch.randn(2, 3, 32))
    with pytest.raises(ShapeError):
        sae.decode(torch.randn(2, 3, 64))
    clt = make_clt()
    with pytest.raises(LayerOutOfRangeError):
        clt.encode_layer(torch.randn(2, D), 3)
    with pytest.raises(ShapeError, match="n_layers=3"):
        clt(torch.randn(2, 2, 4, D))
    with pytest.raises(ShapeError, match="layers 0..2"):
        clt.decode_layer([torch.zeros(1, 48)], 2)
    with pytest.raises(CheckpointError, match="unknown activation"):
        SAEConfig(d_in=4, d_sae=8, activation="gelu")
    with pytest.raises(CheckpointError, match="d_sae"):
        SAEConfig(d_in=4, d_sae=0)
    with pytest.raises(CheckpointError, match="bad parameters"):
        make_activation("topk", 8, {"kk": 3})
    assert TranscoderConfig.from_dict(TranscoderConfig(d_in=4, d_sae=8).to_dict()).d_out == 4
    with pytest.raises(CheckpointError, match="unknown keys"):
        SAEConfig.from_dict({"d_in": 4, "d_sae": 8, "oops": 1})


# ------------------------------------------------------------- activations
def test_relu_and_topk():
    x = torch.randn(4, 6, 20, requires_grad=True)
    assert torch.equal(ReLU()(x), x.relu())
    y = TopK(3)(x)
    kth = x.detach().topk(3, -1).values[..., -1:]
    assert torch.equal(y, torch.where(x >= kth, x, 0.0).relu())
    assert ((y != 0).sum(-1) <= 3).all()
    y.sum().backward()
    assert torch.equal(x.grad, ((x >= kth) & (x > 0)).float())  # gradient to kept entries only
    assert torch.equal(TopK(2)(torch.tensor([[-1.0, -2.0, -3.0]])), torch.zeros(1, 3))  # ReLU'd


def test_batchtopk_training_inference_and_export():
    torch.manual_seed(0)
    act = make_activation("batchtopk", 30, {"k": 4, "threshold_lr": 0.5})
    assert isinstance(act, BatchTopK)
    x = torch.randn(16, 30)
    y = act(x)  # training mode: k·n over the whole batch
    assert int((y > 0).sum()) == 4 * 16
    kept = x.flatten().topk(4 * 16).values
    assert torch.equal(torch.sort(y[y > 0]).values, torch.sort(kept).values)
    per_row = (y > 0).sum(-1)
    assert per_row.float().mean() == 4 and per_row.max() > per_row.min()  # rows vary
    assert float(act.threshold) == pytest.approx(float(kept.min()))
    first = float(act.threshold)
    x2 = torch.randn(16, 30)
    y2 = act(x2)
    assert float(act.threshold) == pytest.approx(0.5 * first + 0.5 * float(y2[y2 > 0].min()))
    act.eval()  # inference: per-row threshold, independent of the batch
    z = torch.randn(5, 30)
    theta = float(act.threshold)
    assert torch.equal(act(z), torch.where(z > theta, z, 0.0))
    assert torch.equal(act(z[:2]), act(z)[:2])
    jump = act.to_jumprelu()
    assert jump.threshold.shape == (30,) and torch.all(jump.threshold == theta)
    assert torch.equal(jump(z), act(z))
    fresh = BatchTopK(2, 30).eval()  # no estimate yet: the batch rule
    assert int((fresh(z) > 0).sum()) == 2 * 5
    fresh.set_threshold(0.25)
    assert torch.equal(fresh(z), torch.where(z > 0.25, z, 0.0))


def test_jumprelu_forward_and_straight_through_gradients():
    eps = 0.1
    act = JumpReLU(3, threshold=torch.tensor([0.2, 0.5, 0.8]), bandwidth=eps)
    # x[1, 1] == θ_1 exactly: H(0) = 0, as SAELens's ``pre > threshold`` (mutation probe 2026-11-28: ``>=`` passed)
    x = torch.tensor([[0.1, 0.52, 0.9], [0.25, 0.5, 0.79], [-1.0, 0.46, 0.84]], requires_grad=True)
    y = act(x)
    theta = act.threshold.detach()
    assert torch.equal(y, torch.where(x > theta, x, 0.0)) and y[1, 1] == 0
    g = torch.randn(3, 3)
    y.backward(g)
    rect = ((x - theta).abs() < eps / 2).float()
    assert torch.allclose(x.grad, g * (x > theta).float())
    assert torch.allclose(act.threshold.grad, (-(theta / eps) * rect * g).sum(0))  # eq. 11
    act.threshold.grad = None
    l0 = act.l0(x)
    assert torch.equal(l0, (x > theta).float().sum(-1))
    l0.sum().backward()
    assert torch.allclose(act.threshold.grad, (-(1 / eps) * rect).sum(0))  # eq. 12


def test_jumprelu_pseudo_gradients_estimate_the_true_derivative():
    """For x ~ U(0, 1): d/dθ E[H(x − θ)] = −p(θ) = −1 and d/dθ E[x H(x − θ)] = −θ p(θ) = −θ."""
    torch.manual_seed(0)
    x = torch.rand(200_000, 2)
    act = JumpReLU(2, threshold=torch.tensor([0.3, 0.6]), bandwidth=0.05)
    act.l0(x).mean().backward()
    assert torch.allclose(act.threshold.grad, torch.tensor([-1.0, -1.0]), atol=0.05)
    act.threshold.grad = None
    act(x).sum(-1).mean().backward()
    assert torch.allclose(act.threshold.grad, torch.tensor([-0.3, -0.6]), atol=0.05)


# ------------------------------------------------------------ in a trace
@contextlib.contextmanager
def forward_hooks(*pairs):
    handles = [module.register_forward_hook(fn, with_kwargs=True) for module, fn in pairs]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def coder_hook(coder, *, reads_output: bool, edit=None, error: bool = False, seen: list | None = None):
    """Plain-PyTorch reference of a spliced SAE/transcoder: edited output (+ error from the clean one)."""
    def hook(module, args, kwargs, output):
        true = output[0] if isinstance(output, tuple) else output
        x = true if reads_output else args[0]
        acts = coder.encode(x)
        if seen is not None:
            seen.append(acts)
        live = acts if edit is None else edit(acts.clone())
        skip = coder.skip(x)
        out = coder.decode(live) + (0 if skip is None else skip)
        if error:
            out = out + (true - (coder.decode(acts) + (0 if skip is None else skip)))
        return (out, *output[1:]) if isinstance(output, tuple) else out
    return hook


def clt_hooks(hf, adapter, clt, edit=None, error: bool = False):
    """Reference CLT splice: hooks on every MLP sharing the features of earlier layers."""
    clean, live = [], []

    def make(layer):
        def hook(module, args, kwargs, output):
            x = args[0]
            acts = clt.encode_layer(x, layer)
            clean.append(acts)
            live.append(acts if edit is None else edit(layer, acts.clone()))
            out = clt.reconstruct_layer(live, layer, x)
            return out + (output - clt.reconstruct_layer(clean, layer, x)) if error else out
        return hook

    return forward_hooks(*[(adapter.mlp_module(hf, layer), make(layer)) for layer in range(clt.n_layers)])


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request):
    model, hf = tiny_nnsight(request.param)
    return model, hf, get_adapter(model)


def zero_feature(f):
    def edit(acts):
        acts[..., f] = 0
        return acts
    return edit


def busiest(acts: torch.Tensor) -> int:
    return int((acts > 0).flatten(0, -2).sum(0).argmax())


@torch.no_grad()
def test_transcoder_in_trace(fam):
    model, hf, adapter = fam
    tc = make_transcoder()
    tcs = TranscoderSet(model, {LAYER: tc})
    ids = random_ids()
    ref = head_logits(hf, ids)
    seen: list = []
    with forward_hooks((adapter.mlp_module(hf, LAYER), coder_hook(tc, reads_output=False, seen=seen))):
        hf(ids)
    f = busiest(seen[0])
    for error in (False, True):
        for edit in (None, zero_feature(f)):
            with forward_hooks((adapter.mlp_module(hf, LAYER), coder_hook(tc, reads_output=False, edit=edit,
                                                                            error=error))):
                want = head_logits(hf, ids)
            with model.trace(ids):
                site = tcs.replace(layer=LAYER, error=error)
                acts = site.hook_sae_acts_post.output.clone().save()
                if edit is not None:
                    site.hook_sae_acts_post.output[:, :, f] = 0
                logits = unembed(model).output.save()
            assert torch.allclose(acts, seen[0], atol=1e-6)
            assert (logits - want).abs().max() < 1e-5, (error, edit)
            if error and edit is None:
                assert (logits - ref).abs().max() < 1e-5
            else:
                assert (logits - ref).abs().max() > 1e-4  # the replacement (or the edit) shows


@torch.no_grad()
def test_sae_on_residual_stream_in_trace(fam):
    model, hf, adapter = fam
    site_path = adapter.layer_path(LAYER)
    sae = make_sae()
    saes = SAESet(model, {site_path: sae})
    layer = adapter.get_module(hf, site_path)
    ids = random_ids()
    ref = head_logits(hf, ids)
    seen: list = []
    with forward_hooks((layer, coder_hook(sae, reads_output=True, seen=seen))):
        hf(ids)
    f = busiest(seen[0])
    for error in (False, True):
        for edit in (None, zero_feature(f)):
            with forward_hooks((layer, coder_hook(sae, reads_output=True, edit=edit, error=error))):
                want = head_logits(hf, ids)
            with model.trace(ids):
                site = saes.replace(site_path, error=error)
                acts = site.hook_sae_acts_post.output.clone().save()
                if edit is not None:
                    site.hook_sae_acts_post.output[:, :, f] = 0
                recons = site.hook_sae_recons.output.save()
                logits = unembed(model).output.save()
            assert torch.allclose(acts, seen[0], atol=1e-6) and recons.shape == (2, 10, D)
            assert (logits - want).abs().max() < 1e-5, (error, edit)
            assert ((logits - ref).abs().max() < 1e-5) == (error and edit is None)


@torch.no_grad()
def test_sae_on_tuple_output_site_and_several_invokes():
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    path = adapter.attention_path(LAYER)  # returns (attn_output, attn_weights)
    sae = make_sae(activation="topk", activation_params={"k": 6})
    saes = SAESet(model, {path: sae})
    ids = random_ids(batch=3)
    with forward_hooks((adapter.attention_module(hf, LAYER), coder_hook(sae, reads_output=True))):
        want = head_logits(hf, ids)
    with model.trace() as tracer:
        with tracer.invoke(ids[:1]):
            saes.replace()
            first = unembed(model).output.save()
        with tracer.invoke(ids[1:]):
            acts = saes.replace()[path].hook_sae_acts_post.output.save()  # replace() per invoke: its rows
            rest = unembed(model).output.save()
    assert acts.shape == (2, 10, 128) and ((acts > 0).sum(-1) <= 6).all()
    assert (torch.cat([first, rest]) - want).abs().max() < 1e-5


@torch.no_grad()
def test_clt_in_trace(fam):
    model, hf, adapter = fam
    clt = make_clt(skip=True)
    clts = CLTSet(model, clt)
    ids = random_ids()
    ref = head_logits(hf, ids)
    with model.trace(ids):
        site = clts.replace()
        acts0 = site.hook_sae_acts_post[0].output.save()
        unembed(model).output.save()
    f = busiest(acts0)

    def edit(layer, acts):
        if layer == 0:
            acts[..., f] = 0
        return acts

    for error in (False, True):
        for ed in (None, edit):
            with clt_hooks(hf, adapter, clt, edit=ed, error=error):
                want = head_logits(hf, ids)
            with model.trace(ids):
                site = clts.replace(error=error)
                a0 = site.hook_sae_acts_post[0].output.clone().save()
                if ed is not None:
                    site.hook_sae_acts_post[0].output[:, :, f] = 0
                a2 = site.hook_sae_acts_post[2].output.save()
                recons = site.hook_sae_recons[2].output.save()
                logits = unembed(model).output.save()
            assert torch.equal(a0, acts0) and a2.shape == (2, 10, 48) and recons.shape == (2, 10, D)
            assert (logits - want).abs().max() < 1e-5, (error, ed)
            assert ((logits - ref).abs().max() < 1e-5) == (error and ed is None)


@torch.no_grad()
def test_clt_edit_propagates_with_errors_held_fixed():
    """Zeroing layer-0 feature f: MLP 0 moves by exactly −a·W_dec_0[f, 0]; at layer 1 the error is
    the true MLP minus the CLT computed with the *unedited* layer-0 features (the clean state)."""
    model, hf = tiny_nnsight("llama")
    clt = make_clt()
    clts = CLTSet(model, clt)
    ids = random_ids()
    with model.trace(ids):
        site = clts.replace(error=True)
        a0 = site.hook_sae_acts_post[0].output.clone().save()
        resid0 = model.model.layers[1].input.save()
    f = busiest(a0)
    with model.trace(ids):
        site = clts.replace(error=True)
        site.hook_sae_acts_post[0].output[:, :, f] = 0
        resid0_edit = model.model.layers[1].input.save()
        x1 = model.model.layers[1].mlp.input.save()
        recons1 = site.hook_sae_recons[1].output.save()
        err1 = site.hook_error[1].output.save()
    delta0 = -a0[..., f:f + 1] * clt.W_dec_0[f, 0]
    assert delta0.abs().max() > 1e-3
    assert torch.allclose(resid0_edit - resid0, delta0, atol=1e-5)
    a1 = clt.encode_layer(x1, 1)
    a0_edit = a0.clone()
    a0_edit[..., f] = 0
    assert torch.allclose(recons1, clt.reconstruct_layer([a0_edit, a1], 1), atol=1e-5)
    true1 = hf.model.layers[1].mlp(x1)
    assert torch.allclose(err1, true1 - clt.reconstruct_layer([a0, a1], 1), atol=1e-5)


def test_nothing_survives_the_trace_even_on_error():
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    tc, sae, clt = make_transcoder(), make_sae(), make_clt()
    tcs, saes, clts = TranscoderSet(model, {LAYER: tc}), SAESet(model, {"model.layers.1": sae}), CLTSet(model, clt)
    ids = random_ids()
    before = module_state(hf)
    with torch.no_grad():
        ref = hf(ids).logits
    for fail in (False, True):
        with pytest.raises(RuntimeError, match="boom") if fail else contextlib.nullcontext(), model.trace(ids):
            tc_site = tcs.replace(layer=LAYER)
            sae_site = saes.replace("model.layers.1", error=True)
            clts.replace(error=True)
            tc_site.hook_sae_acts_post.output.save()
            sae_site.hook_error.output.save()
            unembed(model).output.save()
            if fail:
                raise RuntimeError("boom")
        assert module_state(hf) == before
        assert "clt" not in dict(model._module.named_children())
        with torch.no_grad():
            assert torch.equal(hf(ids).logits, ref)
        for module in (tc, sae, clt):
            assert all("forward" not in m.__dict__ for m in module.modules())
    assert adapter.n_layers == 3


@pytest.mark.parametrize("mlps", ["transcoders", "clt"])
@torch.no_grad()
def test_complete_replacement_model_in_one_trace(fam, mlps):
    """Lorsa at every attention, transcoders (or a CLT) at every MLP, an SAE on the last residual."""
    model, hf, adapter = fam
    layers = list(range(adapter.n_layers))
    lorsas = LorsaSet(model, {layer: make_lorsa(hf, adapter, layer, seed=layer) for layer in layers})
    tcs = TranscoderSet(model, {layer: make_transcoder(seed=layer, layer=layer) for layer in layers})
    clts = CLTSet(model, make_clt())
    last = adapter.layer_path(layers[-1])
    saes = SAESet(model, {last: make_sae()})
    ids = random_ids()
    ref = head_logits(hf, ids)
    mlp_ref = (clt_hooks(hf, adapter, clts.clt) if mlps == "clt" else
               forward_hooks(*[(adapter.mlp_module(hf, layer), coder_hook(tcs[layer], reads_output=False))
                               for layer in layers]))
    with contextlib.ExitStack() as stack:
        stack.enter_context(hooked(hf, adapter, {layer: lorsas[layer] for layer in layers}))
        stack.enter_context(mlp_ref)
        stack.enter_context(forward_hooks((adapter.get_module(hf, last), coder_hook(saes[last], reads_output=True))))
        want = head_logits(hf, ids)
    for error in (False, True):
        with model.trace(ids):
            lorsas.replace(error=error)
            if mlps == "clt":
                clts.replace(error=error)
            else:
                tcs.replace(error=error)
            site = saes.replace(last, error=error)
            acts = site.hook_sae_acts_post.output.save()
            logits = unembed(model).output.save()
        assert acts.shape == (2, 10, 128)
        if error:
            assert (logits - ref).abs().max() < 1e-5
        else:
            assert (logits - want).abs().max() < 1e-4
            assert (logits - ref).abs().max() > 1e-2


def test_bad_input_raises_package_errors():
    model, hf = tiny_nnsight("llama")
    with pytest.raises(ConfigMismatchError, match="d_in=32"):
        TranscoderSet(model, {1: make_transcoder(d_in=32)})
    with pytest.raises(ConfigMismatchError, match="d_out=32"):
        TranscoderSet(model, {1: make_transcoder(d_out=32)})
    with pytest.raises(ConfigMismatchError, match="layer 2"):
        TranscoderSet(model, {1: make_transcoder(layer=2)})
    with pytest.raises(LayerOutOfRangeError, match="out of range"):
        TranscoderSet(model, {3: make_transcoder()})
    tcs = TranscoderSet(model, {1: make_transcoder()})
    with pytest.raises(LayerOutOfRangeError, match="no transcoder for layer 0"):
        tcs[0]
    assert 1 in tcs and 0 not in tcs and tcs.layers == [1] and len(tcs) == 1
    with pytest.raises(ConfigMismatchError, match="no module at 'model.layers.7'"):
        SAESet(model, {"model.layers.7": make_sae()})
    with pytest.raises(ConfigMismatchError, match="d_in=32"):
        SAESet(model, {"model.layers.1.mlp": make_sae(d_in=32)})
    with pytest.raises(ConfigMismatchError, match="no SAE at site"):
        SAESet(model, {})["model.layers.1"]
    with pytest.raises(ConfigMismatchError, match="d_model=32"):
        CLTSet(model, CrossLayerTranscoder(CLTConfig(d_in=32, d_sae=8, n_layers=2)))
    with pytest.raises(ConfigMismatchError, match="spans 4 layers"):
        CLTSet(model, make_clt(n_layers=4))
    odd = SAESet(model, {"model.layers.1.mlp.gate_proj": make_sae()})  # width 128, known only at run time
    with pytest.raises(ShapeError, match=r"\(\*batch, 64\)"), model.trace(random_ids()):
        odd.replace("model.layers.1.mlp.gate_proj")
        unembed(model).output.save()
    clts = CLTSet(model, make_clt())
    with pytest.raises(TraceOrderError, match="already ran"), model.trace(random_ids()):
        model.model.layers[1].output.save()
        clts.replace()
    with pytest.raises(TraceOrderError, match="already ran"), model.trace(random_ids()):
        model.model.layers[1].output.save()
        tcs.replace(layer=1)
    assert module_state(hf) == module_state(tiny_nnsight("llama")[1])


def test_splice_chain_refuses_an_error_term_without_error_hook():
    from nnsight_lorsa.envoy.splice_chain import SpliceChain, splice_chain

    model, _ = tiny_nnsight("llama")
    chain = SpliceChain(site_paths=("model.layers.0",), attach_path="model.layers.0", attach_name="x",
                        step=lambda m, i, a, k, out, state: out, get_output=lambda o: o,
                        set_output=lambda o, new: new, error_hook=lambda m, i: m.get_submodule("hook_error"))
    with pytest.raises(LorsaError, match="cannot carry an error term"), model.trace(random_ids()):
        splice_chain(model, chain, torch.nn.Identity(), error=True)


def test_from_pretrained_attaches_at_the_sites_the_files_name(tmp_path):
    from nnsight_lorsa.formats.circuit_tracer import save_circuit_tracer_transcoders
    from nnsight_lorsa.formats.saelens import save_saelens
    from nnsight_lorsa.formats.sparse_coder_format import save_sparse_coder
    from nnsight_lorsa.formats.sparsify import save_sparsify

    model, hf = tiny_nnsight("llama")
    saes = {i: make_sae(seed=i).eval() for i in range(4)}
    save_saelens(saes[0], tmp_path / "sl_post1", hook_name="blocks.1.hook_resid_post")
    save_saelens(saes[1], tmp_path / "sl_pre1", hook_name="blocks.1.hook_resid_pre")  # = layer 0's output
    sae_topk = make_sae(seed=2, activation="topk", activation_params={"k": 8}).eval()
    save_sparsify(sae_topk, tmp_path / "run" / "layers.2")  # a sparsify run: one folder per hookpoint
    saes[3].cfg.hook = "model.embed_tokens"
    save_sparse_coder(saes[3], tmp_path / "ours")
    s = SAESet.from_pretrained(model, [tmp_path / "sl_post1", tmp_path / "sl_pre1", tmp_path / "run",
                                       tmp_path / "ours"])
    assert sorted(s) == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2"]
    x = torch.randn(2, 3, D)
    assert torch.allclose(s["model.layers.0"](x), saes[1](x), atol=1e-6)
    assert torch.allclose(s["model.layers.2"](x), sae_topk(x), atol=1e-6)
    explicit = SAESet.from_pretrained(model, {"model.layers.2": tmp_path / "sl_post1"})
    assert list(explicit) == ["model.layers.2"]
    with model.trace(random_ids()):
        s.replace("model.layers.1")
        out = unembed(model).output.save()
    assert out.shape[-1] == hf.config.vocab_size

    tcs = {i: make_transcoder(skip=False, seed=i, activation="relu", activation_params={}).eval() for i in range(3)}
    save_saelens(tcs[2], tmp_path / "tc_sl", hook_name="blocks.2.ln2.hook_normalized")
    save_circuit_tracer_transcoders({0: tcs[0], 1: tcs[1]}, tmp_path / "ct")
    t = TranscoderSet.from_pretrained(model, [tmp_path / "tc_sl", tmp_path / "ct"])
    assert sorted(t) == [0, 1, 2]
    assert torch.allclose(t[2](x), tcs[2](x), atol=1e-6) and torch.allclose(t[1](x), tcs[1](x), atol=1e-6)

    with pytest.raises(ConfigMismatchError, match="not a transcoder"):
        TranscoderSet.from_pretrained(model, tmp_path / "sl_post1")
    with pytest.raises(ConfigMismatchError, match="not an SAE"):
        SAESet.from_pretrained(model, tmp_path / "tc_sl")
    save_saelens(saes[2], tmp_path / "nohook")
    with pytest.raises(ConfigMismatchError, match="names no hook site"):
        SAESet.from_pretrained(model, tmp_path / "nohook")
    save_saelens(saes[2], tmp_path / "mlp_in", hook_name="blocks.1.hook_mlp_in")
    with pytest.raises(ConfigMismatchError, match="replaces module outputs"):
        SAESet.from_pretrained(model, tmp_path / "mlp_in")
    with pytest.raises(ConfigMismatchError, match="second SAE"):
        SAESet.from_pretrained(model, [tmp_path / "sl_post1", tmp_path / "sl_post1"])
    with pytest.raises(CheckpointError, match="no known sparse-coder checkpoint files"):
        SAESet.from_pretrained(model, tmp_path / "nothing_here")


@pytest.mark.parametrize("kind", ["skip_transcoder", "clt"])
def test_skip_with_constant_weights_is_the_same_path_without_a_weight_gradient(kind):
    """``skip(x, constant_weights=True)`` (the attribution's frozen pass) gives the same values and the same gradient
    on ``x`` bit for bit, and no gradient on ``W_skip`` (so autograd keeps no copy of ``x`` for one)."""
    from helpers import autograd_nodes, make_clt, make_transcoder

    coder = make_transcoder(skip=True) if kind == "skip_transcoder" else make_clt(skip=True).by_layer()[1]
    W = coder.W_skip if kind == "skip_transcoder" else coder.clt.W_skip
    with torch.no_grad():
        W.copy_(torch.randn(W.shape, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(5, W.shape[-1], generator=torch.Generator().manual_seed(1), requires_grad=True)
    live = coder.skip(x)
    (gx_live,) = torch.autograd.grad(live.sum(), x)
    const = coder.skip(x, constant_weights=True)
    assert torch.equal(const, live)
    assert not any(n.__class__.__name__ == "AccumulateGrad" and n.variable is W
                   for n in autograd_nodes(const.grad_fn))
    (gx_const,) = torch.autograd.grad(const.sum(), x)
    assert torch.equal(gx_const, gx_live)
    assert live.grad_fn is not None and any(n.__class__.__name__ == "AccumulateGrad" and n.variable is W
                                            for n in autograd_nodes(live.grad_fn))


def test_gemmascope_hooks_on_gemma2_name_their_sites():
    """A circuit-tracer transcoder / CLT trained on GemmaScope's sites (``ln2.hook_normalized`` in: before the
    ``1 + weight`` gain; ``hook_mlp_out`` out: after ``post_feedforward_layernorm``) attaches on Gemma-2 where it was
    trained: it reads the pre-MLP norm's input (``x / rms(x)`` of it) and replaces the post-MLP norm's output; on
    Llama ``ln2.hook_normalized`` is ``post_attention_layernorm``'s input before its gain too, ``hook_mlp_out`` the
    MLP output; ``mlp.hook_in`` / ``mlp.hook_out`` are the MLP's call (the values:
    tests/formats/test_circuit_tracer_hooks.py)."""
    gemma, _ = tiny_nnsight("gemma2")
    llama, _ = tiny_nnsight("llama")
    tc, clt = make_transcoder(), make_clt()
    gemmascope = {"feature_input_hook": "ln2.hook_normalized", "feature_output_hook": "hook_mlp_out"}
    tc.cfg.extra["circuit_tracer"] = clt.cfg.extra["circuit_tracer"] = gemmascope
    chain = TranscoderSet(gemma, {LAYER: tc}).site(LAYER)
    assert chain.input_paths == (f"model.layers.{LAYER}.pre_feedforward_layernorm",)
    assert chain.site_paths == (f"model.layers.{LAYER}.post_feedforward_layernorm",)
    assert CLTSet(gemma, clt).site().site_paths[LAYER] == f"model.layers.{LAYER}.post_feedforward_layernorm"
    chain = TranscoderSet(llama, {LAYER: tc}).site(LAYER)
    assert chain.input_paths == (f"model.layers.{LAYER}.post_attention_layernorm",)
    assert chain.site_paths == (f"model.layers.{LAYER}.mlp",)
    tc.cfg.extra["circuit_tracer"] = {"feature_input_hook": "mlp.hook_in", "feature_output_hook": "mlp.hook_out"}
    chain = TranscoderSet(gemma, {LAYER: tc}).site(LAYER)
    assert chain.input_paths == chain.site_paths == (f"model.layers.{LAYER}.mlp",)

