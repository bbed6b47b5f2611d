"""The attribution-graph viewer (viz/graph_viewer.py, its script viz/static/graph.js) in headless Chromium:
first paint on the logit end, fit to width and zoom, the colour legend; one viewer, a package file."""

from __future__ import annotations

import json
import re

import pytest
from helpers import first_paint, require_chromium, run_chromium

from nnsight_lorsa import LorsaSet, ReplacementModel, TranscoderSet, attribute, load
from nnsight_lorsa.assets import default_lorsa_dir, default_transcoder_dir
from nnsight_lorsa.attribution import prune
from nnsight_lorsa.envoy import load_model
from nnsight_lorsa.viz import render_html
from nnsight_lorsa.viz.graph_viewer import MIN_FIRST_SCALE
from nnsight_lorsa.viz.page import static_text

SHORT = "ROMEO:\nBut soft, what light through yonder window breaks?"
#: the induction prompt of benchmarks/attribution_induction_tinyshakespeare.py (44 tokens without its answer)
LONG = "BRUTUS:\nGood morrow, Zandrofel, I pray you, walk with me.\nCASSIUS:\nAnd I to Zandrofel"


@pytest.fixture(scope="module")
def graphs():
    model = load_model()
    lorsas = LorsaSet.from_pretrained(model, default_lorsa_dir())
    tcs = TranscoderSet(model, {int(p.name.split("_")[1]): load(p)
                                for p in sorted(default_transcoder_dir().glob("layer_*"))})
    rm = ReplacementModel(model, lorsas=lorsas, transcoders=tcs)
    out = {}
    long_ids = model.tokenizer(LONG, return_tensors="pt")["input_ids"][0][:-1]  # the answer token left out
    for name, prompt in (("short", SHORT), ("long", long_ids)):
        g = attribute(rm, prompt, batch_size=64, progress=False)
        out[name] = (g, prune(g))
    return model.tokenizer, out


def _page(graphs, name, tmp_path, **kw):
    tok, gs = graphs
    g, pr = gs[name]
    path = tmp_path / f"{name}.html"
    render_html(g, pr, tokenizer=tok, path=path, **kw)
    return path


@pytest.mark.parametrize("name", ["short", "long"])
def test_first_paint_shows_the_logits_and_lorsa_heads(graphs, name, tmp_path):
    """Issue 25: in a 1400 px window the 44-token graph's first paint showed only bias and embedding nodes (the
    logit end off screen, no zoom). Now every logit and at least one Lorsa head is on screen at first paint,
    nodes at least MIN_FIRST_SCALE of their size."""
    require_chromium()
    tok, gs = graphs
    g, pr = gs[name]
    assert name != "long" or len(g.tokens) == 44
    seen = first_paint(_page(graphs, name, tmp_path), tmp_path, size=(1400, 900))
    assert seen["scale"] >= MIN_FIRST_SCALE - 1e-6, seen
    visible, total = seen["logit"]
    assert total > 0 and visible == total, seen
    assert seen["lorsa"][1] > 0 and seen["lorsa"][0] >= 1, seen


def test_the_long_graph_does_not_fit_and_opens_at_the_right_end(graphs, tmp_path):
    """The 44-token graph is wider than the window at a readable scale: the first paint keeps the scale and
    scrolls to the right end, so the first positions' embeddings are off screen (the check can fail both ways)."""
    require_chromium()
    seen = first_paint(_page(graphs, "long", tmp_path), tmp_path, size=(1000, 900))
    assert abs(seen["scale"] - MIN_FIRST_SCALE) < 1e-3, seen
    emb_visible, emb_total = seen["embedding"]
    assert emb_visible < emb_total, seen
    assert seen["logit"][0] == seen["logit"][1] > 0, seen


_CLICKS = """<script>
window.addEventListener('load', () => setTimeout(() => {
  const svg = document.getElementById('graph'), main = document.getElementById('main');
  const s = () => +svg.getAttribute('data-scale'), out = {first: s()};
  out.scrolled = main.scrollLeft;
  out.labelsOffset = document.getElementById('row-labels').getBoundingClientRect().left
    - main.getBoundingClientRect().left;
  document.getElementById('zoom-in').click(); out.zoomIn = s();
  document.getElementById('zoom-out').click(); document.getElementById('zoom-out').click(); out.zoomOut = s();
  document.getElementById('zoom-reset').click(); out.reset = s(); out.resetWidth = +svg.getAttribute('width');
  document.getElementById('zoom-fit').click(); out.fit = s();
  out.fitWidth = svg.getBoundingClientRect().width; out.mainWidth = main.clientWidth;
  out.scrollWidth = main.scrollWidth;
  const e = new WheelEvent('wheel', {deltaY: -200, ctrlKey: true, clientX: 300, clientY: 300, bubbles: true,
                                     cancelable: true});
  main.dispatchEvent(e); out.wheel = s(); out.wheelPrevented = e.defaultPrevented;
  out.level = document.getElementById('zoom-level').textContent;
  const pre = document.createElement('pre'); pre.id = 'clicks'; pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
}, 0));
</script>"""


