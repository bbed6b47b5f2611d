"""The contract between the trainer and an objective (:class:`_Objective`), the narrow state an objective
sees (:class:`TrainingState`), and the checks every objective shares; the objectives themselves are in
:mod:`.objectives` (dictionaries, the registry) and :mod:`.lorsa_objective`."""

from __future__ import annotations

import math
from typing import Any, ClassVar, TypeVar

import torch

from .._placement import f32
from ..errors import ArgumentError, NotReadyError, TooFewTokensError
from .activations import Batch

Metrics = dict[str, float]
ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


class TrainingState:
    """What an objective sees of its trainer (a narrow view, not the trainer): the step, the settings,
    the batches, the dead counters and AuxK, and one change it may make (:meth:`reset_latents`).

    Attributes (read-only): step (steps taken), config (:class:`~.trainer.TrainConfig`), dist (the
    data-parallel context, :class:`~.distributed.DataParallel`, or None).
    """

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    @property
    def step(self) -> int:
        return int(self._trainer.step)

    @property
    def config(self) -> Any:
        return self._trainer.config

    @property
    def dist(self) -> Any:
        return self._trainer.dist

    def source(self, index: int) -> Batch:
        """Batch ``index`` of the trainer's source (:meth:`~.trainer.Trainer.batch`: checked to be a Batch)."""
        return self._trainer.batch(index)

    def count_fired(self, fired: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """:meth:`~.trainer.Trainer.count_fired`: update the dead counters, return the dead mask."""
        return self._trainer.count_fired(fired, n_tokens)

    def aux_k_loss(self, pre: torch.Tensor, dead: torch.Tensor, err: torch.Tensor, W_dec: torch.Tensor,
                   default_k: int, signed: bool = False) -> torch.Tensor:
        """:meth:`~.trainer.Trainer.aux_k_loss` (AuxK, fp32 scalar on ``pre``'s device)."""
        return self._trainer.aux_k_loss(pre, dead, err, W_dec, default_k, signed)

    def batch_mean(self, values: torch.Tensor) -> torch.Tensor:
        """:meth:`~.trainer.Trainer.batch_mean`: the (global) batch mean of per-token ``values``."""
        return self._trainer.batch_mean(values)

    def fold_copy(self, module: ModuleT) -> ModuleT:
        """The copy a fold writes into (:meth:`~.master_weights.MasterWeights.rounded_copy`, inside ``editing``):
        ``module``'s deep copy, each parameter with an fp32 master in its own (low-precision) dtype."""
        return self._trainer.masters.rounded_copy(module)

    def reset_latents(self, params: Any, moved: torch.Tensor) -> None:
        """Latents ``moved`` (indices) start afresh: their rows of the Adam moments of ``params`` (those
        whose first axis is the latent axis) are zeroed, and their dead counters restart (a full dead window)."""
        n = self._trainer.tokens_since_fired.shape[0]
        for p in params:  # (a bf16 module's moments are its fp32 masters')
            for v in self._trainer.optimizer.state.get(self._trainer.masters.held(p), {}).values():
                if v.dim() and v.shape[0] == n:
                    v[moved] = 0
        self._trainer.tokens_since_fired[moved] = 0


class _Objective:
    """Base objective: one scale factor for inputs and one for targets (``s = sqrt(d) / E‖·‖`` over
    the loss-masked tokens of the first ``norm_batches`` batches).

    Attributes:
        module: the trained module. s_in, s_out: the scale factors (None until estimated; a CLT's are the
            means of ``s_in_layers`` / ``s_out_layers``, its per-layer lists, None for other kinds).
    """

    desc: ClassVar[str] = "train"
    weights_file: ClassVar[str] = "module.safetensors"
    config_key: ClassVar[str] = "module_config"
    #: the module class this objective trains (:func:`_objective_for` picks the first that fits)
    module_type: ClassVar[type] = torch.nn.Module

    def __init__(self, module: Any) -> None:
        self.module = module
        self.s_in: Any = None  # float | None (a float once estimated; the losses run after that)
        self.s_out: Any = None
        self.s_in_layers: list[float] | None = None
        self.s_out_layers: list[float] | None = None

    def reset_scales(self) -> None:
        """Forget the scale factors (an estimate that failed)."""
        self.s_in = self.s_out = self.s_in_layers = self.s_out_layers = None

    def n_latents(self) -> int:
        """Number of latents (heads, features) whose firing the dead counters follow.

        Source: ours (the objective contract of this package's trainer).
        """
        raise NotImplementedError

    def check_source(self, source: Any) -> None:
        """Raise when ``source`` visibly does not fit the module (default: nothing to check).

        Source: ours (the objective contract of this package's trainer).
        """

    @torch.no_grad()
    def estimate_norms(self, t: TrainingState) -> None:
        """Set :attr:`s_in` / :attr:`s_out` from the first ``norm_batches`` batches of ``t.source``.

        Raises:
            TooFewTokensError: those batches have no counted token.
        """
        norms_x, norms_y = [], []
        for i in range(t.config.norm_batches):  # in fp32 on the activations' device
            b = t.source(i)
            mask = b.loss_mask.to(b.x.device)
            norms_x.append(f32(b.x[mask]).norm(dim=-1))
            norms_y.append(f32(b.y[mask.to(b.y.device)]).norm(dim=-1).to(b.x.device))
        _require_tokens(t, sum(v.numel() for v in norms_x))
        self.s_in = _ratio(math.sqrt(b.x.shape[-1]), float(torch.cat(norms_x).mean()))
        self.s_out = _ratio(math.sqrt(b.y.shape[-1]), float(torch.cat(norms_y).mean()))

    def check_init_batch(self, t: TrainingState) -> None:
        """Raise :class:`~..errors.TooFewTokensError` when :meth:`after_norms` cannot work on the batches
        (called before it, the scale factors known; default: nothing needed)."""

    def after_norms(self, t: TrainingState) -> None:
        """Called once the scale factors are known (initialisation that depends on them).

        Source: ours (the objective contract of this package's trainer).
        """

    def discard_step(self, t: TrainingState) -> None:
        """Forget what :meth:`loss` recorded for :meth:`post_step` (the step was refused: non-finite).

        Source: ours (the objective contract of this package's trainer).
        """

    def loss(self, t: TrainingState, batch: Batch) -> tuple[torch.Tensor, Metrics]:
        """Loss on one batch (normalised space) and its metrics (``loss``, ``fvu``, ``l0``, ``dead_frac``, …).

        Source: ours (the objective contract of this package's trainer).
        """
        raise NotImplementedError

    def post_step(self, t: TrainingState) -> None:
        """Called after every optimizer step (the decoder constraint).

        Source: ours (the objective contract of this package's trainer).
        """

    def fold(self, t: TrainingState) -> torch.nn.Module:
        """A copy of the module acting on raw activations (scale factors folded into the weights)."""
        raise NotImplementedError

    def module_config(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def build_module(cls, meta: dict[str, Any]) -> torch.nn.Module:
        raise NotImplementedError

    def save_meta(self, t: TrainingState) -> dict[str, Any]:
        """Extra ``trainer.json`` entries.

        Source: ours (the objective contract of this package's trainer).
        """
        return {}

    def restore_meta(self, t: TrainingState, meta: dict[str, Any], path: Any) -> None:
        """Load what :meth:`save_meta` wrote. Called after the checkpoint's files are checked and before any of the
        trainer's state is set (``t`` still holds the state before the restore; ``meta["step"]`` is the saved step,
        checked): every entry is checked before the objective's own fields are set.

        Raises:
            CheckpointError: a malformed entry, naming ``path`` and the key; the objective and the trainer are left
                as they were.

        Source: ours (the objective contract of this package's trainer).
        """


def _ratio(num: float, den: float) -> float:
    """``num / den``, ``inf`` / ``nan`` where Python's division would raise (``den`` zero): the trainer names it."""
    return num / den if den != 0 else math.inf


def _require_tokens(t: TrainingState, n_tokens: int) -> None:
    """Raise :class:`~..errors.TooFewTokensError` when the scale-factor batches count no token."""
    if n_tokens == 0:
        n = t.config.norm_batches
        raise TooFewTokensError(f"the first {n} batch{'es' if n > 1 else ''} (norm_batches={n}) count no token: every "
                                "loss_mask entry is False (BOS and padding are never counted; a target_mask that "
                                "keeps nothing?): give windows with counted tokens (longer windows, a target_mask "
                                "with True entries) or raise norm_batches")


#: elements of one parameter a fold (:func:`fold_rows`) holds in fp32 at once: 2^22 (16 MB)
FOLD_CHUNK = 1 << 20


def row_chunks(t: torch.Tensor) -> list[slice]:
    """Slices of ``t``'s first axis of at most ~:data:`FOLD_CHUNK` elements each (one row at least; one slice
    of everything for a 0-dim ``t``)."""
    if t.dim() == 0:
        return [slice(None)]
    step = max(1, FOLD_CHUNK // max(1, t[0].numel()))
    return [slice(i, i + step) for i in range(0, t.shape[0], step)]


@torch.no_grad()
def fold_rows(dst: torch.Tensor, src: torch.Tensor, fn: Any) -> None:
    """``dst[r] = fn(src[r] copied, r)`` for each of :func:`row_chunks`; ``fn`` edits the copy in place and returns
    it, in ``src``'s dtype (a bf16 parameter's fp32 master), and ``dst`` takes it rounded once to its own dtype (as
    ``.to(dtype)``). A fold so holds one chunk in ``src``'s dtype at a time, not a copy of the module.
    ``dst (rows, *)`` and ``src`` of the same shape."""
    for r in row_chunks(src):
        dst[r] = fn(src[r].clone(), r)


@torch.no_grad()
def row_norms(src: torch.Tensor, fn: Any, dim: int = -1) -> torch.Tensor:
    """``fn(src).norm(dim=dim)`` computed per :func:`row_chunks` (``fn`` elementwise, on a copy; ``dim`` not 0):
    the norms of the rows a fold writes, without a copy of ``src``."""
    return torch.cat([fn(src[r].clone()).norm(dim=dim) for r in row_chunks(src)])


def _require_norms(objective: _Objective) -> None:
    if objective.s_in is None or objective.s_out is None:
        raise NotReadyError(f"{type(objective).__name__}: the scale factors are not estimated yet: run "
                            "Trainer.estimate_norms() or a train_step first")


def _fits(cls: type[_Objective], module: Any) -> bool:
    return isinstance(module, cls.module_type)


def _check_module(cls: type[_Objective], module: Any) -> None:
    if not _fits(cls, module):
        raise ArgumentError(f"{cls.__name__} trains a {cls.module_type.__name__}, got a {type(module).__name__}")
