"""The Trainer's working module and the run's edges, an independent review's cases (each kills a mutation the day-one
probe lets live): ``save`` of a dict of modules (circuit-tracer's ``{layer: transcoder}``) holding the working
module is refused; the mark travels with a deep copy, a pickle and ``.to()`` (all still in the normalised space) and
not with ``folded()``; ``train(0)`` at the end of the run is a no-op, not a refusal; ``split`` holds out the floor of
a count that is not whole."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from helpers import random_ids, tiny_training_setup

from nnsight_lorsa import TranscoderSet, save
from nnsight_lorsa.errors import ArgumentError, UnsupportedArchitectureError
from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig
from nnsight_lorsa.training import ActivationSource, TokenDataset, TrainConfig, Trainer

LAYER = 1


@pytest.fixture(scope="module")
def run():
    model, hf, adapter, data = tiny_training_setup()
    tc = Transcoder(TranscoderConfig(d_in=adapter.d_model, d_sae=64, activation="topk", activation_params={"k": 4},
                                     layer=LAYER))
    trainer = Trainer(tc, ActivationSource.transcoder(model, LAYER, data, batch_size=8),
                      TrainConfig(total_steps=2, lr=1e-2))
    trainer.train(progress=False)
    return model, tc, trainer


def test_a_dict_of_modules_holding_the_working_module_is_not_saved(run, tmp_path):
    model, tc, trainer = run
    first = Transcoder(TranscoderConfig(d_in=tc.cfg.d_in, d_sae=64, activation="topk", activation_params={"k": 4},
                                        layer=0))
    with pytest.raises(ArgumentError, match=r"trainer\.folded\(\)"):
        save({0: first, LAYER: tc}, tmp_path / "ct", format="circuit_tracer")
    assert not (tmp_path / "ct").exists() or not any((tmp_path / "ct").iterdir())
    # the folded copy passes the check (and meets the format's own: circuit-tracer's files have no TopK)
    with pytest.raises(UnsupportedArchitectureError, match="topk"):
        save({0: first, LAYER: trainer.folded()}, tmp_path / "ct_folded", format="circuit_tracer")


def test_copies_of_the_working_module_carry_the_mark_the_folded_one_does_not(run):
    model, tc, trainer = run
    for other in (copy.deepcopy(tc), pickle.loads(pickle.dumps(tc)), tc.to(torch.float32)):
        with pytest.raises(ArgumentError, match="working module"):
            TranscoderSet(model, {LAYER: other})
    folded = trainer.folded()
    TranscoderSet(model, {LAYER: folded})
    TranscoderSet(model, {LAYER: copy.deepcopy(folded)})
    with pytest.raises(ArgumentError, match="working module"):  # folding leaves the working module marked
        TranscoderSet(model, {LAYER: tc})


def test_train_zero_steps_at_the_end_is_a_no_op(run):
    _, _, trainer = run
    step, history = trainer.step, list(trainer.history)
    assert step == trainer.config.total_steps
    trainer.train(0, progress=False)
    assert trainer.step == step and trainer.history == history


@pytest.mark.parametrize(("n", "fraction", "held"), [(25, 0.1, 2), (3, 0.5, 1), (10, 0.15, 1), (10, 0.99, 9),
                                                      (7, 0.999999, 6), (1000, 0.0015, 1), (1000, 0.0025, 2)])
def test_split_holds_out_the_floor_of_a_count_that_is_not_whole(n, fraction, held):
    train, out = TokenDataset(random_ids(batch=n, seq=4, seed=0)).split(fraction)
    assert (len(train), len(out)) == (n - held, held)
