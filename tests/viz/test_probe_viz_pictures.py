"""Pictures probe: what ``plot_graph``, the figures (``plot_z_pattern``, ``plot_operand_grid``, ``plot_heads_spanned``)
and the graph viewer's page draw, read back from the matplotlib artists (``fig.axes[0].collections / lines / images``)
and from the viewer's DOM after its script ran (headless Chromium), against references written here from the
documented layout (``viz/graph_plot.py``'s and ``viz/graph_viewer.py``'s module docstrings, the functions' docstrings).

Graphs: the hypothesis-drawn graphs of the export probe (every node kind, shared indices, 1-token prompts) and a real
graph of the tiny Llama; a graph with one crowded cell; z-patterns of the tiny Llama's Lorsa (fp32 / bf16).
``-m slow``: more drawn graphs, and the viewer with 160,800 links and a 400 × 400 heatmap.
"""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from helpers import attribution_setup, random_ids, render_dom, require_chromium, rm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_probe_export_dashboards import THRESHOLDS, graphs

from nnsight_lorsa.attribution import attribute, prune, to_neuronpedia
from nnsight_lorsa.attribution.export import node_ids
from nnsight_lorsa.attribution.graph import (
    ATTN_ERROR,
    BIAS,
    EMBEDDING,
    LOGIT,
    LORSA,
    MLP_ERROR,
    TRANSCODER,
    Graph,
    NodeTable,
)
from nnsight_lorsa.envoy.read import attention_activations
from nnsight_lorsa.errors import ArgumentError, NonFiniteError
from nnsight_lorsa.viz import figures, plot_graph, render_html
from nnsight_lorsa.viz.graph_viewer import normalize_details

HC = [HealthCheck.too_slow, HealthCheck.filter_too_much]
#: the legend label of each kind in plot_graph (the documented colours / markers' names)
PLOT_LABEL = {TRANSCODER: "transcoder feature", LORSA: "Lorsa head", MLP_ERROR: "MLP error", ATTN_ERROR: "Lorsa error",
              EMBEDDING: "embedding", BIAS: "bias", LOGIT: "logit"}


def finite_graph(g: Graph) -> bool:
    return bool(torch.isfinite(g.adjacency).all()) and bool(torch.isfinite(g.logit_probs).all())


# ----------------------------------------------------------------------------- plot_graph
def ref_cell(g: Graph, i: int, n_layers: int) -> tuple[float, float]:
    """The documented place of node ``i``: x = its position (biases: one column right of the last), y = its layer
    (embeddings -1, logits n_layers, a layer's Lorsa heads, Lorsa errors and attention-side biases — named
    ``L<l>.attn_norm.bias``, ``L<l>.lorsa.*``, ``L<l>.attn.*`` by the layout — 0.45 below its MLP's nodes)."""
    k, layer, pos = int(g.nodes.kind[i]), int(g.nodes.layer[i]), int(g.nodes.pos[i])
    x = len(g.tokens) + 0.5 if k == BIAS else float(pos)
    attn = k in (LORSA, ATTN_ERROR) or k == BIAS and g.nodes.bias_names[int(g.nodes.index[i])].split(".")[1:2] in (
        ["attn_norm"], ["lorsa"], ["attn"])
    y = {EMBEDDING: -1.0, LOGIT: float(n_layers)}.get(k, layer - 0.45 if attn else float(layer))
    return x, round(y, 5)


