"""Sparse encode/decode kernels for top-k sparse coders (the training fast path of TopK / BatchTopK).

A TopK (or BatchTopK) coder keeps ``nnz ≈ k · n`` of the ``n · d_sae`` pre-activations. The dense
reference — ``acts = scatter(topk(x W_enc + b_enc))`` into ``(n, d_sae)``, then ``acts W_dec`` —
spends ``O(n · d_sae · d)`` on the decode and on three more matmuls of that size in the backward
(``∂acts = ∂out W_decᵀ``, ``∂W_dec = actsᵀ ∂out``, ``∂W_enc = xᵀ ∂pre``), although only ``nnz``
entries are non-zero. Here the active features are kept as :class:`SparseActs` (row, column, value
triplets grouped by row) and:

* :func:`sparse_decode` — ``out[r] = Σ_{j ∈ row r} vals_j W_dec[cols_j] (+ b_dec)`` by
  ``torch.nn.functional.embedding_bag`` (``mode="sum"``, ``per_sample_weights``); its autograd is
  sparse: ``∂W_dec`` touches the selected rows only, ``∂vals_j = ∂out[r] · W_dec[cols_j]``.
* :func:`gathered_preact` — ``pre[rows, cols]`` (already computed densely, without a graph, for the
  selection) with a sparse backward (:class:`GatheredPreact`): ``∂b_enc = Σ`` of the entry grads per
  column, ``∂W_enc[:, c] = Σ_{j: cols_j = c} g_j x[rows_j]`` and ``∂x[r] = Σ_{j ∈ row r} g_j W_enc[:, cols_j]``,
  each ``O(nnz · d)``.

The encoder matmul itself stays dense (the selection needs every pre-activation). Values and
gradients equal the dense reference up to float summation order (tested in fp32). Needs torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .._repr import FieldsRepr
from .._typing import Float, Int


@dataclass(repr=False)  # FieldsRepr: no _thread in a request (NDIF's unpickling whitelist)
class SparseActs(FieldsRepr):
    """Active features of ``n_rows`` rows as triplets grouped by row (rows ascending).

    Attributes:
        rows: ``(nnz,)`` int64 row of each entry, non-decreasing.
        cols: ``(nnz,)`` int64 feature index of each entry, in ``[0, d_sae)``.
        vals: ``(nnz,)`` activation values (may be 0: a kept entry whose pre-activation was ≤ 0).
        offsets: ``(n_rows,)`` int64 index of each row's first entry (``embedding_bag`` offsets).
        d_sae: number of features (width of :meth:`to_dense`).
    """

    rows: Int[torch.Tensor, " nnz"]
    cols: Int[torch.Tensor, " nnz"]
    vals: Float[torch.Tensor, " nnz"]
    offsets: Int[torch.Tensor, " n_rows"]
    d_sae: int

    @property
    def n_rows(self) -> int:
        return int(self.offsets.shape[0])

    def to_dense(self) -> Float[torch.Tensor, "n_rows d_sae"]:
        """The ``(n_rows, d_sae)`` activation matrix (differentiable in ``vals``)."""
        out = torch.zeros(self.n_rows, self.d_sae, dtype=self.vals.dtype, device=self.vals.device)
        return out.index_put((self.rows, self.cols), self.vals)

    def fired(self) -> torch.Tensor:
        """``(d_sae,)`` bool: features with a positive value in some row."""
        mask = torch.zeros(self.d_sae, dtype=torch.bool, device=self.cols.device)
        mask[self.cols[self.vals > 0]] = True
        return mask

    def l0(self) -> float:
        """Mean number of positive activations per row."""
        return float((self.vals > 0).sum()) / max(1, self.n_rows)


def topk_indices(pre: Float[torch.Tensor, "n d_sae"], k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows, cols, offsets)`` of the ``k`` largest entries of every row (the :class:`~.activations.TopK` rule).

    Same call as the dense rule (``topk(min(k, d_sae), sorted=False)``), so the same entries are kept.
    """
    n, f = pre.shape
    kk = min(k, f)
    idx = pre.topk(kk, dim=-1, sorted=False).indices
    rows = torch.arange(n, device=pre.device).repeat_interleave(kk)
    return rows, idx.reshape(-1), torch.arange(0, n * kk, kk, device=pre.device)


