"""Train SAEs and (skip-)transcoders with the Lorsa trainer's core (:class:`~.trainer.TrainerCore`).

Objective (normalised space ``x · s_in -> y · s_out``, dataset-norm factors as for a Lorsa):
``‖y − ŷ‖²`` summed over the feature dim and averaged over non-BOS, non-pad tokens, plus the
method's sparsity term:

* ``"relu"`` — L1 weighted by the decoder norms, ``l1_coef · Σ_i acts_i ‖W_dec[i]‖`` (Bricken
  et al. 2023; SAELens ``standard``);
* ``"topk"`` / ``"batchtopk"`` — no penalty; AuxK against dead latents (Gao et al. 2024);
* ``"jumprelu"`` — ``l0_coef · Σ_i H(pre_i − θ_i)`` through the straight-through estimator of
  :meth:`~..modules.activations.JumpReLU.l0` (Rajamanoharan et al. 2024).

TopK / BatchTopK coders run through the sparse kernels of :mod:`~..modules.sparse_decode`
(``SparseCoderTrainConfig.sparse_kernels``, default on): dense encoder matmul without a graph, top-k
selection, ``embedding_bag`` decode and backward passes that touch only the selected features (AuxK
too); same values and gradients as the dense path up to summation order.

Decoder rows are kept at unit norm after every step for ReLU+L1, TopK and BatchTopK (SAELens,
sparsify); not for JumpReLU (set ``normalize_decoder`` to override). :meth:`SparseCoderTrainer.folded`
returns a copy acting on raw activations; checkpoints resume bit-exactly, as for a Lorsa.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from ..modules.activations import BatchTopK, JumpReLU, TopK
from ..modules.sae import SAEConfig, SparseAutoencoder
from ..modules.sparse_coder import SparseCoder, SparseCoderConfig, affine
from ..modules.sparse_decode import SparseActs, gathered_preact, sparse_decode
from ..modules.transcoder import SkipTranscoder, Transcoder, TranscoderConfig
from .activations import SiteActivationSource, SiteBatch
from .metrics import fvu
from .trainer import TrainConfig, TrainerCore

_CLASSES: dict[str, tuple[type[SparseCoder], type[SparseCoderConfig]]] = {
    "SparseAutoencoder": (SparseAutoencoder, SAEConfig),
    "Transcoder": (Transcoder, TranscoderConfig),
    "SkipTranscoder": (SkipTranscoder, TranscoderConfig),
}


def sparsity_terms(trainer: TrainerCore, act: torch.nn.Module, pre: torch.Tensor, acts: torch.Tensor,
                   dead: torch.Tensor, err: torch.Tensor,
                   W_dec: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The sparsity part of a dense sparse-coder loss: ``(penalty or None, aux, sparsity)``.

    ``pre, acts (n, d_sae)`` pre-activations and activations of ``act``; ``dead (d_sae,)`` the dead
    mask; ``err (n, d_out)`` the reconstruction error ``y − ŷ``; ``W_dec (d_sae, d_out)`` the
    decoder (a CLT passes a source layer's decoder over all its targets, flattened, and the
    matching error). ``penalty`` is what the loss adds (None: nothing): TopK / BatchTopK —
    ``aux_k_coef · AuxK`` when some latent is dead (:meth:`~.trainer.TrainerCore.aux_k_loss`);
    JumpReLU — ``l0_coef · mean L0`` (straight-through); ReLU — ``l1_coef · Σ acts_i ‖W_dec[i]‖``.
    ``aux`` and ``sparsity`` are the unweighted terms (zero where they do not apply).
    """
    config = trainer.config
    sparsity = torch.zeros((), dtype=pre.dtype)
    aux = torch.zeros((), dtype=pre.dtype)
    penalty: torch.Tensor | None = None
    if isinstance(act, (TopK, BatchTopK)):
        aux = trainer.aux_k_loss(pre, dead, err, W_dec, 2 * act.k)
        if config.aux_k_coef > 0 and dead.any():
            penalty = config.aux_k_coef * aux
    elif isinstance(act, JumpReLU):
        sparsity = act.l0(pre).mean()
        penalty = config.l0_coef * sparsity
    else:  # ReLU + decoder-norm-weighted L1
        sparsity = (acts * W_dec.norm(dim=-1)).sum(-1).mean()
        penalty = config.l1_coef * sparsity
    return penalty, aux, sparsity