def check_plot(g: Graph, pr, max_edges: int, tokens: list[str] | None = None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fig = plot_graph(g, pr, max_edges=max_edges, tokens=tokens)
    try:
        ax = fig.axes[0]
        n_layers = int(g.nodes.layer[g.logit_ids].max())
        keep = pr.node_mask.nonzero().flatten().tolist()
        # nodes: one scatter per kind, its points in the kept nodes' cells (spread at most 0.3 within a cell)
        drawn: dict[str, np.ndarray] = {c.get_label(): np.asarray(c.get_offsets()) for c in ax.collections}
        seen_cells: Counter = Counter()
        point_cell: dict[tuple[float, float], tuple[float, float]] = {}
        for kind, name in PLOT_LABEL.items():
            want = Counter(ref_cell(g, i, n_layers) for i in keep if int(g.nodes.kind[i]) == kind)
            label = f"{name} ({sum(want.values())})"
            if not want:
                assert not any(k.startswith(name + " (") for k in drawn), (name, list(drawn))
                continue
            pts = drawn[label]
            got: Counter = Counter()
            for x, y in pts:
                cx = len(g.tokens) + 0.5 if kind == BIAS else float(round(x))
                assert abs(x - cx) <= 0.3 + 1e-6, (name, x, y)
                cell = (cx, round(float(y), 5))
                got[cell] += 1
                point_cell[(round(float(x), 6), round(float(y), 6))] = cell
            assert got == want, (name, got, want)
            seen_cells += got
        all_pts = np.concatenate(list(drawn.values())) if drawn else np.zeros((0, 2))
        assert len({(round(float(x), 6), round(float(y), 6)) for x, y in all_pts}) == len(all_pts), "nodes overlap"
        # edges: the kept edges of largest |weight|, from source to target, blue / red by sign, width and opacity
        # linear in |weight| / max |weight|
        t, s = pr.edge_index
        w = g.adjacency[t, s].double()
        n_draw = min(max_edges, len(w))
        assert len(ax.lines) == n_draw
        if n_draw:
            top = w.abs().sort(descending=True).values
            wmax = float(top[0])
            assert sorted((round(x.get_linewidth(), 5) for x in ax.lines), reverse=True) == [
                round(0.3 + 2.5 * float(x) / wmax, 5) for x in top[:n_draw]]
            want_edges = Counter()
            for i in w.abs().argsort(descending=True)[:n_draw].tolist():
                a, b = ref_cell(g, int(s[i]), n_layers), ref_cell(g, int(t[i]), n_layers)
                frac = abs(float(w[i])) / wmax
                want_edges[(a, b, "tab:blue" if w[i] > 0 else "tab:red", round(0.3 + 2.5 * frac, 5),
                            round(0.15 + 0.6 * frac, 5))] += 1
            got_edges = Counter()
            tie = n_draw < len(w) and top[n_draw - 1] == top[n_draw]  # which of equal edges is drawn: either
            for line in [] if tie else ax.lines:
                xs, ys = line.get_xdata(), line.get_ydata()
                a = point_cell[(round(float(xs[0]), 6), round(float(ys[0]), 6))]
                b = point_cell[(round(float(xs[1]), 6), round(float(ys[1]), 6))]
                got_edges[(a, b, line.get_color(), round(line.get_linewidth(), 5), round(line.get_alpha(), 5))] += 1
            assert tie or got_edges == want_edges
        # the title: nodes, kept edges, and how many are drawn when capped; the axes' labels
        title = ax.get_title()
        assert f"{len(keep)} nodes, {len(w)} edges" in title, title
        assert (str(n_draw) in title.split("edges", 1)[1]) == (n_draw < len(w)), title
        labels = tokens if tokens is not None else [str(int(i)) for i in g.tokens]
        bias = any(int(g.nodes.kind[i]) == BIAS for i in keep)  # the bias column's label, where one is drawn
        assert [x.get_text() for x in ax.get_xticklabels()] == [repr(x)[1:-1] for x in labels] + ["bias"] * bias
        assert list(ax.get_xticks()) == list(range(len(g.tokens))) + [len(g.tokens) + 0.5] * bias
        assert [x.get_text() for x in ax.get_yticklabels()] == ["emb", *[f"L{i}" for i in range(n_layers)], "logit"]
        assert list(ax.get_yticks()) == list(range(-1, n_layers + 1))
    finally:
        plt.close(fig)


@settings(max_examples=25, deadline=None, suppress_health_check=HC)
@given(g=graphs(), nt=THRESHOLDS, et=THRESHOLDS, max_edges=st.sampled_from([0, 1, 3, 400]))
def test_plot_graph_draws_the_pruned_graph(g, nt, et, max_edges):
    """Every kept node in its cell, every drawn edge the strongest kept ones with sign colour and |w| width; the title
    says how many of the kept edges are drawn (it said all were while ``max_edges`` cut them: seen failing)."""
    if not finite_graph(g):
        return
    check_plot(g, prune(g, node_threshold=nt, edge_threshold=et), max_edges)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=HC)
@given(g=graphs(max_layers=4, max_pos=6), nt=THRESHOLDS, et=THRESHOLDS, max_edges=st.sampled_from([0, 1, 3, 7, 400]))
def test_plot_graph_draws_the_pruned_graph_sweep(g, nt, et, max_edges):
    if not finite_graph(g):
        return
    check_plot(g, prune(g, node_threshold=nt, edge_threshold=et), max_edges)


