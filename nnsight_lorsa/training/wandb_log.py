"""Weights & Biases logging of a :class:`~.trainer.Trainer` run (optional: ``pip install nnsight-lorsa[wandb]``).

Asked for with ``TrainConfig(wandb_project="name")`` (as SAELens' ``wandb_project`` / sparsify's
``log_to_wandb``); the run starts at the first :meth:`~.trainer.Trainer.train` (or
:meth:`~.trainer.Trainer.log_evaluation`) and is finished by :meth:`~.trainer.Trainer.close_logging` (or
by ``wandb`` itself when the process exits). Metric names are the trainer's and :func:`~.evaluate.evaluate`'s:

* ``train/<name>`` at every ``history`` entry (every ``log_every`` steps): ``loss``, ``fvu``, ``l0``,
  ``dead_frac``, ``aux``, ``lr``, … (whatever :meth:`~.trainer.Trainer.train_step` returns);
* ``eval/<name>`` from an :class:`~.evaluate.Evaluation`: ``fvu``, ``l0``, ``dead_frac``, ``ce_orig``,
  ``ce_spliced``, ``ce_zero``, ``ce_recovered``, ``kl``, ``n_tokens``, the shrinkage metrics; a CLT's
  per-layer lists as ``eval/fvu/layer_<l>`` …; the per-feature ``feature_density`` is not logged.

The W&B step is the trainer's step. The run's config holds the :class:`~.trainer.TrainConfig` fields and
the module's config. The run id is kept in training checkpoints, so :meth:`~.trainer.Trainer.resume`
continues the same W&B run (``resume="allow"``). ``wandb``'s own settings apply (``WANDB_MODE=offline``,
``WANDB_DIR``, ``WANDB_ENTITY``, ``wandb login``). Nothing here runs unless ``wandb_project`` is set.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ArgumentError, MissingDependencyError

__all__ = ["WandbRun", "flat_metrics"]


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError as e:
        raise MissingDependencyError(
            "TrainConfig.wandb_project is set, but the wandb package is not installed: pip install "
            "'nnsight-lorsa[wandb]' (or pip install wandb), or leave wandb_project=None") from e
    return wandb


def flat_metrics(metrics: Any, prefix: str) -> dict[str, float]:
    """``{prefix/name: number}`` of an :class:`~.evaluate.Evaluation` (its ``to_dict()``) or a mapping of
    names to numbers; a list of numbers (a CLT's per-layer values) becomes ``prefix/name/layer_<i>``;
    ``None``, ``feature_density`` and non-numeric entries are left out; a non-finite number (e.g. an undefined
    ``ce_recovered``, ``nan``) is kept: W&B records it as ``NaN`` / ``Infinity`` (its line charts skip it), so an
    undefined or diverged metric shows as such rather than as a missing point.

    Raises:
        ArgumentError: ``metrics`` is neither an Evaluation nor a mapping.
    """
    if hasattr(metrics, "to_dict") and callable(metrics.to_dict):
        metrics = metrics.to_dict()
    if not isinstance(metrics, Mapping):
        raise ArgumentError(f"metrics must be an Evaluation or a mapping of names to numbers, got "
                            f"{type(metrics).__name__}")
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if name == "feature_density" or name == "step":
            continue
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                if _number(v):
                    out[f"{prefix}/{name}/layer_{i}"] = float(v)
        elif _number(value):
            out[f"{prefix}/{name}"] = float(value)
    return out


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class WandbRun:
    """One W&B run of a trainer (started on construction).

    Args:
        project: the W&B project. name: the run's display name (None: W&B's). config: the run config.
        run_id: a run to continue (a resumed trainer's), else a new one.

    Raises:
        MissingDependencyError: ``wandb`` is not installed.
    """

    def __init__(self, project: str, name: str | None, config: dict[str, Any], run_id: str | None = None) -> None:
        wandb = _import_wandb()
        kwargs: dict[str, Any] = {"project": project, "name": name, "config": config}
        if run_id is not None:
            kwargs.update(id=run_id, resume="allow")
        self.run = wandb.init(**kwargs)
        self.id: str = str(self.run.id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Log ``metrics`` at W&B step ``step`` (W&B refuses a step below one already logged: the metrics are
        then logged without a step)."""
        if step >= getattr(self.run, "step", 0):
            self.run.log(metrics, step=step)
        else:  # e.g. an evaluation of an earlier state: keep it, at W&B's current step
            self.run.log(metrics)

    def finish(self) -> None:
        """Finish the run (flushes it; offline, the run's files are complete)."""
        self.run.finish()
