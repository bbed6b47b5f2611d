"""The frozen linear replacement model's arithmetic, one site at a time (Ameisen et al. 2025, *Circuit Tracing*:
frozen-Jacobian attribution; docs/attribution.md).

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
follow the changed inputs. Row ``b`` of the batch is one copy of the prompt; ``M[b]`` carries the
gradients of the target injected into row ``b``.

How node vectors are written and read (the ``memory`` setting of :func:`.attribute.attribute`):
a node ``i`` at token position ``pos_i`` with vector ``w_i = W[idx_i]`` (a transcoder feature's
decoder row, a Lorsa head's ``w_o``, an encoder column ``W_enc[:, f]``) is *written*
``out[b, p] = Σ_{i at p} c[b, i] · w_i`` and *read* ``pre[b, i] = x[b, pos_i] · w_i``, each the
other's transpose in the backward pass. :class:`GridNodes` copies the vectors once onto a
per-position grid (:class:`PositionSlots`) and runs one batched matmul over positions (fastest;
``n·d_model`` numbers kept per site, 2 GB per layer for 4096 tokens × 64 features × 4096 dims in
bf16); :class:`GatheredNodes` gathers the rows from ``W`` chunk by chunk in the forward and again in
the backward (a custom autograd function; nothing per node kept beyond the indices).
:func:`choose` picks the grid while it fits :data:`GRID_BUDGET_BYTES`.

Active Lorsa heads' ``z_pre`` without stored pattern rows (:class:`PatternRows`, :func:`z_pre`):
a head node ``n`` (OV head ``h_n`` of QK head ``g_n`` at query position ``i_n``) has
``z_pre[n] = Σ_j A^{g_n}[i_n, j] · v_j^{h_n}`` (Lorsa paper §3.1); keeping every node's pattern row
costs ``n·pos`` numbers, so the rows are recomputed from the constant ``q, k`` in every pass, forward and
backward, many QK heads per step (:func:`plan_rows`): the nodes sit on a ``(QK heads, slots)`` grid, most nodes
first, and a step is one ``bmm`` of its slots' queries with its heads' keys (:func:`~nnsight_lorsa._placement.bmm_f32`),
the causal mask, an fp32 softmax and one contraction with the values — ~20 dispatched operators a step, where a loop
over QK heads dispatched ~10 per head (256 heads a layer at the Llama-3.1-8B Lorsa's shape; on a GPU each a kernel
launch: docs/attribution.md, "Recomputed Lorsa pattern rows"). The contraction (:data:`HEAD_PRODUCT`, per device
type) is, on the CPU, a gather of each node's value column (backward an ``index_add_`` into them), elsewhere the
*head product*: one ``bmm`` of the rows with every OV head's values of the step's QK heads (backward, with the
gradients scattered on that grid) — ``group_size``× the FLOPs on tensor cores for none of the gather's traffic and
atomics. A padded slot reads query position 0 (a finite row) and writes a dummy node.

torch only (these functions run inside a trace, also on an NDIF server).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .._placement import HOST, bmm_f32
from .._typing import Float, Int
from ..adapters.base import UNIT_OFFSET_NORMS, MHSAWeights, mhsa_mask, mhsa_values, norm_gain
from ..errors import ShapeError, UnsupportedArchitectureError


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
        if eps is None and isinstance(norm, getattr(nn, "RMSNorm", ())):  # torch's None: the eps of the dtype it
            eps = torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps  # computes in (fp32 for bf16 / fp16)
        if getattr(norm, "weight", None) is None or eps is None:
            raise UnsupportedArchitectureError(f"cannot freeze a {type(norm).__name__}: not a LayerNorm or RMSNorm")
        return torch.rsqrt(_upcast(x).pow(2).mean(-1, keepdim=True) + float(eps))


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (as transformers' RMSNorm), fp64 kept."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _is_layer_norm(norm: nn.Module) -> bool:
    # torch's own RMSNorm has ``normalized_shape`` and ``eps`` too: until 2026-11-30 it was read as a LayerNorm
    # (mean-centred; a scale of 1.59 where 1/rms was 0.34)
    rms = isinstance(norm, getattr(nn, "RMSNorm", ())) or "RMSNorm" in type(norm).__name__
    return isinstance(norm, nn.LayerNorm) or (not rms and hasattr(norm, "normalized_shape") and hasattr(norm, "eps"))


def frozen_norm(
    norm: nn.Module,
    x: Float[torch.Tensor, "batch pos d"],
    scale: Float[torch.Tensor, "b pos 1"],
    bias_mult: torch.Tensor | None,
) -> Float[torch.Tensor, "batch pos d"]:
    """A LayerNorm or RMSNorm with its scale frozen to ``scale`` (:func:`norm_scale` on the prompt):
    linear in ``x``. ``LayerNorm: (x − mean x)·scale·γ + β·mult``; ``RMSNorm: x·scale·γ`` (fp32 as
    transformers' ``LlamaRMSNorm``; for an fp32/fp64 ``x`` one multiply by the fused ``scale·γ``,
    equal up to rounding order; ``γ = 1 + weight`` for a Gemma RMSNorm,
    :func:`~nnsight_lorsa.adapters.base.norm_gain`, multiplied in fp32 before the cast back as ``Gemma2RMSNorm``).
    At the prompt's own ``x`` the value is the module's output."""
    # the norm's parameters where the site's input is, as constants: a weight that requires grad would make every
    # product keep its other factor (this copy's input, ``(P, d)`` per norm per prompt copy) for a gradient the
    # frozen pass never takes
    w = norm_gain(norm)
    w = None if w is None else w.to(x.device)
    if _is_layer_norm(norm):
        out = (x - x.mean(-1, keepdim=True)) * scale.to(x.dtype)
        if w is not None:
            out = out * w
        b = getattr(norm, "bias", None)
        return out + scaled(None if b is None else b.detach().to(x.device), bias_mult)
    assert w is not None  # checked by norm_scale
    if x.dtype == scale.dtype:  # fp32/fp64: one multiply by the fused (pos, d) factor, half the backward work
        return x * (scale * w.to(x.dtype))
    if type(norm).__name__ in UNIT_OFFSET_NORMS:  # Gemma: (x/rms · (1 + w)) in fp32, then cast
        return (_upcast(x) * scale * w).to(x.dtype)
    return w * (_upcast(x) * scale).to(x.dtype)


def normalized_input(norm: nn.Module, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``norm``'s input normalised before its gain and bias with the scale frozen (:func:`norm_scale`): ``x · scale``
    (an RMSNorm's ``x / rms(x)``) or ``(x − mean x) · scale`` (a LayerNorm's ``(x − mean x) / σ(x)``), in fp32 or
    wider — linear in ``x``; at the prompt's own ``x`` TransformerLens's ``ln2.hook_normalized``
    (:meth:`~nnsight_lorsa.formats.hook_sites.MLPSiteIO.read`)."""
    x = _upcast(x)
    if _is_layer_norm(norm):
        x = x - x.mean(-1, keepdim=True)
    return x * scale.to(x.device)