def test_plot_graph_refuses_what_it_cannot_draw_right():
    """Token labels not one per position, another graph's pruning, a negative or non-int ``max_edges`` (``-1`` drew
    all but the weakest edge), a NaN / inf kept edge: named errors (seen failing: silent, IndexError, ZeroDivision,
    matplotlib's ValueError)."""
    g, other = crowded_graph(3, tokens=(5, 6, 7)), crowded_graph(5)
    pr = prune(g)
    for tokens in (["a"], list("abcdef")):
        with pytest.raises(ArgumentError, match="token labels"):
            plot_graph(g, pr, tokens=tokens)
    with pytest.raises(ArgumentError, match="PruneResult"):
        plot_graph(g, prune(other))
    with pytest.raises(ArgumentError, match="PruneResult"):
        plot_graph(other, pr)
    for bad in (-1, True):  # (a float is the type checker's in the tests; ArgumentError without it)
        with pytest.raises(ArgumentError, match="max_edges"):
            plot_graph(g, pr, max_edges=bad)
    t, s = pr.edge_index
    for value in (float("nan"), float("inf")):
        A = g.adjacency.clone()
        A[t[0], s[0]] = value
        bad_g = Graph(tokens=g.tokens, nodes=g.nodes, adjacency=A, values=g.values, logit_probs=g.logit_probs,
                      feature_rows=g.feature_rows, layout_ids=g.layout_ids)
        with pytest.raises(NonFiniteError, match="kept edge") as e:
            plot_graph(bad_g, pr)
        assert e.value.tensor == "edges"
    plt.close("all")


@pytest.fixture(scope="module")
def llama():
    model, _, lorsas, tcs = attribution_setup("llama")
    return model, rm(model, lorsas, tcs), lorsas


@pytest.fixture(scope="module")
def real_graph(llama):
    model, r, _ = llama
    g = attribute(r, random_ids(1, 6, seed=5)[0], batch_size=64)
    return g


def test_plot_graph_of_a_real_graph(llama, real_graph):
    """The tiny Llama's graph (Lorsa at layer 1, transcoders at 0 and 2, biases, kept as causal blocks): the same
    checks, with its tokenizer's per-token decodes as labels."""
    model, _, _ = llama
    g = real_graph
    tokens = [model.tokenizer.decode([int(i)]) for i in g.tokens]
    for nt, et, cap in ((0.8, 0.98, 400), (1.0, 1.0, 25)):
        pr = prune(g, node_threshold=nt, edge_threshold=et)
        dense = Graph(tokens=g.tokens, nodes=g.nodes, adjacency=g.edge_values(
            torch.arange(g.n_nodes)[:, None], torch.arange(g.n_nodes)[None, :]), values=g.values,
            logit_probs=g.logit_probs, feature_rows=g.feature_rows, layout_ids=g.layout_ids)
        check_plot(dense, pr, cap, tokens=tokens)


