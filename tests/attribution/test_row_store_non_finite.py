"""A NaN or inf in an edge row is a named error on every storage path of :class:`RowStore` — the full graph's
blocks (:class:`BlockAdjacency`, the default), a dense matrix (the QK probes' :class:`FixedRows`) and sparse rows
(a budget, ``keep_mass``) — with the same message, before anything of the batch is stored (``done`` included).
The block and dense paths stored the NaN with no word until 2026-11-27 (a graph of NaN edges)."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from helpers import attribution_setup, random_ids, rm
from hypothesis import given, settings
from hypothesis import strategies as st

from nnsight_lorsa.attribution import PruneConfig, attribute
from nnsight_lorsa.attribution.blocks import BlockAdjacency
from nnsight_lorsa.attribution.rows import RowStore
from nnsight_lorsa.errors import NonFiniteError

TRACE = sys.modules["nnsight_lorsa.attribution.trace"]
BAD = st.sampled_from([float("nan"), float("inf"), float("-inf")])
DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64])


def _store(kind: str, n: int, n_rows: int) -> RowStore:
    """A store of ``kind`` for rows ``n … n + n_rows - 1`` (node ids after ``n`` sources: every source a bias-like
    node of site -1, so each row's block holds all ``n`` columns)."""
    if kind == "dense":
        return RowStore(n, dense_shape=(n + n_rows, n))
    if kind == "sparse":
        return RowStore(n, keep_mass=0.9)
    site = torch.cat([torch.full((n,), -1), torch.zeros(n_rows, dtype=torch.long)])
    pos = torch.cat([torch.zeros(n, dtype=torch.long), torch.arange(n_rows)])
    targets = torch.arange(n, n + n_rows)
    return RowStore(n, blocks=lambda dtype: BlockAdjacency(site, pos, n, targets, dtype))


def _snapshot(store: RowStore) -> tuple:
    _, m = store.matrix()
    return list(store.done), m.clone()


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["blocks", "dense", "sparse"]), b=st.integers(1, 4), n=st.integers(2, 30),
       seed=st.integers(0, 2**16), bad=BAD, dtype=DTYPES, n_bad=st.integers(1, 3))
def test_every_storage_path_refuses_a_non_finite_row_and_stores_nothing_of_its_batch(kind, b, n, seed, bad, dtype,
                                                                                     n_bad):
    g = torch.Generator().manual_seed(seed)
    store = _store(kind, n, 2 + b)
    store.record([n, n + 1], torch.randn(2, n, generator=g).to(dtype))
    before = _snapshot(store)
    grads = torch.randn(b, n, generator=g).to(dtype)
    rs = torch.randint(b, (n_bad,), generator=g)
    cs = torch.randint(n, (n_bad,), generator=g)
    grads[rs, cs] = bad
    rows = list(range(n + 2, n + 2 + b))
    named = sorted({rows[int(r)] for r in rs})
    message = rf"edge rows of target rows {re.escape(str(named))} hold NaN or inf \(computed in {dtype}.*nothing of "
    with pytest.raises(NonFiniteError, match=message + "this batch was stored") as err:
        store.record(rows, grads)
    assert err.value.tensor == "edges"
    after = _snapshot(store)
    assert after[0] == before[0]
    assert torch.equal(after[1], before[1])
    # the same batch made finite goes in as before
    store.record(rows, torch.where(torch.isfinite(grads), grads, torch.zeros((), dtype=dtype)))
    assert store.done == [n, n + 1, *rows]


@pytest.mark.parametrize("path", ["blocks", "sparse", "dense"])
def test_attribute_and_the_qk_probes_refuse_a_non_finite_edge_row(monkeypatch, path):
    """Through a real call: a NaN put into one batch's edge rows (as an fp16 backward past 65504 makes them) on their
    way from the backward to the store ends the call in the same NonFiniteError, on each storage path."""
    from nnsight_lorsa.attribution.qk import qk_attribution

    model, _, lorsas, tcs = attribution_setup("llama")
    ids = random_ids(1, 8, seed=2)[0]
    record = TRACE._record
    calls = []

    def poisoned(scheduler, rows, grad):
        calls.append(rows)
        if len(calls) == 2:
            grad = grad.clone()
            grad[0, 0] = float("nan")
        record(scheduler, rows, grad)

    monkeypatch.setattr(TRACE, "_record", poisoned)
    with pytest.raises(NonFiniteError, match=r"edge rows of target rows \[\d+\] hold NaN") as err:
        if path == "dense":
            qk_attribution(rm(model, lorsas, tcs), ids, layer=1, head=37, query_pos=6, key_pos=2, batch_size=4)
        else:
            attribute(rm(model, lorsas, tcs), ids, batch_size=4,
                      **({"prune": PruneConfig(keep_mass=0.99)} if path == "sparse" else {}))
    assert err.value.tensor == "edges" and len(calls) == 2
