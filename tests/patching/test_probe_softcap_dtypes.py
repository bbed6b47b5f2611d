"""Gemma-2's final logit soft-cap in the model's dtype: what experiments, ``evaluate`` and attribution read as
"the model's logits" are the logits a bf16 / fp16 Gemma-2 outputs, bit for bit.

transformers' ``Gemma2ForCausalLM`` caps in the logits' dtype (``logits / c``, ``tanh``, ``· c``, each rounded
to bf16 / fp16); ``ArchitectureAdapter.final_logits`` capped in fp32 and rounded once, and the attribution's
target probabilities capped the fp32 upcast: in bf16 a third of the logits were one ulp off (up to 0.0156), the
experiments' baselines with them, the graph's target probabilities 2.2e-4 away from the model's.
Reference: the plain Hugging Face model's ``logits``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import attribution_setup, make_lorsa, random_ids, rm, tiny_nnsight, unembed

from nnsight_lorsa import get_adapter
from nnsight_lorsa.attribution import attribute
from nnsight_lorsa.patching import MHSAHead, ReplacementModel, logit_difference
from nnsight_lorsa.patching.experiments import ablation_effect

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@torch.no_grad()
def test_the_final_logits_are_the_models_bit_for_bit(dtype):
    model, hf = tiny_nnsight("gemma2", dtype=dtype)
    adapter = get_adapter(model)
    ids = random_ids(4, 30, seed=1)
    with model.trace(ids):
        head = unembed(model).output.save()
    want = hf(ids).logits
    got = adapter.final_logits(head)
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want), int((got != want).sum())  # bf16: 4914 of 15360 were one ulp off
    baseline = ablation_effect(ReplacementModel(model), ids, [MHSAHead(1, 0)], correct_ids=5, incorrect_ids=9).baseline
    assert torch.equal(baseline, logit_difference(want, 5, 9).cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_the_graphs_target_probabilities_are_the_models(dtype):
    model, hf, lorsas, tcs = attribution_setup("gemma2")
    hf.to(dtype)
    lorsas = {0: make_lorsa(hf.float(), get_adapter(model), 0)}
    hf.to(dtype)
    ids = random_ids(1, 12, seed=4)[0]
    graph = attribute(rm(model, lorsas, tcs), ids, batch_size=32)
    with torch.no_grad():
        probs = hf(ids[None]).logits[0, -1].float().softmax(-1)
    assert torch.allclose(graph.logit_probs, probs[graph.nodes.index[graph.logit_ids]], rtol=0, atol=1e-7)
