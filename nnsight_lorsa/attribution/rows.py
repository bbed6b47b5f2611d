"""Edge rows: which target rows to compute and in which order, how they are stored, and how they
become a :class:`.graph.Graph` (dense, or pruned while built).

*Schedule* (``max_feature_nodes``): logit rows come first; then, when the prompt has more active
features/heads than the budget, features are visited in order of their influence on the logits
estimated from the rows computed so far (circuit-tracer's influence-ordered selection,
``circuit_tracer/attribution/attribute.py``), re-estimated after every batch; otherwise every
feature row is computed in node order (:class:`RowScheduler`).

*Storage*, as each batch of rows is computed (nothing per row kept twice): the full graph's rows go
straight into its adjacency, stored by causal blocks (:class:`.blocks.BlockAdjacency`: only the
entries that can be non-zero, ~20 % of ``n_nodes²`` on the embedded model); otherwise (a feature
budget, or pruning while building) into :class:`SparseRows` — 8 B per kept entry in large blocks — where a row keeps its
non-zero entries, or its largest ``|edges|`` up to a fraction ``keep_mass`` of its absolute mass;
the signed sum of the dropped entries is kept exactly as the row's ``residual``, so ``Σ kept +
residual`` still equals the target's value.

*Assembly*: :func:`assemble` (every visited feature and every error/embedding/bias/logit node; the adjacency
is the computed rows' causal blocks, :class:`.blocks.BlockAdjacency` — with a feature budget ``rows × sources``
at most, linear in the prompt's length, never a dense ``n_nodes²`` matrix) or :func:`assemble_pruned`: the
same influence pruning as :func:`.scores.prune` (circuit-tracer's rules, ``circuit_tracer/graph.py``) run on
the stored rows — node influence, node threshold, edge scores on the node-pruned matrix, edge threshold,
dangling features and errors removed — without ever holding a dense ``n_nodes²`` adjacency (the kept graph's is
its kept rows' causal blocks over its kept sources, as the unpruned one's, with or without a feature budget). On the
full graph's blocks these are :func:`.scores.prune`'s own calls on the same blocks (:func:`.scores.row_influence`,
:func:`.scores.prune_rows`), so the kept nodes are those of ``prune`` on the finished graph, bit for bit; on
:class:`SparseRows` the same calls on the store in place (its chunks, only the rows each step reads), so with every
non-zero entry stored (a feature budget) they keep the nodes and edges ``prune`` keeps on the budgeted graph
(tested).
Each kept target's edges from everything else (dropped sources and the entries a row did not keep) are summed into its
``residual``, so ``Σ adjacency[t] + residual[t]`` is still the target's value — a real check, since the values
come from the forward and the edges from the backward passes. torch only.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .._memory import release_free_memory
from .._typing import Float, Int
from ..errors import NonFiniteError
from .blocks import BlockAdjacency
from .graph import ATTN_ERROR, BIAS, EMBEDDING, HOST, LOGIT, MLP_ERROR, Graph
from .layout import Layout
from .scores import EntryRows, find_threshold, prune_rows, row_influence

#: entries per storage block of :class:`SparseRows` (int32 column + value: 64 MiB each at fp32): above
#: glibc's largest mmap threshold (32 MiB), so a block is mapped and unmapped whole and the stored rows
#: never sit in the heap between the per-batch temporaries (which then reuse the same heap space);
#: pages of a block not yet written are not resident
BLOCK_ENTRIES = 2**24


#: batches of rows between two :func:`release_free_memory` calls
TRIM_EVERY = 8
#: entries per step of the chunked passes over the stored rows (influence, pruning, assembly)
CHUNK_ENTRIES = 2**18
#: an influence step multiplies a run of ≥ 3 rows with at most this many entries by one repeated weight vector
#: (128 KiB: a heap allocation, no fresh pages), a longer run row by row in place
SMALL_RUN_ENTRIES = 2**14
#: the influence steps' entries (:meth:`SparseRows.restricted`) are found by a binary search in each row of a storage
#: block whose rows hold at least this many entries per searched column (a search's reads, ~log2 of a row, and its
#: per-row calls), else by one pass over the block
SEARCH_READS = 64
#: the feature budget's ranking pass (:meth:`SparseRows.weighted_abs`) runs on the CUDA device the rows were computed
#: on when the stored rows hold at least this many entries each on average: one scatter-add per row there
#: instead of the host's serial ``index_add_`` (~3 ns an entry: 3.5 s a ranking, 77 % of the call, with the paper's
#: Lorsa on every layer of the 8B shape at 1024 tokens and 512 feature rows on an H200, 2026-11-27)
DEVICE_ROW_ENTRIES = 2**16
#: entries copied to the device per step of that pass (int32 column + value, their float64 terms: 64 MiB at fp32)
DEVICE_CHUNK_ENTRIES = 2**22


def mirrors(device: torch.device) -> bool:
    """Whether rows computed on ``device`` may keep a device copy for the ranking pass (:class:`SparseRows`'
    ``mirror_bytes``): a CUDA device (where :meth:`SparseRows.pass_device` sums; the rows' own device, so this process
    has it)."""
    return device.type == "cuda"


def refuse_non_finite_rows(row_sums: Float[torch.Tensor, " b"], rows: list[int], dtype: torch.dtype
                           ) -> Float[torch.Tensor, " b"]:
    """``row_sums`` (one value per edge row of a batch, on the rows' device, NaN / inf iff the row holds one: its
    ``Σ |edges|`` in float64, or its largest ``|edge|``) copied to the host — one ``(b,)`` device read — and
    checked there. Every storage path of :class:`RowStore` calls it before it stores anything of the batch.

    Raises:
        NonFiniteError: a row's value is NaN / inf (``tensor="edges"``); the message names the target ``rows`` whose
            edges hold one and ``dtype``, what they were computed in.
    """
    host = row_sums.to(HOST)
    bad = ~torch.isfinite(host)
    if bool(bad.any()):  # a host tensor: no device read
        named = [rows[i] for i in bad.nonzero().flatten().tolist()]
        raise NonFiniteError(
            f"attribute: the edge rows of target rows {named[:8]}{' …' if len(named) > 8 else ''} hold NaN or inf "
            f"(computed in {dtype}; an fp16 frozen pass overflows past 65504: attribute(..., "
            f"dtype=torch.float32)); nothing of this batch was stored", tensor="edges")
    return host


def add_in_order(total: Float[torch.Tensor, " 1"], run: Float[torch.Tensor, " m"], n: int) -> None:
    """``total += run[1] + run[2] + … + run[n]``, one addition at a time in that order: the entries' sequential
    float64 sum, as ``index_add_`` of them into one place adds them (the bits of every residual and row mass the
    stored rows' passes sum). ``total: (1,)`` and ``run: (≥ n + 1,)`` float64 on the host, the entries at ``run[1:n +
    1]``; ``run[0]`` is overwritten with ``total`` and ``run[:n + 1]`` with the running sums. A host ``cumsum`` is one
    sequential scan (``cpu_cum_base_kernel``, from +0.0: a ``total`` of -0.0 is set back where every entry is -0.0),
    its last running sum the ``index_add_``'s result bit for bit
    (``tests/attribution/test_add_in_order.py``): a chunk of 2**18 entries copied in and summed at 1.0-1.6 ns an entry
    against 2.4-2.9 for the ``index_add_`` (``python -m benchmarks.sequential_sums``)."""
    # the scan's sums start from +0.0 (its first is ``0 + total``): a total of -0.0 comes out +0.0 where every entry is
    # -0.0 too (the sequential sum stays -0.0), and is the same number anywhere else (one host read of ``total``)
    start = float(total)
    stays_negative_zero = start == 0.0 and math.copysign(1.0, start) < 0 and bool(
        torch.signbit(run[1:n + 1]).logical_and_(run[1:n + 1] == 0).all())
    run[:1].copy_(total)
    run[:n + 1].cumsum_(0)
    total.copy_(run[n:n + 1])
    if stays_negative_zero:
        total.fill_(-0.0)


@dataclass
class _Block:
    """Consecutive rows of a :class:`SparseRows`: ``col``/``val`` filled up to ``fill``; row
    ``row_start + i`` holds entries ``[ends[i-1], ends[i])`` (``ends[-1] = 0``)."""

    col: torch.Tensor
    val: torch.Tensor
    row_start: int
    fill: int = 0
    ends: list[int] = field(default_factory=list)
    #: device copies of some of its batches (:class:`SparseRows`' ``mirror_bytes``): ``(entry start, col, val)``,
    #: each batch's entries ``[start, start + len(col))``, in storage order; ``mirror_starts`` their starts
    mirror: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    mirror_starts: list[int] = field(default_factory=list)

    def mirrored(self, start: int, end: int) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """The device copy holding entries ``[start, end)`` (one row's: a batch's rows are copied whole), or None."""
        i = bisect.bisect_right(self.mirror_starts, start) - 1
        if i < 0:
            return None
        s0, col, val = self.mirror[i]
        return (s0, col, val) if end <= s0 + col.numel() else None


class SparseRows:
    """Edge rows stored sparse as they are computed (CSR in large blocks, 8 B per kept entry at fp32:
    int32 source column + value).

    A row keeps its non-zero entries, or with ``keep_mass < 1`` its largest ``|edges|`` up to that
    fraction of the row's absolute mass; the signed sum of the dropped ones is the row's ``residual``
    (float64, one reduction per row on the rows' device: the same bits run to run, also on CUDA), and
    ``abs_total`` (float64) is the full row's ``Σ |edges|`` (for row normalisation). Everything that reads
    the rows goes through :meth:`chunks`, at most :data:`CHUNK_ENTRIES` entries at a time: no per-entry
    temporary of the whole store exists.

    A feature budget's ranking reads every stored entry at each ranking (:meth:`weighted_abs`); on a CUDA device that
    pass copies each entry over from the host every time (pageable memory: ~5.7 GB/s on an H200, 203 GB over a
    512-row call at the 8B shape's 1024 tokens, 2026-11-27). With ``mirror_bytes > 0`` the batches computed on a
    CUDA device (:func:`mirrors`) keep their kept entries there too — the tensors :meth:`append` copies to the host
    anyway, no extra work — while they fit ``mirror_bytes`` (the first batches: once one does not fit, no later one
    is kept), and the pass reads those from the device. The sums are the same bits either way (the same terms in the
    same order); :meth:`drop_mirror` frees the copies.

    Args:
        n_cols: sources per row.
        mirror_bytes: device bytes the copies may take (int ≥ 0; 0: none kept). ``attribute`` gives what its memory
            plan leaves free on the model's device (:attr:`.budget.CallPlan.ranking_mirror`).
    """

    def __init__(self, n_cols: int, mirror_bytes: int = 0) -> None:
        self.n_cols = n_cols
        #: where the rows were computed (the first :meth:`append`'s ``grads``): the ranking pass's device
        self.device = HOST
        self.mirror_bytes = mirror_bytes
        #: bytes of the device copies kept (≤ ``mirror_bytes``)
        self.mirrored_bytes = 0
        self._mirror_open = mirror_bytes > 0
        self.blocks: list[_Block] = []
        self.n_rows = 0
        self.nnz = 0
        self._residual: list[torch.Tensor] = []
        self._abs_total: list[torch.Tensor] = []

    @property
    def residual(self) -> Float[torch.Tensor, " n"]:
        return torch.cat(self._residual) if self._residual else torch.zeros(0, dtype=torch.float64, device=HOST)

    @property
    def abs_total(self) -> Float[torch.Tensor, " n"]:
        return torch.cat(self._abs_total) if self._abs_total else torch.zeros(0, dtype=torch.float64, device=HOST)

    def append(self, grads: Float[torch.Tensor, "b s"], keep_mass: float | None = None,
               rows: list[int] | None = None) -> None:
        """Store ``grads`` as the next rows (``keep_mass`` None or ≥ 1: every non-zero entry). ``grads`` may
        be on the model's device: which entries to keep is decided there, the kept ones are copied to the host.

        Raises:
            NonFiniteError: a row holds NaN or inf (an fp16 frozen backward past 65504, a NaN in the model): it would
                have been dropped from the row (``|NaN| > 0`` is false) with no word — a wrong graph. Read from each
                row's ``Σ |edges|`` on the host, the copy made anyway (no extra device read;
                :func:`refuse_non_finite_rows`); nothing is stored. ``rows``: the batch's target rows, named in the
                message (None: the store's row numbers).
        """
        g = grads.detach()
        if not self.n_rows:
            self.device = g.device
        a = g.abs()
        abs_row = a.sum(1, dtype=torch.float64)  # on grads' device; NaN / inf iff a row holds one
        abs_total = refuse_non_finite_rows(
            abs_row, rows if rows is not None else list(range(self.n_rows, self.n_rows + g.shape[0])), g.dtype)
        if keep_mass is None or keep_mass >= 1.0:
            keep = a > 0
        else:
            srt, order = a.sort(dim=1, descending=True)
            cum = srt.double().cumsum(1)
            keep_sorted = ((cum - srt.double()) < keep_mass * abs_row[:, None]) & (srt > 0)
            keep = torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
        del a
        if keep_mass is None or keep_mass >= 1.0:  # every non-zero kept: nothing dropped, residual exactly 0
            self._residual.append(torch.zeros(g.shape[0], dtype=torch.float64, device=HOST))
        else:  # the dropped entries' sum: one reduction per row (deterministic on every device, unlike an
            # index_add of the kept ones, whose float64 atomics reorder between runs on CUDA)
            self._residual.append(torch.where(keep, 0, g).sum(1, dtype=torch.float64).to(HOST))
        # the kept entries' flat indices, row-major (each row's entries in column order): one 1-D nonzero, the values
        # a 1-D gather, each row's end a binary search, its columns its indices less the row's start in place (a 2-D
        # nonzero and a 2-D gather cost twice as much, measured: benchmarks/attribution_row_stages.py)
        flat = keep.reshape(-1).nonzero().squeeze(1)
        del keep
        b, n_cols = g.shape
        val = g.reshape(-1)[flat]
        row_ends = torch.arange(1, b + 1, dtype=torch.long, device=flat.device).mul_(n_cols)
        ends: list[int] = torch.searchsorted(flat, row_ends).tolist()  # the one host read of the batch's counts
        for i in range(1, b):
            flat[ends[i - 1]:ends[i]] -= i * n_cols
        # on the model's device: 4-byte columns cross to the host (a cross-device copy with a cast of the int64
        # indices would convert them on the host, after an 8-byte copy into a fresh temporary)
        c = flat if flat.device == HOST else flat.to(torch.int32)
        del flat
        self._abs_total.append(abs_total)
        n = int(val.numel())
        block = self.blocks[-1] if self.blocks else None
        if block is None or block.fill + n > block.col.numel() or block.val.dtype != val.dtype:
            cap = max(BLOCK_ENTRIES, n)
            block = _Block(torch.empty(cap, dtype=torch.int32, device=HOST),
                           torch.empty(cap, dtype=val.dtype, device=HOST), self.n_rows)
            self.blocks.append(block)
        # straight from the model's device into the block (no intermediate host copy: fresh pages per batch)
        block.col[block.fill:block.fill + n].copy_(c)
        block.val[block.fill:block.fill + n].copy_(val)
        if self._mirror_open and n:  # the device's own tensors kept for the ranking pass, while they fit
            size = n * (4 + val.element_size())  # int32 columns (on a device ``c`` is int32 already)
            if mirrors(val.device) and self.mirrored_bytes + size <= self.mirror_bytes:
                block.mirror.append((block.fill, c.to(torch.int32), val))
                block.mirror_starts.append(block.fill)
                self.mirrored_bytes += size
            else:
                self._mirror_open = False
        block.ends.extend(block.fill + e for e in ends)
        block.fill += n
        self.n_rows += g.shape[0]
        self.nnz += n

    def chunks(self, row_mask: torch.Tensor | None = None
               ) -> Iterator[tuple[Int[torch.Tensor, " k"], Int[torch.Tensor, " k"], Float[torch.Tensor, " k"]]]:
        """``(row (k,) int64, col (k,) int64, val (k,))`` of the stored entries, ≤ :data:`CHUNK_ENTRIES`
        at a time, in storage order; with ``row_mask: (n_rows,)`` bool, only those of its rows (the others are not
        read: a chunk holds runs of consecutive rows of the mask). After each storage block's chunks the heap's free
        pages are given back (:func:`release_free_memory`): else the freed chunk temporaries of a pass stay resident
        beside the stored rows (measured: the sparse pruning's resident-set peak 40.9 → 22.2 MB at 512 tokens,
        ``keep_mass=0.99``; allocated 8.2 MB either way)."""
        for block in self.blocks:
            if row_mask is None:
                spans: Iterator[tuple[int, int]] = (
                    (e0, min(e0 + CHUNK_ENTRIES, block.fill)) for e0 in range(0, block.fill, CHUNK_ENTRIES))
            else:
                live = row_mask[block.row_start:block.row_start + len(block.ends)].nonzero().flatten().tolist()
                if not live:  # none of its rows: not read, nothing to give back
                    continue
                spans = _spans(block.ends, live)
            for e0, e1 in spans:
                row = _rows_of(block.ends, e0, e1) + block.row_start
                yield row, block.col[e0:e1].long(), block.val[e0:e1]
            release_free_memory()

    def weighted_abs(self, scale: Float[torch.Tensor, " n"], col_mask: torch.Tensor | None = None,
                     den: torch.Tensor | None = None, out: torch.Tensor | None = None) -> Float[torch.Tensor, " s"]:
        """``Σ_r scale[r] · |row r|``: ``(n_cols,)`` float64 (with ``col_mask``, a bool over the columns, only
        the entries of its columns — the others' sums set to +0.0 at the end, what their terms times 0 add up to
        for finite entries, instead of a per-entry mask each step; with ``den: (n,)`` float64, each entry
        ``(|v| / den[r]) · scale[r]`` — the arithmetic of :func:`.scores.row_influence`'s steps on every storage).
        Reads only the rows with a non-zero ``scale`` (the others add exact zeros), each entry's term computed in
        float64 and accumulated in storage order; at most :data:`CHUNK_ENTRIES` entries at a time, in place in one
        float64 buffer made per call and reused by its chunks (a fresh multi-MB temporary per chunk costs its page
        faults, as much as the arithmetic; one held across calls would sit under the pruning's other passes).
        ``out``: an ``(n_cols,)`` float64 tensor to zero and fill (and return) instead of a fresh one — the influence
        series' steps reuse one (a fresh ``n_cols`` vector a step is its page faults: 39 ms against 14 ms for
        zeroing one at 6.3M columns, the 8B shape's all-layer graph, measured on CPU).

        Long rows computed on a CUDA device (:meth:`pass_device`) are summed there: each row's entries copied over
        (:data:`DEVICE_CHUNK_ENTRIES` at a time) and added by one scatter-add per row, whose columns are distinct —
        each column's terms added in storage order, as on the host: the same bits (the sums copied back to ``out``
        on the host); the rows kept there (``mirror_bytes``) are read in place, not copied. Device memory: ``n_cols``
        float64 and one step's entries (counted in the estimate's term ``ranking_device``)."""
        device = self.pass_device()
        if device != HOST:
            return self._weighted_abs_on(device, scale, col_mask, den, out)
        out = torch.zeros(self.n_cols, dtype=torch.float64, device=HOST) if out is None else out.zero_()
        buffer = torch.empty(min(CHUNK_ENTRIES, max(self.nnz, 1)), dtype=torch.float64, device=HOST)
        runs: list[tuple[int, int, float, float | None]] = []  # (entry start, end, scale, den) of consecutive rows
        at: _Block | None = None  # the block the runs are in (runs never span two)
        for block, start, end, w, d in self._weighted_rows(scale, den):
            for a in range(start, end, CHUNK_ENTRIES):  # a row longer than a chunk: in pieces
                b = min(a + CHUNK_ENTRIES, end)
                if runs and at is not None and (block is not at or runs[-1][1] != a or b - runs[0][0] > CHUNK_ENTRIES):
                    self._add_runs(out, at, runs, buffer)
                    runs = []
                at = block
                runs.append((a, b, w, d))
        if runs and at is not None:
            self._add_runs(out, at, runs, buffer)
        if col_mask is not None:  # the masked columns' sums (every term ``0 · x``: +0.0) — no per-entry mask
            out.masked_fill_(~col_mask, 0.0)
        return out

    def pass_device(self) -> torch.device:
        """Where :meth:`weighted_abs` sums: the rows' device (:attr:`device`) when it is a CUDA device (float64
        arithmetic; MPS has none) this process has — rows computed remotely come back to a client that may have
        none — and the rows hold :data:`DEVICE_ROW_ENTRIES` entries or more each on average (per-row steps pay
        off), else the host."""
        if self.device.type != "cuda" or self.nnz < DEVICE_ROW_ENTRIES * max(self.n_rows, 1):
            return HOST
        if not torch.cuda.is_available() or (self.device.index or 0) >= torch.cuda.device_count():
            return HOST
        return self.device

    def _weighted_abs_on(self, device: torch.device, scale: torch.Tensor, col_mask: torch.Tensor | None,
                         den: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
        """:meth:`weighted_abs` summed on ``device``, row by row (a row's columns are distinct: each scatter-add
        adds one term per column, in storage order across the rows — the host's bits)."""
        acc = torch.zeros(self.n_cols, dtype=torch.float64, device=device)
        for block, start, end, w, d in self._weighted_rows(scale, den):
            kept = block.mirrored(start, end)  # the row's entries kept on the device, or None: copied over
            for a in range(start, end, DEVICE_CHUNK_ENTRIES):
                b = min(a + DEVICE_CHUNK_ENTRIES, end)
                if kept is not None:
                    s0, kcol, kval = kept
                    col, val = kcol[a - s0:b - s0], kval[a - s0:b - s0]
                else:
                    col, val = block.col[a:b].to(device), block.val[a:b].to(device)
                contrib = val.to(torch.float64, copy=True).abs_()  # a fresh tensor: never the stored values
                if d is not None:
                    contrib.div_(d)
                acc.index_add_(0, col, contrib.mul_(w))
                del col, val, contrib
        out = torch.empty(self.n_cols, dtype=torch.float64, device=HOST) if out is None else out
        out.copy_(acc)
        if col_mask is not None:  # as on the host: the masked columns' sums +0.0
            out.masked_fill_(~col_mask, 0.0)
        return out

    def drop_mirror(self) -> None:
        """Free the device copies (:attr:`mirrored_bytes` stays, what was kept); later batches keep none."""
        for block in self.blocks:
            block.mirror.clear()
            block.mirror_starts.clear()
        self._mirror_open = False

    def restricted(self, cols: Int[torch.Tensor, " m"]) -> EntryRows:
        """The stored entries at the columns ``cols`` (``(m,)`` int64, ascending, unique) as an
        :class:`.scores.EntryRows` over ``m`` columns (an entry's column: its place in ``cols``), in storage order —
        what an influence step over those columns reads (:func:`.scores.row_influence` gathers them once per series
        and runs every step on them, where each step read the stored rows again: 8 passes over every entry per
        ranking on the small all-layer model). Rows holding at least :data:`SEARCH_READS` entries per column are
        binary-searched, each in its column-sorted entries; the others are read in one pass, a chunk at a time,
        through a column → place table (``int32 (n_cols,)``, made only then). Memory: the found entries (int64 row
        and place, the value; 8 B + the value each, int32 place) and the table."""
        m = int(cols.numel())
        rows: list[torch.Tensor] = []
        places: list[torch.Tensor] = []
        vals: list[torch.Tensor] = []
        cols32 = cols.to(torch.int32)
        table: torch.Tensor | None = None
        for block in self.blocks:
            n = len(block.ends)
            if not n or not m:
                continue
            if block.fill >= SEARCH_READS * m * n:  # long rows: a binary search of the m columns in each
                start = 0
                for i, end in enumerate(block.ends):
                    if end > start:
                        row_cols = block.col[start:end]
                        at = torch.searchsorted(row_cols, cols32).clamp_max_(end - start - 1)
                        hit = (row_cols[at] == cols32).nonzero().flatten()
                        rows.append(torch.full((hit.numel(),), block.row_start + i, dtype=torch.long, device=HOST))
                        places.append(hit)
                        vals.append(block.val[start:end][at[hit]])
                    start = end
                continue
            if table is None:
                table = torch.full((self.n_cols,), -1, dtype=torch.int32, device=HOST)
                table[cols] = torch.arange(m, dtype=torch.int32, device=HOST)
            ends = torch.tensor(block.ends, dtype=torch.long, device=HOST)
            for e0 in range(0, block.fill, CHUNK_ENTRIES):
                e1 = min(e0 + CHUNK_ENTRIES, block.fill)
                place = table.index_select(0, block.col[e0:e1])
                hit = (place >= 0).nonzero().flatten()
                rows.append(torch.searchsorted(ends, hit + e0, right=True).add_(block.row_start))
                places.append(place[hit].long())
                vals.append(block.val[e0:e1][hit])
        dtype = self.blocks[0].val.dtype if self.blocks else torch.float32
        if not rows:
            empty = torch.zeros(0, dtype=torch.long, device=HOST)
            return EntryRows(empty, empty, torch.zeros(0, dtype=dtype, device=HOST), self.n_rows, m)
        return EntryRows(torch.cat(rows), torch.cat(places), torch.cat(vals), self.n_rows, m)

    def _weighted_rows(self, scale: torch.Tensor, den: torch.Tensor | None
                       ) -> Iterator[tuple[_Block, int, int, float, float | None]]:
        """``(block, entry start, end, scale, den)`` of each stored row with a non-zero ``scale``, in storage order
        (Python floats: the same float64 values; ``den`` None: None)."""
        for block in self.blocks:
            s = scale[block.row_start:block.row_start + len(block.ends)]
            live = s.nonzero().flatten()
            if not live.numel():
                continue
            weights = s[live].tolist()
            dens = [None] * len(weights) if den is None else den[live + block.row_start].tolist()
            for i, w, d in zip(live.tolist(), weights, dens, strict=True):
                yield block, block.ends[i - 1] if i else 0, block.ends[i], w, d

    @staticmethod
    def _add_runs(out: torch.Tensor, block: _Block, runs: list[tuple[int, int, float, float | None]],
                  buffer: torch.Tensor) -> None:
        """``out[col] += (|val| / d) · w`` (or ``w · |val|``, ``d`` None) over contiguous runs ``(start, end, w, d)``
        of ``block``'s entries."""
        e0, e1 = runs[0][0], runs[-1][1]
        contrib = buffer[:e1 - e0]
        contrib.copy_(block.val[e0:e1]).abs_()
        with_den = runs[0][3] is not None
        if len(runs) >= 3 and e1 - e0 <= SMALL_RUN_ENTRIES:  # many short rows: one multiply by the repeated weights
            lengths = torch.tensor([b - a for a, b, _, _ in runs], dtype=torch.long, device=HOST)
            if with_den:
                dens = torch.tensor([d for _, _, _, d in runs], dtype=torch.float64, device=HOST)
                contrib.div_(torch.repeat_interleave(dens, lengths, output_size=e1 - e0))
            weights = torch.tensor([w for _, _, w, _ in runs], dtype=torch.float64, device=HOST)
            contrib.mul_(torch.repeat_interleave(weights, lengths, output_size=e1 - e0))
        else:  # long rows: in place, one multiply each (a per-entry weight vector would be a fresh large tensor)
            for a, b, w, d in runs:
                if d is not None:
                    contrib[a - e0:b - e0].div_(d)
                contrib[a - e0:b - e0].mul_(w)
        out.index_add_(0, block.col[e0:e1], contrib)

    def dense(self) -> Float[torch.Tensor, "n s"]:
        """The kept entries as a dense ``(n_rows, n_cols)`` matrix (dropped ones 0)."""
        dtype = self.blocks[0].val.dtype if self.blocks else torch.float32
        out = torch.zeros(self.n_rows, self.n_cols, dtype=dtype, device=HOST)
        for row, col, val in self.chunks():
            out[row, col] = val
        return out

    def row_sums(self) -> Float[torch.Tensor, " n"]:
        """``Σ kept + residual`` per row (float64): the full rows' sums."""
        out = torch.zeros(self.n_rows, dtype=torch.float64, device=HOST)
        for row, _, val in self.chunks():
            out.index_add_(0, row, val.double())
        return out + self.residual

    def abs_sums(self, col_mask: torch.Tensor | None = None, row_mask: torch.Tensor | None = None
                 ) -> Float[torch.Tensor, " n"]:
        """``(n_rows,)`` float64: each row's full absolute mass (:attr:`abs_total`, the dropped entries included), or
        with ``col_mask`` (bool over the columns) ``Σ |kept entries|`` of its columns, in storage order (with
        ``row_mask: (n_rows,)`` bool only its rows read, the others left 0). Row by row, :data:`CHUNK_ENTRIES` entries
        at a time in one float64 buffer: ``|v|`` times the column's mask (an entry of a left-out column adds +0.0,
        which leaves the running sum as it is) added one by one into the row's sum (:func:`add_in_order`: the same
        bits as the per-entry row index and masked copies of the former code, and as its ``index_add_`` to one
        place)."""
        if col_mask is None:
            return self.abs_total
        den = torch.zeros(self.n_rows, dtype=torch.float64, device=HOST)
        run = torch.empty(min(CHUNK_ENTRIES, max(self.nnz, 1)) + 1, dtype=torch.float64, device=HOST)
        for block in self.blocks:
            n = len(block.ends)
            live: Any = (range(n) if row_mask is None
                         else row_mask[block.row_start:block.row_start + n].nonzero().flatten().tolist())
            for i in live:
                start, end = block.ends[i - 1] if i else 0, block.ends[i]
                total = den[block.row_start + i:][:1]
                for e0 in range(start, end, CHUNK_ENTRIES):
                    e1 = min(e0 + CHUNK_ENTRIES, end)
                    run[1:e1 - e0 + 1].copy_(block.val[e0:e1]).abs_().mul_(col_mask[block.col[e0:e1]])
                    add_in_order(total, run, e1 - e0)
        return den

    def count_edges(self, col_mask: torch.Tensor, row_mask: torch.Tensor) -> int:
        """The stored non-zero entries between ``row_mask: (n_rows,)`` rows and ``col_mask: (n_cols,)`` columns
        (bool), counted a span of the mask's rows at a time (≤ :data:`CHUNK_ENTRIES` entries: one gather of the column
        mask, no row index; the former :meth:`chunks` pass made an int64 row and column index and three masks per
        entry)."""
        n = torch.zeros((), dtype=torch.long, device=HOST)
        for block in self.blocks:  # the mask's rows' spans: every stored entry is non-zero (``append``), so a span's
            live = row_mask[block.row_start:block.row_start + len(block.ends)].nonzero().flatten().tolist()
            for e0, e1 in _spans(block.ends, live):  # count is its columns' mask summed (no per-entry row index)
                n += col_mask[block.col[e0:e1]].sum()
        return int(n)

    def edge_scores(self, factor: Float[torch.Tensor, " n"], den: Float[torch.Tensor, " n"], col_mask: torch.Tensor,
                    row_mask: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(row (k,) int64, col (k,) int64, score (k,) float64)`` of the stored non-zero entries between
        ``row_mask`` rows and ``col_mask`` columns, score ``|v| / den[row] · factor[row]`` (``factor``, ``den``:
        ``(n_rows,)`` float64), in storage order, at most :data:`CHUNK_ENTRIES` entries at a time — the arithmetic
        of :meth:`.scores.EntryRows.edge_scores`, read in place (no copy of the entries; only the rows of the mask
        read). A span of the mask's rows at a time: one gather of the column mask, then only the entries it keeps —
        their positions, rows (a binary search per row end), columns and values (the former :meth:`chunks` pass, through
        :func:`.scores.scored_entries`, made an int64 row and column index and three masks for every entry, bit for
        bit the same scores)."""
        for block in self.blocks:
            live = row_mask[block.row_start:block.row_start + len(block.ends)].nonzero().flatten().tolist()
            if not live:
                continue
            for e0, e1 in _spans(block.ends, live):
                cols = block.col[e0:e1]
                hits = col_mask[cols].nonzero().squeeze(1)
                r0, r1 = bisect.bisect_right(block.ends, e0), bisect.bisect_right(block.ends, e1 - 1)
                bounds = torch.tensor(block.ends[r0:r1], dtype=torch.long, device=HOST).sub_(e0)
                counts = torch.searchsorted(hits, bounds).diff(prepend=hits.new_zeros(1),
                                                               append=hits.new_full((1,), hits.numel()))
                row = torch.repeat_interleave(torch.arange(r0 + block.row_start, r1 + 1 + block.row_start,
                                                           device=HOST), counts, output_size=hits.numel())
                val = block.val[e0:e1][hits]
                yield row, cols[hits].long(), val.abs().to(torch.float64).div_(den[row]).mul_(factor[row])
            release_free_memory()

    def influence(self, row_node: Int[torch.Tensor, " n"], row_weight: Float[torch.Tensor, " n"],
                  node_mask: torch.Tensor | None = None, max_iter: int = 1000) -> Float[torch.Tensor, " s"]:
        """:func:`.scores.row_influence` over the stored entries, each row normalised by its full absolute
        mass — or, with ``node_mask: (≥ n_cols,)`` bool, only over the entries between two nodes of the
        mask (source ``col`` and target ``row_node[row]``), each row normalised by those entries' mass.
        Chunked (:meth:`weighted_abs`, one :data:`CHUNK_ENTRIES` float64 buffer per step); float64."""
        if node_mask is not None and bool(node_mask.all()):
            node_mask = None  # every node: the full rows
        return row_influence(_SparseSource(self), row_node, row_weight, self.n_cols, node_mask, max_iter)


class _SparseSource:
    """:class:`SparseRows` as a :class:`.scores.RowSource` / :class:`.scores.PrunableRows` (rows are the store's;
    ``row_node`` maps them to nodes where the caller needs it)."""

    #: :meth:`weighted_abs` fills a given ``out`` (:func:`.scores.row_influence` reuses one vector for its steps)
    fills_out = True

    def __init__(self, rows: SparseRows) -> None:
        self.rows = rows

    def abs_sums(self, col_mask: torch.Tensor | None = None, row_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.rows.abs_sums(col_mask, row_mask)

    def weighted_abs(self, weight: torch.Tensor, den: torch.Tensor, col_mask: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        return self.rows.weighted_abs(weight, col_mask, den, out)

    def restricted(self, cols: torch.Tensor) -> EntryRows:
        return self.rows.restricted(cols)

    def count_edges(self, col_mask: torch.Tensor, row_mask: torch.Tensor) -> int:
        return self.rows.count_edges(col_mask, row_mask)

    def edge_scores(self, factor: torch.Tensor, den: torch.Tensor, col_mask: torch.Tensor, row_mask: torch.Tensor
                    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        return self.rows.edge_scores(factor, den, col_mask, row_mask)


def _spans(ends: list[int], live: list[int]) -> Iterator[tuple[int, int]]:
    """Contiguous entry ranges ``[e0, e1)`` of at most :data:`CHUNK_ENTRIES` entries holding, in order, the entries
    of the rows ``live`` (ascending block-local rows; row ``i`` ends at ``ends[i]``): consecutive rows merged, a row
    longer than a chunk split."""
    span: list[int] = []
    for i in live:
        for a in range(ends[i - 1] if i else 0, ends[i], CHUNK_ENTRIES):
            b = min(a + CHUNK_ENTRIES, ends[i])
            if span and (span[1] != a or b - span[0] > CHUNK_ENTRIES):
                yield span[0], span[1]
                span = []
            span = [span[0] if span else a, b]
    if span:
        yield span[0], span[1]


def _rows_of(ends: list[int], e0: int, e1: int) -> torch.Tensor:
    """Block-local row of each entry ``e0 … e1 − 1`` (row ``i`` ends at ``ends[i]``; rows are contiguous)."""
    r0, r1 = bisect.bisect_right(ends, e0), bisect.bisect_right(ends, e1 - 1)
    bounds = torch.tensor([e0, *ends[r0:r1], e1], dtype=torch.long, device=HOST)
    return torch.repeat_interleave(torch.arange(r0, r1 + 1, device=HOST), bounds.diff())


class RowStore:
    """Computed edge rows, in computation order: ``done[i]`` is the target of the ``i``-th row.

    Rows go, as each batch is computed, either into a dense matrix of ``dense_shape`` at the row
    :meth:`position` says, or into the full graph's :class:`.blocks.BlockAdjacency` made by ``blocks(dtype)``
    (at the row :meth:`position` says: the graph's adjacency itself, no second copy of the rows), or
    sparse into a :class:`SparseRows` (``keep_mass`` as there; None keeps every non-zero entry; ``mirror_bytes``
    its device copies' bytes)."""

    def __init__(self, n_sources: int, keep_mass: float | None = None, progress: Any = None,
                 dense_shape: tuple[int, int] | None = None, blocks: Any = None, mirror_bytes: int = 0) -> None:
        self.n_sources, self.keep_mass, self.progress = n_sources, keep_mass, progress
        self.dense_shape = dense_shape
        self._make_blocks = blocks
        self.done: list[int] = []
        self.rows: torch.Tensor | SparseRows | BlockAdjacency | None = (
            None if dense_shape is not None or blocks is not None else SparseRows(n_sources, mirror_bytes))

    def position(self, rows: list[int]) -> torch.Tensor:
        """Where rows ``rows`` go in the dense matrix (here: their numbers)."""
        return torch.as_tensor(rows, dtype=torch.long, device=HOST)

    def record(self, rows: list[int], grads: torch.Tensor) -> None:
        """Store ``grads: (len(rows), n_sources)``, the incoming edges of each row.

        Raises:
            NonFiniteError: a row holds NaN or inf, on every storage path (:func:`refuse_non_finite_rows`, before
                anything of the batch is stored, ``done`` included): the sparse rows check their ``Σ |edges|``
                (computed there anyway), the blocks and the dense matrix each row's largest ``|edge|`` (from
                ``aminmax`` on the rows' device: NaN propagates, no temporary of the batch, no overflow) — one
                ``(b,)`` copy to the host a batch either way.
        """
        if (self._make_blocks is not None or self.dense_shape is not None) and grads.numel():
            lo, hi = torch.aminmax(grads.detach(), dim=1)
            refuse_non_finite_rows(torch.maximum(lo.abs(), hi.abs()), rows, grads.dtype)
        if self._make_blocks is not None:
            if self.rows is None:
                self.rows = self._make_blocks(grads.dtype)
            assert isinstance(self.rows, BlockAdjacency)
            self.rows.write(self.position(rows), grads)
        elif self.dense_shape is not None:
            if self.rows is None:
                self.rows = torch.zeros(self.dense_shape, dtype=grads.dtype, device=HOST)
            assert isinstance(self.rows, torch.Tensor)
            self.rows[self.position(rows), :grads.shape[1]] = grads.to(HOST)
        else:
            assert isinstance(self.rows, SparseRows)
            self.rows.append(grads, self.keep_mass, rows)
        self.done.extend(rows)
        if len(self.done) % (TRIM_EVERY * len(rows)) < len(rows):
            release_free_memory()
        if self.progress is not None:
            self.progress.update(len(rows))

    def matrix(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(row_targets (n,), rows (n, n_sources))`` computed so far, in computation order (dense)."""
        done = torch.tensor(self.done, dtype=torch.long, device=HOST)
        if isinstance(self.rows, SparseRows):
            return done, self.rows.dense()
        if self.rows is None:
            return done, torch.zeros(0, self.n_sources, device=HOST)
        dense = self.rows.dense() if isinstance(self.rows, BlockAdjacency) else self.rows
        return done, dense[self.position(self.done), :self.n_sources]


class RowScheduler(RowStore):
    """Hands out batches of target rows and stores the computed edge rows.

    Target row ``r < n_features`` is feature node ``r``; ``r ≥ n_features`` is logit ``r − n_features``.
    When every row is computed and none is dropped (``max_feature_nodes`` None, ``keep_mass`` None),
    the rows are written straight into the full graph's adjacency (:class:`.blocks.BlockAdjacency`, its
    causal blocks); otherwise they are stored sparse (:class:`SparseRows`).

    Args:
        layout: the prompt's nodes.
        max_feature_nodes: at most this many feature rows (None: all).
        progress: a tqdm-like bar (``update(n)``) or None.
        keep_mass: store each row sparse — its largest ``|edges|`` up to this fraction of the row's
            absolute mass, plus the exact sum of the rest (``residual``). ``1``: every non-zero
            entry, sparse; None: dense where possible.
        update_interval: with a budget, the influence ranking is recomputed when the queue it filled is empty:
            every ``update_interval`` batches, queueing the ``update_interval · batch`` most influential
            unvisited features in rank order (circuit-tracer's ``update_interval`` and queue, its
            ``attribution/attribute.py``).
        zero_positions: the prompt's first positions without feature nodes (``attribute(zero_positions=)``): the
            ranking leaves out their error nodes, as it leaves out the bias nodes (:meth:`feature_influence`).
        mirror_bytes: with a budget, the device bytes the stored rows may keep a copy in for the ranking
            (:class:`SparseRows`); without one nothing is ranked and none is kept.
    """

    def __init__(self, layout: Layout, max_feature_nodes: int | None = None, progress: Any = None,
                 keep_mass: float | None = None, update_interval: int = 4, zero_positions: int = 0,
                 mirror_bytes: int = 0) -> None:
        budget = layout.n_features if max_feature_nodes is None else min(max_feature_nodes, layout.n_features)
        full = (keep_mass is None or keep_mass >= 1.0) and budget == layout.n_features
        super(RowScheduler, self).__init__(layout.n_sources, keep_mass, progress,
                                           blocks=functools.partial(full_graph_blocks, layout) if full else None,
                                           mirror_bytes=mirror_bytes if budget < layout.n_features else 0)
        self.layout = layout
        self.budget = budget
        self._pending_logits = list(range(layout.n_features, layout.n_targets))
        self._visited = torch.zeros(layout.n_features, dtype=torch.bool, device=HOST)
        self._n_visited = 0  # ``_visited.sum()``, kept on the host (each pick is of unvisited rows)
        self.update_interval = update_interval
        self._queue: list[int] = []  # ranked, unvisited features still to hand out from the last ranking
        self.zero_positions = zero_positions
        self._rank_mask: torch.Tensor | None = None
        self._rank_all = True  # the ranking's nodes are every node (no bias node, no error node left out)
        self._rank_sums = torch.zeros(0, dtype=torch.float64, device=HOST)  # _rank_den of the rows so far

    def position(self, rows: list[int]) -> torch.Tensor:
        """A target row's node index (features, then logits after the sources)."""
        t = torch.as_tensor(rows, dtype=torch.long, device=HOST)
        lay = self.layout
        return torch.where(t < lay.n_features, t, lay.n_sources + t - lay.n_features)

    @property
    def n_feature_rows(self) -> int:
        return self._n_visited

    def next_rows(self, batch: int) -> list[int]:
        """The next ≤ ``batch`` target rows to compute (empty when done)."""
        if self._pending_logits:
            rows, self._pending_logits = self._pending_logits[:batch], self._pending_logits[batch:]
            return rows
        left = self.budget - self.n_feature_rows
        if left <= 0:
            return []
        n = min(batch, left)
        if self.budget == self.layout.n_features:  # everything: node order
            start = self.n_feature_rows
            picked = list(range(start, start + n))
        else:
            if not self._queue:
                # a fresh vector (feature_influence's): ranked in place — no n_features copy, no boolean-index
                # scatter (its nonzero) per ranking
                score = self.feature_influence().masked_fill_(self._visited, -1.0)
                self._queue = score.topk(min(self.update_interval * batch, left)).indices.tolist()
            picked, self._queue = sorted(self._queue[:n]), self._queue[n:]
        self._visited[picked] = True
        self._n_visited += len(picked)
        return picked

    def sparse(self) -> SparseRows:
        """The computed rows as a :class:`SparseRows` (dense ones converted exactly)."""
        if isinstance(self.rows, SparseRows):
            return self.rows
        out = SparseRows(self.n_sources)
        if self.done:
            out.append(self.matrix()[1])
        return out

    def row_nodes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(node (n,), logit weight (n,))`` of each computed row (node ids: sources, then logits)."""
        lay = self.layout
        targets = torch.tensor(self.done, dtype=torch.long, device=HOST)
        node = self.position(self.done)
        weight = torch.where(targets >= lay.n_features,
                             lay.logit_probs[(targets - lay.n_features).clamp_min(0)].double(),
                             torch.zeros((), dtype=torch.float64, device=HOST))
        return node, weight

    def feature_influence(self) -> torch.Tensor:
        """Influence on the logits of every feature node, from the rows computed so far, over circuit-tracer's
        nodes: each row normalised by its edges' absolute mass without the bias nodes and the error nodes at the
        first ``zero_positions`` positions, which circuit-tracer's graphs lack (it has no bias nodes, and zeroes
        the errors at position 0, where it has no features). With them the ranking swapped near-ties against
        circuit-tracer's: 1-3 of 40-200 rows differed (``benchmarks/attribution_vs_circuit_tracer.py
        --max-feature-nodes``; docs/attribution.md). A fresh vector, the caller's to change."""
        if self._rank_mask is None:
            n = self.layout.nodes
            error = (n.kind == MLP_ERROR) | (n.kind == ATTN_ERROR)
            self._rank_mask = ~((n.kind == BIAS) | (error & (n.pos < self.zero_positions)))
            self._rank_all = bool(self._rank_mask.all())
        node, weight = self.row_nodes()
        sp = self.sparse()
        if self._rank_all or not isinstance(self.rows, SparseRows):  # every node: the rows' full masses
            return sp.influence(node, weight, None if self._rank_all else self._rank_mask)[:self.layout.n_features]
        return row_influence(_SparseSource(sp), node, weight, self.n_sources, self._rank_mask,
                             den=self._rank_den(sp, node))[:self.layout.n_features]

    def _rank_den(self, sp: SparseRows, node: torch.Tensor) -> torch.Tensor:
        """``(n_rows,)`` float64 each stored row's ``Σ |entries|`` over the ranking's nodes (:meth:`feature_influence`;
        rows whose target is not one of them: 0) — :func:`.scores.row_influence`'s ``den`` with the mask, which the
        former code recomputed from every stored entry at each ranking. A row's sum is fixed once it is stored: the
        rows stored since the last ranking are summed (:meth:`SparseRows.abs_sums` reading only them), the others'
        kept — the same bits, each row's sum its own entries added in storage order either way."""
        assert self._rank_mask is not None
        have = self._rank_sums.numel()
        if have < sp.n_rows:
            new = torch.zeros(sp.n_rows, dtype=torch.bool, device=HOST)
            new[have:] = self._rank_mask[node[have:]]
            part = sp.abs_sums(self._rank_mask[:self.n_sources], new)
            self._rank_sums = torch.cat([self._rank_sums, part[have:]])
        return self._rank_sums


def full_graph_blocks(layout: Layout, dtype: torch.dtype) -> BlockAdjacency:
    """The full graph's adjacency (every node of ``layout``), rows: every feature and logit."""
    ns = layout.n_sources
    targets = torch.cat([torch.arange(layout.n_features, device=HOST),
                         torch.arange(ns, ns + layout.n_logits, device=HOST)])
    return BlockAdjacency(layout.nodes.sites(), layout.nodes.pos, ns, targets, dtype)


class FixedRows(RowStore):
    """Every one of ``n`` target rows, in order (no logits first, no budget), dense: for probes such
    as the query/key coordinates of :mod:`.qk`."""

    def __init__(self, n: int, n_sources: int) -> None:
        super(FixedRows, self).__init__(n_sources, dense_shape=(n, n_sources))
        self.n = n

    def next_rows(self, batch: int) -> list[int]:
        start = len(self.done)
        return list(range(start, min(start + batch, self.n)))


def assemble(layout: Layout, scheduler: RowScheduler, values: torch.Tensor, prompt: str, meta: dict[str, Any]) -> Graph:
    """The :class:`Graph` over the visited features and every error/embedding/bias/logit node. Its adjacency is
    a :class:`.blocks.BlockAdjacency` whatever the budget: the full graph's (written in place as the rows were
    computed), or, with a feature budget, the computed rows' causal blocks over the graph's nodes
    (:func:`_budget_blocks`: ``rows × their upstream sources``, linear in the prompt's length for a fixed
    budget, where a dense ``n_nodes²`` matrix is quadratic)."""
    targets = torch.tensor(scheduler.done, dtype=torch.long, device=HOST)
    nf, ns = layout.n_features, layout.n_sources
    visited = torch.zeros(nf, dtype=torch.bool, device=HOST)
    visited[targets[targets < nf]] = True
    keep_src = torch.cat([visited, torch.ones(ns - nf, dtype=torch.bool, device=HOST)])
    src_ids = keep_src.nonzero().flatten()
    n_logits = layout.n_logits
    node_ids = torch.cat([src_ids, torch.arange(ns, ns + n_logits, device=HOST)])
    n = node_ids.numel()
    rows = scheduler.rows
    residual = torch.zeros(n, dtype=torch.float64, device=HOST)
    index = _graph_index(node_ids, ns + n_logits)
    nodes = layout.nodes.select(node_ids)
    adjacency: BlockAdjacency
    if isinstance(rows, BlockAdjacency) and rows.shape == (n, n):  # written in place: every node kept, in order
        adjacency = rows
    else:
        adjacency = _budget_blocks(layout, scheduler, keep_src, node_ids, residual, index, nodes)
    all_values = torch.full((ns + n_logits,), float("nan"), dtype=adjacency.dtype, device=HOST)
    all_values[:nf] = values[:nf].to(HOST)
    all_values[ns:] = values[nf:].to(HOST)
    computed = torch.zeros(n, dtype=torch.bool, device=HOST)
    computed[index[scheduler.position(scheduler.done)]] = True
    return Graph(tokens=layout.tokens, nodes=nodes,
                 adjacency=adjacency,  # type: ignore[arg-type]  # blocks: densified only by graph.densify()
                 values=all_values[node_ids], logit_probs=layout.logit_probs, feature_rows=computed,
                 layout_ids=node_ids, prompt=prompt, meta=meta, residual=residual.to(adjacency.dtype))


def _graph_index(node_ids: torch.Tensor, n_all: int) -> torch.Tensor:
    """``(n_all,)`` each layout node's index in the graph of the layout nodes ``node_ids`` (``-1``: not in it)."""
    index = torch.full((n_all,), -1, dtype=torch.long, device=HOST)
    index[node_ids] = torch.arange(node_ids.numel(), device=HOST)
    return index


def _budget_blocks(layout: Layout, scheduler: RowScheduler, keep_src: torch.Tensor, node_ids: torch.Tensor,
                   residual: torch.Tensor, index: torch.Tensor, nodes: Any) -> BlockAdjacency:
    """The computed rows of a budgeted graph as a :class:`.blocks.BlockAdjacency` over the graph's nodes
    ``node_ids`` (layout ids: the visited features, every other source, the logits; ``index``: their
    :func:`_graph_index`, ``nodes``: their :class:`.graph.NodeTable`), each row written once from the stored sparse
    entries, :data:`CHUNK_ENTRIES` dense entries at a time. Edges from sources that are not graph nodes (features
    never visited) are summed, exactly, into ``residual`` (float64, in place, by graph index), so
    ``Σ adjacency[t] + residual[t] = value[t]`` still holds.

    Row by row (:func:`_budget_row`): a stored row's entries are in column order, so its feature columns are a prefix
    (one binary search) and every entry after it is a graph node's (every non-feature source is one); of the prefix
    only the visited features — at most the budget — are graph nodes, found by a binary search each. The rest of the
    prefix is summed into the row's residual in storage order (float64, the visited entries as ``+0.0``: the same
    bits as adding the dropped entries alone, which the per-entry masks of the former code did)."""
    sp = scheduler.sparse()
    row_at = index[scheduler.position(scheduler.done)]  # graph index of each stored row
    n_src = int(keep_src.sum())
    nf = layout.n_features
    visited = keep_src[:nf].nonzero().flatten()  # ascending layout ids of the visited features
    dtype = sp.blocks[0].val.dtype if sp.blocks else torch.float32
    out = BlockAdjacency(nodes.sites(), nodes.pos, n_src, row_at.sort().values, dtype)
    group = max(1, CHUNK_ENTRIES // max(n_src, 1))  # rows densified at a time
    # one chunk's float64 values after a slot for the running sum (a row's dropped entries summed in order into its
    # residual: add_in_order), made once
    run = torch.empty(min(CHUNK_ENTRIES, max(sp.nnz, 1)) + 1, dtype=torch.float64, device=HOST)
    row_list: list[int] = row_at.tolist()
    for block in sp.blocks:
        for i0 in range(0, len(block.ends), group):
            i1 = min(i0 + group, len(block.ends))
            dense = torch.zeros(i1 - i0, n_src, dtype=dtype, device=HOST)
            for i in range(i0, i1):
                start = block.ends[i - 1] if i else 0
                _budget_row(block, start, block.ends[i], nf, visited, index, dense[i - i0],
                            residual[row_list[block.row_start + i]:][:1], run)
            out.write(row_at[block.row_start + i0:block.row_start + i1], dense)
            del dense
    return out


def _budget_row(block: _Block, start: int, end: int, nf: int, visited: torch.Tensor, index: torch.Tensor,
                dense: torch.Tensor, residual: torch.Tensor, run: torch.Tensor) -> None:
    """One stored row (entries ``[start, end)`` of ``block``, columns ascending) of :func:`_budget_blocks`: its graph
    nodes' entries into ``dense: (n_src,)`` at their graph index (``index``), its other entries (features not in
    ``visited``) added to ``residual: (1,)`` float64 one by one in storage order (:func:`add_in_order`, ``run`` its
    float64 buffer of a chunk and one)."""
    cols = block.col[start:end]
    split = start + int(torch.searchsorted(cols, torch.tensor(nf, dtype=cols.dtype, device=HOST)))
    # the visited features among the row's feature columns: a binary search each
    feats = cols[:split - start]
    at = torch.searchsorted(feats, visited.to(feats.dtype))
    found = at < feats.numel()
    hit = torch.zeros_like(found)
    hit[found] = feats[at[found]].long() == visited[found]
    hits = at[hit]
    dense[index[visited[hit]]] = block.val[start + hits]
    dense[index[cols[split - start:]]] = block.val[split:end]
    for e0 in range(start, split, CHUNK_ENTRIES):  # the dropped entries' sum, a chunk at a time
        e1 = min(e0 + CHUNK_ENTRIES, split)
        v = run[1:e1 - e0 + 1].copy_(block.val[e0:e1])
        inside = hits[(hits >= e0 - start) & (hits < e1 - start)] - (e0 - start)
        v[inside] = 0.0  # a graph node's entry: +0.0, which leaves the running sum as it is
        add_in_order(residual, run, e1 - e0)


def assemble_pruned(layout: Layout, scheduler: RowScheduler, values: torch.Tensor, *, node_threshold: float,
                    edge_threshold: float, prompt: str, meta: dict[str, Any]) -> Graph:
    """The pruned :class:`Graph` of the rows in ``scheduler`` (see the module docstring). On the full graph's
    blocks: :func:`.scores.prune`'s steps on them in place (temporaries of one cell / chunk, the edge scores among
    the node-pruned nodes, 8 B each), then the kept nodes' adjacency and residuals cell by cell
    (:func:`_block_pruned`). On sparse rows the same steps on the stored rows in place (:class:`SparseRows` through
    its source view, rows mapped to nodes by ``row_node``): chunked passes that read only the rows they need — the
    node influence, then those of the node-pruned nodes (edge scores, 8 B each of their entries among those nodes),
    then the kept rows' adjacency and residuals (:func:`_sparse_pruned`); no entry is copied out of the store. Either
    way the pruned graph keeps its kept rows' causal blocks over its kept sources (:func:`_kept_blocks`, a
    :class:`.blocks.BlockAdjacency` as the unpruned graph's — the kept nodes are mostly error and embedding nodes,
    whose rows are empty; a dense ``k × k`` matrix until 2026-11-26), and ``prune_rows`` gathers no kept edges
    (``keep_edges=False``: the graph keeps every stored edge among the kept nodes; its dangling-node loop re-reads
    them): the edge scores, 8 B per entry among the node-pruned nodes, are its one value-sized part. Temporaries: one
    :data:`CHUNK_ENTRIES` chunk's."""
    nf, ns, nl = layout.n_features, layout.n_sources, layout.n_logits
    row_node, lw_row = scheduler.row_nodes()
    kind = layout.nodes.kind
    n_all = ns + nl
    visited = torch.zeros(n_all, dtype=torch.bool, device=HOST)
    visited[row_node] = True
    in_graph = visited.clone()
    in_graph[nf:] = True  # errors, embeddings, biases, logits are always graph nodes
    always = (kind == EMBEDDING) | (kind == BIAS) | (kind == LOGIT) | layout.nodes.intervened  # (scores.prune)
    store = scheduler.rows
    adjacency: torch.Tensor | BlockAdjacency
    if isinstance(store, BlockAdjacency):  # every row, every entry: the causal blocks — prune(graph)'s steps
        assert bool(in_graph.all())
        ids = torch.arange(n_all, device=HOST)
        lw = torch.zeros(n_all, dtype=torch.float64, device=HOST)
        lw[row_node] = lw_row
        # 1. node influence on the graph
        infl = torch.zeros(n_all, dtype=torch.float64, device=HOST)
        infl[:ns] = row_influence(store, ids, lw, ns)
        first = (infl >= find_threshold(infl, node_threshold)) | always
        # 2.–3. edge scores on the node-pruned matrix, edge threshold, dangling features / errors
        node_mask = prune_rows(store, ids, lw, first, always, kind, edge_threshold, ns, keep_edges=False)[0]
        kept = node_mask.nonzero().flatten()
        adjacency, residual = _block_pruned(store, first, node_mask, kept, layout.nodes.select(kept))
        stored = store.entries()
    else:
        sp = scheduler.sparse()
        # 1. node influence on the graph (unvisited features are not graph nodes, as in the dense path)
        infl = torch.cat([sp.influence(row_node, lw_row, node_mask=in_graph),
                          torch.zeros(nl, dtype=torch.float64, device=HOST)])
        infl[~in_graph] = 0
        node_mask = in_graph & ((infl >= find_threshold(infl[in_graph], node_threshold)) | always)
        # 2.–3. edge scores on the node-pruned matrix, edge threshold, dangling features / errors (scores.prune's),
        # on the stored entries in place (rows mapped to their nodes by row_node)
        first = node_mask
        node_mask = prune_rows(_SparseSource(sp), row_node, lw_row, first, always & in_graph, kind, edge_threshold,
                               ns, keep_edges=False)[0]
        # 4. the kept nodes' graph: every stored edge among them, the rest of each row in its residual
        kept = node_mask.nonzero().flatten()
        adjacency, residual = _sparse_pruned(sp, row_node, first, node_mask, kept, values.dtype,
                                             layout.nodes.select(kept))
        stored = sp.nnz
    computed = torch.zeros(kept.numel(), dtype=torch.bool, device=HOST)
    computed[_graph_index(kept, n_all)[row_node[node_mask[row_node]]]] = True
    all_values = torch.full((n_all,), float("nan"), dtype=values.dtype, device=HOST)
    all_values[:nf] = values[:nf].to(HOST)
    all_values[ns:] = values[nf:].to(HOST)
    meta = {**meta, "pruned": {"node_threshold": node_threshold, "edge_threshold": edge_threshold,
                               "keep_mass": scheduler.keep_mass, "stored_entries": int(stored)}}
    return Graph(tokens=layout.tokens, nodes=layout.nodes.select(kept),
                 adjacency=adjacency,  # type: ignore[arg-type]  # blocks: densified only by graph.densify()
                 values=all_values[kept], logit_probs=layout.logit_probs, feature_rows=computed, layout_ids=kept,
                 prompt=prompt, meta=meta, residual=residual.to(adjacency.dtype))


def _sparse_pruned(rows: SparseRows, row_node: torch.Tensor, first: torch.Tensor, node_mask: torch.Tensor,
                   kept: torch.Tensor, empty_dtype: torch.dtype, nodes: Any) -> tuple[BlockAdjacency, torch.Tensor]:
    """``(adjacency, residual (k,) float64)`` of the ``k`` nodes ``kept`` (the final ``node_mask``, within the
    node-pruned ``first``; both ``(n_all,)`` bool) from the stored sparse rows (row ``r`` the target
    ``row_node[r]``): each kept row's residual is its stored residual, then its entries outside the ``first`` nodes,
    then those among them but dropped later, each added in storage order (float64); the adjacency (the rows' dtype,
    ``empty_dtype`` if nothing is stored) holds every stored edge among ``kept``: the kept rows' causal blocks over
    the kept sources (:func:`_kept_blocks`; ``nodes``: the kept nodes' :class:`.graph.NodeTable` — at most ``kept rows
    × kept sources``, and at most the full graph's blocks of the kept rows; the kept nodes are mostly error and
    embedding nodes, whose rows are empty), written :data:`CHUNK_ENTRIES` dense entries of rows at a time.

    Row by row (:func:`_pruned_row`), reading only the kept rows, each once (twice for a row longer than a chunk): no
    per-entry row index, no masked copies of the entries, no row mask per group of rows (the former code read the kept
    rows through :meth:`SparseRows.chunks` once for the residuals and once per group, each chunk's row and column
    indices in int64 and its masks' gathers: ``tests/attribution/test_row_stages.py`` keeps it as the reference, bit
    for bit). Temporaries: one :data:`CHUNK_ENTRIES` float64 buffer, a chunk's two column-mask gathers (1 B an
    entry), the kept edges' positions of a chunk."""
    n_all = node_mask.numel()
    index = _graph_index(kept, n_all)
    dtype = rows.blocks[0].val.dtype if rows.blocks else empty_dtype
    row_kept = node_mask[row_node]  # only the kept rows are read (the others are not in the graph)
    live = row_kept.nonzero().flatten()  # the kept stored rows, in storage order
    at = index[row_node]  # each stored row's graph index
    adjacency, n_src = _kept_blocks(nodes, kept, rows.n_cols, at[live], dtype)
    group = max(1, CHUNK_ENTRIES // max(n_src, 1))  # rows densified at a time
    stored = rows.residual
    residual = torch.zeros(kept.numel(), dtype=torch.float64, device=HOST)
    run = torch.empty(min(CHUNK_ENTRIES, max(rows.nnz, 1)) + 1, dtype=torch.float64, device=HOST)
    starts = [block.row_start for block in rows.blocks]
    live_list: list[int] = live.tolist()
    at_list: list[int] = at.tolist()
    for g0 in range(0, len(live_list), group):
        part = live_list[g0:g0 + group]
        dense = torch.zeros(len(part), n_src, dtype=dtype, device=HOST)
        for j, r in enumerate(part):
            block = rows.blocks[bisect.bisect_right(starts, r) - 1]
            i = r - block.row_start
            total = residual[at_list[r]:][:1]
            total.copy_(stored[r:r + 1])
            _pruned_row(block, block.ends[i - 1] if i else 0, block.ends[i], first, node_mask, index, dense[j], total,
                        run)
        adjacency.write(at[live[g0:g0 + group]], dense)
        del dense
    return adjacency, residual


def _pruned_row(block: _Block, start: int, end: int, first: torch.Tensor, node_mask: torch.Tensor,
                index: torch.Tensor, dense: torch.Tensor, total: torch.Tensor, run: torch.Tensor) -> None:
    """One kept stored row (entries ``[start, end)`` of ``block``) of :func:`_sparse_pruned`: its entries outside the
    ``first`` nodes, then those among them but not in ``node_mask``, added one by one in storage order into ``total:
    (1,)`` float64 (:func:`add_in_order`, ``run`` its float64 buffer of a chunk and one; every other entry as
    ``-0.0``, which leaves any running sum's bits as they are), and its entries among the kept nodes into ``dense:
    (n_src,)`` at their graph index (``index``)."""
    held: torch.Tensor | None = None
    for e0 in range(start, end, CHUNK_ENTRIES):  # 1. outside the node-pruned nodes
        e1 = min(e0 + CHUNK_ENTRIES, end)
        among = first[block.col[e0:e1]]
        run[1:e1 - e0 + 1].copy_(block.val[e0:e1]).masked_fill_(among, -0.0)
        add_in_order(total, run, e1 - e0)
        held = among if end - start <= CHUNK_ENTRIES else None  # a row of one chunk: its gather kept for step 2
    for e0 in range(start, end, CHUNK_ENTRIES):  # 2. among them but dropped later; the kept edges
        e1 = min(e0 + CHUNK_ENTRIES, end)
        cols = block.col[e0:e1]
        among = held if held is not None else first[cols]
        edge = node_mask[cols]
        run[1:e1 - e0 + 1].copy_(block.val[e0:e1]).masked_fill_(among.logical_not_().logical_or_(edge), -0.0)
        add_in_order(total, run, e1 - e0)
        hits = edge.nonzero().squeeze(1)
        dense[index[cols[hits]]] = block.val[e0:e1][hits]


def _block_pruned(blocks: BlockAdjacency, first: torch.Tensor, node_mask: torch.Tensor, kept: torch.Tensor,
                  nodes: Any) -> tuple[BlockAdjacency, torch.Tensor]:
    """``(adjacency, residual (k,) float64)`` of the ``k`` nodes ``kept`` (the final ``node_mask``) from the full
    graph's causal blocks, cell by cell: every stored edge among them, and each kept row's sum of everything
    else — the row's sum outside the node-pruned (``first``) nodes, then its entries among those but dropped
    later added one by one in its block's column order (float64), as the entry list of the former code added them.
    The adjacency is the kept rows' causal blocks over the kept sources (``nodes``: the kept nodes'
    :class:`.graph.NodeTable`; :func:`_kept_blocks`, as :func:`_sparse_pruned`'s): a kept target's block columns are
    the kept ones among its full-graph block's, so it holds at most the full graph's blocks of the kept rows.
    Temporaries: one cell's block in float64, and :data:`CHUNK_ENTRIES` dense entries of kept rows at a time."""
    index = _graph_index(kept, blocks.n)
    written = torch.cat(blocks.cell_rows) if blocks.cell_rows else kept[:0]
    adjacency, n_src = _kept_blocks(nodes, kept, blocks.n_sources, index[written[node_mask[written]]], blocks.dtype)
    group = max(1, CHUNK_ENTRIES // max(n_src, 1))  # kept rows densified at a time
    outside = torch.zeros(blocks.n, dtype=torch.float64, device=HOST)
    for rows, cols, block in blocks.items():
        rk, ck = first[rows].nonzero().flatten(), first[cols].nonzero().flatten()
        sub = block[rk][:, ck]
        rest = block.sum(1, dtype=torch.float64)
        rest[rk] -= sub.sum(1, dtype=torch.float64)
        fr, fc = node_mask[rows[rk]], node_mask[cols[ck]]
        dropped = torch.where(fr[:, None] & fc[None, :], 0.0, sub.double())
        rest[rk] = torch.cat([rest[rk][:, None], dropped], 1).cumsum(1)[:, -1]  # sequential, as index_add
        outside[rows] = rest
        targets, sources, kept_sub = index[rows[rk[fr]]], index[cols[ck[fc]]], sub[fr][:, fc]
        for r0 in range(0, targets.numel(), group):
            dense = torch.zeros(min(group, targets.numel() - r0), n_src, dtype=blocks.dtype, device=HOST)
            dense[:, sources] = kept_sub[r0:r0 + group]
            adjacency.write(targets[r0:r0 + group], dense)
            del dense
    return adjacency, outside[kept]


def _kept_blocks(nodes: Any, kept: torch.Tensor, n_cols: int, targets: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[BlockAdjacency, int]:
    """``(adjacency, n_src)``: the empty :class:`.blocks.BlockAdjacency` of a pruned graph — over its ``k`` kept nodes
    (``nodes``, their :class:`.graph.NodeTable`; ``kept``, their ascending layout ids: the ``n_src`` of them below
    ``n_cols`` are its sources, first), rows ``targets`` (graph indices of the kept nodes whose rows were computed) —
    which :func:`_sparse_pruned` and :func:`_block_pruned` fill, a group of dense rows at a time."""
    n_src = int((kept < n_cols).sum())
    return BlockAdjacency(nodes.sites(), nodes.pos, n_src, targets.sort().values, dtype), n_src