def test_zoom_buttons_fit_to_width_and_ctrl_wheel(graphs, tmp_path):
    require_chromium()
    path = _page(graphs, "long", tmp_path)
    probed = tmp_path / "clicks.html"
    probed.write_text(path.read_text().replace("</body>", _CLICKS + "</body>"))
    dom = run_chromium(["--window-size=1400,900", "--dump-dom", probed.resolve().as_uri()], 60).stdout
    r = json.loads(re.search(r'<pre id="clicks">(.*?)</pre>', dom, re.S).group(1).replace("&quot;", '"'))
    assert r["scrolled"] > 100 and abs(r["labelsOffset"]) < 2  # scrolled right, the row names still at the left
    assert r["zoomIn"] == pytest.approx(r["first"] * 1.25, rel=1e-3)
    assert r["zoomOut"] == pytest.approx(r["first"] / 1.25, rel=1e-3)
    assert r["reset"] == 1
    assert r["fit"] < MIN_FIRST_SCALE  # the 44 tokens fit only below the readable first-paint scale ...
    assert r["fitWidth"] <= r["mainWidth"] and r["scrollWidth"] <= r["mainWidth"] + 1  # ... and fit they do
    assert r["wheel"] > r["fit"] and r["wheelPrevented"]  # Ctrl + wheel up zooms in (the page does not zoom)
    assert r["level"] == f"{round(100 * r['wheel'])}%"


def test_the_legend_names_every_kind_with_its_count_and_the_edge_colours(graphs, tmp_path):
    require_chromium()
    tok, gs = graphs
    g, pr = gs["short"]
    path = _page(graphs, "short", tmp_path)
    dom = run_chromium(["--dump-dom", path.resolve().as_uri()], 60).stdout
    data = json.loads(re.search(r"id=\"graph-data\">(.*?)</script>", dom, re.S).group(1))
    kinds = [n["feature_type"] for n in data["graph"]["nodes"]]
    legend = re.search(r'<div id="legend">(.*?)</div>', dom, re.S).group(1)
    for kind, label in (("lorsa", "Lorsa head"), ("logit", "logit (output token)"),
                        ("cross layer transcoder", "transcoder feature"), ("embedding", "token embedding")):
        assert f'data-kind="{kind}"' in legend and f"{label} ({kinds.count(kind)})" in legend, kind
    assert "positive edge" in legend and "negative edge" in legend
    assert kinds.count("lorsa") > 0 and re.search(r'<circle [^>]*data-kind="lorsa"', dom)


def test_one_viewer_its_script_a_package_file(graphs, tmp_path):
    """The viewer lives in viz/ (attribution keeps the JSON export); its script is viz/static/graph.js, inlined."""
    import importlib.resources
    from pathlib import Path

    import nnsight_lorsa.attribution as attribution
    import nnsight_lorsa.attribution.export as export

    assert not hasattr(attribution, "render_html") and not hasattr(export, "render_html")
    script = static_text("graph.js")
    assert importlib.resources.files("nnsight_lorsa.viz").joinpath("static", "graph.js").is_file()
    assert "<script" not in script.lower() and "</" not in script  # it cannot end its own element
    page = _page(graphs, "short", tmp_path).read_text()
    assert f"<script>{script}</script>" in page and page.count("<script") == 2
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    data = pyproject[pyproject.index("[tool.setuptools.package-data]"):].split("\n[", 1)[0]
    assert '"viz/static/*"' in data, data


def test_a_clicked_node_is_scrolled_into_view(graphs, tmp_path):
    """clicked= opens the panel of a node far from the logit end (the first embedding) and shows it."""
    require_chromium()
    tok, gs = graphs
    g, pr = gs["long"]
    from nnsight_lorsa.attribution import to_neuronpedia

    d = to_neuronpedia(g, pr, slug="x", tokenizer=tok)
    first = next(n["node_id"] for n in d["nodes"] if n["feature_type"] == "embedding" and n["ctx_idx"] == 1)
    path = _page(graphs, "long", tmp_path, clicked=first)
    probed = tmp_path / "clicked.html"
    probed.write_text(path.read_text().replace("</body>", """<script>
window.addEventListener('load', () => setTimeout(() => {
  const c = document.querySelector('circle.sel'), r = c.getBoundingClientRect();
  const m = document.getElementById('main').getBoundingClientRect();
  const pre = document.createElement('pre'); pre.id = 'sel';
  pre.textContent = (r.left >= m.left && r.right <= m.right && r.top >= m.top && r.bottom <= m.bottom) + ' '
    + c.getAttribute('data-node-id');
  document.body.appendChild(pre);
}, 0));
</script></body>"""))
    dom = run_chromium(["--window-size=1000,900", "--dump-dom", probed.resolve().as_uri()], 60).stdout
    assert re.search(r'<pre id="sel">(.*?)</pre>', dom).group(1) == f"true {first}"


def test_token_labels_show_characters_that_byte_level_bpe_splits(tmp_path):
    """The x-axis labels show '日本語' and 'café', not '\ufffd' per byte piece; the JSON keeps circuit-tracer's
    per-token strings."""
    require_chromium()
    import html

    model = load_model()
    rm = ReplacementModel(model, lorsas=LorsaSet.from_pretrained(model, default_lorsa_dir()))
    prompt = "ROMEO: café — 日本語 naïve"
    g = attribute(rm, prompt, batch_size=64, progress=False)
    path = tmp_path / "mb.html"
    page = render_html(g, prune(g), tokenizer=model.tokenizer, path=path)
    data = json.loads(re.search(r"id='graph-data'>(.*?)</script>", page, re.S).group(1))
    assert sum("\ufffd" in t for t in data["graph"]["metadata"]["prompt_tokens"]) >= 3  # the JSON: per token
    dom = run_chromium(["--dump-dom", path.resolve().as_uri()], 60).stdout
    labels = [html.unescape(t) for t in re.findall(r'<text [^>]*class="token"[^>]*>([^<]*)</text>', dom)]
    labels = labels[1:] if labels and labels[0] == "\u03a3 bias" else labels  # the bias column, if drawn
    assert len(labels) == len(g.tokens) and "\ufffd" not in "".join(labels)
    assert "".join(labels) == model.tokenizer.decode(g.tokens.tolist())
