"""Attribution test added by the sixth mutation probe (docs/reliability.md, "Mutation probe, round 6"): round 5's
mutant 11 (a cache cast to the model's dtype rather than to ``dtype=``), left then as probably equivalent, measured
and killed."""

from __future__ import annotations

import torch
from helpers import attribution_setup, random_ids, rm

from nnsight_lorsa.attribution import attribute, cache_for_attribution


def test_an_fp32_cache_attributed_in_fp32_on_a_bf16_model_keeps_its_fp32_values():
    """A bf16 model, its cache made in fp32 (before the cast), attributed with ``dtype=torch.float32``: the graph of
    the same weights held in fp32 from the same cache, to fp32 rounding (mutant: the cache rounded to bf16 on the way
    in, 1e-3 of the largest edge off)."""
    model, hf, lorsas, tcs = attribution_setup("llama")
    modules = [hf, *lorsas.values(), *tcs.values()]
    ids = random_ids(1, 8, seed=7)[0]
    for m in modules:  # bf16 weights held in fp32: the reference computes in fp32 with the bf16 model's weights
        m.to(torch.bfloat16).to(torch.float32)
    cache = cache_for_attribution(rm(model, lorsas, tcs), ids)
    assert cache.embeddings.dtype == torch.float32
    want = attribute(rm(model, lorsas, tcs), cache, batch_size=40)
    for m in modules:
        m.to(torch.bfloat16)
    got = attribute(rm(model, lorsas, tcs), cache, batch_size=40, dtype=torch.float32)
    assert got.meta["dtype"] == "torch.float32" and torch.equal(got.layout_ids, want.layout_ids)
    a, b = got.densify(), want.densify()
    scale = float(b.abs().max())
    assert float((a - b).abs().max()) <= 1e-5 * scale, float((a - b).abs().max()) / scale
    assert cache.embeddings.dtype == torch.float32  # the caller's cache is not cast in place
