"""Mutation probe, round 7 (docs/reliability.md): ``TrainConfig``'s defaults and checks, and the objective
contract's shared pieces (``_Objective.estimate_norms``, ``TrainingState.reset_latents``). Each test was seen
failing with one hand-made mutant of ``training/train_config.py`` / ``training/objective_base.py`` and passing
on the clean tree; the references are the documented formulas and rules, computed here in plain torch."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from nnsight_lorsa.errors import ArgumentError
from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig
from nnsight_lorsa.training import TrainConfig, Trainer
from nnsight_lorsa.training.activations import Batch
from nnsight_lorsa.training.objective_base import TrainingState

D_IN, D_OUT, NORM_BATCHES = 6, 10, 3


def _batch(i: int) -> Batch:
    """Batch ``i``: its own scale (``i + 1``, so that the batches' norms differ), BOS and a padded tail masked out
    and holding large values (counted, they would move the mean by orders of magnitude)."""
    g = torch.Generator().manual_seed(i)
    x = torch.randn(2, 5, D_IN, generator=g) * (i + 1)
    y = torch.randn(2, 5, D_OUT, generator=g) * 3 * (i + 1)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[:, 0] = False
    mask[1, 3:] = False
    x[~mask] = 1e3
    y[~mask] = 1e3
    return Batch(x=x, y=y, loss_mask=mask)


def test_the_scale_factors_are_the_formula_over_the_counted_tokens_of_the_norm_batches():
    """``s = sqrt(d) / E‖·‖`` over the loss-masked tokens of the first ``norm_batches`` batches (``_Objective``'s
    docstring), ``d`` the input's width for ``s_in`` and the target's for ``s_out`` (a transcoder of
    ``d_out != d_in``) (mutants: the mask ignored, ``sqrt(d_in)`` for ``s_out``, the first batch only)."""
    tc = Transcoder(TranscoderConfig(d_in=D_IN, d_sae=8, d_out=D_OUT, activation="relu"))
    trainer = Trainer(tc, _batch, TrainConfig(total_steps=1, norm_batches=NORM_BATCHES))
    s_in, s_out = trainer.estimate_norms()
    batches = [_batch(i) for i in range(NORM_BATCHES)]
    x = torch.cat([b.x[b.loss_mask] for b in batches]).double()
    y = torch.cat([b.y[b.loss_mask] for b in batches]).double()
    assert s_in == pytest.approx(math.sqrt(D_IN) / float(x.norm(dim=-1).mean()), rel=1e-6)
    assert s_out == pytest.approx(math.sqrt(D_OUT) / float(y.norm(dim=-1).mean()), rel=1e-6)


def test_reset_latents_zeroes_the_moved_rows_of_every_latent_moment_and_restarts_their_counters():
    """``reset_latents``: for the moved latents, their rows of every Adam moment whose first axis is the latent
    axis — a 2-d ``W_V`` and a 1-d ``b_V`` alike — are zeroed, the other rows and the scalar ``step`` kept, and
    their dead counters restart at 0 (its docstring) (mutants: 1-d moments left; the counters set to a full dead
    window)."""
    n = 5
    g = torch.Generator().manual_seed(0)
    params = (torch.nn.Parameter(torch.randn(n, 3, generator=g)), torch.nn.Parameter(torch.randn(n, generator=g)),
              torch.nn.Parameter(torch.randn(3, 4, generator=g)))  # the last: no latent axis
    state = {p: {"step": torch.tensor(7.0), "exp_avg": torch.randn(p.shape, generator=g) + 5,
                 "exp_avg_sq": torch.rand(p.shape, generator=g) + 1} for p in params}
    before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in state.items()}
    counters = torch.full((n,), 1000, dtype=torch.long)
    fake = SimpleNamespace(tokens_since_fired=counters, optimizer=SimpleNamespace(state=state),
                           masters=SimpleNamespace(held=lambda p: p), config=SimpleNamespace(dead_after_tokens=1000))
    moved = torch.tensor([1, 3])
    TrainingState(fake).reset_latents(params, moved)
    kept = torch.tensor([0, 2, 4])
    for p in params[:2]:
        for key in ("exp_avg", "exp_avg_sq"):
            assert (state[p][key][moved] == 0).all(), key
            assert torch.equal(state[p][key][kept], before[id(p)][key][kept]), key
        assert state[p]["step"].item() == 7.0
    for key, value in state[params[2]].items():
        assert torch.equal(value, before[id(params[2])][key]), key
    assert counters.tolist() == [1000, 0, 1000, 0, 1000]


def test_train_config_defaults_are_the_documented_ones():
    """The defaults docs/training.md states: lr 2e-3 ("`TrainConfig`'s default lr (2e-3)"), the decay to 0 (theirs
    1/32), a bf16 module trained through fp32 master weights; AuxK weight 1/32 (Gao et al. 2024's α, the Lorsa
    authors' ``auxk_coefficient``) (mutants: lr 2e-4, ``aux_k_coef`` 1/16, ``master_weights`` False)."""
    cfg = TrainConfig(total_steps=1)
    assert cfg.lr == 2e-3 and cfg.decay_to == 0.0
    assert cfg.master_weights is True
    assert cfg.aux_k_coef == 1 / 32


@pytest.mark.parametrize("betas", [(1.0, 0.999), (0.9, 1.0)])
def test_a_beta_of_one_is_refused(betas):
    """``betas`` two numbers in ``[0, 1)`` (docs/training.md): β = 1 is Adam without forgetting, refused naming
    the field (mutant: the interval closed at 1)."""
    with pytest.raises(ArgumentError, match=r"TrainConfig\.betas\[[01]\]"):
        TrainConfig(total_steps=1, betas=betas)