# ----------------------------------------------------------------------------- figures
class _Capture:
    """The figures' ``_save`` replaced: keep the figure to read its artists (no PNG written)."""

    def __init__(self, monkeypatch):
        self.figs: list = []
        monkeypatch.setattr(figures, "_save", lambda fig, path: (self.figs.append(fig), Path(path))[1])

    @property
    def ax(self):
        return self.figs[-1].axes[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_z_pattern_figure_is_the_lorsas_z_pattern(llama, monkeypatch, dtype):
    """A real z-pattern (the tiny Llama's Lorsa, fp32 and bf16): the image is zp (query rows, key columns) below the
    diagonal, the masked cells above it grey (not 0: they were drawn as zero contributions), the scale symmetric and
    holding the largest |value| (no clipping), the tokens on both axes."""
    model, _, lorsas = llama
    cap = _Capture(monkeypatch)
    ids = random_ids(1, 7, seed=2)[0]
    act = attention_activations(model, 1, ids[None])
    lorsa = lorsas[1].to(dtype)
    try:
        zp = lorsa.z_pattern(act.x.to(dtype), [3], act.positions)[0, 0].detach()
    finally:
        lorsas[1].float()
    tokens = [model.tokenizer.decode([int(i)]) for i in ids]
    figures.plot_z_pattern(zp, tokens, "unused.png")
    img = cap.ax.images[0]
    shown = np.ma.filled(img.get_array().astype(np.float64), np.nan)
    want = zp.float().numpy().astype(np.float64)
    lower = np.tril(np.ones_like(want, dtype=bool))
    assert np.array_equal(shown[lower], want[lower])
    assert np.isnan(shown[~lower]).all()
    assert tuple(img.get_cmap().get_bad()[:3]) != tuple(img.get_cmap()(0.5)[:3])  # masked: not the colour of 0
    m = float(np.abs(want).max())
    assert img.get_clim() == (-m, m)
    assert [t.get_text() for t in cap.ax.get_xticklabels()] == [t.replace("\n", "⏎") for t in tokens]
    assert [t.get_text() for t in cap.ax.get_yticklabels()] == [t.replace("\n", "⏎") for t in tokens]
    assert (cap.ax.get_xlabel(), cap.ax.get_ylabel()) == ("key", "query")
    # the transposed pattern (keys as rows) is refused, not drawn with its axes swapped
    if bool((zp.float().tril(-1) != 0).any()):
        with pytest.raises(ArgumentError, match="transposed"):
            figures.plot_z_pattern(zp.T, tokens, "unused.png")
    plt.close("all")


@pytest.mark.parametrize("bad, err, match", [
    (torch.tensor([[1.0, 0.0], [float("nan"), 1.0]]), NonFiniteError, r"zp\[1, 0\]"),
    (torch.tensor([[1.0, 0.0], [float("inf"), 1.0]]), NonFiniteError, r"zp\[1, 0\]"),
    (torch.ones(3, 3).tril(), ArgumentError, "does not fit 2 tokens"),
    (torch.ones(2), ArgumentError, "2-D"),
    (torch.ones(2, 2), ArgumentError, "transposed"),
], ids=["nan", "inf", "size", "1-D", "not causal"])
def test_z_pattern_figure_refuses_what_it_would_draw_wrong(monkeypatch, bad, err, match):
    """NaN / inf (a broken scale), a size that does not fit the tokens (labels on the wrong cells), values above the
    diagonal: named errors (seen failing: drawn silently, or matplotlib's TypeError)."""
    _Capture(monkeypatch)
    with pytest.raises(err, match=match):
        figures.plot_z_pattern(bad, ["a", "b"], "unused.png")
    with pytest.raises(ArgumentError, match="2-D"):
        figures.plot_z_pattern(torch.zeros(0, 0), [], "unused.png")


def _cell_centres(img, n: int) -> tuple[list[float], list[float]]:
    left, right, bottom, top = img.get_extent()
    return ([left + (right - left) * (j + 0.5) / n for j in range(n)],
            [top + (bottom - top) * (i + 0.5) / n for i in range(n)])


@settings(max_examples=30, deadline=None, suppress_health_check=HC)
@given(ops=st.one_of(
    st.builds(lambda a, d, n: list(range(a, a + d * n, d)), st.integers(-5, 50), st.integers(1, 7), st.integers(1, 9)),
    st.builds(lambda a, n: list(range(a + n - 1, a - 1, -1)), st.integers(0, 50), st.integers(2, 9)),
    st.lists(st.integers(0, 200), min_size=2, max_size=9, unique=True)),
    signed=st.booleans(), nan=st.booleans(), seed=st.integers(0, 2**16))
def test_operand_grid_axes_read_the_operands(ops, signed, nan, seed):
    """Cell (i, j) of ``grid[op1, op2]`` is read at op1 = ops[i], op2 = ops[j]: evenly spaced operands (either order)
    as the axes' values, other ones as the tick labels of their cells (they were placed as if consecutive and
    ascending: ``[3, 7, 12]`` read 4.2, 7.5, 10.8; ``range(4, -1, -1)`` put op 4 where the axis says 0). A signed grid
    on a scale symmetric about 0; NaN cells blank; the largest value inside the scale (seen failing)."""
    n = len(ops)
    g = torch.from_numpy(np.random.default_rng(seed).uniform(0.1, 5, (n, n))).float()
    if signed:
        g[0, n - 1] = -float(g.max()) * 1.5
    if nan and n > 1:
        g[1, 0] = float("nan")
    import matplotlib

    with pytest.MonkeyPatch.context() as mp:
        cap = _Capture(mp)
        figures.plot_operand_grid(g, "unused.png", operands=ops)
    ax, img = cap.ax, cap.ax.images[0]
    shown = np.ma.filled(img.get_array().astype(np.float64), np.nan)
    assert np.array_equal(shown, g.numpy().astype(np.float64), equal_nan=True)
    xs, ys = _cell_centres(img, n)
    steps = {b - a for a, b in zip(ops, ops[1:], strict=False)}
    if len(steps) <= 1:  # the axes are the operand values
        assert np.allclose(xs, ops) and np.allclose(ys, ops), (ops, xs, ys)
    else:  # tick labels name the operands of the cells they sit on
        for axis, centres in ((ax.xaxis, xs), (ax.yaxis, ys)):
            ticks = axis.get_ticklocs()
            texts = [t.get_text() for t in axis.get_ticklabels()]
            assert len(ticks) >= 2
            for at, text in zip(ticks, texts, strict=True):
                k = int(np.argmin([abs(c - at) for c in centres]))
                assert abs(centres[k] - at) < 1e-9 and text == str(ops[k]), (ops, at, text)
    lo, hi = img.get_clim()
    finite = g[torch.isfinite(g)]
    assert lo <= float(finite.min()) and hi >= float(finite.max())
    if signed:
        assert lo == -hi and img.get_cmap().name.startswith("RdBu")
    assert isinstance(img.get_cmap(), matplotlib.colors.Colormap)
    plt.close("all")


def test_operand_grid_refuses_misfits(monkeypatch):
    _Capture(monkeypatch)
    with pytest.raises(ArgumentError, match="3 operands"):
        figures.plot_operand_grid(torch.rand(4, 4), "unused.png", operands=range(3))
    with pytest.raises(NonFiniteError, match=r"grid\[0, 1\]"):
        figures.plot_operand_grid(torch.tensor([[1.0, float("inf")], [0.0, 1.0]]), "unused.png")
    with pytest.raises(ArgumentError, match="2-D"):
        figures.plot_operand_grid(torch.rand(4), "unused.png")


@settings(max_examples=30, deadline=None)
@given(counts=st.lists(st.integers(-1, 12), min_size=0, max_size=40),
       dtype=st.sampled_from([torch.long, torch.float32]))
def test_heads_spanned_bars_are_the_fractions_of_active_heads(counts, dtype):
    """Bar k = the share of active Lorsa heads with a defined n (n > 0) spanning k MHSA heads; -1 (undefined) is
    dropped and counted in the title; a float 1.7 was truncated into bar 1 and a negative count dropped: now refused
    (seen failing). Only the counts that occur are drawn (a count of 10**6 drew a million bars: 444 s)."""
    with pytest.MonkeyPatch.context() as mp:
        cap = _Capture(mp)
        figures.plot_heads_spanned(torch.tensor(counts, dtype=dtype), "unused.png")
        active = [c for c in counts if c > 0]
        bars = {round(p.get_x() + p.get_width() / 2): p.get_height() for p in cap.ax.patches}
        assert set(bars) == set(active)  # a bar per count that occurs (a bar of height 0 draws nothing)
        for k, h in bars.items():
            assert math.isclose(h, active.count(k) / len(active), rel_tol=1e-6)
        low, high = cap.ax.get_xlim()  # the axis spans every count from 1 to the largest
        assert low < 1 and high > max(active, default=0)
        if -1 in counts:
            assert f"({counts.count(-1)} undefined, dropped)" in cap.ax.get_title()
        for bad in (1.7, -2.0, float("nan")):
            with pytest.raises(ArgumentError, match="no count"):
                figures.plot_heads_spanned(torch.tensor([*counts, bad]), "unused.png")
    plt.close("all")


# ----------------------------------------------------------------------------- the viewer's page
class _Dom(HTMLParser):
    """The SVG's circles, lines and texts, and the panel's cells, as attribute dicts (``_text``: text content)."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.items: list[dict] = []
        self._cur: dict | None = None
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        d = dict(attrs, _tag=tag, _text="")
        self.items.append(d)
        self._cur = d

    def handle_data(self, data):
        if self._cur is not None:
            self._cur["_text"] += data

    def handle_endtag(self, tag):
        self._cur = None

    def of(self, tag: str, cls: str | None = None) -> list[dict]:
        return [d for d in self.items if d["_tag"] == tag and (cls is None or d.get("class") == cls)]


def _show(s: str) -> str:
    return s.replace("\n", "\u23ce").replace("\t", "\u21e5")


def check_viewer(g: Graph, pr, path, tokenizer=None) -> _Dom:
    """The page of ``render_html(g, pr)`` after its script: one circle per exported node in its token's column and its
    layer's row (rows ordered emb, L0 attn, L0 mlp, …, logits from the bottom; the rows' node bands disjoint), one
    line per link from source to target, green / red by sign, width 0.3 + 4 |w| / max |w|."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        data = to_neuronpedia(g, pr, slug="x", tokenizer=tokenizer)
        render_html(g, pr, path=path, tokenizer=tokenizer)
    nodes = {n["node_id"]: n for n in data["nodes"]}
    assert len(nodes) == len(data["nodes"]), "documented layer-0 id collision: not drawn by this check"
    dom = _Dom(render_dom(path))
    assert any(d.get("data-ready") == "1" for d in dom.of("body")), "the page's script did not finish"
    circles = {c["data-node-id"]: c for c in dom.of("circle")}
    assert set(circles) == set(nodes)
    xy = {k: (float(c["cx"]), float(c["cy"])) for k, c in circles.items()}
    n_layers = int(next(n["layer"] for n in nodes.values() if n["feature_type"] == "logit")) - 1
    has_bias = any(n["feature_type"] == "bias" for n in nodes.values())

    def row_of(n: dict) -> str:
        ft, layer = n["feature_type"], n["layer"]
        if ft == "embedding":
            return "emb"
        if ft == "logit":
            return "logits"
        if ft == "bias" and int(layer) == n_layers:
            return "final"
        attn = ft in ("lorsa", "lorsa error") or ft == "bias" and not re.search(r"\.(mlp|transcoder)", n["clerp"])
        return f"L{int(layer)} {'attn' if attn else 'mlp'}"

    order = ["emb", *[f"L{L} {s}" for L in range(n_layers + 1) for s in ("attn", "mlp")], "final", "logits"]
    # rows: each row's nodes in a band of its own, the bands in layer order from the bottom, >= 2 radii apart
    band: dict[str, list[float]] = {}
    for nid, n in nodes.items():
        band.setdefault(row_of(n), []).append(xy[nid][1])
    rows = sorted(band, key=order.index)
    for lower, upper in zip(rows, rows[1:], strict=False):
        assert min(band[lower]) - max(band[upper]) >= 10, ("rows overlap", lower, upper, band[lower], band[upper])
    labels = {t["_text"]: t for t in dom.of("text", "axis")}
    assert sorted(labels, key=order.index) == rows
    for r in rows:  # each row's name at its nodes, inside the band the page declares for it
        y = float(labels[r]["y"]) - 4
        assert min(band[r]) - 1e-6 <= y <= max(band[r]) + 1e-6 or len(set(band[r])) > 1
        top, bottom = float(labels[r]["data-top"]), float(labels[r]["data-bottom"])
        assert all(top + 4.9 <= v <= bottom - 4.9 for v in band[r]), (r, top, bottom, band[r])
    # columns: the token labels in order (Σ bias first), each node between its column's boundaries
    tokens = [t for t in dom.of("text", "token")]
    want = (["\u03a3 bias"] if has_bias else []) + [_show(t) for t in (render_labels(g, data, tokenizer))]
    assert [t["_text"] for t in tokens] == want
    bounds = [float(v["x1"]) for v in dom.of("line", "col-line")]
    assert len(bounds) == len(tokens) - 1 and bounds == sorted(bounds)
    edges = [-math.inf, *bounds, math.inf]
    for c, t in enumerate(tokens):
        assert edges[c] < float(t["x"]) < edges[c + 1]
    for nid, n in nodes.items():
        c = 0 if n["feature_type"] == "bias" else n["ctx_idx"] + int(has_bias)
        assert edges[c] + 4.9 <= xy[nid][0] <= edges[c + 1] - 4.9, (nid, c, xy[nid], edges)
    # links
    weight = {(x["source"], x["target"]): x["weight"] for x in data["links"]}
    lines = dom.of("line", "link")
    assert len(lines) == len(weight)
    wmax = max((abs(w) for w in weight.values()), default=1.0)
    for e in lines:
        w = weight[(e["data-source"], e["data-target"])]
        assert e["stroke"] == ("#2ca02c" if w > 0 else "#d62728")
        assert abs(float(e["stroke-width"]) - (0.3 + 4 * abs(w) / wmax)) <= 6e-4
        assert (float(e["x1"]), float(e["y1"])) == xy[e["data-source"]]
        assert (float(e["x2"]), float(e["y2"])) == xy[e["data-target"]]
    return dom


