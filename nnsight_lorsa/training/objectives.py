"""What is module-specific in training: one small objective per module kind, called by the trainer.

An objective says how to scale the activations (dataset-norm factors), the loss terms, the
decoder constraint after each step, how to fold the scaling into a copy acting on raw activations,
and how a checkpoint names and rebuilds the module. :func:`_objective_for` picks it from the
module's type; :class:`~.trainer.Trainer` owns everything else (step loop, Adam + WSD, dead
counters, AuxK, checkpoints, data parallelism).

* Lorsa (Lorsa paper (He et al. 2025) §3.2): MSE of the Lorsa output against the MHSA output in the
  normalised space ``x · s_in -> y · s_out``; AuxK against dead heads; unit-norm ``w_o`` after every
  step (footnote 1); QK optionally initialised from the MHSA once the norms are known (App. B.3).
* SAE / transcoder / skip transcoder: ``‖y − ŷ‖²`` plus the activation's sparsity term
  (:func:`_sparsity_terms`): AuxK for TopK / BatchTopK / AbsTopK / GroupMax (Gao et al. 2024), ``l0_coef`` · L0 through
  the straight-through estimator for JumpReLU (Rajamanoharan et al. 2024), decoder-norm-weighted
  L1 for ReLU (Bricken et al. 2023). TopK / BatchTopK train through the sparse kernels of
  :mod:`~..modules.sparse_decode` (``TrainConfig.sparse_kernels``; same values and gradients up to
  summation order). An SAE uses one scale factor (``s_out = s_in``) so that ``b_dec`` centring folds.
* CLT (Ameisen et al. 2025, *Circuit Tracing*, cross-layer transcoders): Σ over layers of the per-layer transcoder
  loss with
  per-layer scale factors, plus per source layer the sparsity term with its decoder over all the
  layers it writes to (flattened), as Ameisen et al. weight the sparsity by the concatenated decoder
  norm. Dense path only (no sparse kernels).

Decoder rows are kept at unit norm for every dictionary except JumpReLU ones (``normalize_decoder``
overrides); the fold keeps a rank-based activation's ranking (one common factor, :meth:`fold`).

Here: the dictionaries' objectives and the registry (:data:`_OBJECTIVES`, :func:`_objective_for`); the Lorsa's
is :mod:`.lorsa_objective`, the contract they share (:class:`_Objective`, :class:`TrainingState`)
:mod:`.objective_base`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .._checks import is_real
from .._placement import f32
from ..errors import (
    ArgumentError,
    CheckpointError,
    ConfigMismatchError,
    NotReadyError,
    ShapeError,
    UnsupportedArchitectureError,
)
from ..modules.activations import AbsTopK, BatchTopK, GroupMax, JumpReLU, TopK
from ..modules.clt import CLTConfig, CrossLayerTranscoder
from ..modules.sae import SAEConfig, SparseAutoencoder
from ..modules.sparse_coder import SparseCoder, SparseCoderConfig, affine
from ..modules.sparse_decode import SparseActs, gathered_preact, sparse_decode
from ..modules.transcoder import SkipTranscoder, Transcoder, TranscoderConfig
from .activations import Batch
from .lorsa_objective import LorsaObjective
from .metrics import fvu
from .objective_base import (  # noqa: F401 - TrainingState / _Objective: the trainer's names for them
    Metrics,
    TrainingState,
    _check_module,
    _fits,
    _Objective,
    _ratio,
    _require_norms,
    _require_tokens,
    fold_rows,
    row_norms,
)


# --------------------------------------------------------------------------- dictionaries
def _sparsity_terms(t: TrainingState, act: torch.nn.Module, pre: torch.Tensor, acts: torch.Tensor, dead: torch.Tensor,
                    err: torch.Tensor, W_dec: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The sparsity part of a dense dictionary loss: ``(penalty or None, aux, sparsity)``.

    ``pre, acts (n, d_sae)`` pre-activations and activations of ``act``; ``dead (d_sae,)`` the dead
    mask; ``err (n, d_out)`` the error ``y − ŷ``; ``W_dec (d_sae, d_out)`` the decoder (a CLT passes a
    source layer's decoder over all its targets, flattened, and the matching error). ``penalty`` is
    what the loss adds: the k-sparse TopK / BatchTopK / AbsTopK / GroupMax — ``aux_k_coef · AuxK`` when some
    latent is dead (AbsTopK: dead latents picked by ``|pre|``, signed, as SAELens ``abstopk``; GroupMax: as TopK,
    as sparsify); JumpReLU — ``l0_coef · mean L0`` (straight-through); ReLU — ``l1_coef · Σ acts_i ‖W_dec[i]‖``.
    ``aux`` and ``sparsity`` are the unweighted terms (zero where they do not apply). (Until 2026-11-27 AbsTopK and
    GroupMax fell to the ReLU branch: an "L1" of AbsTopK's signed activations, which rewards negative ones.)
    """
    config = t.config
    sparsity = torch.zeros((), dtype=f32(pre).dtype, device=pre.device)
    aux = torch.zeros((), dtype=f32(pre).dtype, device=pre.device)
    penalty: torch.Tensor | None = None
    if isinstance(act, (TopK, BatchTopK, AbsTopK, GroupMax)):
        aux = t.aux_k_loss(pre, dead, err, W_dec, 2 * act.k, signed=isinstance(act, AbsTopK))
        if config.aux_k_coef > 0 and dead.any():
            penalty = config.aux_k_coef * aux
    elif isinstance(act, JumpReLU):
        sparsity = f32(act.l0(pre)).mean()
        penalty = config.l0_coef * sparsity
    else:  # ReLU + decoder-norm-weighted L1
        sparsity = f32(acts * W_dec.norm(dim=-1)).sum(-1).mean()
        penalty = config.l1_coef * sparsity
    return penalty, aux, sparsity