def batch_topk_indices(pre: Float[torch.Tensor, "n d_sae"], k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows, cols, offsets)`` of the ``k · n`` largest ReLU'd entries of the whole batch
    (the :class:`~.activations.BatchTopK` training rule), sorted by row."""
    n, f = pre.shape
    flat = pre.reshape(-1)
    keep = min(k * n, flat.numel())
    idx = flat.relu().topk(keep, sorted=False).indices.sort().values
    rows, cols = idx // f, idx % f
    counts = torch.bincount(rows, minlength=n)
    offsets = torch.cumsum(counts, 0) - counts
    return rows, cols, offsets


def _scatter_rows(cols: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor, src: torch.Tensor,
                  n_out: int) -> torch.Tensor:
    """``out[c] = Σ_{j: cols_j = c} weights_j src[row_j]``, ``(n_out, src.shape[1])``.

    This is the weight gradient of ``embedding_bag``; it is computed by that op's backward (no
    ``(nnz, d)`` intermediate).
    """
    with torch.enable_grad():
        table = torch.zeros(n_out, src.shape[1], dtype=src.dtype, device=src.device, requires_grad=True)
        out = F.embedding_bag(cols, table, offsets, mode="sum", per_sample_weights=weights.detach())
        (grad,) = torch.autograd.grad(out, table, src.detach())
    return grad


class GatheredPreact(torch.autograd.Function):
    """``pre[rows, cols]`` where ``pre = x W_enc + b_enc``, with a sparse backward (module docstring).

    ``apply(x (n, d), W_enc (d, f), b_enc (f,), rows, cols, offsets, pre (n, f))``; ``pre`` must be
    ``x W_enc + b_enc`` computed without a graph (it only supplies the forward values).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, W_enc: torch.Tensor, b_enc: torch.Tensor, rows: torch.Tensor,
                cols: torch.Tensor, offsets: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, W_enc, cols, offsets)
        return pre[rows, cols]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        x, W_enc, cols, offsets = ctx.saved_tensors
        grad_x = grad_W = grad_b = None
        g = g.contiguous()
        # in the weights' dtype: under autocast the gathered values (and so g) are bf16 / fp16, the weights fp32,
        # and embedding_bag takes no mix (autograd casts each gradient back to its input's dtype)
        if ctx.needs_input_grad[0]:
            grad_x = F.embedding_bag(cols, W_enc.t().contiguous(), offsets, mode="sum",
                                     per_sample_weights=g.to(W_enc.dtype))
        if ctx.needs_input_grad[1]:
            grad_W = _scatter_rows(cols, offsets, g.to(x.dtype), x, W_enc.shape[1]).t()
        if ctx.needs_input_grad[2]:
            grad_b = torch.zeros(W_enc.shape[1], dtype=g.dtype, device=g.device).index_add_(0, cols, g)
        return grad_x, grad_W, grad_b, None, None, None, None


def gathered_preact(x: Float[torch.Tensor, "n d_in"], W_enc: Float[torch.Tensor, "d_in d_sae"],
                    b_enc: Float[torch.Tensor, " d_sae"], rows: Int[torch.Tensor, " nnz"],
                    cols: Int[torch.Tensor, " nnz"], offsets: Int[torch.Tensor, " n"],
                    pre: Float[torch.Tensor, "n d_sae"]) -> Float[torch.Tensor, " nnz"]:
    """The selected pre-activations ``(x W_enc + b_enc)[rows, cols]``, differentiable in ``x``,
    ``W_enc``, ``b_enc`` at ``O(nnz · d_in)`` backward cost (:class:`GatheredPreact`)."""
    return GatheredPreact.apply(x, W_enc, b_enc, rows, cols, offsets, pre.detach())


def sparse_decode(acts: SparseActs, W_dec: Float[torch.Tensor, "d_sae d_out"],
                  b_dec: Float[torch.Tensor, " d_out"] | None = None) -> Float[torch.Tensor, "n_rows d_out"]:
    """``acts W_dec (+ b_dec)`` without the dense ``(n_rows, d_sae)`` matrix: one ``embedding_bag``.

    Equals ``acts.to_dense() @ W_dec (+ b_dec)`` up to summation order; gradients to ``acts.vals``
    and ``W_dec`` (selected rows only) through ``embedding_bag``'s own backward.

    ``embedding_bag`` is not an autocast op: values in another float dtype than ``W_dec`` (bf16 values of a coder
    run under ``torch.autocast``) are cast to ``W_dec``'s dtype (until 2026-11-28 torch's own dtype error escaped;
    callers that refuse a mismatch outside autocast check it first, :meth:`~.sparse_coder.SparseCoder.decode_sparse`).
    The output's dtype is the dense product's: ``W_dec``'s outside autocast; under ``torch.autocast`` the dtype
    autocast gives ``acts.to_dense() @ W_dec`` (bf16 / fp16: the sum is made in ``W_dec``'s dtype, then rounded;
    until 2026-11-28 it stayed in ``W_dec``'s dtype, where the dense ``decode`` gave bf16).
    """
    vals = acts.vals if acts.vals.dtype == W_dec.dtype else acts.vals.to(W_dec.dtype)
    out = F.embedding_bag(acts.cols, W_dec, acts.offsets, mode="sum", per_sample_weights=vals)
    out = out if b_dec is None else out + b_dec
    if torch.is_autocast_enabled(W_dec.device.type):  # the dense product's dtype there (an empty product: no work)
        dense = torch.mm(acts.vals.new_empty((0, W_dec.shape[0])), W_dec[:, :0]).dtype
        out = out.to(dense)
    return out
