"""The frozen linear replacement model, one site at a time (paper ``004_…`` §9.4, GUIDE §4).

With attention patterns (MHSA and Lorsa QK), normalisation scales, activation functions and
top-k selections frozen at their values on the prompt, the replacement model is *linear* in the
vectors its nodes write: token embeddings, transcoder features ``a_f d_f``, Lorsa heads
``z_h w_o^h``, error terms and biases. Every such vector is multiplied here by its own scalar
*multiplier* ``M[b, s]`` (all ones): then the direct effect of source ``s`` on a target ``t`` is
``∂t/∂M[s]`` (the gradient reaching the vector's write point, dotted with the vector), and
because every additive term of the frozen model carries a multiplier, Euler's theorem for this
homogeneous-linear function gives ``t = Σ_s ∂t/∂M[s]`` — the incoming edges of every node sum to
its value, bias nodes included (circuit-tracer has no bias nodes, so its edges do not).

Each function maps a site's (frozen-normalised) input to the output the frozen model writes
there, and, where the site holds target nodes, their pre-activations. The frozen quantities
(norm scales, patterns, error vectors) are constants computed once on the prompt: the same
functions then also run the *intervened* frozen model (a multiplier raised), where they must not
follow the changed inputs. Row ``b`` of the batch is
one copy of the prompt; ``M[b]`` carries the gradients of the target injected into row ``b``.

torch only (these functions run inside a trace, also on an NDIF server).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._typing import Float, Int
from ..adapters.base import MHSAWeights, mhsa_mask, mhsa_values
from ..errors import UnsupportedArchitectureError


def column(M: torch.Tensor, index: int | None) -> torch.Tensor | None:
    """``M[:, index]`` as ``(batch, 1, 1)`` for scaling a bias, or None when there is no such bias."""
    return None if index is None else M[:, index, None, None]


def scaled(bias: torch.Tensor | None, mult: torch.Tensor | None) -> torch.Tensor | float:
    """``bias * mult`` (0 without a bias)."""
    if bias is None:
        return 0.0
    return bias * mult if mult is not None else bias


def norm_scale(norm: nn.Module, x: Float[torch.Tensor, "batch pos d"]) -> Float[torch.Tensor, "batch pos 1"]:
    """The factor a LayerNorm (``1/σ(x)``) or RMSNorm (``1/rms(x)``, fp32) multiplies by — what freezing fixes.

    Raises:
        UnsupportedArchitectureError: a norm that is neither (no ``weight`` and eps attribute).
    """
    with torch.no_grad():
        if _is_layer_norm(norm):
            xc = x - x.mean(-1, keepdim=True)
            return torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + float(getattr(norm, "eps")))  # noqa: B009
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        if getattr(norm, "weight", None) is None or eps is None:
            raise UnsupportedArchitectureError(f"cannot freeze a {type(norm).__name__}: not a LayerNorm or RMSNorm")
        return torch.rsqrt(_upcast(x).pow(2).mean(-1, keepdim=True) + float(eps))


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (as transformers' RMSNorm), fp64 kept."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _is_layer_norm(norm: nn.Module) -> bool:
    return isinstance(norm, nn.LayerNorm) or (hasattr(norm, "normalized_shape") and hasattr(norm, "eps"))


def frozen_norm(
    norm: nn.Module,
    x: Float[torch.Tensor, "batch pos d"],
    scale: Float[torch.Tensor, "b pos 1"],
    bias_mult: torch.Tensor | None,
) -> Float[torch.Tensor, "batch pos d"]:
    """A LayerNorm or RMSNorm with its scale frozen to ``scale`` (:func:`norm_scale` on the prompt):
    linear in ``x``. ``LayerNorm: (x − mean x)·scale·γ + β·mult``; ``RMSNorm: x·scale·γ`` (fp32 as
    transformers' ``LlamaRMSNorm``). At the prompt's own ``x`` the value is the module's output."""
    w = getattr(norm, "weight", None)
    if _is_layer_norm(norm):
        out = (x - x.mean(-1, keepdim=True)) * scale.to(x.dtype)
        if w is not None:
            out = out * w
        return out + scaled(getattr(norm, "bias", None), bias_mult)
    assert w is not None  # checked by norm_scale
    return w * (_upcast(x) * scale).to(x.dtype)


def frozen_mhsa(
    w: MHSAWeights,
    x: Float[torch.Tensor, "batch pos d_model"],
    frozen: Float[torch.Tensor, "1 n_heads pos pos"] | tuple[torch.Tensor, torch.Tensor],
    mult_v: torch.Tensor | None,
    mult_o: torch.Tensor | None,
) -> Float[torch.Tensor, "batch pos d_model"]:
    """MHSA with frozen patterns: ``Σ_h A_h (x W_V^h + b_V^h·mult_v) W_O^h + b_O·mult_o``.

    ``frozen``: the prompt's pattern ``(1, n_heads, pos, pos)`` (:func:`~nnsight_lorsa.adapters.base.mhsa_pattern`)
    — one copy, broadcast over the batch; cheapest where memory allows (CPU) — or its queries and keys
    ``(q, k)`` (:func:`~nnsight_lorsa.adapters.base.mhsa_qk`): then one ``scaled_dot_product_attention``
    with gradient to the values only, whose memory-efficient GPU kernels recompute the pattern
    blockwise and never store it (long prompts). Either way the OV circuit (seed ``001_…``) is the
    only path from ``x``. ``mult_v``, ``mult_o``: ``(batch, 1, 1)``.
    """
    b = x.shape[0]
    b_v = (w.b_V[None, :, None] * (mult_v[:, :, :, None] if mult_v is not None else 1.0)).to(x.dtype)
    v = mhsa_values(w, x, b_v)
    if isinstance(frozen, torch.Tensor):
        z = shared_matmul(frozen.to(v.dtype), v)  # patterns may be kept in fp32 for a bf16 model
    else:
        q, k = (t.to(v.dtype) for t in frozen)
        mask = None if w.sliding_window is None else mhsa_mask(w, x.shape[1], x.device)
        z = F.scaled_dot_product_attention(q.expand(b, -1, -1, -1), k.expand(b, -1, -1, -1), v, attn_mask=mask,
                                           is_causal=mask is None, scale=w.scale)
    return torch.einsum("bhse,hed->bsd", z, w.W_O) + scaled(w.b_O, mult_o)


def shared_matmul(a: Float[torch.Tensor, "1 h p q"], v: Float[torch.Tensor, "batch h q e"]
                  ) -> Float[torch.Tensor, "batch h p e"]:
    """``a @ v`` for ``a`` shared by every batch row, as one ``(h, p, q) @ (h, q, batch·e)`` matmul:
    a broadcast ``a @ v`` expands ``a`` to ``(batch, h, p, q)`` and keeps that copy for the backward
    — ``h·p²`` per copy of the prompt; here ``a`` is kept once."""
    b, h, q, e = v.shape
    z = a[0] @ v.permute(1, 2, 0, 3).reshape(h, q, b * e)
    return z.view(h, a.shape[-2], b, e).permute(2, 0, 1, 3)


class PositionSlots:
    """Nodes grouped by token position, for dense per-position matmuls instead of gathers.

    Node ``i`` sits at ``(pos[i], slot[i])`` of a ``(n_pos, width)`` grid, ``width`` = the most
    nodes at one position (a TopK coder's ``k``). Writing ``Σ_i c_i v_i`` into each position and
    reading ``x_{pos_i}·u_i`` then become batched matmuls over positions ``(pos, batch, width) @
    (pos, width, d)`` — ``batch·n·d`` work, no ``(batch, n, d)`` temporaries — which is what makes
    one backward per batch of targets cheap. ``pos`` may be any group id (e.g. a Lorsa head's OV
    index: then ``read`` takes ``x: (batch, n_heads, pos)`` and a grid of pattern rows).

    Args:
        pos: ``(n,)`` int64 group ids (token positions) in ``[0, n_pos)``, any order.
        n_pos: number of groups.
    """

    def __init__(self, pos: Int[torch.Tensor, " n"], n_pos: int) -> None:
        n = pos.numel()
        counts = torch.bincount(pos, minlength=n_pos) if n else torch.zeros(n_pos, dtype=torch.long)
        starts = torch.cumsum(counts, 0) - counts
        order = torch.argsort(pos, stable=True)  # identity for sorted positions
        slot = torch.empty_like(pos)
        slot[order] = torch.arange(n, device=pos.device) - starts[pos[order]]
        self.n_pos, self.width = n_pos, max(int(counts.max()) if n else 0, 1)
        self.flat = pos * self.width + slot

    def grid(self, vectors: Float[torch.Tensor, "n d"]) -> Float[torch.Tensor, "pos width d"]:
        """Vectors placed on the grid (zeros in empty slots)."""
        out = vectors.new_zeros(self.n_pos * self.width, vectors.shape[-1])
        return out.index_copy(0, self.flat.to(vectors.device), vectors).view(self.n_pos, self.width, -1)

    def write(self, coeff: Float[torch.Tensor, "batch n"], grid: Float[torch.Tensor, "pos width d"]
              ) -> Float[torch.Tensor, "batch pos d"]:
        """``out[b, p] = Σ_{i at p} coeff[b, i] · v_i`` for ``grid = self.grid(v)`` (the vectors placed)."""
        c = coeff.new_zeros(coeff.shape[0], self.n_pos * self.width).index_copy(1, self.flat.to(coeff.device), coeff)
        c = c.to(grid.dtype)
        return torch.bmm(c.view(-1, self.n_pos, self.width).transpose(0, 1), grid).transpose(0, 1).contiguous()

    def read(self, x: Float[torch.Tensor, "batch pos d"], grid: Float[torch.Tensor, "pos width d"]
             ) -> Float[torch.Tensor, "batch n"]:
        """``out[b, i] = x[b, pos_i] · u_i`` for ``grid = self.grid(u)``."""
        y = torch.bmm(x.transpose(0, 1), grid.transpose(1, 2)).transpose(0, 1)  # (batch, pos, width)
        return y.reshape(x.shape[0], -1)[:, self.flat.to(x.device)]


def per_position(err: Float[torch.Tensor, "b pos d"], mult: Float[torch.Tensor, "batch pos"]) -> torch.Tensor:
    """An error term with one multiplier per position (one error node per module and position)."""
    return err.detach() * mult[:, :, None]
