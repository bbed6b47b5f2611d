"""The rows of ``plot_graph`` and how it writes its file (the hub / viz probe, docs/reliability.md).

Each bias node on the row of the component that adds it (the layout's names, ``attribution/layout.py``: a layer's
``attn_norm`` / ``lorsa`` / ``attn`` biases on its attention row, 0.45 below its MLP row; ``mlp_norm`` /
``transcoder`` on the MLP row; ``final_norm`` / ``lm_head`` on the logits row), read back from the figure's scatter
offsets against :func:`test_probe_viz_pictures.ref_cell` on drawn graphs given the layout's bias names; and the PNG
written atomically: an error while rendering or writing leaves the previous file (or none), never a torn one.
"""

from __future__ import annotations

import math
import os
import warnings

import matplotlib.figure
import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_probe_export_dashboards import THRESHOLDS, graphs
from test_probe_viz_pictures import HC, check_plot, finite_graph, ref_cell

from nnsight_lorsa import _atomic
from nnsight_lorsa.attribution import prune, to_neuronpedia
from nnsight_lorsa.attribution.graph import BIAS, EMBEDDING, LOGIT, Graph, NodeTable
from nnsight_lorsa.viz import plot_graph

#: what the layout names a layer's biases (attribution/layout.py), and whether the attention side adds it
LAYER_BIASES = [("attn_norm.bias", True), ("lorsa.b_V", True), ("lorsa.b_D", True), ("attn.b_V", True),
                ("attn.b_O", True), ("mlp_norm.bias", False), ("transcoder.b_dec", False), ("transcoder.b_enc", False)]


@st.composite
def named_graphs(draw):
    """A drawn graph whose bias nodes carry the names the layout gives them (a layer's, or the top's at the logits'
    layer)."""
    g = draw(graphs())
    n_layers = int(g.nodes.layer[g.logit_ids].max())
    names = []
    for i in (g.nodes.kind == BIAS).nonzero().flatten().tolist():
        layer = int(g.nodes.layer[i])
        if layer >= n_layers:
            names.append(draw(st.sampled_from(["final_norm.bias", "lm_head.bias"])))
        else:
            names.append(f"L{layer}." + draw(st.sampled_from([n for n, _ in LAYER_BIASES])))
    n = g.nodes
    nodes = NodeTable(n.kind, n.layer, n.pos, n.index, n.activation, names, n.intervened)
    return Graph(tokens=g.tokens, nodes=nodes, adjacency=g.adjacency, values=g.values, logit_probs=g.logit_probs,
                 feature_rows=g.feature_rows, layout_ids=g.layout_ids, meta=g.meta)


