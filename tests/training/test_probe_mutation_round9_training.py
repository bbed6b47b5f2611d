"""Mutation probe, round 9 (docs/reliability.md): master weights, the WSD schedule and the Lorsa recipe.

Each test here was seen failing with a one-line mutant of the module it names that the default tests let
through, and passes on the package as it is; the references are independent (a documented rule, plain torch)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nnsight_lorsa.training.master_weights import MasterWeights
from nnsight_lorsa.training.schedule import wsd_lr_factor


@pytest.mark.parametrize("min_factor", [0.0, 1 / 32, 0.25])
def test_wsd_decay_is_one_straight_line_from_the_plateau_to_min_factor(min_factor):
    """The decay (its docstring: linear, ending at ``min_factor`` on the last step) over ``decay`` steps is the
    straight line from the plateau's 1.0 to ``min_factor``: ``linspace(1, min_factor, decay + 1)[1:]`` — its first
    step already below 1 and every step the same size."""
    total, decay = 100, 20
    got = torch.tensor([wsd_lr_factor(s, total, warmup_frac=0.1, decay_frac=0.2, min_factor=min_factor)
                        for s in range(total - decay - 1, total)], dtype=torch.float64)
    want = torch.linspace(1.0, min_factor, decay + 1, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------------------- master weights
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


class _Toy(nn.Module):
    """A bf16 weight, an fp32 bias and a bf16 trained buffer (as BatchTopK's threshold) plus an fp32 one."""

    trained_buffers = ("theta", "count")

    def __init__(self, dtype: torch.dtype = BF16) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(3, 4, generator=g).to(dtype))
        self.b = nn.Parameter(torch.randn(4, generator=g))
        self.register_buffer("theta", torch.tensor([1.0, 2.0]).to(dtype))
        self.register_buffer("count", torch.tensor([0.0, 0.0]))

    def forward(self) -> None:  # an estimate updated in place by a step below half a bf16 ulp of 1.0
        self.theta.add_(1e-3)


def test_disabled_master_weights_hold_nothing():
    m = _Toy()
    mw = MasterWeights(m.parameters(), enabled=False)
    mw.add_buffers(m)
    assert len(mw) == 0 and mw.held(m.w) is m.w and mw.buffer_masters() == []


def test_only_low_precision_trained_buffers_get_an_fp32_master():
    m = _Toy()
    mw = MasterWeights(m.parameters())
    mw.add_buffers(m)
    assert mw.has_buffer(m.theta) and not mw.has_buffer(m.count)
    (master,) = mw.buffer_masters()
    assert master.dtype == F32 and torch.equal(master, m.theta.float())
    # what a checkpoint saves for the buffer is the fp32 master, not the bf16 buffer
    saved = mw.named_buffers(m)
    assert list(saved) == ["theta"] and saved["theta"].dtype == F32


def test_estimating_accumulates_below_bf16_resolution_and_rounds_into_the_buffer():
    """10 EMA-like steps of 1e-3 on θ = 1 (bf16 ulp 2^-7): in fp32 they add up to 1.01, the buffer its rounding."""
    m = _Toy()
    mw = MasterWeights(m.parameters())
    mw.add_buffers(m)
    for _ in range(10):
        with mw.estimating(m):
            assert m.theta.dtype == F32
            m()
    ref = torch.tensor([1.0, 2.0], dtype=BF16).float()
    for _ in range(10):
        ref = ref + 1e-3
    torch.testing.assert_close(mw.buffer_masters()[0], ref, rtol=0, atol=1e-6)
    assert m.theta.dtype == BF16 and torch.equal(m.theta, ref.to(BF16))


def test_restore_estimates_puts_back_the_buffer_and_its_master():
    m = _Toy()
    mw = MasterWeights(m.parameters())
    mw.add_buffers(m)
    saved = mw.estimates(m)
    before = mw.buffer_masters()[0].clone()
    with mw.estimating(m):
        m()
    mw.restore_estimates(saved)
    assert torch.equal(mw.buffer_masters()[0], before) and torch.equal(m.theta, before.to(BF16))


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_editing_acts_on_the_masters_and_leaves_their_rounding(dtype):
    m = _Toy(dtype)
    mw = MasterWeights(m.parameters())
    master = mw.held(m.w)
    ref = m.w.detach().double() / 3.0
    with mw.editing(m):
        assert m.w is master and m.w.dtype == F32
        m.w.div_(3.0)
    assert m.w is not master and m.w.dtype == dtype
    torch.testing.assert_close(master.double(), ref, rtol=2.0 ** -23, atol=0)
    assert torch.equal(m.w, master.to(dtype))


def test_the_rounded_copy_is_in_the_parameters_dtype():
    m = _Toy()
    mw = MasterWeights(m.parameters())
    with mw.editing(m):
        m.w.mul_(1.0 + 2.0 ** -12)  # below half a bf16 ulp: the master moves, its rounding may not
        rounded = mw.rounded_copy(m)
    want = mw.held(m.w).detach().to(BF16)
    assert rounded.w.dtype == BF16 and torch.equal(rounded.w, want) and rounded.b.dtype == F32


def test_set_writes_the_master_and_rounds_the_parameter():
    m = _Toy()
    mw = MasterWeights(m.parameters())
    value = torch.linspace(-1, 1, 12, dtype=torch.float64).view(3, 4) * (1 + 2.0 ** -10)
    mw.set_(m.w, value)
    assert torch.equal(mw.held(m.w), value.float()) and torch.equal(m.w, value.float().to(BF16))
    mw.set_(m.b, value[0])  # no master: the parameter itself, cast
    assert torch.equal(m.b, value[0].float())

