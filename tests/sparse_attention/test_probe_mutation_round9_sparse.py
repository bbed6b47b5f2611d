"""Mutation probe, round 9 (docs/reliability.md): sparse-attention post-training's τ windows and checkpoint config
check. Each test was seen failing with a one-line mutant of ``sparse_attention/train.py`` that the default tests let
through; the references are the documented rules, replayed in plain torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_hf_model

from nnsight_lorsa.errors import CheckpointError
from nnsight_lorsa.sparse_attention import SparseTrainConfig
from nnsight_lorsa.sparse_attention.train import SparseAttentionTrainer
from nnsight_lorsa.training import TokenDataset

SEQ = 12


def _stream() -> torch.Tensor:
    return torch.randint(3, 128, (300,), generator=torch.Generator().manual_seed(0))  # no EOS (2): one text


def _cfg(**kw) -> SparseTrainConfig:
    return SparseTrainConfig(**{"total_steps": 4, "batch_size": 3, "seq_len": SEQ, "init_bias": 2.0,
                                "target_batches": 2, "target_ce": 100.0, "allow_slack_constraint": True, **kw})


@pytest.mark.filterwarnings("ignore:the constraint")
def test_base_ce_of_a_stream_is_measured_on_windows_of_a_generator_seeded_seed_plus_one():
    """``measure_train_ce``: stream windows "from a generator of its own (seed ``config.seed + 1``)" — replayed:
    the model in eval mode on ``target_batches`` batches of ``sample_stream`` windows drawn from that generator, the
    summed next-token CE (plain ``F.cross_entropy``) over the count."""
    cfg = _cfg(seed=5)
    tr = SparseAttentionTrainer(tiny_hf_model("llama"), _stream(), cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    tr.hf.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for _ in range(cfg.target_batches):
            x = TokenDataset.sample_stream(_stream(), cfg.batch_size, SEQ, gen, tr.bos_id)
            logits = tr.hf(input_ids=x).logits.double()
            total += float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                           reduction="sum"))
            count += x[:, 1:].numel()
    assert tr.base_ce == pytest.approx(total / count, rel=1e-5)


@pytest.mark.filterwarnings("ignore:the constraint")
@pytest.mark.parametrize("field", ["seed", "init_bias", "gate_lr"])
def test_a_checkpoint_resumes_only_under_its_own_settings(tmp_path, field):
    """``load_checkpoint``: a checkpoint saved under another ``SparseTrainConfig`` is refused naming the setting
    ("only ``total_steps`` may differ"; ``seed`` picks the data windows and the gates' noise of every later step)."""
    tr = SparseAttentionTrainer(tiny_hf_model("llama"), _stream(), _cfg())
    tr.train(1, progress=False)
    tr.save_checkpoint(tmp_path / "ck")
    other = {"seed": 1, "init_bias": 3.0, "gate_lr": 0.01}[field]
    fresh = SparseAttentionTrainer(tiny_hf_model("llama"), _stream(), _cfg(**{field: other}))
    with pytest.raises(CheckpointError, match=f"{field}="):
        fresh.load_checkpoint(tmp_path / "ck")
    same = SparseAttentionTrainer(tiny_hf_model("llama"), _stream(), _cfg(total_steps=9))
    same.load_checkpoint(tmp_path / "ck")
    assert same.step == 1
