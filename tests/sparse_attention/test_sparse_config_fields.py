"""Every field of ``SparseTrainConfig`` is checked with the config, by name, before a model runs: a field out of its
rule was accepted and either failed deep in torch / peft (``batch_size=0``: "stack expects a non-empty TensorList";
``bos_id=10**9``: an embedding ``IndexError``) or trained silently wrong (a negative ``gate_lr`` climbs the sparsity
term; ``recover_fraction=nan`` never recovers; ``target_batches=0`` measured τ on one batch) — found by a probe of
every config field (2026-11-29, fourth session). Wrong *kinds* (a str, None) run outside the suite's beartype hook in
``wrong_kind_cases.py``."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_hf_model
from hypothesis import given, settings
from hypothesis import strategies as st

from nnsight_lorsa.errors import ArgumentError, GateNotInstalledError
from nnsight_lorsa.sparse_attention import (
    SparseTrainConfig,
    evaluate_sparse,
    install_gated_attention,
    train_sparse_attention,
)
from nnsight_lorsa.sparse_attention.install import get_gates
from nnsight_lorsa.sparse_attention.train import SparseAttentionTrainer, resolve_bos_id

SEQ = 8
NAN, INF = math.nan, math.inf

# (field, a value that breaks its rule) — each rule as SparseTrainConfig.validate's docstring states it
OUT_OF_RULE = [
    ("batch_size", 0), ("batch_size", -1), ("target_batches", 0), ("target_batches", -1),
    ("seq_len", 1), ("seq_len", 0), ("seed", -1),
    ("gate_lr", 0.0), ("gate_lr", -1.0), ("gate_lr", NAN), ("temperature", 0.0), ("temperature", INF),
    ("geco_lr", -1.0), ("lora_alpha", 0), ("init_lambda", 0.0), ("min_lambda", -1.0), ("max_lambda", INF),
    ("weight_decay", -1.0), ("weight_decay", NAN), ("target_margin", -0.5), ("max_initial_slack", -0.1),
    ("init_bias", NAN), ("init_bias", -INF), ("geco_ema", 1.0), ("geco_ema", -0.1),
    ("recover_fraction", 1.0), ("recover_fraction", -0.1), ("recover_fraction", NAN),
    ("target_ce", 0.0), ("target_ce", -1.0), ("target_ce", NAN), ("lora_rank", 0), ("bos_id", -1),
]


def _stream() -> torch.Tensor:
    return torch.randint(3, 128, (200,), generator=torch.Generator().manual_seed(0))  # no EOS (2): one text


def _cfg(**kw) -> SparseTrainConfig:
    return SparseTrainConfig(**{"total_steps": 2, "batch_size": 2, "seq_len": SEQ, "target_batches": 1,
                                "target_ce": 100.0, "allow_slack_constraint": True, **kw})


@pytest.mark.parametrize(("name", "value"), OUT_OF_RULE, ids=[f"{n}={v}" for n, v in OUT_OF_RULE])
def test_a_field_out_of_its_rule_is_refused_with_the_config_by_name(name, value):
    with pytest.raises(ArgumentError, match=rf"SparseTrainConfig\.{name} must be"):
        _cfg(**{name: value})


@pytest.mark.parametrize(("lo", "init", "hi"), [(2.0, 1.0, 3.0), (1e-3, 5.0, 4.0), (3.0, 3.0, 2.0)])
def test_the_lambda_bounds_must_hold_init_lambda(lo, init, hi):
    with pytest.raises(ArgumentError, match="min_lambda <= init_lambda <= max_lambda"):
        _cfg(min_lambda=lo, init_lambda=init, max_lambda=hi)


@settings(max_examples=40, deadline=None)
@given(init_bias=st.floats(allow_nan=False, allow_infinity=False),
       ema=st.floats(0.0, 1.0, exclude_max=True), recover=st.floats(0.0, 1.0, exclude_max=True),
       margin=st.floats(0.0, 1e6), seq_len=st.integers(2, 4096), seed=st.integers(0, 2**62))
def test_every_value_inside_the_rules_is_accepted(init_bias, ema, recover, margin, seq_len, seed):
    cfg = _cfg(init_bias=init_bias, geco_ema=ema, recover_fraction=recover, target_margin=margin,
               seq_len=seq_len, seed=seed)
    assert (cfg.init_bias, cfg.geco_ema, cfg.recover_fraction, cfg.seq_len) == (init_bias, ema, recover, seq_len)


def test_a_field_set_after_construction_is_refused_by_the_trainer_before_the_model_is_touched():
    hf = tiny_hf_model("llama")
    cfg = _cfg()
    cfg.batch_size = 0  # was "stack expects a non-empty TensorList" from inside the first batch
    with pytest.raises(ArgumentError, match=r"SparseTrainConfig\.batch_size must be a positive int, got 0"):
        SparseAttentionTrainer(hf, _stream(), cfg)
    with pytest.raises(GateNotInstalledError):
        get_gates(hf)  # no gate was installed: the model is as it was
    cfg.batch_size, cfg.recover_fraction = 2, float("nan")  # was: trained as if 0
    with pytest.raises(ArgumentError, match=r"SparseTrainConfig\.recover_fraction"):
        train_sparse_attention(hf, _stream(), cfg, progress=False)


def test_a_bos_id_outside_the_vocabulary_is_refused_by_name():
    hf = tiny_hf_model("llama")
    vocab = hf.get_input_embeddings().num_embeddings
    assert resolve_bos_id(hf, vocab - 1) == vocab - 1
    for bad in (vocab, 10**9):  # was an IndexError from the embedding, after the gates were installed
        with pytest.raises(ArgumentError, match=f"BOS id {bad} is outside the model's vocabulary of {vocab}"):
            SparseAttentionTrainer(hf, _stream(), _cfg(bos_id=bad))
        with pytest.raises(ArgumentError, match="outside the model's vocabulary"):
            evaluate_sparse(hf, _stream(), seq_len=SEQ, bos_id=bad)
    with pytest.raises(GateNotInstalledError):
        get_gates(hf)


@pytest.mark.parametrize(("kw", "name"), [({"batch_size": 0}, "batch_size"), ({"batch_size": -1}, "batch_size"),
                                          ({"max_windows": 0}, "max_windows"), ({"max_windows": -2}, "max_windows"),
                                          ({"seq_len": 1}, "seq_len"), ({"seq_len": 0}, "seq_len")])
def test_evaluate_sparse_refuses_its_counts_by_name_before_the_model_runs(kw, name):
    """``batch_size=0`` was "range() arg 3 must not be zero", ``-1`` an ``AssertionError``, ``seq_len=1`` a
    ``ZeroDivisionError``, ``max_windows=0`` "need at least 7 tokens for one window, got 200"."""
    hf = tiny_hf_model("llama")
    hf.config.bos_token_id = 0
    install_gated_attention(hf, init_bias=30.0)
    calls = []
    hf.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ArgumentError, match=rf"evaluate_sparse\.{name} must be"):
        evaluate_sparse(hf, _stream(), **{"seq_len": SEQ, **kw})
    assert calls == []
    ok = evaluate_sparse(hf, _stream(), seq_len=SEQ, batch_size=1, max_windows=1)
    assert ok["windows"] == 1 and calls == [1]


def test_measure_train_ce_refuses_a_count_below_one():
    """``measure_train_ce(0)`` (or a negative count) measured one batch (round 11b's note): now refused by name."""
    trainer = SparseAttentionTrainer(tiny_hf_model("llama"), _stream(), _cfg())
    one = trainer.measure_train_ce(1)
    for bad in (0, -2):
        with pytest.raises(ArgumentError, match=r"measure_train_ce\.n_batches must be a positive int"):
            trainer.measure_train_ce(bad)
    assert trainer.measure_train_ce(1) == one


def test_train_never_runs_past_total_steps_as_the_trainer():
    """``train(steps)`` stops at ``config.total_steps``, as ``Trainer.train`` (seen failing: a call past it kept
    training at the recovery phase's LR, outside the schedule laid out over ``total_steps``)."""
    trainer = SparseAttentionTrainer(tiny_hf_model("llama"), _stream(), _cfg(total_steps=3))
    trainer.train(2, progress=False)
    assert trainer.step == 2
    trainer.train(5, progress=False)  # one step left
    assert trainer.step == 3
    trainer.train(4, progress=False)  # none left: nothing runs
    assert trainer.step == 3
