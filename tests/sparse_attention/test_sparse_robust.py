"""Sparse-attention training without silent wrong results: atomic, verified checkpoints (the trainer's
own machinery), τ and the constraint on the same document windows as the training (padding out), and a
named error when the constraint is vacuous at step 0."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_hf_model, tiny_tokenizer

from nnsight_lorsa.errors import ArgumentError, CheckpointError, GateConfigError, VacuousConstraintError
from nnsight_lorsa.sparse_attention import (
    SparseTrainConfig,
    evaluate_sparse,
    install_gated_attention,
    train_sparse_attention,
)
from nnsight_lorsa.sparse_attention.train import SparseAttentionTrainer
from nnsight_lorsa.training import TokenDataset

SEQ = 16


def _model():
    hf = tiny_hf_model("llama")
    hf.config.bos_token_id = 0  # the tiny tokenizer's <bos>
    return hf


def _documents(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 2 * SEQ, (n,), generator=g).tolist()
    return [" ".join(f"w{int(t)}" for t in torch.randint(2, 128, (k,), generator=g)) for k in lengths]


@pytest.fixture(scope="module")
def docs():
    data = TokenDataset.from_documents(tiny_tokenizer(), _documents(), SEQ, bos_token_id=0)
    assert data.target_mask is not None and not data.target_mask.all()  # some windows are padded
    return data


def _cfg(**kw):
    return SparseTrainConfig(**{"total_steps": 4, "batch_size": 4, "seq_len": SEQ, "init_bias": 2.0,
                                "target_batches": 2, **kw})


# --------------------------------------------------------------------------- checkpoints
def _trained(docs, steps=2):
    tr = SparseAttentionTrainer(_model(), docs, _cfg())
    tr.train(steps, progress=False)
    return tr


def test_resume_from_a_document_dataset_is_bit_exact(docs, tmp_path):
    straight = _trained(docs, 4)
    first = _trained(docs, 2)
    first.save_checkpoint(tmp_path / "ck")
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"checkpoint.safetensors", "checkpoint.json"}
    resumed = SparseAttentionTrainer(_model(), docs, _cfg())
    resumed.load_checkpoint(tmp_path / "ck")
    resumed.train(2, progress=False)
    _assert_same_run(straight, resumed)
    assert straight.geco.lam == resumed.geco.lam


def test_truncated_mixed_or_unverified_checkpoints_raise_naming_the_file(docs, tmp_path):
    tr = _trained(docs, 1)
    a, b = tmp_path / "a", tmp_path / "b"
    tr.save_checkpoint(a)
    tr.train(1, progress=False)
    tr.save_checkpoint(b)
    fresh = SparseAttentionTrainer(_model(), docs, _cfg())
    # truncated tensors file
    t = b / "checkpoint.safetensors"
    t.write_bytes(t.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="checkpoint.safetensors.*truncated"):
        fresh.load_checkpoint(b)
    # mixed: one file from another save
    (b / "checkpoint.safetensors").write_bytes((a / "checkpoint.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="checkpoint.safetensors"):
        fresh.load_checkpoint(b)
    # written before manifests existed, or not a checkpoint at all
    (a / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest"):
        fresh.load_checkpoint(a)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        fresh.load_checkpoint(tmp_path / "missing")
    other = tmp_path / "notes"
    other.mkdir()
    (other / "readme.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        tr.save_checkpoint(other)
    assert (other / "readme.txt").read_text() == "mine"
    with pytest.raises(CheckpointError, match="manifest"):  # a resume never silently skips what is there
        train_sparse_attention(_model(), docs, _cfg(), progress=False, checkpoint_dir=other)


def test_a_save_interrupted_between_its_renames_resumes_from_the_previous(docs, tmp_path):
    tr = _trained(docs, 2)
    tr.save_checkpoint(tmp_path / "ck")
    (tmp_path / "ck").rename(tmp_path / "ck.old")  # the state right after `ck -> ck.old`
    resumed = SparseAttentionTrainer(_model(), docs, _cfg())
    resumed.load_checkpoint(tmp_path / "ck")
    assert resumed.step == 2 and [r.ce for r in resumed.history] == [r.ce for r in tr.history]


# --------------------------------------------------------------------------- τ on the training windows
def _reference_ce(hf, data, window_ids):
    """CE of each window's real tokens only (no padding at all), one window at a time, token-weighted."""
    hf.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for w in window_ids:
            n = int(data.target_mask[w].sum())
            x = data.tokens[w, :n][None]
            logits = hf(input_ids=x).logits[0, :-1]
            total += float(F.cross_entropy(logits, x[0, 1:], reduction="sum"))
            count += n - 1
    return total / count


