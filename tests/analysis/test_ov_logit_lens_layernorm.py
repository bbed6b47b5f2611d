"""The OV logit lens of a LayerNorm model centres the head's direction, as the model's final norm does.

Found by the Lorsa-analysis peer check against Llamascopium's ``DirectLogitAttributor``
(``scripts/peer_checks/lorsa_analysis/run.py``, docs/analysis.md): on random GPT-2s our rows were 13-24% (of their
largest entry) off theirs and 10-13% of the top-10 tokens differed, because ``W_U (g ⊙ w_o)`` left out the final
LayerNorm's mean subtraction. The model's own forward decides: a direction along the all-ones vector of ``d_model``
never reaches the logits through a LayerNorm, so two heads whose ``w_o`` differ by ``c·1`` have the same direct
effect and must have the same logit lens.
"""

from __future__ import annotations

import pytest
import torch
from helpers import LAYER, make_lorsa, tiny_nnsight

from nnsight_lorsa import LorsaSet, ReplacementModel, get_adapter
from nnsight_lorsa.analysis import ov_logit_lens


def _final_norm(hf):
    base = hf.base_model
    return next(getattr(base, n) for n in ("norm", "final_layer_norm", "ln_f") if hasattr(base, n))


@pytest.mark.parametrize("family", ["gpt2", "neox"])
@torch.no_grad()
def test_a_direction_the_final_layernorm_removes_has_no_logit_lens(family):
    model, hf = tiny_nnsight(family)
    lorsa = make_lorsa(hf, get_adapter(model))
    d = lorsa.cfg.d_model
    lorsa.W_O[1] = lorsa.W_O[0] + 0.7  # head 1 = head 0 plus 0.7 along the all-ones vector
    lorsa.W_O[2] = 0.5  # head 2 writes only along the all-ones vector
    final, w_u = _final_norm(hf), hf.get_output_embeddings().weight
    assert isinstance(final, torch.nn.LayerNorm)

    # the model's own forward: the residual h plus either head's output gives the same logits (LayerNorm centres)
    h = torch.randn(3, d, generator=torch.Generator().manual_seed(0))
    logits = [final(h + lorsa.W_O[i]) @ w_u.T for i in (0, 1)]
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final(h + lorsa.W_O[2]) @ w_u.T, final(h) @ w_u.T, rtol=1e-5, atol=1e-5)

    rm = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: lorsa}))
    vocab = w_u.shape[0]
    vals, ids, _ = ov_logit_lens(rm, LAYER, [0, 1, 2], k=vocab)
    rows = torch.zeros(3, vocab).scatter_(1, ids, vals)
    scale = float(rows[0].abs().max())
    assert float((rows[0] - rows[1]).abs().max()) <= 1e-5 * scale  # was 0.7 · |W_U g 1| off
    assert float(rows[2].abs().max()) <= 1e-5 * scale  # was 0.5 · W_U g 1: a "head" promoting tokens
    assert torch.equal(ids[0, :10], ids[1, :10])
    # and the row is W_U (g ⊙ (w_o − mean w_o)): the head's direct effect with the norm's scale frozen
    w_o = lorsa.W_O[0].double()
    want = ((w_o - w_o.mean()) * final.weight.double()) @ w_u.double().T
    assert float((rows[0].double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