def render_labels(g: Graph, data: dict, tokenizer) -> list[str]:
    """The viewer's x labels: circuit-tracer's per-token decodes, a character split over tokens shown whole on the
    token that completes it (its documented rule; here computed by decoding growing prefixes)."""
    raw = data["metadata"]["prompt_tokens"]
    if tokenizer is None:
        return raw
    ids = g.tokens.tolist()
    out, prev = [], ""
    for k in range(len(ids)):
        text = tokenizer.decode(ids[:k + 1])
        piece = "" if text.endswith("\ufffd") and k + 1 < len(ids) else text[len(prev):]
        if not text.endswith("\ufffd") or k + 1 == len(ids):
            prev = text
        out.append(piece if "\ufffd" in raw[k] else raw[k])
    return out


def crowded_graph(n_features: int, tokens=(5, 6)) -> Graph:
    """``n_features`` transcoder features of layer 0 in one cell (the last position), 3 Lorsa heads of layer 1 reading
    them all, one logit reading the heads."""
    F, G, P = n_features, 3, len(tokens)
    kind = [TRANSCODER] * F + [LORSA] * G + [MLP_ERROR] * 2 + [EMBEDDING] * P + [LOGIT]
    layer = [0] * F + [1] * G + [0, 1] + [-1] * P + [2]
    pos = [P - 1] * (F + G + 2) + list(range(P)) + [P - 1]
    index = list(range(1, F + 1)) + list(range(G)) + [-1, -1, *tokens, 7]
    n = len(kind)
    A = torch.zeros(n, n)
    A[F:F + G, :F] = torch.rand(G, F, generator=torch.Generator().manual_seed(0)) + 0.1
    A[:F, F + G + 2 + P - 1] = 1.0
    A[n - 1, F:F + G] = 1.0
    nodes = NodeTable(torch.tensor(kind), torch.tensor(layer), torch.tensor(pos), torch.tensor(index), torch.ones(n),
                      [], torch.zeros(n, dtype=torch.bool))
    rows = torch.zeros(n, dtype=torch.bool)
    rows[:F + G] = True
    rows[-1] = True
    values = torch.full((n,), float("nan"))
    values[rows] = A.sum(1)[rows]
    return Graph(tokens=torch.tensor(tokens), nodes=nodes, adjacency=A, values=values, logit_probs=torch.tensor([1.0]),
                 feature_rows=rows, layout_ids=torch.arange(n))