def bias_rows(g: Graph, pr) -> tuple[list[float], list[float]]:
    """(drawn, wanted) sorted y of the kept bias nodes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fig = plot_graph(g, pr)
    try:
        n_layers = int(g.nodes.layer[g.logit_ids].max())
        keep = [i for i in pr.node_mask.nonzero().flatten().tolist() if int(g.nodes.kind[i]) == BIAS]
        want = sorted(ref_cell(g, i, n_layers)[1] for i in keep)
        pts = [np.asarray(c.get_offsets()) for c in fig.axes[0].collections if c.get_label().startswith("bias (")]
        got = sorted(round(float(y), 5) for p in pts for _, y in p)
        return got, want
    finally:
        plt.close(fig)


def test_attention_side_biases_are_on_the_attention_row():
    """One bias of every name on a two-layer graph: the attention side's 0.45 below the MLP row (all were drawn on
    the MLP row: seen failing), the MLP side's on it, the top's on the logits row."""
    names = [f"L1.{n}" for n, _ in LAYER_BIASES] + ["final_norm.bias", "lm_head.bias"]
    layers = [1] * len(LAYER_BIASES) + [2, 2]
    kinds = [BIAS] * len(names) + [LOGIT]  # the biases, then one logit
    n = len(kinds)
    nodes = NodeTable(torch.tensor(kinds), torch.tensor(layers + [2]), torch.tensor([-1] * len(names) + [0]),
                      torch.tensor(list(range(len(names))) + [3]), torch.zeros(n), names)
    A = torch.zeros(n, n)
    A[-1, : len(names)] = torch.arange(1, len(names) + 1, dtype=torch.float32)
    g = Graph(tokens=torch.tensor([3]), nodes=nodes, adjacency=A, values=torch.full((n,), float("nan")),
              logit_probs=torch.tensor([1.0]), feature_rows=torch.tensor([False] * len(names) + [True]),
              layout_ids=torch.arange(n))
    got, want = bias_rows(g, prune(g, node_threshold=1.0, edge_threshold=1.0))
    attn = sum(a for _, a in LAYER_BIASES)
    assert want == sorted([0.55] * attn + [1.0] * (len(LAYER_BIASES) - attn) + [2.0, 2.0])
    assert got == want


def test_the_bias_column_has_its_tick_label():
    """The bias nodes sit in a column right of the last position (``len(tokens) + 0.5``), which had no tick label;
    it is labelled ``bias`` where a bias node is drawn, and only there."""
    names = ["L0.attn.o_proj.bias", "L0.mlp.down_proj.bias"]
    nodes = NodeTable(torch.tensor([BIAS, BIAS, LOGIT]), torch.tensor([0, 0, 1]), torch.tensor([-1, -1, 0]),
                      torch.tensor([0, 1, 3]), torch.zeros(3), names)
    A = torch.zeros(3, 3)
    A[-1, :2] = torch.tensor([1.0, 2.0])
    g = Graph(tokens=torch.tensor([3, 4]), nodes=nodes, adjacency=A, values=torch.full((3,), float("nan")),
              logit_probs=torch.tensor([1.0]), feature_rows=torch.tensor([False, False, True]),
              layout_ids=torch.arange(3))
    without = Graph(tokens=torch.tensor([3, 4]), nodes=NodeTable(
        torch.tensor([EMBEDDING, LOGIT]), torch.tensor([0, 1]), torch.tensor([1, 0]), torch.tensor([0, 3]),
        torch.zeros(2), ["emb", "logit"]), adjacency=torch.tensor([[0.0, 0.0], [1.0, 0.0]]),
        values=torch.full((2,), float("nan")), logit_probs=torch.tensor([1.0]),
        feature_rows=torch.tensor([False, True]), layout_ids=torch.arange(2))
    for graph, want in ((g, True), (without, False)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fig = plot_graph(graph, prune(graph, node_threshold=1.0, edge_threshold=1.0), tokens=["a", "b"])
        try:
            ax = fig.axes[0]
            ticks = dict(zip(ax.get_xticks().tolist(), [t.get_text() for t in ax.get_xticklabels()], strict=True))
            assert (ticks.get(2.5) == "bias") is want and ticks[0.0] == "a" and ticks[1.0] == "b", ticks
        finally:
            plt.close(fig)


@settings(max_examples=15, deadline=None, suppress_health_check=HC)
@given(g=named_graphs(), nt=THRESHOLDS, et=THRESHOLDS, max_edges=st.sampled_from([0, 3, 400]))
def test_plot_graph_puts_each_bias_on_its_components_row(g, nt, et, max_edges):
    """Drawn graphs with the layout's bias names: every node in its cell, every edge from and to its nodes' cells
    (the pictures probe's reference, which reads the bias names)."""
    if not finite_graph(g):
        return
    check_plot(g, prune(g, node_threshold=nt, edge_threshold=et), max_edges)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=HC)
@given(g=named_graphs(), nt=THRESHOLDS, et=THRESHOLDS, max_edges=st.sampled_from([0, 1, 3, 7, 400]))
def test_plot_graph_puts_each_bias_on_its_components_row_sweep(g, nt, et, max_edges):
    if not finite_graph(g):
        return
    check_plot(g, prune(g, node_threshold=nt, edge_threshold=et), max_edges)


# ----------------------------------------------------------------------------- the file
def small_graph() -> tuple[Graph, object]:
    names = ["L0.lorsa.b_D"]
    nodes = NodeTable(torch.tensor([BIAS, LOGIT]), torch.tensor([0, 1]), torch.tensor([-1, 0]), torch.tensor([0, 2]),
                      torch.zeros(2), names)
    A = torch.tensor([[0.0, 0.0], [1.5, 0.0]])
    g = Graph(tokens=torch.tensor([2]), nodes=nodes, adjacency=A, values=torch.tensor([float("nan"), 1.5]),
              logit_probs=torch.tensor([1.0]), feature_rows=torch.tensor([False, True]), layout_ids=torch.arange(2))
    return g, prune(g, node_threshold=1.0, edge_threshold=1.0)


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != "graph.png")


