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

from .._checks import check_instance, is_collection, is_int  # noqa: E402
from ..errors import ArgumentError, NonFiniteError  # noqa: E402
from ..formats.files import check_path  # noqa: E402


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


def _matrix(values: Any, name: str, fn: str) -> torch.Tensor:
    """``values`` as a 2-D fp32 host tensor (any real float or integer dtype, any device with data).

    Raises:
        ArgumentError: not a real tensor, not 2-D, or empty."""
    if not isinstance(values, torch.Tensor) or values.is_complex() or values.dtype == torch.bool or values.is_meta:
        raise ArgumentError(f"{fn}: {name} must be a real tensor on a device with data, got "
                            f"{getattr(values, 'dtype', type(values).__name__)}")
    if values.dim() != 2 or values.numel() == 0:
        raise ArgumentError(f"{fn}: {name} must be a non-empty 2-D tensor, got shape {tuple(values.shape)}")
    return values.detach().to("cpu", torch.float32)


def _inf_error(values: torch.Tensor, name: str, fn: str) -> NonFiniteError:
    i, j = (int(x) for x in torch.isinf(values).nonzero()[0])
    return NonFiniteError(f"{fn}: {name}[{i}, {j}] is {float(values[i, j])} (or beyond float32's range): no colour "
                          "scale shows it; its neighbours would all look 0", tensor=name)


