"""matplotlib figures: z-pattern heatmap (Lorsa paper §5.1), operand plot (Fig. 7), Fig. 13 histogram.

Local only (matplotlib, Agg backend); each function writes a PNG and returns its path.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402


def _save(fig: "plt.Figure", path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


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
