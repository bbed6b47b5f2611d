"""Low-Rank Sparse Attention (Lorsa): many rank-1 OV heads sharing grouped QK heads, top-k sparse.

Lorsa paper (He et al. 2025) §3: for OV head ``h`` with QK head ``g(h) = h // G``,

    A^g     = softmax_causal((x W_Q^g + b_Q^g)(x W_K^g + b_K^g)^T / attn_scale)   (RoPE on q, k)
    v^h     = x w_v^h + b_v^h                                   (one scalar per token)
    z^h_i   = sum_{j<=i} A^g_ij v^h_j                            (head activation, §3.1)
    out_i   = sum_{h in topk_i(ReLU(z_i))} z^h_i w_o^h + b_D     (top-k over heads per token)

With ``‖w_o^h‖ = 1`` (footnote 1, kept by :meth:`Lorsa.normalize_decoder_`) ``z^h`` is the norm of
head ``h``'s output. All ``n_ov_heads`` z are computed by ONE ``scaled_dot_product_attention``
call: the ``G`` OV heads of a QK head are that head's value dimension (no per-head loop).

Parameter names and shapes follow the Lorsa authors' code (OpenMOSS Llamascopium ``lorsa.py``):
``W_Q, W_K: (n_qk, d_model, d_qk)``, ``b_Q, b_K: (n_qk, d_qk)``, ``W_V, W_O: (n_ov, d_model)``,
``b_V: (n_ov,)``, ``b_D: (d_model,)``, and ``ln_q.w, ln_k.w: (n_qk, d_qk)`` with QK-norm.

Decoding: :meth:`Lorsa.forward_step` runs the newest positions against a :class:`LorsaKV` (the keys
per QK head and scalar values per OV head of the earlier positions), exactly what :meth:`Lorsa.forward`
on the whole sequence gives at those positions — the Lorsa's own KV cache for generation.

Needs torch only. Internals pass through :class:`HookPoint` children so that, attached to an
nnsight model, each is an envoy (``hook_q``, ``hook_k``, ``hook_v``, ``hook_z_pre``, ``hook_z``,
``hook_out``; ``hook_error`` carries the error term when spliced into a model with ``error=True``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_flag, is_int
from .._placement import bmm_f32, is_index_dtype
from .._repr import FieldsRepr
from .._typing import Float, Int
from ..errors import ArgumentError, PlacementError, ShapeError
from .hook_point import HookPoint
from .lorsa_config import LorsaConfig
from .replacement_module import ReplacementModule, check_construction
from .rotary import apply_rotary, rotary_cos_sin, rotary_table
from .sparse_coder import check_dtype, shared_pre

if TYPE_CHECKING:
    from ..adapters.base import MHSAWeights


@torch.no_grad()
def _normal_(w: torch.Tensor, std: float, generator: torch.Generator | None) -> None:
    """Fill ``w`` with ``N(0, std²)`` drawn on ``generator``'s device (the CPU without one) in fp32, then cast
    and copied: the same values whichever device and dtype ``w`` is in (up to the cast), and the same numbers
    taken from the generator (as :mod:`.sparse_coder`'s inits; ``meta``: left unset)."""
    if w.is_meta:
        return
    device = generator.device if generator is not None else torch.device("cpu")
    if w.device == device and w.dtype == torch.float32:
        w.normal_(0.0, std, generator=generator)
    else:
        w.copy_(torch.empty(w.shape, dtype=torch.float32, device=device).normal_(0.0, std, generator=generator))


class PerHeadRMSNorm(nn.Module):
    """RMSNorm over the last dim of ``(batch, heads, seq, d_head)`` with a weight per head.

    ``w: (n_heads, d_head)``; computed in fp32 like transformers' ``LlamaRMSNorm`` (Qwen3 QK-norm), in fp64 for an
    fp64 input (transformers' downcasts it to fp32: until 2026-11-28 ours did too, exact to ~1e-8 only).
    """

    def __init__(self, n_heads: int, d_head: int, eps: float, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super(PerHeadRMSNorm, self).__init__()
        self.w = nn.Parameter(torch.ones(n_heads, d_head, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: Float[torch.Tensor, "batch heads seq d"]) -> Float[torch.Tensor, "batch heads seq d"]:
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))  # fp32 for bf16 / fp16 / fp32, fp64 for fp64
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.w[:, None, :] * x.to(dtype)


@dataclass(frozen=True, repr=False)
class LorsaKV(FieldsRepr):
    """The keys and values of the positions a Lorsa has seen so far in one decoding run.

    What :meth:`Lorsa.forward_step` attends to besides the positions it is called with (the
    Lorsa analogue of a transformer's KV cache; exact: the same keys and values a
    whole-sequence forward computes). Immutable: each step returns a new one.

    Attributes:
        k: rotated keys per QK head, ``(batch, n_qk_heads, past, d_qk_head)`` (after ``hook_k``).
        v: scalar values per OV head, ``(batch, past, n_ov_heads)`` (after ``hook_v``).

    Source: ours (incremental decoding for a Lorsa; transformers keeps a KV cache the same way).
    """

    k: torch.Tensor
    v: torch.Tensor

    @property
    def length(self) -> int:
        """How many positions it holds (``past``).

        Source: ours (incremental decoding for a Lorsa; transformers keeps a KV cache the same way).
        """
        return int(self.v.shape[1])

    def crop(self, length: int) -> LorsaKV:
        """The first ``length`` positions (a decoder that rolled its own cache back, e.g. rejected
        draft tokens of assisted decoding).

        Raises:
            ArgumentError: ``length`` not an int in ``[0, self.length]`` (no negative, Python-style crop).

        Source: ours (incremental decoding for a Lorsa; transformers keeps a KV cache the same way).
        """
        if not is_int(length) or not 0 <= length <= self.length:
            raise ArgumentError(f"LorsaKV.crop: length must be an int in [0, {self.length}], got {length!r}")
        return LorsaKV(self.k[:, :, :length], self.v[:, :length])


@dataclass(repr=False)
class LorsaCache(FieldsRepr):
    """Internals of one Lorsa forward, returned with ``return_cache=True``.

    Attributes:
        z_pre: ``(batch, pos, n_ov_heads)`` head activations before ReLU/top-k.
        z: ``(batch, pos, n_ov_heads)`` head activations after ReLU + top-k (zeros elsewhere).
        topk_indices: ``(batch, pos, top_k)`` int64 indices of the kept heads (active if ``z > 0``).
        out: ``(batch, pos, d_model)`` Lorsa output.
    """

    z_pre: torch.Tensor
    z: torch.Tensor
    topk_indices: torch.Tensor
    out: torch.Tensor

    @property
    def active(self) -> torch.Tensor:
        """``(batch, pos, n_ov_heads)`` bool: heads kept by top-k with a positive activation."""
        return self.z > 0


def head_indices(heads: Any, n: int, what: str, device: torch.device | str) -> torch.Tensor:
    """``heads`` (an int, a list/tuple/range of ints, or a 1-D integer tensor) as a 1-D int64 tensor on
    ``device``, every entry in ``[0, n)`` (no negative indexing: ``-1`` is refused, not the last head).

    Raises:
        ArgumentError: not an int / sequence of ints / integer tensor (bools and floats included), or empty.
        ShapeError: an index outside ``[0, n)``.
    """
    if is_int(heads):
        heads = [int(heads)]
    if isinstance(heads, torch.Tensor):
        if heads.dim() > 1 or not is_index_dtype(heads.dtype):
            raise ArgumentError(f"{what} must be head indices (a 1-D integer tensor), got shape {tuple(heads.shape)} "
                                f"dtype {heads.dtype}")
        idx = heads.to(device=device, dtype=torch.long).reshape(-1)
    elif isinstance(heads, (list, tuple, range)) and all(
            is_int(h) for h in heads):
        idx = torch.tensor([int(h) for h in heads], dtype=torch.long, device=device)
    else:
        raise ArgumentError(f"{what} must be an int, a list of ints or an integer tensor, got {heads!r}")
    if idx.numel() == 0:
        raise ArgumentError(f"{what} is empty: give at least one head index")
    if int(idx.min()) < 0 or int(idx.max()) >= n:
        raise ShapeError(f"{what} must be in [0, {n}), got {idx.tolist()}")
    return idx


class Lorsa(ReplacementModule):
    """A Lorsa layer; see the module docstring for the equations.

    ``forward(x, positions=None, attn_mask=None)`` maps the attention's input hidden states
    ``x: (batch, pos, d_model)`` (after the pre-attention norm) to ``(batch, pos, d_model)``,
    the approximation of the attention's output (after the output projection);
    ``forward_step(x, positions, attn_mask, past)`` does the same for the newest positions of a
    sequence whose earlier keys and values are in ``past`` (a :class:`LorsaKV`), for decoding.

    Raises:
        ShapeError: ``x`` is not ``(batch, pos, d_model)`` or positions/mask do not fit.

    Source: Lorsa paper (He et al. 2025) §3.1; Llamascopium ``src/llamascopium/models/lorsa.py``.
    """

    def __init__(self, cfg: LorsaConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super(Lorsa, self).__init__()
        check_construction(cfg, LorsaConfig, device, dtype, "Lorsa")
        self.cfg = cfg
        h, d, e, n = cfg.n_qk_heads, cfg.d_model, cfg.d_qk_head, cfg.n_ov_heads
        self.W_Q = nn.Parameter(torch.empty(h, d, e, device=device, dtype=dtype))
        self.W_K = nn.Parameter(torch.empty(h, d, e, device=device, dtype=dtype))
        self.b_Q = nn.Parameter(torch.zeros(h, e, device=device, dtype=dtype))
        self.b_K = nn.Parameter(torch.zeros(h, e, device=device, dtype=dtype))
        self.W_V = nn.Parameter(torch.empty(n, d, device=device, dtype=dtype))
        self.b_V = nn.Parameter(torch.zeros(n, device=device, dtype=dtype))
        self.W_O = nn.Parameter(torch.empty(n, d, device=device, dtype=dtype))
        if cfg.use_decoder_bias:
            self.b_D = nn.Parameter(torch.zeros(d, device=device, dtype=dtype))
        else:
            self.register_parameter("b_D", None)
        if cfg.activation == "jumprelu":  # per-head thresholds (Llamascopium's JumpReLU), read from files
            self.register_buffer("threshold", torch.zeros(n, device=device, dtype=dtype))
        else:
            self.threshold: torch.Tensor | None = None
        if cfg.qk_norm:
            self.ln_q = PerHeadRMSNorm(h, e, cfg.qk_norm_eps, device=device, dtype=dtype)
            self.ln_k = PerHeadRMSNorm(h, e, cfg.qk_norm_eps, device=device, dtype=dtype)
        self.hook_q = HookPoint()
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        self.hook_z_pre = HookPoint()
        self.hook_z = HookPoint()
        self.hook_out = HookPoint()
        # the error term (MHSA output − Lorsa output) when spliced with error=True; unused by forward
        self.hook_error = HookPoint()
        self.reset_parameters()

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Random init as the reference implementation: xavier QK, N(0, 1/n_ov) W_V, unit-norm W_O.

        The draws are made on ``generator``'s device (the CPU's default generator without one) in fp32, then
        cast and copied to the parameters' device and dtype: a Lorsa on CUDA or in bf16 / fp64 gets the same
        init as in fp32 on the CPU. Parameters on ``meta`` are left unset.

        Source: Llamascopium ``src/llamascopium/models/lorsa.py`` (its random initialisation).
        """
        for w in (self.W_Q, self.W_K):
            fan = w.shape[1] + w.shape[2]
            _normal_(w, (2.0 / fan) ** 0.5, generator)
        _normal_(self.W_V, self.cfg.n_ov_heads ** -0.5, generator)
        _normal_(self.W_O, self.cfg.d_model ** -0.5, generator)
        for b in (self.b_Q, self.b_K, self.b_V):
            b.zero_()
        if self.b_D is not None:
            self.b_D.zero_()
        self.normalize_decoder_()

    @torch.no_grad()
    def init_from_mhsa(self, mhsa: MHSAWeights, generator: torch.Generator | None = None) -> None:
        """Initialise from the target MHSA (Lorsa paper App. B.3).

        QK: each MHSA head's ``W_Q``/``W_K`` (KV heads expanded for GQA) is copied to the
        ``n_qk_heads / n_heads`` consecutive QK heads that replace it, with biases and QK-norm
        weights (an MHSA QK-norm over the whole projection, OLMo-2's: each head's slice of its gain, in the
        Lorsa's per-head norm — a different normaliser, so those QK heads start near, not at, the MHSA
        head's pattern). OV: OV head ``h`` (in QK group ``g``, which descends from MHSA head ``m``) gets a
        random rank-1 slice of head ``m``'s OV circuit, ``w_v = W_V^m u``, ``w_o ∝ u W_O^m``
        with ``u ~ N(0, I)``, then ``w_o`` is normalised (the norm moves into ``w_v``).

        Devices and dtypes: the MHSA weights may be on any device and in any float dtype (e.g. the
        model's bf16 weights on CUDA) and the Lorsa on another; the OV products are computed in fp32 on
        the MHSA's device, one MHSA head at a time (no intermediate larger than ``1/n_heads`` of ``W_V``
        in fp32), and written into the Lorsa's parameters in their device and dtype. ``u`` is drawn on
        ``generator``'s device (the CPU's default generator without one), so the init does not depend
        on where the Lorsa or the MHSA live.

        Raises:
            ShapeError: ``d_model``/``d_qk_head`` differ from the MHSA's, or ``n_qk_heads`` is
                not a multiple of its head count.
            PlacementError: the Lorsa's parameters or the MHSA weights are on ``meta`` (not materialised).
            ArgumentError: ``mhsa`` not an ``MHSAWeights`` (``adapter.mhsa_weights(model, layer)``), ``generator``
                not None or a ``torch.Generator``.

        Source: Lorsa paper (He et al. 2025) App. B (QK initialised from the MHSA); Llamascopium
        ``src/llamascopium/models/lorsa.py``.
        """
        if not all(isinstance(getattr(mhsa, n, None), torch.Tensor) for n in ("W_Q", "W_K", "W_V", "W_O", "b_Q")):
            raise ArgumentError(f"Lorsa.init_from_mhsa(mhsa=...) must be an MHSAWeights "
                                f"(adapter.mhsa_weights(model, layer)), got a {type(mhsa).__name__}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ArgumentError(f"Lorsa.init_from_mhsa(generator=...) must be None or a torch.Generator, got a "
                                f"{type(generator).__name__}")
        cfg = self.cfg
        n_heads, d_model, head_dim = mhsa.W_Q.shape
        if d_model != cfg.d_model or head_dim != cfg.d_qk_head:
            raise ShapeError(
                f"MHSA has d_model={d_model}, head_dim={head_dim}; Lorsa has d_model={cfg.d_model}, "
                f"d_qk_head={cfg.d_qk_head} (App. B: d_qk_head must equal the MHSA head size)"
            )
        if cfg.n_qk_heads % n_heads:
            raise ShapeError(f"n_qk_heads ({cfg.n_qk_heads}) must be a multiple of the MHSA's {n_heads} heads")
        if self.W_Q.is_meta:
            raise PlacementError("Lorsa.init_from_mhsa: the Lorsa's parameters are on the meta device "
                                 "(not materialised): build it on a real device, or call to_empty(device=…) first")
        for name in ("W_Q", "W_K", "W_V", "W_O"):
            if getattr(mhsa, name).is_meta:
                raise PlacementError(f"Lorsa.init_from_mhsa: the MHSA weight {name} is on the meta device "
                                     "(the model is not materialised yet: dispatch it first)")
        rep = cfg.n_qk_heads // n_heads
        n_kv = mhsa.W_K.shape[0]
        kv_rep = n_heads // n_kv
        # QK: broadcast copies into views (n_heads | n_kv, copies, …): no repeated intermediate
        self.W_Q.view(n_heads, rep, d_model, head_dim).copy_(mhsa.W_Q[:, None])
        self.W_K.view(n_kv, kv_rep * rep, d_model, head_dim).copy_(mhsa.W_K[:, None])
        self.b_Q.view(n_heads, rep, head_dim).copy_(mhsa.b_Q[:, None])
        self.b_K.view(n_kv, kv_rep * rep, head_dim).copy_(mhsa.b_K[:, None])
        if cfg.qk_norm:
            if mhsa.q_norm is None or mhsa.k_norm is None:
                raise ShapeError("Lorsa has qk_norm=True but the MHSA has no QK-norm weights")
            # one gain per head (Qwen3, Gemma-3), or the head's slice of a whole-projection norm's gain (OLMo-2:
            # the Lorsa's normaliser is per head, the MHSA's spans all heads, so the initial pattern is not its own)
            q_gain, k_gain = (g.reshape(-1, head_dim) for g in (mhsa.q_norm, mhsa.k_norm))
            q_gain, k_gain = (g.expand(n_heads, head_dim) if g.shape[0] == 1 else
                              g.repeat_interleave(n_heads // g.shape[0], 0) for g in (q_gain, k_gain))
            self.ln_q.w.view(n_heads, rep, head_dim).copy_(q_gain[:, None])
            self.ln_k.w.view(n_heads, rep, head_dim).copy_(k_gain[:, None])
        # OV: the OV heads of MHSA head m are the contiguous block [m·per_head, (m+1)·per_head)
        # (mhsa_of_ov = arange(n_ov) // G // rep); u drawn at once (as before: the same draws)
        per_head = cfg.n_ov_heads // n_heads
        where = mhsa.W_V.device
        gen_device = generator.device if generator is not None else torch.device("cpu")
        u = torch.randn(cfg.n_ov_heads, head_dim, generator=generator, dtype=torch.float32, device=gen_device)
        for m in range(n_heads):
            rows = slice(m * per_head, (m + 1) * per_head)
            u_m = u[rows].to(where)
            self.W_V[rows].copy_(u_m @ mhsa.W_V[m // kv_rep].float().T)   # w_v = W_V^m u: (per_head, d_model)
            self.W_O[rows].copy_(u_m @ mhsa.W_O[m].float())                # w_o = u W_O^m
        self.b_V.zero_()
        self.normalize_decoder_()

    @torch.no_grad()
    def normalize_decoder_(self) -> None:
        """Rescale so every ``‖w_o^h‖ = 1``, moving the norm into ``w_v^h, b_v^h`` (footnote 1).

        Each head's contribution ``z^h w_o^h`` is unchanged; the top-k afterwards ranks heads by
        ``z^h ‖w_o^h‖`` (their output norms; Llamascopium's ``sparsity_include_decoder_norm``), so the
        output is unchanged whenever that ranking is (always when all norms are equal, as after
        training, where ``w_o`` is renormalised after every step).

        Source: Lorsa paper (He et al. 2025) §3.1, footnote 1 (unit-norm ``w_o``); Llamascopium
        ``src/llamascopium/models/lorsa.py``.
        """
        norm = self.W_O.norm(dim=1).clamp_min(1e-12)
        self.W_O.div_(norm[:, None])
        self.W_V.mul_(norm[:, None])
        self.b_V.mul_(norm)

    # --------------------------------------------------------------- forward
    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise ShapeError(f"Lorsa expects x as a tensor (batch, pos, d_model={self.cfg.d_model}), "
                             f"got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.cfg.d_model:
            raise ShapeError(
                f"Lorsa expects x of shape (batch, pos, d_model={self.cfg.d_model}), got {tuple(x.shape)}"
            )
        check_dtype(x, self.W_V, "Lorsa", "x")

    def _check_per_head(self, t: Any, method: str, name: str) -> None:
        """``t`` a floating tensor with one entry per OV head on its last dimension (``z_pre``, ``z``)."""
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[-1] != self.cfg.n_ov_heads \
                or not t.is_floating_point():
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ShapeError(f"Lorsa.{method}: {name} must be a floating tensor (..., n_ov_heads="
                             f"{self.cfg.n_ov_heads}), got {got}")

    def _check_past(self, past: Any, batch: int) -> None:
        """``past`` a :class:`LorsaKV` of this Lorsa for ``batch`` rows: ``k (batch, n_qk_heads, past, d_qk_head)``
        and ``v (batch, past, n_ov_heads)`` of one length (shapes only)."""
        if not isinstance(past, LorsaKV):
            raise ShapeError(f"Lorsa: past must be a LorsaKV (or None), got {type(past).__name__}")
        c = self.cfg
        k, v = past.k, past.v
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 4 or v.dim() != 3 \
                or tuple(k.shape[:2]) != (batch, c.n_qk_heads) or k.shape[3] != c.d_qk_head \
                or tuple(v.shape[::2]) != (batch, c.n_ov_heads) or k.shape[2] != v.shape[1]:
            ks = tuple(k.shape) if isinstance(k, torch.Tensor) else type(k).__name__
            vs = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ShapeError(f"LorsaKV does not fit this Lorsa and x (batch {batch}): k must be (batch, "
                             f"n_qk_heads={c.n_qk_heads}, past, d_qk_head={c.d_qk_head}) and v (batch, past, "
                             f"n_ov_heads={c.n_ov_heads}) of one past length; got k {ks}, v {vs}")

    def _positions(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """``positions`` (checked by :meth:`qk`) on ``x``'s device, default ``arange(pos)``."""
        if positions is None:
            return torch.arange(x.shape[1], device=x.device)
        return positions.to(x.device)

    @staticmethod
    def _check_positions(x: torch.Tensor, positions: Any) -> None:
        """``positions`` an integer ``(pos,)`` or ``(batch, pos)`` tensor for ``x`` (shapes only: nothing read)."""
        seq = x.shape[1]
        if not isinstance(positions, torch.Tensor) or positions.dim() not in (1, 2) or positions.shape[-1] != seq:
            got = tuple(positions.shape) if isinstance(positions, torch.Tensor) else type(positions).__name__
            raise ShapeError(f"positions must be (pos,) or (batch, pos) with pos={seq}, got {got}")
        if not is_index_dtype(positions.dtype):
            raise ShapeError(f"positions must be integer token positions, got dtype {positions.dtype}")

    def qk(
        self, x: Float[torch.Tensor, "batch pos d_model"], positions: Int[torch.Tensor, "*b pos"] | None = None
    ) -> tuple[Float[torch.Tensor, "batch n_qk pos d_qk"], Float[torch.Tensor, "batch n_qk pos d_qk"]]:
        """Queries and keys ``(batch, n_qk_heads, pos, d_qk_head)``: projection, QK-norm, RoPE.

        Source: Lorsa paper (He et al. 2025) §3.1; Llamascopium ``src/llamascopium/models/lorsa.py``.
        """
        self._check_input(x)
        if positions is not None:  # before any work; checked without RoPE too (unused there, a wrong one a misuse)
            self._check_positions(x, positions)
        b, s, d = x.shape
        h, e = self.cfg.n_qk_heads, self.cfg.d_qk_head
        if torch.is_grad_enabled() and x.requires_grad:
            # x needs a gradient: one fused (d_model -> 2·n_qk·d_qk) matmul (the per-head batched matmul below
            # would materialise its input gradient as (n_qk, batch·pos, d_model) before summing over heads)
            w = torch.cat([self.W_Q, self.W_K], 0).permute(1, 0, 2).reshape(d, 2 * h * e)
            bias = torch.cat([self.b_Q, self.b_K], 0).reshape(2 * h * e)
            qk = torch.addmm(bias, x.reshape(b * s, d), w).view(b, s, 2, h, e)
            q, k = qk[:, :, 0].transpose(1, 2), qk[:, :, 1].transpose(1, 2)
        else:
            # a batched matmul over the QK heads on the stored (n_qk, d_model, d_qk) weights: no copy of them
            # (the fused weight is 2·n_qk·d_model·d_qk elements, 537 MB a call at the Llama-3.1-8B shape) and
            # heads-first outputs (benchmarks/lorsa_forward_variants.py times both)
            xs = x.reshape(b * s, d).expand(h, b * s, d)
            q = torch.baddbmm(self.b_Q[:, None, :], xs, self.W_Q).view(h, b, s, e).transpose(0, 1)
            k = torch.baddbmm(self.b_K[:, None, :], xs, self.W_K).view(h, b, s, e).transpose(0, 1)
        if self.cfg.qk_norm:
            q, k = self.ln_q(q), self.ln_k(k)
        if self.cfg.rotary is not None:
            inter = self.cfg.rotary.interleaved
            cos, sin = rotary_cos_sin(self.cfg.rotary, self._positions(x, positions),
                                      dtype=torch.promote_types(q.dtype, torch.float32))  # fp64 for an fp64 Lorsa
            # without autograd: the (cos, ±sin) factors built once in q's dtype for both q and k
            table = None if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad) or q.dtype != k.dtype \
                else rotary_table(cos, sin, q.dtype, inter)
            q = apply_rotary(q, cos, sin, inter, table)
            k = apply_rotary(k, cos, sin, inter, table)
        return q, k

    def values(self, x: Float[torch.Tensor, "batch pos d_model"]) -> Float[torch.Tensor, "batch pos n_ov"]:
        """Per-head scalar values ``v = x W_V^T + b_V``: ``(batch, pos, n_ov_heads)``.

        Raises:
            ShapeError: ``x`` not a ``(batch, pos, d_model)`` tensor in the weights' dtype (as :meth:`forward`).

        Source: Lorsa paper (He et al. 2025) §3.1; Llamascopium ``src/llamascopium/models/lorsa.py``.
        """
        self._check_input(x)
        return F.linear(x, self.W_V, self.b_V)

    def _mask(self, attn_mask: torch.Tensor | None, seq: int, device: torch.device,
              n_keys: int | None = None) -> torch.Tensor | None:
        """A ``(batch|1, 1, pos, keys)`` mask for SDPA (True = may attend), or None for plain causal.

        ``n_keys`` (default ``seq``): the keys attended to, the last ``seq`` of them being the
        queries' own positions (``keys − seq`` earlier positions come from a :class:`LorsaKV`).
        """
        keys = seq if n_keys is None else n_keys
        offset = keys - seq
        if attn_mask is None:
            if offset == 0 or seq == 1:  # plain causal / one query that sees every key
                return None
            return torch.ones(seq, keys, dtype=torch.bool, device=device).tril(offset)[None, None]
        if not isinstance(attn_mask, torch.Tensor):
            raise ShapeError(f"attn_mask must be a tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dim() == 2 and attn_mask.shape[-1] != keys:
            raise ShapeError(f"attn_mask (batch, keys) must have keys={keys}, got {tuple(attn_mask.shape)}")
        if attn_mask.dtype.is_complex or (attn_mask.dim() == 2 and attn_mask.dtype.is_floating_point):
            # a float (batch, keys) mask may be 0 / 1 or additive (0 = attend): read as 0 / 1, an additive one
            # would be inverted, and telling them apart reads the device
            raise ShapeError(
                f"attn_mask {tuple(attn_mask.shape)} is {attn_mask.dtype}: a (batch, keys) key-padding mask is bool "
                "or integer (1 = token, a tokenizer's attention_mask); an additive float mask (0 = may attend, "
                "-inf = masked) is given as (batch, 1, pos, keys)")
        if attn_mask.dim() == 2:  # (batch, keys) key padding mask, 1 = real token
            causal = torch.ones(seq, keys, dtype=torch.bool, device=device).tril(offset)
            attn_mask = causal[None, None] & attn_mask.bool()[:, None, None, :]
        if attn_mask.dim() != 4 or attn_mask.shape[-2:] != (seq, keys):
            raise ShapeError(f"attn_mask must be (batch, keys) or (batch, 1, pos, keys) with pos={seq}, "
                             f"keys={keys}, got {tuple(attn_mask.shape)}")
        if attn_mask.dtype.is_floating_point:  # additive: 0 may attend, the dtype's min / -inf masked
            attn_mask = attn_mask > torch.finfo(attn_mask.dtype).min / 2
        elif attn_mask.dtype != torch.bool:  # integer 0 / 1, as the 2-D key-padding mask: nonzero may attend
            attn_mask = attn_mask != 0
        # a query that may attend nowhere (a left-pad row) attends to itself instead of giving NaN
        eye = (torch.arange(keys, device=device)[None] == torch.arange(seq, device=device)[:, None] + offset)
        return attn_mask | (~attn_mask.any(-1, keepdim=True) & eye[None, None])

    def attention_scores_softmax(
        self, q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None
    ) -> Float[torch.Tensor, "batch n_qk pos pos"]:
        """Explicit causal softmax patterns ``A`` from q, k (what SDPA computes implicitly), in ``q``'s dtype.

        The scores and the softmax run in at least fp32 (:func:`~nnsight_lorsa._placement.bmm_f32`, as attribution's
        pattern rows): an fp16 Lorsa's unscaled ``q·k`` past 65504 would be ``inf`` (and the pattern NaN) where its
        forward, which scales before the product, is finite; the pattern is rounded once to ``q``'s dtype.

        Source: Lorsa paper (He et al. 2025) §3.1; Llamascopium ``src/llamascopium/models/lorsa.py``.
        """
        seq = q.shape[-2]
        scores = bmm_f32(q, k.transpose(-1, -2)) / self.cfg.scale
        mask = self._mask(attn_mask, seq, q.device)
        if mask is None:
            mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
        return scores.masked_fill(~mask, float("-inf")).softmax(-1).to(q.dtype)

    def compute_z_pre(
        self,
        x: Float[torch.Tensor, "batch pos d_model"],
        positions: Int[torch.Tensor, "*b pos"] | None = None,
        attn_mask: torch.Tensor | None = None,
        *,
        qk_input: Float[torch.Tensor, "batch pos d_model"] | None = None,
    ) -> Float[torch.Tensor, "batch pos n_ov"]:
        """Head activations before the activation function: ``z^h_i = Σ_j A^{g(h)}_ij v^h_j``. ``qk_input``: the
        input the queries and keys are computed from, ``x``'s shape (default ``x``; :meth:`forward`).

        Source: Lorsa paper (He et al. 2025) §3.1; Llamascopium ``src/llamascopium/models/lorsa.py``.
        """
        return self._z_pre_kv(x, positions, attn_mask, None, qk_input=qk_input)[0]

    def _z_pre_kv(self, x: torch.Tensor, positions: torch.Tensor | None, attn_mask: torch.Tensor | None,
                  past: LorsaKV | None, start: int | None = None, *,
                  qk_input: torch.Tensor | None = None) -> tuple[torch.Tensor, LorsaKV]:
        """``z_pre`` of ``x``'s positions attending to ``past`` and themselves, and the extended :class:`LorsaKV`
        (``start``: ``positions`` is ``arange(start, start + pos)``, made by the caller; ``qk_input``: the input of
        the queries and keys, default ``x``)."""
        self._check_input(x)
        b, s, _ = x.shape
        if qk_input is None:
            qk_input = x
        elif not isinstance(qk_input, torch.Tensor) or qk_input.shape != x.shape:
            got = tuple(qk_input.shape) if isinstance(qk_input, torch.Tensor) else type(qk_input).__name__
            raise ShapeError(f"Lorsa: qk_input must have x's shape {tuple(x.shape)}, got {got}")
        # shared_pre: in a splice's two passes (modules.sparse_coder.share_encoder_matmul) the live pass copies the
        # clean pass's q, k, v (no hook point before them) and, where hook_q/hook_k/hook_v passed those copies on
        # unedited, its z_pre; otherwise (and outside a splice) computed here
        q, k = shared_pre(self, (qk_input, None if start is not None else positions), ("qk", start),
                          lambda: self.qk(qk_input, positions))
        q, k = self.hook_q(q), self.hook_k(k)
        v = self.hook_v(shared_pre(self, x, "v", lambda: self.values(x)))
        if past is not None:
            self._check_past(past, b)
        past_k, past_v = (None, None) if past is None else (past.k, past.v)
        k_all, v_all = (k, v) if past is None else (torch.cat([past.k.to(k.dtype), k], 2),
                                                    torch.cat([past.v.to(v.dtype), v], 1))
        z_pre = shared_pre(self, (x, q, k, v, past_k, past_v, attn_mask), "z_pre",
                           lambda: self._attend(q, k_all, v_all, attn_mask, b, s, x.device))
        return z_pre, LorsaKV(k_all, v_all)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, b: int,
                s: int, device: torch.device) -> torch.Tensor:
        """``z_pre (b, s, n_ov)`` from the queries and the keys and values (the past's and these) after their hooks."""
        keys = v.shape[1]
        g = self.cfg.group_size
        vh = v.view(b, keys, self.cfg.n_qk_heads, g).transpose(1, 2)  # (b, n_qk, keys, G): OV heads as value dim
        mask = self._mask(attn_mask, s, device, keys)
        if mask is not None and mask.shape[0] not in (1, b):
            raise ShapeError(f"attn_mask holds batch {mask.shape[0]}, x has batch {b}")
        z = F.scaled_dot_product_attention(
            q, k, vh, attn_mask=mask, is_causal=mask is None and keys == s, scale=1.0 / self.cfg.scale
        )
        return z.transpose(1, 2).reshape(b, s, self.cfg.n_ov_heads)

    def activation(
        self, z_pre: Float[torch.Tensor, "batch pos n_ov"], top_k: int | None = None
    ) -> tuple[Float[torch.Tensor, "batch pos n_ov"], Int[torch.Tensor, "batch pos k"]]:
        """ReLU then top-k over heads per token: ``(z, topk_indices)``; z is dense with zeros. A JumpReLU Lorsa
        (``cfg.activation == "jumprelu"``) keeps ``z_pre[h]`` where it exceeds ``threshold[h]`` (strictly; zero
        elsewhere), then the top-k of those.

        Raises:
            ArgumentError: ``top_k`` given and not an int in ``[1, n_ov_heads]``.
            ShapeError: ``z_pre`` not a floating tensor ``(..., n_ov_heads)`` (a top-k over another width ran on it).

        Source: Lorsa paper (He et al. 2025) §3.1; Llamascopium ``src/llamascopium/models/lorsa.py``.
        """
        self._check_per_head(z_pre, "activation", "z_pre")
        k = self.cfg.top_k if top_k is None else top_k
        if top_k is not None and (not is_int(k)
                                  or not 1 <= k <= self.cfg.n_ov_heads):
            raise ArgumentError(f"Lorsa top_k must be an int in [1, n_ov_heads={self.cfg.n_ov_heads}], got {k!r}")
        if self.threshold is not None:  # JumpReLU: z_pre · 1[z_pre > θ_h] (Llamascopium's JumpReLU.forward)
            z_pre = z_pre * (z_pre > self.threshold.to(z_pre.device)).to(z_pre.dtype)
        vals, idx = z_pre.topk(int(k), dim=-1, sorted=False)
        z = torch.zeros_like(z_pre).scatter_(-1, idx, vals.relu())  # in place: no copy of the zeros
        return z, idx

    def decode(self, z: Float[torch.Tensor, "batch pos n_ov"]) -> Float[torch.Tensor, "batch pos d_model"]:
        """``out = z W_O + b_D``.

        Raises:
            ShapeError: ``z`` not a tensor ``(..., n_ov_heads)`` (e.g. an edited ``hook_z`` output of another
                width), or not in the weights' dtype (e.g. an fp32 tensor put in place of an fp16 Lorsa's
                ``hook_z`` output inside a trace; a dtype check, nothing read).

        Source: Lorsa paper (He et al. 2025) §3.1; Llamascopium ``src/llamascopium/models/lorsa.py``.
        """
        self._check_per_head(z, "decode", "z")
        check_dtype(z, self.W_O, "Lorsa", "z")
        if self.b_D is None:
            return z @ self.W_O
        return torch.addmm(self.b_D, z.reshape(-1, z.shape[-1]), self.W_O).view(*z.shape[:-1], self.cfg.d_model)

    def heads(
        self,
        x: Float[torch.Tensor, "batch pos d_model"],
        positions: Int[torch.Tensor, "*b pos"] | None = None,
        attn_mask: torch.Tensor | None = None,
        *,
        top_k: int | None = None,
        qk_input: Float[torch.Tensor, "batch pos d_model"] | None = None,
    ) -> tuple[Float[torch.Tensor, "batch pos n_ov"], Float[torch.Tensor, "batch pos n_ov"],
               Int[torch.Tensor, "batch pos k"]]:
        """``(z_pre, z, topk_indices)`` as :meth:`forward` computes them (through ``hook_z_pre`` and ``hook_z``),
        without the output: what attribution's layout reads (the active heads), not the dense ``z W_O`` decode
        (``2·pos·n_ov·d_model`` FLOPs, more than the values' projection at the paper's scale).

        Source: Lorsa paper (He et al. 2025) §3.1; Llamascopium ``src/llamascopium/models/lorsa.py``.
        """
        z_pre = self.hook_z_pre(self.compute_z_pre(x, positions, attn_mask, qk_input=qk_input))
        z, idx = self.activation(z_pre, top_k)
        return z_pre, self.hook_z(z), idx

    def forward(
        self,
        x: Float[torch.Tensor, "batch pos d_model"],
        positions: Int[torch.Tensor, "*b pos"] | None = None,
        attn_mask: torch.Tensor | None = None,
        *,
        return_cache: bool = False,
        top_k: int | None = None,
        past: LorsaKV | None = None,
        kv_out: dict | None = None,
        qk_input: Float[torch.Tensor, "batch pos d_model"] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, LorsaCache]:
        """Lorsa output ``(batch, pos, d_model)``; with ``return_cache`` also a :class:`LorsaCache`.

        Args:
            x: attention input hidden states (after the pre-attention norm).
            positions: token positions ``(pos,)`` or ``(batch, pos)`` for RoPE; default ``arange(pos)``.
            attn_mask: ``(batch, pos)`` key-padding mask, bool or integer (1 = token; a float one is refused:
                0 / 1 and additive cannot be told apart without reading the device), or ``(batch, 1, pos, pos)``
                (bool / integer: True / nonzero = may attend; float: additive, 0 = may attend, the dtype's
                minimum or -inf masked); default causal.
            top_k: overrides ``cfg.top_k`` (k annealing during training).
            past, kv_out: a decoding step (:meth:`forward_step`): ``x`` attends to ``past`` too, and the
                new :class:`LorsaKV` is stored as ``kv_out["kv"]`` — so that a splice calls the module
                itself (its envoy's ``.input`` / ``.output`` are then served in a trace) and still keeps
                the keys and values. Not with ``return_cache`` / ``top_k``.
            qk_input: the input the queries and keys are computed from, ``x``'s shape (default ``x``): the QK
                patterns of another pass with the values of this one — frozen attention
                (:func:`nnsight_lorsa.patching.freeze_attention`; circuit-tracer's ``feature_intervention(...,
                freeze_attention=True)``).

        Raises:
            ShapeError: ``x`` not a ``(batch, pos, d_model)`` tensor in the weights' dtype; ``positions`` or
                ``attn_mask`` of the wrong shape or dtype; ``past`` / ``kv_out`` given with ``return_cache`` or
                ``top_k``; ``kv_out`` not a dict.
            ArgumentError: ``top_k`` not an int in ``[1, n_ov_heads]``; ``return_cache`` not a bool.

        Source: Lorsa paper (He et al. 2025) §3.1; Llamascopium ``src/llamascopium/models/lorsa.py``.
        """
        check_flag(return_cache, "return_cache", "Lorsa.forward")  # a truthy "no" returned a tuple
        if kv_out is not None and not isinstance(kv_out, dict):
            raise ShapeError(f"Lorsa.forward: kv_out must be None or a dict (the new LorsaKV is stored as "
                             f"kv_out['kv']), got a {type(kv_out).__name__}")
        if past is not None or kv_out is not None:
            if return_cache or top_k is not None:
                raise ShapeError("Lorsa.forward: past / kv_out (a decoding step) do not take return_cache or top_k")
            out, kv = self.forward_step(x, positions, attn_mask, past, qk_input=qk_input)
            if kv_out is not None:
                kv_out["kv"] = kv
            return out
        z_pre, z, idx = self.heads(x, positions, attn_mask, top_k=top_k, qk_input=qk_input)
        out = self.hook_out(self.decode(z))
        if return_cache:
            return out, LorsaCache(z_pre=z_pre, z=z, topk_indices=idx, out=out)
        return out

    def forward_step(
        self,
        x: Float[torch.Tensor, "batch pos d_model"],
        positions: Int[torch.Tensor, "*b pos"] | None = None,
        attn_mask: torch.Tensor | None = None,
        past: LorsaKV | None = None,
        *,
        qk_input: Float[torch.Tensor, "batch pos d_model"] | None = None,
    ) -> tuple[Float[torch.Tensor, "batch pos d_model"], LorsaKV]:
        """One decoding step: the output at ``x``'s positions, attending to ``past`` and to themselves.

        ``x`` holds the newest ``pos`` positions of the sequence (one token per generation step,
        the whole prompt on the first), ``past`` the keys and values of the ``past`` positions
        before them (None: there are none). Exact: the output equals the last ``pos`` positions
        of :meth:`forward` on the whole sequence (up to fp rounding of the attention's shape).
        The hook points see this step's positions only (``hook_q``, ``hook_k``:
        ``(batch, n_qk_heads, pos, d_qk_head)``; ``hook_v``, ``hook_z``: ``(batch, pos, n_ov_heads)``);
        the returned :class:`LorsaKV` holds the keys and values after the hooks (edits included).

        Args:
            positions: ``(pos,)`` or ``(batch, pos)`` positions of ``x``'s tokens for RoPE
                (default ``past … past+pos−1``).
            attn_mask: ``(batch, past+pos)`` key-padding mask or ``(batch, 1, pos, past+pos)`` (dtypes as
                for :meth:`forward`); default causal.

        Returns:
            ``(out (batch, pos, d_model), LorsaKV with past+pos positions)``.

        Raises:
            ShapeError: ``x`` not ``(batch, pos, d_model)``, a mask or ``past`` that does not fit.

        Source: ours (incremental decoding for a Lorsa under ``generate``).
        """
        if past is not None:
            self._check_input(x)
            self._check_past(past, x.shape[0])
        start = None  # positions made here: past.length, ... (the same in two calls: shared_pre's key)
        if positions is None and past is not None:
            start = past.length
            positions = torch.arange(start, start + x.shape[1], device=x.device)
        z_pre, kv = self._z_pre_kv(x, positions, attn_mask, past, start, qk_input=qk_input)
        z, _ = self.activation(self.hook_z_pre(z_pre))
        out = self.hook_out(self.decode(self.hook_z(z)))
        return out, kv

    # -------------------------------------------------------------- analysis
    @torch.no_grad()
    def attention_pattern(
        self,
        x: Float[torch.Tensor, "batch pos d_model"],
        qk_heads: list[int] | torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> Float[torch.Tensor, "batch heads pos pos"]:
        """Attention patterns ``A`` of the chosen QK heads (all by default): ``(batch, heads, q_pos, k_pos)``.

        ``qk_heads``: an int, a list of ints or a 1-D integer tensor, each in ``[0, n_qk_heads)`` (a single
        int keeps the heads axis, of size 1).

        Raises:
            ShapeError: ``x``, ``positions`` or ``attn_mask`` that do not fit (see :meth:`forward`), or a head
                index outside ``[0, n_qk_heads)``.
            ArgumentError: ``qk_heads`` that are not head indices (floats, bools, strings, nested, empty).

        Source: Lorsa paper (He et al. 2025) §3.1; Llamascopium ``src/llamascopium/models/lorsa.py``.
        """
        self._check_input(x)
        idx = None if qk_heads is None else head_indices(qk_heads, self.cfg.n_qk_heads, "qk_heads", x.device)
        q, k = self.qk(x, positions)
        if idx is not None:
            q, k = q[:, idx], k[:, idx]
        return self.attention_scores_softmax(q, k, attn_mask)

    @torch.no_grad()
    def z_pattern(
        self,
        x: Float[torch.Tensor, "batch pos d_model"],
        ov_heads: list[int] | torch.Tensor,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> Float[torch.Tensor, "batch heads pos pos"]:
        """z-patterns (Lorsa paper §5.1): ``zp[b, n, i, j] = A^{g(h_n)}_ij v^{h_n}_j``.

        Per-key contributions to head ``h_n``'s pre-activation at query ``i``; summing over ``j``
        gives ``z_pre`` exactly (and ``z`` wherever the head is active). ``ov_heads``: an int, a list of
        ints or a 1-D integer tensor, each in ``[0, n_ov_heads)``.

        Raises:
            ShapeError: ``x``, ``positions`` or ``attn_mask`` that do not fit, or a head outside ``[0, n_ov_heads)``.
            ArgumentError: ``ov_heads`` that are not head indices (floats, bools, strings, nested, empty).

        Source: Lorsa paper (He et al. 2025) §5.1 (z-pattern); Llamascopium ``src/llamascopium/models/lorsa.py``.
        """
        self._check_input(x)
        heads = head_indices(ov_heads, self.cfg.n_ov_heads, "ov_heads", x.device)
        pattern = self.attention_pattern(x, heads // self.cfg.group_size, positions, attn_mask)
        v = self.values(x)[..., heads]  # (b, s, n)
        return pattern * v.transpose(1, 2)[:, :, None, :]
