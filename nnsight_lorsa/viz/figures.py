"""matplotlib figures: z-pattern heatmap (Lorsa paper §5.1), operand plot (Fig. 7), Fig. 13 histogram,
training curves.

Local only (matplotlib, Agg backend); each function writes a PNG and returns its path.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from ..errors import ArgumentError  # noqa: E402


def _save(fig: "plt.Figure", path: str | Path) -> Path:
    """Write ``fig`` to ``path`` (format from its suffix) atomically: rendered in memory, then a sibling temporary
    renamed over ``path`` (:func:`~nnsight_lorsa._atomic.atomic_file`), so Ctrl-C never leaves half a picture."""
    import io

    from .._atomic import atomic_file

    path = Path(path)
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format=path.suffix[1:].lower() or None, dpi=110, bbox_inches="tight")
    finally:
        plt.close(fig)
    return atomic_file(path, buf.getvalue())


def plot_z_pattern(zp: torch.Tensor, tokens: Sequence[str], path: str | Path, title: str = "") -> Path:
    """Heatmap of one head's z-pattern ``zp (q_pos, k_pos)`` (query rows, key columns; causal)."""
    zp = zp.detach().float().cpu()
    m = float(zp.abs().max()) or 1.0
    n = len(tokens)
    fig, ax = plt.subplots(figsize=(0.28 * n + 2, 0.28 * n + 1.5))
    im = ax.imshow(zp.numpy(), cmap="RdBu_r", vmin=-m, vmax=m)
    labels = [t.replace("\n", "⏎") for t in tokens]
    ax.set_xticks(range(n), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(n), labels, fontsize=7)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_title(title or "z-pattern")
    fig.colorbar(im, ax=ax, fraction=0.04)
    return _save(fig, path)


def plot_operand_grid(grid: torch.Tensor, path: str | Path, operands: Sequence[int] | None = None,
                      title: str = "") -> Path:
    """Operand plot (Lorsa paper Fig. 7): ``grid[op1, op2]`` (e.g. a head's z at the last token)."""
    g = grid.detach().float().cpu()
    fig, ax = plt.subplots(figsize=(5, 4.4))
    ext = None if operands is None else (min(operands) - 0.5, max(operands) + 0.5, max(operands) + 0.5,
                                         min(operands) - 0.5)
    im = ax.imshow(g.numpy(), cmap="viridis", extent=ext)
    ax.set_xlabel("op2")
    ax.set_ylabel("op1")
    ax.set_title(title or "operand plot")
    fig.colorbar(im, ax=ax, fraction=0.046)
    return _save(fig, path)


def plot_heads_spanned(n_spanned: torch.Tensor, path: str | Path, title: str = "") -> Path:
    """Fig. 13: how many MHSA heads each Lorsa head spans (``n`` of App. E.2; 0 = never active, dropped)."""
    n = n_spanned.detach().cpu()
    n = n[n > 0].long()
    counts = torch.bincount(n, minlength=int(n.max()) + 1 if n.numel() else 1)[1:]
    frac = counts.float() / max(int(n.numel()), 1)
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    ax.bar(range(1, len(frac) + 1), frac.numpy(), color="#1f77b4")
    ax.set_xlabel("MHSA heads spanned (90% of contribution)")
    ax.set_ylabel("fraction of Lorsa heads")
    ax.set_title(title or f"{int(n.numel())} active Lorsa heads")
    return _save(fig, path)


#: panels first in this order (the rest of a history's numeric keys follow, sorted)
_CURVES = ("loss", "fvu", "l0", "dead_frac", "lr")
_LOG_SCALE = ("loss", "fvu", "mse", "aux")


def plot_training_curves(history: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """The training curves of a run: one panel per logged metric against the step (a
    :class:`~nnsight_lorsa.training.Trainer`'s ``config.history``: dicts with ``step`` and the metrics it
    logs every ``log_every`` steps, e.g. ``loss``, ``fvu``, ``l0``, ``dead_frac``). ``loss`` and ``fvu``
    are drawn on a log scale where all positive; non-finite values are left out of a panel. Writes a PNG.

    Raises:
        ArgumentError: ``history`` empty, an entry that is no mapping or has no ``step``, or no numeric
            metric beside ``step``.
    """
    if not isinstance(history, Sequence) or isinstance(history, (str, bytes)) or not history:
        raise ArgumentError("plot_training_curves: history must be a non-empty list of logged entries "
                            "(Trainer.config.history)")
    for i, entry in enumerate(history):
        if not isinstance(entry, Mapping) or not isinstance(entry.get("step"), (int, float)):
            raise ArgumentError(f"plot_training_curves: history[{i}] is not a dict with a numeric 'step': {entry!r}")
    keys = {k for e in history for k, v in e.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    names = [k for k in _CURVES if k in keys] + sorted(keys - set(_CURVES))
    if not names:
        raise ArgumentError("plot_training_curves: the history holds no numeric metric beside 'step'")
    cols = min(3, len(names))
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.9 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        pts = [(float(e["step"]), float(e[name])) for e in history
               if isinstance(e.get(name), (int, float)) and math.isfinite(float(e[name]))]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color="#1f77b4", lw=1.4, marker="." if len(pts) < 40
                    else None)
            if name in _LOG_SCALE and all(p[1] > 0 for p in pts):
                ax.set_yscale("log")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle(title or f"training: {len(history)} logged steps", fontsize=11)
    fig.tight_layout()
    return _save(fig, path)
