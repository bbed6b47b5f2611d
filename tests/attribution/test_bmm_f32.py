"""Attention scores in at least fp32 without upcast copies on an accelerator (:func:`nnsight_lorsa._placement.bmm_f32`,
issue 21 (d): the recomputed Lorsa pattern rows of every attribution pass multiplied fp32 copies of bf16 queries and
keys, at an H100/H200's fp32 rate, ~1/15 of its bf16 one). On the CPU the upcast product bit for bit; on ``meta`` (an
accelerator's dispatch without one) the half-input overload with an fp32 result and no copy; on CUDA (``gpu``) the
fp32 product of the same numbers within fp32 rounding, fp16 past 65504 finite."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import DEVICES
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import nnsight_lorsa.attribution.frozen as frozen
from nnsight_lorsa._placement import bmm_f32
from nnsight_lorsa.attribution.frozen import PatternRows, z_pre


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3), i=st.integers(1, 9), k=st.integers(1, 70), j=st.integers(1, 9),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
       seed=st.integers(0, 2**16), transposed=st.booleans())
def test_on_the_cpu_the_scores_are_the_upcast_product_bit_for_bit(n, i, k, j, dtype, seed, transposed):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(n, i, k, generator=g) * 30).to(dtype)
    b = (torch.randn(n, j, k, generator=g) * 30).to(dtype).transpose(1, 2) if transposed else \
        (torch.randn(n, k, j, generator=g) * 30).to(dtype)
    got = bmm_f32(a, b)
    wide = torch.promote_types(dtype, torch.float32)
    assert got.dtype == wide
    assert torch.equal(got, torch.bmm(a.to(wide), b.to(wide)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_an_accelerator_half_inputs_multiply_as_they_are_with_an_fp32_result(dtype):
    """On ``meta`` (dispatched as on a device): one ``bmm.dtype``, no upcast copy of either input."""
    a = torch.empty(4, 16, 128, dtype=dtype, device="meta")
    b = torch.empty(4, 128, 2048, dtype=dtype, device="meta")
    with Ops() as spy:
        out = bmm_f32(a, b)
    assert out.dtype == torch.float32 and out.shape == (4, 16, 2048) and out.device.type == "meta"
    assert spy.ops == ["aten.bmm.dtype"], spy.ops


def test_the_recomputed_pattern_rows_take_their_scores_from_it(monkeypatch):
    """:class:`PatternRows` passes bf16 queries and keys to :func:`bmm_f32` as they are (the former code upcast them
    first: fp32 copies, multiplied at the fp32 rate on a GPU)."""
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    original = frozen.bmm_f32

    def spy(a, b):
        seen.append((a.dtype, b.dtype))
        return original(a, b)

    monkeypatch.setattr(frozen, "bmm_f32", spy)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 12, 8, generator=g).to(torch.bfloat16)
    group, qpos = torch.randint(0, 3, (20,), generator=g), torch.randint(0, 12, (20,), generator=g)
    v = torch.randn(2, 12, 5, generator=g).to(torch.bfloat16).requires_grad_(True)
    out = z_pre(v, PatternRows(q, k, group, qpos, math.sqrt(8)), torch.randint(0, 5, (20,), generator=g))
    out.sum().backward()
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_cuda_the_scores_are_the_fp32_product_within_rounding(device, dtype):
    g = torch.Generator().manual_seed(0)
    scale = 300.0 if dtype == torch.float16 else 30.0  # fp16: products summing past 65504
    a = (torch.randn(8, 64, 128, generator=g) * scale).to(dtype)
    b = (torch.randn(8, 128, 512, generator=g) * scale).to(dtype)
    want = torch.bmm(a.double(), b.double())
    got = bmm_f32(a.to(device), b.to(device)).cpu()
    assert got.dtype == torch.float32 and bool(torch.isfinite(got).all())
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
