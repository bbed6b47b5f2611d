"""Mutation probe, round 4 (sparse coders): tests for mutants the area's tests let pass (docs/reliability.md,
"Mutation probe, round 4"). Each was seen failing with its mutant and passing on the clean tree."""

from __future__ import annotations

import torch

from nnsight_lorsa.modules.activations import BatchTopK


def test_batchtopk_inference_zeroes_an_input_at_the_threshold():
    """BatchTopK at inference is ``x · 1[x > θ]`` (Bussmann et al. 2024; SAELens' JumpReLU rule, strict), the same
    as its :meth:`to_jumprelu` export: inputs exactly at ``θ`` give 0 (mutant: ``x ≥ θ``)."""
    act = BatchTopK(k=2, d_sae=6)
    act.set_threshold(0.5)
    act.eval()
    x = torch.tensor([[0.5, 0.25, 0.75, -1.0, 0.5, 2.0], [0.0, 0.5, 0.5, 0.625, 0.4375, 0.5]])
    want = x * (x > 0.5).to(x.dtype)
    assert torch.equal(act(x), want)
    assert torch.equal(act.to_jumprelu()(x), want)