def test_plot_graph_writes_its_png_atomically(tmp_path, monkeypatch):
    """An error while the figure is rendered into the file, or between writing and renaming it, leaves the previous
    PNG byte for byte (or no file) and no temporary: ``savefig(path)`` wrote the file in place (a torn PNG where
    the old one was: seen failing)."""
    g, pr = small_graph()
    path = tmp_path / "graph.png"
    plt.close(plot_graph(g, pr, path=path))
    old = path.read_bytes()
    assert old.startswith(b"\x89PNG")
    real = matplotlib.figure.Figure.savefig

    def torn(self, fname, *args, **kwargs):  # writes half a picture where it is told, then fails
        if isinstance(fname, (str, os.PathLike)):
            with open(fname, "wb") as f:
                f.write(old[: len(old) // 2])
        else:
            fname.write(b"\x89PNG half")
        raise OSError("disk full")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", torn)
    with pytest.raises(OSError, match="disk full"):
        plot_graph(g, pr, path=path, title="new")
    plt.close("all")
    assert path.read_bytes() == old and leftovers(tmp_path) == []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", real)

    def crash(event):  # the process stops after the temporary is written, before it is renamed over the PNG
        if event.startswith("file:"):
            raise KeyboardInterrupt

    monkeypatch.setattr(_atomic, "_boundary", crash)
    with pytest.raises(KeyboardInterrupt):
        plot_graph(g, pr, path=path, title="new")
    plt.close("all")
    assert path.read_bytes() == old and leftovers(tmp_path) == []
    fresh = tmp_path / "sub" / "fresh.png"
    with pytest.raises(KeyboardInterrupt):
        plot_graph(g, pr, path=fresh)
    plt.close("all")
    assert not fresh.exists() and list(fresh.parent.iterdir()) == []
    monkeypatch.setattr(_atomic, "_boundary", lambda event: None)
    plt.close(plot_graph(g, pr, path=path, title="new"))
    assert path.read_bytes() != old and path.read_bytes().startswith(b"\x89PNG") and leftovers(tmp_path) == ["sub"]


# ----------------------------------------------------------------------------- the viewer's panel
def _num(text: str) -> float | None:
    return None if text == "\u2013" else float(text)


def check_panel(g: Graph, pr, node: int, path) -> None:
    """The panel of node ``node`` opened on load (``clicked=``): its kind, layer, position and activation, and its
    strongest 10 incoming and outgoing links' weights (4 significant digits), against the Graph's own tensors."""
    from helpers import render_dom
    from test_probe_viz_pictures import _Dom

    from nnsight_lorsa.attribution.export import node_ids
    from nnsight_lorsa.attribution.graph import ATTN_ERROR, EMBEDDING, KIND_NAMES, LORSA, MLP_ERROR, TRANSCODER
    from nnsight_lorsa.viz import render_html

    ids = node_ids(g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        render_html(g, pr, path=path, clicked=ids[node])
    dom = _Dom(render_dom(path))
    props = {d["class"][len("prop-"):]: d["_text"] for d in dom.items if d.get("class", "").startswith("prop-")}
    k, layer, pos = int(g.nodes.kind[node]), int(g.nodes.layer[node]), int(g.nodes.pos[node])
    n_layers = int(g.nodes.layer[g.logit_ids].max())
    assert props["node_id"] == ids[node] and props["type"] == KIND_NAMES[k]
    assert props["layer"] == ("E" if k == EMBEDDING else str(n_layers + 1) if k == LOGIT else str(min(layer, n_layers)))
    assert props["position"].split(" ")[0] == str(0 if k == BIAS else pos)
    act = float(g.nodes.activation[node])
    shown = _num(props["activation"])
    if k in (TRANSCODER, LORSA, MLP_ERROR, ATTN_ERROR) and math.isfinite(act):
        assert shown is not None and abs(shown - act) <= 5e-4 * abs(act) + 1e-30, (shown, act)
    else:
        assert shown is None
    # the links: the kept edges between kept nodes, into / out of this node, 10 of largest |weight|
    keep = pr.node_mask
    t, s = pr.edge_index
    kept = keep[t] & keep[s]
    t, s = t[kept], s[kept]
    w = g.adjacency[t, s].double()
    tables = [d for d in dom.items if d["_tag"] == "table" and d.get("class") == "edges"]
    cells = [d for d in dom.items if d["_tag"] == "td" and d.get("class") == "num"]
    heads = [d["_text"] for d in dom.items if d["_tag"] == "h3"]
    assert heads[:2] == ["Incoming", "Outgoing"]
    got = [_num(c["_text"]) for c in cells]
    want = []
    for side in (t, s):
        ws = sorted(w[side == node].tolist(), key=abs, reverse=True)[:10]
        want += ws
    assert len(tables) == 2 and len(got) == len(want), (got, want)
    for a, b in zip(got, want, strict=True):
        assert abs(a - b) <= 5e-4 * abs(b) + 1e-30, (got, want)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=HC)
@given(g=named_graphs(), nt=THRESHOLDS, et=THRESHOLDS, pick=st.integers(0, 10**6))
def test_viewer_panel_shows_the_graphs_node_and_links_sweep(tmp_path_factory, g, nt, et, pick):
    from helpers import require_chromium

    from nnsight_lorsa.attribution.export import node_ids

    require_chromium()
    if not finite_graph(g):
        return
    pr = prune(g, node_threshold=nt, edge_threshold=et)
    ids = node_ids(g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shown = {n["node_id"] for n in to_neuronpedia(g, pr, slug="x")["nodes"]}  # kept and linked (or emb / logit)
    unique = [i for i in range(g.n_nodes) if ids[i] in shown and ids.count(ids[i]) == 1]
    if not unique:
        return
    check_panel(g, pr, unique[pick % len(unique)], tmp_path_factory.mktemp("panel") / "g.html")
