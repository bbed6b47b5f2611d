"""Training a cross-layer transcoder on every MLP at once: data, loss, folding, exact resume, splicing, evaluation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import check_resume_bit_exact, tiny_training_setup

from nnsight_lorsa.envoy.clt_set import CLTSet
from nnsight_lorsa.envoy.read import Site
from nnsight_lorsa.errors import ConfigMismatchError, LayerOutOfRangeError, LorsaError, ShapeError
from nnsight_lorsa.modules.clt import CLTConfig, CrossLayerTranscoder
from nnsight_lorsa.training import ActivationSource, TokenDataset, TrainConfig, Trainer, evaluate
from nnsight_lorsa.training.activation_cache import write_activation_cache
from nnsight_lorsa.training.activations import Batch

K = 8


@pytest.fixture(scope="module")
def setup():
    model, hf, adapter, data = tiny_training_setup()
    return model, hf, adapter, data, ActivationSource.clt(model, data, batch_size=8)


def new_clt(adapter, activation="topk", params=None, n_layers=None, d_model=None, skip=False, seed=0):
    torch.manual_seed(seed)
    cfg = CLTConfig(d_in=d_model or adapter.d_model, d_sae=128, n_layers=n_layers or adapter.n_layers,
                    activation=activation, activation_params={"k": K} if params is None else params, skip=skip)
    return CrossLayerTranscoder(cfg)


@torch.no_grad()
def test_source_stacks_the_per_layer_transcoder_streams(setup, tmp_path):
    model, hf, adapter, data, source = setup
    b = source(5)
    assert b.x.shape == (adapter.n_layers, 8, 16, adapter.d_model) and b.y.shape == b.x.shape
    for layer in range(adapter.n_layers):
        ref = ActivationSource.transcoder(model, layer, data, batch_size=8)(5)
        assert torch.equal(b.x[layer], ref.x) and torch.equal(b.y[layer], ref.y), layer
        assert torch.equal(b.loss_mask, ref.loss_mask)
    sites = [s for layer in range(adapter.n_layers)
             for s in (Site.mlp_input(adapter, layer), Site.mlp_output(adapter, layer))]
    cache = write_activation_cache(model, sites, data, tmp_path / "cache", batch_size=16)
    cached = ActivationSource.clt(cache, batch_size=8, adapter=adapter)(5)
    assert torch.equal(cached.x, b.x) and torch.equal(cached.y, b.y) and torch.equal(cached.loss_mask, b.loss_mask)


def test_topk_clt_training_reduces_loss_and_fvu_and_folds_exactly(setup):
    model, hf, adapter, data, source = setup
    trainer = Trainer(new_clt(adapter), source, TrainConfig(total_steps=30, lr=1e-2, log_every=1))
    history = trainer.train(progress=False)
    first, last = history[0], history[-1]
    assert last["loss"] < 0.5 * first["loss"]
    for layer in range(adapter.n_layers):  # every layer's reconstruction improves, not just the sum
        assert last[f"fvu_{layer}"] < 0.7 * first[f"fvu_{layer}"], layer
        assert last[f"l0_{layer}"] <= K
    assert len(trainer.s_in_layers) == adapter.n_layers and len(set(trainer.s_out_layers)) == adapter.n_layers
    for layer in range(adapter.n_layers):  # decoder rows over all targets kept at unit norm
        W = trainer.module.W_dec(layer)
        assert torch.allclose(W.flatten(1).norm(dim=-1), torch.ones(128), atol=1e-5)
    # folded: acts on raw activations exactly as the training-space CLT on scaled ones
    folded = trainer.folded()
    b = source(0)
    s_in = torch.tensor(trainer.s_in_layers)[:, None, None, None]
    s_out = torch.tensor(trainer.s_out_layers)[:, None, None, None]
    with torch.no_grad():
        want = trainer.module.eval()(b.x * s_in) / s_out
        got = folded(b.x)
        init_fvu = evaluate_fvu(new_clt(adapter), b)
        trained_fvu = evaluate_fvu(folded, b)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    assert all(t < 0.7 * i for t, i in zip(trained_fvu, init_fvu, strict=True)), (trained_fvu, init_fvu)


def evaluate_fvu(clt, b: Batch) -> list[float]:
    x, y = b.x[:, b.loss_mask], b.y[:, b.loss_mask]
    out = clt.eval()(x)
    return [float((y[i] - out[i]).pow(2).sum() / (y[i] - y[i].mean(0)).pow(2).sum()) for i in range(len(y))]


@pytest.mark.parametrize("kind", ["relu", "jumprelu"])
def test_other_activations_train(setup, kind):
    model, hf, adapter, data, source = setup
    params = {} if kind == "relu" else {"threshold": 0.05, "bandwidth": 0.05}
    clt = new_clt(adapter, kind, params, skip=kind == "jumprelu")
    theta0 = clt.activation[1].threshold.detach().clone() if kind == "jumprelu" else None
    trainer = Trainer(clt, source, TrainConfig(total_steps=8, lr=1e-2, log_every=1))
    history = trainer.train(progress=False)
    assert history[-1]["fvu"] < history[0]["fvu"] and history[-1]["sparsity"] > 0
    if theta0 is not None:  # the L0 penalty reaches every layer's threshold through the STE
        assert not torch.equal(theta0, clt.activation[1].threshold)


@pytest.mark.parametrize("kind", ["topk", "jumprelu"])
def test_checkpoint_resumes_bit_exactly(setup, tmp_path, kind):
    model, hf, adapter, data, source = setup
    make = (lambda: new_clt(adapter)) if kind == "topk" else (
        lambda: new_clt(adapter, "jumprelu", {"threshold": 0.05, "bandwidth": 0.05}, skip=True))
    def at_resume(straight, first, resumed):
        assert resumed.step == 3 and resumed.s_in_layers == first.s_in_layers

    straight = check_resume_bit_exact(make, source, tmp_path / "ckpt", at_resume)
    if kind == "topk":
        assert any(h["aux"] > 0 for h in straight.history)


def test_trained_clt_splices_and_evaluates(setup):
    model, hf, adapter, data, source = setup
    trainer = Trainer(new_clt(adapter), source, TrainConfig(total_steps=10, lr=1e-2))
    trainer.train(progress=False)
    with torch.no_grad():
        check_splice_and_evaluation(model, hf, adapter, data, trainer)


def check_splice_and_evaluation(model, hf, adapter, data, trainer):
    clt_set = CLTSet(model, trainer.folded())
    ids = data.tokens[:4]
    want = hf(ids).logits
    lm_head = model.lm_head
    with model.trace(ids, use_cache=False):
        clt_set.replace(error=True)
        with_error = lm_head.output.save()
    with model.trace(ids, use_cache=False):
        clt_set.replace()
        spliced = lm_head.output.save()
    assert torch.allclose(with_error, want, atol=1e-4)
    assert not torch.allclose(spliced, want, atol=1e-2)
    ev = evaluate(clt_set, TokenDataset(ids), batch_size=2)
    ce_orig = float(F.cross_entropy(want[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))
    ce_spliced = float(F.cross_entropy(spliced[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))
    assert ev.ce_orig == pytest.approx(ce_orig, rel=1e-5) and ev.ce_spliced == pytest.approx(ce_spliced, rel=1e-5)
    hooks = [adapter.mlp_module(hf, layer).register_forward_hook(lambda m, a, out: torch.zeros_like(out))
             for layer in range(adapter.n_layers)]
    zeroed = hf(ids).logits
    for h in hooks:
        h.remove()
    ce_zero = float(F.cross_entropy(zeroed[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))
    assert ev.ce_zero == pytest.approx(ce_zero, rel=1e-5) and ev.ce_zero != pytest.approx(ev.ce_orig, rel=1e-4)
    lp, lq = want[:, :-1].log_softmax(-1), spliced[:, :-1].log_softmax(-1)
    assert ev.kl == pytest.approx(float((lp.exp() * (lp - lq)).sum(-1).mean()), rel=1e-4)
    assert ev.kl > 0 and ev.n_tokens == 4 * 15
    assert len(ev.fvu) == len(ev.l0) == len(ev.dead_frac) == adapter.n_layers
    assert all(0 < v <= K for v in ev.l0) and all(0 <= d < 1 for d in ev.dead_frac)
    # per-layer FVU on the original activations = the folded CLT run on them directly
    direct = evaluate_fvu(clt_set.clt, ActivationSource.clt(model, TokenDataset(ids), batch_size=4)(0))
    assert ev.fvu == pytest.approx(direct, rel=1e-4)


def test_bad_input_raises_clear_errors(setup):
    model, hf, adapter, data, source = setup
    config = TrainConfig(total_steps=2)
    with pytest.raises(ConfigMismatchError, match="spans 2 layers"):
        Trainer(new_clt(adapter, n_layers=2), source, config)
    with pytest.raises(ConfigMismatchError, match="d_model=32"):
        Trainer(new_clt(adapter, d_model=32), source, config)
    with pytest.raises(LayerOutOfRangeError):
        ActivationSource.clt(model, data, batch_size=8, n_layers=adapter.n_layers + 1)
    # a bare callable source is checked batch by batch
    b = source(0)
    bad_layers = Batch(x=b.x[:2], y=b.y[:2], loss_mask=b.loss_mask)
    bad_width = Batch(x=b.x[..., :32], y=b.y[..., :32], loss_mask=b.loss_mask)
    for bad, what in ((bad_layers, "n_layers=3"), (bad_width, "d_model=64")):
        trainer = Trainer(new_clt(adapter), lambda i, bad=bad: bad, config)
        with pytest.raises(ShapeError, match=what) as info:
            trainer.train(progress=False)
        assert isinstance(info.value, LorsaError)


def test_one_front_door_rejects_mismatched_sources_and_sets(setup):
    """The one Trainer / evaluate: a stacked (CLT) source for a transcoder, a transcoder source for a
    Lorsa, an unknown module, and at= for a CLT raise before anything runs."""
    from nnsight_lorsa import Lorsa, LorsaConfig
    from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig

    model, hf, adapter, data, source = setup
    config = TrainConfig(total_steps=1)
    tc = Transcoder(TranscoderConfig(d_in=adapter.d_model, d_sae=64, activation="topk", activation_params={"k": 4}))
    with pytest.raises(ConfigMismatchError, match="reads one site"):
        Trainer(tc, source, config)
    lorsa = Lorsa(LorsaConfig(d_model=adapter.d_model, n_qk_heads=4, d_qk_head=16, n_ov_heads=32, top_k=4))
    with pytest.raises(ConfigMismatchError, match="positions"):
        Trainer(lorsa, ActivationSource.transcoder(model, 1, data, batch_size=8), config)
    with pytest.raises(TypeError, match="cannot train"):
        Trainer(torch.nn.Linear(2, 2), source, config)
    with pytest.raises(ValueError, match="at="):
        evaluate(CLTSet(model, new_clt(adapter)), TokenDataset(data.tokens[:2]), at=1)