def keeps_pattern(w: MHSAWeights, store_patterns: bool) -> bool:
    """Whether the frozen pass keeps a frozen MHSA's pattern (:func:`~nnsight_lorsa.adapters.base.mhsa_pattern`,
    ``(1, n_heads, pos, pos)``, once per prompt) rather than its queries and keys for SDPA: where patterns are stored
    (``store_patterns``: the CPU's default), and always for a soft-capped attention (``w.softcap``: Gemma-2's
    ``attn_logit_softcapping``; SDPA cannot cap the scores). The memory model counts the same layers
    (:func:`.budget.estimate_info`)."""
    return store_patterns or w.softcap is not None


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
    blockwise and never store it (long prompts). Either way the OV circuit (Elhage et al. 2021, *A Mathematical
    Framework for Transformer Circuits*) is the
    only path from ``x``. ``mult_v``, ``mult_o``: ``(batch, 1, 1)``.

    Raises:
        UnsupportedArchitectureError: ``(q, k)`` of a soft-capped MHSA (``w.softcap``: SDPA cannot cap the scores).
    """
    b = x.shape[0]
    b_v = (w.b_V[None, :, None] * (mult_v[:, :, :, None] if mult_v is not None else 1.0)).to(x.dtype)
    if isinstance(frozen, torch.Tensor):  # GQA: one value per KV head, the pattern grouped by KV head
        v = mhsa_values(w, x, b_v, repeat_kv=False)
        z = shared_matmul(frozen.to(v.dtype), v)  # patterns may be kept in fp32 for a bf16 model
    else:
        if w.softcap is not None:
            raise UnsupportedArchitectureError(
                f"frozen MHSA from queries and keys: scaled_dot_product_attention cannot soft-cap the scores "
                f"(softcap={w.softcap}); pass the stored pattern (mhsa_pattern) instead")
        v = mhsa_values(w, x, b_v)
        q, k = (t.to(v.dtype) for t in frozen)
        mask = None if w.sliding_window is None else mhsa_mask(w, x.shape[1], x.device)
        z = F.scaled_dot_product_attention(q.expand(b, -1, -1, -1), k.expand(b, -1, -1, -1), v, attn_mask=mask,
                                           is_causal=mask is None, scale=w.scale)
    return torch.einsum("bhse,hed->bsd", z, w.W_O) + scaled(w.b_O, mult_o)


def shared_matmul(a: Float[torch.Tensor, "1 h p q"], v: Float[torch.Tensor, "batch g q e"]
                  ) -> Float[torch.Tensor, "batch h p e"]:
    """``a @ v`` for ``a`` shared by every batch row, as one ``(g, (h/g)·p, q) @ (g, q, batch·e)`` matmul:
    a broadcast ``a @ v`` expands ``a`` to ``(batch, h, p, q)`` and keeps that copy for the backward
    — ``h·p²`` per copy of the prompt; here ``a`` is kept once. ``v`` has ``g`` heads, ``g`` dividing
    ``h``: query head ``i`` reads value head ``i // (h/g)`` (GQA without repeating the values, so the
    backward has no sum over the copies)."""
    b, g, q, e = v.shape
    h, p = a.shape[1], a.shape[-2]
    z = a[0].reshape(g, (h // g) * p, q) @ v.permute(1, 2, 0, 3).reshape(g, q, b * e)
    return z.view(h, p, b, e).permute(2, 0, 1, 3)


def _grid_write(c: torch.Tensor, grid: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The product of a write onto a grid: ``(positions, batch, d)``, positions first, ``[p, b] = Σ_s c[b, p·width +
    s] · grid[p, s]`` for coefficients ``c (batch, positions·width)`` in their slots and ``grid (positions, width,
    d)`` in their dtype — one ``bmm`` (into ``out``: a chunk's rows of a positions-first output, no copy).
    :meth:`PositionSlots.write` on the whole grid, :func:`gather_write` on each chunk's."""
    return torch.bmm(c.view(c.shape[0], grid.shape[0], grid.shape[1]).transpose(0, 1), grid, out=out)


