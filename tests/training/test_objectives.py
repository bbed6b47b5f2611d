"""Objectives own their state (issue 22): the Lorsa-only settings live in ``LorsaObjective``, the scale
factors on the objective, which sees the trainer through a narrow ``TrainingState``; ``evaluate`` takes a
bundle holding one set."""

from __future__ import annotations

import pytest
import torch
from helpers import make_sae, tiny_training_setup

from nnsight_lorsa import ReplacementModel, TranscoderSet
from nnsight_lorsa.envoy.read import Site
from nnsight_lorsa.errors import ArgumentError
from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig
from nnsight_lorsa.training import (
    ActivationSource,
    LorsaObjective,
    LorsaRecipe,
    TokenDataset,
    TrainConfig,
    Trainer,
    evaluate,
)
from nnsight_lorsa.training.objectives import TrainingState

LAYER = 1


@pytest.fixture(scope="module")
def setup():
    return tiny_training_setup()


def test_a_lorsa_objective_refuses_another_module_by_name():
    # ours: "LorsaObjective trains a Lorsa, got a SparseAutoencoder" (under the suite's type-check hook its own)
    with pytest.raises(TypeError, match="Lorsa"):
        LorsaObjective(make_sae(), recipe=LorsaRecipe())


def test_the_scale_factors_are_the_objective_s_and_it_sees_a_training_state(setup):
    model, _, adapter, data = setup
    source = ActivationSource.sae(model, Site.resid_post(adapter, LAYER), data, batch_size=8)
    trainer = Trainer(make_sae(), source, TrainConfig(total_steps=2, norm_batches=1))
    assert isinstance(trainer.state, TrainingState) and trainer.s_in is None
    s_in, s_out = trainer.estimate_norms()
    assert (trainer.objective.s_in, trainer.objective.s_out) == (s_in, s_out) == (trainer.s_in, trainer.s_out)
    assert s_out == s_in  # an SAE: one scale factor
    trainer.s_in = 2.0
    assert trainer.objective.s_in == 2.0
    assert trainer.state.step == 0 and trainer.state.config is trainer.config


def test_evaluate_takes_a_bundle_holding_one_set(setup):
    model, _, adapter, data = setup
    torch.manual_seed(0)
    tc = Transcoder(TranscoderConfig(d_in=adapter.d_model, d_sae=64, activation="topk", activation_params={"k": 8},
                                     layer=LAYER)).eval()
    held = TokenDataset(data.tokens[:4])
    by_set = evaluate(TranscoderSet(model, {LAYER: tc}), held, batch_size=4)
    by_bundle = evaluate(ReplacementModel(model, transcoders={LAYER: tc}), held, batch_size=4)
    assert by_bundle.to_dict() == by_set.to_dict()
    two = ReplacementModel(model, transcoders={LAYER: tc}, saes={"model.layers.0": make_sae()})
    with pytest.raises(ArgumentError, match="holds 2 sets"):
        evaluate(two, held)