@dataclass
class SparseCoderTrainConfig(TrainConfig):
    """:class:`TrainConfig` plus the sparsity coefficients of the sparse-coder losses.

    Attributes:
        l1_coef: weight of the decoder-norm-weighted L1 (ReLU coders).
        l0_coef: weight of the L0 penalty (JumpReLU coders).
        normalize_decoder: keep unit-norm decoder rows (None: yes except for JumpReLU).
        sparse_kernels: train TopK / BatchTopK coders through the sparse fast path
            (:meth:`~..modules.sparse_coder.SparseCoder.encode_sparse`, ``decode_sparse`` and a sparse
            AuxK); False: the dense reference (same values and gradients up to summation order).
    """

    l1_coef: float = 1e-3
    l0_coef: float = 1e-3
    normalize_decoder: bool | None = None
    sparse_kernels: bool = True


def step_metrics(loss: torch.Tensor, mse: torch.Tensor, y: torch.Tensor, out: torch.Tensor, l0: float,
                 dead: torch.Tensor, aux: torch.Tensor, sparsity: torch.Tensor) -> dict[str, float]:
    """The per-step metrics a sparse-coder loss reports (FVU of ``out`` against ``y``, L0, dead fraction, …)."""
    return {"loss": float(loss.detach()), "mse": float(mse.detach()), "fvu": float(fvu(y, out.detach())),
            "l0": l0, "dead_frac": float(dead.float().mean()), "aux": float(aux.detach()),
            "sparsity": float(sparsity.detach())}


class DictionaryTrainer(TrainerCore):
    """What the sparse-coder and cross-layer-transcoder trainers share: their config class, and
    unit-norm decoder columns by default unless the activation is a JumpReLU (whose threshold sets
    the scale)."""

    @classmethod
    def config_class(cls) -> type:
        return SparseCoderTrainConfig

    @property
    def activation_fn(self) -> Any:
        """The coder's activation function (a CLT's first layer's: they are all of one kind)."""
        raise NotImplementedError

    @property
    def normalize_decoder(self) -> bool:
        if self.config.normalize_decoder is not None:
            return self.config.normalize_decoder
        return not isinstance(self.activation_fn, JumpReLU)


