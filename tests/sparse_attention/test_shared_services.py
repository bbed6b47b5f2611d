"""Sparse attention on the package's shared services (issue 22 item 2): its gate files are a format of the
registry, its CE is training's one next-token CE, its BOS the one BOS rule, its windows TokenDataset's, its
optimisation settings training's OptimConfig."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import torch.nn.functional as F
from helpers import random_ids, tiny_hf_model, tiny_tokenizer

import nnsight_lorsa
from nnsight_lorsa.errors import ArgumentError, CheckpointError, FormatDetectionError
from nnsight_lorsa.formats.gate_format import GateSet
from nnsight_lorsa.modules.attention_gate import AttentionGate
from nnsight_lorsa.sparse_attention import SparseTrainConfig, install_gated_attention, load_gates, save_sparse_model
from nnsight_lorsa.sparse_attention.install import get_gates
from nnsight_lorsa.sparse_attention.io import save_gates
from nnsight_lorsa.sparse_attention.train import SparseAttentionTrainer
from nnsight_lorsa.training import OptimConfig, TokenDataset, TrainConfig
from nnsight_lorsa.training.dataset import special_token_id
from nnsight_lorsa.training.metrics import next_token_ce


def _gated(seed: int) -> torch.nn.Module:
    hf = tiny_hf_model("llama")
    install_gated_attention(hf, init_bias=0.0)
    with torch.no_grad():
        for g in get_gates(hf).values():
            g.bias.copy_(torch.randn(g.n_heads, generator=torch.Generator().manual_seed(seed)) * 0.05)
    return hf


def test_gate_files_load_and_save_through_the_registry(tmp_path):
    hf = _gated(0)
    save_gates(hf, tmp_path / "g", training={"steps": 3})
    loaded = nnsight_lorsa.load(tmp_path / "g")  # detected: sparse_attention
    assert isinstance(loaded, GateSet) and loaded.config.training == {"steps": 3} and len(loaded) == 3
    for layer, gate in get_gates(hf).items():
        assert isinstance(loaded[layer], AttentionGate) and torch.equal(loaded[layer].bias, gate.bias)
    nnsight_lorsa.save(loaded, tmp_path / "again", format="sparse_attention")
    fresh = tiny_hf_model("llama")
    load_gates(fresh, tmp_path / "again")
    ids = random_ids()
    with torch.no_grad():
        assert torch.equal(fresh(input_ids=ids).logits, hf(input_ids=ids).logits)
    with pytest.raises(CheckpointError, match=r"sparse_attention\.json: gates for a llama model .* do not fit"):
        nnsight_lorsa.load(tmp_path / "g", format="sparse_attention", model_type="llama", n_layers=3, n_heads=8)
    save_sparse_model(hf, tmp_path / "m")  # a Hugging Face directory with gates: say which format to read
    with pytest.raises(FormatDetectionError, match="ambiguous"):
        nnsight_lorsa.load(tmp_path / "m")
    assert isinstance(nnsight_lorsa.load(tmp_path / "m", format="sparse_attention"), GateSet)


def test_next_token_ce_is_the_reference_with_and_without_a_mask():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 11, generator=g, requires_grad=True)
    ids = torch.randint(0, 11, (3, 6), generator=g)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, 4:] = False
    total, n = next_token_ce(logits, ids)
    ref = sum(F.cross_entropy(logits[b, t], ids[b, t + 1], reduction="sum") for b in range(3) for t in range(5))
    assert n == 15 and torch.allclose(total, ref, rtol=1e-6)
    kept, m = next_token_ce(logits, ids, mask)
    ref_kept = sum(F.cross_entropy(logits[b, t], ids[b, t + 1], reduction="sum")
                   for b in range(3) for t in range(5) if mask[b, t + 1])
    assert m == 13 and torch.allclose(kept, ref_kept, rtol=1e-6)
    kept.backward()  # differentiable: sparse-attention training descends it
    assert logits.grad is not None and logits.grad[1, 3:].abs().sum() == 0  # predictions of masked targets
    half, _ = next_token_ce(logits.detach().bfloat16(), ids)
    assert half.dtype == torch.float32


def test_one_bos_rule():
    tok = types.SimpleNamespace(bos_token_id=4, eos_token_id=[1, 2])
    cfg = types.SimpleNamespace(bos_token_id=5, eos_token_id=2)
    assert special_token_id(tok, cfg) == 4 and special_token_id(None, cfg) == 5 and special_token_id(tok, cfg, 7) == 7
    assert special_token_id(tok, cfg, name="eos_token_id") == 2  # a list of EOS ids is not one id
    assert special_token_id(types.SimpleNamespace(bos_token_id=True), None) is None  # a bool is not an id
    assert special_token_id(None, None) is None


def test_stream_windows_are_token_dataset_windows():
    stream = torch.arange(10, 40)
    data = TokenDataset.from_ids(stream, 8, bos_token_id=0)
    assert data.tokens.tolist() == [[0, *range(10 + 7 * i, 17 + 7 * i)] for i in range(4)]  # the 2-token tail dropped
    assert TokenDataset.from_ids(stream, 10).tokens.tolist() == [list(range(10, 20)), list(range(20, 30)),
                                                                 list(range(30, 40))]
    text = " ".join(f"w{i}" for i in range(2, 40))
    assert torch.equal(TokenDataset.from_text(tiny_tokenizer(), text, 8).tokens,
                       TokenDataset.from_ids(torch.arange(2, 40), 8, bos_token_id=0).tokens)
    with pytest.raises(ValueError, match="fewer than one window"):
        TokenDataset.from_ids(stream[:6], 8, bos_token_id=0)
    x = TokenDataset.sample_stream(stream, 5, 8, torch.Generator().manual_seed(3), 0)
    assert x.shape == (5, 8) and (x[:, 0] == 0).all()
    assert (x[:, 2:] - x[:, 1:-1] == 1).all() and (x[:, 1:] >= 10).all() and (x[:, 1:] < 40).all()
    assert torch.equal(x, TokenDataset.sample_stream(stream, 5, 8, torch.Generator().manual_seed(3), 0))
    docs = TokenDataset.from_documents(tiny_tokenizer(), ["w2 w3", "w4 w5 w6 w7", "w8", "w9 w10 w11"], 4)
    assert docs.target_mask is not None
    for i in range(3):
        batch = docs.batch(i, 2, seed=1)
        rows = [next(r for r in range(len(docs)) if torch.equal(docs.tokens[r], b)) for b in batch]
        assert torch.equal(docs.batch_targets(i, 2, seed=1), docs.target_mask[rows])
    assert TokenDataset(docs.tokens).batch_targets(0, 2) is None


def test_sparse_config_takes_the_shared_optimisation_settings():
    """``SparseTrainConfig`` repeats none of the settings every trainer shares: they are ``OptimConfig``'s (also
    ``TrainConfig``'s), with the same names and checks, and this trainer's defaults; its AdamW takes ``betas``."""
    shared = [f.name for f in dataclasses.fields(OptimConfig)]
    assert shared == ["total_steps", "lr", "betas", "grad_clip", "decay_frac"]
    for config_type in (TrainConfig, SparseTrainConfig):
        assert issubclass(config_type, OptimConfig)
        assert [f.name for f in dataclasses.fields(config_type)][:len(shared)] == shared
    cfg = SparseTrainConfig()
    assert [getattr(cfg, name) for name in shared] == [300, 1e-3, (0.9, 0.95), 1.0, 0.0]
    for bad, needle in [({"total_steps": 0}, r"SparseTrainConfig\.total_steps must be a positive int, got 0"),
                        ({"lr": 0.0}, r"SparseTrainConfig\.lr must be in \(0, inf\)"),
                        ({"betas": (0.9, 1.0)}, r"SparseTrainConfig\.betas\[1\] must be in \[0, 1\)"),
                        ({"grad_clip": float("nan")}, r"SparseTrainConfig\.grad_clip must be a finite number"),
                        ({"decay_frac": 1.5}, r"SparseTrainConfig\.decay_frac must be in \[0, 1\]")]:
        with pytest.raises(ArgumentError, match=needle):
            SparseTrainConfig(**bad)
    with pytest.raises(TypeError, match="steps"):
        SparseTrainConfig(steps=3)  # one name per setting: total_steps
    stream = torch.randint(3, 128, (200,), generator=torch.Generator().manual_seed(0))  # no EOS (2): one text
    trainer = SparseAttentionTrainer(tiny_hf_model("llama"), stream, SparseTrainConfig(
        total_steps=1, batch_size=2, seq_len=16, target_batches=1, betas=(0.8, 0.9)))
    assert [group["betas"] for group in trainer.optimizer.param_groups] == [(0.8, 0.9), (0.8, 0.9)]
