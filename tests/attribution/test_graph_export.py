"""Neuronpedia graph-JSON export and the HTML graph viewer (schema, weights, rendering in headless
Chromium, a simulated click, escaping of hostile token strings)."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from html.parser import HTMLParser

import pytest
import torch
from helpers import attribution_setup, random_ids, render_dom, require_chromium, rm, run_chromium

from nnsight_lorsa.attribution import attribute, prune, save_neuronpedia, to_neuronpedia
from nnsight_lorsa.attribution.export import node_ids
from nnsight_lorsa.attribution.graph import EMBEDDING, LOGIT, LORSA, TRANSCODER
from nnsight_lorsa.errors import ArgumentError
from nnsight_lorsa.viz import TrustedHTML, render_html
from nnsight_lorsa.viz.page import embed_json

EVIL = "</script><script>alert(1)</script>"
NODE_KEYS = {"node_id", "feature", "layer", "ctx_idx", "feature_type", "jsNodeId", "clerp", "influence",
             "activation", "is_target_logit", "token_prob", "reverse_ctx_idx"}


@pytest.fixture(scope="module")
def built():
    model, _, lorsas, tcs = attribution_setup("llama")
    g = attribute(rm(model, lorsas, tcs), random_ids(1, 9, seed=5)[0], batch_size=48)
    pr = prune(g)
    return model.tokenizer, g, pr, to_neuronpedia(g, pr, slug="tiny-llama", tokenizer=model.tokenizer)


class _Dom(HTMLParser):
    """Elements (tag, attrs) and the text inside each element with an id."""

    def __init__(self) -> None:
        super(_Dom, self).__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.stack: list[tuple[str, str | None]] = []
        self.text_by_id: dict[str, str] = {}
        self.token_texts: list[str] = []
        self._in_token = False

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        self.elements.append((tag, a))
        self._in_token = tag == "text" and a.get("class") == "token"
        if tag not in ("br", "meta", "img", "input", "hr"):
            self.stack.append((tag, a.get("id")))

    def handle_endtag(self, tag):
        self._in_token = False
        while self.stack:
            if self.stack.pop()[0] == tag:
                break

    def handle_data(self, data):
        if self._in_token:
            self.token_texts.append(data)
        for _, id_ in self.stack:
            if id_:
                self.text_by_id[id_] = self.text_by_id.get(id_, "") + data


def parse(dom: str) -> _Dom:
    p = _Dom()
    p.feed(dom)
    return p


# ----------------------------------------------------------------------------- JSON schema
def test_schema_links_and_weights(built, tmp_path):
    tok, g, pr, d = built
    assert set(d) == {"metadata", "qParams", "nodes", "links"}
    meta = d["metadata"]
    for k in ("slug", "scan", "prompt_tokens", "prompt", "node_threshold", "schema_version", "info"):
        assert k in meta, k
    assert meta["slug"] == "tiny-llama" and meta["scan"] == "llama" and meta["schema_version"] == 1
    assert meta["info"]["generator"]["name"] == "nnsight-lorsa" and meta["info"]["creator_name"]
    assert meta["prompt_tokens"] == [tok.decode([t]) for t in g.tokens.tolist()]
    assert {"pinnedIds", "supernodes", "linkType", "clickedId", "sparsityThreshold"} <= set(d["qParams"])

    ids = [n["node_id"] for n in d["nodes"]]
    assert len(ids) == len(set(ids))
    for n in d["nodes"]:
        assert set(n) >= NODE_KEYS, set(NODE_KEYS) - set(n)
        assert isinstance(n["layer"], str) and isinstance(n["ctx_idx"], int)
        assert 0 <= n["ctx_idx"] < g.tokens.numel()
    # the exported nodes: kept nodes with a kept edge, plus every embedding and logit
    all_ids = node_ids(g)
    index = {nid: i for i, nid in enumerate(all_ids)}
    assert len(all_ids) == len(set(all_ids)) == g.n_nodes
    exported = torch.zeros(g.n_nodes, dtype=torch.bool)
    exported[[index[i] for i in ids]] = True
    assert not (exported & ~pr.node_mask).any()
    for kind in (EMBEDDING, LOGIT):
        assert exported[g.ids_of(kind)].all()
    assert exported.sum() < g.n_nodes  # pruning did remove nodes

    # links: endpoints are exported nodes; one per kept edge; weights are the adjacency entries
    idset = set(ids)
    assert d["links"]
    for link in d["links"]:
        assert link["source"] in idset and link["target"] in idset
        t, s = index[link["target"]], index[link["source"]]
        assert bool(pr.edge_mask[t, s])
        assert link["weight"] == float(g.densify()[t, s]) and link["weight"] != 0.0
    kept_edges = pr.edge_mask & pr.node_mask[:, None] & pr.node_mask[None, :]
    assert len(d["links"]) == int(kept_edges.sum())
    assert len({(link["source"], link["target"]) for link in d["links"]}) == len(d["links"])

    # logits: all flagged as logits, exactly one target logit (the most probable), probabilities kept
    logits = [n for n in d["nodes"] if n["feature_type"] == "logit"]
    assert len(logits) == len(g.logit_ids) and sum(n["is_target_logit"] for n in logits) == 1
    target = next(n for n in logits if n["is_target_logit"])
    assert target["token_prob"] == pytest.approx(float(g.logit_probs.max()))
    for n in logits:
        i = index[n["node_id"]]
        p = float(g.logit_probs[(g.logit_ids == i).nonzero()[0, 0]])
        assert n["token_prob"] == pytest.approx(p) and n["ctx_idx"] == g.tokens.numel() - 1
        assert n["feature"] == int(g.nodes.index[i])

    # circuit-tracer's layer numbers (layer L, logits n_layers + 1); Lorsa heads their own feature type
    # and id prefix (the documented extension), with negative feature keys distinct from every feature's
    lorsa = [n for n in d["nodes"] if n["feature_type"] == "lorsa"]
    assert lorsa, "no Lorsa head survived pruning"
    n_layers = int(g.nodes.layer[g.logit_ids[0]])
    for n in d["nodes"]:
        i = index[n["node_id"]]
        kind, layer, idx = int(g.nodes.kind[i]), int(g.nodes.layer[i]), int(g.nodes.index[i])
        if kind == LORSA:
            assert n["layer"] == str(layer) and n["activation"] == pytest.approx(float(g.nodes.activation[i]))
            assert n["node_id"] == f"A{layer}_{idx}_{n['ctx_idx']}" and n["feature"] <= -2
        elif kind == TRANSCODER:
            assert n["layer"] == str(layer) and n["feature_type"] == "cross layer transcoder"
            assert n["node_id"] == f"{layer}_{idx}_{n['ctx_idx']}" and n["jsNodeId"] == f"{layer}_{idx}-0"
            assert n["feature"] == (layer + idx) * (layer + idx + 1) // 2 + idx
        elif kind == EMBEDDING:
            assert n["layer"] == "E" and n["node_id"] == f"E_{int(g.tokens[n['ctx_idx']])}_{n['ctx_idx']}"
        elif kind == LOGIT:
            assert n["layer"] == str(n_layers + 1) and n["node_id"].startswith(f"{n_layers + 1}_{idx}_")
    keys = [(n["layer"], n["feature"], n["ctx_idx"]) for n in d["nodes"] if "error" not in n["feature_type"]]
    assert len(keys) == len(set(keys))  # the frontend's featureId
    assert any(n["feature_type"] == "bias" for n in d["nodes"])

    # strict JSON on disk, same content
    p = save_neuronpedia(g, tmp_path / "out" / "tiny-llama.json", pr, tokenizer=tok)
    loaded = json.loads(p.read_text())
    assert loaded["metadata"]["slug"] == "tiny-llama"
    assert loaded["nodes"] == d["nodes"] and loaded["links"] == d["links"]


def test_default_prune_and_thresholds(built):
    tok, g, pr, d = built
    again = to_neuronpedia(g, slug="x", tokenizer=tok)  # prunes with the default thresholds itself
    assert again["nodes"] == d["nodes"] and again["links"] == d["links"]
    small = to_neuronpedia(g, slug="x", node_threshold=0.5, edge_threshold=0.9)
    assert len(small["nodes"]) < len(d["nodes"]) and len(small["links"]) < len(d["links"])
    assert small["metadata"]["node_threshold"] == 0.5
    assert small["metadata"]["prompt_tokens"][1] == f"tok{int(g.tokens[1])}"  # no tokenizer
    bad = dataclasses.replace(pr, node_mask=pr.node_mask[:-1])
    with pytest.raises(ValueError, match="do not fit"):
        to_neuronpedia(g, bad, slug="x")


@pytest.mark.parametrize("bad", [True, False, -0.1, 1.5, float("nan"), float("inf")])
def test_prune_refuses_a_threshold_that_is_not_a_fraction(built, bad):
    """``edge_threshold=True`` was accepted as 1.0 (and NaN passed the range check as no comparison holds)."""
    from nnsight_lorsa.errors import ArgumentError

    _, g, _, _ = built
    for name in ("node_threshold", "edge_threshold"):
        with pytest.raises(ArgumentError, match=name):
            prune(g, **{name: bad})


def test_render_html_refuses_details_for_nodes_the_graph_does_not_have(built):
    """Unknown node ids in ``details=`` were dropped without a word; a pruned-away node of the graph is fine."""
    from nnsight_lorsa.errors import ArgumentError

    tok, g, pr, d = built
    drawn = {n["node_id"] for n in d["nodes"]}
    pruned_away = next(i for i in node_ids(g) if i not in drawn)
    render_html(g, pr, tokenizer=tok, details={pruned_away: "not drawn: nothing to show"})
    with pytest.raises(ArgumentError, match=r"not in this graph.*'nope_1_2'"):
        render_html(g, pr, tokenizer=tok, details={"nope_1_2": "a typo"})


# ----------------------------------------------------------------------------- viewer
def _details(d):
    lorsa = next(n["node_id"] for n in d["nodes"] if n["feature_type"] == "lorsa")
    z = torch.tensor([[1.0, 0.0], [0.25, -0.5]])
    return lorsa, {lorsa: [{"contexts": [("But soft, what light", 3.5), ("through yonder", 1.25)]},
                           {"heatmap": z, "rows": ["q0", "q1"], "cols": ["k0", "k1"], "title": "z pattern"},
                           TrustedHTML("<em class='custom-snippet'>head note</em>")]}


def test_viewer_renders_nodes_links_tokens_and_panel(built, tmp_path):
    require_chromium()
    tok, g, pr, d = built
    lorsa, details = _details(d)
    html = render_html(g, pr, tokenizer=tok, details=details, path=tmp_path / "g.html", clicked=lorsa)
    offline = html.replace("http://www.w3.org/2000/svg", "")  # the SVG namespace name, not a fetch
    for needle in ("http://", "https://", "src=", "<link", "url(", "@import", "fetch("):
        assert needle not in offline, needle
    dom = parse(render_dom(tmp_path / "g.html"))
    circles = [a for t, a in dom.elements if t == "circle" and "node" in a.get("class", "").split()]
    lines = [a for t, a in dom.elements if t == "line" and "link" in a.get("class", "").split()]
    assert sorted(a["data-node-id"] for a in circles) == sorted(n["node_id"] for n in d["nodes"])
    assert sorted((a["data-source"], a["data-target"]) for a in lines) == sorted(
        (link["source"], link["target"]) for link in d["links"])
    # widths ∝ |weight|: the strongest link is the widest
    w = {(a["data-source"], a["data-target"]): float(a["stroke-width"]) for a in lines}
    top = max(d["links"], key=lambda link: abs(link["weight"]))
    assert w[(top["source"], top["target"])] == max(w.values())
    # tokens label the x axis (plus the bias column)
    shown = [t.replace("\u23ce", "\n") for t in dom.token_texts]
    assert shown[-len(d["metadata"]["prompt_tokens"]):] == d["metadata"]["prompt_tokens"]
    # the simulated click on the Lorsa head opened its panel with the details
    panel = dom.text_by_id["panel"]
    node = next(n for n in d["nodes"] if n["node_id"] == lorsa)
    assert node["clerp"] in dom.text_by_id["panel-title"]
    assert lorsa in panel and "Incoming" in panel and "Outgoing" in panel
    assert "But soft, what light" in panel and "z pattern" in panel and "head note" in panel
    assert any(t == "em" and a.get("class") == "custom-snippet" for t, a in dom.elements)
    sel = [a for a in circles if "sel" in a["class"].split()]
    assert [a["data-node-id"] for a in sel] == [lorsa]


def test_viewer_hash_opens_node(built, tmp_path):
    require_chromium()
    tok, g, pr, d = built
    target = next(n for n in d["nodes"] if n["is_target_logit"])
    path = tmp_path / "g.html"
    render_html(g, pr, tokenizer=tok, path=path)
    plain = parse(render_dom(path))
    assert "Click a node" in plain.text_by_id["panel"]
    uri = path.resolve().as_uri() + "#node=" + target["node_id"]
    dom = parse(run_chromium(["--dump-dom", uri], 60.0).stdout)
    assert dom.text_by_id["panel-title"] == target["clerp"]
    assert "probability" in dom.text_by_id["panel"]


class _EvilTokenizer:
    def __init__(self, evil_id: int):
        self.evil_id = evil_id

    def decode(self, ids):
        return EVIL if int(ids[0]) == self.evil_id else f"t{int(ids[0])}"


def test_hostile_token_strings_are_escaped(built, tmp_path):
    _, g, pr, _ = built
    evil_id = int(g.tokens[3])
    g2 = dataclasses.replace(g, prompt=EVIL)
    first = to_neuronpedia(g2, pr, slug="x")["nodes"][0]["node_id"]
    html = render_html(g2, pr, tokenizer=_EvilTokenizer(evil_id), path=tmp_path / "evil.html",
                       details={first: {"text": EVIL}}, clicked=first)
    assert html.count("<script") == 2 and html.count("</script>") == 2
    assert EVIL not in html and "alert(1)</script>" not in html
    payload = re.search(r"<script type='application/json' id='graph-data'>(.*?)</script>", html, re.S).group(1)
    data = json.loads(payload)
    assert data["graph"]["metadata"]["prompt_tokens"][3] == EVIL and data["graph"]["metadata"]["prompt"] == EVIL
    require_chromium()
    dom = parse(render_dom(tmp_path / "evil.html"))
    assert EVIL in dom.token_texts  # shown as text, not run
    assert EVIL in dom.text_by_id["panel"]  # a {"text": …} detail is text too
    assert sum(t == "script" for t, _ in dom.elements) == 2
    assert sum(t == "circle" for t, _ in dom.elements) == len(data["graph"]["nodes"]) > 0


HOSTILE = ["<script>alert('details')</script>", "<img src=x onerror=alert('details')>"]


def test_detail_strings_are_text_unless_trusted(built, tmp_path):
    """A plain string (bare or as {"html": str}) is escaped text; markup only through TrustedHTML."""
    tok, g, pr, d = built
    node = d["nodes"][0]["node_id"]
    trusted = TrustedHTML("<em class='trusted-snippet'>opted in</em>")
    html = render_html(g, pr, tokenizer=tok, path=tmp_path / "details.html", clicked=node,
                       details={node: [HOSTILE[0], {"html": HOSTILE[1]}, trusted]})
    assert all(evil not in html for evil in HOSTILE)
    assert "<img" not in html and "<script>alert" not in html
    assert html.count("<script") == 2  # the page's own two scripts only
    payload = re.search(r"<script type='application/json' id='graph-data'>(.*?)</script>", html, re.S).group(1)
    blocks = json.loads(payload)["details"][node]
    assert blocks == [{"type": "text", "text": HOSTILE[0]}, {"type": "text", "text": HOSTILE[1]},
                      {"type": "html", "html": str(trusted)}]
    assert "\\u003cem class='trusted-snippet'\\u003e" in payload  # escaped in the JSON, inserted by the viewer
    require_chromium()
    dom = parse(render_dom(tmp_path / "details.html"))
    panel = dom.text_by_id["panel"]
    assert all(evil in panel for evil in HOSTILE)  # displayed as text …
    assert not any(t == "img" for t, _ in dom.elements)  # … never an element
    assert sum(t == "script" for t, _ in dom.elements) == 2
    assert any(t == "em" and a.get("class") == "trusted-snippet" for t, a in dom.elements)  # the opt-in renders


def test_embed_json_and_bad_inputs(built):
    tok, g, pr, d = built
    s = embed_json({"a": "</script><!-- & \u2028 >"})
    assert "<" not in s and ">" not in s and "&" not in s and "\u2028" not in s
    assert json.loads(s) == {"a": "</script><!-- & \u2028 >"}
    with pytest.raises(ValueError, match="NaN|Out of range"):
        embed_json({"x": float("nan")})
    with pytest.raises(ValueError, match="unsupported"):
        render_html(g, pr, details={d["nodes"][0]["node_id"]: 3.5})
    with pytest.raises(ValueError, match="not an exported node"):
        render_html(g, pr, clicked="no-such-node")



@pytest.mark.parametrize("where", ["prompt", "logit"])
def test_a_token_id_beyond_the_vocabulary_is_refused_not_exported_as_empty(built, where):
    """Issue 23, class 8: a token id past ``len(tokenizer)`` decoded as ``''``; now an ArgumentError naming it."""
    tok, g, pr, _ = built
    g.densify()  # dataclasses.replace reads every field, the dense adjacency too (the tests before may have built it)
    bad = len(tok) + 5
    if where == "prompt":
        g2 = dataclasses.replace(g, tokens=torch.cat([g.tokens[:-1], torch.tensor([bad])]))
    else:
        index = g.nodes.index.clone()
        index[g.logit_ids[0]] = bad
        g2 = dataclasses.replace(g, nodes=dataclasses.replace(g.nodes, index=index))
    with pytest.raises(ArgumentError, match=rf"token id {bad} is outside the tokenizer's vocabulary \[0, {len(tok)}\)"):
        to_neuronpedia(g2, pr, slug="x", tokenizer=tok)
    assert to_neuronpedia(g2, pr, slug="x")["metadata"]["prompt_tokens"]  # without a tokenizer: tok<id> labels


def test_exporting_a_graph_pruned_while_built_warns_and_logits_have_no_influence(built):
    """A graph pruned while built lost the full graph: its export re-prunes the kept nodes (fewer nodes, influence
    recomputed on the subgraph: not circuit-tracer's export of the full graph) — said by a warning; logit nodes are
    written with ``influence: null`` as circuit-tracer writes them (a cumulative score read 1.0000000000000002)."""
    tok, g, pr, d = built
    assert all(n["influence"] is None for n in d["nodes"] if n["feature_type"] == "logit")
    assert all(n["influence"] is not None for n in d["nodes"] if n["feature_type"] != "logit")
    model, _, lorsas, tcs = attribution_setup("llama")
    gp = attribute(rm(model, lorsas, tcs), random_ids(1, 9, seed=5)[0], batch_size=48, prune=(0.8, 0.98))
    with pytest.warns(UserWarning, match=r"pruned while it was built .* prunes it again"):
        to_neuronpedia(gp, slug="tiny-llama", tokenizer=tok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        to_neuronpedia(gp, prune(gp, 1.0, 1.0), slug="tiny-llama", tokenizer=tok)  # a prune of one's own: no warning
