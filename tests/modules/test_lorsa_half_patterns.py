"""A Lorsa's explicit attention patterns (``attention_pattern``, ``z_pattern``: the dashboards, QK ablation references,
attribution's stored pattern rows) in bf16 / fp16 (issue 21): the scores ``q·k`` were formed in the Lorsa's dtype
before the division by the scale, so an fp16 Lorsa whose unscaled ``q·k`` passed 65504 had inf scores and NaN
patterns where its forward (SDPA, which scales first) was finite — a z-pattern of NaN on a dashboard. The scores
and the softmax run in fp32 (as attribution's :class:`PatternRows` does), the pattern returned in the Lorsa's dtype."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import make_lorsa, tiny_hf_model

from nnsight_lorsa import get_adapter


def _loud(dtype: torch.dtype, mult: float):
    hf = tiny_hf_model("llama")
    lorsa = make_lorsa(hf, get_adapter(hf))
    with torch.no_grad():
        lorsa.W_Q.mul_(mult)
        lorsa.W_K.mul_(mult)
    return copy.deepcopy(lorsa).double(), lorsa.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mult", [1.0, 700.0])
def test_half_precision_patterns_follow_the_fp64_ones_where_the_forward_is_finite(dtype, mult):
    ref, lorsa = _loud(dtype, mult)
    x = torch.randn(2, 8, lorsa.cfg.d_model, generator=torch.Generator().manual_seed(0)).to(dtype)
    q, k = ref.qk(x.double())
    if mult > 1:  # the unscaled scores leave fp16's range, the scaled ones do not (not vacuous)
        raw = (q @ k.transpose(-1, -2)).tril()
        assert float(raw.abs().max()) > 65504 > float(raw.abs().max()) / lorsa.cfg.scale
    z_pre = lorsa.compute_z_pre(x)
    assert bool(torch.isfinite(z_pre).all())
    pattern = lorsa.attention_pattern(x)
    want = ref.attention_pattern(x.double())
    assert pattern.dtype == dtype and bool(torch.isfinite(pattern).all())
    eps = torch.finfo(dtype).eps
    assert float((pattern.double() - want).abs().max()) <= 2 * eps  # rounded once to the Lorsa's dtype
    heads = list(range(lorsa.cfg.n_ov_heads))[:16]
    zp = lorsa.z_pattern(x, heads)
    assert zp.dtype == dtype and bool(torch.isfinite(zp).all())
    want_zp = ref.z_pattern(x.double(), heads)
    err = float((zp.double() - want_zp).abs().max() / want_zp.abs().max())
    assert err <= 8 * eps, err