class SparseCoderTrainer(DictionaryTrainer):
    """Trains an SAE / transcoder / skip transcoder ``coder`` on batches from ``source``.

    Args:
        coder: the module (modified in place; training-space weights).
        source: batch index -> :class:`~.activations.SiteBatch` (e.g. :class:`SiteActivationSource`).
        config: :class:`SparseCoderTrainConfig`.
    """

    desc = "sparse coder"
    weights_file = "coder.safetensors"
    config_key = "coder_config"

    def __init__(self, coder: SparseCoder, source: SiteActivationSource | Any,
                 config: SparseCoderTrainConfig) -> None:
        super().__init__(coder, source, config)
        self.coder = coder
        self.config: SparseCoderTrainConfig = config
        coder.train()

    @staticmethod
    def n_latents(module: Any) -> int:
        return int(module.cfg.d_sae)

    @property
    def activation_fn(self) -> Any:
        return self.coder.activation

    def after_norms(self) -> None:
        # an SAE reconstructs its input: one scale factor, so that b_dec centring folds exactly
        if isinstance(self.coder, SparseAutoencoder):
            self.s_out = self.s_in

    @torch.no_grad()
    def post_step(self) -> None:
        if self.normalize_decoder:
            W = self.coder.W_dec
            W.div_(W.norm(dim=-1, keepdim=True).clamp_min(1e-12))

    def module_config(self) -> dict[str, Any]:
        return {"class": type(self.coder).__name__, **self.coder.cfg.to_dict()}

    @classmethod
    def build_module(cls, meta: dict[str, Any]) -> torch.nn.Module:
        d = dict(meta[cls.config_key])
        module_cls, cfg_cls = _CLASSES[d.pop("class")]
        return module_cls(cfg_cls.from_dict(d))

    # -------------------------------------------------------------- step
    def loss(self, batch: SiteBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss on one batch (normalised space) and its metrics (FVU, L0, dead fraction, aux, sparsity)."""
        assert self.s_in is not None and self.s_out is not None
        coder = self.coder
        mask = batch.loss_mask
        x = batch.x[mask].to(coder.W_dec.dtype) * self.s_in
        y = batch.y[mask].to(coder.W_dec.dtype) * self.s_out
        if self.config.sparse_kernels and coder.supports_sparse:
            return self._sparse_loss(x, y)
        pre = affine(coder.encoder_input(x), coder.W_enc, coder.b_enc)
        acts = coder.activation(pre)
        out, err, mse = self._reconstruction(x, y, coder.decode(acts))
        loss = mse
        active = acts > 0
        dead = self.count_firing(active, x.shape[0])
        penalty, aux, sparsity = sparsity_terms(self, coder.activation, pre, acts, dead, err, coder.W_dec)
        if penalty is not None:
            loss = loss + penalty
        return loss, step_metrics(loss, mse, y, out, float(active.sum(-1).float().mean()), dead, aux, sparsity)

    def _reconstruction(self, x: torch.Tensor, y: torch.Tensor, decoded: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(output, error, MSE)``: the decoded features plus the skip path, against the target ``y``."""
        skip = self.coder.skip(x)
        out = decoded if skip is None else decoded + skip
        err = y - out
        return out, err, err.pow(2).sum(-1).mean()

    def _sparse_loss(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """:meth:`loss` of a TopK / BatchTopK coder through the sparse kernels (:mod:`~..modules.sparse_decode`)."""
        coder = self.coder
        pre, acts = coder.encode_sparse(x)
        out, err, mse = self._reconstruction(x, y, coder.decode_sparse(acts))
        loss = mse
        dead = self.count_fired(acts.fired(), x.shape[0])
        act: Any = coder.activation
        aux = torch.zeros((), dtype=mse.dtype)
        if dead.any() and self.config.aux_k_coef > 0:
            # AuxK (as TrainerCore.aux_k_loss): the dead latents' top-k_aux reconstruct the error
            k_aux = min(self.config.aux_k or 2 * act.k, int(dead.sum()))
            idx = pre.masked_fill(~dead, float("-inf")).topk(k_aux, dim=-1).indices
            rows = torch.arange(pre.shape[0], device=pre.device).repeat_interleave(k_aux)
            cols = idx.reshape(-1)
            offsets = torch.arange(0, rows.numel(), k_aux, device=pre.device)
            vals = gathered_preact(coder.encoder_input(x), coder.W_enc, coder.b_enc, rows, cols, offsets, pre).relu()
            z_aux = SparseActs(rows=rows, cols=cols, vals=vals, offsets=offsets, d_sae=coder.cfg.d_sae)
            e = err.detach()
            aux = ((sparse_decode(z_aux, coder.W_dec) - e).pow(2).sum(-1).mean()
                   / self.batch_mean(e.pow(2).sum(-1)).clamp_min(1e-12))
            loss = loss + self.config.aux_k_coef * aux
        return loss, step_metrics(loss, mse, y, out, acts.l0(), dead, aux, torch.zeros(()))

    # ----------------------------------------------------------- results
    @torch.no_grad()
    def folded(self) -> SparseCoder:
        """A copy acting on raw activations: ``f_raw(x) = f(x · s_in) / s_out`` (eval mode).

        ``W_enc *= s_in`` (pre-activations unchanged, so the same features fire), ``W_dec, b_dec
        /= s_out``, ``W_skip *= s_in / s_out``; an SAE's ``b_dec`` centring uses ``s_in = s_out``.
        Then decoder rows are renormalised (:meth:`~..modules.sparse_coder.SparseCoder.fold_decoder_norm_`)
        for ReLU/JumpReLU, and for TopK (all rows share one norm, so the ranking is unchanged);
        a BatchTopK keeps its rows at ``1/s_out`` so that its threshold stays valid.
        """
        if self.s_in is None or self.s_out is None:
            raise RuntimeError("norms are not estimated yet: train first")
        out = copy.deepcopy(self.coder).eval()
        out.W_enc.mul_(self.s_in)
        out.W_dec.div_(self.s_out)
        out.b_dec.div_(self.s_out)
        if isinstance(out, SkipTranscoder):
            out.W_skip.mul_(self.s_in / self.s_out)
        if not isinstance(out.activation, BatchTopK):
            out.fold_decoder_norm_()
        return out
