"""Mutation probe, round 10 (docs/reliability.md): QK feature ablation (``analysis/qk_ablation.py``, Lorsa paper
App. F.1); each test seen failing with the mutant it names and passing without.
"""

from __future__ import annotations

import torch
from helpers import LAYER, coordinate_sae, make_lorsa, random_ids, tiny_nnsight

from nnsight_lorsa import LorsaSet, ReplacementModel, get_adapter
from nnsight_lorsa.analysis import qk_feature_impacts


@torch.no_grad()
def test_the_reported_window_is_the_corpus_row_of_the_maximum_whatever_the_batch():
    """Each feature's maximum over the corpus is where it is largest over the windows run one at a time, and its
    ``q_window`` / ``k_window`` is that window's row in ``tokens`` (mutant Q13: the row within its batch, ``b``, not
    ``start + b``: every window past the first batch reported as one of the first batch's)."""
    model, hf = tiny_nnsight("llama")
    lorsa = make_lorsa(hf, get_adapter(model))
    lorsa.W_Q.mul_(6.0)
    lorsa.W_K.mul_(6.0)
    rm = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: lorsa}))
    tokens = random_ids(batch=4, seq=8, seed=11)
    sae = coordinate_sae(lorsa.cfg.d_model)
    head = 0
    res = qk_feature_impacts(rm, LAYER, head, sae, tokens, batch_size=1)
    alone = [qk_feature_impacts(rm, LAYER, head, sae, tokens[w:w + 1], batch_size=1) for w in range(4)]
    checked = 0
    for side in ("q", "k"):
        per = torch.stack([getattr(a, f"{side}_kl") for a in alone])  # (windows, features)
        cnt = torch.stack([getattr(a, f"{side}_count") for a in alone]).sum(0)
        assert torch.equal(getattr(res, f"{side}_count"), cnt)
        torch.testing.assert_close(getattr(res, f"{side}_kl"), per.max(0).values, atol=1e-6, rtol=1e-5)
        for f in range(per.shape[1]):
            top = per[:, f].topk(2).values
            if cnt[f] > 0 and top[0] > 1e-4 and top[0] - top[1] > 1e-4:  # a unique maximum: its window is known
                assert int(getattr(res, f"{side}_window")[f]) == int(per[:, f].argmax()), (side, f)
                checked += 1
    assert checked > 4
