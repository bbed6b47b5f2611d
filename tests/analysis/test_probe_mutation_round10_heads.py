"""Mutation probe, round 10 (docs/reliability.md, "Mutation probe, round 10: head analysis, figures, dashboards and
the CLI"): the head analysis' rules its tests left open, each against the documented rule or plain torch.

* ``heads_spanned``: ``>=`` the threshold (a sum landing exactly on it), never more heads than the MHSA has;
* ``ov_logit_lens``: ``k`` up to the vocabulary (``[1, vocab]``), the ``tokenizer=`` passed is the one that names;
* ``mhsa_correlation``: a top-k slot clamped to ``z = 0`` is no active head.
"""

from __future__ import annotations

import pytest
import torch
from helpers import LAYER, VOCAB, make_lorsa, random_ids, tiny_nnsight

from nnsight_lorsa import LorsaSet, ReplacementModel, get_adapter
from nnsight_lorsa.analysis.heads import MHSACorrelation, mhsa_correlation, ov_logit_lens
from nnsight_lorsa.envoy.read import attention_activations
from nnsight_lorsa.errors import ArgumentError


@pytest.fixture(scope="module")
def tiny():
    model, hf = tiny_nnsight("llama")
    lorsa = make_lorsa(hf, get_adapter(model))
    return ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: lorsa})), hf, lorsa


def test_heads_spanned_counts_a_sum_landing_on_the_threshold_and_never_more_heads_than_there_are():
    """App. E.2 as documented: the fewest heads whose cumulative fraction reaches the threshold (``>=``), with
    fractions exact in binary (0.5, 0.25, 0.25: 2 heads reach 0.75 exactly); and at most every MHSA head: ten equal
    contributions of 0.1 sum in fp32 to 0.99999988, below a threshold of 1.0, yet all 10 heads are the answer (seen
    failing: ``cum <= threshold`` gave 3; no clamp gave 11)."""
    contrib = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.25, 0.25, 0.25, 0.25]])
    corr = MHSACorrelation(contrib, torch.tensor([4, 4]), 8)
    assert corr.heads_spanned(0.75).tolist() == [2, 3]
    assert corr.heads_spanned(0.5).tolist() == [1, 2]
    uniform = MHSACorrelation(torch.full((1, 10), 0.1), torch.tensor([3]), 3)
    assert float(uniform.fractions().sort(descending=True).values.cumsum(-1)[0, -1]) < 1.0  # the premise
    assert uniform.heads_spanned(1.0).tolist() == [10]


def test_ov_logit_lens_takes_k_up_to_the_vocabulary_and_names_with_the_tokenizer_passed(tiny):
    """``k`` in ``[1, vocab]`` (documented): ``k = vocab`` is every token, sorted — plain torch's full sort of
    ``W_U w_o`` (the tiny Llama's final norm gain) — and ``vocab + 1`` refused (seen failing: ``k >= vocab`` refused
    the whole vocabulary). The strings come from the ``tokenizer=`` passed, not the model's (seen failing: the
    model's tokenizer named them)."""
    rm, hf, lorsa = tiny

    class Named:
        def __len__(self) -> int:
            return VOCAB

        def decode(self, ids: list[int]) -> str:
            return f"<id {ids[0]}>"

    vals, ids, strings = ov_logit_lens(rm, LAYER, [2], k=VOCAB, tokenizer=Named())
    want = ((lorsa.W_O[[2]] * hf.model.norm.weight) @ hf.lm_head.weight.T).detach().sort(-1, descending=True)
    torch.testing.assert_close(vals, want.values)
    assert sorted(ids[0].tolist()) == list(range(VOCAB))
    assert strings == [[f"<id {i}>" for i in ids[0].tolist()]]
    with pytest.raises(ArgumentError, match="exceeds the vocabulary"):
        ov_logit_lens(rm, LAYER, [2], k=VOCAB + 1)


@torch.no_grad()
def test_a_head_in_the_top_k_with_z_zero_is_not_active(tiny):
    """``count``: tokens each head was active on (``z > 0``). A Lorsa whose top-k holds heads clamped to ``z = 0``
    (60 of its 64 heads' ``b_V`` at -100: at most 4 of the 8 slots positive) counts exactly the ``z > 0`` of its own
    forward, and a slot at 0 adds no token (seen failing: ``active = zk >= 0`` counted the zero slots, every head
    "active" on every token)."""
    rm, _, lorsa = tiny
    tokens = random_ids(batch=2, seq=7, seed=5)
    saved = lorsa.b_V.clone()
    try:
        lorsa.b_V[:60] = -100.0
        corr = mhsa_correlation(rm, LAYER, tokens)
        act = attention_activations(rm.model, LAYER, tokens)
        _, cache = lorsa(act.x, act.positions, return_cache=True)
    finally:
        lorsa.b_V.copy_(saved)
    z = cache.z[:, 1:]
    assert bool((z.gather(-1, cache.topk_indices[:, 1:]) == 0).any())  # the premise: zero slots in the top-k
    assert torch.equal(corr.count, (z > 0).sum((0, 1)))
    assert int(corr.count[:60].sum()) == 0 and corr.n_tokens == 2 * 6
