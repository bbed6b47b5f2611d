"""What a researcher's first day met (a usability probe, 2026-11-30), each silent until then:

* the module given to ``Trainer`` is trained in place in the normalised space (``x · s_in -> y · s_out``): spliced,
  evaluated or saved as it is, it computed the wrong outputs (a transcoder's FVU 0.887 / CE 4.362 where its folded
  copy's were 0.491 / 4.008) — the sets and ``save`` now refuse it by name and point to ``trainer.folded()``;
* ``TokenDataset.split(8 / n)`` held out 7 windows (``n · 8 / n`` is 7.999… in floats): the demo's
  ``--heldout-windows 8`` held out 7 and said it was the 20 % cap;
* ``trainer.train(3)`` at the end of the run did nothing, without a word: now an ``ArgumentError``."""

from __future__ import annotations

import pytest
import torch
from helpers import random_ids, tiny_training_setup

from nnsight_lorsa import TranscoderSet, save
from nnsight_lorsa.errors import ArgumentError
from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig
from nnsight_lorsa.training import ActivationSource, TokenDataset, TrainConfig, Trainer, evaluate

LAYER = 1


def trained(steps=3):
    model, hf, adapter, data = tiny_training_setup()
    tc = Transcoder(TranscoderConfig(d_in=adapter.d_model, d_sae=64, activation="topk", activation_params={"k": 4},
                                     layer=LAYER))
    source = ActivationSource.transcoder(model, LAYER, data, batch_size=8)
    trainer = Trainer(tc, source, TrainConfig(total_steps=steps, lr=1e-2))
    trainer.train(progress=False)
    return model, data, tc, trainer


def test_the_working_module_is_refused_where_it_would_compute_wrong_outputs(tmp_path):
    model, data, tc, trainer = trained()
    assert trainer.module is tc and (trainer.s_in, trainer.s_out) != (1.0, 1.0)
    with pytest.raises(ArgumentError, match=r"trainer\.folded\(\)"):
        TranscoderSet(model, {LAYER: tc})
    with pytest.raises(ArgumentError, match=r"trainer\.folded\(\)"):
        save(tc, tmp_path / "tc")
    folded = trainer.folded()
    ev = evaluate(TranscoderSet(model, {LAYER: folded}), data, max_batches=1)  # the copy on raw activations: fine
    assert ev.fvu == ev.fvu  # finite, computed
    save(folded, tmp_path / "folded")
    with pytest.raises(ArgumentError, match="working module"):  # more training keeps it marked
        trainer.config.total_steps += 1
        trainer.train(progress=False)
        TranscoderSet(model, {LAYER: tc})


def test_a_resumed_trainer_marks_its_module_too(tmp_path):
    model, data, tc, trainer = trained()
    trainer.save_checkpoint(tmp_path / "ckpt")
    source = ActivationSource.transcoder(model, LAYER, data, batch_size=8)
    again = Trainer.resume(tmp_path / "ckpt", source)
    with pytest.raises(ArgumentError, match="working module"):
        TranscoderSet(model, {LAYER: again.module})


def test_training_past_the_end_is_refused():
    _, _, _, trainer = trained(steps=2)
    history = list(trainer.history)
    with pytest.raises(ArgumentError, match="at its end"):
        trainer.train(3, progress=False)
    assert trainer.history == history and trainer.step == 2
    trainer.train(progress=False)  # to total_steps: already there, nothing to do (a resumable no-op)
    trainer.config.total_steps = 3  # raised: one more step runs
    trainer.train(5, progress=False)
    assert trainer.step == 3


@pytest.mark.parametrize("n", [14849, 100, 7, 3])
def test_a_split_holds_out_the_count_its_fraction_names(n):
    data = TokenDataset(random_ids(batch=n, seq=4, seed=0)) if n < 1000 else TokenDataset(
        torch.zeros(n, 4, dtype=torch.long))
    for k in {1, 2, n // 3, 8 % n or 1}:
        k = max(1, min(n - 1, k))
        train, held = data.split(k / n)
        assert len(held) == k and len(train) == n - k

