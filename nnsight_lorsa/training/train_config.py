"""The optimisation settings of a :class:`~.trainer.Trainer` run: :class:`TrainConfig`, every field checked
(:meth:`TrainConfig.validate`) at construction and when a trainer takes it. :mod:`.trainer` re-exports it.

:class:`OptimConfig` holds the settings every trainer of the package shares — run length, learning rate, Adam's
betas, gradient clipping, the learning-rate decay at the end of the run — with one name, meaning and check each:
:class:`TrainConfig` and the sparse-attention trainer's
:class:`~nnsight_lorsa.sparse_attention.train.SparseTrainConfig` extend it (each with its trainer's defaults).
"""

from __future__ import annotations

from dataclasses import dataclass

from .._checks import check_int, check_real
from ..errors import ArgumentError


@dataclass
class OptimConfig:
    """The optimisation settings every trainer shares (module docstring); checked at construction.

    Attributes:
        total_steps: optimiser steps of the run (one batch each).
        lr: the base learning rate (Adam / AdamW).
        betas: Adam's ``(β1, β2)``.
        grad_clip: max gradient norm (0: none).
        decay_frac: the last fraction of ``total_steps`` over which the learning rate decays linearly (to what:
            each trainer's config says).

    Raises:
        ArgumentError: a field of the wrong type or out of its range (:meth:`validate`), named with its value.

    Source: Lorsa paper (He et al. 2025) §3.2 (Adam, warmup–stable–decay); ours (the fields and checks).
    """

    total_steps: int
    lr: float = 2e-3
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    decay_frac: float = 0.2

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the shared fields: ``total_steps`` an ``int`` ≥ 1 (``bool`` is not one); ``lr`` > 0; ``betas``
        two numbers in ``[0, 1)``; ``grad_clip`` ≥ 0; ``decay_frac`` in ``[0, 1]`` (finite real numbers).

        Raises:
            ArgumentError: the first field that breaks its rule, named (``<Config>.<field>``) with its value.

        Source: Lorsa paper (He et al. 2025) §3.2 (Adam, warmup–stable–decay); ours (the fields and checks).
        """
        who = type(self).__name__
        check_int(who, "total_steps", self.total_steps)
        check_real(who, "lr", self.lr, positive=True)
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise ArgumentError(f"{who}.betas must be a pair of numbers in [0, 1), got {self.betas!r}")
        for i, b in enumerate(self.betas):
            check_real(who, f"betas[{i}]", b, upper=1.0, upper_open=True)
        check_real(who, "grad_clip", self.grad_clip)
        check_real(who, "decay_frac", self.decay_frac, upper=1.0)


@dataclass
class TrainConfig(OptimConfig):
    """Optimisation settings of a :class:`~.trainer.Trainer`. ``total_steps`` batches are drawn from the source,
    one per step.

    Attributes:
        total_steps, lr, betas, grad_clip, decay_frac: as :class:`OptimConfig` (Adam; the decay is the WSD
            schedule's, to ``decay_to`` at the last step). warmup_frac: the WSD schedule's warmup as a fraction of
            ``total_steps``. decay_to: the fraction of ``lr`` the decay ends at (0; the Lorsa authors'
            trainer: 1/32). norm_batches: batches the scale factors are estimated on.
        aux_k: latents in AuxK (default ``2 · top_k``). aux_k_coef: AuxK weight (TopK / BatchTopK /
            Lorsa). dead_after_tokens: tokens without firing after which a latent counts as dead.
        l1_coef: weight of the decoder-norm-weighted L1 (ReLU dictionaries).
        l0_coef: weight of the L0 penalty (JumpReLU dictionaries).
        normalize_decoder: keep unit-norm dictionary decoder rows (None: yes except for JumpReLU).
        sparse_kernels: train TopK / BatchTopK SAEs and transcoders through the sparse fast path
            (False: the dense reference; same values and gradients up to summation order).
        master_weights: train a bf16 module through fp32 master weights (mixed precision: Adam steps fp32
            masters with fp32 moments, the module's weights are their rounding; :mod:`.master_weights`).
            False: Adam steps the bf16 weights themselves (6 instead of 14 bytes per parameter, but an update
            below half a bf16 step of a weight is lost: at ``lr=1e-4`` most entries never move). No effect on
            fp32 / fp64 modules.
        log_every: steps between entries of the trainer's ``history`` (the logged metrics;
            :attr:`~.trainer.Trainer.history`).
        wandb_project: log the run to this Weights & Biases project (None: no W&B; needs ``pip install
            nnsight-lorsa[wandb]``): every ``history`` entry as ``train/<name>`` at its step, and
            :meth:`~.trainer.Trainer.log_evaluation` as ``eval/<name>`` (:mod:`.wandb_log`). wandb_run_name: the
            W&B run's name (None: W&B's).

    Raises:
        ArgumentError: a field of the wrong type or out of its range (:meth:`validate`), named with its value.

    Source: Lorsa paper (He et al. 2025) §3.2 (Adam, warmup–stable–decay); ours (the fields and checks).
    """

    warmup_frac: float = 0.05
    decay_to: float = 0.0
    norm_batches: int = 4
    aux_k: int | None = None  # default: 2 * top_k
    aux_k_coef: float = 1.0 / 32
    dead_after_tokens: int = 20_000
    l1_coef: float = 1e-3
    l0_coef: float = 1e-3
    normalize_decoder: bool | None = None
    sparse_kernels: bool = True
    master_weights: bool = True
    log_every: int = 10
    wandb_project: str | None = None
    wandb_run_name: str | None = None

    def validate(self) -> None:
        """Check every field (also run at construction, and by :class:`~.trainer.Trainer` on the config it is given).

        The shared fields as :meth:`OptimConfig.validate`; then integers are ``int`` (``bool`` is not one),
        floats finite real numbers: ``decay_to`` in ``[0, 1]``; ``norm_batches``, ``log_every``,
        ``dead_after_tokens`` ≥ 1; ``aux_k`` None
        or ≥ 1; ``warmup_frac`` in ``[0, 1]`` with ``warmup_frac + decay_frac`` ≤ 1; ``aux_k_coef``,
        ``l1_coef``, ``l0_coef`` ≥ 0; ``normalize_decoder`` None or a bool; ``sparse_kernels`` and
        ``master_weights`` bools;
        ``wandb_project``, ``wandb_run_name`` None or a non-empty str.

        Raises:
            ArgumentError: the first field that breaks its rule, named with its value.

        Source: Lorsa paper (He et al. 2025) §3.2 (Adam, warmup–stable–decay); ours (the fields and checks).
        """
        super().validate()
        for name in ("norm_batches", "log_every", "dead_after_tokens"):
            check_int("TrainConfig", name, getattr(self, name))
        if self.aux_k is not None:
            check_int("TrainConfig", "aux_k", self.aux_k)
        check_real("TrainConfig", "warmup_frac", self.warmup_frac, upper=1.0)
        check_real("TrainConfig", "decay_to", self.decay_to, upper=1.0)
        if self.warmup_frac + self.decay_frac > 1:
            raise ArgumentError(f"TrainConfig.warmup_frac + decay_frac must be at most 1 (the warmup and the decay "
                                f"are parts of one run), got warmup_frac={self.warmup_frac!r} + "
                                f"decay_frac={self.decay_frac!r} = {self.warmup_frac + self.decay_frac!r}")
        for name in ("aux_k_coef", "l1_coef", "l0_coef"):
            check_real("TrainConfig", name, getattr(self, name))
        if self.normalize_decoder is not None and not isinstance(self.normalize_decoder, bool):
            raise ArgumentError(f"TrainConfig.normalize_decoder must be None or a bool, got {self.normalize_decoder!r}")
        for name in ("sparse_kernels", "master_weights"):
            if not isinstance(getattr(self, name), bool):
                raise ArgumentError(f"TrainConfig.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("wandb_project", "wandb_run_name"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ArgumentError(f"TrainConfig.{name} must be None or a non-empty str, got {value!r}")