def test_viewer_keeps_a_crowded_cell_in_its_own_row(tmp_path):
    """60 features in one cell stack in 5 lines: the upper lines were drawn 12 px apart from the row's line up into the
    next layer's row (at most 3 lines fitted its 54 px), reading as layer 1 attention (seen failing). Rows now grow
    with their most stacked cell; columns carry boundaries."""
    require_chromium()
    g = crowded_graph(60)
    check_viewer(g, prune(g, node_threshold=1.0, edge_threshold=1.0), tmp_path / "crowded.html")


def test_viewer_draws_a_real_graph(llama, real_graph, tmp_path):
    require_chromium()
    model, _, _ = llama
    check_viewer(real_graph, prune(real_graph, node_threshold=0.9, edge_threshold=0.99), tmp_path / "real.html",
                 tokenizer=model.tokenizer)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=HC)
@given(g=graphs(max_layers=3, max_pos=4), nt=THRESHOLDS, et=THRESHOLDS)
def test_viewer_draws_drawn_graphs_sweep(tmp_path_factory, g, nt, et):
    require_chromium()
    if not finite_graph(g):
        return
    pr = prune(g, node_threshold=nt, edge_threshold=et)
    ids = [node_ids(g)[i] for i in pr.node_mask.nonzero().flatten().tolist()]
    if len(set(ids)) == len(ids):
        check_viewer(g, pr, tmp_path_factory.mktemp("drawn") / "g.html")


