"""A NaN or inf in an edge row stored sparse (a feature budget, ``keep_mass < 1``) is a named error, not an entry
dropped with no word (``|NaN| > 0`` is false: ``SparseRows.append`` used to leave it out of the row)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nnsight_lorsa.attribution.rows import SparseRows
from nnsight_lorsa.errors import NonFiniteError


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 4), n=st.integers(2, 40), seed=st.integers(0, 2**16),
       bad=st.sampled_from([float("nan"), float("inf"), float("-inf")]),
       keep_mass=st.sampled_from([None, 1.0, 0.9, 0.5]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]))
def test_a_non_finite_edge_is_refused_and_nothing_of_its_batch_is_stored(b, n, seed, bad, keep_mass, dtype):
    g = torch.Generator().manual_seed(seed)
    store = SparseRows(n)
    first = torch.randn(2, n, generator=g).to(dtype)
    store.append(first, keep_mass, rows=[10, 11])
    before = (store.n_rows, store.nnz, len(store.blocks), store.blocks[-1].fill, store.residual.clone(),
              store.abs_total.clone())
    grads = torch.randn(b, n, generator=g).to(dtype)
    r, c = int(torch.randint(b, (1,), generator=g)), int(torch.randint(n, (1,), generator=g))
    grads[r, c] = bad
    rows = list(range(100, 100 + b))
    with pytest.raises(NonFiniteError, match=rf"target rows \[{rows[r]}\]") as err:
        store.append(grads, keep_mass, rows=rows)
    assert err.value.tensor == "edges"
    after = (store.n_rows, store.nnz, len(store.blocks), store.blocks[-1].fill)
    assert after == before[:4]
    assert torch.equal(store.residual, before[4]) and torch.equal(store.abs_total, before[5])
    # the finite rows of the same batch go in as before
    store.append(torch.where(torch.isfinite(grads), grads, torch.zeros((), dtype=dtype)), keep_mass, rows=rows)
    assert store.n_rows == 2 + b


def test_finite_rows_are_stored_as_before():
    store = SparseRows(5)
    store.append(torch.tensor([[0.0, 1.0, -2.0, 0.0, 3.0]]), None)
    assert store.nnz == 3 and store.n_rows == 1 and float(store.abs_total[0]) == 6.0
