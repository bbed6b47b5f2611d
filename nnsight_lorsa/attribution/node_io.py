"""How the frozen model writes its nodes' vectors and reads its targets' encoder directions.

A node ``i`` at token position ``pos_i`` with vector ``w_i = W[idx_i]`` (a transcoder feature's
decoder row, a Lorsa head's ``w_o``, an encoder column ``W_enc[:, f]``) is

* *written*: ``out[b, p] = Σ_{i at p} c[b, i] · w_i`` (``c``: activation × multiplier), and
* *read*: ``pre[b, i] = x[b, pos_i] · w_i`` (a target's pre-activation),

and each is the other's transpose in the backward pass. Two implementations, same numbers:

* :class:`GridNodes` — the vectors copied once onto a per-position grid
  (:class:`~.frozen.PositionSlots`), then one batched matmul over positions: fastest, but keeps
  ``n·d_model`` numbers per site (2 GB per layer for 4096 tokens × 64 features × 4096 dims in bf16);
* :class:`GatheredNodes` — the rows gathered from ``W`` chunk by chunk in the forward and again in
  the backward (a custom autograd function): nothing per node is kept beyond the indices.

:func:`choose` picks the grid while it fits a memory budget. torch only (runs on NDIF too).
"""

from __future__ import annotations

from typing import Any

import torch

from .._typing import Float, Int
from .frozen import PositionSlots

#: ``"auto"`` keeps a site's grid up to this many bytes, and gathers above it
GRID_BUDGET_BYTES = 256 * 2**20
#: elements of one gathered ``(batch, chunk, d_model)`` temporary
CHUNK_ELEMENTS = 2**22


def _chunk(batch: int, d: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, batch * d))


def gather_write(coeff: torch.Tensor, W: torch.Tensor, idx: torch.Tensor, pos: torch.Tensor, n_pos: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """``out[b, p] = Σ_{i at p} coeff[b, i] · W[idx_i]``, ``(batch, n_pos, d)`` in ``dtype``."""
    b, n = coeff.shape
    out = torch.zeros(b, n_pos, W.shape[-1], dtype=dtype, device=coeff.device)
    step = _chunk(b, W.shape[-1])
    for s in range(0, n, step):
        rows = W[idx[s:s + step]].to(dtype)
        out.index_add_(1, pos[s:s + step], coeff[:, s:s + step, None].to(dtype) * rows[None])
    return out


def gather_read(x: torch.Tensor, W: torch.Tensor, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``out[b, i] = x[b, pos_i] · W[idx_i]``, ``(batch, n)`` in ``x``'s dtype."""
    b, n = x.shape[0], idx.numel()
    step = _chunk(b, W.shape[-1])
    parts = [(x[:, pos[s:s + step]] * W[idx[s:s + step]].to(x.dtype)[None]).sum(-1) for s in range(0, n, step)]
    return torch.cat(parts, dim=1) if parts else x.new_zeros(b, 0)


class _Write(torch.autograd.Function):
    """:func:`gather_write` with gradient to ``coeff`` only (``W`` is a constant of the frozen model)."""

    @staticmethod
    def forward(ctx: Any, coeff: torch.Tensor, W: torch.Tensor, idx: torch.Tensor, pos: torch.Tensor,
                n_pos: int, dtype: torch.dtype) -> torch.Tensor:
        ctx.W, ctx.idx, ctx.pos, ctx.coeff_dtype = W, idx, pos, coeff.dtype
        return gather_write(coeff, W, idx, pos, n_pos, dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return gather_read(grad, ctx.W, ctx.idx, ctx.pos).to(ctx.coeff_dtype), None, None, None, None, None


class _Read(torch.autograd.Function):
    """:func:`gather_read` with gradient to ``x`` only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, W: torch.Tensor, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        ctx.W, ctx.idx, ctx.pos, ctx.n_pos, ctx.x_dtype = W, idx, pos, x.shape[1], x.dtype
        return gather_read(x, W, idx, pos)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return gather_write(grad, ctx.W, ctx.idx, ctx.pos, ctx.n_pos, ctx.x_dtype), None, None, None


class GridNodes:
    """Node vectors on a :class:`~.frozen.PositionSlots` grid (one ``(n, d)`` copy, kept)."""

    def __init__(self, slots: PositionSlots, grid: Float[torch.Tensor, "pos width d"]) -> None:
        self.slots, self.grid = slots, grid

    def write(self, coeff: Float[torch.Tensor, "batch n"]) -> Float[torch.Tensor, "batch pos d"]:
        return self.slots.write(coeff, self.grid)

    def read(self, x: Float[torch.Tensor, "batch pos d"]) -> Float[torch.Tensor, "batch n"]:
        return self.slots.read(x, self.grid)


class GatheredNodes:
    """Node vectors gathered from ``W`` chunk by chunk, in the forward and again in the backward.

    Args:
        W: ``(rows, d)`` the matrix whose row ``idx_i`` is node ``i``'s vector (detached).
        idx: ``(n,)`` int64 row of each node.
        pos: ``(n,)`` int64 token position of each node.
        n_pos: number of positions.
        dtype: the dtype of the written output (the model's).
    """

    def __init__(self, W: torch.Tensor, idx: Int[torch.Tensor, " n"], pos: Int[torch.Tensor, " n"], n_pos: int,
                 dtype: torch.dtype) -> None:
        self.W, self.idx, self.pos, self.n_pos, self.dtype = W.detach(), idx, pos, n_pos, dtype

    def write(self, coeff: Float[torch.Tensor, "batch n"]) -> Float[torch.Tensor, "batch pos d"]:
        return _Write.apply(coeff, self.W, self.idx, self.pos, self.n_pos, self.dtype)

    def read(self, x: Float[torch.Tensor, "batch pos d"]) -> Float[torch.Tensor, "batch n"]:
        return _Read.apply(x, self.W, self.idx, self.pos)


def choose(mode: str, n: int, d: int, dtype: torch.dtype) -> str:
    """``"grid"`` or ``"gather"`` for a site of ``n`` nodes: ``mode`` itself, or for ``"auto"`` the grid
    while ``n·d`` numbers fit :data:`GRID_BUDGET_BYTES`."""
    if mode != "auto":
        return mode
    return "grid" if n * d * torch.empty((), dtype=dtype).element_size() <= GRID_BUDGET_BYTES else "gather"
