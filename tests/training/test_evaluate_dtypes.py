"""``evaluate`` across model dtypes (issue 21): CE and KL are computed in fp32 from the logits; logits that an
fp16 model overflowed (|logit| > 65504 is ``inf``) made every CE and the KL NaN in the returned Evaluation
with no word. Now a NonFiniteError names the metric, the batch and the logits' dtype."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import make_transcoders, random_ids, tiny_nnsight

from nnsight_lorsa import TranscoderSet
from nnsight_lorsa.errors import NonFiniteError
from nnsight_lorsa.training import TokenDataset, evaluate

HELD = TokenDataset(random_ids(batch=4, seq=12, seed=5))


def _loud_head(dtype: torch.dtype):
    """The tiny Llama in ``dtype`` with its final norm and unembedding scaled: logits of order 1e5-1e6."""
    model, hf = tiny_nnsight("llama", dtype=dtype)
    with torch.no_grad():
        hf.lm_head.weight.mul_(1e5)
        hf.model.norm.weight.mul_(100)
    return model, hf


def test_logits_past_fp16s_range_are_a_named_error_not_nan_metrics():
    model, hf = _loud_head(torch.float16)
    with torch.no_grad():
        logits = hf(HELD.tokens[:4]).logits
    assert not bool(torch.isfinite(logits).all())  # the fp16 model overflows its logits (not vacuous)
    with pytest.raises(NonFiniteError, match=r"ce_orig.*batch 0.*float16") as info:
        evaluate(TranscoderSet(model, {1: make_transcoders([1])[1]}), HELD, at=1, batch_size=4)
    assert info.value.step == 0 and info.value.tensor == "ce_orig"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_same_loud_model_in_a_wider_range_evaluates_finite(dtype):
    """bf16 and fp32 hold those logits: every metric finite and close to the fp64 model's, relative 8 of the
    dtype's eps (measured: bf16 3.7e-2 on CE of logits ~1e6, whose gaps carry the dtype's rounding)."""
    got = evaluate(TranscoderSet(_loud_head(dtype)[0], {1: make_transcoders([1])[1]}), HELD, at=1, batch_size=4)
    want = evaluate(TranscoderSet(_loud_head(torch.float64)[0], {1: make_transcoders([1])[1]}), HELD, at=1,
                    batch_size=4)
    for name in ("ce_orig", "ce_spliced", "ce_zero", "kl"):
        g, w = getattr(got, name), getattr(want, name)
        assert math.isfinite(g), name
        assert abs(g - w) <= 8 * torch.finfo(dtype).eps * abs(w), (name, g, w)


def test_gemma2_cross_entropy_is_the_models_own():
    """Gemma-2 soft-caps its logits after the unembedding (whose output the traces read): ``evaluate``'s CE is the
    model's own, from its capped logits, not that of the uncapped unembedding output."""
    from nnsight_lorsa.training.evaluate import next_token_ce

    model, hf = tiny_nnsight("gemma2")
    ev = evaluate(TranscoderSet(model, {1: make_transcoders([1])[1]}), HELD, at=1, batch_size=4)
    ids, mask = HELD.tokens[:4], HELD.targets(0, 4)
    with torch.no_grad():
        logits = hf(ids).logits
        ce, n = next_token_ce(logits, ids, mask)
        uncapped, _ = next_token_ce(hf.lm_head(hf.model(ids).last_hidden_state), ids, mask)
    assert abs(ev.ce_orig - float(ce) / n) < 1e-5 * float(ce) / n
    assert abs(float(uncapped) - float(ce)) / float(ce) > 1e-3  # the cap bites
