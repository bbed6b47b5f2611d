"""Mutation probe, round 11 (docs/reliability.md): QK feature ablation (``analysis/qk_ablation.py``, Lorsa paper
App. F.1), round 10's unrun mutants and a few more; each test seen failing with the mutant it names and passing
without.
"""

from __future__ import annotations

import pytest
import torch
from helpers import LAYER, coordinate_sae, make_lorsa, random_ids, tiny_nnsight

from nnsight_lorsa import LorsaSet, ReplacementModel, get_adapter
from nnsight_lorsa.analysis import QKFeatureImpacts, qk_feature_impacts
from nnsight_lorsa.envoy.read import attention_activations
from nnsight_lorsa.errors import ConfigMismatchError
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.where(p > 0, p * (p.log() - q.log()), torch.zeros((), dtype=p.dtype)).sum(-1)


@pytest.fixture(scope="module")
def tiny_qwen3():
    """Qwen-3 (per-head QK-norm, RoPE): the tiny model shared by this file's tests (its setup is most of their
    time); each test makes its own Lorsa."""
    return tiny_nnsight("qwen3")


@torch.no_grad()
def test_the_ablation_normalises_queries_and_keys_with_the_qk_norms_eps(tiny_qwen3):
    """Qwen-3's per-head QK-norm with an ``eps`` the size of the raw queries' and keys' mean square (a norm's ``eps``
    is part of the model: ``x / sqrt(mean(x²) + eps)``): each feature's maximum KL equals the one recomputed from
    the module's own ``qk`` on the edited input (mutant Q5: the ablation's QK-norm without ``eps``; with the
    usual 1e-6 the gap hides under the reference's bound, with this one the normalised vectors differ by ~√2)."""
    model, hf = tiny_qwen3
    lorsa = make_lorsa(hf, get_adapter(model))
    assert lorsa.cfg.qk_norm
    lorsa.W_Q.mul_(6.0)
    lorsa.W_K.mul_(6.0)
    tokens = random_ids(batch=2, seq=8, seed=5)
    act = attention_activations(model, LAYER, tokens)
    x, positions = act.x, act.positions
    g = 0
    q_raw = x @ lorsa.W_Q[g] + lorsa.b_Q[g]
    k_raw = x @ lorsa.W_K[g] + lorsa.b_K[g]
    lorsa.ln_q.eps = float(q_raw.pow(2).mean(-1).median())
    lorsa.ln_k.eps = float(k_raw.pow(2).mean(-1).median())
    _, cache = lorsa(x, positions, return_cache=True)
    heads = [h for h in range(lorsa.cfg.n_ov_heads) if h // lorsa.cfg.group_size == g]
    active = cache.z[..., heads] > 0
    active[:, 0] = False  # skip_first: BOS is no activation location
    head = heads[int(active.sum((0, 1)).argmax())]
    active = active[..., heads.index(head)]
    assert active.any()
    rm = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: lorsa}))
    d = lorsa.cfg.d_model
    feats = [f for c in range(0, d, max(1, d // 16)) for f in (c, d + c)]  # 32 features
    res = qk_feature_impacts(rm, LAYER, head, coordinate_sae(d), tokens, batch_size=2, features=feats)
    # the reference, every feature's edited input in one batch: feature f zeroes coordinate f % d where it is active
    # (coordinate SAE); queries from the edit with the clean keys (Q), and the reverse (K)
    n_f, b = len(feats), x.shape[0]
    on = torch.stack([(1.0 if f < d else -1.0) * x[..., f % d] > 0 for f in feats])  # (n_f, b, s)
    x_edit = x.expand(n_f, *x.shape).clone()
    for i, f in enumerate(feats):
        x_edit[i, ..., f % d] = torch.where(on[i], torch.zeros(()), x[..., f % d])
    pos_edit = positions if positions.dim() == 1 else positions.expand(b, -1).repeat(n_f, 1)
    q_e, k_e = lorsa.qk(x_edit.flatten(0, 1), pos_edit)
    q_0, k_0 = lorsa.qk(x, positions)

    def pattern(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return lorsa.attention_scores_softmax(q[:, [g]], k[:, [g]], None)[:, 0].double()

    base = pattern(q_0, k_0)
    kl_q = _kl(base, pattern(q_e, k_0.repeat(n_f, 1, 1, 1)).unflatten(0, (n_f, b)))  # (n_f, b, s)
    kl_k = _kl(base, pattern(q_0.repeat(n_f, 1, 1, 1), k_e).unflatten(0, (n_f, b)))
    q_ref, k_ref = torch.zeros(2 * d, dtype=torch.float64), torch.zeros(2 * d, dtype=torch.float64)
    for i, f in enumerate(feats):
        for ref, where, kl in ((q_ref, active & on[i], kl_q[i]), (k_ref, active & on[i].cummax(1).values, kl_k[i])):
            if where.any():
                ref[f] = kl[where].max()
    assert q_ref.max() > 2e-3 and k_ref.max() > 2e-3  # not comparing zeros
    torch.testing.assert_close(res.q_kl.double(), q_ref, atol=2e-6, rtol=1e-3)
    torch.testing.assert_close(res.k_kl.double(), k_ref, atol=2e-6, rtol=1e-3)


@pytest.fixture
def tiny_bundle(tiny_qwen3):
    model, hf = tiny_qwen3
    lorsa = make_lorsa(hf, get_adapter(model))
    return ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: lorsa})), lorsa


def test_an_sae_reading_another_width_is_refused_even_if_it_writes_d_model(tiny_bundle):
    """The documented ``ConfigMismatchError``: the SAE must *read* and write the Lorsa's input (``d_in`` and
    ``W_dec``'s width both ``d_model``); a coder whose decoder writes ``d_model`` but whose encoder reads another
    width (an object of another library with ``cfg.d_in = d_model + 4``; a transcoder of ours is refused as a
    transcoder since 2026-11-29) is refused by name before the model runs (mutant E6: ``d_in`` not compared: the
    coder accepted, numbers returned here, where head 0 never fires and ``encode`` never runs)."""
    import types

    rm, lorsa = tiny_bundle
    d = lorsa.cfg.d_model
    coder = types.SimpleNamespace(W_dec=torch.zeros(16, d), cfg=types.SimpleNamespace(d_in=d + 4),
                                  encode=lambda x: torch.zeros(*x.shape[:-1], 16))
    with pytest.raises(ConfigMismatchError, match=rf"it has d_in={d + 4}"):
        qk_feature_impacts(rm, LAYER, 0, coder, random_ids(batch=1, seq=4, seed=1))


def test_a_tie_in_a_later_batch_keeps_the_first_windows_maximum():
    """``QKFeatureImpacts.update``'s rule: per feature the pair of largest KL, the first one among ties — across
    the batches merged one after another as within one (a corpus with a repeated window reports the first copy,
    whatever ``batch_size``) (mutant E7: ``>=`` for ``>`` across merges: a later batch's equal KL takes the
    place); a strictly larger KL later still wins."""
    r = QKFeatureImpacts.empty(0, 0, 0, 3)
    for side in ("q", "k"):
        r.update(side, torch.tensor([0.5, 0.25]), torch.tensor([0, 1]), torch.tensor([0, 0]), torch.tensor([3, 4]))
        r.update(side, torch.tensor([0.5, 0.75, 0.0]), torch.tensor([0, 1, 2]), torch.tensor([2, 2, 2]),
                 torch.tensor([5, 6, 7]))
        assert getattr(r, f"{side}_kl").tolist() == [0.5, 0.75, 0.0]
        assert getattr(r, f"{side}_window").tolist() == [0, 2, 2]  # feature 0: the first window's tie
        assert getattr(r, f"{side}_position").tolist() == [3, 6, 7]
        assert getattr(r, f"{side}_count").tolist() == [2, 2, 1]


class _PadCodes(SparseAutoencoder):
    """An 'SAE' on ``(1, pad + 6)`` windows: feature 0 fires at the first ``pad`` positions only (the padding of a
    left-padded row), features 1 and 2 at every other position."""

    def __init__(self, w_dec: torch.Tensor) -> None:
        super().__init__(SAEConfig(d_in=w_dec.shape[1], d_sae=w_dec.shape[0]))
        with torch.no_grad():
            self.W_dec.copy_(w_dec)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        codes = torch.zeros(*x.shape[:2], 3)
        pad = x.shape[1] - 6
        codes[:, :pad, 0] = 1.0
        codes[:, pad:, 1:] = 1.0
        return codes


@torch.no_grad()
def test_a_feature_firing_only_at_left_padding_is_present_nowhere(tiny_qwen3):
    """The documented ``attention_mask`` rule (padded positions are no keys, no activation locations and no feature
    presences; a prompt's numbers are those of the prompt alone): a left-padded prompt gives the prompt's own counts
    and maximum KLs, and a feature active only at its pads is counted nowhere, has no window and is no top key
    feature (mutant Q8: the SAE's activations at padded positions kept: that feature counted present at every
    activation, as at a key ``j <= i``; Q9, padded keys valid, changes every K and Q KL)."""
    model, hf = tiny_qwen3
    lorsa = make_lorsa(hf, get_adapter(model))
    lorsa.W_Q.mul_(6.0)
    lorsa.W_K.mul_(6.0)
    rm = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: lorsa}))
    sae = _PadCodes(torch.randn(3, lorsa.cfg.d_model, generator=torch.Generator().manual_seed(0)))
    prompt = random_ids(batch=1, seq=6, seed=3)
    pad = 2
    ids = torch.cat([prompt[:, :1].expand(1, pad), prompt], 1)
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], 1)
    act = attention_activations(model, LAYER, prompt)
    _, cache = lorsa(act.x, act.positions, return_cache=True)
    head = int((cache.z[0, 1:] > 0).sum(0).argmax())  # the head active most often past BOS
    want = qk_feature_impacts(rm, LAYER, head, sae, prompt)
    assert want.n_activations > 0
    got = qk_feature_impacts(rm, LAYER, head, sae, ids, attention_mask=mask)
    assert got.n_activations == want.n_activations and got.n_tokens == want.n_tokens == 5
    for side in ("q", "k"):
        assert getattr(got, f"{side}_count").tolist() == getattr(want, f"{side}_count").tolist(), side
        assert getattr(got, f"{side}_count")[0] == 0 and getattr(got, f"{side}_window")[0] == -1, side
        torch.testing.assert_close(getattr(got, f"{side}_kl"), getattr(want, f"{side}_kl"), atol=1e-6, rtol=1e-4)
    assert float(want.k_kl.max()) > 1e-3 and 0 not in [f for f, *_ in got.top_key_features(3)]
