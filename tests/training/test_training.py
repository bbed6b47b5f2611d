"""Training a Lorsa on activations collected through nnsight; metrics; exact resume; evaluation."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_training_setup

from nnsight_lorsa import Lorsa, LorsaConfig, LorsaSet
from nnsight_lorsa.errors import CheckpointError
from nnsight_lorsa.modules import SAEConfig, SparseAutoencoder
from nnsight_lorsa.training import (
    ActivationSource,
    LorsaObjective,
    LorsaRecipe,
    TokenDataset,
    TrainConfig,
    Trainer,
    evaluate,
)
from nnsight_lorsa.training.metrics import FVUAccumulator, fvu
from nnsight_lorsa.training.schedule import wsd_lr_factor

LAYER = 1


@pytest.fixture(scope="module")
def setup():
    return tiny_training_setup()


def new_lorsa(adapter, seed=0) -> Lorsa:
    torch.manual_seed(seed)
    cfg = LorsaConfig(d_model=adapter.d_model, n_qk_heads=8, d_qk_head=16, n_ov_heads=256, top_k=8,
                      rotary=adapter.rotary_config(), layer=LAYER)
    return Lorsa(cfg)


def test_wsd_schedule():
    factors = [wsd_lr_factor(s, 100, warmup_frac=0.1, decay_frac=0.2) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == 1.0
    assert all(f == 1.0 for f in factors[10:80])
    assert factors[-1] == pytest.approx(0.0) and factors[85] < factors[80]
    # decay_to (TrainConfig.decay_to): the decay ends at that fraction of the lr (the authors' 1/32)
    ends = [wsd_lr_factor(s, 100, warmup_frac=0.1, decay_frac=0.2, min_factor=1 / 32) for s in range(100)]
    assert ends[:80] == factors[:80] and ends[-1] == pytest.approx(1 / 32) and ends[85] < ends[80]


def test_trainer_lr_ends_at_decay_to():
    cfg = TrainConfig(total_steps=10, lr=1e-3, warmup_frac=0.0, decay_frac=0.5, decay_to=0.25)
    t = Trainer(SparseAutoencoder(SAEConfig(d_in=4, d_sae=8, activation="relu")), lambda i: None, cfg)
    lrs = []
    for _ in range(10):
        lrs.append(t.scheduler.get_last_lr()[0])
        t.optimizer.step()
        t.scheduler.step()
    assert lrs[0] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(0.25e-3) and lrs[7] > lrs[-1]


def test_fvu_accumulator_matches_one_shot():
    g = torch.Generator().manual_seed(0)
    y, y_hat = torch.randn(100, 8, generator=g) + 3, torch.randn(100, 8, generator=g) + 3
    acc = FVUAccumulator()
    for i in range(0, 100, 30):
        acc.update(y[i:i + 30], y_hat[i:i + 30])
    assert acc.value() == pytest.approx(float(fvu(y, y_hat)), rel=1e-6)
    assert float(fvu(y, y.mean(0, keepdim=True).expand_as(y))) == pytest.approx(1.0)



def test_fvu_accumulator_is_exact_when_the_mean_is_large_against_the_spread():
    """fp64 rows at an offset of 1e7 with unit spread, in uneven batches (one empty): the streamed FVU equals the
    fp64 definition ``Σ‖y − ŷ‖² / Σ‖y − ȳ‖²`` (the difference-of-sums formula was 1.5% off here)."""
    g = torch.Generator().manual_seed(1)
    y = torch.randn(4000, 16, generator=g, dtype=torch.float64) + 1e7
    y_hat = y + 0.5 * torch.randn(4000, 16, generator=g, dtype=torch.float64)
    want = float((y - y_hat).pow(2).sum() / (y - y.mean(0)).pow(2).sum())
    acc = FVUAccumulator()
    for a, b in ((0, 1), (1, 1), (1, 700), (700, 2300), (2300, 4000)):
        acc.update(y[a:b], y_hat[a:b])
    assert acc.value() == pytest.approx(want, rel=1e-9)
    assert FVUAccumulator().value() != FVUAccumulator().value()  # NaN before any update

@torch.no_grad()
def test_activations_match_the_model(setup):
    model, hf, adapter, data = setup
    ids = data.tokens[:2]
    seen = {}

    def hook(m, a, kw, out):
        seen["x"], seen["y"] = adapter.attention_input(a, kw), adapter.attention_output(out)

    h = adapter.attention_module(hf, LAYER).register_forward_hook(hook, with_kwargs=True)
    hf(ids)
    h.remove()
    batch = ActivationSource.attention(model, LAYER, data, batch_size=2).read(ids)
    assert torch.equal(batch.x, seen["x"]) and torch.equal(batch.y, seen["y"])
    assert not batch.loss_mask[:, 0].any() and batch.loss_mask[:, 1:].all()


def test_training_reduces_fvu_and_folding_is_exact(setup):
    model, hf, adapter, data = setup
    source = ActivationSource.attention(model, LAYER, data, batch_size=8)
    trainer = Trainer(LorsaObjective(new_lorsa(adapter), mhsa=adapter.mhsa_weights(hf, LAYER)),
                      source, TrainConfig(total_steps=40, lr=1e-2, log_every=1))
    history = trainer.train(progress=False)
    assert history[-1]["fvu"] < 0.5 * history[0]["fvu"]
    assert all(h["l0"] <= 8 for h in history)
    # folded weights act on raw activations exactly as the trained function acts on scaled ones (the
    # training-time ranking: z·‖w_o‖ by default, training_output; the module's own forward ranks by z)
    batch = source(0)
    folded = trainer.folded()
    with torch.no_grad():
        want = trainer.objective.training_output(batch.x * trainer.s_in, batch.positions) / trainer.s_out
        got = folded(batch.x, batch.positions)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    # the default balance gains are still on at the last step (remedy_until = 1): folded into the weights,
    # the folded Lorsa's ‖w_o^h‖ = 1/g_h (1 for a head whose gain is 1)
    gain = trainer.objective.balance.gain()
    assert float(gain.max()) > 1.0
    assert torch.allclose(folded.W_O.norm(dim=1), 1 / gain, atol=1e-5)


def test_folding_is_exact_with_heads_ranked_by_decoder_norm(setup):
    """The authors' split (``rank_by_decoder_norm``, scale in ``‖w_o‖``): the folded Lorsa computes the
    trained function — heads ranked by ``z·‖w_o‖`` (``training_output``) — which the unfolded module's
    own forward (ranking by ``z``) is not once the ``‖w_o‖`` differ."""
    model, hf, adapter, data = setup
    source = ActivationSource.attention(model, LAYER, data, batch_size=8)
    trainer = Trainer(LorsaObjective(new_lorsa(adapter), mhsa=adapter.mhsa_weights(hf, LAYER),
                                     recipe=LorsaRecipe(rank_by_decoder_norm=True)),
                      source, TrainConfig(total_steps=40, lr=1e-2, log_every=1))
    history = trainer.train(progress=False)
    assert history[-1]["fvu"] < 0.5 * history[0]["fvu"]
    norms = trainer.module.W_O.detach().norm(dim=1)
    assert float(norms.max() / norms.min()) > 1.1  # w_o is not renormalised during training
    batch = source(0)
    folded = trainer.folded()
    with torch.no_grad():
        want = trainer.objective.training_output(batch.x * trainer.s_in, batch.positions) / trainer.s_out
        plain = trainer.module(batch.x * trainer.s_in, batch.positions) / trainer.s_out
        got = folded(batch.x, batch.positions)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    assert (plain - want).abs().max() > 1e-2 * want.abs().max()  # the ranking by z·‖w_o‖ is what folding keeps
    # the default balance gains, still on at the last step, are folded in too: ‖w_o^h‖ = 1/g_h
    assert torch.allclose(folded.W_O.norm(dim=1), 1 / trainer.objective.balance.gain(), atol=1e-5)


def test_checkpoint_resumes_bit_exactly(setup, tmp_path):
    model, hf, adapter, data = setup
    source = ActivationSource.attention(model, LAYER, data, batch_size=8)
    config = dict(total_steps=6, lr=1e-2, dead_after_tokens=50)  # small: AuxK is active too
    straight = Trainer(new_lorsa(adapter), source, TrainConfig(**config))
    straight.train(progress=False)
    first = Trainer(new_lorsa(adapter), source, TrainConfig(**config))
    first.train(3, progress=False)
    first.save_checkpoint(tmp_path / "ckpt")
    resumed = Trainer.resume(tmp_path / "ckpt", source)
    assert resumed.step == 3
    resumed.train(progress=False)
    for (name, a), b in zip(straight.module.state_dict().items(), resumed.module.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(straight.tokens_since_fired, resumed.tokens_since_fired)


def test_resume_rejects_broken_checkpoints(setup, tmp_path):
    model, hf, adapter, data = setup
    source = ActivationSource.attention(model, LAYER, data, batch_size=8)
    trainer = Trainer(new_lorsa(adapter), source, TrainConfig(total_steps=2))
    trainer.train(progress=False)
    trainer.save_checkpoint(tmp_path)
    meta = json.loads((tmp_path / "trainer.json").read_text())
    meta["lorsa_config"]["n_ov_heads"] = 128
    (tmp_path / "trainer.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="trainer.json: (truncated or )?altered"):  # the manifest catches the edit
        Trainer.resume(tmp_path, source)
    (tmp_path / "state.safetensors").unlink()
    with pytest.raises(CheckpointError, match="state.safetensors"):
        Trainer.resume(tmp_path, source)


def test_auxk_trains_dead_heads(setup):
    model, hf, adapter, data = setup
    source = ActivationSource.attention(model, LAYER, data, batch_size=8)
    trainer = Trainer(LorsaObjective(new_lorsa(adapter), recipe=LorsaRecipe(dead_remedy="auxk")),
                      source, TrainConfig(total_steps=4, dead_after_tokens=1))
    trainer.estimate_norms()
    batch = source(0)
    trainer.loss(batch)  # counts firing: with threshold 1 every head that did not fire is dead
    loss, metrics = trainer.loss(batch)
    assert metrics["dead_frac"] > 0 and metrics["aux"] > 0
    loss.backward()
    dead = trainer.tokens_since_fired >= 1
    assert trainer.module.W_V.grad[dead].abs().sum() > 0


@torch.no_grad()
def test_evaluation_numbers_match_direct_computation(setup):
    model, hf, adapter, data = setup
    lorsa = new_lorsa(adapter)
    lorsa.init_from_mhsa(adapter.mhsa_weights(hf, LAYER))
    ev = evaluate(LorsaSet(model, {LAYER: lorsa}), TokenDataset(data.tokens[:8]), at=LAYER, batch_size=4)
    ids = data.tokens[:8]
    logits = hf(ids).logits
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert ev.ce_orig == pytest.approx(float(ce), rel=1e-5)
    attn = adapter.attention_module(hf, LAYER)
    h = attn.register_forward_hook(lambda m, a, out: adapter.with_attention_output(
        out, torch.zeros_like(adapter.attention_output(out))))
    ce_zero = F.cross_entropy(hf(ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    h.remove()
    assert ev.ce_zero == pytest.approx(float(ce_zero), rel=1e-5)
    assert ev.n_tokens == 8 * 15 and 0 < ev.l0 <= 8 and 0 <= ev.dead_frac <= 1 and ev.fvu > 0


def test_evaluation_counts_only_the_target_mask(setup):
    """``TokenDataset(target_mask=…)``: CE/KL over the masked predictions only (e.g. a task's answers),
    equal to the direct computation on them; an all-true mask is the default; bad shapes raise."""
    model, hf, adapter, data = setup
    lorsa = new_lorsa(adapter)
    lorsa.init_from_mhsa(adapter.mhsa_weights(hf, LAYER))
    ids = data.tokens[:8]
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 5] = mask[::2, 11] = True
    lorsas = LorsaSet(model, {LAYER: lorsa})
    ev = evaluate(lorsas, TokenDataset(ids, target_mask=mask), at=LAYER, batch_size=4)
    with torch.no_grad():
        logits = hf(ids).logits
    keep = mask[:, 1:]
    ce = F.cross_entropy(logits[:, :-1][keep], ids[:, 1:][keep])
    assert ev.n_tokens == int(mask.sum()) == 12 and ev.ce_orig == pytest.approx(float(ce), rel=1e-5)
    full = evaluate(lorsas, TokenDataset(ids), at=LAYER, batch_size=4)
    ones = evaluate(lorsas, TokenDataset(ids, target_mask=torch.ones_like(mask)), at=LAYER, batch_size=4)
    assert ones.ce_orig == pytest.approx(full.ce_orig) and ones.n_tokens == full.n_tokens
    assert ev.ce_orig != pytest.approx(full.ce_orig)
    train, held = TokenDataset(ids, target_mask=mask).split(0.25)
    assert held.target_mask is not None and torch.equal(held.target_mask, mask[-2:])
    with pytest.raises(ValueError, match="target_mask"):
        TokenDataset(ids, target_mask=mask[:, :-1])


def test_train_can_be_bounded_and_watched_without_a_progress_bar(setup):
    from nnsight_lorsa.errors import ArgumentError

    model, hf, adapter, data = setup
    source = ActivationSource.attention(model, LAYER, data, batch_size=8)
    trainer = Trainer(new_lorsa(adapter), source, TrainConfig(total_steps=100, log_every=2))
    seen = []
    trainer.train(5, progress=False, on_log=seen.append)
    assert trainer.step == 5 and [m["step"] for m in seen] == [2, 4, 5] and seen == trainer.history
    for bad in (-1, True):  # (a float is refused too; under the tests' type checker, by it)
        with pytest.raises(ArgumentError, match="steps"):
            trainer.train(bad, progress=False)
    assert trainer.step == 5
