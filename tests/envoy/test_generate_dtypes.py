"""``model.generate`` with a Lorsa spliced and edited at every step, the model and the Lorsa in different dtypes
(issue 21): the tokens equal those of a no-cache loop (a full-sequence trace per step) and the per-step logits
agree to ``REL`` of max |logit| for fp32 / fp64 logits (measured: <= 4e-7) or the logits' own eps for bf16 / fp16
(measured: bit-equal); the Lorsa keeps its dtype."""

from __future__ import annotations

import pytest
import torch
from envoy.test_generate import HEAD, LAYER, REL, generated, no_cache_loop, rel_err
from helpers import make_lorsa, random_ids, tiny_nnsight

from nnsight_lorsa import LorsaSet, get_adapter

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


@pytest.mark.parametrize(("model_dtype", "lorsa_dtype"), [(BF16, F32), (F16, F32), (F32, BF16), (F16, F16),
                                                          (F64, F32), (F32, F64)], ids=str)
@pytest.mark.parametrize("error", [False, True])
def test_generate_with_a_steered_lorsa_in_another_dtype_matches_the_loop(model_dtype, lorsa_dtype, error):
    model, _ = tiny_nnsight("llama", dtype=model_dtype)
    lorsa = make_lorsa(tiny_nnsight("llama")[1], get_adapter(model), LAYER).to(lorsa_dtype)
    rset = LorsaSet(model, {LAYER: lorsa})
    ids = random_ids(2, 6)

    def edit(site):
        site.hook_z.output[..., HEAD] += 3.0

    seq, ref = no_cache_loop(model, ids, lambda: edit(rset.replace(layer=LAYER, error=error)))
    out, logits = generated(model, ids, lambda: rset.replace(layer=LAYER, error=error), each_step=edit)
    assert torch.equal(out, seq)
    bound = REL if model_dtype in (F32, F64) else torch.finfo(model_dtype).eps
    for step, (a, b) in enumerate(zip(logits, ref, strict=True)):
        assert a.dtype == b.dtype == model_dtype
        assert rel_err(a.double(), b.double()) <= bound, (step, rel_err(a.double(), b.double()))
    assert {p.dtype for p in lorsa.parameters()} == {lorsa_dtype}
    plain, _ = generated(model, ids, lambda: None)  # the steered Lorsa changes the tokens (not vacuous)
    assert not torch.equal(plain, out)
