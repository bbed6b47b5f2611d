"""A Lorsa given an all-True ``(batch, keys)`` key-padding mask computes what it computes with no mask, bit for bit.

``LorsaSet.replace`` on a sliding-window layer passed the Lorsa no mask (SDPA's ``is_causal``) when every position
of the batch was a token and the tokens as a key-padding mask (an explicit boolean mask) otherwise; telling the two
apart read the tokens back on the host (``bool(tokens.all())``), a device sync per forward per sliding layer. It now
passes the tokens whenever the model's own mask is a tensor, padding or not (no read): the same outputs as before
only if the explicit all-True causal mask and ``is_causal`` give the same bits. On the CPU they do (the math kernel
turns ``is_causal`` into the same boolean mask; the CPU flash kernel's skipped blocks add exact zeros), for the whole
forward and for a cached step (no mask over the past vs an all-True one). This test pins it for the torch installed;
on CUDA the two take different SDPA kernels (flash / memory-efficient with ``is_causal`` vs an explicit mask) and
agree to rounding only (docs/nnsight.md, "Host syncs").
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nnsight_lorsa.errors import ShapeError
from nnsight_lorsa.modules import Lorsa, LorsaConfig, RotaryConfig

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _lorsa(d_qk: int, group: int, dtype: torch.dtype, seed: int) -> Lorsa:
    n_qk = 4
    cfg = LorsaConfig(d_model=32, n_qk_heads=n_qk, d_qk_head=d_qk, n_ov_heads=n_qk * group, top_k=min(6, n_qk * group),
                      rotary=RotaryConfig(head_dim=d_qk, rotary_dim=d_qk, base=10000.0))
    lorsa = Lorsa(cfg)
    lorsa.reset_parameters(torch.Generator().manual_seed(seed))
    return lorsa.to(dtype).eval()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = [t.contiguous().view(torch.uint8) for t in (a, b)]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*bits)


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from(DTYPES), d_qk=st.sampled_from([8, 16]), group=st.sampled_from([1, 8, 16]),
       batch=st.integers(1, 3), seq=st.sampled_from([1, 2, 5, 33, 70]), seed=st.integers(0, 2**16))
def test_an_all_true_key_padding_mask_is_plain_causal_bit_for_bit(dtype, d_qk, group, batch, seq, seed):
    """``group == d_qk``: the value width equals the QK head's (the CPU flash kernel); else the math kernel."""
    lorsa = _lorsa(d_qk, group, dtype, seed)
    x = torch.randn(batch, seq, 32, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    ones = torch.ones(batch, seq, dtype=torch.bool)
    with torch.no_grad():
        assert _same(lorsa(x, None, ones), lorsa(x, None, None))
        assert _same(lorsa.compute_z_pre(x, None, ones), lorsa.compute_z_pre(x, None, None))


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from(DTYPES), group=st.sampled_from([1, 16]), batch=st.integers(1, 3),
       past=st.integers(1, 40), new=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_a_cached_step_with_an_all_true_mask_is_the_step_without_bit_for_bit(dtype, group, batch, past, new, seed):
    """A generation step over a :class:`LorsaKV` (one query attends to every key: no mask at all, vs all-True)."""
    lorsa = _lorsa(16, group, dtype, seed)
    x = torch.randn(batch, past + new, 32, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    positions = torch.arange(past + new)
    with torch.no_grad():
        _, kv = lorsa.forward_step(x[:, :past], positions[:past], None, None)
        plain = lorsa.forward_step(x[:, past:], positions[past:], None, kv)[0]
        masked = lorsa.forward_step(x[:, past:], positions[past:], torch.ones(batch, past + new, dtype=torch.bool),
                                    kv)[0]
    assert _same(masked, plain)


def _mask_forms(pad: list[int], seq: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One left-padding, written in every mask form the Lorsa takes: ``(batch, keys)`` bool / integer 0 / 1 and
    ``(batch, 1, pos, keys)`` bool / integer / additive float (0 and ``-inf`` or the dtype's minimum)."""
    tokens = torch.arange(seq)[None] >= torch.tensor(pad)[:, None]                      # (batch, keys)
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()[None, None] & tokens[:, None, None, :]
    return {"2-D bool": tokens, "2-D int64": tokens.long(), "2-D int32": tokens.int(), "2-D uint8": tokens.byte(),
            "4-D bool": allowed, "4-D int64": allowed.long(),
            "4-D additive -inf": torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, float("-inf")),
            "4-D additive min": torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed,
                                                                                     torch.finfo(dtype).min)}


@settings(max_examples=25, deadline=None)
@given(dtype=st.sampled_from(DTYPES), group=st.sampled_from([1, 8]), pads=st.lists(st.integers(0, 6), min_size=1,
       max_size=3), real=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_every_mask_form_reads_the_same_left_padding(dtype, group, pads, real, seed):
    """Every form of one mask gives the same output bit for bit, and each row's tokens what the Lorsa gives that row
    without its padding (relative bound). A float ``(batch, keys)`` mask was read as 0 / 1 (``mask.bool()``): an
    additive one (0 = token) attended to the padding only; an integer ``(batch, 1, pos, keys)`` one was torch's
    ``finfo`` ``TypeError``. The float one is now refused (its two readings cannot be told apart without reading the
    device) and the integer one read as the bool one."""
    lorsa = _lorsa(16, group, dtype, seed)
    seq = max(pads) + real
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(len(pads), seq, 32, generator=g).to(dtype)
    positions = (torch.arange(seq)[None] - torch.tensor(pads)[:, None]).clamp_min(0)
    forms = _mask_forms(pads, seq, dtype)
    with torch.no_grad():
        outs = {name: lorsa(x, positions, mask) for name, mask in forms.items()}
        for name, out in outs.items():
            assert _same(out, outs["2-D bool"]), name
        for row, pad in enumerate(pads):
            alone = lorsa(x[row:row + 1, pad:], positions[row:row + 1, pad:]).float()
            got = outs["2-D bool"][row:row + 1, pad:].float()
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert (got - alone).norm() <= tol * alone.norm() + 1e-6, (row, pad)
        for bad in (forms["4-D additive -inf"][:, 0, -1], forms["2-D bool"].to(dtype), torch.complex64):
            mask = bad if isinstance(bad, torch.Tensor) else forms["2-D bool"].to(bad)
            with pytest.raises(ShapeError, match=r"attn_mask .* is torch\.(float|bfloat|complex)"):
                lorsa(x, positions, mask)
