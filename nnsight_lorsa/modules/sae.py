"""Sparse autoencoder (SAE): reconstruct an activation through a sparse, overcomplete code.

Bricken et al. 2023, *Towards Monosemanticity* (the SAE; SAELens v6 ``standard``/``topk``/``jumprelu``/``batchtopk``
architectures)::

    x̃        = x − b_dec                       (if apply_b_dec_to_input; the "b_pre" centering)
    acts_pre = x̃ W_enc + b_enc                 (*batch, d_sae)
    acts     = σ(acts_pre)                     ReLU / TopK / BatchTopK / JumpReLU
    x̂        = acts W_dec + b_dec              (*batch, d_in)

Run-time input normalisation (``cfg.normalize_activations``, SAELens ``sae_lens/saes/sae.py``
``_setup_activation_normalization``; per token, not foldable into the weights)::

    "constant_norm_rescale"   x ← x · c,  c = √d_in / ‖x‖;            x̂ ← x̂ / c
    "layer_norm"              x ← (x − μ) / (σ + 1e-5), σ the unbiased std;  x̂ ← x̂ · σ + μ

``encode`` sees the normalised input, ``forward`` returns ``x̂`` in the input's own scale;
``decode`` alone stays in the normalised space (it has no input to take the scale from).

Parameters (SAELens names): ``W_enc (d_in, d_sae)``, ``b_enc (d_sae,)``, ``W_dec (d_sae, d_in)``,
``b_dec (d_in,)``; a JumpReLU's threshold is ``activation.threshold (d_sae,)`` (SAELens: ``threshold``).
Hook points: ``hook_sae_acts_pre``, ``hook_sae_acts_post`` (the features), ``hook_sae_recons``
(``x̂``), ``hook_error`` (``x − x̂`` when spliced with ``error=True``). Needs torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .._typing import Float
from ..errors import CheckpointError, ShapeError
from .sparse_coder import SparseCoder, SparseCoderConfig, check_last_dim

#: ``SAEConfig.normalize_activations`` values (module docstring)
NORMALIZATIONS = ("none", "constant_norm_rescale", "layer_norm")


@dataclass(repr=False)
class SAEConfig(SparseCoderConfig):
    """Config of a :class:`SparseAutoencoder` (see :class:`SparseCoderConfig` for the shared fields).

    Attributes:
        apply_b_dec_to_input: subtract ``b_dec`` from the input before encoding (SAELens default).
        hook: the site the SAE was trained on (metadata, e.g. ``"model.layers.3"``).
        normalize_activations: per-token input normalisation, one of :data:`NORMALIZATIONS`
            (module docstring; SAELens's name and values).

    Source: Bricken et al. 2023, *Towards Monosemanticity*; SAELens ``sae_lens/saes/sae.py``.
    """

    apply_b_dec_to_input: bool = True
    hook: str | None = None
    normalize_activations: str = "none"

    def __post_init__(self) -> None:
        super(SAEConfig, self).__post_init__()
        if self.hook is not None and not isinstance(self.hook, str):
            raise CheckpointError(f"SAEConfig.hook must be None or a str (the site's name), got {self.hook!r}")
        if self.normalize_activations not in NORMALIZATIONS:
            raise CheckpointError(f"SAEConfig.normalize_activations is {self.normalize_activations!r}; "
                                  f"known: {list(NORMALIZATIONS)}")

    _flags: ClassVar[dict[str, type]] = {"apply_b_dec_to_input": bool}


class SparseAutoencoder(SparseCoder):
    """An SAE on ``d_in``-wide activations; see the module docstring for the equations.

    ``SparseAutoencoder(cfg: SAEConfig, *, device=None, dtype=None)``; ``encode(x) -> acts``,
    ``decode(acts) -> x̂``, ``forward(x) -> x̂`` (all ``(*batch, ·)``).

    Raises:
        ShapeError: an ``encode`` / ``forward`` input not ``(*batch, d_in)``, a ``decode`` input not
            ``(*batch, d_sae)``, or either not in the weights' dtype.

    Source: Bricken et al. 2023, *Towards Monosemanticity*; SAELens ``sae_lens/saes/sae.py``.
    """

    _kind: ClassVar[str] = "SparseAutoencoder"
    cfg: SAEConfig

    def encoder_input(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised input (:meth:`normalize`), minus ``b_dec`` if ``cfg.apply_b_dec_to_input``:
        ``(*batch, d_in)``, the shape of ``x``.

        Raises:
            ShapeError: ``x`` is not a ``(*batch, d_in)`` tensor in the weights' dtype.

        Source: Bricken et al. 2023, *Towards Monosemanticity*; SAELens ``sae_lens/saes/sae.py``.
        """
        check_last_dim(x, self.cfg.d_in, self._kind, "x", self.W_enc)
        x = self.normalize(x)
        return x - self.b_dec if self.cfg.apply_b_dec_to_input else x

    def _check_floating(self, t: Any, method: str, name: str) -> None:
        """``t`` a floating ``(*batch, d_in)`` tensor (any float dtype: the normalisation reads no weight)."""
        check_last_dim(t, self.cfg.d_in, f"{self._kind}.{method}", name)
        if not t.is_floating_point():
            raise ShapeError(f"{self._kind}.{method} expects {name} as a floating tensor, got dtype {t.dtype}")

    def normalize(self, x: Float[torch.Tensor, "*batch d_in"]) -> Float[torch.Tensor, "*batch d_in"]:
        """``x`` under ``cfg.normalize_activations`` (identity for ``"none"``).

        Raises:
            ShapeError: ``x`` is not a floating ``(*batch, d_in)`` tensor.

        Source: Bricken et al. 2023, *Towards Monosemanticity*; SAELens ``sae_lens/saes/sae.py``.
        """
        self._check_floating(x, "normalize", "x")
        mode = self.cfg.normalize_activations
        if mode == "constant_norm_rescale":
            return x * (self.cfg.d_in ** 0.5 / x.norm(dim=-1, keepdim=True))
        if mode == "layer_norm":
            centred = x - x.mean(dim=-1, keepdim=True)
            return centred / (centred.std(dim=-1, keepdim=True) + 1e-5)
        return x

    def denormalize(self, x: Float[torch.Tensor, "*batch d_in"],
                    out: Float[torch.Tensor, "*batch d_in"]) -> Float[torch.Tensor, "*batch d_in"]:
        """A reconstruction ``out`` of ``normalize(x)`` back in ``x``'s scale (identity for ``"none"``).

        Raises:
            ShapeError: ``x`` or ``out`` is not a floating ``(*batch, d_in)`` tensor, or their shapes differ.

        Source: Bricken et al. 2023, *Towards Monosemanticity*; SAELens ``sae_lens/saes/sae.py``.
        """
        self._check_floating(x, "denormalize", "x")
        self._check_floating(out, "denormalize", "out")
        if out.shape != x.shape:
            raise ShapeError(f"{self._kind}.denormalize expects out of x's shape {tuple(x.shape)}, got "
                             f"{tuple(out.shape)}")
        mode = self.cfg.normalize_activations
        if mode == "constant_norm_rescale":
            return out * (x.norm(dim=-1, keepdim=True) / self.cfg.d_in ** 0.5)
        if mode == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            return out * (x - mu).std(dim=-1, keepdim=True) + mu
        return out

    def forward(self, x: Float[torch.Tensor, "*batch d_in"]) -> Float[torch.Tensor, "*batch d_in"]:
        """``denormalize(x, decode(encode(x)))``, through ``hook_sae_recons``.

        Source: *From Tokenization to Attribution Graphs* §6.1; SAELens ``sae_lens/saes/sae.py``.
        """
        if self.cfg.normalize_activations == "none":
            return super(SparseAutoencoder, self).forward(x)
        return self.hook_sae_recons(self.denormalize(x, self.decode(self.encode(x))))

    @property
    def supports_sparse(self) -> bool:
        """As :attr:`SparseCoder.supports_sparse`, and no run-time normalisation.

        Source: Bricken et al. 2023, *Towards Monosemanticity*; SAELens ``sae_lens/saes/sae.py``.
        """
        return self.cfg.normalize_activations == "none" and super(SparseAutoencoder, self).supports_sparse
