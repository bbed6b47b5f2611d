"""Transcoders: a sparse, wide replacement of an MLP that reads its input and predicts its output.

Per-layer transcoder (Dunefsky et al. 2024, *Transcoders Find Interpretable LLM Feature
Circuits*, arXiv:2406.11944; Ge et al. 2024, arXiv:2405.13868)::

    acts = σ(x W_enc + b_enc)                  x: the MLP's input (after the pre-MLP norm), (*batch, d_in)
    ŷ    = acts W_dec + b_dec                  ≈ the MLP's output, (*batch, d_out)

Skip transcoder (Paulo, Shabalin & Belrose 2025, *Transcoders Beat Sparse Autoencoders for
Interpretability*, arXiv:2501.18823; EleutherAI sparsify, SAELens ``skip_transcoder``) adds a
dense linear path::

    ŷ    = acts W_dec + b_dec + x W_skipᵀ      W_skip: (d_out, d_in), zero-initialised

Same names, layouts and hook points as :class:`~.sae.SparseAutoencoder` (``W_enc (d_in, d_sae)``,
``W_dec (d_sae, d_out)``, ``hook_sae_acts_pre``, ``hook_sae_acts_post``, ``hook_sae_recons``,
``hook_error``); the input is never centred by ``b_dec`` (it lives in the output space).
Needs torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .._typing import Float
from ..errors import CheckpointError
from .sparse_coder import SparseCoder, SparseCoderConfig, check_last_dim


@dataclass(repr=False)
class TranscoderConfig(SparseCoderConfig):
    """Config of a :class:`Transcoder` / :class:`SkipTranscoder`.

    Attributes:
        d_out: width of the output (default ``d_in``: an MLP maps d_model to d_model).
        layer: the layer whose MLP it replaces (metadata; checked when attached to a model).

    Source: Dunefsky et al. 2024, *Transcoders Find Interpretable LLM Feature Circuits*; sparsify
    ``sparsify/sparse_coder.py`` (skip transcoder).
    """

    d_out: int | None = None
    layer: int | None = None

    def __post_init__(self) -> None:
        if self.d_out is None:
            self.d_out = self.d_in
        super(TranscoderConfig, self).__post_init__()
        if self.layer is not None and (not isinstance(self.layer, int) or isinstance(self.layer, bool)
                                       or self.layer < 0):
            raise CheckpointError(f"TranscoderConfig.layer must be a layer index (int >= 0) or None, "
                                  f"got {self.layer!r}")

    _sizes: ClassVar[tuple[str, ...]] = ("d_in", "d_sae", "d_out")


class Transcoder(SparseCoder):
    """A per-layer transcoder ``(*batch, d_in) -> (*batch, d_out)``; see the module docstring.

    ``Transcoder(cfg: TranscoderConfig, *, device=None, dtype=None)``.

    Raises:
        ShapeError: an ``encode`` / ``forward`` input not ``(*batch, d_in)``, a ``decode`` input not
            ``(*batch, d_sae)``, or either not in the weights' dtype.

    Source: Dunefsky et al. 2024, *Transcoders Find Interpretable LLM Feature Circuits*; sparsify
    ``sparsify/sparse_coder.py`` (skip transcoder).
    """

    _kind: ClassVar[str] = "Transcoder"
    cfg: TranscoderConfig


class SkipTranscoder(Transcoder):
    """A transcoder with a linear skip path ``x W_skipᵀ`` (``W_skip: (d_out, d_in)``, as sparsify/SAELens).

    Source: Dunefsky et al. 2024, *Transcoders Find Interpretable LLM Feature Circuits*; sparsify
    ``sparsify/sparse_coder.py`` (skip transcoder).
    """

    _kind: ClassVar[str] = "SkipTranscoder"

    def __init__(self, cfg: TranscoderConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super(SkipTranscoder, self).__init__(cfg, device=device, dtype=dtype)
        self.W_skip = nn.Parameter(torch.zeros(self.d_out, cfg.d_in, device=device, dtype=dtype))

    def skip(self, x: Float[torch.Tensor, "*batch d_in"], *,
             constant_weights: bool = False) -> Float[torch.Tensor, "*batch d_out"]:
        """The skip path ``x W_skipᵀ`` (``constant_weights``: ``W_skip`` detached, the gradient reaching ``x``
        only — :meth:`~.sparse_coder.SparseCoder.skip`).

        Raises:
            ShapeError: ``x`` is not a ``(*batch, d_in)`` tensor in the weights' dtype.

        Source: Dunefsky et al. 2024, *Transcoders Find Interpretable LLM Feature Circuits*; sparsify
        ``sparsify/sparse_coder.py`` (skip transcoder).
        """
        check_last_dim(x, self.cfg.d_in, self._kind, "x", self.W_skip)
        return F.linear(x, self.W_skip.detach() if constant_weights else self.W_skip)
