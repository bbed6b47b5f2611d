"""A static matplotlib picture of a pruned attribution graph (layer × token position).

Nodes sit at ``x = token position`` and ``y = layer`` (embeddings below layer 0, logits above the
last layer; within a layer the attention's Lorsa heads and errors sit below its MLP's features and
errors, and so do the biases each side adds: :meth:`~nnsight_lorsa.attribution.graph.NodeTable.attention_side`);
edges are lines whose width and opacity grow with ``|weight|`` (blue positive, red
negative; at most ``max_edges``, the largest). Bias nodes, which sum over positions, are drawn at the right edge.
Local-only (matplotlib).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .._atomic import atomic_file
from .._checks import check_instance, is_int
from ..attribution.graph import ATTN_ERROR, BIAS, EMBEDDING, LOGIT, LORSA, MLP_ERROR, TRANSCODER, Graph
from ..attribution.scores import PruneResult, check_pruned_graph
from ..errors import ArgumentError, NonFiniteError
from ..formats.files import check_path

_STYLE = {TRANSCODER: ("tab:green", "o", "transcoder feature"), LORSA: ("tab:purple", "D", "Lorsa head"),
          MLP_ERROR: ("0.55", "s", "MLP error"), ATTN_ERROR: ("0.75", "s", "Lorsa error"),
          EMBEDDING: ("tab:orange", "^", "embedding"), BIAS: ("tab:brown", "P", "bias"),
          LOGIT: ("tab:red", "*", "logit")}


def node_xy(graph: Graph, n_layers: int) -> torch.Tensor:
    """``(n_nodes, 2)`` plot coordinates (see the module docstring)."""
    k, layer, pos = graph.nodes.kind, graph.nodes.layer.float(), graph.nodes.pos.float()
    y = layer.clone()
    y[graph.nodes.attention_side()] -= 0.45  # Lorsa heads, Lorsa errors, attention-side biases
    y[k == EMBEDDING] = -1.0
    y[k == LOGIT] = float(n_layers)
    x = pos.clone()
    x[k == BIAS] = float(len(graph.tokens)) + 0.5
    # spread nodes sharing a cell a little
    key = (x * 1000 + y * 10).round()
    for cell in key.unique():
        idx = (key == cell).nonzero().flatten()
        if len(idx) > 1:
            x[idx] += torch.linspace(-0.3, 0.3, len(idx), device=x.device)
    return torch.stack([x, y], 1)


def plot_graph(graph: Graph, pruned: PruneResult, *, tokens: list[str] | None = None, path: str | Path | None = None,
               title: str = "", max_edges: int = 400) -> Any:
    """Draw the pruned graph; returns the matplotlib figure (saved to ``path`` if given, as a PNG unless its suffix
    names another format, atomically: rendered in memory, then written through
    :func:`~nnsight_lorsa._atomic.atomic_file`, so an error or Ctrl-C while saving leaves the previous file or none).

    Args:
        graph: the attribution graph; ``pruned``: :func:`~nnsight_lorsa.attribution.prune` of this graph (its kept
            nodes are drawn, and its kept edges up to ``max_edges``).
        tokens: the x-axis labels, one per position of ``graph.tokens`` (default: the token ids).
        max_edges: the cap on drawn edges (an int >= 0): the ``max_edges`` kept edges of largest ``|weight|`` are
            drawn; the default title then says how many of the kept edges are shown.

    Raises:
        ArgumentError: ``graph`` / ``pruned`` not a :class:`~nnsight_lorsa.attribution.Graph` / ``PruneResult``,
            ``pruned`` not of this graph (another node count), ``tokens`` not a list of str, one per position,
            ``max_edges`` not an int >= 0, ``path`` not None, a str or ``os.PathLike``, ``title`` not a str.
        NonFiniteError: a NaN / inf weight among the kept edges (``tensor="edges"``).

    Source: ours (a static matplotlib picture of the graph).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    check_pruned_graph(graph, pruned, "plot_graph")
    if path is not None:
        check_path(path, "plot_graph", "an image file")
    if tokens is not None and (isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence)
                               or not all(isinstance(t, str) for t in tokens)):
        raise ArgumentError(f"plot_graph: tokens must be a list of str labels, one per position, got a "
                            f"{type(tokens).__name__}")
    if tokens is not None and len(tokens) != len(graph.tokens):
        raise ArgumentError(f"plot_graph: {len(tokens)} token labels for the graph's {len(graph.tokens)} positions")
    if not is_int(max_edges) or max_edges < 0:
        raise ArgumentError(f"plot_graph: max_edges must be an int >= 0, got {max_edges!r}")
    check_instance(title, str, "plot_graph", "title")
    n_layers = int(graph.nodes.layer[graph.logit_ids].max()) if len(graph.logit_ids) else 1
    xy = node_xy(graph, n_layers)
    keep = pruned.node_mask
    t, s = pruned.edge_index
    w = graph.edge_values(t, s).float()  # the kept edges only (from the causal blocks if kept: no n² matrix)
    if not bool(torch.isfinite(w).all()):
        i = int((~torch.isfinite(w)).nonzero()[0])
        raise NonFiniteError(f"plot_graph: the kept edge {int(s[i])} -> {int(t[i])} (source -> target node) has weight "
                             f"{float(w[i])}", tensor="edges")
    order = w.abs().argsort(descending=True)[:max_edges]
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(graph.tokens) + 3), 6))
    wmax = float(w.abs().max()) if len(w) else 1.0
    for i in order.tolist():
        a, b = int(s[i]), int(t[i])
        frac = float(w[i].abs()) / wmax
        ax.plot([xy[a, 0], xy[b, 0]], [xy[a, 1], xy[b, 1]], color="tab:blue" if w[i] > 0 else "tab:red",
                lw=0.3 + 2.5 * frac, alpha=0.15 + 0.6 * frac, zorder=1)
    for kind, (color, marker, label) in _STYLE.items():
        m = keep & (graph.nodes.kind == kind)
        if m.any():
            ax.scatter(xy[m, 0], xy[m, 1], c=color, marker=marker, s=40, label=f"{label} ({int(m.sum())})",
                       zorder=2, edgecolors="k", linewidths=0.3)
    labels = [repr(x)[1:-1] for x in (tokens if tokens is not None else [str(int(i)) for i in graph.tokens])]
    ticks: list[float] = list(range(len(labels)))
    if bool((keep & (graph.nodes.kind == BIAS)).any()):  # the bias nodes' column, right of the last position
        ticks.append(float(len(graph.tokens)) + 0.5)
        labels.append("bias")
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels, rotation=70, fontsize=7)
    ax.set_yticks(range(-1, n_layers + 1))
    ax.set_yticklabels(["emb", *[f"L{i}" for i in range(n_layers)], "logit"])
    n_edges = pruned.edge_index.shape[1]
    shown = "" if len(order) == n_edges else f" ({len(order)} of largest |weight| drawn)"
    ax.set_title(title or f"attribution graph: {int(keep.sum())} nodes, {n_edges} edges{shown}")
    ax.legend(loc="upper left", fontsize=7, ncol=4)
    fig.tight_layout()
    if path is not None:
        buf = io.BytesIO()
        fig.savefig(buf, format=Path(path).suffix[1:].lower() or "png", dpi=130)
        atomic_file(path, buf.getvalue())
    return fig
