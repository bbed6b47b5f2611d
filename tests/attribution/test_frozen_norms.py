"""The frozen norms of the attribution pass (``attribution.frozen.norm_scale`` / ``frozen_norm`` /
``normalized_input``) against the norm modules themselves: at the prompt's own input the frozen norm is the module's
output, and its scale is the one the module divides by. ``torch.nn.RMSNorm`` has ``normalized_shape`` and ``eps`` like
a LayerNorm: until 2026-11-30 it was read as one (mean-centred: a scale of 1.59 where ``1/rms`` was 0.34; found by the
tenth session's analysis probe)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from nnsight_lorsa.attribution.frozen import frozen_norm, norm_scale, normalized_input

D = 16


def norms():
    g = torch.Generator().manual_seed(0)
    out = {"layer_norm": nn.LayerNorm(D), "llama_rms": LlamaRMSNorm(D, eps=1e-6),
           "torch_rms": nn.RMSNorm(D, eps=1e-6), "torch_rms_default_eps": nn.RMSNorm(D)}
    with torch.no_grad():
        for m in out.values():
            m.weight.copy_(1 + 0.3 * torch.randn(D, generator=g))
            if getattr(m, "bias", None) is not None:
                m.bias.copy_(0.2 * torch.randn(D, generator=g))
    return out


@pytest.mark.parametrize("name", ["layer_norm", "llama_rms", "torch_rms", "torch_rms_default_eps"])
def test_a_frozen_norm_at_its_own_input_is_the_module(name):
    norm = norms()[name]
    x = 3.0 + 2.0 * torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1))  # a mean far from 0
    with torch.no_grad():
        want = norm(x)
        scale = norm_scale(norm, x)
        got = frozen_norm(norm, x, scale, None)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    if name != "layer_norm":  # an RMSNorm divides by rms(x), with no mean taken out
        eps = getattr(norm, "variance_epsilon", None) or norm.eps or torch.finfo(x.dtype).eps
        rms = (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
        assert torch.allclose(scale, 1 / rms, rtol=1e-6)
        assert torch.allclose(normalized_input(norm, x, scale), x / rms, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_rmsnorm_without_eps_in_half_precision(dtype):
    """``torch.nn.RMSNorm(eps=None)`` on a bf16 / fp16 input uses fp32's eps (it computes in fp32): the frozen scale
    took the input dtype's (86% off the module for inputs near 0.01; the session's mutation review)."""
    norm = nn.RMSNorm(D).to(dtype)
    x = (0.01 * torch.randn(2, 5, D, generator=torch.Generator().manual_seed(2))).to(dtype)
    with torch.no_grad():
        want = norm(x).float()
        got = frozen_norm(norm, x, norm_scale(norm, x), None).float()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
