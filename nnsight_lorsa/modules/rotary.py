"""Rotary position embeddings (RoPE), computed exactly as the target model computes them.

Lorsa applies RoPE to its QK heads "in the same way as the target model" (Lorsa paper App. A).
This module covers the variants of the supported families: half-split pairs (Llama, Qwen,
GPT-NeoX: dimension ``i`` rotates with ``i + rotary_dim/2``), interleaved/adjacent pairs
(GPT-J: ``2i`` with ``2i+1``), partial rotary (GPT-NeoX ``rotary_pct``: only the first
``rotary_dim`` of ``head_dim`` dimensions rotate) and the frequency scalings ``linear``,
``llama3`` (Llama-3.1's NTK-by-parts) and ``yarn`` (gpt-oss, DeepSeek, Qwen long-context configs). The sequence-length
dependent types ``dynamic`` and ``longrope`` are not described (their frequencies change with the prompt's length).
The arithmetic follows ``transformers.modeling_rope_utils``
operation for operation so that fp32 results agree with the model's own cos/sin bit for bit.

Needs torch only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .._checks import check_instance
from .._repr import FieldsRepr
from .._typing import Float, Int
from ..errors import CheckpointError, UnsupportedArchitectureError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
#: transformers' rope types whose frequencies depend on the sequence length: recomputed in the forward
#: (``dynamic_rope_update``), not one table per position; refused, with the reason
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")


@dataclass(frozen=True, repr=False)
class RotaryConfig(FieldsRepr):
    """How a model rotates its queries and keys.

    Attributes:
        head_dim: size of one QK head (the rotated vectors' last dimension).
        rotary_dim: how many leading dimensions of a head rotate (``head_dim`` unless partial rotary).
        base: RoPE base ``theta`` (inverse frequencies ``base ** (-2i / rotary_dim)``).
        interleaved: ``True`` for GPT-J adjacent pairs, ``False`` for half-split pairs (Llama, NeoX).
        rope_type: ``"default"``, ``"linear"``, ``"llama3"`` or ``"yarn"``.
        scaling: the rope-type's parameters (``factor``; for llama3 also ``low_freq_factor``,
            ``high_freq_factor``, ``original_max_position_embeddings``; for yarn ``factor``,
            ``original_max_position_embeddings`` and optionally ``beta_fast`` (default 32), ``beta_slow`` (default 1),
            ``truncate`` (1.0 default / 0.0: whether the correction range is rounded to whole dimensions)).
        attention_scaling: factor multiplied into cos and sin (1.0 except for yarn: its ``attention_factor``,
            given or derived from ``factor`` / ``mscale`` / ``mscale_all_dim`` by the adapters, as transformers).
        table_dtype: ``None`` (default) or ``"bfloat16"``/``"float16"``: cos and sin are rounded to
            this dtype (then used in float32 or the input's dtype), for checkpoints whose author code
            reads its rotary tables back from a file stored in that precision (Llamascopium).
        inv_freq_dtype: ``None`` (default) or ``"bfloat16"``/``"float16"``: the inverse frequencies are rounded
            to this dtype, then used in float32 — what a Hugging Face model cast after loading
            (``model.to(torch.bfloat16)``, ``.half()``) computes: the cast rounds its rotary module's ``inv_freq``
            buffer, which its forward upcasts to float32 (``from_pretrained(..., dtype=...)`` keeps the buffer in
            float32). Set by the adapters' ``mhsa_weights`` from the model's buffer
            (:meth:`~nnsight_lorsa.adapters.base.ArchitectureAdapter.model_rotary`), never by a Lorsa
            (``LorsaConfig.from_mhsa`` drops it).

    Raises:
        CheckpointError: a field of the wrong type or out of range (named in the message), or a rope type
            without its scaling parameters (a ``ValueError`` subclass, as before).
        UnsupportedArchitectureError: an unknown ``rope_type``; ``"dynamic"`` / ``"longrope"`` with the reason
            (sequence-length-dependent frequencies).

    Source: Lorsa paper (He et al. 2025) App. A; transformers ``modeling_rope_utils.py``.
    """

    head_dim: int
    rotary_dim: int
    base: float = 10000.0
    interleaved: bool = False
    rope_type: str = "default"
    scaling: dict[str, float] = field(default_factory=dict)
    attention_scaling: float = 1.0
    table_dtype: str | None = None
    inv_freq_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in ("head_dim", "rotary_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise CheckpointError(f"RotaryConfig.{name} must be an int, got {value!r}")
        for name in ("base", "attention_scaling"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise CheckpointError(f"RotaryConfig.{name} must be a positive finite number, got {value!r}")
        if not isinstance(self.interleaved, bool):
            raise CheckpointError(f"RotaryConfig.interleaved must be a bool, got {self.interleaved!r}")
        if not isinstance(self.scaling, dict) or any(
                not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
                or (v not in (0, 1) if k == "truncate" else v <= 0) for k, v in self.scaling.items()):
            raise CheckpointError(
                "RotaryConfig.scaling must map names to positive finite numbers (truncate: 0 or 1), "
                f"got {self.scaling!r}")
        if self.rope_type in LENGTH_DEPENDENT_ROPE_TYPES:
            raise UnsupportedArchitectureError(
                f"rope_type {self.rope_type!r} is not supported: its frequencies depend on the sequence length "
                "(transformers recomputes them in the forward from the longest position: dynamic NTK past "
                "max_position_embeddings, longrope's long factors past original_max_position_embeddings), which one "
                f"cos/sin per position cannot describe (supported: {SUPPORTED_ROPE_TYPES})")
        if not isinstance(self.rope_type, str) or self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedArchitectureError(
                f"rope_type {self.rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
            )
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise CheckpointError(
                f"rotary_dim must be even and in (0, head_dim={self.head_dim}], got {self.rotary_dim}"
            )
        for name in ("table_dtype", "inv_freq_dtype"):
            if getattr(self, name) not in (None, "bfloat16", "float16"):
                raise CheckpointError(
                    f"RotaryConfig.{name} must be None, 'bfloat16' or 'float16', got {getattr(self, name)!r}")
        required = {"linear": ("factor",), "llama3": (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "yarn": ("factor", "original_max_position_embeddings")}
        missing = [k for k in required.get(self.rope_type, ()) if k not in self.scaling]
        if missing:
            raise CheckpointError(f"rope_type {self.rope_type!r} needs scaling parameters {missing}")

    def to_dict(self) -> dict[str, Any]:
        """The config as a JSON-able dict.

        Source: Lorsa paper (He et al. 2025) App. A; transformers ``modeling_rope_utils.py``.
        """
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RotaryConfig:
        """The config from :meth:`to_dict`'s dict (``scaling`` copied).

        Source: Lorsa paper (He et al. 2025) App. A; transformers ``modeling_rope_utils.py``.
        """
        check_instance(d, Mapping, f"{cls.__name__}.from_dict", "d", " (to_dict()'s dict)")
        scaling = d.get("scaling") or {}
        return cls(**{**d, "scaling": dict(scaling) if isinstance(scaling, dict) else scaling})


def rotary_inv_freq(cfg: RotaryConfig, device: torch.device | None = None,
                    dtype: torch.dtype = torch.float32) -> Float[torch.Tensor, " half"]:
    """Inverse frequencies ``(rotary_dim // 2,)`` float32, as transformers' ``ROPE_INIT_FUNCTIONS``; with
    ``cfg.inv_freq_dtype`` rounded to that dtype and back (the buffer of a model cast after loading). ``dtype``
    ``torch.float64``: the same operations in fp64 (an fp64 Lorsa's, exact to fp64; transformers computes them in
    fp32 whatever the model's dtype)."""
    dim = cfg.rotary_dim
    # the exponents made on ``device`` itself: a host arange copied there (transformers' form, run once at its
    # init) would be a host-to-device copy in every forward, which on CUDA waits for the queued kernels
    # (tests/modules/test_lorsa_host_copies.py); the same integers, so the same bits
    inv_freq = 1.0 / (cfg.base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(dtype) / dim))
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / cfg.scaling["factor"]
    elif cfg.rope_type == "llama3":
        factor = cfg.scaling["factor"]
        low, high = cfg.scaling["low_freq_factor"], cfg.scaling["high_freq_factor"]
        old_len = cfg.scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif cfg.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(cfg, device, dtype)
    if cfg.inv_freq_dtype is not None:
        inv_freq = inv_freq.to(getattr(torch, cfg.inv_freq_dtype)).to(dtype)
    return inv_freq


def _yarn_inv_freq(cfg: RotaryConfig, device: torch.device | None,
                   dtype: torch.dtype = torch.float32) -> Float[torch.Tensor, " half"]:
    """YaRN's inverse frequencies, transformers' ``_compute_yarn_parameters`` operation for operation: the correction
    range in Python floats, the ramp and the blend in float32 (the attention factor is ``cfg.attention_scaling``)."""
    dim, base = cfg.rotary_dim, cfg.base
    factor = cfg.scaling["factor"]
    old_len = cfg.scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = cfg.scaling.get("beta_fast", 32), cfg.scaling.get("beta_slow", 1)

    def correction_dim(rotations: float | int) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if cfg.scaling.get("truncate", 1):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: "Prevent singularity"
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(dtype) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=dtype, device=device) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def rotary_cos_sin(
    cfg: RotaryConfig, positions: Int[torch.Tensor, "*batch seq"], device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Float[torch.Tensor, "*batch seq rotary_dim"], Float[torch.Tensor, "*batch seq rotary_dim"]]:
    """cos and sin ``(*batch, seq, rotary_dim)`` float32 for integer ``positions`` (``dtype=torch.float64``: made
    in fp64, as an fp64 :class:`~.lorsa.Lorsa` uses them since 2026-11-28; they were fp32, exact to ~1e-8).

    Half-split layout repeats the frequencies as ``[f, f]`` (transformers' ``cat((freqs, freqs))``);
    interleaved layout as ``[f0, f0, f1, f1, ...]``.
    """
    inv_freq = rotary_inv_freq(cfg, device=positions.device if device is None else device, dtype=dtype)
    freqs = positions[..., None].to(dtype) * inv_freq
    emb = freqs.repeat_interleave(2, dim=-1) if cfg.interleaved else torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if cfg.attention_scaling != 1.0:  # a product by 1.0 is the identity: two passes over the tables saved
        cos, sin = cos * cfg.attention_scaling, sin * cfg.attention_scaling
    if cfg.table_dtype is not None:
        rounded = getattr(torch, cfg.table_dtype)
        cos, sin = cos.to(rounded).to(dtype), sin.to(rounded).to(dtype)
    return cos, sin


def rotary_table(
    cos: Float[torch.Tensor, "*batch seq rotary_dim"],
    sin: Float[torch.Tensor, "*batch seq rotary_dim"],
    dtype: torch.dtype,
    interleaved: bool = False,
) -> Float[torch.Tensor, "*batch seq two rotary_dim"]:
    """The factors of :func:`apply_rotary`'s products in ``dtype``, ``(*batch, seq, 2, rotary_dim)``: ``[..., 0, :]``
    the cosine at both dims of each pair, ``[..., 1, :]`` the sine with rotate's signs (``+sin`` at the first dim of
    each pair, ``-sin`` at the second). Built from the first dim of each pair of ``cos`` / ``sin`` (cast to ``dtype``
    as transformers does), as :func:`apply_rotary` has always read them; a caller rotating several tensors with the
    same positions builds it once (:meth:`Lorsa.qk` for queries and keys). Three small copies, the casts folded in."""
    rot = cos.shape[-1]
    half = rot // 2
    table = torch.empty(*cos.shape[:-1], 2, rot, dtype=dtype, device=cos.device)
    if interleaved:
        c, s = cos[..., 0::2], sin[..., 0::2]
        tc, ts = table[..., 0, :].unflatten(-1, (half, 2)), table[..., 1, :].unflatten(-1, (half, 2))
        tc.copy_(c[..., None])
        ts[..., 0].copy_(s)
        torch.neg(ts[..., 0], out=ts[..., 1])
    else:
        c, s = cos[..., :half], sin[..., :half]
        tc, ts = table[..., 0, :].unflatten(-1, (2, half)), table[..., 1, :].unflatten(-1, (2, half))
        tc.copy_(c[..., None, :])
        ts[..., 0, :].copy_(s)
        torch.neg(ts[..., 0, :], out=ts[..., 1, :])
    return table


def apply_rotary(
    x: Float[torch.Tensor, "batch heads seq head_dim"],
    cos: Float[torch.Tensor, "*batch seq rotary_dim"],
    sin: Float[torch.Tensor, "*batch seq rotary_dim"],
    interleaved: bool = False,
    table: Float[torch.Tensor, "*batch seq two rotary_dim"] | None = None,
) -> Float[torch.Tensor, "batch heads seq head_dim"]:
    """Rotate the first ``rotary_dim`` dims of each head: ``x·cos + rotate(x)·sin``; the rest pass.

    ``cos``/``sin`` are ``(seq, rotary_dim)`` or ``(batch, seq, rotary_dim)``; they are cast to
    ``x.dtype`` first, as transformers does. ``table``: :func:`rotary_table` of ``cos``, ``sin`` in ``x``'s dtype,
    when the caller has it already (used only without autograd; it must be built from these ``cos``, ``sin``).

    Bit for bit transformers' roundings: each product rounded to ``x``'s dtype, then their sum. Pairs
    ``(x1, x2)`` rotate by angle ``t`` to ``(x1·cos t − x2·sin t, x2·cos t + x1·sin t)``; without autograd the four
    products come from ONE multiply of ``x`` by the :func:`rotary_table` (``−x2·sin t`` as ``x2·(−sin t)``: the
    same number, rounding is sign-symmetric, and ``a − b`` is ``a + (−b)`` exactly), then one add per half writes
    the output: three kernels and ``6·numel`` elements read or written, where the former form (``mul`` into each
    half, ``mul``, ``sub_``/``add_``) took six and ``7·numel`` (``benchmarks/lorsa_forward_passes.py``). With
    autograd the former form stays (its gradient unchanged).
    """
    rot = cos.shape[-1]
    half = rot // 2
    first, second = (slice(0, rot, 2), slice(1, rot, 2)) if interleaved else (slice(0, half), slice(half, rot))
    out = torch.empty_like(x)
    # the former form also under torch.func transforms (vmap has no batching rule for the out= adds: until
    # 2026-11-28 ``torch.func.vmap(lorsa)`` failed with torch's "Batching rule not implemented for aten::add.out")
    if torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad) \
            or torch._C._are_functorch_transforms_active():
        cos = cos.to(x.dtype)
        sin = sin.to(x.dtype)
        if cos.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]
        if interleaved:
            x1, x2, c, s = x[..., 0:rot:2], x[..., 1:rot:2], cos[..., 0::2], sin[..., 0::2]
        else:
            x1, x2, c, s = x[..., :half], x[..., half:rot], cos[..., :half], sin[..., :half]
        out[..., first] = x1 * c - x2 * s
        out[..., second] = x2 * c + x1 * s
    else:
        if table is None:
            table = rotary_table(cos, sin, x.dtype, interleaved)
        if table.dim() == 4:  # per-batch positions: (batch, seq, 2, rot) -> (batch, 1, seq, 2, rot)
            table = table[:, None]
        # (..., seq, 2, rot): [..., 0, :] = x·cos, [..., 1, :] = (x1·sin, −x2·sin) at (first, second)
        prod = x[..., :rot].unsqueeze(-2) * table
        torch.add(prod[..., 0, first], prod[..., 1, second], out=out[..., first])
        torch.add(prod[..., 0, second], prod[..., 1, first], out=out[..., second])
    if rot < x.shape[-1]:
        out[..., rot:] = x[..., rot:]
    return out
