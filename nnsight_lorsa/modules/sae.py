"""Sparse autoencoder (SAE): reconstruct an activation through a sparse, overcomplete code.

Seed ``004_…`` §6.1 (Bricken et al. 2023; SAELens v6 ``standard``/``topk``/``jumprelu``/``batchtopk``
architectures)::

    x̃        = x − b_dec                       (if apply_b_dec_to_input; the "b_pre" centering)
    acts_pre = x̃ W_enc + b_enc                 (*batch, d_sae)
    acts     = σ(acts_pre)                     ReLU / TopK / BatchTopK / JumpReLU
    x̂        = acts W_dec + b_dec              (*batch, d_in)

Parameters (SAELens names): ``W_enc (d_in, d_sae)``, ``b_enc (d_sae,)``, ``W_dec (d_sae, d_in)``,
``b_dec (d_in,)``; a JumpReLU's threshold is ``activation.threshold (d_sae,)`` (SAELens: ``threshold``).
Hook points: ``hook_sae_acts_pre``, ``hook_sae_acts_post`` (the features), ``hook_sae_recons``
(``x̂``), ``hook_error`` (``x − x̂`` when spliced with ``error=True``). Needs torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .sparse_coder import SparseCoder, SparseCoderConfig


@dataclass(repr=False)
class SAEConfig(SparseCoderConfig):
    """Config of a :class:`SparseAutoencoder` (see :class:`SparseCoderConfig` for the shared fields).

    Attributes:
        apply_b_dec_to_input: subtract ``b_dec`` from the input before encoding (SAELens default).
        hook: the site the SAE was trained on (metadata, e.g. ``"model.layers.3"``).
    """

    apply_b_dec_to_input: bool = True
    hook: str | None = None

    _flags: ClassVar[dict[str, type]] = {"apply_b_dec_to_input": bool}


class SparseAutoencoder(SparseCoder):
    """An SAE on ``d_in``-wide activations; see the module docstring for the equations.

    ``SparseAutoencoder(cfg: SAEConfig, *, device=None, dtype=None)``; ``encode(x) -> acts``,
    ``decode(acts) -> x̂``, ``forward(x) -> x̂`` (all ``(*batch, ·)``).
    """

    _kind: ClassVar[str] = "SparseAutoencoder"
    cfg: SAEConfig

    def encoder_input(self, x: torch.Tensor) -> torch.Tensor:
        """``x − b_dec`` if ``cfg.apply_b_dec_to_input`` else ``x``."""
        return x - self.b_dec if self.cfg.apply_b_dec_to_input else x