def _panel_page(tmp_path, details, name="panel.html") -> _Dom:
    g = crowded_graph(2)
    pr = prune(g, node_threshold=1.0, edge_threshold=1.0)
    nid = node_ids(g)[0]
    render_html(g, pr, details={nid: details}, clicked=nid, path=tmp_path / name)
    dom = _Dom(render_dom(tmp_path / name))
    assert any(d.get("data-ready") == "1" for d in dom.of("body"))
    return dom


def _rgba(style: str) -> tuple[str, float]:
    m = re.search(r"background:\s*rgba\((\d+),\s*(\d+),\s*(\d+),\s*([0-9.]+)\)", style)
    assert m is not None, style
    return ",".join(m.group(1, 2, 3)), float(m.group(4))


def test_viewer_panel_heatmap_and_contexts_show_their_numbers(tmp_path):
    """A signed heatmap (rows × columns as given: query × key) shaded blue / red by sign with alpha |v| / max |v|,
    NaN blank; a contexts table shaded 0.6 |a| / max |a|, a NaN activation shown as '–' (it raised json's ValueError
    before: seen failing)."""
    require_chromium()
    v = torch.tensor([[0.5, float("nan"), 0.0], [-2.0, 1.0, 0.25]])
    dom = _panel_page(tmp_path, [{"heatmap": v, "rows": ["q0", "q1"], "cols": ["k0", "k1", "k2"], "title": "zp"},
                                 {"contexts": [("alpha", 2.0), ("beta", -1.0), ("gamma", float("nan"))]}])
    heat = [d for d in dom.of("td") if d.get("title", "").count("\u2192") == 1]
    assert len(heat) == 6
    for d, (i, j) in zip(heat, [(i, j) for i in range(2) for j in range(3)], strict=True):
        x = float(v[i, j])
        assert d["title"].startswith(f"q{i} \u2192 k{j}: ")
        colour, alpha = _rgba(d["style"])
        assert colour == ("214,39,40" if x < 0 else "31,119,180")
        assert math.isclose(alpha, 0.0 if x != x else abs(x) / 2.0, abs_tol=6e-4)
    ctx = dom.of("td", "ctx")
    assert [c["_text"] for c in ctx] == ["alpha", "beta", "gamma"]
    assert [_rgba(c["style"])[1] for c in ctx] == [0.6, 0.3, 0.0]
    nums = [d["_text"] for d in dom.of("td", "num")][-3:]
    assert nums == ["2.000", "-1.000", "\u2013"]