def test_tau_is_the_base_ce_on_the_training_windows_without_padding(docs):
    from nnsight_lorsa.training.dataset import _window_ids

    tr = SparseAttentionTrainer(_model(), docs, _cfg(target_batches=2))
    ids = torch.cat([_window_ids(len(docs), i, 4, 0) for i in range(2)]).tolist()
    ref = _reference_ce(tr.hf, docs, ids)
    assert tr.base_ce == pytest.approx(ref, rel=1e-5) and tr.geco.target == tr.base_ce
    # counting the padding predictions would give another τ (the check above can fail)
    unmasked = SparseAttentionTrainer(_model(), TokenDataset(docs.tokens), _cfg(target_batches=2))
    assert abs(unmasked.base_ce - ref) > 1e-4 * ref  # 10x the bound above
    # the first step's CE (training mode, sampled gates) also counts only real tokens: at a large
    # init_bias every gate is open and it equals the base CE of batch 0
    open_gates = SparseAttentionTrainer(_model(), docs, _cfg(init_bias=40.0, target_batches=1))
    rec = open_gates.train_step()
    assert rec.ce == pytest.approx(_reference_ce(_model(), docs, _window_ids(len(docs), 0, 4, 0).tolist()), rel=1e-5)


def test_evaluate_sparse_counts_the_datasets_target_mask(docs):
    hf = _model()
    ref = _reference_ce(hf, docs, range(len(docs)))
    install_gated_attention(hf, init_bias=40.0)  # every edge open: the dense model
    got = evaluate_sparse(hf, docs, batch_size=5)
    assert got["ce"] == pytest.approx(ref, rel=1e-5)
    assert got["tokens"] == int(docs.target_mask[:, 1:].sum()) and got["windows"] == len(docs)


def test_vacuous_constraint_raises_by_default_and_warns_when_allowed(docs):
    base = SparseAttentionTrainer(_model(), docs, _cfg()).base_ce
    with pytest.raises(VacuousConstraintError, match="slack") as info:
        SparseAttentionTrainer(_model(), docs, _cfg(target_ce=2.0 * base))
    assert isinstance(info.value, GateConfigError) and f"{base:.4f}" in str(info.value)
    with pytest.warns(UserWarning, match="slack"):
        tr = SparseAttentionTrainer(_model(), docs, _cfg(target_ce=2.0 * base, allow_slack_constraint=True))
    assert tr.geco.target == 2.0 * base
    # within the bound (max_initial_slack = 10% of the base CE): no error, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SparseAttentionTrainer(_model(), docs, _cfg(target_ce=1.05 * base))
        SparseAttentionTrainer(_model(), docs, _cfg(target_ce=1.2 * base, target_margin=0.15 * base))
    with pytest.raises(VacuousConstraintError):
        SparseAttentionTrainer(_model(), docs, _cfg(target_ce=1.2 * base, max_initial_slack=0.1))
    for bad in (-0.1, float("nan")):  # refused with the config, before the model runs
        with pytest.raises(ArgumentError, match="SparseTrainConfig.max_initial_slack"):
            _cfg(max_initial_slack=bad)


def test_windows_must_fit_the_config_and_start_with_the_models_bos(docs):
    with pytest.raises(GateConfigError, match="seq_len"):
        SparseAttentionTrainer(_model(), docs, _cfg(seq_len=SEQ + 1))
    other_bos = TokenDataset.from_documents(tiny_tokenizer(), _documents(), SEQ, bos_token_id=5)
    with pytest.raises(GateConfigError, match="BOS id 0"):
        SparseAttentionTrainer(_model(), other_bos, _cfg())


