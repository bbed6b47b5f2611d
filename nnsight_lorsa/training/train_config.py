"""The optimisation settings of a :class:`~.trainer.Trainer` run: :class:`TrainConfig`, every field checked
(:meth:`TrainConfig.validate`) at construction and when a trainer takes it. :mod:`.trainer` re-exports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import ArgumentError


@dataclass
class TrainConfig:
    """Optimisation settings. ``total_steps`` batches are drawn from the source, one per step.

    Attributes:
        total_steps: steps (= batches) of the run. lr, betas: Adam. warmup_frac, decay_frac: the WSD
            schedule's warmup and decay as fractions of ``total_steps``. grad_clip: max gradient norm
            (0: none). norm_batches: batches the scale factors are estimated on.
        aux_k: latents in AuxK (default ``2 · top_k``). aux_k_coef: AuxK weight (TopK / BatchTopK /
            Lorsa). dead_after_tokens: tokens without firing after which a latent counts as dead.
        l1_coef: weight of the decoder-norm-weighted L1 (ReLU dictionaries).
        l0_coef: weight of the L0 penalty (JumpReLU dictionaries).
        normalize_decoder: keep unit-norm dictionary decoder rows (None: yes except for JumpReLU).
        sparse_kernels: train TopK / BatchTopK SAEs and transcoders through the sparse fast path
            (False: the dense reference; same values and gradients up to summation order).
        log_every: steps between entries of ``history`` (the logged metrics).
        wandb_project: log the run to this Weights & Biases project (None: no W&B; needs ``pip install
            nnsight-lorsa[wandb]``): every ``history`` entry as ``train/<name>`` at its step, and
            :meth:`~.trainer.Trainer.log_evaluation` as ``eval/<name>`` (:mod:`.wandb_log`). wandb_run_name: the
            W&B run's name (None: W&B's).

    Raises:
        ArgumentError: a field of the wrong type or out of its range (:meth:`validate`), named with its value.
    """

    total_steps: int
    lr: float = 2e-3
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_frac: float = 0.05
    decay_frac: float = 0.2
    grad_clip: float = 1.0
    norm_batches: int = 4
    aux_k: int | None = None  # default: 2 * top_k
    aux_k_coef: float = 1.0 / 32
    dead_after_tokens: int = 20_000
    l1_coef: float = 1e-3
    l0_coef: float = 1e-3
    normalize_decoder: bool | None = None
    sparse_kernels: bool = True
    log_every: int = 10
    wandb_project: str | None = None
    wandb_run_name: str | None = None
    history: list[dict[str, float]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (also run at construction, and by :class:`~.trainer.Trainer` on the config it is given).

        Integers are ``int`` (``bool`` is not one), floats finite real numbers: ``total_steps``,
        ``norm_batches``, ``log_every``, ``dead_after_tokens`` ≥ 1; ``aux_k`` None or ≥ 1; ``lr`` > 0;
        ``betas`` two numbers in ``[0, 1)``; ``warmup_frac``, ``decay_frac`` in ``[0, 1]`` with
        ``warmup_frac + decay_frac`` ≤ 1; ``grad_clip``, ``aux_k_coef``, ``l1_coef``, ``l0_coef`` ≥ 0;
        ``normalize_decoder`` None or a bool; ``sparse_kernels`` a bool; ``wandb_project``,
        ``wandb_run_name`` None or a non-empty str; ``history`` a list.

        Raises:
            ArgumentError: the first field that breaks its rule, named with its value.
        """
        for name in ("total_steps", "norm_batches", "log_every", "dead_after_tokens"):
            _check_int(name, getattr(self, name))
        if self.aux_k is not None:
            _check_int("aux_k", self.aux_k)
        _check_real("lr", self.lr, positive=True)
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise ArgumentError(f"TrainConfig.betas must be a pair of numbers in [0, 1), got {self.betas!r}")
        for i, b in enumerate(self.betas):
            _check_real(f"betas[{i}]", b, upper=1.0, upper_open=True)
        for name in ("warmup_frac", "decay_frac"):
            _check_real(name, getattr(self, name), upper=1.0)
        if self.warmup_frac + self.decay_frac > 1:
            raise ArgumentError(f"TrainConfig.warmup_frac + decay_frac must be at most 1 (the warmup and the decay "
                                f"are parts of one run), got warmup_frac={self.warmup_frac!r} + "
                                f"decay_frac={self.decay_frac!r} = {self.warmup_frac + self.decay_frac!r}")
        for name in ("grad_clip", "aux_k_coef", "l1_coef", "l0_coef"):
            _check_real(name, getattr(self, name))
        if self.normalize_decoder is not None and not isinstance(self.normalize_decoder, bool):
            raise ArgumentError(f"TrainConfig.normalize_decoder must be None or a bool, got {self.normalize_decoder!r}")
        if not isinstance(self.sparse_kernels, bool):
            raise ArgumentError(f"TrainConfig.sparse_kernels must be a bool, got {self.sparse_kernels!r}")
        for name in ("wandb_project", "wandb_run_name"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ArgumentError(f"TrainConfig.{name} must be None or a non-empty str, got {value!r}")
        if not isinstance(self.history, list):
            raise ArgumentError(f"TrainConfig.history must be a list, got {type(self.history).__name__}")


def _check_int(name: str, value: Any) -> None:
    """``value`` an ``int`` (not a bool) ≥ 1, else :class:`ArgumentError` naming ``TrainConfig.<name>``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ArgumentError(f"TrainConfig.{name} must be a positive int, got {value!r}")


def _check_real(name: str, value: Any, *, positive: bool = False, upper: float | None = None,
                upper_open: bool = False) -> None:
    """``value`` a finite real number (int or float, not a bool), ``> 0`` if ``positive`` else ``≥ 0``, and at
    most ``upper`` (below it if ``upper_open``); else :class:`ArgumentError` naming ``TrainConfig.<name>``."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ArgumentError(f"TrainConfig.{name} must be a finite number, got {value!r}")
    low_ok = value > 0 if positive else value >= 0
    high_ok = upper is None or (value < upper if upper_open else value <= upper)
    if not (low_ok and high_ok):
        lo = "(0" if positive else "[0"
        hi = "inf)" if upper is None else (f"{upper:g})" if upper_open else f"{upper:g}]")
        raise ArgumentError(f"TrainConfig.{name} must be in {lo}, {hi}, got {value!r}")
