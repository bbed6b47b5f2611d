"""Head analysis: oblique projection (App. E.1), heads spanned (E.2), OV logit lens, SAE cosines (F.2)."""

from __future__ import annotations

import torch
from helpers import LAYER, make_lorsa, random_ids, tiny_nnsight

from nnsight_lorsa import LorsaSet, ReplacementModel, get_adapter
from nnsight_lorsa.analysis.heads import (
    MHSACorrelation,
    collect_top_activations,
    mhsa_correlation,
    oblique_coefficients,
    ov_feature_cosines,
    ov_logit_lens,
)
from nnsight_lorsa.envoy.read import attention_activations


def test_oblique_coefficients_recover_known_mixtures():
    g = torch.Generator().manual_seed(0)
    basis = torch.randn(5, 3, 16, generator=g)           # 3 non-orthogonal vectors per row
    coef = torch.randn(5, 3, 4, generator=g)
    targets = torch.einsum("nkm,nkd->nmd", coef, basis)
    torch.testing.assert_close(oblique_coefficients(basis, targets), coef, atol=1e-4, rtol=1e-4)
    basis[:, 2] = 0                                        # an inactive head: minimum-norm, no NaN
    c = oblique_coefficients(basis, targets)
    assert torch.isfinite(c).all() and (c[:, 2] == 0).all()


def test_heads_spanned():
    contrib = torch.tensor([[0.95, 0.03, 0.02, 0.0], [0.5, 0.45, 0.05, 0.0], [0.3, 0.3, 0.2, 0.2], [0.0, 0, 0, 0]])
    corr = MHSACorrelation(contrib, torch.tensor([5, 5, 5, 0]), 20)
    assert corr.heads_spanned().tolist() == [1, 2, 4, 0]
    assert corr.heads_spanned(0.5).tolist() == [1, 1, 2, 0]


def test_fractions_and_heads_spanned_are_undefined_for_a_head_whose_contributions_do_not_sum_positive():
    """An active head whose mean contributions sum to 0 or less (they are signed least-squares coefficients) has no
    normalisation: NaN fractions and heads_spanned -1, not inf fractions and "all heads"."""
    contrib = torch.tensor([[0.6, 0.4, 0.0], [0.5, -0.5, 0.0], [0.2, -0.7, 0.1], [0.0, 0.0, 0.0]])
    corr = MHSACorrelation(contrib, torch.tensor([3, 3, 3, 0]), 9)
    frac = corr.fractions()
    torch.testing.assert_close(frac[0], torch.tensor([0.6, 0.4, 0.0]))
    assert frac[1:].isnan().all()
    assert corr.heads_spanned().tolist() == [2, -1, -1, 0]


@torch.no_grad()
def test_correlation_logit_lens_and_cosines_on_a_tiny_model():
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsa = make_lorsa(hf, adapter)
    ls = LorsaSet(model, {LAYER: lorsa})
    rm = ReplacementModel(model, lorsas=ls)
    tokens = random_ids(batch=3, seq=9, seed=4)
    corr = mhsa_correlation(rm, LAYER, tokens, batch_size=2)
    act = attention_activations(model, LAYER, tokens)
    _, cache = lorsa(act.x, act.positions, return_cache=True)
    active = (cache.z[:, 1:] > 0)
    assert corr.n_tokens == 3 * 8
    assert torch.equal(corr.count, active.sum((0, 1)))
    assert corr.contrib.shape == (lorsa.cfg.n_ov_heads, adapter.n_heads) and torch.isfinite(corr.contrib).all()
    # a head active on exactly one token: its contrib row is that token's oblique coefficients
    once = (corr.count == 1).nonzero().flatten()
    if len(once):
        h = int(once[0])
        b, s = (cache.z[:, 1:, h] > 0).nonzero()[0].tolist()
        s += 1
        idx = cache.topk_indices[b, s]
        basis = (cache.z[b, s, idx][:, None] * lorsa.W_O[idx])[None]
        per_head = __import__("nnsight_lorsa.adapters.base", fromlist=["mhsa_forward"]).mhsa_forward(
            adapter.mhsa_weights(hf, LAYER), act.x, act.positions, per_head=True)[b, s][None]
        coef = oblique_coefficients(basis, per_head)[0]
        torch.testing.assert_close(corr.contrib[h], coef[(idx == h).nonzero()[0, 0]], atol=1e-4, rtol=1e-4)
    vals, ids, strings = ov_logit_lens(rm, LAYER, [3, 7], k=4)
    want = (lorsa.W_O[[3, 7]] * hf.model.norm.weight) @ hf.lm_head.weight.T
    torch.testing.assert_close(vals, want.topk(4, -1).values)
    assert strings is not None and len(strings[0]) == 4
    mat = torch.randn(10, lorsa.cfg.d_model)
    mat[6] = 2 * lorsa.W_V[5]
    cos = ov_feature_cosines(lorsa, 5, sae_in_decoder=mat, k=2)
    assert int(cos["v"][1][0]) == 6 and abs(float(cos["v"][0][0]) - 1) < 1e-5 and "o" not in cos
    top = collect_top_activations(rm, LAYER, tokens, n_top=3)
    assert top.n_tokens == 3 * 8 and torch.equal(top.count, corr.count)