def plot_z_pattern(zp: torch.Tensor, tokens: Sequence[str], path: str | Path, title: str = "") -> Path:
    """Heatmap of one head's z-pattern ``zp (q_pos, k_pos)`` (query rows, key columns; causal:
    :meth:`~nnsight_lorsa.modules.Lorsa.z_pattern`'s ``[b, n]``), the tokens on both axes. The colour scale
    is symmetric about 0 (``RdBu_r``, ``±max |zp|``); the cells above the diagonal (keys after the query,
    masked by causal attention) are drawn grey, not as 0. Writes a PNG.

    Args:
        zp: ``(n, n)`` any real dtype (bf16 / fp16 are shown as their fp32 values), any device.
        tokens: the ``n`` token strings (``\n`` shown as ``⏎``).

    Raises:
        ArgumentError: ``zp`` not a non-empty square matrix of ``len(tokens)`` rows, or non-zero above its diagonal
            (a key after its query: a pattern passed transposed, ``(k_pos, q_pos)``, or no causal one).
        NonFiniteError: a NaN / inf in ``zp`` (``tensor="zp"``; the message names the query and key).
        ArgumentError: ``path`` not a str / ``os.PathLike``, ``title`` not a str, ``tokens`` not a list of str.

    Source: Lorsa paper (He et al. 2025) §5.1 (z-pattern).
    """
    check_path(path, "plot_z_pattern", "an image file")
    check_instance(title, str, "plot_z_pattern", "title")
    if not isinstance(tokens, (list, tuple)) or not all(isinstance(t, str) for t in tokens):
        raise ArgumentError(f"plot_z_pattern: tokens must be a list of str labels, got {tokens!r}"[:200])
    z = _matrix(zp, "zp", "plot_z_pattern")
    n = len(tokens)
    if tuple(z.shape) != (n, n):
        raise ArgumentError(f"plot_z_pattern: zp of shape {tuple(z.shape)} does not fit {n} tokens: it must be "
                            f"({n}, {n}) (query rows, key columns)")
    if not bool(torch.isfinite(z).all()):
        i, j = (int(x) for x in (~torch.isfinite(z)).nonzero()[0])
        raise NonFiniteError(f"plot_z_pattern: zp[{i}, {j}] (query {i}, key {j}) is {float(z[i, j])}", tensor="zp")
    upper = torch.ones(n, n, dtype=torch.bool, device=z.device).triu(1)
    if bool((z[upper] != 0).any()):
        i, j = (int(x) for x in ((z != 0) & upper).nonzero()[0])
        raise ArgumentError(f"plot_z_pattern: zp[{i}, {j}] = {float(z[i, j]):.4g} is a key after its query; a "
                            "z-pattern is causal with query rows and key columns (was it passed transposed? zp.T)")
    m = float(z.abs().max()) or 1.0
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="0.85")
    fig, ax = plt.subplots(figsize=(0.28 * n + 2, 0.28 * n + 1.5))
    im = ax.imshow(z.masked_fill(upper, float("nan")).numpy(), cmap=cmap, vmin=-m, vmax=m)
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
    """Operand plot (Lorsa paper Fig. 7): ``grid[op1, op2]`` (e.g. a head's z at the last token; op1 rows from
    the top, op2 columns). ``operands``: the operand value of each row / column (e.g. ``range(100)``; any order,
    any spacing: an evenly spaced one labels the axes by value, another by its values at the tick positions).
    Colours: ``viridis`` over the data's range where no value is negative, else ``RdBu_r`` symmetric about 0.
    NaN cells (prompts left out: :meth:`~nnsight_lorsa.patching.tasks.ArithmeticGrid.assemble`) stay blank.

    Raises:
        ArgumentError: ``grid`` not a non-empty 2-D tensor; ``operands`` not a list / range of ints, or not one per
            row and column; ``path`` not a str / ``os.PathLike``, ``title`` not a str.
        NonFiniteError: an inf in ``grid`` (``tensor="grid"``).

    Source: Lorsa paper (He et al. 2025) §6.2, Fig. 7.
    """
    check_path(path, "plot_operand_grid", "an image file")
    check_instance(title, str, "plot_operand_grid", "title")
    g = _matrix(grid, "grid", "plot_operand_grid")
    if bool(torch.isinf(g).any()):
        raise _inf_error(g, "grid", "plot_operand_grid")
    ops: list[int] | None = None
    if operands is not None:
        if not is_collection(operands):
            raise ArgumentError(f"plot_operand_grid: operands must be a list / range of ints, got {operands!r}"[:200])
        ops = list(operands)
        if not all(is_int(o) for o in ops):
            raise ArgumentError(f"plot_operand_grid: operands must be ints, got {ops[:5]}")
        if g.shape[0] != len(ops) or g.shape[1] != len(ops):
            raise ArgumentError(f"plot_operand_grid: {len(ops)} operands do not label a grid of shape "
                                f"{tuple(g.shape)} (one operand per row and per column)")
    fig, ax = plt.subplots(figsize=(5, 4.4))
    ext = None
    steps = {b - a for a, b in zip(ops, ops[1:], strict=False)} if ops else set()
    if ops and len(steps) <= 1 and 0 not in steps:  # evenly spaced: the axes are the operand values
        d = steps.pop() if steps else 1
        ext = (ops[0] - d / 2, ops[-1] + d / 2, ops[-1] + d / 2, ops[0] - d / 2)
    finite = g[torch.isfinite(g)]
    lo = float(finite.min()) if finite.numel() else 0.0
    if lo < 0:
        m = float(finite.abs().max())
        im = ax.imshow(g.numpy(), cmap="RdBu_r", vmin=-m, vmax=m, extent=ext)
    else:
        im = ax.imshow(g.numpy(), cmap="viridis", extent=ext)
    if ops and ext is None:  # uneven or repeated operands: ticks at cells, labelled with their operands
        at = sorted({round(k * (len(ops) - 1) / min(9, len(ops) - 1)) for k in range(min(9, len(ops) - 1) + 1)})
        ax.set_xticks(at, [str(ops[k]) for k in at])
        ax.set_yticks(at, [str(ops[k]) for k in at])
    ax.set_xlabel("op2")
    ax.set_ylabel("op1")
    ax.set_title(title or "operand plot")
    fig.colorbar(im, ax=ax, fraction=0.046)
    return _save(fig, path)


