"""One trainer for every module kind: Lorsa, SAE, (skip) transcoder, cross-layer transcoder.

:class:`Trainer` draws batch ``i`` of an :class:`~.activations.ActivationSource` (or any callable
``index -> Batch``) at step ``i`` and minimises the module's objective (:mod:`.objectives`, picked
from the module's type: the loss terms, decoder constraint, norm scaling and folding) in the
normalised space ``x · s_in -> y · s_out`` (dataset-wise factors ``s = sqrt(d) / E‖·‖`` estimated on
the first ``norm_batches`` batches; per layer for a CLT), with Adam, a warmup–stable–decay LR,
gradient clipping, dead-latent counters and AuxK (Gao et al. 2024: latents silent for
``dead_after_tokens`` tokens reconstruct the residual error with their own top-``aux_k``, weighted
by ``aux_k_coef``). :meth:`Trainer.folded` returns a copy of the module acting on raw activations.

Checkpoints (:meth:`Trainer.save_checkpoint` / :meth:`Trainer.resume`) hold the training-space
weights (and a bf16 module's fp32 master weights, :mod:`.master_weights`), Adam state, dead counters, scale
factors and step as safetensors + JSON, and resume
bit-exactly because batch ``i`` depends only on ``i``. A save is atomic and a load verified
(:mod:`.checkpoint_io`: temporary sibling, fsync, rename; a sha256 manifest written last).
Data parallelism (:mod:`.distributed`) hooks
in through :attr:`Trainer.dist`: the loss of this rank's part of the global batch goes through DDP,
and the dead counters (:meth:`Trainer.count_fired`) and batch means (:meth:`Trainer.batch_mean`) are
combined over the ranks.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm

from .._checks import TRAINING_SPACE, check_flag
from .._placement import check_placement_args, f32, placement
from ..errors import (
    ArgumentError,
    CheckpointError,
    ConfigMismatchError,
    NonFiniteError,
    RankFailedError,
)
from ..formats.validate import count_non_finite
from .activations import Batch, checked_batch
from .checkpoint_io import check_checkpointing, verified_checkpoint, write_checkpoint
from .master_weights import MasterWeights
from .objectives import TrainingState, _Objective, _objective_class, _objective_for
from .schedule import wsd_lr_factor
from .train_config import TrainConfig as TrainConfig  # defined there; imported from here too
from .wandb_log import WandbRun, flat_metrics

#: a checkpoint's fp32 master weights (a bf16 run's; absent when the module has none)
MASTERS_FILE = "masters.safetensors"


class _ObjectiveField:
    """A trainer attribute held by its objective (the scale factors): read and set there."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, trainer: Any, owner: Any = None) -> Any:
        return self if trainer is None else getattr(trainer.objective, self.name)

    def __set__(self, trainer: Any, value: Any) -> None:
        setattr(trainer.objective, self.name, value)


