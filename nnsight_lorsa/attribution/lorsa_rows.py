"""Active Lorsa heads' ``z_pre`` from frozen queries/keys, pattern rows recomputed in every pass.

A Lorsa head node ``n`` (OV head ``h_n`` of QK head ``g_n`` at query position ``i_n``) is a target
with ``z_pre[n] = Σ_j A^{g_n}[i_n, j] · v_j^{h_n}`` (Lorsa paper §3.1), ``A`` the frozen causal
softmax of ``q·k / attn_scale``. Keeping every node's pattern row costs ``n·pos`` numbers (2 GB per
layer for 4096 tokens × 64 heads per token in bf16) and a broadcast SDPA over all OV heads keeps
``pos·n_ov_heads`` per prompt copy; here the rows are recomputed from the constant ``q, k`` in chunks
of nodes — per QK head one ``(chunk, d_qk) @ (d_qk, pos)`` matmul — in the forward and again in the
backward (a custom autograd function that keeps nothing per node or per copy). torch only.
"""

from __future__ import annotations

from typing import Any

import torch

from .._typing import Float, Int

#: elements of one ``(batch, pos, chunk)`` gathered-values temporary
CHUNK_ELEMENTS = 2**22


class PatternRows:
    """The nodes' pattern rows, computed on demand from frozen queries and keys.

    Args:
        q, k: ``(n_qk, pos, d_qk)`` frozen queries and keys (QK-norm and RoPE applied).
        group: ``(n,)`` QK head of each node; ``qpos``: ``(n,)`` its query position.
        scale: the divisor of the scores (``LorsaConfig.scale``).
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, group: Int[torch.Tensor, " n"], qpos: Int[torch.Tensor, " n"],
                 scale: float) -> None:
        self.q, self.k, self.qpos, self.scale = q, k, qpos, scale
        order = torch.argsort(group, stable=True)
        counts = torch.bincount(group, minlength=q.shape[0]).tolist()
        self.by_group = [(g, nodes) for g, nodes in enumerate(order.split(counts)) if nodes.numel()]

    def chunks(self, batch: int) -> list[tuple[int, torch.Tensor]]:
        """``(qk head, node indices)`` chunks with ``batch·pos·len(nodes)`` ≤ :data:`CHUNK_ELEMENTS`."""
        step = max(1, CHUNK_ELEMENTS // max(1, batch * self.q.shape[1]))
        return [(g, part) for g, nodes in self.by_group for part in nodes.split(step)]

    def rows(self, g: int, nodes: torch.Tensor, dtype: torch.dtype) -> Float[torch.Tensor, "m pos"]:
        """Pattern rows of ``nodes`` (all of QK head ``g``): causal softmax in fp32, cast to ``dtype``."""
        qpos = self.qpos[nodes]
        scores = (self.q[g, qpos].float() @ self.k[g].float().T) / self.scale
        future = torch.arange(self.k.shape[1], device=scores.device)[None] > qpos[:, None]
        return scores.masked_fill(future, float("-inf")).softmax(-1).to(dtype)


class _ZPre(torch.autograd.Function):
    """``z_pre[b, n] = rows_n · v[b, :, col_n]`` with gradient to ``v`` only."""

    @staticmethod
    def forward(ctx: Any, v: torch.Tensor, rows: PatternRows, col: torch.Tensor) -> torch.Tensor:
        ctx.rows, ctx.col, ctx.shape = rows, col, v.shape
        out = v.new_zeros(v.shape[0], col.numel())
        for g, nodes in rows.chunks(v.shape[0]):
            r = rows.rows(g, nodes, v.dtype)
            out[:, nodes] = torch.einsum("mp,bpm->bm", r, v[:, :, col[nodes]])
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        rows, col = ctx.rows, ctx.col
        grad_v = grad.new_zeros(ctx.shape)
        for g, nodes in rows.chunks(grad.shape[0]):
            r = rows.rows(g, nodes, grad.dtype)
            grad_v.index_add_(2, col[nodes], r.T[None] * grad[:, None, nodes])
        return grad_v, None, None


def z_pre(v: Float[torch.Tensor, "batch pos u"], rows: PatternRows, col: Int[torch.Tensor, " n"]
          ) -> Float[torch.Tensor, "batch n"]:
    """The nodes' ``z_pre`` from ``v``: the values of the OV heads active somewhere (column ``col_n``
    is node ``n``'s head), through their recomputed pattern rows."""
    return _ZPre.apply(v, rows, col)