def _grid_read(x: torch.Tensor, grid: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The product of a read off a grid: ``(positions, batch, width)``, positions first, ``[p, b, s] = x[b, p] ·
    grid[p, s]`` for ``x (batch, positions, d)`` and ``grid (positions, width, d)`` — one ``bmm`` (into ``out`` as
    :func:`_grid_write`). :meth:`PositionSlots.read` on the whole grid, :func:`gather_read` on each chunk's."""
    return torch.bmm(x.transpose(0, 1), grid.transpose(1, 2), out=out)


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
        counts = torch.bincount(pos, minlength=n_pos) if n else torch.zeros(n_pos, dtype=torch.long, device=pos.device)
        if counts.numel() != n_pos:  # a group past the last (its length is known on the host: no device read)
            raise ShapeError(f"PositionSlots: node group ids reach {counts.numel() - 1}, past the {n_pos} groups "
                             f"(positions 0 … {n_pos - 1}); a node there would be in no chunk of the gathered passes")
        starts = torch.cumsum(counts, 0) - counts
        order = torch.argsort(pos, stable=True)  # identity for sorted positions
        slot = torch.empty_like(pos)
        slot[order] = torch.arange(n, device=pos.device) - starts[pos[order]]
        self.n_pos, self.width = n_pos, max(int(counts.max()) if n else 0, 1)
        self.flat = pos * self.width + slot
        # node i in slot i (sorted groups of equal size: a TopK coder's k per position): the grid is the nodes
        # themselves, no scatter into it nor gather out of it (in the forward or the backward)
        self.identity = n == n_pos * self.width and bool((self.flat == torch.arange(n, device=pos.device)).all())
        self.order, self._counts = order, counts
        self._bounds: list[int] | None = None  # each group's first node in ``order``, and n: read on first use

    def spans(self, groups: int) -> Iterator[tuple[int, int, int, int]]:
        """``(g0, g1, s, e)``: runs of at most ``groups`` consecutive groups and their nodes, ``order[s:e]`` — the
        chunks of :func:`gather_write` / :func:`gather_read` (one host read of the groups' sizes, on first use)."""
        if self._bounds is None:
            self._bounds = [0, *torch.cumsum(self._counts, 0).tolist()]
        for g0 in range(0, self.n_pos, max(1, groups)):
            g1 = min(g0 + max(1, groups), self.n_pos)
            yield g0, g1, self._bounds[g0], self._bounds[g1]

    def grid(self, vectors: Float[torch.Tensor, "n d"]) -> Float[torch.Tensor, "pos width d"]:
        """Vectors placed on the grid (zeros in empty slots)."""
        if self.identity:
            return vectors.contiguous().view(self.n_pos, self.width, -1)
        out = vectors.new_zeros(self.n_pos * self.width, vectors.shape[-1])
        return out.index_copy_(0, self.flat.to(vectors.device), vectors).view(self.n_pos, self.width, -1)

    def write(self, coeff: Float[torch.Tensor, "batch n"], grid: Float[torch.Tensor, "pos width d"]
              ) -> Float[torch.Tensor, "batch pos d"]:
        """``out[b, p] = Σ_{i at p} coeff[b, i] · v_i`` for ``grid = self.grid(v)`` (the vectors placed)."""
        c = coeff if self.identity else coeff.new_zeros(coeff.shape[0], self.n_pos * self.width).index_copy(
            1, self.flat.to(coeff.device), coeff)
        return _grid_write(c.to(grid.dtype), grid).transpose(0, 1).contiguous()

    def read(self, x: Float[torch.Tensor, "batch pos d"], grid: Float[torch.Tensor, "pos width d"]
             ) -> Float[torch.Tensor, "batch n"]:
        """``out[b, i] = x[b, pos_i] · u_i`` for ``grid = self.grid(u)``."""
        y = _grid_read(x, grid).transpose(0, 1).reshape(x.shape[0], -1)  # (batch, pos · width)
        return y if self.identity else y[:, self.flat.to(x.device)]


def take_rows(W: Float[torch.Tensor, "rows d"], idx: Int[torch.Tensor, " n"]) -> Float[torch.Tensor, "n d"]:
    """``W[idx]``; for a transposed view (an encoder's ``W_enc.T``) gathered along the stored matrix's rows
    (``W.T.index_select(1, idx)``, transposed back: contiguous reads, where ``W[idx]`` reads one strided
    column per node — 6× slower on a CPU at 4096 × 512). Same values."""
    if W.dim() == 2 and not W.is_contiguous() and W.T.is_contiguous():
        return W.T.index_select(1, idx).T
    return W[idx]


def per_position(err: Float[torch.Tensor, "b pos d"], mult: Float[torch.Tensor, "batch pos"]) -> torch.Tensor:
    """An error term with one multiplier per position (one error node per module and position)."""
    return err.detach() * mult[:, :, None]


#: ``"auto"`` keeps a site's grid up to this many bytes, and gathers above it
GRID_BUDGET_BYTES = 256 * 2**20
#: elements of one gathered ``(batch, chunk, d_model)`` temporary (grid-less node vectors) on the CPU
NODE_CHUNK_ELEMENTS = 2**22
#: the same on a GPU: each chunk is a few kernel launches, host time that a larger chunk amortises (a
#: transcoder site of the Llama-3.1-8B shape, 4096 tokens × top-k 64 nodes, batch 4, is 1024 chunks of
#: ``2**22`` per pass and direction, 128 of ``2**25``); at most two fp32-sized temporaries of it are live
#: (``estimate_memory``'s ``gather_chunks`` term)
NODE_CHUNK_ELEMENTS_DEVICE = 2**25


def node_chunk_elements(device: torch.device) -> int:
    """:data:`NODE_CHUNK_ELEMENTS` on the CPU, :data:`NODE_CHUNK_ELEMENTS_DEVICE` elsewhere."""
    return NODE_CHUNK_ELEMENTS if device.type == "cpu" else NODE_CHUNK_ELEMENTS_DEVICE


def _chunk_grid(slots: PositionSlots, W: torch.Tensor, idx: torch.Tensor, g0: int, g1: int, s: int, e: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The positions ``[g0, g1)``'s grid ``(g1 − g0, width, d)`` in ``dtype`` — their nodes' rows of ``W``
    (``order[s:e]``) in their slots, zeros in empty ones — and where the nodes sit in it (``(e − s,)``; None: slot
    ``i`` is node ``s + i``, :attr:`PositionSlots.identity`)."""
    if slots.identity:
        return W[idx[s:e]].to(dtype).view(g1 - g0, slots.width, -1), None
    nodes = slots.order[s:e]
    local = slots.flat[nodes] - g0 * slots.width
    grid = torch.zeros((g1 - g0) * slots.width, W.shape[-1], dtype=dtype, device=W.device)
    return grid.index_copy_(0, local, W[idx[nodes]].to(dtype)).view(g1 - g0, slots.width, -1), local


def _positions_per_chunk(slots: PositionSlots, batch: int, d: int, device: torch.device) -> int:
    """Positions per chunk of :func:`gather_write` / :func:`gather_read`: their grid ``(·, width, d)`` and their
    ``(·, batch, d)`` product each at most :func:`node_chunk_elements` numbers."""
    return max(1, node_chunk_elements(device) // max(1, max(slots.width, batch) * d))


def gather_write(coeff: torch.Tensor, W: torch.Tensor, idx: torch.Tensor, pos: torch.Tensor, n_pos: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """``out[b, p] = Σ_{i at p} coeff[b, i] · W[idx_i]``, ``(batch, n_pos, d)`` in ``dtype``.

    By chunks of positions (:class:`PositionSlots` of ``pos``; :class:`GatheredNodes` makes them once), each a grid
    product — the chunk's nodes' rows gathered onto its ``(positions, width, d)`` grid, one ``bmm`` with their
    coefficients (:meth:`PositionSlots.write`'s, on the chunk): ``n·d + batch·n_pos·d`` numbers read and written,
    where a ``(batch, chunk, d)`` product per node was ``batch·n·d`` (3× that traffic at every chunk, the frozen
    backward's largest cost on the CPU: 4.2 of 5.7 s at 512 tokens, issue 21).
    In bf16/fp16 the nodes at one position are summed in fp32 and rounded once (an fp32 grid and ``out``), so the
    result does not depend on the run (CUDA's atomic ``index_add_`` varied it; summed in bf16, two runs of the same
    lean graph differed by up to 14 % of max |A| on an H200)."""
    return _slot_write(coeff, W, idx, PositionSlots(pos, n_pos), dtype)


def _slot_write(coeff: torch.Tensor, W: torch.Tensor, idx: torch.Tensor, slots: PositionSlots,
                dtype: torch.dtype) -> torch.Tensor:
    """:func:`gather_write` on the nodes' :class:`PositionSlots`."""
    n_pos = slots.n_pos
    b = coeff.shape[0]
    W = W.to(coeff.device, non_blocking=W.is_pinned())  # rows kept elsewhere (offloaded): here for this pass only
    acc = torch.float32 if dtype.itemsize < 4 else dtype  # bf16/fp16: summed in fp32, rounded once
    # positions first: each chunk's product lands in its rows (``bmm(out=)``, no copy a chunk) — fewer dispatched
    # operators a chunk (issue 21, tests/attribution/test_gathered_chunk_kernels.py)
    out = torch.zeros(n_pos, b, W.shape[-1], dtype=acc, device=coeff.device)
    for g0, g1, s, e in slots.spans(_positions_per_chunk(slots, b, W.shape[-1], coeff.device)):
        if e == s:
            continue
        grid, local = _chunk_grid(slots, W, idx, g0, g1, s, e, acc)
        if local is None:
            c = coeff[:, s:e].to(acc)
        else:
            c = coeff.new_zeros(b, (g1 - g0) * slots.width, dtype=acc).index_copy_(
                1, local, coeff[:, slots.order[s:e]].to(acc))
        _grid_write(c, grid, out=out[g0:g1])
        del grid, c
    if acc == dtype:  # the sums are the result: its (batch, pos, d) view, no copy (the memory of the former layout)
        return out.transpose(0, 1)
    # rounded once to ``dtype`` by one transposing copy
    return torch.empty(b, n_pos, W.shape[-1], dtype=dtype, device=coeff.device).copy_(out.transpose(0, 1))


def gather_read(x: torch.Tensor, W: torch.Tensor, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``out[b, i] = x[b, pos_i] · W[idx_i]``, ``(batch, n)`` in ``x``'s dtype: by chunks of positions, each a grid
    product (:func:`gather_write`; :meth:`PositionSlots.read`'s, on the chunk)."""
    return _slot_read(x, W, idx, PositionSlots(pos, x.shape[1]))


def _slot_read(x: torch.Tensor, W: torch.Tensor, idx: torch.Tensor, slots: PositionSlots) -> torch.Tensor:
    """:func:`gather_read` on the nodes' :class:`PositionSlots`."""
    b = x.shape[0]
    W = W.to(x.device, non_blocking=W.is_pinned())  # rows kept elsewhere (offloaded): here for this pass only
    if slots.identity:  # positions first: each chunk's product lands in its rows (``bmm(out=)``), one
        # transposing copy at the end — two operators a chunk where a reshape and a copy made four (issue 21)
        out_t = x.new_empty(slots.n_pos, b, slots.width)
        for g0, g1, s, e in slots.spans(_positions_per_chunk(slots, b, W.shape[-1], x.device)):
            grid, _ = _chunk_grid(slots, W, idx, g0, g1, s, e, x.dtype)
            _grid_read(x[:, g0:g1], grid, out=out_t[g0:g1])
            del grid
        out = x.new_empty(b, idx.numel())
        out.view(b, slots.n_pos, slots.width).copy_(out_t.transpose(0, 1))
        return out
    out = x.new_empty(b, idx.numel())
    for g0, g1, s, e in slots.spans(_positions_per_chunk(slots, b, W.shape[-1], x.device)):
        if e == s:
            continue
        grid, local = _chunk_grid(slots, W, idx, g0, g1, s, e, x.dtype)
        y = _grid_read(x[:, g0:g1], grid).transpose(0, 1)  # (batch, positions, width)
        out[:, slots.order[s:e]] = y.reshape(b, -1)[:, local]
        del grid, y
    return out


class _Write(torch.autograd.Function):
    """:func:`gather_write` with gradient to ``coeff`` only (``W`` is a constant of the frozen model)."""

    @staticmethod
    def forward(ctx: Any, coeff: torch.Tensor, W: torch.Tensor, idx: torch.Tensor, slots: PositionSlots,
                dtype: torch.dtype) -> torch.Tensor:
        ctx.W, ctx.idx, ctx.slots, ctx.coeff_dtype = W, idx, slots, coeff.dtype
        return _slot_write(coeff, W, idx, slots, dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _slot_read(grad, ctx.W, ctx.idx, ctx.slots).to(ctx.coeff_dtype), None, None, None, None


class _Read(torch.autograd.Function):
    """:func:`gather_read` with gradient to ``x`` only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, W: torch.Tensor, idx: torch.Tensor, slots: PositionSlots) -> torch.Tensor:
        ctx.W, ctx.idx, ctx.slots, ctx.x_dtype = W, idx, slots, x.dtype
        return _slot_read(x, W, idx, slots)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _slot_write(grad, ctx.W, ctx.idx, ctx.slots, ctx.x_dtype), None, None, None


class _StreamedLinear(torch.autograd.Function):
    """``x Wᵀ`` with ``W`` kept where it is (the host, for an offloaded module): copied to ``x``'s device for
    the forward and again for each backward, never kept there; gradient to ``x`` only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        ctx.W = W
        return F.linear(x, W.to(x.device, non_blocking=W.is_pinned()))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad @ ctx.W.to(grad.device, non_blocking=ctx.W.is_pinned()), None


def streamed_linear(x: Float[torch.Tensor, "*b d"], W: Float[torch.Tensor, "n d"]) -> Float[torch.Tensor, "*b n"]:
    """``F.linear(x, W)`` for a ``W`` on another device than ``x`` (e.g. pinned host rows of an offloaded
    module): the copy lives only while the forward or one backward runs (:class:`_StreamedLinear`)."""
    if W.device == x.device:
        return F.linear(x, W.to(x.dtype))
    return _StreamedLinear.apply(x, W.to(x.dtype))


class GridNodes:
    """Node vectors on a :class:`PositionSlots` grid (one ``(n, d)`` copy, kept)."""

    def __init__(self, slots: PositionSlots, grid: Float[torch.Tensor, "pos width d"]) -> None:
        self.slots, self.grid = slots, grid

    def write(self, coeff: Float[torch.Tensor, "batch n"]) -> Float[torch.Tensor, "batch pos d"]:
        return self.slots.write(coeff, self.grid)

    def read(self, x: Float[torch.Tensor, "batch pos d"]) -> Float[torch.Tensor, "batch n"]:
        return self.slots.read(x, self.grid)


class GatheredNodes:
    """Node vectors gathered from ``W`` by chunks of positions, in the forward and again in the backward
    (:func:`gather_write` / :func:`gather_read`).

    Args:
        W: ``(rows, d)`` the matrix whose row ``idx_i`` is node ``i``'s vector (detached).
        idx: ``(n,)`` int64 row of each node.
        slots: the nodes' :class:`PositionSlots` over the prompt's positions (made once, the site's own).
        dtype: the dtype of the written output (the model's).
    """

    def __init__(self, W: torch.Tensor, idx: Int[torch.Tensor, " n"], slots: PositionSlots, dtype: torch.dtype) -> None:
        self.W, self.idx, self.slots, self.dtype = W.detach(), idx, slots, dtype

    def write(self, coeff: Float[torch.Tensor, "batch n"]) -> Float[torch.Tensor, "batch pos d"]:
        return _Write.apply(coeff, self.W, self.idx, self.slots, self.dtype)

    def read(self, x: Float[torch.Tensor, "batch pos d"]) -> Float[torch.Tensor, "batch n"]:
        return _Read.apply(x, self.W, self.idx, self.slots)


def choose(mode: str, n: int, d: int, dtype: torch.dtype, copies: int = 1) -> str:
    """``"grid"`` or ``"gather"`` for a site of ``n`` nodes: ``mode`` itself, or for ``"auto"`` the grid
    while the ``copies`` grids of ``n·d`` numbers that the same nodes would keep together fit
    :data:`GRID_BUDGET_BYTES` (``copies``: a cross-layer transcoder layer's decoder grids, one per replaced MLP
    it writes into, :meth:`.layout.Layout.decoder_targets`; each of them was held to the budget alone until
    2026-11-26, so a 26-layer CLT could keep 351 grids of up to 256 MiB)."""
    if mode != "auto":
        return mode
    size = torch.empty((), dtype=dtype, device="meta").element_size()
    return "grid" if n * d * size * max(1, copies) <= GRID_BUDGET_BYTES else "gather"


#: elements of one step's ``(batch, pos, slots)`` gathered-values temporary (recomputed Lorsa pattern rows,
#: :class:`PatternRows`) on the CPU; a step's ``(heads, pos, d_qk)`` fp32 key block is held to it as well
ROW_CHUNK_ELEMENTS = 2**22
#: the same on a GPU: each step is ~20 dispatched operators, host time that a larger step amortises (the
#: Llama-3.1-8B Lorsa at 1024 tokens, batch 4: 256 QK heads, ~512 nodes each, was 256 steps per layer and
#: direction, one per QK head, and is 16 of ``2**25``); counted by ``estimate_memory``'s ``row_chunks`` term
ROW_CHUNK_ELEMENTS_DEVICE = 2**25


def row_chunk_elements(device: torch.device) -> int:
    """:data:`ROW_CHUNK_ELEMENTS` on the CPU, :data:`ROW_CHUNK_ELEMENTS_DEVICE` elsewhere."""
    return ROW_CHUNK_ELEMENTS if device.type == "cpu" else ROW_CHUNK_ELEMENTS_DEVICE


#: how :func:`z_pre` contracts the recomputed rows with the values, per device type (absent: True). True, the *head
#: product*: per step one ``bmm`` of the rows with the values of every OV head of the step's QK heads, each node's
#: entry picked from it, and backward one ``bmm`` of the rows with the gradients scattered on that grid — dense
#: products (``group_size``× the FLOPs) instead of a ``(batch, pos, slots)`` gather, multiply and sum (backward an
#: ``index_add_`` of as many numbers, whose nodes of one OV head collide): on a GPU the traffic and the atomics were
#: the cost, and tensor cores make the FLOPs cheap. False, the *gather*: what the CPU, where the FLOPs are the cost,
#: runs.
HEAD_PRODUCT: dict[str, bool] = {"cpu": False}


def head_product(device: torch.device) -> bool:
    """Whether :func:`z_pre` runs the head product on ``device`` (:data:`HEAD_PRODUCT`)."""
    return HEAD_PRODUCT.get(device.type, True)


class RowStep(NamedTuple):
    """One step of :func:`plan_rows`: pieces ``[piece, piece + heads)`` (of one QK head each: its nodes
    ``[col, col + length)``), ``width`` slots each (the first piece's length, the longest), flat slots
    ``[first, first + heads·width)``."""

    piece: int
    heads: int
    width: int
    first: int


def plan_rows(counts: list[int], n_pos: int, batch: int, d_qk: int, elements: int, group_size: int = 0
              ) -> tuple[list[tuple[int, int, int]], list[RowStep]]:
    """The steps of :class:`PatternRows` for ``counts[g]`` nodes of QK head ``g``: ``(pieces, steps)``.

    A QK head's nodes are cut into pieces ``(length, head, col)`` of at most ``elements // (batch·n_pos)`` slots
    (one step's ``(batch, pos, slots)`` values); the pieces, longest first, are packed into steps of consecutive
    pieces, each padded to the first's length, while the step's slots fit, its heads' fp32 keys fit
    (``heads·n_pos·d_qk`` ≤ ``elements``) and its padding stays at most its nodes. A step so holds whole runs of
    few heads' nodes, whose OV heads are neighbours (the values are gathered with the locality of one head's), and
    the steps number at most ``4·batch·n_pos·n / elements + pieces / (elements // (n_pos·d_qk)) + log2(most) + 2``
    (``n`` nodes; a step ended by its padding halves the next one's width) — not one per QK head. ``group_size`` > 0
    (the head product, :data:`HEAD_PRODUCT`): no ``(batch, pos, slots)`` temporary, so a step's slots are held to
    ``elements // max(n_pos, group_size·batch)`` (its rows, as the scores, and its product or scattered gradients,
    ``(slots, group_size·batch)``: ``batch``× fewer steps past ``group_size`` tokens), and its heads' values
    ``(group_size·batch, n_pos)`` each fit ``elements`` too, instead of the keys where those are larger."""
    per_slot = max(n_pos, group_size * batch) if group_size else batch * n_pos
    slots = max(1, elements // max(1, per_slot))
    most_heads = max(1, elements // max(1, n_pos * max(d_qk, group_size * batch)))
    pieces = sorted(((min(slots, c - c0), g, c0) for g, c in enumerate(counts) for c0 in range(0, c, slots)),
                    key=lambda p: -p[0])
    steps: list[RowStep] = []
    i = first = 0
    while i < len(pieces):
        width, j, real = pieces[i][0], i + 1, pieces[i][0]
        while (j < len(pieces) and (j - i + 1) * width <= slots and j - i + 1 <= most_heads
               and (j - i + 1) * width <= 2 * (real + pieces[j][0])):
            real += pieces[j][0]
            j += 1
        steps.append(RowStep(i, j - i, width, first))
        first += (j - i) * width
        i = j
    return pieces, steps


def row_step_bytes(step: RowStep, n_pos: int, batch: int, d_qk: int, itemsize: int, qk_itemsize: int,
                   group_size: int = 0, n_values: int = 0) -> int:
    """The transient bytes of one :func:`plan_rows` step (forward or backward of :func:`z_pre`): its heads' keys
    and its slots' queries as gathered (``qk_itemsize``) and, half ones, their fp32 copies (the CPU's
    :func:`~nnsight_lorsa._placement.bmm_f32`; an accelerator multiplies the half ones as they are: a bound there),
    then the larger of making the rows — the scores and their softmax in at least fp32, ``(slots, pos)`` each, then
    the softmax and the rows transposed in ``itemsize`` — and using them: the rows and one ``(batch, pos, slots)``
    in ``itemsize`` (the values gathered, multiplied in place; in the backward the rows times the gradient); and the
    step's int64 indices and ``(batch, slots)`` results. ``group_size`` > 0, the head product (:data:`HEAD_PRODUCT`):
    using them is the rows, the step's heads' values ``heads·group_size·batch·pos`` and their product with the rows
    ``heads·group_size·batch·width`` (forward, beside the values transposed, ``(n_values + 1, batch, pos)``, held
    through its steps), or the gradients scattered on that grid, their product with the rows and its rows of the OV
    heads with nodes copied out (backward; ``grad_v``, a result, not counted here)."""
    slots = step.heads * step.width
    qk = (step.heads * n_pos + slots) * d_qk
    wide = max(4, qk_itemsize)  # the scores' and softmax's bytes per number
    making = max(2 * wide, wide + itemsize) * slots * n_pos
    if group_size:
        grid = step.heads * group_size * batch
        forward = (slots * n_pos + grid * n_pos + grid * step.width) * itemsize  # the rows, the values, the product
        held = (n_values + 1) * batch * n_pos * itemsize  # the values transposed, through the forward's steps
        # backward: the rows, the scattered gradients, their product and its rows with nodes (grad_v: a result)
        rows_on = max(held + max(making, forward), max(making, forward + grid * n_pos))
    else:
        rows_on = max(making, (1 + batch) * slots * n_pos * itemsize)
    return qk * (qk_itemsize + (4 if qk_itemsize < 4 else 0)) + rows_on + 8 * slots * (3 + 2 * batch)


class _Plan(NamedTuple):
    steps: list[RowStep]
    groups: torch.Tensor  # (pieces,) the QK head of each piece, in the steps' order
    slot_node: torch.Tensor  # (slots,) the node in each slot, n (the padding's dummy node) where padded
    # the head product's (empty lists for the gather): per step, the values' column of each (head, OV head) of its
    # heads (``(heads·group_size,)``, n_values where that OV head has no node), and the places of those with nodes
    head_cols: list[torch.Tensor]
    valid: list[torch.Tensor]


class PatternRows:
    """The nodes' pattern rows, computed on demand from frozen queries and keys, many QK heads per step
    (:func:`plan_rows`: one ``bmm`` of the step's slots' queries and their heads' keys).

    Args:
        q, k: ``(n_qk, pos, d_qk)`` frozen queries and keys (QK-norm and RoPE applied).
        group: ``(n,)`` QK head of each node; ``qpos``: ``(n,)`` its query position.
        scale: the divisor of the scores (``LorsaConfig.scale``).
        heads: ``(n,)`` each node's OV head (``group · group_size`` + its place in the QK head's group) and
            ``group_size``: for the head product (:data:`HEAD_PRODUCT`), with :func:`z_pre`'s values' columns the
            OV heads ``heads.unique()`` in order. None: the gather only.
    """

    def __init__(self, q: torch.Tensor, k: torch.Tensor, group: Int[torch.Tensor, " n"], qpos: Int[torch.Tensor, " n"],
                 scale: float, heads: Int[torch.Tensor, " n"] | None = None, group_size: int = 0) -> None:
        self.q, self.k, self.scale, self.n = q, k, scale, group.numel()
        # a padded slot's node: query position 0 (its row attends to key 0 alone: finite, never all masked)
        self.qpos_pad = torch.cat([qpos, qpos.new_zeros(1)])
        self.order = torch.argsort(group, stable=True)  # nodes by QK head, each head's in their order
        self.counts = torch.bincount(group, minlength=q.shape[0]).tolist()  # one host read per layer and pass
        self.group_size = group_size if heads is not None and group_size > 0 and head_product(q.device) else 0
        if heads is not None and self.group_size:
            uniq = torch.unique(heads).to(HOST)  # one host read per layer and pass, as the counts
            self.n_values = int(uniq.numel())
            # on the host, for the plans: each (QK head, place in its group)'s values column, n_values (a zero
            # column) where that OV head has no node
            self.head_cols = torch.full((q.shape[0] * group_size,), self.n_values, dtype=torch.long, device=HOST)
            self.head_cols[uniq] = torch.arange(self.n_values, device=HOST)
            self.head_cols = self.head_cols.view(q.shape[0], group_size)
            # each node's place in its QK head's group; the padding's (node n) 0
            self.local_pad = torch.cat([torch.remainder(heads, group_size), heads.new_zeros(1)])
        self._plans: dict[tuple[int, int], _Plan] = {}

    def plan(self, batch: int) -> _Plan:
        """The steps for ``batch`` copies and their slots' nodes (made once per batch size and step budget: one
        host→device copy)."""
        elements = row_chunk_elements(self.q.device)
        key = (batch, elements)
        if key not in self._plans:
            pieces, steps = plan_rows(self.counts, self.q.shape[1], batch, self.q.shape[2], elements, self.group_size)
            # the plan is made on the host (from the host counts) and copied to q's device once
            counts = torch.tensor(self.counts, dtype=torch.long, device=HOST)
            length, grp, col0 = torch.tensor(pieces, dtype=torch.long, device=HOST).reshape(-1, 3).unbind(1)
            at0 = (counts.cumsum(0) - counts)[grp] + col0  # each piece's first node, in self.order
            parts = [grp]
            for st in steps:
                cols = torch.arange(st.width, device=HOST)
                sl = slice(st.piece, st.piece + st.heads)
                parts.append(torch.where(cols < length[sl, None], at0[sl, None] + cols, self.n).reshape(-1))
            flat = torch.cat(parts).to(self.q.device)
            order_pad = torch.cat([self.order, self.order.new_full((1,), self.n)])
            head_cols: list[torch.Tensor] = []
            valid: list[torch.Tensor] = []
            if self.group_size:  # per step its heads' values columns and the places with nodes, made on the host
                per_step = []
                for st in steps:
                    cols = self.head_cols[grp[st.piece:st.piece + st.heads]].reshape(-1)
                    per_step += [cols, (cols < self.n_values).nonzero().flatten()]
                if per_step:
                    sizes = [t.numel() for t in per_step]
                    on_device = list(torch.cat(per_step).to(self.q.device).split(sizes))  # one host→device copy
                    head_cols, valid = on_device[0::2], on_device[1::2]
            self._plans[key] = _Plan(steps, flat[:len(pieces)], order_pad[flat[len(pieces):]], head_cols, valid)
        return self._plans[key]

    def tiles(self, batch: int, dtype: torch.dtype, transposed: bool = True
              ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(slots' nodes, their pattern rows transposed, (pos, slots))`` per step (``transposed=False``: the rows as
        made, ``(heads, width, pos)``): the scores in at least fp32 (:func:`~nnsight_lorsa._placement.bmm_f32`: bf16 /
        fp16 queries and keys on tensor cores with an fp32 result on an accelerator), causal softmax, cast to
        ``dtype``; a padded slot's node is ``n`` and its row finite."""
        plan = self.plan(batch)
        future_of = torch.arange(self.k.shape[1], device=self.k.device)
        for st in plan.steps:
            heads = plan.groups[st.piece:st.piece + st.heads]
            nodes = plan.slot_node[st.first:st.first + st.heads * st.width]
            qpos = self.qpos_pad[nodes].view(st.heads, st.width)
            scores = bmm_f32(self.q[heads[:, None], qpos], self.k[heads].transpose(1, 2)).div_(self.scale)
            scores.masked_fill_(future_of > qpos[..., None], float("-inf"))
            rows = scores.softmax(-1)
            del scores  # not held while the rows are cast, nor the fp32 rows once copied
            if transposed:  # (pos, slots), contiguous: the gather's values' and gradient's layout (a transposed
                # view, read across the slots at a stride of pos, made the products 2-3x slower on the CPU)
                flat = rows.view(st.heads * st.width, -1)
                rows = torch.empty(flat.shape[1], flat.shape[0], dtype=dtype, device=flat.device).copy_(flat.T)
                del flat
            else:
                rows = rows.to(dtype)
            yield nodes, rows
            del rows


class _ZPre(torch.autograd.Function):
    """``z_pre[b, n] = rows_n · v[b, :, col_n]`` with gradient to ``v`` only."""

    @staticmethod
    def forward(ctx: Any, v: torch.Tensor, rows: PatternRows, col: torch.Tensor) -> torch.Tensor:
        n = col.numel()
        col_pad = torch.cat([col, col.new_zeros(1)])  # a padded slot reads column 0, written to the dummy node n
        ctx.rows, ctx.col_pad, ctx.shape = rows, col_pad, v.shape
        out = v.new_zeros(v.shape[0], n + 1)
        if rows.group_size:
            _head_product_forward(v, rows, out)
            return out[:, :n]
        for nodes, r_t in rows.tiles(v.shape[0], v.dtype):
            vals = v[:, :, col_pad[nodes]]  # (batch, pos, slots): a step's heads are few, their columns near
            out.index_copy_(1, nodes, vals.mul_(r_t).sum(1))
            del vals, r_t  # not held while the next step's rows are made
        return out[:, :n]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        rows, col_pad = ctx.rows, ctx.col_pad
        grad_pad = torch.cat([grad, grad.new_zeros(grad.shape[0], 1)], 1)  # a padded slot's gradient: 0
        if rows.group_size:
            return _head_product_backward(grad_pad, rows, ctx.shape), None, None
        grad_v = grad.new_zeros(ctx.shape)
        for nodes, r_t in rows.tiles(grad.shape[0], grad.dtype):
            grad_v.index_add_(2, col_pad[nodes], r_t * grad_pad[:, None, nodes])
            del r_t
        return grad_v, None, None


def _slot_grid(rows: PatternRows, nodes: torch.Tensor, heads: int, width: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(head, place, slot)`` index grids ``(heads, width)`` of a head-product step: each slot's place (its node's
    OV head's place in its QK head's group) in the step's ``(heads, group_size)`` values."""
    h = torch.arange(heads, device=nodes.device)[:, None].expand(heads, width)
    w = torch.arange(width, device=nodes.device)[None].expand(heads, width)
    return h, rows.local_pad[nodes].view(heads, width), w


def _head_product_forward(v: torch.Tensor, rows: PatternRows, out: torch.Tensor) -> None:
    """:func:`z_pre`'s head product (:data:`HEAD_PRODUCT`), into ``out: (batch, n + 1)``: per step the rows
    ``(heads, width, pos)`` times every OV head's values of the step's QK heads, ``(heads, pos, group·batch)``
    gathered from the values transposed once, ``(n_values + 1, batch, pos)`` (the last a zero column: an OV head
    without nodes), then each slot's own OV head's entry."""
    b, p, u = v.shape
    g = rows.group_size
    vt = torch.cat([v.permute(2, 0, 1), v.new_zeros(1, b, p)])  # (u + 1, batch, pos), contiguous
    plan = rows.plan(b)
    for st, cols, (nodes, r) in zip(plan.steps, plan.head_cols, rows.tiles(b, v.dtype, transposed=False),
                                    strict=True):
        vals = vt[cols].view(st.heads, g * b, p)
        # the rows as made (a transposed operand of the larger is a copy on the CPU); (heads, width, group, batch)
        prod = torch.bmm(r, vals.transpose(1, 2)).view(st.heads, st.width, g, b)
        del vals, r
        h, place, w = _slot_grid(rows, nodes, st.heads, st.width)
        out.index_copy_(1, nodes, prod[h, w, place].reshape(-1, b).T)  # (heads, width, batch) -> (batch, slots)
        del prod


def _head_product_backward(grad_pad: torch.Tensor, rows: PatternRows, shape: torch.Size) -> torch.Tensor:
    """``grad_v (batch, pos, n_values)`` of the head product: per step each slot's gradient scattered on the
    ``(heads, group, batch, width)`` grid, times the rows, ``(heads, group·batch, pos)``; the rows of the OV heads
    with nodes added to their columns (``(n_values, batch, pos)``, returned transposed: a view)."""
    b, p, u = shape
    g = rows.group_size
    grad_vt = grad_pad.new_zeros(u, b, p)
    plan = rows.plan(b)
    for st, cols, valid, (nodes, r) in zip(plan.steps, plan.head_cols, plan.valid,
                                           rows.tiles(b, grad_pad.dtype, transposed=False), strict=True):
        grid = grad_pad.new_zeros(st.heads, g, b, st.width)
        h, place, w = _slot_grid(rows, nodes, st.heads, st.width)
        grid[h, place, :, w] = grad_pad[:, nodes].T.view(st.heads, st.width, b)  # a padded slot's: 0
        grads = torch.bmm(grid.view(st.heads, g * b, st.width), r).view(st.heads * g, b, p)
        del grid, r
        # only the OV heads with nodes; a QK head is in a step once (only its last piece is not full): no column twice
        grad_vt.index_add_(0, cols[valid], grads[valid])
        del grads
    return grad_vt.permute(1, 2, 0)


def z_pre(v: Float[torch.Tensor, "batch pos u"], rows: PatternRows, col: Int[torch.Tensor, " n"]
          ) -> Float[torch.Tensor, "batch n"]:
    """The nodes' ``z_pre`` from ``v``: the values of the OV heads active somewhere (column ``col_n``
    is node ``n``'s head; with ``rows`` made with ``heads``, the head product's columns ``heads.unique()`` in order:
    the same), through their recomputed pattern rows — the gather or the head product, as ``rows`` was made
    (:data:`HEAD_PRODUCT` of its device). ``(batch, n)`` in ``v``'s dtype, on its device; gradient to ``v`` only
    (Lorsa paper §3.1)."""
    return _ZPre.apply(v, rows, col)
