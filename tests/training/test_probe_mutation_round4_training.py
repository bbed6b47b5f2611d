"""Mutation probe, round 4 (training): tests for mutants the area's tests let pass (docs/reliability.md,
"Mutation probe, round 4"). Each was seen failing with its mutant and passing on the clean tree."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_training_setup

from nnsight_lorsa.modules.clt import CLTConfig, CrossLayerTranscoder
from nnsight_lorsa.training import ActivationSource, TokenDataset, TrainConfig, Trainer


@pytest.mark.parametrize(("n", "fraction"), [(10, 0.3), (7, 0.5), (5, 0.01), (4, 0.75)])
def test_split_holds_out_the_last_windows_and_shares_none(n, fraction):
    """``TokenDataset.split``: the last ``max(1, int(n · fraction))`` windows held out, the rest for training, in
    order, no window in both (mutant: the training part one window into the held-out one)."""
    tokens = torch.arange(n * 4, dtype=torch.long).view(n, 4)
    mask = torch.ones(n, 4, dtype=torch.bool)
    train, held = TokenDataset(tokens, mask).split(fraction)
    n_hold = max(1, int(n * fraction))
    assert torch.equal(held.tokens, tokens[n - n_hold:])
    assert torch.equal(train.tokens, tokens[:n - n_hold])
    assert torch.equal(torch.cat([train.target_mask, held.target_mask]), mask)
    assert not set(train.tokens[:, 0].tolist()) & set(held.tokens[:, 0].tolist())


def test_sample_stream_windows_are_bos_and_a_consecutive_run_from_every_start():
    """``TokenDataset.sample_stream``: each window BOS then ``seq_len − 1`` consecutive ids starting anywhere in
    ``[0, n − seq_len + 1]``; every such start is drawn (64 draws of 3 starts), none past it (mutant: a start one past
    the end, a window short of a token)."""
    seq_len = 5
    ids = torch.arange(10, 16)  # 6 ids: starts 0, 1, 2
    x = TokenDataset.sample_stream(ids, 64, seq_len, torch.Generator().manual_seed(0), 99)
    assert x.shape == (64, seq_len)
    assert (x[:, 0] == 99).all()
    starts = x[:, 1] - 10
    assert set(starts.tolist()) == {0, 1, 2}
    for row, s in zip(x, starts.tolist(), strict=True):
        assert torch.equal(row[1:], ids[s:s + seq_len - 1])


@pytest.mark.parametrize(("index", "batch_size", "seed"), [(0, 3, 0), (5, 4, 1), (11, 2, 7)])
def test_batch_targets_are_the_masks_of_the_batchs_windows(index, batch_size, seed):
    """``batch_targets(i, b, seed)`` is the ``target_mask`` of the very windows ``batch(i, b, seed)`` returns: a mask
    written as a function of each window's ids must come back as that function of the batch (mutant: the masks of
    another permutation's windows)."""
    n, seq = 9, 6
    tokens = torch.arange(n * seq, dtype=torch.long).view(n, seq)
    mask = torch.ones(n, seq, dtype=torch.bool)
    for w in range(n):
        mask[w, seq - 1 - w % 3:] = False  # right padding of 1, 2 or 3 positions, by window
    data = TokenDataset(tokens, mask)
    ids, got = data.batch(index, batch_size, seed), data.batch_targets(index, batch_size, seed)
    want = mask[ids[:, 0] // seq]
    assert torch.equal(got, want)


def test_a_folded_skip_clt_is_the_trained_one_on_raw_activations():
    """``_CLTObjective.fold`` of a CLT with ``W_skip``: ``folded(x) = clt(x · s_in) / s_out`` per layer (its
    docstring's equation, with the trainer's per-layer scales), the skip weights drawn non-zero so that their fold
    shows (mutant: ``W_skip[l] *= s_out[l] / s_in[l]``)."""
    model, _, adapter, data = tiny_training_setup()
    source = ActivationSource.clt(model, data, batch_size=8)
    torch.manual_seed(0)
    cfg = CLTConfig(d_in=adapter.d_model, d_sae=32, n_layers=adapter.n_layers, activation="relu", skip=True)
    trainer = Trainer(CrossLayerTranscoder(cfg), source, TrainConfig(total_steps=1, lr=1e-3, log_every=1))
    trainer.train(progress=False)
    with torch.no_grad():
        trainer.module.W_skip.normal_(0.0, 0.1)
        folded = trainer.folded()
        b = source(0)
        s_in = torch.tensor(trainer.s_in_layers)[:, None, None, None]
        s_out = torch.tensor(trainer.s_out_layers)[:, None, None, None]
        assert not torch.allclose(s_in, s_out, rtol=0.05)  # the two scales differ: an inverted ratio would show
        want = trainer.module.eval()(b.x * s_in) / s_out
        got = folded(b.x)
    assert (got - want).abs().max() < 1e-4 * want.abs().max()