@pytest.mark.parametrize("entry", [torch.tensor([[1.0, float("inf")]]),
                                   torch.tensor([[1.0, 1e300]], dtype=torch.float64),
                                   [("a", float("inf"))], {"contexts": [("a", -float("inf"))]}],
                         ids=["inf", "fp64-overflow", "contexts-inf", "contexts-dict-inf"])
def test_viewer_details_with_inf_are_named(entry):
    """An inf heatmap cell (or an fp64 one beyond fp32) or context activation: NonFiniteError naming the cell / row
    (it was json's bare ``ValueError: Out of range float values`` from the page's JSON: seen failing)."""
    with pytest.raises(NonFiniteError, match=r"values\[0, 1\]|row 0") as e:
        normalize_details({"n": entry})
    assert e.value.tensor in ("heatmap", "contexts")


@pytest.mark.slow
def test_viewer_draws_huge_graphs_and_heatmaps(tmp_path):
    """160,800 links and a 400 × 400 heatmap: the page's ``Math.max(...spread)`` threw RangeError past ~1e5 values —
    a blank graph, an empty panel (seen failing). Now every link and cell is drawn."""
    require_chromium()
    heat = torch.randn(400, 400)
    dom = _panel_page(tmp_path, {"heatmap": heat}, name="heat.html")
    assert len([d for d in dom.of("td") if d.get("title", "").count("\u2192") == 1]) == 160_000
    big = _big_graph(400)
    render_html(big, prune(big, 1.0, 1.0), path=tmp_path / "big.html")
    dom = _Dom(render_dom(tmp_path / "big.html", timeout=180))
    assert any(d.get("data-ready") == "1" for d in dom.of("body"))
    assert len(dom.of("line", "link")) == 160_800


def _big_graph(F: int) -> Graph:
    """F features at layer 0 feeding F features at layer 1 (F² links), one position."""
    kind = [TRANSCODER] * (2 * F) + [MLP_ERROR, MLP_ERROR, EMBEDDING, LOGIT]
    layer = [0] * F + [1] * F + [0, 1, -1, 2]
    index = list(range(F)) * 2 + [-1, -1, 5, 7]
    n = len(kind)
    A = torch.zeros(n, n)
    A[F:2 * F, :F] = torch.rand(F, F, generator=torch.Generator().manual_seed(1)) + 0.1
    A[:F, 2 * F + 2] = 1.0
    A[n - 1, F:2 * F] = 1.0
    nodes = NodeTable(torch.tensor(kind), torch.tensor(layer), torch.zeros(n, dtype=torch.long), torch.tensor(index),
                      torch.ones(n), [], torch.zeros(n, dtype=torch.bool))
    rows = torch.zeros(n, dtype=torch.bool)
    rows[:2 * F] = True
    rows[-1] = True
    values = torch.full((n,), float("nan"))
    values[rows] = A.sum(1)[rows]
    return Graph(tokens=torch.tensor([5]), nodes=nodes, adjacency=A, values=values, logit_probs=torch.tensor([1.0]),
                 feature_rows=rows, layout_ids=torch.arange(n))


def test_a_large_count_draws_one_bar_not_one_per_count_below_it():
    """``plot_heads_spanned`` of a count of 10**6 (a wrong ``n_spanned``, or a model with many heads) drew 10**6 bars,
    zero-height ones included: 444 s on 2 cores (found by tests/argument_value_cases.py's past-range value). Now one
    bar per count that occurs; the patches drawn are counted, not timed."""
    with pytest.MonkeyPatch.context() as mp:
        cap = _Capture(mp)
        figures.plot_heads_spanned(torch.tensor([1, 2, 10**6]), "unused.png")
        assert len(cap.ax.patches) == 3
    plt.close("all")