def _step_metrics(loss: torch.Tensor, mse: torch.Tensor, y: torch.Tensor, out: torch.Tensor, l0: float,
                  dead: torch.Tensor, aux: torch.Tensor, sparsity: torch.Tensor) -> Metrics:
    return {"loss": float(loss.detach()), "mse": float(mse.detach()), "fvu": float(fvu(y, out.detach())),
            "l0": l0, "dead_frac": float(dead.float().mean()), "aux": float(aux.detach()),
            "sparsity": float(sparsity.detach())}


class _DictionaryObjective(_Objective):
    """Unit-norm decoder rows unless the activation is a JumpReLU (``normalize_decoder`` overrides);
    the module is put in training mode (BatchTopK's batch rule and threshold updates)."""

    def __init__(self, module: Any) -> None:
        super().__init__(module)
        module.train()

    def activation_fn(self) -> Any:
        raise NotImplementedError

    def normalize_decoder(self, t: TrainingState) -> bool:
        if t.config.normalize_decoder is not None:
            return bool(t.config.normalize_decoder)
        return not isinstance(self.activation_fn(), JumpReLU)


_CODER_CLASSES: dict[str, tuple[type[SparseCoder], type[SparseCoderConfig]]] = {
    "SparseAutoencoder": (SparseAutoencoder, SAEConfig),
    "Transcoder": (Transcoder, TranscoderConfig),
    "SkipTranscoder": (SkipTranscoder, TranscoderConfig),
}


