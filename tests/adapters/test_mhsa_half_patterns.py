"""The MHSA pattern recomputed from a model's weights (``mhsa_pattern``: attribution's frozen attention, head
analysis) of an fp16 model (issue 21): the unscaled scores ``q·k`` were formed in fp16, so a model whose ``q·k``
passed 65504 before the scale had inf scores and NaN patterns where the model itself (SDPA, eager's softmax in fp32
after the scale) was finite — attribution of such a model then failed with a misleading error (an edge "later than
the target"). The scores and softmax run in fp32; the pattern is returned in the model's dtype."""

from __future__ import annotations

import pytest
import torch
from helpers import make_transcoders, random_ids, tiny_hf_model, tiny_nnsight
from helpers import rm as make_rm

from nnsight_lorsa import get_adapter
from nnsight_lorsa.adapters.base import mhsa_pattern, mhsa_qk
from nnsight_lorsa.attribution import attribute

LOUD = 600.0  # q and k scaled: the tiny Llama's unscaled q·k reach ~1.5e5 at its attention inputs


def _loud(hf):
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(LOUD)
            layer.self_attn.k_proj.weight.mul_(LOUD)
    return hf


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_the_mhsa_pattern_of_a_half_model_is_its_queries_and_keys_softmax_in_fp64_rounded_once(dtype):
    hf = _loud(tiny_hf_model("llama")).to(dtype)
    adapter = get_adapter(hf)
    w = adapter.mhsa_weights(hf, 1)
    x = torch.randn(2, 8, adapter.d_model, generator=torch.Generator().manual_seed(0)).to(dtype)
    q, k = mhsa_qk(w, x)  # the model's own queries and keys, in its dtype
    raw = (q.double() @ k.double().transpose(-1, -2)).tril()
    assert float(raw.abs().max()) > 65504 > float(raw.abs().max()) * w.scale  # not vacuous
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    want = (q.double() @ k.double().transpose(-1, -2) * w.scale).masked_fill(~causal, float("-inf")).softmax(-1)
    got = mhsa_pattern(w, x)
    assert got.dtype == dtype and bool(torch.isfinite(got).all())
    assert float((got.double() - want).abs().max()) <= 2 * torch.finfo(dtype).eps


def test_an_fp16_model_whose_raw_scores_leave_fp16s_range_is_attributed():
    model, hf = tiny_nnsight("llama", attn="sdpa", dtype=torch.float16)
    _loud(hf)
    ids = random_ids(1, 8, seed=1)[0]
    with torch.no_grad():
        assert bool(torch.isfinite(hf(ids[None]).logits).all())  # the model itself is finite
    tcs = {k: v.half() for k, v in make_transcoders((0, 1, 2)).items()}
    g = attribute(make_rm(model, None, tcs), ids)
    assert g.meta["dtype"] == "torch.float16" and bool(torch.isfinite(g.densify()).all())
