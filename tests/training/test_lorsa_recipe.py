"""The Lorsa recipe: data-driven initialisation, k annealing, ranking by z·‖w_o‖, dead-head remedies."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_training_setup

from nnsight_lorsa import Lorsa, LorsaConfig
from nnsight_lorsa.envoy.read import Site
from nnsight_lorsa.errors import ConfigMismatchError
from nnsight_lorsa.training import (
    ActivationCache,
    ActivationSource,
    LorsaObjective,
    LorsaRecipe,
    TokenDataset,
    TrainConfig,
    Trainer,
    write_activation_cache,
)
from nnsight_lorsa.training.lorsa_recipe import init_lorsa, k_schedule, resample_dead

LAYER = 1


@pytest.fixture(scope="module")
def setup():
    return tiny_training_setup()


def new_lorsa(adapter, mhsa, seed=0, top_k=8) -> Lorsa:
    torch.manual_seed(seed)
    cfg = LorsaConfig.from_mhsa(mhsa, n_ov_heads=32 * mhsa.n_heads, top_k=top_k, qk_heads_per_mhsa_head=2,
                                layer=LAYER)
    return Lorsa(cfg)


def _norms(source):
    b = source(0)
    x, y = b.x[b.loss_mask], b.y[b.loss_mask]
    return b, x.shape[-1] ** 0.5 / float(x.norm(dim=-1).mean()), y.shape[-1] ** 0.5 / float(y.norm(dim=-1).mean())


def test_k_schedule_anneals_to_top_k():
    r = LorsaRecipe(k_anneal_from=64, k_anneal_frac=0.25)
    ks = [k_schedule(s, 100, 16, r) for s in range(100)]
    assert ks[0] == 64 and ks[25:] == [16] * 75
    assert all(a >= b for a, b in zip(ks, ks[1:], strict=False)) and 16 < ks[12] < 64
    assert [k_schedule(s, 100, 16, LorsaRecipe()) for s in (0, 50)] == [16, 16]
    with pytest.raises(ConfigMismatchError, match="dead_remedy"):
        LorsaRecipe(dead_remedy="resurrect")


@pytest.mark.parametrize("ov_init", ["value_svd", "output_svd"])
def test_data_driven_init_beats_random_init(setup, ov_init):
    model, hf, adapter, data = setup
    mhsa = adapter.mhsa_weights(hf, LAYER)
    b, s_in, s_out = _norms(ActivationSource.attention(model, LAYER, data, batch_size=16))
    lorsa = new_lorsa(adapter, mhsa)
    info = init_lorsa(lorsa, b.x, b.y, b.loss_mask, s_in=s_in, s_out=s_out, mhsa=mhsa,
                      recipe=LorsaRecipe(ov_init=ov_init), generator=torch.Generator().manual_seed(0))
    assert lorsa.W_V.shape == (lorsa.cfg.n_ov_heads, adapter.d_model)
    # the closed-form scale sits in ‖w_o‖ (the default, rank_by_decoder_norm) or in w_v (‖w_o‖ = 1)
    want = info["scale"] if LorsaRecipe().scale_target == "w_o" else 1.0
    assert torch.allclose(lorsa.W_O.norm(dim=1), torch.full((lorsa.cfg.n_ov_heads,), want), atol=1e-5)
    # w_v of an OV head lies in its MHSA head's value subspace (the column space of W_V^m)
    kv = mhsa.W_V.repeat_interleave(mhsa.n_heads // mhsa.W_K.shape[0], 0)
    per = lorsa.cfg.n_ov_heads // mhsa.n_heads
    for m in range(mhsa.n_heads):
        q, _ = torch.linalg.qr(kv[m].float())
        w = lorsa.W_V[m * per:(m + 1) * per]
        assert (w - (w @ q) @ q.T).norm() < 1e-4 * w.norm()
    rand = new_lorsa(adapter, mhsa)
    rand_info = init_lorsa(rand, b.x, b.y, b.loss_mask, s_in=s_in, s_out=s_out, mhsa=None,
                           recipe=LorsaRecipe(scale_init=False, b_d_init=False))
    assert info["fvu_init"] < 1.0 and info["fvu_init"] < 0.5 * rand_info["fvu_init"]


def test_closed_form_scale_is_the_mse_optimum(setup):
    model, hf, adapter, data = setup
    mhsa = adapter.mhsa_weights(hf, LAYER)
    b, s_in, s_out = _norms(ActivationSource.attention(model, LAYER, data, batch_size=16))
    lorsa = new_lorsa(adapter, mhsa)
    init_lorsa(lorsa, b.x, b.y, b.loss_mask, s_in=s_in, s_out=s_out, mhsa=mhsa)
    xn, yn = b.x * s_in, b.y * s_out

    @torch.no_grad()
    def mse(c):
        z, _ = lorsa.activation(lorsa.compute_z_pre(xn) * c)
        return float((yn - lorsa.decode(z))[b.loss_mask].pow(2).sum(-1).mean())

    best = mse(1.0)
    assert best < mse(0.9) and best < mse(1.1)


def test_scale_into_w_o_is_the_same_function_with_the_scale_in_the_decoder(setup):
    """``scale_into="w_o"`` puts the closed-form scale in ``‖w_o‖`` (the authors' split) instead of
    ``w_v, b_v``: same output and init FVU, ``‖w_v‖`` unchanged; refused without decoder-norm ranking."""
    model, hf, adapter, data = setup
    mhsa = adapter.mhsa_weights(hf, LAYER)
    b, s_in, s_out = _norms(ActivationSource.attention(model, LAYER, data, batch_size=16))
    got = {}
    for into in ("w_v", "w_o"):
        lorsa = new_lorsa(adapter, mhsa)
        info = init_lorsa(lorsa, b.x, b.y, b.loss_mask, s_in=s_in, s_out=s_out, mhsa=mhsa,
                          recipe=LorsaRecipe(scale_into=into, rank_by_decoder_norm=True),
                          generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            got[into] = (info, lorsa(b.x * s_in), lorsa.W_V.norm(dim=1), lorsa.W_O.norm(dim=1))
    (iv, ov, wv_v, wo_v), (io, oo, wv_o, wo_o) = got["w_v"], got["w_o"]
    c = iv["scale"]
    assert c != 1.0 and io["scale"] == pytest.approx(c, rel=1e-6)
    assert io["fvu_init"] == pytest.approx(iv["fvu_init"], rel=1e-4)
    assert torch.allclose(oo, ov, atol=1e-4 * float(ov.abs().max()))
    assert torch.allclose(wo_v, torch.ones_like(wo_v), atol=1e-5) and torch.allclose(wo_o, c * torch.ones_like(wo_o),
                                                                                       rtol=1e-5)
    assert torch.allclose(wv_o * c, wv_v, rtol=1e-4)
    with pytest.raises(ConfigMismatchError, match="rank_by_decoder_norm"):
        LorsaRecipe(scale_into="w_o", rank_by_decoder_norm=False)
    assert LorsaRecipe(rank_by_decoder_norm=True).scale_target == "w_o"
    assert LorsaRecipe(rank_by_decoder_norm=False).scale_target == "w_v"
    assert LorsaRecipe(rank_by_decoder_norm=True, scale_into="w_v").scale_target == "w_v"


def test_revive_makes_a_dead_head_fire_and_auxk_does_not(setup):
    model, hf, adapter, data = setup
    mhsa = adapter.mhsa_weights(hf, LAYER)
    source = ActivationSource.attention(model, LAYER, data, batch_size=8)
    fired = {}
    for remedy in ("revive", "auxk"):
        trainer = Trainer(LorsaObjective(new_lorsa(adapter, mhsa), mhsa=mhsa, recipe=LorsaRecipe(dead_remedy=remedy)),
                          source, TrainConfig(total_steps=4, lr=1e-3, dead_after_tokens=1))
        trainer.estimate_norms()
        with torch.no_grad():
            trainer.module.b_V[0] = -1e3  # head 0: negative pre-activation everywhere
        trainer.train(2, progress=False)
        b = source(2)
        with torch.no_grad():
            _, cache = trainer.module(b.x * trainer.s_in, return_cache=True)
        fired[remedy] = bool(cache.active[..., 0][b.loss_mask].any())
    assert fired == {"revive": True, "auxk": False}


def test_ghost_grads_reach_heads_with_negative_preactivation(setup):
    model, hf, adapter, data = setup
    mhsa = adapter.mhsa_weights(hf, LAYER)
    source = ActivationSource.attention(model, LAYER, data, batch_size=8)
    trainer = Trainer(LorsaObjective(new_lorsa(adapter, mhsa), mhsa=mhsa, recipe=LorsaRecipe(dead_remedy="ghost")),
                      source, TrainConfig(total_steps=4, dead_after_tokens=1))
    trainer.estimate_norms()
    with torch.no_grad():
        trainer.module.b_V[0] = -20.0
    batch = source(0)
    trainer.loss(batch)
    loss, metrics = trainer.loss(batch)
    assert metrics["aux"] > 0
    loss.backward()
    assert trainer.module.W_V.grad[0].abs().sum() > 0 and trainer.module.b_V.grad[0] != 0


def test_rank_by_decoder_norm_folds_exactly_and_anneals_k(setup):
    model, hf, adapter, data = setup
    mhsa = adapter.mhsa_weights(hf, LAYER)
    source = ActivationSource.attention(model, LAYER, data, batch_size=8)
    recipe = LorsaRecipe(rank_by_decoder_norm=True, k_anneal_from=24, k_anneal_frac=0.5)
    trainer = Trainer(LorsaObjective(new_lorsa(adapter, mhsa), mhsa=mhsa, recipe=recipe),
                      source, TrainConfig(total_steps=8, lr=1e-2, log_every=1))
    history = trainer.train(progress=False)
    assert [h["k"] for h in history][0] > 8 and history[-1]["k"] == 8 and history[-1]["l0"] <= 8
    norms = trainer.module.W_O.norm(dim=1)
    assert (norms - 1).abs().max() > 1e-3  # not renormalised during training
    batch = source(0)
    with torch.no_grad():
        xn = batch.x * trainer.s_in
        z_pre = trainer.module.compute_z_pre(xn, batch.positions)
        idx = (z_pre * norms).topk(8, dim=-1).indices
        z = torch.zeros_like(z_pre).scatter(-1, idx, z_pre.gather(-1, idx).relu())
        want = trainer.module.decode(z) / trainer.s_out
        got = trainer.folded()(batch.x, batch.positions)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()


def test_lorsa_trains_from_an_activation_cache(setup, tmp_path):
    model, hf, adapter, data = setup
    mhsa = adapter.mhsa_weights(hf, LAYER)
    small = TokenDataset(data.tokens[:16])
    write_activation_cache(model, [Site.attn_input(adapter, LAYER), Site.attn_output(adapter, LAYER)], small,
                           tmp_path, batch_size=8)
    live = ActivationSource.attention(model, LAYER, small, batch_size=8)
    cached = ActivationSource(ActivationCache(tmp_path), Site.attn_input(adapter, LAYER),
                              Site.attn_output(adapter, LAYER), batch_size=8)
    out = []
    for source in (live, cached):
        trainer = Trainer(LorsaObjective(new_lorsa(adapter, mhsa), mhsa=mhsa), source, TrainConfig(total_steps=3))
        trainer.train(progress=False)
        out.append(trainer.module.W_V.detach())
    assert torch.allclose(out[0], out[1], atol=1e-5)


def test_resample_points_dead_heads_at_high_error_tokens(setup):
    model, hf, adapter, data = setup
    mhsa = adapter.mhsa_weights(hf, LAYER)
    b, s_in, s_out = _norms(ActivationSource.attention(model, LAYER, data, batch_size=8))
    lorsa = new_lorsa(adapter, mhsa)
    init_lorsa(lorsa, b.x, b.y, b.loss_mask, s_in=s_in, s_out=s_out, mhsa=mhsa)
    xn, yn = b.x * s_in, b.y * s_out
    dead = torch.zeros(lorsa.cfg.n_ov_heads, dtype=torch.bool)
    dead[[0, 5, 40]] = True
    with torch.no_grad():
        lorsa.b_V[dead] = -1e3
        err = yn - lorsa(xn)
        idx = resample_dead(lorsa, xn, err, b.loss_mask, dead, torch.Generator().manual_seed(0))
        z_pre = lorsa.compute_z_pre(xn)[b.loss_mask]
    assert idx.tolist() == [0, 5, 40]
    assert torch.allclose(lorsa.W_O[idx].norm(dim=1), torch.ones(3), atol=1e-5)
    # each w_o is the error direction at some token, and the head has a positive pre-activation somewhere
    cos = torch.nn.functional.normalize(err[b.loss_mask], dim=-1) @ lorsa.W_O[idx].T
    assert (cos.amax(0) > 1 - 1e-4).all() and (z_pre[:, idx] > 0).any(0).all()
    assert (z_pre[:, idx] > 0).float().mean() < 0.5  # selective: fires on a minority of tokens


def _balanced(adapter, mhsa, source, **recipe):
    # the ranking, the gains' cap and their stop pinned (not the defaults): these tests follow the gains step by step
    recipe = {"dead_remedy": "balance", "balance_floor": 1.0, "balance_rate": 0.5, "balance_max": 8.0,
              "remedy_until": 1.0, "rank_by_decoder_norm": False, **recipe}
    return Trainer(LorsaObjective(new_lorsa(adapter, mhsa), mhsa=mhsa, recipe=LorsaRecipe(**recipe)),
                   source, TrainConfig(total_steps=6, lr=1e-2, log_every=1))


def test_balance_gains_rank_heads_and_fold_exactly(setup):
    model, hf, adapter, data = setup
    mhsa = adapter.mhsa_weights(hf, LAYER)
    source = ActivationSource.attention(model, LAYER, data, batch_size=8)
    trainer = _balanced(adapter, mhsa, source)
    trainer.train(4, progress=False)
    balance = trainer.objective.balance
    gain = balance.gain()
    under = balance.freq < trainer.module.cfg.top_k / trainer.module.cfg.n_ov_heads
    assert gain.max() > 1.5 and (gain[~under] < gain.max()).any()
    batch = source(4)
    with torch.no_grad():
        z_pre = trainer.module.compute_z_pre(batch.x * trainer.s_in, batch.positions)
        idx = (z_pre * gain).topk(8, dim=-1).indices
        z = torch.zeros_like(z_pre).scatter(-1, idx, z_pre.gather(-1, idx).relu())
        want = trainer.module.decode(z) / trainer.s_out
        plain = trainer.module.decode(trainer.module.activation(z_pre)[0]) / trainer.s_out
        got = trainer.folded()(batch.x, batch.positions)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    assert (plain - want).abs().max() > 1e-2 * want.abs().max()  # the gains do change the selection


def test_balance_with_heads_ranked_by_decoder_norm_folds_exactly(setup):
    """With ``rank_by_decoder_norm`` the training top-k ranks by ``z·‖w_o‖·g``; the folded Lorsa
    (``w_o`` renormalised into ``w_v, b_v``, then the gains) computes exactly that."""
    model, hf, adapter, data = setup
    mhsa = adapter.mhsa_weights(hf, LAYER)
    source = ActivationSource.attention(model, LAYER, data, batch_size=8)
    trainer = _balanced(adapter, mhsa, source, rank_by_decoder_norm=True)
    trainer.train(4, progress=False)
    gain = trainer.objective.balance.gain()
    assert gain.max() > 1.5
    batch = source(4)

    def ranked_by(score):  # the top-8 by z_pre·score, decoded, in the raw space
        idx = (z_pre * score).topk(8, dim=-1).indices
        z = torch.zeros_like(z_pre).scatter(-1, idx, z_pre.gather(-1, idx).relu())
        return trainer.module.decode(z) / trainer.s_out

    with torch.no_grad():
        z_pre = trainer.module.compute_z_pre(batch.x * trainer.s_in, batch.positions)
        norms = trainer.module.W_O.norm(dim=1)
        want = ranked_by(norms * gain)
        got = trainer.folded()(batch.x, batch.positions)
        no_gain, no_norm = ranked_by(norms), ranked_by(gain)
    assert torch.allclose(trainer.objective.selection_gain(), norms * gain)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
    for other in (no_gain, no_norm):  # both factors change the selection
        assert (other - want).abs().max() > 1e-2 * want.abs().max()


def test_balance_lifts_a_head_negative_everywhere_and_decays_after_remedy_until(setup):
    model, hf, adapter, data = setup
    mhsa = adapter.mhsa_weights(hf, LAYER)
    source = ActivationSource.attention(model, LAYER, data, batch_size=8)
    trainer = _balanced(adapter, mhsa, source, balance_max=0.5, remedy_until=0.5)
    trainer.estimate_norms()
    with torch.no_grad():
        trainer.module.b_V[0] = -1e3
    trainer.train(2, progress=False)
    batch = source(2)
    with torch.no_grad():
        z_pre = trainer.module.compute_z_pre(batch.x * trainer.s_in, batch.positions)
    assert (z_pre[..., 0][batch.loss_mask] > 0).any()
    trainer.train(progress=False)  # steps 3..5 after remedy_until: the gains decay to 1 by the last step
    assert torch.equal(trainer.objective.balance.log_gain, torch.zeros_like(trainer.objective.balance.log_gain))


def test_balance_hold_keeps_the_gains_after_remedy_until_and_folds_them_exactly(setup):
    """``balance_hold``: after ``remedy_until`` the gains stop moving (no decay to 1) and the folded Lorsa
    ranks heads by ``z·g`` exactly as training does."""
    model, hf, adapter, data = setup
    mhsa = adapter.mhsa_weights(hf, LAYER)
    source = ActivationSource.attention(model, LAYER, data, batch_size=8)
    trainer = _balanced(adapter, mhsa, source, remedy_until=0.5, balance_hold=True)
    trainer.train(3, progress=False)  # steps 0..2: the remedy moves the gains
    held = trainer.objective.balance.log_gain.clone()
    assert held.max() > 0.4
    trainer.train(progress=False)  # steps 3..5: the gains stay
    balance = trainer.objective.balance
    assert torch.equal(balance.log_gain, held) and torch.equal(balance.at_stop, held)
    batch = source(5)
    with torch.no_grad():
        z_pre = trainer.module.compute_z_pre(batch.x * trainer.s_in, batch.positions)
        idx = (z_pre * balance.gain()).topk(8, dim=-1).indices
        z = torch.zeros_like(z_pre).scatter(-1, idx, z_pre.gather(-1, idx).relu())
        want = trainer.module.decode(z) / trainer.s_out
        got = trainer.folded()(batch.x, batch.positions)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()


def test_balance_state_resumes_bit_exact(setup, tmp_path):
    model, hf, adapter, data = setup
    mhsa = adapter.mhsa_weights(hf, LAYER)
    source = ActivationSource.attention(model, LAYER, data, batch_size=8)
    straight = _balanced(adapter, mhsa, source)
    straight.train(progress=False)
    first = _balanced(adapter, mhsa, source)
    first.train(3, progress=False)
    first.save_checkpoint(tmp_path / "ckpt")
    resumed = Trainer.resume(tmp_path / "ckpt", source)
    assert torch.equal(resumed.objective.balance.log_gain, first.objective.balance.log_gain)
    resumed.train(progress=False)
    for (name, a), b in zip(straight.module.state_dict().items(), resumed.module.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(straight.objective.balance.log_gain, resumed.objective.balance.log_gain)


@pytest.mark.parametrize("field,value", [("balance_floor", 0.0), ("balance_floor", 1.5), ("balance_rate", float("nan")),
                                         ("balance_ema", 0.0), ("balance_max", -1.0)])
def test_balance_settings_are_checked(field, value):
    with pytest.raises(ConfigMismatchError, match=field):
        LorsaRecipe(**{field: value})
