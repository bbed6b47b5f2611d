"""Mutation probe, round 11 (docs/reliability.md): sparse-attention post-training's data windows, periodic
checkpoints, a step-0 checkpoint and the gates' mode. Each test was seen failing with a one-line mutant of
``sparse_attention/train.py`` that the default tests let through; the references are the documented rules, replayed
in plain torch."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_hf_model

from nnsight_lorsa.sparse_attention import SparseTrainConfig
from nnsight_lorsa.sparse_attention.train import SparseAttentionTrainer
from nnsight_lorsa.training import TokenDataset

SEQ = 8
BOS = 1  # the tiny Llama's config.bos_token_id (EOS is 2: streams draw from 3 … 127)


def _stream(n: int = 200, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed))  # no EOS (2): one text


def _cfg(**kw) -> SparseTrainConfig:
    return SparseTrainConfig(**{"total_steps": 4, "batch_size": 2, "seq_len": SEQ, "init_bias": 2.0,
                                "target_batches": 2, "target_ce": 100.0, "allow_slack_constraint": True, **kw})


@pytest.mark.filterwarnings("ignore:the constraint")
def test_the_first_training_windows_come_from_a_generator_seeded_seed_after_tau_drew_from_seed_plus_one():
    """The data generator is seeded ``config.seed``; τ's windows come "from a generator of its own (seed
    ``config.seed + 1``, so the training batches are unaffected)", and ``augment`` draws "only from the given
    generator". Replayed with an augment that draws (a random shift of the ids) and records what it returns: the
    τ batches from ``Generator(seed + 1)``, then step 0's batch from ``Generator(seed)``."""
    seen: list[torch.Tensor] = []

    def augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        shift = int(torch.randint(0, 5, (1,), generator=gen))
        out = torch.where(x == BOS, x, (x - 3 + shift) % 125 + 3)
        seen.append(out.clone())
        return out

    cfg = _cfg(seed=3, target_batches=2, batch_size=3)
    stream = _stream()
    tr = SparseAttentionTrainer(tiny_hf_model("llama"), stream, cfg, augment=augment)
    tr.train_step()
    ref: list[torch.Tensor] = []
    for seed, n in ((cfg.seed + 1, cfg.target_batches), (cfg.seed, 1)):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(n):
            x = TokenDataset.sample_stream(stream, cfg.batch_size, SEQ, gen, BOS)
            shift = int(torch.randint(0, 5, (1,), generator=gen))
            ref.append(torch.where(x == BOS, x, (x - 3 + shift) % 125 + 3))
    assert len(seen) == len(ref) == cfg.target_batches + 1
    for got, want in zip(seen, ref, strict=True):
        assert torch.equal(got, want)


@pytest.mark.filterwarnings("ignore:the constraint")
def test_checkpoints_are_written_every_checkpoint_every_steps_and_at_the_end(tmp_path, monkeypatch):
    """``train(checkpoint_dir=..., checkpoint_every=k)``: "a checkpoint is written every ``checkpoint_every`` steps
    and at the end" — at step 2 of 3, then 3; ``steps`` is a count of *more* steps ("Run up to ``steps`` more
    steps"): a second ``train(1)`` goes on from step 3 to 4."""
    tr = SparseAttentionTrainer(tiny_hf_model("llama"), _stream(), _cfg(total_steps=10))
    saved: list[int] = []
    real = tr.save_checkpoint

    def spy(directory):
        saved.append(tr.step)
        return real(directory)

    monkeypatch.setattr(tr, "save_checkpoint", spy)
    tr.train(3, progress=False, checkpoint_dir=tmp_path / "ck", checkpoint_every=2)
    assert saved == [2, 3]
    tr.train(1, progress=False)
    assert tr.step == 4 and [r.step for r in tr.history] == [1, 2, 3, 4]


@pytest.mark.filterwarnings("ignore:the constraint")
def test_a_checkpoint_saved_before_the_first_step_loads(tmp_path):
    """A checkpoint holds "the step" (an int >= 0): one saved before any step (step 0) loads into a fresh trainer of
    the same config, which then takes the same first step as the saver."""
    stream = _stream()
    tr = SparseAttentionTrainer(tiny_hf_model("llama"), stream, _cfg())
    tr.save_checkpoint(tmp_path / "ck")
    first = tr.train_step()
    fresh = SparseAttentionTrainer(tiny_hf_model("llama"), stream, _cfg())
    fresh.load_checkpoint(tmp_path / "ck")  # the global and data random states as saved, before tr's step
    assert fresh.step == 0 and fresh.history == []
    assert fresh.train_step() == first


@pytest.mark.filterwarnings("ignore:the constraint")
@pytest.mark.parametrize("mode", ["dense", "topk"])
def test_gates_installed_in_another_mode_train_gated(mode):
    """The trainer trains the gates "in training mode (hard straight-through gate samples)": a model whose gates were
    left in ``dense`` or ``topk`` mode (an evaluation before) has every gate in ``gated`` mode once the trainer is
    built (a dense gate would train nothing into the gates: every edge open)."""
    from nnsight_lorsa.sparse_attention import install_gated_attention, set_gate_mode
    from nnsight_lorsa.sparse_attention.install import get_gates

    hf = tiny_hf_model("llama")
    install_gated_attention(hf, init_bias=0.0)
    set_gate_mode(hf, mode, top_k=2 if mode == "topk" else None)
    tr = SparseAttentionTrainer(hf, _stream(), _cfg())
    assert {g.mode for g in get_gates(tr.hf).values()} == {"gated"}