class Trainer:
    """Trains ``module`` in place (training-space weights) on batches from ``source``.

    Args:
        module: a :class:`~..modules.lorsa.Lorsa`, :class:`~..modules.sae.SparseAutoencoder`,
            :class:`~..modules.transcoder.Transcoder` / ``SkipTranscoder`` or
            :class:`~..modules.clt.CrossLayerTranscoder`; its type picks the objective (the
            activation — TopK, BatchTopK, AbsTopK, GroupMax, JumpReLU, ReLU — picks a dictionary's sparsity term).
            Or an objective holding the module with its own settings: a Lorsa's MHSA initialisation
            and recipe go in :class:`~.objectives.LorsaObjective` (``LorsaObjective(lorsa, mhsa=...,
            recipe=LorsaRecipe(...))``).
        source: batch index -> :class:`~.activations.Batch` (:class:`~.activations.ActivationSource`).
        config: :class:`TrainConfig`.

    Attributes:
        objective: the module's objective (it owns the scale factors and the kind's state; it sees the
            trainer through a :class:`~.objectives.TrainingState`).
        masters: the fp32 master weights (:class:`~.master_weights.MasterWeights`) of a bf16 module's parameters;
            empty for an fp32 / fp64 module or with ``TrainConfig.master_weights=False``. The module's weights are
            their rounding, rewritten after every step: edit weights by hand between steps inside
            ``with trainer.masters.editing(trainer.module):`` (the edit then reaches the masters).
        step: steps taken. s_in, s_out: the scale factors (the objective's; None before the first step;
            a CLT's are the means of ``s_in_layers`` / ``s_out_layers``, its per-layer lists).
        tokens_since_fired: ``(n_latents,)`` int64 dead counters, on the module's device.

    Devices and dtypes: the module may be on any device (CPU, CUDA) in any float dtype but fp16 (refused:
    without loss scaling fp16 gradients underflow and overflow; use bf16), the model that produced the
    activations on another device and in another dtype (e.g. a bf16 model on CUDA with an fp32 module): every
    batch is moved to the module's device and cast to its dtype at the module boundary, losses and logged
    metrics are computed in fp32, and an MHSA given as ``mhsa`` may live where the model does. A bf16 module
    trains through fp32 master weights (:mod:`.master_weights`, :attr:`masters`; ``TrainConfig.master_weights``):
    its forward and backward run in bf16, Adam steps an fp32 master of every parameter with fp32 moments, and
    after every step the module's weights are the masters rounded once; the decoder constraint, dead-latent
    remedies, a Lorsa's initialisation and :meth:`folded` act on the masters (in fp32, rounded once). It costs
    14 bytes per parameter (bf16 weight 2 + master 4 + moments 8; fp32 training 12, bf16 without masters 6) and
    keeps the updates that bf16 weights alone round away (5 steps at ``lr=1e-4``: the masters end within 2–16 % of
    the fp32 run's update from it, the bf16 weights without masters 87–90 % for a dictionary: docs/training.md).

    Raises:
        ArgumentError: ``config`` not a valid :class:`TrainConfig` (a field set out of range after
            construction). TypeError: another module type. PlacementError: the module's parameters are on ``meta`` or
            on several devices. ConfigMismatchError: a module with fp16 or complex parameters; a CLT whose layer
            count / width differs from the source's, a stacked (CLT) source for another module, or a Lorsa on an
            :class:`~.activations.ActivationSource` without positions. ShapeError: (CLT, from the
            first step) a batch that does not fit.

    Source: Lorsa paper (He et al. 2025) §3.2; Gao et al. 2024 (AuxK); Llamascopium trainer.
    """

    s_in = _ObjectiveField("s_in")
    s_out = _ObjectiveField("s_out")
    s_in_layers = _ObjectiveField("s_in_layers")
    s_out_layers = _ObjectiveField("s_out_layers")

    def __init__(self, module: torch.nn.Module | _Objective, source: Callable[[int], Batch],
                 config: TrainConfig) -> None:
        if not isinstance(config, TrainConfig):
            raise ArgumentError(f"config must be a TrainConfig, got {type(config).__name__}")
        if not callable(source):
            raise ArgumentError(f"source must be a callable index -> Batch (e.g. an ActivationSource), got a "
                                f"{type(source).__name__}")
        config.validate()  # again: a field may have been set after construction
        given, trained = (module, module.module) if isinstance(module, _Objective) else (None, module)
        device, _ = placement(trained)
        if any(p.dtype == torch.float16 for p in trained.parameters()):
            raise ConfigMismatchError(
                f"{type(trained).__name__} has float16 parameters: the trainer does no loss scaling, and float16's "
                "narrow exponent range (smallest normal 6e-5, largest 65504) makes small gradients underflow to 0 "
                "and large ones overflow to inf in the backward; train the module in bfloat16 or float32 (a "
                "bfloat16 module trains through fp32 master weights, with float32's range: "
                "module.to(torch.bfloat16)); the model may stay in float16")
        if any(p.is_complex() for p in trained.parameters()):
            raise ConfigMismatchError(f"{type(trained).__name__} has complex parameters: train it in a real floating "
                                      "dtype (torch.float32, torch.bfloat16 or torch.float64)")
        self.objective = given if given is not None else _objective_for(trained)
        self.objective.check_source(source)
        self.state = TrainingState(self)
        self.module = trained
        self.source = source
        self.config = config
        self.step = 0
        #: the logged metrics, one dict per ``log_every`` steps and the last (``step``, ``loss``, ``fvu``, ``l0``,
        #: ``dead_frac``, ``lr`` …); this trainer's own (a config shared by several trainers holds none: until
        #: 2026-11-29 it was ``config.history``, and a second run on one config appended to the first's)
        self.history: list[dict[str, float]] = []
        self.tokens_since_fired = torch.zeros(self.objective.n_latents(), dtype=torch.long, device=device)
        #: data-parallel context (:class:`~.distributed.DataParallel`) or None; set by ``DataParallel(trainer)``
        self.dist: Any = None
        #: the W&B run's id (``TrainConfig.wandb_project``; kept in checkpoints), None before the run starts
        self.wandb_run_id: str | None = None
        #: the caller's record of the run (JSON values: e.g. the demo's batch size, seed and data hash), kept in
        #: checkpoints (``trainer.json``'s ``run_info``) and restored by :meth:`resume`, so that a resume can be
        #: checked against the run it continues; empty by default
        self.run_info: dict[str, Any] = {}
        self._wandb: WandbRun | None = None
        #: the fp32 master weights of a bf16 module (none for an fp32 / fp64 one, or with ``master_weights=False``)
        self.masters = MasterWeights(trained.parameters(), enabled=config.master_weights)
        self.masters.add_buffers(trained)  # estimates the forward updates (BatchTopK's threshold): fp32 masters too
        #: what the optimizer steps: each parameter's master, or the parameter itself
        self._params = self.masters.optimized(trained.parameters())
        self.optimizer = torch.optim.Adam(self._params, lr=config.lr, betas=config.betas)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: wsd_lr_factor(s, config.total_steps, config.warmup_frac, config.decay_frac,
                                    float(config.decay_to)),
        )

    @torch.no_grad()
    def estimate_norms(self) -> tuple[float, float]:
        """Estimate the scale factors on the first ``norm_batches`` batches (then the objective's
        initialisation that depends on them, e.g. a Lorsa's QK from the MHSA); returns ``(s_in, s_out)``.

        Raises:
            TooFewTokensError: no counted token (``loss_mask`` all False) in those batches, or (Lorsa)
                fewer counted tokens in batch 0 than its initialisation needs; nothing is changed.
            NonFiniteError: a scale factor is not a finite positive number (non-finite or all-zero
                activations); the scale factors are left unset and the module unchanged.

        Any other exception on the way (a failing batch source, a CUDA out-of-memory error or ``Ctrl-C`` in the
        initialisation) also leaves the scale factors unset and the weights as they were, and passes through: the
        next :meth:`train_step` estimates and initialises again, as an uninterrupted run does.

        Source: Lorsa paper (He et al. 2025) §3.2 (dataset-wise norm scaling); Llamascopium
        ``src/llamascopium/models/lorsa.py``.
        """
        tensors = {id(t): t for t in (*self.module.parameters(), *self.module.buffers(), *self._params,
                                      *self.masters.buffer_masters())}
        saved = [(t, t.detach().clone()) for t in tensors.values()]  # what an initialisation writes (once per run)
        try:
            self.objective.estimate_norms(self.state)
            self._check_scales()
            self.objective.check_init_batch(self.state)
            with self.masters.editing(self.module):  # an initialisation that writes the weights writes the masters
                self.objective.after_norms(self.state)
        except BaseException:  # until 2026-11-28 only the refusals: an initialisation interrupted part-way kept the
            self.objective.reset_scales()  # scale factors, and the next step trained the half-initialised module
            for t, value in saved:
                t.copy_(value)
            raise
        assert self.s_in is not None and self.s_out is not None
        self._mark_training_space()
        return self.s_in, self.s_out

    def _mark_training_space(self) -> None:
        """Mark the module as this trainer's working copy in normalised space (:data:`~.._checks.TRAINING_SPACE`):
        the sets and ``save`` refuse it, pointing to :meth:`folded`."""
        setattr(self.module, TRAINING_SPACE, (float(self.s_in or 1.0), float(self.s_out or 1.0)))

    def _check_scales(self) -> None:
        """Raise :class:`NonFiniteError` unless every scale factor is a finite positive number."""
        n = self.config.norm_batches
        for name in ("s_in", "s_out", "s_in_layers", "s_out_layers"):
            value = getattr(self, name)
            values = value if isinstance(value, list) else [value]
            for i, v in enumerate(values):
                if v is None or (isinstance(v, float) and math.isfinite(v) and v > 0):
                    continue
                which = f"{name}[{i}]" if isinstance(value, list) else name
                side = "inputs x" if name.startswith("s_in") else "targets y"
                raise NonFiniteError(f"step {self.step}: the scale factor {which} = {v!r} (sqrt(d) / the mean norm "
                                     f"of the {side} over the counted tokens of the first {n} batches) is not a "
                                     f"finite positive number: the activations hold non-finite values or are all "
                                     f"zero; nothing was trained", step=self.step, tensor=which)

    def batch(self, index: int) -> Batch:
        """Batch ``index`` of the source (``source(index)``), checked to be a :class:`~.activations.Batch`.

        Raises:
            ArgumentError: the source returned something else (:func:`~.activations.checked_batch`).

        Source: ours (the trainer's source contract).
        """
        return checked_batch(self.source(index), index)

    def loss(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss on one batch (normalised space) and its metrics (``loss``, ``fvu``, ``l0``, ``dead_frac``,
        ``aux``, …); updates the dead counters.

        Raises:
            ShapeError: (CLT) the batch does not fit the module.

        Source: Lorsa paper (He et al. 2025) §3.2; Gao et al. 2024 (AuxK); Llamascopium trainer.
        """
        with self.masters.estimating(self.module):  # a bf16 module's estimates (BatchTopK's θ) updated in fp32
            return self.objective.loss(self.state, batch)

    @torch.no_grad()
    def folded(self) -> torch.nn.Module:
        """A copy of the module acting on raw activations: ``f_raw(x) = f(x · s_in) / s_out`` with the
        scale factors folded into the weights (a dictionary in eval mode; see :mod:`.objectives`).

        Raises:
            NotReadyError: (a ``RuntimeError``) the norms are not estimated yet (no step taken).

        Source: Lorsa paper (He et al. 2025) §3.2 (dataset-wise norm scaling, folded into the weights); Llamascopium
        ``src/llamascopium/models/lorsa.py``.
        """
        with self.masters.editing(self.module):  # a bf16 module's fold is computed on its fp32 masters, rounded once
            out = self.objective.fold(self.state)  # row chunk by row chunk: no fp32 copy of the module (2026-11-28)
        out.__dict__.pop(TRAINING_SPACE, None)  # a copy acting on raw activations: not the working module
        return out

    # -------------------------------------------------------------- loss helpers
    def count_fired(self, fired: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """Update the dead counters with ``fired (n_latents,)`` (latents active on some of the
        ``n_tokens`` tokens); return the dead mask, on ``fired``'s device (the counters follow it
        there). Under data parallelism (:attr:`dist`) both are first combined over the ranks, so every
        rank keeps the counters of the global batch.

        Source: Gao et al. 2024, *Scaling and evaluating sparse autoencoders* (dead latents).
        """
        if self.dist is not None:
            fired, n_tokens = self.dist.combine_firing(fired, n_tokens)
        if self.tokens_since_fired.device != fired.device:
            self.tokens_since_fired = self.tokens_since_fired.to(fired.device)
        self.tokens_since_fired += n_tokens
        self.tokens_since_fired[fired] = 0
        return self.tokens_since_fired >= self.config.dead_after_tokens

    def aux_k_loss(self, pre: torch.Tensor, dead: torch.Tensor, err: torch.Tensor, W_dec: torch.Tensor,
                   default_k: int, signed: bool = False) -> torch.Tensor:
        """AuxK (Gao et al. 2024): dead latents' top-``aux_k`` (ReLU'd) reconstruct the error ``err``.

        ``pre (n, n_latents)`` pre-activations, ``W_dec (n_latents, d)``; normalised by ``‖err‖²``.
        ``signed``: the dead latents of largest ``|pre|``, with their sign (an AbsTopK coder's, as SAELens
        ``abstopk``). Zero when nothing is dead or ``aux_k_coef`` is 0. All on one device; computed in fp32 (a
        scalar on ``pre``'s device).

        Source: Gao et al. 2024, *Scaling and evaluating sparse autoencoders* (AuxK).
        """
        if not dead.any() or self.config.aux_k_coef <= 0:
            return torch.zeros((), dtype=f32(pre).dtype, device=pre.device)
        k_aux = min(self.config.aux_k or default_k, int(dead.sum()))
        if signed:
            idx = pre.detach().abs().masked_fill(~dead, float("-inf")).topk(k_aux, dim=-1).indices
            z_aux = torch.zeros_like(pre).scatter(-1, idx, pre.gather(-1, idx))
        else:
            vals, idx = pre.masked_fill(~dead, float("-inf")).topk(k_aux, dim=-1)
            z_aux = torch.zeros_like(pre).scatter(-1, idx, vals.relu())
        e = f32(err.detach())
        return (f32(z_aux @ W_dec) - e).pow(2).sum(-1).mean() / self.batch_mean(e.pow(2).sum(-1)).clamp_min(1e-12)

    def batch_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean of per-token ``values (n,)`` over the batch, without gradient — over the *global*
        batch under data parallelism (:meth:`~.distributed.DataParallel.global_mean`).

        Source: Lorsa paper (He et al. 2025) §3.2; Gao et al. 2024 (AuxK); Llamascopium trainer.
        """
        if self.dist is None:
            return values.detach().mean()
        return self.dist.global_mean(values.sum(), values.numel())

    # -------------------------------------------------------------- step
    @contextmanager
    def _told(self) -> Iterator[None]:
        """Under data parallelism, a rank-local error raised inside (after the forward pass: the optimizer step, a
        remedy, logging, a checkpoint) is told to the other ranks at their next collective
        (:meth:`.distributed.DataParallel.tell_failed`), then re-raised; another rank's failure passes through."""
        try:
            yield
        except RankFailedError:
            raise
        except Exception:
            if self.dist is not None:
                self.dist.tell_failed(self.step)
            raise

    def train_step(self) -> dict[str, float]:
        """One optimizer step on batch ``step`` (the scale factors are estimated first if needed); its metrics.

        Guarded: a non-finite loss (checked on the float the metrics already hold), gradient (through
        the gradient norm that clipping computes anyway) or learning rate stops the step before the
        optimizer changes anything, and the dead counters and the objective's per-step records are put
        back — the trainer is left exactly as after step ``step - 1``. So is it by any other exception raised
        before the optimizer's update (a CUDA out-of-memory error in the forward or backward pass, ``Ctrl-C``,
        a failing batch source), which passes through: calling :meth:`train_step` again runs the step as an
        uninterrupted run would. An exception inside the optimizer's update or after it (the objective's
        remedies, a checkpoint) leaves the step partly applied.

        Raises:
            NonFiniteError: the loss, a gradient or the learning rate is not finite (the message names
                the step and the tensor: the batch's non-finite activations, a parameter, …).
            TooFewTokensError: see :meth:`estimate_norms` (first step only).
            RankFailedError: (data parallel) another rank failed getting its batch or in its forward pass at this
                step, or in its backward pass (heard once its process ended:
                :meth:`.distributed.DataParallel.backward_failed`); the trainer is left as after step ``step - 1``,
                as for ``NonFiniteError``.

        Source: Lorsa paper (He et al. 2025) §3.2; Gao et al. 2024 (AuxK); Llamascopium trainer.
        """
        if self.s_in is None:
            self.estimate_norms()
        counters = self.tokens_since_fired.clone()  # (n_latents,) ints: what count_fired changes
        estimates = self.masters.estimates(self.module)  # what the forward changes in place (BatchTopK's θ)
        try:
            if self.dist is None:
                loss, metrics = self.loss(self.batch(self.step))
            else:
                loss, metrics = self.dist.loss(self.step)
            loss_value = metrics["loss"] if "loss" in metrics else float(loss.detach())
            if self.dist is None and not math.isfinite(loss_value):  # before the backward: nothing to undo
                raise self._non_finite("loss", loss_value)
            self.optimizer.zero_grad(set_to_none=True)
            self.module.zero_grad(set_to_none=True)  # (a bf16 module's own gradients: moved to the masters below)
            try:
                loss.backward()
            except Exception as e:  # (DDP) this rank's own error is recorded; a peer's recorded one is named
                if self.dist is None:
                    raise
                told = self.dist.backward_failed(self.step)
                if told is None:
                    raise
                raise told from e
            self.masters.move_grads()  # a bf16 module's gradients go to its fp32 masters (DDP has reduced them)
            grads = [p.grad for p in self._params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
            finite = torch.isfinite(norm)
            if self.dist is not None:  # every rank stops, or none: the loss is rank-local, the gradients are not
                finite = self.dist.all_finite(finite & torch.isfinite(loss.detach()))
            if not bool(finite):
                if not math.isfinite(loss_value):
                    raise self._non_finite("loss", loss_value)
                if not bool(torch.isfinite(norm)):
                    raise self._non_finite("grad", float(norm))
                raise self._non_finite("rank", loss_value)
            for group in self.optimizer.param_groups:
                if not math.isfinite(group["lr"]):
                    raise self._non_finite("lr", group["lr"])
        except BaseException:  # refused (another rank failed: this one stops as after step - 1 too), or failed (a
            self._undo_step(counters, estimates)  # CUDA OOM in the backward, Ctrl-C): the forward's changes go back
            raise
        with self._told():
            try:
                if self.config.grad_clip:  # torch.nn.utils.clip_grad_norm_, with the norm computed above
                    torch.nn.utils.clip_grads_with_norm_(self._params, self.config.grad_clip, norm)
            except BaseException:  # still before the update
                self._undo_step(counters, estimates)
                raise
            lr = float(self.optimizer.param_groups[0]["lr"])  # the LR of this step (the scheduler then moves on)
            self.optimizer.step()
            self.scheduler.step()
            with self.masters.editing(self.module):  # constraints and remedies act on the masters, then rounded
                self.objective.post_step(self.state)
        self.step += 1
        metrics["lr"] = lr
        return metrics

    def _undo_step(self, counters: torch.Tensor, estimates: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put back what a step changed before its optimizer update (the dead counters, the estimates its forward
        updates in place, the objective's per-step records; the gradients dropped): as after step ``step - 1``."""
        self.optimizer.zero_grad(set_to_none=True)
        self.tokens_since_fired = counters
        self.masters.restore_estimates(estimates)
        self.objective.discard_step(self.state)

    def _non_finite(self, what: str, value: float) -> NonFiniteError:
        """The :class:`NonFiniteError` of step :attr:`step` for a non-finite ``what`` (``"loss"``, ``"grad"``,
        ``"lr"``), naming what is found wrong: the learning rate, the parameters with non-finite gradients
        or values, the batch's non-finite activations or empty loss mask (looked for only here, on the
        failing step). :attr:`NonFiniteError.tensor` is the first of those (else ``what``)."""
        k = self.step
        causes: list[tuple[str, str]] = []
        for i, g in enumerate(self.optimizer.param_groups):
            if not math.isfinite(g["lr"]):
                causes.append(("lr", f"the learning rate of param group {i} is {g['lr']!r}"))
        for n, p in self.module.named_parameters():
            grad = self.masters.held(p).grad
            if grad is not None and not bool(torch.isfinite(grad).all()):
                causes.append((f"{n}.grad", f"{n}.grad holds {int((~torch.isfinite(grad)).sum())} non-finite values"))
        for n, p in self.module.named_parameters():
            if not bool(torch.isfinite(p.detach()).all()):
                causes.append((n, f"the weights {n} hold {int((~torch.isfinite(p.detach())).sum())} non-finite values"))
        if what != "lr":
            causes += self._batch_causes(k)
        named = "; ".join(c for _, c in causes) if causes else \
            "no input or weight is non-finite: the values overflowed (lower lr, or set grad_clip)"
        label = {"loss": "the loss", "grad": "the gradient norm", "lr": "the learning rate",
                 "rank": "this rank's loss"}[what]
        if what == "rank":
            named = "another rank's loss is non-finite"
        kept = f"the trainer holds the state after step {k - 1} (weights, Adam state, dead counters: " \
               "save_checkpoint() keeps it)"
        if any(" (the weights" in c or c.startswith("the weights ") for _, c in causes):
            kept = (f"the weights were already non-finite after step {k - 1} (its update overflowed: lower lr): "
                    "resume from a checkpoint saved before (save_checkpoint refuses non-finite weights)")
        return NonFiniteError(f"step {k}: {label} is {value!r} ({named}). Training stopped before the optimizer "
                              f"step; {kept}", step=k, tensor=causes[0][0] if causes else what)

    def _batch_causes(self, k: int) -> list[tuple[str, str]]:
        """What is wrong with batch ``k`` (non-finite ``x`` / ``y`` values, no counted token); failing step only."""
        try:
            batch = self.batch(k)
        except Exception:  # the diagnosis must not hide the NonFiniteError
            return []
        causes = []
        for name in ("x", "y"):
            v = getattr(batch, name, None)
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                n_bad = int((~torch.isfinite(v)).sum())
                if n_bad and not (name == "y" and v is batch.x):
                    causes.append((f"batch.{name}", f"batch {k}'s {name} holds {n_bad} non-finite values"))
        mask = getattr(batch, "loss_mask", None)
        if isinstance(mask, torch.Tensor) and not bool(mask.any()):
            causes.append(("batch.loss_mask", f"batch {k} has no counted token (its loss_mask is all False)"))
        return causes

    def train(self, steps: int | None = None, *, progress: bool = True,
              checkpoint_dir: str | Path | None = None, checkpoint_every: int = 0,
              on_log: Callable[[dict[str, float]], None] | None = None) -> list[dict[str, float]]:
        """Run until ``steps`` more steps (default: to ``total_steps``); return the logged metrics.

        ``steps`` bounds this call (a long run in slices: ``train(1000)`` at a time, each resumable). With
        ``checkpoint_dir`` a checkpoint is written every ``checkpoint_every`` steps (0: none between) and at the end
        of the call (until 2026-11-29 a ``checkpoint_dir`` without ``checkpoint_every`` wrote nothing; the
        sparse-attention trainer already saved at the end);
        ``on_log`` is called with every ``history`` entry as it is logged (every ``log_every`` steps and
        the last; with ``step``), e.g. to print or stop a run without the progress bar.

        A non-finite loss, gradient or learning rate stops the run (:meth:`train_step`) with the trainer
        as after the last good step; the checkpoint in ``checkpoint_dir`` is then the last one saved
        before it (nothing non-finite is written).

        With ``TrainConfig.wandb_project`` set, every ``history`` entry is also logged to Weights & Biases
        (``train/<name>`` at its step; :mod:`.wandb_log`); the run stays open for later calls and
        :meth:`log_evaluation` until :meth:`close_logging`.

        Raises:
            ArgumentError: ``steps`` not a non-negative int, or given (> 0) when the run is at ``total_steps``;
                ``checkpoint_every`` not an int ≥ 0, or > 0 without ``checkpoint_dir`` (nothing would be saved);
                ``checkpoint_dir`` not None, a str or ``os.PathLike``;
                ``progress`` not a bool, ``on_log`` not None or a callable — before the first step.
            MissingDependencyError: ``wandb_project`` is set and ``wandb`` is not installed (before any step).
            NonFiniteError, TooFewTokensError: see :meth:`train_step`.
            RankFailedError: (data parallel) another rank failed: getting its batch or in its forward pass at this
                step (:meth:`train_step`), or after its forward pass (its optimizer step, a remedy, logging, saving a
                checkpoint), heard at this rank's next collective or at the end of the call. An error of this rank
                after its forward pass is told to the others before it is raised.

        Source: Lorsa paper (He et al. 2025) §3.2; Gao et al. 2024 (AuxK); Llamascopium trainer.
        """
        if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 0):
            raise ArgumentError(f"steps must be a non-negative int, got {steps!r}")
        check_checkpointing(checkpoint_dir, checkpoint_every, "Trainer.train")
        check_flag(progress, "progress", "Trainer.train")
        if on_log is not None and not callable(on_log):
            raise ArgumentError(f"Trainer.train(on_log=...) must be None or a callable taking each history entry, got "
                                f"a {type(on_log).__name__}")
        logger = self._wandb_run()  # before the first step: a missing wandb stops the run here
        if steps and self.step >= self.config.total_steps:  # until 2026-11-30 a silent no-op
            raise ArgumentError(
                f"Trainer.train({steps}): the run is at its end (step {self.step} of total_steps "
                f"{self.config.total_steps}; the learning-rate schedule decays to there), so no step would run. Raise "
                "trainer.config.total_steps to go on (the schedule follows it), or train a new Trainer")
        end = self.config.total_steps if steps is None else min(self.config.total_steps, self.step + steps)
        bar = tqdm(total=end - self.step, disable=not progress, desc=self.objective.desc, dynamic_ncols=True)
        try:
            while self.step < end:
                m = self.train_step()
                with self._told():
                    self._after_step(m, end, bar, logger, on_log, checkpoint_dir, checkpoint_every)
            if self.dist is not None:  # a rank that failed after its last forward pass is heard here
                self.dist.finish()
        finally:
            bar.close()
        return self.history

    def _after_step(self, m: dict[str, float], end: int, bar: Any, logger: Any,
                    on_log: Callable[[dict[str, float]], None] | None, checkpoint_dir: str | Path | None,
                    checkpoint_every: int) -> None:
        """:meth:`train`'s work after each step: progress, history, logging, checkpoint."""
        bar.update(1)
        if self.step % self.config.log_every == 0 or self.step == end:
            m["step"] = self.step
            self.history.append(m)
            bar.set_postfix(loss=f"{m['loss']:.4f}", fvu=f"{m['fvu']:.3f}", l0=f"{m['l0']:.1f}",
                            dead=f"{m['dead_frac']:.2f}")
            if logger is not None:
                logger.log(flat_metrics(m, "train"), step=self.step)
            if on_log is not None:
                on_log(m)
        due = self.step == end or (checkpoint_every and self.step % checkpoint_every == 0)  # and at the end
        if checkpoint_dir is not None and due:
            self.save_checkpoint(checkpoint_dir)

    # -------------------------------------------------------- W&B logging
    def _wandb_run(self) -> WandbRun | None:
        """The W&B run (started on first use) when ``config.wandb_project`` is set, on rank 0 only; else None."""
        if self.config.wandb_project is None or (self.dist is not None and getattr(self.dist, "rank", 0) != 0):
            return None
        if self._wandb is None:
            cfg = asdict(self.config)
            config = {"train_config": cfg, self.objective.config_key: self.objective.module_config()}
            self._wandb = WandbRun(self.config.wandb_project, self.config.wandb_run_name, config, self.wandb_run_id)
            self.wandb_run_id = self._wandb.id
        return self._wandb

    def log_evaluation(self, evaluation: Any) -> dict[str, float]:
        """Log an :class:`~.evaluate.Evaluation` (or a mapping of metric names to numbers) as ``eval/<name>``
        at the current step to W&B when ``config.wandb_project`` is set (:func:`.wandb_log.flat_metrics`:
        ``eval/fvu``, ``eval/l0``, ``eval/dead_frac``, ``eval/ce_orig``, ``eval/ce_spliced``, ``eval/ce_zero``,
        ``eval/ce_recovered``, ``eval/kl``, …; a CLT's per-layer lists as ``eval/fvu/layer_<l>``); returns
        that flat dict (also without W&B).

        Raises:
            ArgumentError: ``evaluation`` is neither an Evaluation nor a mapping.
            MissingDependencyError: ``wandb_project`` is set and ``wandb`` is not installed.

        Source: ours (this package's checkpoint and logging format).
        """
        flat = flat_metrics(evaluation, "eval")
        logger = self._wandb_run()
        if logger is not None:
            logger.log(flat, step=self.step)
        return flat

    def close_logging(self) -> None:
        """Finish the W&B run, if one is open (its files are then complete; wandb also finishes it when the
        process exits). A later :meth:`train` or :meth:`log_evaluation` continues the same run.

        Source: ours (this package's checkpoint and logging format).
        """
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    # -------------------------------------------------------- checkpoints
    def save_checkpoint(self, directory: str | Path) -> None:
        """Write ``trainer.json`` + weights + ``optimizer.safetensors`` + ``state.safetensors`` (+
        ``masters.safetensors``: the fp32 master weights, when the module has some) + ``manifest.json`` (each
        file's size and sha256), atomically: into ``<directory>.tmp-<pid>``,
        fsynced, then renamed into place; the previous checkpoint at ``directory`` stays until the
        new one is complete. ``trainer.json`` holds :attr:`run_info` when it is set.

        Raises:
            CheckpointError: ``directory`` exists and is neither empty nor a checkpoint.
            NonFiniteError: a weight, master weight or Adam moment holds a non-finite value (named); nothing is written,
                so the checkpoint already at ``directory`` (the last good one) stays.

        Source: ours (this package's checkpoint and logging format).
        """
        weights = {k: v.detach().contiguous() for k, v in self.module.state_dict().items()}
        names = {id(self.masters.held(p)): n for n, p in self.module.named_parameters()}
        masters = {n: m.detach().contiguous() for n, m in {**self.masters.named(self.module),
                                                           **self.masters.named_buffers(self.module)}.items()}
        opt_tensors: dict[str, torch.Tensor] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for key, value in self.optimizer.state.get(p, {}).items():
                    # no copy: the files are written (streamed from these tensors) before this returns
                    opt_tensors[f"{names[id(p)]}.{key}"] = value.detach().contiguous()
        for kind, tensors in (("weights", weights), ("Adam state", opt_tensors), ("fp32 master weights", masters)):
            for name, value in tensors.items():
                # in slices (count_non_finite): torch.isfinite of a whole tensor makes ~1.5x it in temporaries
                if value.is_floating_point() and count_non_finite(value):
                    raise NonFiniteError(f"step {self.step}: the {kind} {name} hold non-finite values: not saved to "
                                         f"{directory} (a checkpoint already there is kept)",
                                         step=self.step, tensor=name)
        cfg = asdict(self.config)
        # the parameters that have Adam state: a resume checks the optimizer file holds exactly these (a parameter
        # with no entry would otherwise pass for one that never had a gradient, and restart its moments)
        adam_params = sorted({name.rpartition(".")[0] for name in opt_tensors})
        meta = {"step": self.step, "s_in": self.s_in, "s_out": self.s_out, "train_config": cfg,
                "adam_params": adam_params,
                self.objective.config_key: self.objective.module_config(), "history": self.history,
                **({"wandb_run_id": self.wandb_run_id} if self.wandb_run_id is not None else {}),
                **({"run_info": self.run_info} if self.run_info else {}),
                **self.objective.save_meta(self.state)}
        write_checkpoint(directory, {
            self.objective.weights_file: weights,
            "optimizer.safetensors": opt_tensors,
            "state.safetensors": {"tokens_since_fired": self.tokens_since_fired.contiguous()},
            **({MASTERS_FILE: masters} if masters else {}),
            "trainer.json": json.dumps(meta, indent=1).encode(),
        })

    @staticmethod
    def load_checkpoint(directory: str | Path) -> tuple[dict[str, Any], TrainConfig, torch.nn.Module]:
        """``(meta, train config, module with the saved weights)`` of a checkpoint directory (the
        module's kind from the config entry ``trainer.json`` holds; in the weights' saved dtype). Every
        file is first checked against ``manifest.json``; ``<directory>.old`` is used when ``directory`` is
        missing (a save interrupted between its renames).

        Raises:
            CheckpointError: the manifest is missing or corrupt (also: a checkpoint written before
                manifests existed), a file is missing, truncated or altered (the message names it),
                or a file does not match the recorded configuration.

        Source: ours (this package's checkpoint and logging format).
        """
        return Trainer._load(directory)[2:]

    @staticmethod
    def _load(directory: str | Path) -> tuple[Path, set[str], dict[str, Any], TrainConfig, torch.nn.Module]:
        d, listed = verified_checkpoint(directory, ("trainer.json",))
        try:
            meta = json.loads((d / "trainer.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{d / 'trainer.json'}: malformed ({e})") from e
        objective = _objective_class(meta, d / "trainer.json")
        for name in (objective.weights_file, "optimizer.safetensors", "state.safetensors"):
            if name not in listed:
                raise CheckpointError(f"{d / name}: missing trainer checkpoint file (not in the manifest)")
        try:
            tc = meta["train_config"]
            tc["betas"] = tuple(tc["betas"])
            config = TrainConfig(**tc)
            module = objective.build_module(meta)
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{d / 'trainer.json'}: malformed ({e})") from e
        _check_progress(meta, d / "trainer.json")
        wpath = d / objective.weights_file
        try:
            weights = load_file(str(wpath))
            params = {name for name, _ in module.named_parameters()}
            # one float dtype for every parameter (a save writes them so): an int or a second dtype was cast silently
            for name, t in weights.items():
                if name in params and not t.is_floating_point():
                    raise CheckpointError(f"{wpath}: the parameter {name!r} is saved as {t.dtype}, not a float dtype")
            _check_finite(wpath, weights)
            saved = {t.dtype for name, t in weights.items() if name in params}
            if len(saved) > 1:
                raise CheckpointError(f"{wpath}: the parameters are saved in several dtypes {sorted(map(str, saved))}; "
                                      "a checkpoint holds them in one")
            if len(saved) == 1:  # the parameters' dtype: the run's (a bf16 / fp64 run goes on as one, not in fp32)
                module = module.to(dtype=saved.pop())
            module.load_state_dict(weights)
        except RuntimeError as e:
            raise CheckpointError(f"{wpath}: does not match the config ({e})") from e
        return d, listed, meta, config, module

    @classmethod
    def resume(cls, directory: str | Path, source: Callable[[int], Batch], *,
               device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Trainer:
        """Rebuild a trainer from :meth:`save_checkpoint` output (any module kind); continues bit-exactly.

        ``device``, ``dtype``: where and in which dtype the module is trained from now on (and with it
        the Adam moments and dead counters); default the CPU and the dtype the checkpoint's weights were
        saved in (the module is rebuilt from its config and the saved weights copied in). The training values
        come from the most precise copy saved: a bf16 run's fp32 masters (resumed in bf16: its masters again,
        the module their rounding; with ``dtype=torch.float32``: the module's weights); a checkpoint without
        masters (an fp32 run, or a bf16 one written before master weights existed) gives a bf16 module masters
        made from its saved weights, and its bf16 Adam moments widened to fp32.

        Raises:
            CheckpointError: a file is missing or does not match the recorded configuration.
            ArgumentError: ``dtype`` not a floating ``torch.dtype``, or ``device`` not a torch device
                (:func:`~.._placement.check_placement_args`). PlacementError: a device this machine lacks.
            ConfigMismatchError: ``dtype=torch.float16`` (as the constructor).

        Source: ours (this package's checkpoint and logging format).
        """
        device = check_placement_args(device, dtype, "Trainer.resume")
        d, listed, meta, config, module = cls._load(directory)
        if device is not None or dtype is not None:
            module = module.to(device=device, dtype=dtype)
        trainer = cls(module, source, config)
        trainer._restore_state(d, meta, listed, fresh=True)
        return trainer

    def restore_state(self, directory: str | Path, meta: dict[str, Any]) -> None:
        """Load step, history, scale factors, master weights (see :meth:`resume`), Adam state, dead counters and the
        LR of a checkpoint.

        Raises:
            CheckpointError: a file missing or failing the manifest check, an unknown optimizer entry or master
                weight, or (CLT) missing per-layer scale factors.

        Source: ours (this package's checkpoint and logging format).
        """
        d, listed = verified_checkpoint(directory, ("trainer.json", "optimizer.safetensors", "state.safetensors"))
        self._restore_state(d, meta, listed)

    def _restore_state(self, d: Path, meta: dict[str, Any], listed: set[str], fresh: bool = False) -> None:
        # every file checked before anything is set (until 2026-11-28 a bad entry raised a KeyError / TypeError, or
        # loaded and failed at the next step, or was taken silently — with the trainer then partly restored). One
        # exception, ``fresh``: resume's own new trainer, dropped on a refusal, gets its masters as soon as they are
        # checked, so that their file's pages (mapped, read by the check) are let go before the Adam state's are read
        # (the finiteness check reads every page): both held made the peak 9.2x a bf16 module, against the 7x it
        # holds afterwards (module, fp32 masters, moments; benchmarks/host_memory_paths.py)
        _check_progress(meta, d / "trainer.json")
        run_id = meta.get("wandb_run_id")
        if run_id is not None and not isinstance(run_id, str):
            raise CheckpointError(f"{d / 'trainer.json'}: key 'wandb_run_id' must be a string, got {run_id!r}")
        run_info = meta.get("run_info", {})
        if not isinstance(run_info, dict):
            raise CheckpointError(f"{d / 'trainer.json'}: key 'run_info' must be an object, got {run_info!r}")
        history = meta.get("history", [])
        if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
            raise CheckpointError(f"{d / 'trainer.json'}: key 'history' must be a list of objects (the logged "
                                  f"metrics), got {str(history)[:80]}")
        masters = self._saved_masters(d, listed)
        if fresh:
            self._restore_masters(masters)
            masters = {}  # set: none left for the setting below, and the file's pages let go
        adam = self._saved_adam_state(d / "optimizer.safetensors", meta.get("adam_params"))
        counters = self._saved_counters(d / "state.safetensors")
        # the objective's entries (a CLT's per-layer scales, a Lorsa's recipe): checked and set before the trainer's
        # own state, so that their refusal leaves the trainer as it was (until 2026-11-28 it ran last)
        self.objective.restore_meta(self.state, meta, d / "trainer.json")
        self.step, self.s_in, self.s_out = meta["step"], meta["s_in"], meta["s_out"]
        if self.s_in is not None:
            self._mark_training_space()
        self.wandb_run_id = run_id  # the W&B run (if any) goes on in the same run
        self.run_info = dict(run_info)
        self.history = [dict(h) for h in history]
        self._restore_masters(masters)
        for p, slots in adam:
            for slot, value in slots.items():
                if slot != "step":  # as Optimizer.load_state_dict: moments on the (master) parameter's device and dtype
                    value = value.to(device=p.device, dtype=p.dtype)
                self.optimizer.state[p][slot] = value
        self.tokens_since_fired = counters.to(self.tokens_since_fired.device)
        # LambdaLR has no state beyond its step count: set it and the LR it implies
        self.scheduler.last_epoch = self.step
        for group, base, fn in zip(self.optimizer.param_groups, self.scheduler.base_lrs,
                                   self.scheduler.lr_lambdas, strict=True):
            group["lr"] = base * fn(self.step)

    def _saved_adam_state(self, path: Path, listed: Any = None) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """``[(parameter the optimizer steps, {slot: tensor})]`` of ``optimizer.safetensors``: each parameter's Adam
        slots complete (``step``, ``exp_avg``, ``exp_avg_sq``), float, finite, of the parameter's shape (``step``
        0-dim), for exactly the parameters ``listed`` (``trainer.json``'s ``adam_params``, written since 2026-11-29);
        in a checkpoint without that list, a parameter without any entry has no state (it had no gradient).

        Raises:
            CheckpointError: an unknown parameter or slot, an incomplete state, a wrong shape or dtype, a parameter
                ``listed`` with no entry or one with entries not listed, a malformed list (named)."""
        params = {n: self.masters.held(p) for n, p in self.module.named_parameters()}
        slots = {"step", "exp_avg", "exp_avg_sq", *(("max_exp_avg_sq",) if self.optimizer.defaults["amsgrad"] else ())}
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in load_file(str(path)).items():
            name, _, slot = key.rpartition(".")
            if name not in params:
                raise CheckpointError(f"{path}: unknown parameter {name!r}")
            if slot not in slots:
                raise CheckpointError(f"{path}: unknown Adam entry {key!r} (a parameter's are {sorted(slots)})")
            shape = () if slot == "step" else tuple(params[name].shape)
            if tuple(value.shape) != shape or not value.is_floating_point():
                raise CheckpointError(f"{path}: the Adam entry {key!r} is {value.dtype} {tuple(value.shape)}; the "
                                      f"parameter {name!r} needs a float {shape}")
            state.setdefault(name, {})[slot] = value
        for name, entries in state.items():
            if set(entries) != slots:
                raise CheckpointError(f"{path}: the Adam state of {name!r} lacks {sorted(slots - set(entries))}")
        if listed is not None:
            meta_path = path.with_name("trainer.json")
            if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
                raise CheckpointError(f"{meta_path}: key 'adam_params' must be a list of parameter names, got "
                                      f"{listed!r}")
            if set(listed) != set(state):
                missing, extra = sorted(set(listed) - set(state)), sorted(set(state) - set(listed))
                raise CheckpointError(
                    f"{path}: holds Adam state for other parameters than {meta_path} lists (adam_params): "
                    + "; ".join(part for part in (f"missing {missing}" if missing else "",
                                                  f"not listed {extra}" if extra else "") if part)
                    + " (files of different saves?)")
        _check_finite(path, {f"{n}.{k}": v for n, e in state.items() for k, v in e.items()})
        return [(params[n], e) for n, e in state.items()]

    def _saved_counters(self, path: Path) -> torch.Tensor:
        """``state.safetensors``'s dead counters: its one tensor ``tokens_since_fired``, int64 ``(n_latents,)``.

        Raises:
            CheckpointError: other tensors, a wrong shape or dtype."""
        tensors = load_file(str(path))
        if set(tensors) != {"tokens_since_fired"}:
            raise CheckpointError(f"{path}: holds {sorted(tensors)}, not the one tensor 'tokens_since_fired'")
        counters, want = tensors["tokens_since_fired"], self.tokens_since_fired
        if counters.shape != want.shape or counters.dtype != want.dtype:
            raise CheckpointError(f"{path}: 'tokens_since_fired' is {counters.dtype} {tuple(counters.shape)}; this "
                                  f"{type(self.module).__name__} counts {want.dtype} {tuple(want.shape)}")
        return counters

    def _saved_masters(self, d: Path, listed: set[str]) -> dict[str, torch.Tensor]:
        """``{name: value}``: the training values of the parameters from the most precise copy the checkpoint
        holds: its fp32 masters (a bf16 run's ``masters.safetensors``) — into this trainer's masters, the module
        getting their rounding, or into the module itself when it has none (a bf16 run resumed with
        ``dtype=torch.float32`` goes on from the masters, not from their bf16 rounding); without that file (an fp32
        run, or a bf16 checkpoint written before masters existed), this trainer's masters come from the saved weights.

        Raises:
            CheckpointError: a master of no parameter or buffer, of another shape, not float or not finite."""
        params = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        if MASTERS_FILE in listed:
            path, saved = d / MASTERS_FILE, load_file(str(d / MASTERS_FILE))
        else:
            path, saved = d / self.objective.weights_file, {}
            weights = load_file(str(path)) if len(self.masters) or self.masters.named_buffers(self.module) else {}
            saved = {n: weights[n] for n, p in params.items() if self.masters.has(p) and n in weights}
            saved.update({n: weights[n] for n, b in buffers.items() if self.masters.has_buffer(b) and n in weights})
        for name, value in saved.items():
            if name in buffers and name not in params and tuple(value.shape) == tuple(buffers[name].shape):
                pass  # an estimate's master (BatchTopK's threshold)
            elif name not in params or tuple(value.shape) != tuple(params[name].shape):
                has = "has no such parameter" if name not in params else \
                    f"has it as {tuple(params[name].shape)}"
                raise CheckpointError(f"{path}: the master weight {name!r} {tuple(value.shape)} does not fit the "
                                      f"module ({type(self.module).__name__} {has})")
            if not value.is_floating_point():
                raise CheckpointError(f"{path}: the master weight {name!r} is saved as {value.dtype}, not a float "
                                      "dtype")
        _check_finite(path, saved)
        return saved

    def _restore_masters(self, masters: dict[str, torch.Tensor]) -> None:
        """Set the values :meth:`_saved_masters` checked."""
        params = dict(self.module.named_parameters())
        buffers = dict(self.module.named_buffers())
        for name, value in masters.items():
            if name in buffers and name not in params:
                self.masters.set_buffer(buffers[name], value)
            else:
                self.masters.set_(params[name], value)


def _check_progress(meta: dict[str, Any], path: Path) -> None:
    """``trainer.json``'s ``step`` (an int >= 0) and scale factors ``s_in`` / ``s_out`` (positive finite numbers,
    or both null before the first step).

    Raises:
        CheckpointError: a missing or malformed entry (named)."""
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{path}: key 'step' must be an int >= 0, got {step!r}")
    scales = [meta.get("s_in"), meta.get("s_out")]
    if scales == [None, None] and step == 0:
        return
    for key, v in zip(("s_in", "s_out"), scales, strict=True):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            raise CheckpointError(f"{path}: key {key!r} must be a positive finite number at step {step} (both null "
                                  f"before the first step), got {v!r}")


def _check_finite(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Raise :class:`CheckpointError` naming the first float tensor of ``tensors`` with a NaN / inf (a save refuses
    them: such a file was not written by it)."""
    for name, value in tensors.items():
        if value.is_floating_point() and count_non_finite(value):
            raise CheckpointError(f"{path}: the tensor {name!r} holds {count_non_finite(value)} non-finite values "
                                  "(a checkpoint is saved finite)")
