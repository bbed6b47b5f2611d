"""Configuration of a Lorsa (Low-Rank Sparse Attention) module (Lorsa paper §3, App. A–B)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from .._checks import check_instance, check_int
from .._repr import FieldsRepr
from ..errors import ArgumentError, CheckpointError
from .rotary import RotaryConfig

#: a Lorsa's activations: the paper's ReLU + top-k, and Llamascopium's JumpReLU (learned per-head thresholds)
LORSA_ACTIVATIONS = ("topk", "jumprelu")


@dataclass(repr=False)
class LorsaConfig(FieldsRepr):
    """Shape and settings of one Lorsa layer.

    Attributes:
        d_model: residual width of the target model.
        n_qk_heads: number of QK heads; each is shared by ``n_ov_heads // n_qk_heads`` OV heads.
        d_qk_head: QK head size; equals the target MHSA head size (App. B: never smaller).
        n_ov_heads: number of rank-1 OV heads ``H_Lorsa`` (6K for Pythia-160M, 32K for Llama-3.1-8B).
        top_k: heads kept active per token after ReLU (64 / 128 in the paper).
        activation: ``"topk"`` (the paper's: ReLU, then the ``top_k`` largest) or ``"jumprelu"`` (Llamascopium's
            ``act_fn: jumprelu``: head ``h`` fires where ``z_pre > threshold[h]``, the Lorsa's ``threshold`` buffer
            ``(n_ov_heads,)``, then the ``top_k`` largest of those; ``top_k = n_ov_heads`` for a JumpReLU alone).
        rotary: how queries and keys rotate (``None`` for models without RoPE, e.g. GPT-2).
        attn_scale: scores are divided by this; default ``sqrt(d_qk_head)``.
        qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3); ``qk_norm_eps`` its epsilon.
        use_decoder_bias: whether the output has the bias ``b_D``.
        layer: index of the target layer (metadata; checked when attached).
        architecture: target model family (metadata, e.g. ``"llama"``).
        extra: free-form metadata carried through save/load (e.g. training metrics).

    Raises:
        CheckpointError: at construction, a field of the wrong type or range (sizes not positive ints, ``n_ov_heads``
            not a multiple of ``n_qk_heads``, ``top_k > n_ov_heads``, ``rotary.head_dim != d_qk_head``, ...).

    Source: Lorsa paper (He et al. 2025) §3.1, App. A–B; Llamascopium ``src/llamascopium/models/lorsa.py``
    (``LorsaConfig``).
    """

    d_model: int
    n_qk_heads: int
    d_qk_head: int
    n_ov_heads: int
    top_k: int
    activation: str = "topk"
    rotary: RotaryConfig | None = None
    attn_scale: float | None = None
    qk_norm: bool = False
    qk_norm_eps: float = 1e-6
    use_decoder_bias: bool = True
    layer: int | None = None
    architecture: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("d_model", "n_qk_heads", "d_qk_head", "n_ov_heads", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CheckpointError(f"LorsaConfig.{name} must be a positive int, got {value!r}")
        for name in ("qk_norm", "use_decoder_bias"):
            if not isinstance(getattr(self, name), bool):
                raise CheckpointError(f"LorsaConfig.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("attn_scale", "qk_norm_eps"):
            value = getattr(self, name)
            if value is None and name == "attn_scale":
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise CheckpointError(f"LorsaConfig.{name} must be a positive finite number, got {value!r}")
        if self.layer is not None and (not isinstance(self.layer, int) or isinstance(self.layer, bool)
                                       or self.layer < 0):
            raise CheckpointError(f"LorsaConfig.layer must be a layer index (int >= 0) or None, got {self.layer!r}")
        if self.architecture is not None and not isinstance(self.architecture, str):
            raise CheckpointError(f"LorsaConfig.architecture must be a model family name or None, got "
                                  f"{self.architecture!r}")
        if not isinstance(self.extra, dict):
            raise CheckpointError(f"LorsaConfig.extra must be a mapping, got {self.extra!r}")
        if self.rotary is not None and not isinstance(self.rotary, RotaryConfig):
            raise CheckpointError(f"LorsaConfig.rotary must be a RotaryConfig or None, got {self.rotary!r}")
        if self.n_ov_heads % self.n_qk_heads:
            raise CheckpointError(
                f"n_ov_heads ({self.n_ov_heads}) must be a multiple of n_qk_heads ({self.n_qk_heads})"
            )
        if self.activation not in LORSA_ACTIVATIONS:
            raise CheckpointError(f"LorsaConfig.activation must be one of {LORSA_ACTIVATIONS}, got {self.activation!r}")
        if self.top_k > self.n_ov_heads:
            raise CheckpointError(f"top_k ({self.top_k}) exceeds n_ov_heads ({self.n_ov_heads})")
        if self.rotary is not None and self.rotary.head_dim != self.d_qk_head:
            raise CheckpointError(
                f"rotary.head_dim ({self.rotary.head_dim}) != d_qk_head ({self.d_qk_head})"
            )
        if self.attn_scale is None:
            self.attn_scale = math.sqrt(self.d_qk_head)

    @property
    def scale(self) -> float:
        """The divisor of attention scores (``attn_scale``, resolved to ``sqrt(d_qk_head)`` by default).

        Source: Lorsa paper (He et al. 2025) §3.1, App. A–B; Llamascopium ``src/llamascopium/models/lorsa.py``
        (``LorsaConfig``).
        """
        return float(self.attn_scale if self.attn_scale is not None else math.sqrt(self.d_qk_head))

    @property
    def group_size(self) -> int:
        """OV heads per QK head, ``G = n_ov_heads / n_qk_heads``.

        Source: Lorsa paper (He et al. 2025) §3.1, App. A–B; Llamascopium ``src/llamascopium/models/lorsa.py``
        (``LorsaConfig``).
        """
        return self.n_ov_heads // self.n_qk_heads

    @classmethod
    def from_mhsa(cls, mhsa: Any, *, n_ov_heads: int, top_k: int, qk_heads_per_mhsa_head: int = 1,
                  layer: int | None = None, architecture: str | None = None) -> LorsaConfig:
        """The config of a Lorsa for the MHSA ``mhsa`` (an :class:`~nnsight_lorsa.adapters.base.MHSAWeights`:
        ``adapter.mhsa_weights(model, layer)``), the one place a config is derived from an MHSA.

        Taken from the MHSA: ``d_model``; ``d_qk_head`` = its head dimension (the paper's rule, App. B.1: the
        QK dimension is never below the MHSA's); its RoPE (``rotary``), score scale and QK norm.
        ``n_qk_heads = qk_heads_per_mhsa_head · mhsa.n_heads`` (Table 1: 256 independent QK heads for
        Llama-3.1-8B's 32, i.e. 8); ``n_ov_heads`` and ``top_k`` as given (Table 1: 32K and 128).

        The Lorsa keeps its own exact fp32 RoPE: ``mhsa.rotary.inv_freq_dtype`` (the bf16 / fp16 rounding of a model
        cast after loading, :meth:`~nnsight_lorsa.adapters.base.ArchitectureAdapter.model_rotary`) is dropped. The
        rounding belongs to how that model object was cast, not to the model: the same weights loaded with
        ``from_pretrained(..., dtype=...)`` rotate with fp32 frequencies, a Lorsa trained on one runs on the other,
        and the Lorsa file formats (Llamascopium's config) cannot express it. Such a Lorsa's QK heads, initialised
        from the MHSA's, rotate as the MHSA would with fp32 frequencies; at long prompts their patterns differ from
        that cast model's own by more than rounding.

        Raises:
            CheckpointError: sizes that do not divide (see the class).
            ArgumentError: ``qk_heads_per_mhsa_head`` not an int ``>= 1`` (``True`` was read as 1); ``mhsa`` not an
                :class:`~nnsight_lorsa.adapters.base.MHSAWeights`.

        Source: Lorsa paper (He et al. 2025) §3.1, App. A–B; Llamascopium ``src/llamascopium/models/lorsa.py``
        (``LorsaConfig``).
        """
        check_int("LorsaConfig.from_mhsa", "qk_heads_per_mhsa_head", qk_heads_per_mhsa_head)
        if not all(hasattr(mhsa, a) for a in ("d_model", "n_heads", "head_dim", "rotary", "scale", "q_norm")):
            raise ArgumentError(f"LorsaConfig.from_mhsa(mhsa=...) must be an MHSAWeights "
                                f"(adapter.mhsa_weights(model, layer)), got a {type(mhsa).__name__}")
        return cls(d_model=int(mhsa.d_model), n_qk_heads=qk_heads_per_mhsa_head * int(mhsa.n_heads),
                   d_qk_head=int(mhsa.head_dim), n_ov_heads=n_ov_heads, top_k=top_k,
                   rotary=None if mhsa.rotary is None else dataclasses.replace(mhsa.rotary, inv_freq_dtype=None),
                   attn_scale=1.0 / float(mhsa.scale), qk_norm=mhsa.q_norm is not None,
                   qk_norm_eps=float(mhsa.qk_norm_eps), layer=layer, architecture=architecture)

    def to_dict(self) -> dict[str, Any]:
        """The config as a JSON-able dict (``rotary`` as a dict or None).

        Source: Lorsa paper (He et al. 2025) §3.1, App. A–B; Llamascopium ``src/llamascopium/models/lorsa.py``
        (``LorsaConfig``).
        """
        d = asdict(self)
        d["rotary"] = None if self.rotary is None else self.rotary.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LorsaConfig:
        """The config from :meth:`to_dict`'s dict. Raises :class:`~nnsight_lorsa.errors.CheckpointError` on unknown
        keys.

        Source: Lorsa paper (He et al. 2025) §3.1, App. A–B; Llamascopium ``src/llamascopium/models/lorsa.py``
        (``LorsaConfig``).
        """
        check_instance(d, Mapping, f"{cls.__name__}.from_dict", "d", " (to_dict()'s dict)")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise CheckpointError(f"unknown LorsaConfig keys {unknown}")
        d = dict(d)
        if d.get("rotary") is not None:
            if not isinstance(d["rotary"], dict):
                raise CheckpointError(f"LorsaConfig.rotary must be a mapping or None, got {d['rotary']!r}")
            d["rotary"] = RotaryConfig.from_dict(d["rotary"])
        try:
            return cls(**d)
        except TypeError as e:
            raise CheckpointError(f"malformed LorsaConfig: {e}") from e
