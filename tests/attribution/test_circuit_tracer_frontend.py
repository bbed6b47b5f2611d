"""Our exported graph JSON drawn by circuit-tracer's OWN frontend (its static files copied from the
installed package into ``tests/fixtures/peers/circuit_tracer/frontend/``; d3 v7, d3-jetpack, dagre and
pako, which it loads from CDNs, from the npm registry: ``tests/fixtures/npm``, installed by ``.ci/run``
with ``npm ci``). Served from a local HTTP server on 127.0.0.1 (the frontend fetches its data), rendered in
headless Chromium: every node the frontend keeps is drawn (one ``text.node`` per node) and no script
error is raised. A graph with Lorsa heads, Lorsa errors, transcoder features, MLP errors and bias nodes,
so the id extension renders too."""

from __future__ import annotations

import functools
import http.server
import json
import re
import shutil
import threading
from collections import Counter
from pathlib import Path

import pytest
from helpers import attribution_setup, random_ids, require_chromium, rm, run_chromium

from nnsight_lorsa.attribution import attribute, prune, to_neuronpedia

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
FRONTEND = FIXTURES / "peers" / "circuit_tracer" / "frontend"
NPM = FIXTURES / "npm" / "node_modules"
#: the CDN scripts of its index.html -> local copies (None: not needed to draw a graph)
SCRIPTS: dict[str, str | list[str] | None] = {
    "static_js/lib/hotserver-client-ws.js": None,  # live reload of its dev server
    "static_js/lib/d3.js": "npm/d3/dist/d3.js",
    # jetpack's helpers (.at, .appendMany, d3.nestBy …) over d3-collection's d3.nest (gone from d3 v6+);
    # the 2024 build it names also gives d3.conventions() a c.drawAxis(svg): SHIM adds it from jetpack's own
    # d3.drawAxis (the one thing the npm release lacks)
    "static_js/lib/jetpack_2024-07-20.js": ["npm/d3-collection/dist/d3-collection.js",
                                           "npm/d3-jetpack/build/d3-jetpack.js", "jetpack-shim.js"],
    "static_js/lib/npy_v0.js": None,  # .npy feature files, not read for a graph
    "dagre@0.8.5/dist/dagre.min.js": "npm/dagre/dist/dagre.min.js",
    "pako@2.1.0/dist/pako.min.js": "npm/pako/dist/pako.min.js",
}
SHIM = ("(function(){var conventions = d3.conventions; d3.conventions = function(o){var c = conventions(o);"
        "c.drawAxis = function(svg){return d3.drawAxis(Object.assign({}, c, {svg: svg || c.svg}))}; return c}})();")
CATCH = ("<script>window.__errors=[];function __err(m){window.__errors.push(String(m));"
         "document.documentElement.setAttribute('data-js-errors',JSON.stringify(window.__errors))}"
         "window.addEventListener('error',e=>__err(e.message));"
         "window.addEventListener('unhandledrejection',e=>__err(e.reason&&(e.reason.stack||e.reason)))</script>")


def _site(root: Path, graph: dict) -> None:
    shutil.copytree(FRONTEND, root, dirs_exist_ok=True)
    (root / "npm").symlink_to(NPM, target_is_directory=True)
    (root / "jetpack-shim.js").write_text(SHIM)
    page = (root / "index.html").read_text()
    for src, local in SCRIPTS.items():
        tag = re.search(rf"<script src='[^']*{re.escape(src)}'></script>\n?", page)
        assert tag, f"circuit-tracer's index.html no longer loads {src}"
        files = [local] if isinstance(local, str) else local or []
        page = page.replace(tag.group(0), "".join(f"<script src='./{f}'></script>\n" for f in files))
    assert "https://" not in page  # nothing left to fetch from outside
    (root / "index.html").write_text(page.replace("<meta charset='utf-8'>", "<meta charset='utf-8'>" + CATCH, 1))
    (root / "data").mkdir()
    (root / "graph_data").mkdir()
    (root / "data" / "graph-metadata.json").write_text(json.dumps({"graphs": [graph["metadata"]]}))
    (root / "graph_data" / f"{graph['metadata']['slug']}.json").write_text(json.dumps(graph))


def _expected_drawn(graph: dict) -> int:
    """The nodes circuit-tracer's ``util-cg.js`` keeps: embeddings, logits and nodes with influence at most
    the graph's ``node_threshold``, less every ``{layer}_{feature}_{ctx}`` key shared by more than 2/3 of
    the prompt's tokens (errors keyed per position)."""
    th, n_tok = graph["metadata"]["node_threshold"], len(graph["metadata"]["prompt_tokens"])
    kept = [n for n in graph["nodes"] if n["feature_type"] in ("embedding", "logit") or
            (n["influence"] is not None and n["influence"] <= th)]
    key = {id(n): f"{n['layer']}_{n['feature']}_{n['ctx_idx']}" + (
        f"__err_idx_{n_tok - n['ctx_idx']}" if "error" in n["feature_type"] else "") for n in kept}
    counts = Counter(key.values())
    return sum(1 for n in kept if counts[key[id(n)]] <= n_tok * 2 / 3)


@pytest.fixture(scope="module")
def graph_json() -> dict:
    model, _, lorsas, tcs = attribution_setup("llama")
    g = attribute(rm(model, lorsas, tcs), random_ids(1, 9, seed=5)[0], batch_size=48)
    return to_neuronpedia(g, prune(g, 0.8, 0.98), slug="tiny-llama-lorsa", tokenizer=model.tokenizer)


def test_circuit_tracer_frontend_draws_our_graph(graph_json: dict, tmp_path: Path) -> None:
    require_chromium()
    files = [f for local in SCRIPTS.values() if local for f in ([local] if isinstance(local, str) else local)]
    if not all((NPM / f[len("npm/"):]).is_file() for f in files if f.startswith("npm/")):
        pytest.skip(f"npm packages not installed: npm ci --prefix {NPM.parent} (.ci/run does)")
    kinds = {n["feature_type"] for n in graph_json["nodes"]}
    assert {"lorsa", "cross layer transcoder", "embedding", "logit", "bias"} <= kinds
    _site(tmp_path, graph_json)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a, **k: None  # type: ignore[method-assign]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/index.html?slug=tiny-llama-lorsa"
        dom = run_chromium(["--dump-dom", url], timeout=120).stdout
    finally:
        server.shutdown()
    errors = re.search(r'data-js-errors="([^"]*)"', dom)
    assert errors is None, f"script errors in circuit-tracer's frontend: {errors.group(1) if errors else ''}"
    drawn = len(re.findall(r'<text class="node"', dom))
    expected = _expected_drawn(graph_json)
    print(f"circuit-tracer frontend drew {drawn} of {len(graph_json['nodes'])} exported nodes (expected {expected})")
    assert drawn > 0 and drawn == expected, (drawn, expected, len(graph_json["nodes"]))
    assert "Attribution Graph: " in dom  # its title, set after the graph was read