def test_ov_logit_lens_through_gemma2_norm_gains():
    """Gemma-2: a head's output goes through ``post_attention_layernorm`` before the residual and the final norm
    after it, both with gains ``1 + weight``: the logit lens multiplies ``w_o`` by both."""
    model, hf = tiny_nnsight("gemma2")
    lorsa = make_lorsa(hf, get_adapter(model))
    rm = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: lorsa}))
    vals, ids, _ = ov_logit_lens(rm, LAYER, [3, 7], k=4)
    gain = (1 + hf.model.layers[LAYER].post_attention_layernorm.weight) * (1 + hf.model.norm.weight)
    want = ((lorsa.W_O[[3, 7]] * gain) @ hf.lm_head.weight.T).topk(4, -1)
    torch.testing.assert_close(vals, want.values)
    assert torch.equal(ids, want.indices)


def test_head_analysis_without_lorsas_names_what_to_pass():
    """Every head analysis reads the Lorsas through ReplacementModel.require: one check, one message."""
    import pytest

    from nnsight_lorsa.analysis import collect_top_activations, mhsa_correlation, ov_logit_lens
    from nnsight_lorsa.errors import ConfigMismatchError

    model, _ = tiny_nnsight("llama")
    rm = ReplacementModel(model)
    for call in (lambda: mhsa_correlation(rm, LAYER, random_ids(1, 8)),
                 lambda: ov_logit_lens(rm, LAYER, [0]),
                 lambda: collect_top_activations(rm, LAYER, random_ids(1, 8))):
        with pytest.raises(ConfigMismatchError,
                           match=r"head analysis needs a LorsaSet: ReplacementModel\(model, lorsas=\.\.\.\)"):
            call()


def test_top_activations_refuse_non_finite_activations():
    """An ``inf`` activation (an fp16 Lorsa's overflow) ranked first with value inf, and a ``-inf`` one read as an
    empty slot: both are refused as NaN is, naming the table, before anything is merged."""
    import pytest

    from nnsight_lorsa.analysis import TopActivations
    from nnsight_lorsa.errors import ArgumentError

    for bad in (float("inf"), float("-inf"), float("nan")):
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            top = TopActivations.empty(3, 2)
            z = torch.rand(2, 4, 3, generator=torch.Generator().manual_seed(0)).to(dtype)
            z[1, 2, 1] = bad
            with pytest.raises(ArgumentError, match=r"TopActivations.update.*(NaN|inf)"):
                top.update(z, 0)
            assert top.n_tokens == 0 and bool((top.window == -1).all())
            z[1, 2, 1] = 0.5
            top.update(z, 0)  # the same batch, finite: merged
            assert top.n_tokens == 8 and float(top.values[0, 0]) == float(z[..., 0].float().max())


def test_ov_feature_cosines_of_a_lorsa_on_meta_is_a_placement_error():
    """A Lorsa whose weights were never loaded (``meta``) ended in torch's "Cannot copy out of meta tensor"; it is
    the PlacementError every other head analysis raises, naming the Lorsa. bf16 / fp64 Lorsas give the fp32
    cosines of their own weights (a relative bound of fp32 rounding against an fp64 reference)."""
    import pytest

    from nnsight_lorsa.errors import PlacementError

    _, hf = tiny_nnsight("llama")
    mat = torch.randn(10, 64, generator=torch.Generator().manual_seed(1))
    for dtype in (torch.bfloat16, torch.float64):
        lorsa = make_lorsa(hf, get_adapter(hf)).to(dtype)
        got = ov_feature_cosines(lorsa, 5, sae_in_decoder=mat, sae_out_encoder=mat, k=3)
        for name, w in (("v", lorsa.W_V[5]), ("o", lorsa.W_O[5])):
            want = torch.nn.functional.cosine_similarity(mat.double(), w.double()[None], dim=-1).topk(3)
            vals, idx = got[name]
            assert vals.dtype == torch.float32 and vals.device.type == "cpu"
            assert torch.equal(idx, want.indices) and float((vals.double() - want.values).abs().max()) <= 1e-6
    lorsa = make_lorsa(hf, get_adapter(hf)).to("meta")
    with pytest.raises(PlacementError, match="Lorsa.*meta"):
        ov_feature_cosines(lorsa, 5, sae_in_decoder=mat)
