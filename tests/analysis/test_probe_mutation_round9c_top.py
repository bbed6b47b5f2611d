"""Mutation probe round 9c (``nnsight_lorsa/analysis/top_activations.py``): what survived the analysis tests.

* ``TopActivations.update`` does not read ``z`` where ``keep`` is False (its docstring: "padding may hold
  anything"): NaN / inf there is accepted and gives the table of the kept tokens alone, checked against a
  brute-force top-k of the kept values (plain torch).
"""

from __future__ import annotations

import pytest
import torch

from nnsight_lorsa.analysis import TopActivations


@pytest.mark.parametrize("junk", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_at_left_out_tokens_are_not_read(junk):
    g = torch.Generator().manual_seed(0)
    b, s, n, n_top = 3, 5, 4, 3
    z = torch.randn(b, s, n, generator=g)
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[:, :2] = False  # e.g. left padding
    z[~keep] = junk
    top = TopActivations.empty(n, n_top)
    top.update(z, first_window=7, keep=keep)
    kept = z[:, 2:].reshape(-1, n)  # the kept tokens, row-major over (window, position)
    ref_v, ref_i = kept.topk(n_top, dim=0)
    torch.testing.assert_close(top.values, ref_v.T)
    assert torch.equal(top.window, (ref_i // (s - 2) + 7).T)
    assert torch.equal(top.position, (ref_i % (s - 2) + 2).T)
    assert top.n_tokens == b * (s - 2) and torch.equal(top.count, (kept > 0).sum(0))


def test_top_heads_lists_only_heads_that_fired():
    """``top_heads``' docstring: a head that never fired (``z > 0`` nowhere) is not listed, even where ``n`` asks for
    more; the others best first by their largest activation."""
    z = torch.tensor([[[0.5, -1.0, 2.0, 0.0], [0.25, -0.5, 1.0, -3.0]]])  # head 1 and 3 never > 0
    top = TopActivations.empty(4, 2)
    top.update(z, first_window=0)
    assert top.top_heads(4) == [2, 0]
    assert top.top_heads(1) == [2]
