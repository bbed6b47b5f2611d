"""Mutation probe, round 4 (training): tests for mutants the area's tests let pass (docs/reliability.md,
"Mutation probe, round 4"). Each was seen failing with its mutant and passing on the clean tree."""

from __future__ import annotations

import pytest
import torch

from nnsight_lorsa.training import TokenDataset


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
