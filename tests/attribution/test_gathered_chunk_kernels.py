"""Kernels per chunk of the gathered node writes and reads (``frozen.GatheredNodes``: every Lorsa and transcoder site
at the Llama-3.1-8B shape, where a 4096-token Lorsa site is 64 chunks a pass on a GPU). Each chunk's product lands in
a positions-first output (``bmm(out=)``), so a chunk dispatches its rows' gather, its casts and its product only —
until 2026-11-27 a read also reshaped and copied each chunk's product, a write copied it (4.3 → 2.8 kernels a chunk,
bf16 site at 4096 tokens, write and read, forward and backward: docs/attribution.md). Also: the results are the
grid path's at every chunk size (hypothesis), in fp32 and bf16."""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import nnsight_lorsa.attribution.frozen as frozen

#: operators that launch no kernel (views, metadata)
VIEWS = {"view", "_unsafe_view", "slice", "transpose", "t", "expand", "select", "as_strided", "alias", "detach",
         "unsqueeze", "squeeze", "permute", "is_pinned", "_reshape_alias"}


class _Kernels(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _site(P: int, k: int, d: int, dtype: torch.dtype, identity: bool = True):
    g = torch.Generator().manual_seed(0)
    W = torch.randn(64, d, generator=g).to(dtype)
    pos = torch.arange(P).repeat_interleave(k)
    if not identity:  # one node fewer at every other position: the scattered grid
        pos = pos[(torch.arange(pos.numel()) % (2 * k)) != 0]
    idx = torch.randint(0, 64, (pos.numel(),), generator=g)
    return W, idx, pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_chunk_dispatches_its_gather_cast_and_product_only(monkeypatch, dtype):
    P, k, d, b = 32, 4, 8, 3
    W, idx, pos = _site(P, k, d, dtype)
    monkeypatch.setattr(frozen, "node_chunk_elements", lambda device: max(k, b) * d * 2)  # 2 positions a chunk
    chunks = P // 2
    nodes = frozen.GatheredNodes(W, idx, frozen.PositionSlots(pos, P), dtype)
    assert nodes.slots.identity
    coeff = torch.randn(b, P * k).requires_grad_(True)
    x = torch.randn(b, P, d).to(dtype).requires_grad_(True)
    written, read = nodes.write(coeff), nodes.read(x)  # the slots' host read of the counts, outside the count
    for out in (written, read):
        with _Kernels() as mode:
            out = nodes.write(coeff) if out is written else nodes.read(x)
            out.backward(torch.ones_like(out))
        per_chunk = {op: n / chunks for op, n in mode.counts.items() if n >= chunks}
        # each pass (forward, backward): the rows' gather and one product a chunk, the write's fp32 grid cast in bf16
        assert per_chunk.pop("index") == 2 and per_chunk.pop("bmm") == 2, mode.counts
        casts = per_chunk.pop("_to_copy", 0)
        assert casts <= (2 if dtype == torch.bfloat16 else 0), mode.counts
        assert not per_chunk, mode.counts  # no reshape, copy or clone a chunk


@settings(max_examples=25, deadline=None)
@given(P=st.integers(1, 9), k=st.integers(1, 4), d=st.integers(1, 6), b=st.integers(1, 3),
       chunk=st.integers(1, 200), identity=st.booleans(), bf16=st.booleans())
def test_gathered_writes_and_reads_are_the_grid_path_at_every_chunk_size(P, k, d, b, chunk, identity, bf16):
    dtype = torch.bfloat16 if bf16 else torch.float32
    W, idx, pos = _site(P, k, d, dtype, identity)
    slots = frozen.PositionSlots(pos, P)
    grid = frozen.GridNodes(slots, slots.grid(W[idx]))
    g = torch.Generator().manual_seed(1)
    coeff = torch.randn(b, idx.numel(), generator=g).to(dtype)
    x = torch.randn(b, P, d, generator=g).to(dtype)
    old = frozen.node_chunk_elements
    frozen.node_chunk_elements = lambda device: chunk  # type: ignore[assignment]
    try:
        nodes = frozen.GatheredNodes(W, idx, slots, dtype)
        written, read = nodes.write(coeff), nodes.read(x)
    finally:
        frozen.node_chunk_elements = old  # type: ignore[assignment]
    # fp32: the positions-first sums seen as (batch, pos, d), no copy; bf16: rounded by one copy, contiguous
    assert written.shape == (b, P, d) and written.dtype == dtype and (written.is_contiguous() or not bf16)
    assert read.shape == (b, idx.numel()) and read.is_contiguous()
    # the grid path sums a position's nodes in the coefficients' dtype; the gathered one in fp32, rounded once
    ref_w = frozen.GridNodes(slots, grid.grid.float()).write(coeff.float()).to(dtype)
    torch.testing.assert_close(written, ref_w, rtol=0, atol=0) if not bf16 else torch.testing.assert_close(
        written.float(), ref_w.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(read.float(), grid.read(x).float(), rtol=0 if not bf16 else 1e-2,
                               atol=0 if not bf16 else 1e-2)
