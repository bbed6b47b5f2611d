"""The feature budget's stored rows kept on the device for the ranking pass (:class:`.rows.SparseRows`'
``mirror_bytes``; :func:`.budget.ranking_mirror`): each ranking read every stored entry over from the host — from
pageable memory, ~5.7 GB/s on an H200, 35.5 s of a 63.3 s call with the paper's Lorsa on all 32 layers of the 8B
shape at 1024 tokens and 512 feature rows (2026-11-27; issue 21, docs/attribution.md).

On the CPU the device copy is faked: :func:`.rows.mirrors` answers True for the CPU and the pass runs per row on
``cpu:0`` (as in ``test_ranking_device.py``); the ``gpu`` case keeps the copies on CUDA."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import DEVICES, attribution_replacement_on, random_ids
from hypothesis import given, settings
from hypothesis import strategies as st

import nnsight_lorsa.attribution.budget as budget
from nnsight_lorsa.attribution import attribute, estimate_memory
from nnsight_lorsa.attribution.budget import MemoryEstimate, ranking_mirror
from nnsight_lorsa.attribution.offload import FREE_MEMORY_MARGIN
from nnsight_lorsa.attribution.rows import HOST, SparseRows

ROWS = sys.modules["nnsight_lorsa.attribution.rows"]
CPU0 = torch.device("cpu", 0)
CUDA0 = torch.device("cuda", 0)


def batches(seed: int, n_rows: int, n_cols: int, zero_frac: float, dtype: torch.dtype, per_batch: int
            ) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    grads = torch.randn(n_rows, n_cols, generator=g, dtype=torch.float64)
    grads[torch.rand(grads.shape, generator=g) < zero_frac] = 0
    return [grads[b:b + per_batch].to(dtype) for b in range(0, n_rows, per_batch)]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), n_rows=st.integers(1, 14), n_cols=st.integers(1, 300),
       zero_frac=st.floats(0.0, 1.0), dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       per_batch=st.integers(1, 5), budget_frac=st.floats(0.0, 1.2), with_den=st.booleans(),
       masked=st.booleans(), chunk=st.sampled_from([3, 7, 2**22]))
def test_the_kept_rows_are_read_on_the_device_and_give_the_host_bits(seed, n_rows, n_cols, zero_frac, dtype,
                                                                    per_batch, budget_frac, with_den, masked,
                                                                    chunk):
    """Generated batches appended with a drawn ``mirror_bytes``: the batches kept are the first ones whose bytes fit
    it (``mirrored_bytes`` their sum, ≤ the budget); the ranking pass reads them on the device — the host store's
    values of the kept rows overwritten with garbage afterwards change nothing, where the host pass does read the
    garbage — and gives the host pass's bits, also after :meth:`drop_mirror` (then from the host again)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ROWS, "mirrors", lambda device: True)
        mp.setattr(ROWS, "DEVICE_CHUNK_ENTRIES", chunk)
        parts = batches(seed, n_rows, n_cols, zero_frac, dtype, per_batch)
        entry = 4 + torch.empty(0, dtype=dtype).element_size()
        sizes = [int((p != 0).sum()) * entry for p in parts]
        allowed = int(budget_frac * sum(sizes))
        plain, kept = SparseRows(n_cols), SparseRows(n_cols, mirror_bytes=allowed)
        for p in parts:
            plain.append(p)
            kept.append(p)
        want_kept = sum(sizes[:kept_batches(sizes, allowed)])
        assert kept.mirrored_bytes == want_kept <= max(allowed, 0)
        g = torch.Generator().manual_seed(seed + 1)
        scale = torch.rand(kept.n_rows, generator=g, dtype=torch.float64)
        scale[torch.rand(kept.n_rows, generator=g) < 0.3] = 0
        den = torch.rand(kept.n_rows, generator=g, dtype=torch.float64) + 0.5 if with_den else None
        col_mask = torch.rand(n_cols, generator=g) < 0.6 if masked else None
        want = plain.weighted_abs(scale, col_mask, den)
        mp.setattr(SparseRows, "pass_device", lambda self: CPU0)
        saved = [block.val.clone() for block in kept.blocks]
        for block in kept.blocks:  # the host copies of the kept entries: garbage (the device's must be what is read)
            for start, col, _ in block.mirror:
                block.val[start:start + col.numel()] = 1e4
        got = kept.weighted_abs(scale, col_mask, den)
        assert torch.equal(got, want) and got.device == HOST
        assert torch.equal(kept.weighted_abs(scale, col_mask, den), want)  # the kept values left as they were
        mp.setattr(SparseRows, "pass_device", lambda self: HOST)
        seen = torch.ones(n_cols, dtype=torch.bool) if col_mask is None else col_mask
        read_kept = any(bool(scale[r].ne(0)) and bool((p[i].ne(0) & seen).any())  # a kept entry the pass reads
                        for r, (p, i) in enumerate((p, i) for p in parts[:kept_batches(sizes, allowed)]
                                                   for i in range(p.shape[0])))
        assert torch.equal(kept.weighted_abs(scale, col_mask, den), want) != read_kept  # the host reads the garbage
        for block, val in zip(kept.blocks, saved, strict=True):
            block.val.copy_(val)
        kept.drop_mirror()
        assert all(not b.mirror for b in kept.blocks) and kept.mirrored_bytes == want_kept
        mp.setattr(SparseRows, "pass_device", lambda self: CPU0)
        assert torch.equal(kept.weighted_abs(scale, col_mask, den), want)  # from the host again


