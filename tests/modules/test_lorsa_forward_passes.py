"""The Lorsa forward's RoPE without autograd: fewer passes over q and k, the same bits as the former form.

``apply_rotary`` used to take six kernels over each of q and k (a ``mul`` into each half of the output, a ``mul``
and a ``sub_``/``add_`` per half) and 7·numel elements read or written; it now takes three (one ``mul`` by the
:func:`rotary_table` and one ``add`` per half, 6·numel) and ``Lorsa.qk`` builds the table once for q and k. The
former form is frozen in ``benchmarks/lorsa_forward_passes.py`` (``former_apply_rotary``, the benchmark's
"before") and every result is compared with it bit for bit (signs of zeros included), in fp32, bf16 and fp16,
with and without autograd (gradients included).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.lorsa_forward_passes import former_apply_rotary as _former_apply_rotary
from nnsight_lorsa.modules import Lorsa, LorsaConfig, RotaryConfig
from nnsight_lorsa.modules import lorsa as lorsa_module
from nnsight_lorsa.modules.rotary import apply_rotary, rotary_cos_sin, rotary_table

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaNs at the same places, and the same sign on every zero (``torch.equal`` has ``-0 == 0``)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    a, b = a.masked_fill(nan, 0), b.masked_fill(nan, 0)
    return torch.equal(a, b) and torch.equal(a.signbit(), b.signbit())


def _special(x: torch.Tensor, gen: torch.Generator, fraction: float) -> torch.Tensor:
    """``x`` with some entries replaced by ±0, ±inf, tiny and huge values (for the dtype)."""
    info = torch.finfo(x.dtype)
    pool = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), info.tiny, -info.tiny, info.max, -info.max,
                         info.tiny / 4], dtype=torch.float32).to(x.dtype)
    where = torch.rand(x.shape, generator=gen) < fraction
    pick = pool[torch.randint(0, len(pool), x.shape, generator=gen)]
    return torch.where(where, pick, x)


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), interleaved=st.booleans(), rot_quarters=st.integers(1, 4),
       batch=st.integers(1, 3), per_batch_positions=st.booleans(), special=st.sampled_from([0.0, 0.2]),
       scale=st.sampled_from([1.0, 0.7]), seed=st.integers(0, 2**16))
def test_apply_rotary_has_the_former_bits(dtype, interleaved, rot_quarters, batch, per_batch_positions, special,
                                          scale, seed):
    """Without autograd (the table form) and with it (the former form, kept), ``apply_rotary`` gives the former
    implementation's bits, zeros' signs, infinities and NaN positions included, on the heads-first layout of
    ``Lorsa.qk``, with a table built by the caller or by ``apply_rotary``; the gradient is the former one too."""
    gen = torch.Generator().manual_seed(seed)
    heads, seq, head_dim = 3, 7, 16
    rope = RotaryConfig(head_dim=head_dim, rotary_dim=4 * rot_quarters, interleaved=interleaved,
                        attention_scaling=scale)
    x = (torch.randn(heads, batch * seq, head_dim, generator=gen) * 4).to(dtype)
    x = _special(x, gen, special)
    x = x.view(heads, batch, seq, head_dim).transpose(0, 1)
    positions = torch.randint(0, 5000, (batch, seq), generator=gen) if per_batch_positions else torch.arange(seq)
    cos, sin = rotary_cos_sin(rope, positions)
    want = _former_apply_rotary(x, cos, sin, interleaved)
    with torch.no_grad():
        assert same_bits(apply_rotary(x, cos, sin, interleaved), want)
        table = rotary_table(cos, sin, dtype, interleaved)
        assert same_bits(apply_rotary(x, cos, sin, interleaved, table), want)
    finite = x.isfinite().all(-1, keepdim=True).expand_as(x)
    leaf = torch.where(finite, x, 0).detach().requires_grad_(True)
    ref_leaf = leaf.detach().clone().requires_grad_(True)
    got, ref = apply_rotary(leaf, cos, sin, interleaved), _former_apply_rotary(ref_leaf, cos, sin, interleaved)
    assert same_bits(got.detach(), ref.detach())
    weight = torch.randn(got.shape, generator=gen)
    (got.float() * weight).sum().backward()
    (ref.float() * weight).sum().backward()
    assert same_bits(leaf.grad, ref_leaf.grad)


ROPE = RotaryConfig(head_dim=16, rotary_dim=16, base=500000.0, rope_type="llama3",
                    scaling=dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64))


def _lorsa(dtype: torch.dtype, rotary: RotaryConfig | None, qk_norm: bool, seed: int) -> Lorsa:
    cfg = LorsaConfig(d_model=32, n_qk_heads=4, d_qk_head=16, n_ov_heads=64, top_k=6, rotary=rotary,
                      qk_norm=qk_norm)
    lorsa = Lorsa(cfg)
    lorsa.reset_parameters(torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for p in (lorsa.b_Q, lorsa.b_K, lorsa.b_V):
            p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(seed + 1))
    return lorsa.to(dtype)


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from(DTYPES), interleaved=st.booleans(), partial=st.booleans(), qk_norm=st.booleans(),
       batch=st.integers(1, 3), seq=st.integers(1, 9), mask=st.booleans(), positions=st.booleans(),
       seed=st.integers(0, 2**16))
def test_lorsa_forward_and_gradients_have_the_former_bits(dtype, interleaved, partial, qk_norm, batch,
                                                          seq, mask, positions, seed):
    """The whole forward (output, z_pre, z, top-k indices) without autograd, and the output and every parameter's
    gradient with autograd, are the former implementation's bit for bit."""
    rotary = RotaryConfig(head_dim=16, rotary_dim=8 if partial else 16, interleaved=interleaved,
                          rope_type="llama3", base=500000.0, scaling=dict(ROPE.scaling))
    lorsa = _lorsa(dtype, rotary, qk_norm, seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, 32, generator=gen).to(dtype)
    pos = torch.randint(0, 3000, (batch, seq), generator=gen) if positions else None
    attn = (torch.rand(batch, seq, generator=gen) < 0.8).long() if mask else None

    def run(grad: bool):
        lorsa.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grad):
            out, cache = lorsa(x, pos, attn, return_cache=True)
        grads = []
        if grad:
            (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
            grads = [p.grad.clone() for p in lorsa.parameters() if p.grad is not None]
        return [out.detach(), cache.z_pre.detach(), cache.z.detach(), cache.topk_indices], grads

    new = run(False), run(True)
    with mock.patch.object(lorsa_module, "apply_rotary", _former_apply_rotary):
        old = run(False), run(True)
    for (got_t, got_g), (ref_t, ref_g) in zip(new, old, strict=True):
        assert all(same_bits(a, b) if a.is_floating_point() else torch.equal(a, b)
                   for a, b in zip(got_t, ref_t, strict=True))
        assert len(got_g) == len(ref_g) and all(same_bits(a, b) for a, b in zip(got_g, ref_g, strict=True))


class _Passes(TorchDispatchMode):
    """Ops that write at least ``floor`` elements, and the elements they write (views and allocations aside)."""

    def __init__(self, floor: int) -> None:
        super().__init__()
        self.floor, self.ops, self.written = floor, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name.startswith("empty") or func.is_view:
            return out
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        n = sum(t.numel() for t in outs)
        if n >= self.floor:
            self.ops.append(name)
            self.written += n
        return out


@pytest.mark.parametrize("interleaved", [False, True], ids=["half-split", "interleaved"])
def test_rope_without_autograd_is_three_passes(interleaved):
    """Without autograd ``apply_rotary`` passes over q-sized buffers with three ops (one ``mul`` writing both
    products, two ``add``\\ s writing a half each; 3·numel written, 3·numel read), where the former form took six
    (3·numel written, 4·numel read); and ``Lorsa.qk`` does that for q and k after the two projections."""
    x = torch.randn(4, 2, 32, 16).transpose(0, 1)  # heads-first, as Lorsa.qk lays it out
    cos, sin = rotary_cos_sin(RotaryConfig(head_dim=16, rotary_dim=16, interleaved=interleaved), torch.arange(32))
    passes = _Passes(x.numel() // 2)
    with torch.no_grad(), passes:
        apply_rotary(x, cos, sin, interleaved)
    assert passes.ops == ["mul", "add", "add"] and passes.written == 3 * x.numel()
    lorsa = _lorsa(torch.float32, ROPE, False, 0)
    xs = torch.randn(2, 32, 32)
    passes = _Passes(2 * 32 * 4 * 16 // 2)
    with torch.no_grad(), passes:
        lorsa.qk(xs)
    assert passes.ops == ["baddbmm", "baddbmm", "mul", "add", "add", "mul", "add", "add"]