def plot_heads_spanned(n_spanned: torch.Tensor, path: str | Path, title: str = "") -> Path:
    """Fig. 13: how many MHSA heads each Lorsa head spans (``n`` of App. E.2; 0 = never active, -1 = contributions
    summing to 0 or less, both dropped): bar ``k`` is the fraction of the Lorsa heads with a defined ``n`` that span
    ``k`` MHSA heads; the title says how many were dropped as undefined. Writes a PNG.

    Args:
        n_spanned: ``(n_heads,)`` counts (:meth:`~nnsight_lorsa.analysis.heads.MHSACorrelation.heads_spanned`), any
            integer dtype or a float one holding whole numbers.

    Raises:
        ArgumentError: not a real 1-D tensor, or a count below -1, NaN / inf or not a whole number (it would have
            been dropped or truncated into another bar); ``path`` not a str / ``os.PathLike``, ``title`` not a str.

    Source: Lorsa paper (He et al. 2025) App. E, Fig. 13.
    """
    check_path(path, "plot_heads_spanned", "an image file")
    check_instance(title, str, "plot_heads_spanned", "title")
    if not isinstance(n_spanned, torch.Tensor) or n_spanned.is_complex() or n_spanned.is_meta or n_spanned.dim() != 1:
        raise ArgumentError(f"plot_heads_spanned: n_spanned must be a 1-D tensor of counts, got "
                            f"{getattr(n_spanned, 'shape', type(n_spanned).__name__)}")
    n = n_spanned.detach().cpu().double()
    bad = ~torch.isfinite(n) | (n < -1) | (n != n.round())
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ArgumentError(f"plot_heads_spanned: n_spanned[{i}] = {float(n[i])} is no count of MHSA heads "
                            "(a whole number >= 0, or -1 for undefined)")
    undefined = int((n == -1).sum())
    n = n[n > 0].long()
    counts = torch.bincount(n, minlength=int(n.max()) + 1 if n.numel() else 1)[1:]
    frac = counts.float() / max(int(n.numel()), 1)
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    drawn = counts.nonzero().flatten()  # one bar per count that occurs (a bar of height 0 draws nothing; a count
    ax.bar((drawn + 1).numpy(), frac[drawn].numpy(), color="#1f77b4")  # of 10**6 took minutes as a million of them)
    ax.set_xlim(0.4, max(len(frac), 1) + 0.6)  # the axis of every bar from 1 to the largest count, as before
    ax.set_xlabel("MHSA heads spanned (90% of contribution)")
    ax.set_ylabel("fraction of Lorsa heads")
    ax.set_title(title or f"{int(n.numel())} active Lorsa heads"
                 + (f" ({undefined} undefined, dropped)" if undefined else ""))
    return _save(fig, path)


#: panels first in this order (the rest of a history's numeric keys follow, sorted)
_CURVES = ("loss", "fvu", "l0", "dead_frac", "lr")
_LOG_SCALE = ("loss", "fvu", "mse", "aux")


def plot_training_curves(history: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """The training curves of a run: one panel per logged metric against the step (a
    :class:`~nnsight_lorsa.training.Trainer`'s ``history``: dicts with ``step`` and the metrics it
    logs every ``log_every`` steps, e.g. ``loss``, ``fvu``, ``l0``, ``dead_frac``). ``loss`` and ``fvu``
    are drawn on a log scale where all positive; non-finite values are left out of a panel. Writes a PNG.

    Raises:
        ArgumentError: ``history`` empty, an entry that is no mapping or has no ``step``, or no numeric
            metric beside ``step``; ``path`` not a str / ``os.PathLike``, ``title`` not a str.

    Source: ours (the training log of this package's trainer).
    """
    check_path(path, "plot_training_curves", "an image file")
    check_instance(title, str, "plot_training_curves", "title")
    if not isinstance(history, Sequence) or isinstance(history, (str, bytes)) or not history:
        raise ArgumentError("plot_training_curves: history must be a non-empty list of logged entries "
                            "(Trainer.history)")
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
