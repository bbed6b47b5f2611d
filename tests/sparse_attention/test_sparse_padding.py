"""Right-padded document windows in sparse-attention training and evaluation: the padding's edges count
nowhere — not in the sparsity term, not in the logged or reported edge fractions — against a reference that
runs each window's real tokens alone (no padding at all) through the same gated model.

Before the fix the model ran without an attention mask and every gate counted every query row, so a window
of ``n`` real tokens padded to ``L`` counted ``L(L+1)/2`` allowed edges instead of ``n(n+1)/2`` (and the
expected and active edges of the pad rows with them)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_hf_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnsight_lorsa.sparse_attention import edge_statistics, install_gated_attention
from nnsight_lorsa.sparse_attention.install import get_gates
from nnsight_lorsa.sparse_attention.train import SparseAttentionTrainer, SparseTrainConfig, evaluate_sparse
from nnsight_lorsa.training.dataset import TokenDataset, _window_ids

FAST = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PAD = 5

_cases = st.fixed_dictionaries({
    "seq_len": st.integers(3, 10), "n_docs": st.integers(1, 6), "batch_size": st.integers(1, 4),
    "lengths_seed": st.integers(0, 10_000), "last_bias": st.lists(st.floats(-1.5, 1.5), min_size=4, max_size=4),
    "answers": st.booleans(),
})


def _model_and_data(a):
    """The tiny Llama, gates installed: layers 0-1 wide open (bias 30: their outputs do not depend on the gate
    noise, so training-mode scores are deterministic), the last layer's biases drawn; and right-padded windows
    ``[BOS] + document`` (lengths 1 … seq_len, at least one padded), their mask the real tokens — or, with
    ``answers``, a task mask counting only each document's last token (its padding still after it)."""
    model = tiny_hf_model("llama")
    install_gated_attention(model, init_bias=30.0)
    with torch.no_grad():
        gates = get_gates(model)
        gates[max(gates)].bias.copy_(torch.tensor(a["last_bias"]))
    g = torch.Generator().manual_seed(a["lengths_seed"])
    seq, bos = a["seq_len"], model.config.bos_token_id
    lengths = torch.randint(2, seq + 1, (a["n_docs"],), generator=g)
    lengths[0] = min(int(lengths[0]), seq - 1)  # some padding in every case
    tokens = torch.full((a["n_docs"], seq), PAD, dtype=torch.long)
    mask = torch.zeros(tokens.shape, dtype=torch.bool)
    for r, n in enumerate(lengths.tolist()):
        tokens[r, 0] = bos
        tokens[r, 1:n] = torch.randint(10, 128, (n - 1,), generator=g)
        if a["answers"]:
            mask[r, n - 1] = True
        else:
            mask[r, :n] = True
    return model, TokenDataset(tokens, mask), lengths


def _alone(model, windows: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Σ expected, active and allowed edges (per layer and head) of each window's real tokens run alone."""
    was = model.training
    model.eval()
    tot = None
    with torch.no_grad():
        for row, n in zip(windows, lengths, strict=True):
            model(input_ids=row[None, :n])
            st_ = edge_statistics(model)
            now = torch.stack([st_.expected.double(), st_.active.double(), st_.possible.double()])
            tot = now if tot is None else tot + now
    model.train(was)
    assert tot is not None
    return tot[0], tot[1], tot[2]


@FAST
@given(_cases)
def test_evaluate_sparse_counts_the_edges_of_real_tokens_only(a) -> None:
    model, ds, lengths = _model_and_data(a)
    exp, act, pos = _alone(model, ds.tokens, lengths.tolist())
    got = evaluate_sparse(model, ds, batch_size=a["batch_size"])
    assert got["expected_fraction"] == pytest.approx(float(exp.sum() / pos.sum()), rel=1e-5)
    assert got["active_fraction"] == pytest.approx(float(act.sum() / pos.sum()), rel=1e-5)
    assert torch.allclose(torch.tensor(got["active_fraction_per_head"], dtype=torch.float64), act / pos,
                          rtol=1e-5, atol=1e-7)


@FAST
@given(_cases)
def test_the_sparsity_term_counts_the_edges_of_real_tokens_only(a) -> None:
    model, ds, lengths = _model_and_data(a)
    cfg = SparseTrainConfig(total_steps=4, batch_size=a["batch_size"], seq_len=a["seq_len"], target_batches=1,
                            target_ce=None, allow_slack_constraint=True, init_bias=30.0)
    picked = _window_ids(len(ds), 0, cfg.batch_size, cfg.seed)  # the windows of training batch 0
    exp, _, pos = _alone(model, ds.tokens[picked], lengths[picked].tolist())
    trainer = SparseAttentionTrainer(model, ds, cfg)
    rec = trainer.train_step()
    assert rec.expected_fraction == pytest.approx(float(exp.sum() / pos.sum()), rel=1e-5)
    st_ = edge_statistics(trainer.hf)
    assert torch.equal(st_.possible.double(), pos)  # the pad rows' edges are not allowed edges
    assert bool((st_.active <= st_.possible).all())
