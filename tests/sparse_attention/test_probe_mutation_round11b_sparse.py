"""Mutation probe, round 11b (docs/reliability.md): a ``max_initial_slack`` of 0 and a ``checkpoint.json`` without
``param_names``. Each test was seen failing with a one-line mutant of ``sparse_attention/train.py`` that the default
tests let through; the references are the documented rules (``SparseTrainConfig.validate``'s "≥ 0",
``load_checkpoint``'s "Raises: CheckpointError: ... the manifest missing or corrupt")."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_hf_model

from nnsight_lorsa.errors import ArgumentError, CheckpointError
from nnsight_lorsa.sparse_attention import SparseTrainConfig
from nnsight_lorsa.sparse_attention.train import SparseAttentionTrainer


def test_a_max_initial_slack_of_zero_is_accepted_and_a_negative_one_refused():
    """The docstring: "``weight_decay``, ``target_margin``, ``max_initial_slack`` ≥ 0" — 0 (any slack is vacuous)
    is a value a config takes; below 0 it is an ``ArgumentError`` naming the field."""
    assert SparseTrainConfig(max_initial_slack=0.0).max_initial_slack == 0.0
    with pytest.raises(ArgumentError, match="max_initial_slack"):
        SparseTrainConfig(max_initial_slack=-0.01)


def _remanifest(d: Path) -> None:
    """Rewrite ``d``'s manifest for its current files (an edit made on purpose, so that only the edit is wrong)."""
    files = {}
    for p in sorted(d.iterdir()):
        if p.name != "manifest.json":
            b = p.read_bytes()
            files[p.name] = {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()}
    (d / "manifest.json").write_text(json.dumps({"format": 1, "files": files}))


def test_a_checkpoint_json_without_param_names_is_a_checkpoint_error_naming_the_file(tmp_path):
    """A ``checkpoint.json`` that lacks a key is a corrupt checkpoint: ``CheckpointError`` naming the file (as a
    raw ``KeyError`` it would escape ``except CheckpointError`` around a resume), and the trainer is as it was."""
    torch.manual_seed(0)
    stream = torch.randint(3, 128, (200,), generator=torch.Generator().manual_seed(0))  # no EOS (2): one text
    cfg = SparseTrainConfig(total_steps=2, batch_size=2, seq_len=8, target_batches=1, target_ce=100.0,
                            allow_slack_constraint=True)
    with pytest.warns(UserWarning):
        trainer = SparseAttentionTrainer(tiny_hf_model("llama"), stream, cfg)
    trainer.train(steps=1, progress=False)
    d = tmp_path / "ckpt"
    trainer.save_checkpoint(d)
    meta = json.loads((d / "checkpoint.json").read_text())
    del meta["param_names"]
    (d / "checkpoint.json").write_text(json.dumps(meta))
    _remanifest(d)
    weights = {k: v.clone() for k, v in trainer.hf.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"checkpoint\.json: malformed .*param_names"):
        trainer.load_checkpoint(d)
    assert trainer.step == 1
    assert all(torch.equal(v, weights[k]) for k, v in trainer.hf.state_dict().items())
