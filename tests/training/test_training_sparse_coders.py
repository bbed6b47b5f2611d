"""Training SAEs and (skip-)transcoders with the shared trainer core; folding; exact resume; evaluation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import check_resume_bit_exact, tiny_training_setup

from nnsight_lorsa.envoy.read import Site
from nnsight_lorsa.envoy.sae_set import SAESet
from nnsight_lorsa.envoy.transcoder_set import TranscoderSet
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
from nnsight_lorsa.modules.transcoder import SkipTranscoder, Transcoder, TranscoderConfig
from nnsight_lorsa.training import ActivationSource, TokenDataset, TrainConfig, Trainer, evaluate

LAYER = 1


@pytest.fixture(scope="module")
def setup():
    return tiny_training_setup()


def new_transcoder(adapter, activation="topk", params=None, skip=False, seed=0) -> Transcoder:
    torch.manual_seed(seed)
    cfg = TranscoderConfig(d_in=adapter.d_model, d_sae=256, activation=activation,
                           activation_params={"k": 8} if params is None else params, layer=LAYER)
    return (SkipTranscoder if skip else Transcoder)(cfg)


def new_sae(adapter, activation="relu", params=None, seed=0) -> SparseAutoencoder:
    torch.manual_seed(seed)
    return SparseAutoencoder(SAEConfig(d_in=adapter.d_model, d_sae=256, activation=activation,
                                       activation_params=params or {}, hook=adapter.layer_path(LAYER)))


@torch.no_grad()
def test_site_activations_match_the_model(setup):
    model, hf, adapter, data = setup
    ids = data.tokens[:2]
    seen = {}
    mlp = adapter.mlp_module(hf, LAYER)
    h1 = mlp.register_forward_hook(lambda m, a, out: seen.update(x=a[0], y=out))
    h2 = adapter.get_module(hf, adapter.layer_path(LAYER)).register_forward_hook(
        lambda m, a, out: seen.update(r=out[0] if isinstance(out, tuple) else out))
    hf(ids)
    h1.remove()
    h2.remove()
    b = ActivationSource.transcoder(model, LAYER, data, batch_size=2).read(ids)
    assert torch.equal(b.x, seen["x"]) and torch.equal(b.y, seen["y"])
    assert not b.loss_mask[:, 0].any() and b.loss_mask[:, 1:].all()
    site = Site.resid_post(adapter, LAYER)
    b = ActivationSource.sae(model, site, data, batch_size=2).read(ids)
    assert torch.equal(b.x, seen["r"]) and b.y is b.x


def _check_folded(trainer, batch):
    folded = trainer.folded()
    coder = trainer.module.eval()
    with torch.no_grad():
        want = coder(batch.x * trainer.s_in) / trainer.s_out
        got = folded(batch.x)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    return folded


def test_topk_transcoder_training_reduces_fvu_and_folds_exactly(setup):
    model, hf, adapter, data = setup
    source = ActivationSource.transcoder(model, LAYER, data, batch_size=8)
    trainer = Trainer(new_transcoder(adapter), source,
                      TrainConfig(total_steps=40, lr=1e-2, log_every=1))
    history = trainer.train(progress=False)
    assert history[-1]["fvu"] < 0.5 * history[0]["fvu"]
    assert all(h["l0"] <= 8 for h in history)
    assert torch.allclose(trainer.module.W_dec.norm(dim=1), torch.ones(256), atol=1e-5)
    folded = _check_folded(trainer, source(0))
    assert torch.allclose(folded.W_dec.norm(dim=1), torch.ones(256), atol=1e-5)


def test_relu_l1_sae_training_reduces_fvu_and_folds_exactly(setup):
    model, hf, adapter, data = setup
    source = ActivationSource.sae(model, Site.resid_post(adapter, LAYER), data, batch_size=8)
    trainer = Trainer(new_sae(adapter), source,
                      TrainConfig(total_steps=40, lr=1e-2, l1_coef=1e-3, log_every=1))
    history = trainer.train(progress=False)
    assert trainer.s_in == trainer.s_out
    assert history[-1]["fvu"] < 0.5 * history[0]["fvu"] and history[-1]["sparsity"] > 0
    _check_folded(trainer, source(0))


@pytest.mark.parametrize("kind", ["jumprelu", "batchtopk", "skip"])
def test_other_methods_train_and_fold(setup, kind):
    model, hf, adapter, data = setup
    source = ActivationSource.transcoder(model, LAYER, data, batch_size=8)
    if kind == "jumprelu":
        coder = new_transcoder(adapter, "jumprelu", {"threshold": 0.05, "bandwidth": 0.05})
    elif kind == "batchtopk":
        coder = new_transcoder(adapter, "batchtopk", {"k": 8})
    else:
        coder = new_transcoder(adapter, skip=True)
    trainer = Trainer(coder, source, TrainConfig(total_steps=10, lr=1e-2, log_every=1))
    theta0 = coder.activation.threshold.detach().clone() if kind == "jumprelu" else None
    history = trainer.train(progress=False)
    assert history[-1]["fvu"] < history[0]["fvu"]
    if theta0 is not None:  # the L0 penalty reaches the threshold through the STE
        assert not torch.equal(theta0, coder.activation.threshold) and history[-1]["sparsity"] > 0
    _check_folded(trainer, source(0))


@pytest.mark.parametrize("kind", ["topk", "jumprelu"])
def test_checkpoint_resumes_bit_exactly(setup, tmp_path, kind):
    model, hf, adapter, data = setup
    source = ActivationSource.transcoder(model, LAYER, data, batch_size=8)
    make = (lambda: new_transcoder(adapter)) if kind == "topk" else (
        lambda: new_transcoder(adapter, "jumprelu", {"threshold": 0.05, "bandwidth": 0.05}, skip=True))
    def at_resume(straight, first, resumed):
        assert resumed.step == 3 and type(resumed.module) is type(straight.module)

    check_resume_bit_exact(make, source, tmp_path / "ckpt", at_resume)


def _direct_ce(hf, ids, module=None, fn=None):
    h = module.register_forward_hook(fn) if module is not None else None
    logits = hf(ids).logits
    if h is not None:
        h.remove()
    return logits, float(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))


@torch.no_grad()
def test_transcoder_evaluation_matches_direct_computation(setup):
    model, hf, adapter, data = setup
    tc = new_transcoder(adapter).eval()
    ids = data.tokens[:8]
    ev = evaluate(TranscoderSet(model, {LAYER: tc}), TokenDataset(ids), at=LAYER, batch_size=4)
    mlp = adapter.mlp_module(hf, LAYER)
    logits_o, ce_o = _direct_ce(hf, ids)
    seen = {}

    def replace(m, a, out):
        seen.setdefault("y", []).append(out)
        seen.setdefault("acts", []).append(tc.encode(a[0]))
        return tc(a[0])

    logits_s, ce_s = _direct_ce(hf, ids, mlp, replace)
    _, ce_z = _direct_ce(hf, ids, mlp, lambda m, a, out: torch.zeros_like(out))
    assert ev.ce_orig == pytest.approx(ce_o, rel=1e-5)
    assert ev.ce_spliced == pytest.approx(ce_s, rel=1e-5)
    assert ev.ce_zero == pytest.approx(ce_z, rel=1e-5)
    lp, lq = logits_o[:, :-1].log_softmax(-1), logits_s[:, :-1].log_softmax(-1)
    assert ev.kl == pytest.approx(float((lp.exp() * (lp - lq)).sum(-1).mean()), rel=1e-4)
    y, acts = seen["y"][0][:, 1:], seen["acts"][0][:, 1:]
    recon = tc.decode(acts)
    resid = (y - recon).pow(2).sum()
    total = (y.flatten(0, 1) - y.flatten(0, 1).mean(0)).pow(2).sum()
    assert ev.fvu == pytest.approx(float(resid / total), rel=1e-4)
    assert ev.l0 == pytest.approx(8.0) and ev.n_tokens == 8 * 15
    assert ev.dead_frac == pytest.approx(float(((acts > 0).flatten(0, 1).any(0) == 0).float().mean()))


@torch.no_grad()
def test_sae_evaluation_matches_direct_computation(setup):
    model, hf, adapter, data = setup
    sae = new_sae(adapter, "topk", {"k": 8}).eval()
    site = adapter.layer_path(LAYER)
    ids = data.tokens[:8]
    ev = evaluate(SAESet(model, {site: sae}), TokenDataset(ids), at=site, batch_size=8)
    layer = adapter.get_module(hf, site)

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    def swap(out, new):
        return (new, *out[1:]) if isinstance(out, tuple) else new

    _, ce_o = _direct_ce(hf, ids)
    _, ce_s = _direct_ce(hf, ids, layer, lambda m, a, out: swap(out, sae(first(out))))
    _, ce_z = _direct_ce(hf, ids, layer, lambda m, a, out: swap(out, torch.zeros_like(first(out))))
    assert (ev.ce_orig, ev.ce_spliced, ev.ce_zero) == pytest.approx((ce_o, ce_s, ce_z), rel=1e-5)
    assert ev.kl > 0 and ev.l0 == pytest.approx(8.0)


def test_sae_evaluation_shrinkage_matches_direct_computation(setup):
    model, hf, adapter, data = setup
    sae = new_sae(adapter, "topk", {"k": 8}).eval()
    site = adapter.layer_path(LAYER)
    ids = data.tokens[:4]
    ev = evaluate(SAESet(model, {site: sae}), TokenDataset(ids), at=site, batch_size=4)
    seen = []
    handle = adapter.get_module(hf, site).register_forward_hook(
        lambda m, a, out: seen.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        hf(ids)
    handle.remove()
    y = seen[0][:, 1:].reshape(-1, seen[0].shape[-1]).double()  # BOS left out, as evaluate does
    with torch.no_grad():
        y_hat, acts = sae(y.float()).double(), sae.encode(y.float())
    assert ev.l2_ratio == pytest.approx(float((y_hat.norm(dim=-1) / y.norm(dim=-1)).mean()), rel=1e-4)
    assert ev.relative_reconstruction_bias == pytest.approx(
        float(y_hat.norm(dim=-1).pow(2).mean() / (y * y_hat).sum(-1).mean()), rel=1e-4)
    assert ev.feature_density == pytest.approx((acts != 0).double().mean(0).tolist(), abs=1e-9)
    assert sum(ev.feature_density) == pytest.approx(ev.l0)
    assert "feature_density" not in ev.summary()
