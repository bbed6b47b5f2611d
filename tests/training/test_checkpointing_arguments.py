"""``train(checkpoint_dir=, checkpoint_every=)`` of both trainers, checked before the first step (2026-11-29, fourth
session): ``checkpoint_every`` without a directory saved nothing, silently; a ``checkpoint_dir`` of the wrong kind
failed at the first save, after the steps before it had run; the ``Trainer`` with a ``checkpoint_dir`` and no
``checkpoint_every`` wrote nothing, where the sparse-attention trainer saved at the end — both save at the end now.
The sparse trainer's ``train(steps=-1)`` ran no step and saved."""

from __future__ import annotations

import pytest
import torch
from helpers import make_sae, reconstruction_source, tiny_hf_model

from nnsight_lorsa import TrainConfig, Trainer
from nnsight_lorsa.errors import ArgumentError
from nnsight_lorsa.sparse_attention import SparseTrainConfig
from nnsight_lorsa.sparse_attention.train import SparseAttentionTrainer


def _trainer() -> Trainer:
    sae = make_sae(d_in=64, d_sae=128, activation="topk", activation_params={"k": 4})
    return Trainer(sae, reconstruction_source(4, 6, 64), TrainConfig(total_steps=3, norm_batches=1))


def _sparse() -> SparseAttentionTrainer:
    hf = tiny_hf_model("llama")
    hf.config.bos_token_id = 0
    stream = torch.randint(3, 128, (200,), generator=torch.Generator().manual_seed(0))
    cfg = SparseTrainConfig(total_steps=2, batch_size=2, seq_len=8, target_batches=1, target_ce=100.0,
                            allow_slack_constraint=True)
    return SparseAttentionTrainer(hf, stream, cfg)


def test_a_checkpoint_dir_alone_saves_at_the_end_of_the_call(tmp_path):
    trainer = _trainer()
    trainer.train(2, progress=False, checkpoint_dir=tmp_path / "ck")
    assert Trainer.load_checkpoint(tmp_path / "ck")[0]["step"] == 2
    resumed = Trainer.resume(tmp_path / "ck", reconstruction_source(4, 6, 64))
    assert resumed.step == 2
    assert all(torch.equal(a, b) for a, b in zip(resumed.module.state_dict().values(),
                                                 trainer.module.state_dict().values(), strict=True))


@pytest.mark.parametrize("make", [_trainer, _sparse], ids=["Trainer", "SparseAttentionTrainer"])
def test_checkpoint_every_without_a_directory_is_refused_before_the_first_step(make, tmp_path):
    trainer = make()
    with pytest.raises(ArgumentError, match="checkpoint_every=2 without checkpoint_dir saves nothing"):
        trainer.train(progress=False, checkpoint_every=2)
    with pytest.raises(ArgumentError, match="checkpoint_every must be a non-negative int, got -1"):
        trainer.train(progress=False, checkpoint_dir=tmp_path / "ck", checkpoint_every=-1)
    assert trainer.step == 0 and not (tmp_path / "ck").exists()


def test_the_sparse_trainer_refuses_a_negative_step_count():
    trainer = _sparse()
    with pytest.raises(ArgumentError, match=r"SparseAttentionTrainer.train.steps must be an int >= 0, got -1"):
        trainer.train(-1, progress=False)
    assert trainer.step == 0
