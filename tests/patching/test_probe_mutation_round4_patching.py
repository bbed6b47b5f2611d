"""Mutation probe, round 4 (patching): tests for mutants the area's tests let pass (docs/reliability.md,
"Mutation probe, round 4"). Each was seen failing with its mutant and passing on the clean tree."""

from __future__ import annotations

import torch
from helpers import random_ids, tiny_nnsight, tiny_tokenizer

from nnsight_lorsa import get_adapter
from nnsight_lorsa.patching import MHSAHead, ReplacementModel, mean_activations
from nnsight_lorsa.patching.experiments import RandomControl
from nnsight_lorsa.patching.tasks import induction_task


def test_induction_corrupt_prompts_repeat_nothing():
    """``induction_task``'s documented corrupt prompt ``[BOS] s' s[:-1]``: a fresh ``s'`` that shares no token with
    ``s`` (the pool, 128 tokens, holds more than ``2 · seq_len + 1``), so the tail has nothing to copy from
    (mutant: the corrupt prompt equal to the clean one)."""
    tok = tiny_tokenizer()
    n = 6
    t = induction_task(tok, n_prompts=4, seq_len=n, seed=3)
    for clean, corrupt in zip(t.clean.tolist(), t.corrupt.tolist(), strict=True):
        seq, fresh = clean[1:1 + n], corrupt[1:1 + n]
        assert not set(seq) & set(fresh), (seq, fresh)
        assert corrupt[1 + n:] == seq[:-1] == clean[1 + n:]
        assert len(set(fresh)) == n


def test_random_control_relative_is_one_value_per_draw():
    """``RandomControl.relative``: ``(mean baseline − mean samples[i]) / mean baseline`` per draw ``i``
    (``(n_samples,)``), from the formula by hand, with ``n_samples != batch`` (mutant: the mean over the draws)."""
    base = torch.tensor([2.0, 4.0, 6.0])  # (batch=3,), mean 4
    samples = torch.tensor([[1.0, 2.0, 3.0], [4.0, 4.0, 4.0], [0.0, 0.0, 0.0], [8.0, 8.0, 8.0], [2.0, 6.0, 4.0]])
    rel = RandomControl(base, samples, [()] * 5).relative
    want = torch.tensor([(4 - 2) / 4, 0.0, 1.0, (4 - 8) / 4, 0.0])
    assert rel.shape == (5,)
    torch.testing.assert_close(rel, want)


@torch.no_grad()
def test_per_position_means_average_over_the_batch():
    """``mean_activations(per_position=True)``: the head's output-projection input averaged over the batch only,
    ``(pos, head_dim)``, against a plain forward pre-hook (mutant: averaged over the positions)."""
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    d = adapter.head_dim
    ids = random_ids(batch=3, seq=7, seed=5)
    seen = {}
    proj = adapter.attention_module(hf, 1).o_proj
    h = proj.register_forward_pre_hook(lambda m, a: seen.update(x=a[0].clone()))
    try:
        hf(ids)
    finally:
        h.remove()
    got = mean_activations(ReplacementModel(model), [MHSAHead(1, 2)], ids, per_position=True)[MHSAHead(1, 2)]
    want = seen["x"][..., 2 * d:3 * d].mean(0)
    assert got.shape == want.shape == (7, d)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
