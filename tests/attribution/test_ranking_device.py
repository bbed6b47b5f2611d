"""The feature budget's ranking pass on the device the rows were computed on (:meth:`.rows.SparseRows.weighted_abs`,
:meth:`.rows.SparseRows.pass_device`): one scatter-add per row there instead of the host's serial ``index_add_``,
each column's terms added in storage order as on the host — the same bits, the same ranking, the same graph
(issue 21, goal 4(d): the host pass was 77 % of the 8B-shaped all-layer call at 1024 tokens and 512 feature rows on
an H200, 2026-11-27).

On the CPU the per-row pass runs on ``torch.device("cpu", 0)`` (a device that is not the host object, so the
dispatch takes it); the ``gpu`` cases run it on CUDA."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import DEVICES, attribution_replacement_on, random_ids
from hypothesis import given, settings
from hypothesis import strategies as st

from nnsight_lorsa.attribution import attribute, estimate_memory
from nnsight_lorsa.attribution.rows import HOST, SparseRows

ROWS = sys.modules["nnsight_lorsa.attribution.rows"]
#: the per-row pass on the CPU: a device that compares unequal to the host
CPU0 = torch.device("cpu", 0)


def stored(seed: int, n_rows: int, n_cols: int, zero_frac: float, dtype: torch.dtype, per_batch: int = 4,
           device: str = "cpu") -> SparseRows:
    g = torch.Generator().manual_seed(seed)
    grads = torch.randn(n_rows, n_cols, generator=g, dtype=torch.float64)
    grads[torch.rand(grads.shape, generator=g) < zero_frac] = 0
    rows = SparseRows(n_cols)
    for b in range(0, n_rows, per_batch):
        rows.append(grads[b:b + per_batch].to(device=device, dtype=dtype))
    return rows


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), n_rows=st.integers(1, 12), n_cols=st.integers(1, 400),
       zero_frac=st.floats(0.0, 1.0), dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       with_den=st.booleans(), masked=st.booleans(), chunk=st.sampled_from([3, 7, 2**22]),
       host_chunk=st.sampled_from([5, 2**18]), reuse_out=st.booleans())
def test_the_per_row_pass_is_the_host_pass_bit_for_bit(seed, n_rows, n_cols, zero_frac, dtype, with_den, masked,
                                                       chunk, host_chunk, reuse_out):
    """Generated rows (zeros, zero weights, a denominator or none, a column mask, steps of a few entries or whole
    rows): the per-row pass gives the host pass's bits, into a given ``out`` too."""
    rows = stored(seed, n_rows, n_cols, zero_frac, dtype)
    g = torch.Generator().manual_seed(seed + 1)
    scale = torch.rand(n_rows, generator=g, dtype=torch.float64)
    scale[torch.rand(n_rows, generator=g) < 0.3] = 0
    den = torch.rand(n_rows, generator=g, dtype=torch.float64) + 0.5 if with_den else None
    col_mask = torch.rand(n_cols, generator=g) < 0.6 if masked else None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ROWS, "DEVICE_CHUNK_ENTRIES", chunk)
        mp.setattr(ROWS, "CHUNK_ENTRIES", host_chunk)
        want = rows.weighted_abs(scale, col_mask, den)
        mp.setattr(SparseRows, "pass_device", lambda self: CPU0)
        out = torch.full((n_cols,), 7.0, dtype=torch.float64) if reuse_out else None
        got = rows.weighted_abs(scale, col_mask, den, out)
    assert torch.equal(got, want) and got.device == HOST
    assert out is None or got is out


def test_the_pass_runs_where_the_rows_were_computed_when_they_are_long(monkeypatch):
    """The rule: the host for rows computed on the CPU (or ``meta``, or MPS: no float64, or a CUDA device this process
    lacks: rows back from a remote server); the CUDA device where they hold :data:`DEVICE_ROW_ENTRIES` entries or
    more each on average."""
    rows = stored(0, 6, 50, 0.0, torch.float32)
    assert rows.device == HOST and rows.pass_device() == HOST
    monkeypatch.setattr(ROWS, "DEVICE_ROW_ENTRIES", 1)
    assert rows.pass_device() == HOST  # computed on the CPU
    cuda = torch.device("cuda", 0)
    rows.device = cuda
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # rows computed remotely, back on a CPU client
    assert rows.pass_device() == HOST
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert rows.pass_device() == cuda
    rows.device = torch.device("cuda", 1)  # a device this process does not have
    assert rows.pass_device() == HOST
    rows.device = cuda
    monkeypatch.setattr(ROWS, "DEVICE_ROW_ENTRIES", rows.nnz // rows.n_rows + 1)  # one more than their average
    assert rows.pass_device() == HOST
    monkeypatch.setattr(ROWS, "DEVICE_ROW_ENTRIES", 1)
    for other in ("meta", "mps"):  # a remote model's copy; a device without float64
        rows.device = torch.device(other)
        assert rows.pass_device() == HOST, other
    assert SparseRows(5).pass_device() == HOST  # nothing stored


@pytest.mark.parametrize("device", DEVICES)
def test_a_budgeted_graph_ranked_on_the_device_is_the_host_ranked_graph(device, monkeypatch):
    """``attribute`` with a feature budget whose every ranking pass runs per row on the device (on the CPU: on
    ``cpu:0``) gives the graph of the host's pass bit for bit — the same feature rows, the same edges — and the
    estimate on a device counts the pass's bytes."""
    rep = attribution_replacement_on(device)
    ids = random_ids(1, 10, seed=3)[0]
    kw = {"batch_size": 3, "max_feature_nodes": 12}
    host = attribute(rep, ids, **kw)
    monkeypatch.setattr(ROWS, "DEVICE_ROW_ENTRIES", 1)
    monkeypatch.setattr(ROWS, "DEVICE_CHUNK_ENTRIES", 17)
    used: list[torch.device] = []
    real = SparseRows._weighted_abs_on

    def on(self, where, *args):
        used.append(where)
        return real(self, where, *args)

    monkeypatch.setattr(SparseRows, "_weighted_abs_on", on)
    if device == "cpu":
        monkeypatch.setattr(SparseRows, "pass_device", lambda self: CPU0)
    ranked = attribute(rep, ids, **kw)
    assert used and {d.type for d in used} == {device}
    assert torch.equal(ranked.feature_ids, host.feature_ids)
    assert all(torch.equal(a, b) for a, b in zip(ranked.coo(), host.coo(), strict=True))
    terms = estimate_memory(rep, ids, **kw).terms
    assert (terms["ranking_device"] > 0) == (device != "cpu")
    assert terms["ranking_device"] <= terms["frozen_shared"]