def kept_batches(sizes: list[int], allowed: int) -> int:
    """How many of the first batches fit ``allowed`` (the kept prefix)."""
    total = 0
    for n, size in enumerate(sizes):
        if total + size > allowed:
            return n
        total += size
    return len(sizes)


def test_no_copy_is_kept_off_cuda_or_without_a_budget():
    """The rule (:func:`.rows.mirrors`): only batches computed on a CUDA device are kept; ``mirror_bytes=0`` (the
    default) keeps none."""
    part = batches(0, 4, 20, 0.0, torch.float32, 4)[0]
    for rows in (SparseRows(20, mirror_bytes=10**9), SparseRows(20)):
        rows.append(part)
        assert rows.mirrored_bytes == 0 and not rows.blocks[0].mirror
    assert ROWS.mirrors(CUDA0) and not ROWS.mirrors(HOST) and not ROWS.mirrors(torch.device("meta"))


def estimate(device_bytes: int, entries: int) -> MemoryEstimate:
    return MemoryEstimate(10**9, device_bytes, 4, {"stored_entries": entries})


@settings(max_examples=60, deadline=None)
@given(device_bytes=st.integers(0, 10**10), entries=st.integers(0, 10**9), cap=st.none() | st.integers(1, 2 * 10**10),
       free=st.none() | st.integers(0, 2 * 10**10), itemsize=st.sampled_from([2, 4, 8]), ranked=st.booleans())
def test_the_mirror_budget_is_the_plans_slack_up_to_the_stored_entries(device_bytes, entries, cap, free, itemsize,
                                                                       ranked):
    """``ranking_mirror``: with ``max_memory`` the cap less the call's device estimate, without it the device's free
    bytes over the margin less it, at most the stored entries' bytes and never below 0; 0 without a budget, off
    CUDA, or without a free-memory answer."""
    est = estimate(device_bytes, entries)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(budget, "device_free_bytes", lambda device: free)
        got = ranking_mirror(est, CUDA0, ranked=ranked, max_memory=cap, edge_itemsize=itemsize)
    room = cap if cap is not None else None if free is None else int(free / FREE_MEMORY_MARGIN)
    want = 0 if not ranked or room is None else max(0, min(room - device_bytes, entries * (4 + itemsize)))
    assert got == want
    assert ranking_mirror(est, HOST, ranked=ranked, max_memory=cap, edge_itemsize=itemsize) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_budgeted_graph_ranked_on_kept_rows_is_the_host_ranked_graph(device, monkeypatch):
    """``attribute`` with a feature budget whose stored rows keep a device copy (on the CPU: faked, the pass on
    ``cpu:0``; with ``max_memory`` on the CPU, the host's budget, so that the plan has a slack) gives the graph of the
    host's pass bit for bit, says what it kept (``meta["ranking_mirror_bytes"]``, > 0, within the plan's
    ``ranking_mirror``) and frees it; ``estimate_memory`` counts the plan's copy in ``device_bytes``."""
    rep = attribution_replacement_on(device)
    ids = random_ids(1, 10, seed=3)[0]
    kw = {"batch_size": 3, "max_feature_nodes": 12}
    monkeypatch.setattr(ROWS, "DEVICE_ROW_ENTRIES", 1)
    host = attribute(rep, ids, **kw)  # on CUDA the copy is kept here too: compared with a run that keeps none below
    if device == "cpu":
        monkeypatch.setattr(ROWS, "mirrors", lambda d: True)
        monkeypatch.setattr(budget, "mirrors", lambda d: True)
        monkeypatch.setattr(SparseRows, "pass_device", lambda self: CPU0)
        kw["max_memory"] = 2**40
    else:
        none = attribute(rep, ids, max_memory=estimate_memory(rep, ids, **kw).device_bytes
                         - estimate_memory(rep, ids, **kw).terms["ranking_mirror"], **kw)
        assert none.meta["ranking_mirror_bytes"] == 0
        assert torch.equal(none.feature_ids, host.feature_ids)
        assert all(torch.equal(a, b) for a, b in zip(none.coo(), host.coo(), strict=True))
    kept: list[SparseRows] = []
    real = SparseRows._weighted_abs_on

    def on(self, where, *args):
        kept.append(self)
        return real(self, where, *args)

    monkeypatch.setattr(SparseRows, "_weighted_abs_on", on)
    ranked = attribute(rep, ids, **kw)
    assert kept and ranked.meta["ranking_mirror_bytes"] > 0
    assert all(not b.mirror for rows in kept for b in rows.blocks)  # freed with the call
    assert torch.equal(ranked.feature_ids, host.feature_ids)
    assert all(torch.equal(a, b) for a, b in zip(ranked.coo(), host.coo(), strict=True))
    est = estimate_memory(rep, ids, **kw)
    assert 0 < ranked.meta["ranking_mirror_bytes"] <= est.terms["ranking_mirror"]
    no_budget = estimate_memory(rep, ids, batch_size=3)
    assert no_budget.terms["ranking_mirror"] == 0
