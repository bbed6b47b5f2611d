"""Lorsa ``resample_dead`` probe: padding never counts.

The ``resample`` dead-head remedy re-initialises a dead head toward a counted token's attended input
``x̄_i = Σ_j A_ij x_j`` minus its mean over the counted tokens. Until 2026-11-27 it computed the attention pattern
``A`` without the batch's key-padding mask and positions (the training forward has both): on left-padded windows
every real token attended to the padding before it (and RoPE saw shifted positions), so the values at padded
positions — anything a source puts there — changed the re-initialised heads. Checked here against the
padding-free references: the same windows right-padded (causal: padding after a token is never attended), and
the same windows with other values at their padded positions (an fp64 Lorsa; relative bound 1e-5, the
attended inputs being computed in fp32), through
:func:`~nnsight_lorsa.training.lorsa_recipe.resample_dead` and through the trainer's ``dead_remedy="resample"``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import generated
from hypothesis import strategies as st

from nnsight_lorsa.modules import Lorsa, LorsaConfig, RotaryConfig
from nnsight_lorsa.training import LorsaObjective, LorsaRecipe, TrainConfig, Trainer
from nnsight_lorsa.training.activations import Batch
from nnsight_lorsa.training.lorsa_recipe import resample_dead

DT = torch.float64
D, SEQ = 8, 7
#: resample_dead computes the attended inputs in fp32 (whatever the Lorsa's dtype): their differences from the mean
#: carry fp32 rounding, amplified by the normalisation of a short direction
REL = 1e-5


def _lorsa(seed: int) -> Lorsa:
    cfg = LorsaConfig(d_model=D, n_qk_heads=2, d_qk_head=4, n_ov_heads=8, top_k=2,
                      rotary=RotaryConfig(head_dim=4, rotary_dim=4, base=10000.0))
    lorsa = Lorsa(cfg)
    lorsa.reset_parameters(torch.Generator().manual_seed(seed))
    return lorsa.to(DT)


def _windows(seed: int, lengths: list[int], left: bool, garbage: float) -> Batch:
    """Windows of ``lengths`` real tokens padded to :data:`SEQ` (left or right); the padded positions hold
    ``garbage`` times noise (0: zeros). The real tokens' values depend on ``seed`` and ``lengths`` only."""
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    real_x = torch.randn(b, SEQ, D, generator=g, dtype=DT)
    real_y = torch.randn(b, SEQ, D, generator=g, dtype=DT)
    noise = torch.Generator().manual_seed(seed + int(garbage * 1000) + 1)
    x = garbage * torch.randn(b, SEQ, D, generator=noise, dtype=DT)
    y = garbage * torch.randn(b, SEQ, D, generator=noise, dtype=DT)
    real = torch.zeros(b, SEQ, dtype=torch.bool)
    positions = torch.zeros(b, SEQ, dtype=torch.long)
    for i, n in enumerate(lengths):
        cols = slice(SEQ - n, SEQ) if left else slice(0, n)
        x[i, cols], y[i, cols] = real_x[i, :n], real_y[i, :n]
        real[i, cols] = True
        positions[i, cols] = torch.arange(n)
    loss_mask = real.clone()
    loss_mask[torch.arange(b), real.int().argmax(1)] = False  # the first real token (BOS) not counted
    return Batch(x, y, loss_mask, positions, real.long())


def _real_tokens(t: torch.Tensor, batch: Batch) -> torch.Tensor:
    return t[batch.attn_mask.bool()]


@generated(examples=10, sweep=150, seed=st.integers(0, 2 ** 16),
           lengths=st.lists(st.integers(2, SEQ), min_size=1, max_size=4), n_dead=st.integers(1, 8))
def test_resample_dead_is_the_same_for_left_and_right_padding_and_any_padded_values(seed, lengths, n_dead):
    dead = torch.zeros(8, dtype=torch.bool)
    dead[torch.randperm(8, generator=torch.Generator().manual_seed(seed))[:n_dead]] = True
    results = []
    for left, garbage in ((False, 0.0), (False, 50.0), (True, 0.0), (True, 50.0)):
        b = _windows(seed, lengths, left, garbage)
        lorsa = _lorsa(seed)
        err = b.y - b.x  # an error that is garbage at the padded positions too
        moved = resample_dead(lorsa, b.x, err, b.loss_mask, dead, torch.Generator().manual_seed(seed),
                              positions=b.positions, attn_mask=b.attn_mask)
        results.append((moved, lorsa.W_V.detach().clone(), lorsa.b_V.detach().clone(), lorsa.W_O.detach().clone()))
    want = results[0]
    for got in results[1:]:
        assert torch.equal(got[0], want[0])
        for a, w in zip(got[1:], want[1:], strict=True):
            assert (a - w).norm() <= REL * w.norm().clamp_min(1e-30), (a - w).abs().max()


@pytest.mark.parametrize("left", [True, False])
def test_training_with_resampling_ignores_the_padded_values(left):
    """4 steps with ``dead_remedy="resample"`` (heads dead after 10 tokens: resampled from step 1) on the same
    windows with zeros or noise (×50) at the padded positions: the same Lorsa (relative 1e-5). Before the fix the
    left-padded runs parted at the first resampling."""
    lengths = [7, 4, 2, 5, 3, 6]

    def run(garbage: float) -> Lorsa:
        bs = [_windows(10 + i, lengths, left, garbage) for i in range(4)]
        torch.manual_seed(0)
        lorsa = _lorsa(1)
        recipe = LorsaRecipe(ov_init="random", dead_remedy="resample", remedy_until=1.0, rank_by_decoder_norm=False)
        trainer = Trainer(LorsaObjective(lorsa, recipe=recipe), lambda i: bs[i],
                          TrainConfig(total_steps=4, lr=1e-2, norm_batches=1, dead_after_tokens=10))
        trainer.train(progress=False)
        return trainer.module

    want, got = run(0.0), run(50.0)
    for (name, p), q in zip(want.named_parameters(), got.parameters(), strict=True):
        assert (p - q).norm() <= REL * p.norm().clamp_min(1e-30), name