# --------------------------------------------------------------------------- reduced precision
def _fp16_model():
    return _model().to(torch.float16)


def test_full_fine_tuning_an_fp16_model_keeps_fp32_master_weights(docs, tmp_path):
    """AdamW on fp16 parameters: ``(1 − β2)·g²`` underflows to 0 in fp16 and so does ``eps`` (1e-8), so the first
    step divided 0 by 0 and every weight became NaN while the step returned normally (the NaN loss was only
    seen a step later, and a 1-step run handed back a NaN model). The trainer keeps fp32 master copies of
    fp16 parameters (mixed precision): the model stays fp16 and finite, follows the fp32 run's CE, and a
    checkpoint resumes it bit for bit (the masters are saved, not their fp16 rounding)."""
    fp32 = SparseAttentionTrainer(_model(), docs, _cfg())
    fp32.train(3, progress=False)
    tr = SparseAttentionTrainer(_fp16_model(), docs, _cfg())
    tr.train(3, progress=False)
    assert {p.dtype for n, p in tr.hf.named_parameters() if "gate" not in n.split(".")[-2:][0]} == {torch.float16}
    assert all(bool(torch.isfinite(p).all()) for p in tr.hf.parameters())
    before = dict(_fp16_model().named_parameters())
    moved = [n for n, p in tr.hf.named_parameters() if n in before and not torch.equal(p, before[n])]
    assert len(moved) == len(before)  # every weight trains (not a frozen model)
    for a, b in zip(tr.history, fp32.history, strict=True):
        assert abs(a.ce - b.ce) < 0.05 * b.ce, (a, b)
    tr.save_checkpoint(tmp_path / "ck")
    straight = SparseAttentionTrainer(_fp16_model(), docs, _cfg())
    straight.train(4, progress=False)
    resumed = SparseAttentionTrainer(_fp16_model(), docs, _cfg())
    resumed.train(2, progress=False)
    resumed.save_checkpoint(tmp_path / "ck2")
    again = SparseAttentionTrainer(_fp16_model(), docs, _cfg())
    again.load_checkpoint(tmp_path / "ck2")
    again.train(2, progress=False)
    _assert_same_run(straight, again)


def test_full_fine_tuning_a_bf16_model_trains_through_fp32_masters_too(docs, tmp_path):
    """A bf16 model trains through the same fp32 master weights (``training.master_weights``, the module
    ``Trainer``'s mechanism): every trainable bf16 parameter has an fp32 master, the model's weight is its rounding
    after each step, the masters follow the fp32 run's CE, and the checkpoint saves the masters (fp32), not the
    bf16 weights."""
    from safetensors.torch import load_file

    fp32 = SparseAttentionTrainer(_model(), docs, _cfg())
    fp32.train(2, progress=False)
    tr = SparseAttentionTrainer(_model().to(torch.bfloat16), docs, _cfg())
    params = dict(tr.hf.named_parameters())
    low = [n for n in tr.param_names if params[n].dtype == torch.bfloat16]
    assert low and all(tr.masters.has(params[n]) for n in low)
    for _ in range(2):
        tr.train_step()
        for n in low:
            m = tr.masters.held(params[n])
            assert m.dtype == torch.float32 and torch.equal(params[n], m.to(torch.bfloat16)), n
    for a, b in zip(tr.history, fp32.history, strict=True):
        assert abs(a.ce - b.ce) < 0.05 * b.ce, (a, b)
    tr.save_checkpoint(tmp_path / "ck")
    saved = load_file(str(tmp_path / "ck" / "checkpoint.safetensors"))
    for n in low:
        value = saved[f"param.{n}"]
        assert value.dtype == torch.float32 and torch.equal(value, tr.masters.held(params[n])), n


def _assert_same_run(straight, resumed):
    """Two trainers' models bit-identical, parameter by parameter, with the same CE history."""
    for (n, a), (_, b) in zip(straight.hf.named_parameters(), resumed.hf.named_parameters(), strict=True):
        assert torch.equal(a, b), n
    assert [r.ce for r in straight.history] == [r.ce for r in resumed.history]