class _SparseCoderObjective(_DictionaryObjective):
    desc = "sparse coder"
    weights_file = "coder.safetensors"
    config_key = "coder_config"
    module_type = SparseCoder

    def __init__(self, module: Any) -> None:
        norm = getattr(module.cfg, "normalize_activations", "none")
        if norm != "none":  # the loss below reconstructs x itself, not its normalised form
            raise UnsupportedArchitectureError(f"training an SAE with normalize_activations={norm!r} (a run-time "
                                               "per-token normalisation, for loaded SAELens files) is not supported")
        super().__init__(module)

    def n_latents(self) -> int:
        return int(self.module.cfg.d_sae)

    def check_source(self, source: Any) -> None:
        if getattr(source, "stacked", False):
            raise ConfigMismatchError(f"a {type(self.module).__name__} reads one site: the source stacks "
                                      f"{source.n_layers} (a CLT's source)")

    def activation_fn(self) -> Any:
        return self.module.activation

    @torch.no_grad()
    def post_step(self, t: TrainingState) -> None:
        if self.normalize_decoder(t):
            W = self.module.W_dec
            W.div_(W.norm(dim=-1, keepdim=True).clamp_min(1e-12))

    def module_config(self) -> dict[str, Any]:
        return {"class": type(self.module).__name__, **self.module.cfg.to_dict()}

    @classmethod
    def build_module(cls, meta: dict[str, Any]) -> torch.nn.Module:
        d = dict(meta[cls.config_key])
        module_cls, cfg_cls = _CODER_CLASSES[d.pop("class")]
        return module_cls(cfg_cls.from_dict(d))

    def loss(self, t: TrainingState, batch: Batch) -> tuple[torch.Tensor, Metrics]:
        coder = self.module
        batch = batch.to(coder.W_dec.device, coder.W_dec.dtype)
        mask = batch.loss_mask
        x = batch.x[mask] * self.s_in
        y = batch.y[mask] * self.s_out
        if t.config.sparse_kernels and coder.supports_sparse:
            return self._sparse_loss(t, x, y)
        pre = affine(coder.encoder_input(x), coder.W_enc, coder.b_enc)
        acts = coder.activation(pre)
        out, err, mse = self._reconstruction(x, y, coder.decode(acts))
        loss = mse
        active = acts != 0  # fired: non-zero (AbsTopK's features fire negative too)
        dead = t.count_fired(active.any(0), x.shape[0])
        penalty, aux, sparsity = _sparsity_terms(t, coder.activation, pre, acts, dead, err, coder.W_dec)
        if penalty is not None:
            loss = loss + penalty
        return loss, _step_metrics(loss, mse, y, out, float(active.sum(-1).float().mean()), dead, aux, sparsity)

    def _reconstruction(self, x: torch.Tensor, y: torch.Tensor, decoded: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(output, error, MSE)``: the decoded features plus the skip path, against the target ``y``
        (error and MSE in fp32)."""
        skip = self.module.skip(x)
        out = decoded if skip is None else decoded + skip
        err = f32(y) - f32(out)
        return out, err, err.pow(2).sum(-1).mean()

    def _sparse_loss(self, t: TrainingState, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
        """:meth:`loss` of a TopK / BatchTopK coder through the sparse kernels (:mod:`~..modules.sparse_decode`)."""
        coder = self.module
        pre, acts = coder.encode_sparse(x)
        out, err, mse = self._reconstruction(x, y, coder.decode_sparse(acts))
        loss = mse
        dead = t.count_fired(acts.fired(), x.shape[0])
        act: Any = coder.activation
        aux = torch.zeros((), dtype=mse.dtype, device=mse.device)
        if dead.any() and t.config.aux_k_coef > 0:
            # AuxK (as Trainer.aux_k_loss): the dead latents' top-k_aux reconstruct the error
            k_aux = min(t.config.aux_k or 2 * act.k, int(dead.sum()))
            idx = pre.masked_fill(~dead, float("-inf")).topk(k_aux, dim=-1).indices
            rows = torch.arange(pre.shape[0], device=pre.device).repeat_interleave(k_aux)
            cols = idx.reshape(-1)
            offsets = torch.arange(0, rows.numel(), k_aux, device=pre.device)
            vals = gathered_preact(coder.encoder_input(x), coder.W_enc, coder.b_enc, rows, cols, offsets, pre).relu()
            z_aux = SparseActs(rows=rows, cols=cols, vals=vals, offsets=offsets, d_sae=coder.cfg.d_sae)
            e = err.detach()
            aux = ((f32(sparse_decode(z_aux, coder.W_dec)) - e).pow(2).sum(-1).mean()
                   / t.batch_mean(e.pow(2).sum(-1)).clamp_min(1e-12))
            loss = loss + t.config.aux_k_coef * aux
        return loss, _step_metrics(loss, mse, y, out, acts.l0(), dead, aux, torch.zeros((), device=mse.device))

    @torch.no_grad()
    def fold(self, t: TrainingState) -> SparseCoder:
        """``f_raw(x) = f(x · s_in) / s_out`` (eval mode): ``W_enc *= s_in`` (the same features fire),
        ``W_dec, b_dec /= s_out``, ``W_skip *= s_in / s_out``; then decoder rows are renormalised: each row to unit
        norm for ReLU / JumpReLU (:meth:`~..modules.sparse_coder.SparseCoder.fold_decoder_norm_`: exact, each
        feature's contribution kept); for the rank-based TopK / AbsTopK / GroupMax all rows by one common factor
        (their mean norm; unit rows when they were kept at unit norm, ``normalize_decoder``): a per-row factor would
        rank ``pre_i · ‖W_dec_i‖`` instead of ``pre_i`` and pick other features where the norms differ
        (``normalize_decoder=False``); BatchTopK's rows stay at ``1/s_out`` so that its threshold stays valid."""
        _require_norms(self)
        src = self.module  # inside the trainer's ``editing``: a bf16 module's parameters are its fp32 masters
        out = t.fold_copy(src).eval()  # written row chunk by row chunk below, each rounded once into its dtype
        s_in, s_out = self.s_in, self.s_out
        act = out.activation
        if isinstance(act, (TopK, AbsTopK, GroupMax)):  # one factor: every feature's rank kept
            common = row_norms(src.W_dec, lambda w: w.div_(s_out)).mean().clamp_min(1e-12)
            fold_rows(out.W_dec, src.W_dec, lambda w, r: w.div_(s_out).div_(common))
            fold_rows(out.W_enc, src.W_enc, lambda w, r: w.mul_(s_in).mul_(common))
            fold_rows(out.b_enc, src.b_enc, lambda w, r: w.mul_(common))
        elif not isinstance(act, BatchTopK):  # fold_decoder_norm_ of the scaled decoder: each row to unit norm
            norm = row_norms(src.W_dec, lambda w: w.div_(s_out)).clamp_min(1e-12)
            fold_rows(out.W_dec, src.W_dec, lambda w, r: w.div_(s_out).div_(norm[r, None]))
            fold_rows(out.W_enc, src.W_enc, lambda w, r: w.mul_(s_in).mul_(norm[None, :]))
            fold_rows(out.b_enc, src.b_enc, lambda w, r: w.mul_(norm[r]))
            if isinstance(act, JumpReLU):
                fold_rows(act.threshold, src.activation.threshold, lambda w, r: w.mul_(norm[r]))
        else:  # BatchTopK: rows stay at 1/s_out
            fold_rows(out.W_dec, src.W_dec, lambda w, r: w.div_(s_out))
            fold_rows(out.W_enc, src.W_enc, lambda w, r: w.mul_(s_in))
        fold_rows(out.b_dec, src.b_dec, lambda w, r: w.div_(s_out))
        if getattr(out, "W_skip", None) is not None:  # a skip transcoder's linear path
            fold_rows(out.W_skip, src.W_skip, lambda w, r: w.mul_(s_in / s_out))
        return out


class _SAEObjective(_SparseCoderObjective):
    """An SAE reconstructs its input: one scale factor (``s_out = s_in``), so that ``b_dec`` centring folds exactly."""

    module_type = SparseAutoencoder

    def after_norms(self, t: TrainingState) -> None:
        self.s_out = self.s_in


# --------------------------------------------------------------------------- CLT
class _CLTObjective(_DictionaryObjective):
    """Per-layer scale factors :attr:`s_in_layers` / :attr:`s_out_layers` (:attr:`s_in` / :attr:`s_out`: their
    means)."""

    desc = "CLT"
    weights_file = "clt.safetensors"
    config_key = "clt_config"
    module_type = CrossLayerTranscoder

    def n_latents(self) -> int:
        return int(self.module.cfg.n_layers * self.module.cfg.d_sae)

    def activation_fn(self) -> Any:
        return self.module.activation[0]

    def module_config(self) -> dict[str, Any]:
        return self.module.cfg.to_dict()

    @classmethod
    def build_module(cls, meta: dict[str, Any]) -> torch.nn.Module:
        return CrossLayerTranscoder(CLTConfig.from_dict(dict(meta[cls.config_key])))

    def check_source(self, source: Any) -> None:
        clt = self.module
        n_src, d_src = getattr(source, "n_layers", None), getattr(source, "d_model", None)
        if n_src is not None and n_src != clt.n_layers:
            raise ConfigMismatchError(f"the CLT spans {clt.n_layers} layers, the activation source {n_src}")
        if d_src is not None and d_src != clt.cfg.d_in:
            raise ConfigMismatchError(f"the CLT has d_model={clt.cfg.d_in}, the activation source {d_src}")

    def check_batch(self, batch: Batch) -> None:
        """Raise :class:`~..errors.ShapeError` unless ``batch.x`` / ``batch.y`` are
        ``(n_layers, batch, pos, d_model)`` of this CLT and ``loss_mask`` is ``(batch, pos)``."""
        c = self.module.cfg
        for name, v in (("x", batch.x), ("y", batch.y)):
            if v.dim() != 4 or v.shape[0] != c.n_layers or v.shape[-1] != c.d_in:
                raise ShapeError(f"CLT training batch: {name} must be (n_layers={c.n_layers}, batch, pos, "
                                 f"d_model={c.d_in}), got {tuple(v.shape)}")
        if batch.x.shape != batch.y.shape or tuple(batch.loss_mask.shape) != tuple(batch.x.shape[1:3]):
            raise ShapeError(f"CLT training batch: x {tuple(batch.x.shape)}, y {tuple(batch.y.shape)} and "
                             f"loss_mask {tuple(batch.loss_mask.shape)} disagree")

    @torch.no_grad()
    def estimate_norms(self, t: TrainingState) -> None:
        norms_x, norms_y = [], []
        for i in range(t.config.norm_batches):  # in fp32 on the activations' device
            b = t.source(i)
            self.check_batch(b)
            mask = b.loss_mask.to(b.x.device)
            norms_x.append(f32(b.x[:, mask]).norm(dim=-1))
            norms_y.append(f32(b.y[:, mask.to(b.y.device)]).norm(dim=-1).to(b.x.device))
        _require_tokens(t, sum(v.shape[1] for v in norms_x))
        root_d = math.sqrt(self.module.cfg.d_in)
        self.s_in_layers = [_ratio(root_d, float(v)) for v in torch.cat(norms_x, 1).mean(1)]
        self.s_out_layers = [_ratio(root_d, float(v)) for v in torch.cat(norms_y, 1).mean(1)]
        self.s_in = sum(self.s_in_layers) / len(self.s_in_layers)
        self.s_out = sum(self.s_out_layers) / len(self.s_out_layers)

    def _scales(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s_in, s_out)`` per layer, ``(n_layers, 1, 1)`` in ``like``'s dtype on its device."""
        if self.s_in_layers is None or self.s_out_layers is None:
            raise NotReadyError(f"{type(self).__name__}: the scale factors are not estimated yet: run "
                                "Trainer.estimate_norms() or a train_step first")
        return (torch.tensor(self.s_in_layers, dtype=like.dtype, device=like.device)[:, None, None],
                torch.tensor(self.s_out_layers, dtype=like.dtype, device=like.device)[:, None, None])

    def loss(self, t: TrainingState, batch: Batch) -> tuple[torch.Tensor, Metrics]:
        """``mse`` / ``aux`` / ``sparsity`` summed over layers, ``fvu`` / ``l0`` their means (per layer as
        ``fvu_{l}`` / ``l0_{l}``), ``dead_frac`` over all ``n_layers · d_sae`` features."""
        self.check_batch(batch)
        clt = self.module
        batch = batch.to(clt.W_enc.device, clt.W_enc.dtype)
        s_in, s_out = self._scales(clt.W_enc)
        mask = batch.loss_mask
        x = batch.x[:, mask] * s_in                                  # (n_layers, n, d_model)
        y = batch.y[:, mask] * s_out
        n_layers, n_tok = x.shape[0], x.shape[1]
        pres = [affine(x[layer], clt.W_enc[layer], clt.b_enc[layer]) for layer in range(n_layers)]
        acts = torch.stack([clt.activation[layer](pres[layer]) for layer in range(n_layers)])
        out = clt.decode(acts, x)
        err = f32(y) - f32(out)                                      # the loss in fp32
        mse = err.pow(2).sum(-1).mean(-1).sum()
        loss = mse
        active = acts != 0  # fired: non-zero (AbsTopK's features fire negative too)
        dead = t.count_fired(active.any(1).reshape(-1), n_tok).view(n_layers, -1)
        aux = torch.zeros((), dtype=mse.dtype, device=mse.device)
        sparsity = torch.zeros((), dtype=mse.dtype, device=mse.device)
        for layer in range(n_layers):
            # a source layer's features write to layers layer..n_layers-1: decoder and error over all of them
            err_l = err[layer:].transpose(0, 1).reshape(n_tok, (n_layers - layer) * err.shape[-1])
            W_l = clt.W_dec(layer).reshape(clt.cfg.d_sae, -1)
            penalty, aux_l, sparsity_l = _sparsity_terms(t, clt.activation[layer], pres[layer], acts[layer],
                                                         dead[layer], err_l, W_l)
            if penalty is not None:
                loss = loss + penalty
            aux = aux + aux_l.detach()
            sparsity = sparsity + sparsity_l.detach()
        out_d = out.detach()
        fvus = [float(fvu(y[layer], out_d[layer])) for layer in range(n_layers)]
        l0s = [float(v) for v in active.sum(-1).float().mean(-1)]
        metrics = {"loss": float(loss.detach()), "mse": float(mse.detach()), "fvu": sum(fvus) / n_layers,
                   "l0": sum(l0s) / n_layers, "dead_frac": float(dead.float().mean()), "aux": float(aux),
                   "sparsity": float(sparsity)}
        metrics.update({f"fvu_{layer}": v for layer, v in enumerate(fvus)})
        metrics.update({f"l0_{layer}": v for layer, v in enumerate(l0s)})
        return loss, metrics

    @torch.no_grad()
    def post_step(self, t: TrainingState) -> None:
        if self.normalize_decoder(t):
            for layer in range(self.module.n_layers):
                W = self.module.W_dec(layer)
                W.div_(W.flatten(1).norm(dim=-1)[:, None, None].clamp_min(1e-12))

    def save_meta(self, t: TrainingState) -> dict[str, Any]:
        return {"s_in_layers": self.s_in_layers, "s_out_layers": self.s_out_layers}

    def restore_meta(self, t: TrainingState, meta: dict[str, Any], path: Any) -> None:
        s_in, s_out = meta.get("s_in_layers"), meta.get("s_out_layers")
        if s_in is None and s_out is None and meta["step"] == 0:  # saved before the scale factors were estimated
            self.s_in_layers = self.s_out_layers = None
            return
        n = self.module.n_layers
        checked = []
        for key, values in (("s_in_layers", s_in), ("s_out_layers", s_out)):
            # until 2026-11-28 only the lengths were checked: a string, zero or NaN entry was taken and every fold
            # and loss went wrong silently from it
            if not isinstance(values, list) or len(values) != n or not all(
                    is_real(v) and math.isfinite(v) and v > 0 for v in values):
                raise CheckpointError(f"{path}: key {key!r} must be a list of {n} positive finite numbers (one per "
                                      f"layer; both null before the first step), got {values!r}")
            checked.append([float(v) for v in values])
        self.s_in_layers, self.s_out_layers = checked

    @torch.no_grad()
    def fold(self, t: TrainingState) -> CrossLayerTranscoder:
        """``ŷ_raw_l' = ŷ_l'(x · s_in) / s_out[l']`` (eval mode): ``W_enc[l] *= s_in[l]`` (the same
        features fire with the same values, so thresholds stay valid), ``W_dec_l[:, l' − l] /= s_out[l']``,
        ``b_dec[l] /= s_out[l]``, ``W_skip[l] *= s_in[l] / s_out[l]``; decoder rows are not renormalised."""
        src = self.module  # inside the trainer's ``editing``: a bf16 module's parameters are its fp32 masters
        s_in, s_out = self._scales(src.W_enc)
        out = t.fold_copy(src).eval()  # written row chunk by row chunk below, each rounded once into its dtype
        for layer in range(out.n_layers):
            fold_rows(out.W_enc[layer], src.W_enc[layer], lambda w, r, s=s_in[layer]: w.mul_(s))
            fold_rows(out.W_dec(layer), src.W_dec(layer),
                      lambda w, r, s=s_out[layer:, 0, 0][None, :, None]: w.div_(s))
        fold_rows(out.b_dec, src.b_dec, lambda w, r: w.div_(s_out[r, 0]))
        if out.W_skip is not None:
            ratio = s_in / s_out
            for layer in range(out.n_layers):
                fold_rows(out.W_skip[layer], src.W_skip[layer], lambda w, r, s=ratio[layer]: w.mul_(s))
        return out


#: the objective registry: module kind -> objective, the first whose ``module_type`` fits (an SAE before
#: the other sparse coders)
_OBJECTIVES: tuple[type[_Objective], ...] = (LorsaObjective, _SAEObjective, _SparseCoderObjective, _CLTObjective)


def _objective_for(module: Any) -> _Objective:
    """The objective of ``module`` (a Lorsa, SAE, (skip) transcoder or CLT), with its defaults.

    Raises:
        ArgumentError: (a ``TypeError``) another module type.
    """
    for cls in _OBJECTIVES:
        if _fits(cls, module):
            return cls(module)
    raise ArgumentError(f"cannot train a {type(module).__name__}: expected a Lorsa, SparseAutoencoder, "
                        "Transcoder, SkipTranscoder or CrossLayerTranscoder")


def _objective_class(meta: dict[str, Any], path: Any) -> type[_Objective]:
    """The objective class whose ``config_key`` a checkpoint's ``trainer.json`` holds.

    Raises:
        CheckpointError: none of them.
    """
    for cls in _OBJECTIVES:
        if cls.config_key in meta:
            return cls
    raise CheckpointError(f"{path}: malformed (no lorsa_config, coder_config or clt_config)")
