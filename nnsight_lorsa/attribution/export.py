"""Export a pruned attribution graph as Neuronpedia / circuit-tracer graph JSON.

The file is the one Neuronpedia's graph frontend (and circuit-tracer's local server) reads:
``{"metadata", "qParams", "nodes", "links"}`` with the field names of circuit-tracer's
``frontend/graph_models.py``. Ids follow circuit-tracer 0.5.0 exactly (``Node.feature_node`` /
``error_node`` / ``token_node`` / ``logit_node`` there; ``n`` = the model's number of layers, ``L`` a
layer, ``p`` a position), so a graph of the same model, transcoders and prompt gets the same ids from
both (``tests/attribution/test_circuit_tracer_ids.py``):

=================  ======================  ===========  ====================  ==================
node               ``node_id``             ``layer``    ``feature``           ``jsNodeId``
=================  ======================  ===========  ====================  ==================
transcoder feature ``{L}_{f}_{p}``         ``L``        ``cantor(L, f)``      ``{L}_{f}-0``
MLP error          ``0_{L}_{p}``           ``L``        ``-1``                ``{L}_{p}-0``
embedding          ``E_{token}_{p}``       ``E``        ``p``                 ``E_{token}-{p}``
logit              ``{n+1}_{token}_{p}``   ``n+1``      ``token``             ``L_{token}-{p}``
=================  ======================  ===========  ====================  ==================

(circuit-tracer's MLP error id ``0_{L}_{p}`` can equal a layer-0 feature's ``0_{f}_{p}`` when
``f == L``; both tools then write two nodes with one id, and :func:`to_neuronpedia` warns, naming them.)
Extensions for what circuit-tracer's graphs do not have — the ``A`` / ``B`` prefixes keep them apart
from every id above, and negative ``feature`` values keep the frontend's ``{layer}_{feature}_{ctx}``
keys distinct:

* Lorsa head ``h``: ``node_id`` ``A{L}_{h}_{p}``, ``layer`` ``L``, ``feature`` ``-2 - 2·cantor(L, h)``,
  ``jsNodeId`` ``A{L}_{h}-0``;
* Lorsa error: ``AE_{L}_{p}``, ``L``, ``-1``, ``AE_{L}-{p}``;
* bias ``b``: ``B_{b}_0``, ``L`` (``n`` for the final norm / unembedding), ``-3 - 2·b``, ``B_{b}-0``.

A Lorsa head of layer ``L`` shares the row of layer ``L``'s transcoder features (circuit-tracer's
frontend draws one row per integer ``layer``); bias nodes sum over positions and sit at ``ctx_idx`` 0
(the final-norm / unembedding biases at ``layer`` ``n``).
``feature_type``: :data:`.graph.KIND_NAMES`. ``influence``: the node's *cumulative* influence rank
score (:attr:`.scores.PruneResult.cumulative`, what circuit-tracer writes there); ``activation``:
feature activation / Lorsa head ``z``, the error vector's norm for error nodes (circuit-tracer: None),
``None`` for the rest. ``intervened``: ``true`` on a node edited in the traced pass the graph is of
(:attr:`.graph.NodeTable.intervened`; absent otherwise; such a node is exported whatever its influence,
as embeddings and logits are). ``metadata.prompt``: the graph's prompt, or —
for a graph built from token ids — ``tokenizer.decode(tokens)`` (as circuit-tracer's ``attribute`` does).

:func:`render_html` (below) draws the nodes :func:`to_neuronpedia` exports as one self-contained
HTML page: one column per
token position (the tokens label the x axis; bias nodes, which sum over positions, get their own
column on the left), one row per layer's attention and one per its MLP (embeddings at the bottom, logits on top),
links as lines whose width is proportional to ``|weight|`` (green positive, red negative), nodes
coloured by kind. Clicking a node opens a side panel with its label, activation, influence, its
strongest incoming and outgoing links and optional per-node details (top activating contexts, a
Lorsa head's z pattern, text; HTML only as :class:`TrustedHTML`). Opening the file with
``#node=<node_id>`` opens that node's panel on load.

SVG elements carry ``data-node-id`` (``circle.node``) and ``data-source`` / ``data-target``
(``line.link``) attributes; the side panel is ``#panel``.
"""

from __future__ import annotations

import html
import json
import math
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import ArgumentError
from .graph import ATTN_ERROR, BIAS, EMBEDDING, KIND_NAMES, LOGIT, LORSA, MLP_ERROR, TRANSCODER, Graph
from .scores import PruneResult, prune

SCHEMA_VERSION = 1
GENERATOR_NAME = "nnsight-lorsa"


def _version() -> str:
    from .._version import __version__

    return str(__version__)


def _cantor(x: int, y: int) -> int:
    return (x + y) * (x + y + 1) // 2 + y


def n_layers_of(graph: Graph) -> int:
    """The model's number of layers, read off the logit nodes (their ``layer`` is ``n_layers``).

    Raises:
        ValueError: a graph without logit nodes.
    """
    ids = graph.logit_ids
    if ids.numel() == 0:
        raise ValueError("the graph has no logit nodes")
    return int(graph.nodes.layer[ids[0]])


def decode_token(tokenizer: Any, token_id: int) -> str:
    """``tokenizer.decode([token_id])``, or ``"tok{token_id}"`` without a tokenizer.

    Raises:
        ArgumentError: ``token_id`` outside the tokenizer's vocabulary ``[0, len(tokenizer))`` (a
            tokenizer decodes it as ``''``, which would label the node with nothing).
    """
    if tokenizer is None:
        return f"tok{token_id}"
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else getattr(tokenizer, "vocab_size", None)
    if isinstance(size, int) and not 0 <= int(token_id) < size:
        raise ArgumentError(f"token id {int(token_id)} is outside the tokenizer's vocabulary [0, {size}) "
                            "(it would decode as ''); pass the model's own tokenizer, or tokenizer=None for "
                            "tok<id> labels")
    return str(tokenizer.decode([int(token_id)]))


def layer_name(graph: Graph, i: int, n_layers: int) -> str:
    """Node ``i``'s Neuronpedia ``layer`` string (module docstring): ``"E"``, the layer, or ``n_layers + 1``
    for logits (``n_layers`` for the final-norm / unembedding biases)."""
    n = graph.nodes
    kind, layer = int(n.kind[i]), int(n.layer[i])
    if kind == EMBEDDING:
        return "E"
    if kind == LOGIT:
        return str(n_layers + 1)
    return str(min(layer, n_layers))


def _ids(graph: Graph, i: int, n_layers: int, last: int) -> tuple[str, int, str]:
    """``(node_id, feature, jsNodeId)`` of node ``i`` (module docstring's tables)."""
    n = graph.nodes
    kind, pos, idx, layer = int(n.kind[i]), int(n.pos[i]), int(n.index[i]), int(n.layer[i])
    if kind == TRANSCODER:
        return f"{layer}_{idx}_{pos}", _cantor(layer, idx), f"{layer}_{idx}-0"
    if kind == MLP_ERROR:
        return f"0_{layer}_{pos}", -1, f"{layer}_{pos}-0"
    if kind == EMBEDDING:
        return f"E_{idx}_{pos}", pos, f"E_{idx}-{pos}"
    if kind == LOGIT:
        return f"{n_layers + 1}_{idx}_{last}", idx, f"L_{idx}-{last}"
    if kind == LORSA:
        return f"A{layer}_{idx}_{pos}", -2 - 2 * _cantor(layer, idx), f"A{layer}_{idx}-0"
    if kind == ATTN_ERROR:
        return f"AE_{layer}_{pos}", -1, f"AE_{layer}-{pos}"
    return f"B_{idx}_0", -3 - 2 * idx, f"B_{idx}-0"  # bias


def node_ids(graph: Graph) -> list[str]:
    """The Neuronpedia ``node_id`` of every node of ``graph`` (``(n_nodes,)`` strings; circuit-tracer's
    scheme, module docstring — distinct except where circuit-tracer's own MLP-error ids collide)."""
    L, last = n_layers_of(graph), int(graph.tokens.numel()) - 1
    return [_ids(graph, i, L, last)[0] for i in range(graph.n_nodes)]


def _num(x: float) -> float | None:
    return None if math.isnan(x) or math.isinf(x) else x


def to_neuronpedia(
    graph: Graph,
    prune_result: PruneResult | None = None,
    *,
    slug: str,
    tokenizer: Any = None,
    scan: str | None = None,
    node_threshold: float = 0.8,
    edge_threshold: float = 0.98,
    sparsity_threshold: float = 1.0,
    creator_name: str = "nnsight-lorsa",
) -> dict[str, Any]:
    """The graph as a Neuronpedia / circuit-tracer graph-JSON dict (see the module docstring).

    Args:
        graph: an attribution graph (:func:`.attribute.attribute`).
        prune_result: which nodes and edges to export (default: :func:`.scores.prune` with the two
            thresholds). Exported are the kept edges between kept nodes, and the kept nodes that have
            such an edge, plus every embedding and logit node (as circuit-tracer).
        slug: the graph's name (``metadata.slug``; Neuronpedia's URL key).
        tokenizer: decodes the prompt and logit tokens (``decode([id])``); without one, tokens are
            ``"tok{id}"``.
        scan: ``metadata.scan`` (Neuronpedia reads it as the model id); default the graph's
            ``meta["model_type"]``.
        node_threshold, edge_threshold: pruning thresholds in ``[0, 1]`` (used only when
            ``prune_result`` is None; ``node_threshold`` is recorded in the metadata either way).
        sparsity_threshold: passed through as ``qParams.sparsityThreshold`` (the frontend's
            feature-density filter; 1.0 hides nothing).
        creator_name: ``metadata.info.creator_name``.

    Returns:
        A JSON-serialisable dict; every ``links[*].weight`` is ``float(graph.densify()[t, s])`` (the
        direct effect of source on target, in units of the target's pre-activation / demeaned logit).

    Raises:
        ValueError: a graph without logit nodes, thresholds outside ``[0, 1]``, or a prune result whose
            masks do not fit the graph.
        ArgumentError: a prompt or logit token id outside ``tokenizer``'s vocabulary.
    """
    if prune_result is None:
        prune_result = prune(graph, node_threshold, edge_threshold)
    N = graph.n_nodes
    if prune_result.node_mask.shape != (N,) or prune_result.edge_mask.shape != (N, N):
        raise ValueError(f"prune result masks {tuple(prune_result.node_mask.shape)} / "
                         f"{tuple(prune_result.edge_mask.shape)} do not fit a graph of {N} nodes")
    n, L = graph.nodes, n_layers_of(graph)
    last = int(graph.tokens.numel()) - 1
    triples = [_ids(graph, i, L, last) for i in range(N)]
    ids = [t[0] for t in triples]
    kept = prune_result.node_mask.bool()
    edges = prune_result.edge_mask.bool() & kept[:, None] & kept[None, :]
    targets, sources = edges.nonzero(as_tuple=True)
    weights = graph.densify()[targets, sources].tolist()
    links = [{"source": ids[s], "target": ids[t], "weight": float(w)}
             for t, s, w in zip(targets.tolist(), sources.tolist(), weights, strict=True)]
    connected = set(targets.tolist()) | set(sources.tolist())

    tokens = [decode_token(tokenizer, t) for t in graph.tokens.tolist()]
    n_pos = len(tokens)
    probs = {int(i): float(p) for i, p in zip(graph.logit_ids.tolist(), graph.logit_probs.tolist(), strict=True)}
    top_logit = max(probs, key=lambda i: probs[i]) if probs else -1
    cumulative = prune_result.cumulative.tolist()
    nodes = []
    for i in range(N):
        kind = int(n.kind[i])
        marked = bool(n.intervened[i])  # an edited node is exported whatever its influence (an ablated one has none)
        if not marked and (not bool(kept[i]) or (i not in connected and kind not in (EMBEDDING, LOGIT))):
            continue
        pos, idx = int(n.pos[i]), int(n.index[i])
        node_id, feature, js_id = triples[i]
        act = float(n.activation[i])
        node: dict[str, Any] = {"node_id": node_id, "feature": feature, "layer": layer_name(graph, i, L),
                                "ctx_idx": pos, "feature_type": KIND_NAMES[kind], "jsNodeId": js_id,
                                "clerp": n.label(i), "influence": _num(float(cumulative[i])), "activation": None,
                                "is_target_logit": False, "token_prob": 0.0, "reverse_ctx_idx": 0, "run_idx": 0}
        if marked:  # edited in the traced pass (attribute(rm, tracer=tracer)): a fixed input
            node["intervened"] = True
        if kind in (TRANSCODER, LORSA, MLP_ERROR, ATTN_ERROR):
            node.update(activation=_num(act))
        elif kind == EMBEDDING:
            node.update(clerp=f"Emb: {tokens[pos]!r}")
        elif kind == BIAS:
            node.update(ctx_idx=0, clerp=f"Bias {n.bias_names[idx]}")
        else:  # logit
            p = probs.get(i, 0.0)
            tok = decode_token(tokenizer, idx)
            node.update(ctx_idx=n_pos - 1, token_prob=p, is_target_logit=i == top_logit,
                        clerp=f'Output "{tok}" (p={p:.3f})')
        nodes.append(node)
    seen: dict[str, int] = {}
    for node in nodes:
        seen[node["node_id"]] = seen.get(node["node_id"], 0) + 1
    if dups := sorted(k for k, c in seen.items() if c > 1):
        warnings.warn(f"node ids {dups} are shared by a layer-0 transcoder feature and an MLP error node "
                      "(circuit-tracer's id scheme, followed exactly: error '0_{layer}_{pos}' vs feature "
                      "'0_{feature}_{pos}'); viewers keyed by node_id show one of each pair", stacklevel=2)

    metadata = {
        "slug": slug,
        "scan": scan if scan is not None else str(graph.meta.get("model_type", "unknown")),
        "transcoder_list": [],
        "prompt_tokens": tokens,
        "prompt": graph.prompt or (str(tokenizer.decode(graph.tokens.tolist())) if tokenizer is not None else ""),
        "node_threshold": float(node_threshold),
        "schema_version": SCHEMA_VERSION,
        "info": {"creator_name": creator_name, "creator_url": "", "source_urls": [],
                 "generator": {"name": GENERATOR_NAME, "version": _version(), "url": ""},
                 "create_time_ms": int(time.time() * 1000)},
    }
    qparams = {"pinnedIds": [], "supernodes": [], "linkType": "both", "clickedId": "", "sg_pos": "",
               "sparsityThreshold": float(sparsity_threshold)}
    out = {"metadata": metadata, "qParams": qparams, "nodes": nodes, "links": links}
    if graph.qk:  # QK tracing of the top Lorsa heads (attribute(..., qk_heads=n)); -1: a node outside the graph
        def qk_node(i: int) -> str | None:
            return "bias" if i == N else ids[i] if i >= 0 else None

        out["qk_tracing"] = [
            {"node_id": ids[int(pr[0])], "layer": int(pr[1]), "qk_head": int(pr[2]), "query_pos": int(pr[3]),
             "key_pos": int(pr[4]), "score": float(sc), "pair_sum_error": float(err),
             "pairs": [{"query": qk_node(int(a)), "key": qk_node(int(b)), "value": float(v)}
                       for (a, b), v in zip(pi.tolist(), pv.tolist(), strict=True) if v != 0]}
            for pr, sc, err, pi, pv in zip(graph.qk["probe"], graph.qk["score"], graph.qk["pair_sum_error"],
                                           graph.qk["pair_index"], graph.qk["pair_value"], strict=True)]
    return out


def save_neuronpedia(
    graph: Graph,
    path: str | os.PathLike[str],
    prune_result: PruneResult | None = None,
    **kwargs: Any,
) -> Path:
    """Write :func:`to_neuronpedia`'s dict to ``path`` (a ``.json`` file; parents created); returns it.

    ``kwargs`` are :func:`to_neuronpedia`'s (``slug`` defaults to the file's stem). The JSON is strict
    (no NaN / Infinity). Written atomically (:func:`nnsight_lorsa._atomic.atomic_file`: a sibling
    temporary renamed over ``path``), so a crash leaves the old file or the new one.
    """
    from .._atomic import atomic_file

    p = Path(path)
    kwargs.setdefault("slug", p.stem)
    data = to_neuronpedia(graph, prune_result, **kwargs)
    return atomic_file(p, json.dumps(data, allow_nan=False, indent=1, ensure_ascii=False).encode("utf-8"))


def embed_json(data: Any) -> str:
    """``data`` as JSON safe inside ``<script type="application/json">``: ``<``, ``>``, ``&`` and the
    JS line separators are written as ``\\uXXXX`` escapes, so no ``</script>`` or ``<!--`` can occur.

    Raises:
        ValueError: NaN / Infinity in ``data`` (not JSON).
    """
    s = json.dumps(data, allow_nan=False, ensure_ascii=False)
    for ch, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                    ("\u2029", "\\u2029")):
        s = s.replace(ch, esc)
    return s


def _heatmap(values: Any, rows: Sequence[str] | None = None, cols: Sequence[str] | None = None,
             title: str = "") -> dict[str, Any]:
    v = torch.as_tensor(values, dtype=torch.float32, device="cpu")
    if v.dim() == 1:
        v = v[None]
    if v.dim() != 2:
        raise ValueError(f"a heatmap needs a 1-D or 2-D array, got shape {tuple(v.shape)}")
    r = [str(x) for x in rows] if rows is not None else [str(i) for i in range(v.shape[0])]
    c = [str(x) for x in cols] if cols is not None else [str(i) for i in range(v.shape[1])]
    if len(r) != v.shape[0] or len(c) != v.shape[1]:
        raise ValueError(f"heatmap labels {len(r)}×{len(c)} do not fit values {tuple(v.shape)}")
    vals = [[None if x != x else float(x) for x in row] for row in v.tolist()]
    return {"type": "heatmap", "title": title, "rows": r, "cols": c, "values": vals}


class TrustedHTML(str):
    """An HTML snippet the caller vouches for: :func:`render_html` inserts it into the page as is.

    Every other string in ``details`` (a bare ``str``, ``{"text": …}``, ``{"html": str}``) is shown as
    text — escaped, never run. Wrap only markup you wrote yourself (not token strings, model
    outputs or anything read from a file of unknown origin)::

        details = {node_id: TrustedHTML("<em>copies the previous token</em>")}
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"TrustedHTML({str.__repr__(self)})"


def _detail_block(item: Any) -> dict[str, Any]:
    if isinstance(item, TrustedHTML):
        return {"type": "html", "html": str(item)}
    if isinstance(item, str):  # not vouched for: text
        return {"type": "text", "text": str(item)}
    if isinstance(item, torch.Tensor):
        return _heatmap(item)
    if isinstance(item, Mapping):
        if "html" in item:
            value = item["html"]
            if isinstance(value, TrustedHTML):
                return {"type": "html", "html": str(value)}
            return {"type": "text", "text": str(value)}
        if "text" in item:
            return {"type": "text", "text": str(item["text"])}
        if "contexts" in item:
            return {"type": "contexts", "title": str(item.get("title", "Top activations")),
                    "rows": [[str(c), float(a)] for c, a in item["contexts"]]}
        if "heatmap" in item:
            return _heatmap(item["heatmap"], item.get("rows"), item.get("cols"), str(item.get("title", "")))
        raise ValueError(f"a details dict needs one of 'html', 'text', 'contexts', 'heatmap'; got {sorted(item)}")
    if isinstance(item, Sequence) and all(isinstance(x, Sequence) and not isinstance(x, str) and len(x) == 2
                                          and isinstance(x[0], str) for x in item):
        return {"type": "contexts", "title": "Top activations", "rows": [[str(c), float(a)] for c, a in item]}
    raise ValueError(f"unsupported details entry of type {type(item).__name__}")


def normalize_details(details: Mapping[str, Any] | None) -> dict[str, list[dict[str, Any]]]:
    """``{node_id: [block, …]}`` from :func:`render_html`'s ``details`` (see there).

    Raises:
        ValueError: an entry of an unsupported form.
    """
    out: dict[str, list[dict[str, Any]]] = {}
    for node_id, entry in (details or {}).items():
        items = entry if isinstance(entry, list) and entry and all(
            isinstance(x, (Mapping, str, torch.Tensor)) for x in entry) else [entry]
        out[str(node_id)] = [_detail_block(x) for x in items]
    return out


_STYLE = """
body{margin:0;font:13px system-ui,sans-serif;color:#222;display:flex;height:100vh}
#main{flex:1;overflow:auto}#panel{width:340px;border-left:1px solid #ccc;padding:10px;overflow:auto;
background:#fafafa}#panel h2{font-size:15px;margin:4px 0 8px}#panel table{border-collapse:collapse;width:100%}
#panel td,#panel th{border-bottom:1px solid #e4e4e4;padding:2px 4px;text-align:left;vertical-align:top}
#panel .num{text-align:right;font-variant-numeric:tabular-nums}#panel a{cursor:pointer;color:#1558b0}
.node{cursor:pointer;stroke:#333;stroke-width:.7}.node.sel{stroke:#000;stroke-width:2.5}
.link{stroke-linecap:round}.dim{opacity:.08}.token{font-size:12px}.axis{font-size:11px;fill:#666}
#legend span{display:inline-block;margin-right:10px}#legend i{display:inline-block;width:10px;height:10px;
border-radius:50%;margin-right:3px;vertical-align:middle}h1{font-size:15px;margin:8px 10px}
.heat td{width:14px;height:14px;padding:0;border:none}.ctx{font-family:monospace;white-space:pre-wrap}
"""

_SCRIPT = r"""
(function(){
const D = JSON.parse(document.getElementById('graph-data').textContent);
const NS = 'http://www.w3.org/2000/svg';
const COLORS = {'cross layer transcoder':'#4c78a8','lorsa':'#f58518','mlp reconstruction error':'#9d9d9d',
  'lorsa error':'#bab0ac','embedding':'#54a24b','bias':'#b279a2','logit':'#e45756'};
const g = D.graph, tokens = g.metadata.prompt_tokens;
const byId = {}; g.nodes.forEach(n => byId[n.node_id] = n);
const show = t => String(t).replace(/\n/g,'\u23ce').replace(/\t/g,'\u21e5');
const num = x => (x === null || x === undefined) ? '\u2013' : (+x).toPrecision(4);
function el(tag, attrs, parent, ns){
  const e = ns ? document.createElementNS(NS, tag) : document.createElement(tag);
  for (const k in (attrs||{})) e.setAttribute(k, attrs[k]);
  if (parent) parent.appendChild(e); return e;
}
function txt(tag, text, parent, attrs){ const e = el(tag, attrs, parent); e.textContent = text; return e; }
// rows: per layer an attention row (Lorsa heads, Lorsa errors, attention-side biases) below an MLP row,
// "E" at the bottom, logits on top; columns: bias column + one per token
const logitLayer = Math.max(-1, ...g.nodes.filter(n => n.feature_type === 'logit').map(n => +n.layer));
const isAttn = n => n.feature_type === 'lorsa' || n.feature_type === 'lorsa error' ||
  (n.feature_type === 'bias' && !/\.(mlp|transcoder)/.test(n.clerp) && +n.layer < logitLayer - 1);
const rowKey = n => n.layer === 'E' ? 'E' : n.layer + (isAttn(n) ? 'a' : 'm');
const rowOrder = k => k === 'E' ? -1 : 2 * parseInt(k) + (k.endsWith('a') ? 0 : 1);
function rowName(k){
  if (k === 'E') return 'emb';
  const s = parseInt(k);
  if (s === logitLayer) return 'logits';
  if (s === logitLayer - 1) return 'final';
  return 'L' + s + (k.endsWith('a') ? ' attn' : ' mlp');
}
const layers = [...new Set(g.nodes.map(rowKey))].sort((a,b) => rowOrder(a) - rowOrder(b));
const hasBias = g.nodes.some(n => n.feature_type === 'bias');
const col = n => n.feature_type === 'bias' ? 0 : n.ctx_idx + (hasBias ? 1 : 0);
const nCols = tokens.length + (hasBias ? 1 : 0);
const cells = {};
g.nodes.forEach(n => { const k = rowKey(n) + '|' + col(n); (cells[k] = cells[k] || []).push(n); });
let maxCell = 1; for (const k in cells) maxCell = Math.max(maxCell, cells[k].length);
const colW = Math.max(70, Math.min(maxCell, 12) * 13 + 20), rowH = 54, left = 70, top = 20, R = 5;
const W = left + nCols * colW + 20, H = top + layers.length * rowH + 60;
const pos = {};
for (const k in cells) {
  const list = cells[k].sort((a,b) => (a.influence ?? 1) - (b.influence ?? 1));
  const [layer, c] = [k.slice(0, k.lastIndexOf('|')), +k.slice(k.lastIndexOf('|') + 1)];
  const perRow = Math.max(1, Math.floor((colW - 16) / 13));
  list.forEach((n, i) => {
    const r = Math.floor(i / perRow), j = i % perRow, inRow = Math.min(perRow, list.length - r * perRow);
    pos[n.node_id] = [left + c * colW + colW / 2 + (j - (inRow - 1) / 2) * 13,
                      top + (layers.length - 1 - layers.indexOf(layer)) * rowH + rowH / 2 - r * 12];
  });
}
const svg = el('svg', {width: W, height: H, id: 'graph'}, document.getElementById('main'), true);
layers.forEach((l, i) => {
  const y = top + (layers.length - 1 - i) * rowH + rowH / 2;
  el('line', {x1: left, x2: W - 20, y1: y, y2: y, stroke: '#eee'}, svg, true);
  const t = el('text', {x: 6, y: y + 4, class: 'axis'}, svg, true);
  t.textContent = rowName(l);
});
for (let c = 0; c < nCols; c++) {
  const label = (hasBias && c === 0) ? '\u03a3 bias' : show(tokens[c - (hasBias ? 1 : 0)]);
  const t = el('text', {x: left + c * colW + colW / 2, y: H - 30, 'text-anchor': 'middle', class: 'token'}, svg, true);
  t.textContent = label;
}
const maxW = Math.max(1e-30, ...g.links.map(l => Math.abs(l.weight)));
const linkEls = [];
const gl = el('g', {}, svg, true), gn = el('g', {}, svg, true);
g.links.forEach(l => {
  const a = pos[l.source], b = pos[l.target];
  const e = el('line', {x1: a[0], y1: a[1], x2: b[0], y2: b[1], class: 'link', 'data-source': l.source,
    'data-target': l.target, stroke: l.weight >= 0 ? '#2ca02c' : '#d62728',
    'stroke-width': (0.3 + 4 * Math.abs(l.weight) / maxW).toFixed(3), 'stroke-opacity': 0.45}, gl, true);
  linkEls.push(e);
});
const nodeEls = {};
g.nodes.forEach(n => {
  const p = pos[n.node_id];
  const e = el('circle', {cx: p[0], cy: p[1], r: n.feature_type === 'logit' ? R + 1 : R, class: 'node',
    fill: COLORS[n.feature_type] || '#000', 'data-node-id': n.node_id}, gn, true);
  txt('title', n.clerp || n.node_id, e); e.addEventListener('click', () => select(n.node_id));
  nodeEls[n.node_id] = e;
});
const legend = document.getElementById('legend');
Object.keys(COLORS).forEach(k => { const s = el('span', {}, legend); el('i', {style: 'background:' + COLORS[k]}, s);
  s.appendChild(document.createTextNode(k)); });
function edgeTable(title, list, key, panel){
  txt('h3', title, panel);
  const t = el('table', {class: 'edges'}, panel);
  list.sort((a,b) => Math.abs(b.weight) - Math.abs(a.weight)).slice(0, 10).forEach(l => {
    const tr = el('tr', {}, t), other = byId[l[key]];
    const a = txt('a', other ? (other.clerp || other.node_id) : l[key], el('td', {}, tr));
    a.addEventListener('click', () => select(l[key]));
    txt('td', num(l.weight), tr, {class: 'num'});
  });
  if (!list.length) txt('p', 'none', panel);
}
function block(b, panel){
  if (b.type === 'html') { const d = el('div', {class: 'detail-html'}, panel); d.innerHTML = b.html; return; }
  if (b.type === 'text') { txt('pre', b.text, panel, {class: 'detail-text'}); return; }
  if (b.title) txt('h3', b.title, panel);
  if (b.type === 'contexts') {
    const t = el('table', {class: 'contexts'}, panel);
    const m = Math.max(1e-30, ...b.rows.map(r => Math.abs(r[1])));
    b.rows.forEach(r => { const tr = el('tr', {}, t);
      const shade = (0.6 * Math.abs(r[1]) / m).toFixed(3);
      txt('td', show(r[0]), tr, {class: 'ctx', style: 'background:rgba(245,133,24,' + shade + ')'});
      txt('td', num(r[1]), tr, {class: 'num'}); });
  } else if (b.type === 'heatmap') {
    const t = el('table', {class: 'heat'}, panel);
    const flat = b.values.flat().filter(v => v !== null), m = Math.max(1e-30, ...flat.map(Math.abs));
    const hr = el('tr', {}, t); el('td', {}, hr); b.cols.forEach(c => txt('td', show(c), hr, {class: 'axis'}));
    b.values.forEach((row, i) => { const tr = el('tr', {}, t); txt('td', show(b.rows[i]), tr, {class: 'axis'});
      row.forEach((v, j) => { const a = v === null ? 0 : Math.abs(v) / m;
        const c = v !== null && v < 0 ? '214,39,40' : '31,119,180';
        txt('td', '', tr, {style: 'background:rgba(' + c + ',' + a.toFixed(3) + ')',
          title: show(b.rows[i]) + ' \u2192 ' + show(b.cols[j]) + ': ' + num(v)}); }); });
  }
}
function select(id){
  const n = byId[id], panel = document.getElementById('panel');
  if (!n) return;
  panel.textContent = '';
  Object.values(nodeEls).forEach(e => e.classList.remove('sel')); nodeEls[id].classList.add('sel');
  linkEls.forEach(e => e.classList.toggle('dim', e.dataset.source !== id && e.dataset.target !== id));
  txt('h2', n.clerp || n.node_id, panel, {id: 'panel-title'});
  const t = el('table', {class: 'props'}, panel);
  const tok = n.feature_type === 'bias' ? '(all positions)' : show(tokens[n.ctx_idx]);
  [['node_id', n.node_id], ['type', n.feature_type], ['layer', n.layer], ['position', n.ctx_idx + ' ' + tok],
   ['activation', num(n.activation)], ['influence (cumulative)', num(n.influence)]].concat(
   n.feature_type === 'logit' ? [['probability', num(n.token_prob)]] : []).forEach(([k, v]) => {
    const tr = el('tr', {}, t); txt('th', k, tr); txt('td', String(v), tr, {class: 'prop-' + k.split(' ')[0]}); });
  edgeTable('Incoming', g.links.filter(l => l.target === id), 'source', panel);
  edgeTable('Outgoing', g.links.filter(l => l.source === id), 'target', panel);
  (D.details[id] || []).forEach(b => block(b, panel));
  const h = '#node=' + encodeURIComponent(id);
  if (location.hash !== h) { try { history.replaceState(null, '', h); } catch (e) { /* opaque origin */ } }
}
function click(id){ if (nodeEls[id]) nodeEls[id].dispatchEvent(new MouseEvent('click', {bubbles: true})); }
function fromHash(){
  const m = /^#node=(.+)$/.exec(location.hash);
  if (m) { click(decodeURIComponent(m[1])); return true; }
  return false;
}
window.addEventListener('hashchange', fromHash);
if (!fromHash() && g.qParams.clickedId) click(g.qParams.clickedId);
document.body.setAttribute('data-ready', '1');
})();
"""


def render_html(
    graph: Graph,
    prune_result: PruneResult | None = None,
    *,
    tokenizer: Any = None,
    details: Mapping[str, Any] | None = None,
    path: str | os.PathLike[str] | None = None,
    title: str | None = None,
    clicked: str | None = None,
    **export_kwargs: Any,
) -> str:
    """One self-contained HTML page (no network access) drawing the pruned graph; see the module docstring.

    Args:
        graph: an attribution graph.
        prune_result: the nodes and edges to draw (default: :func:`.scores.prune` with the default
            thresholds, or ``node_threshold`` / ``edge_threshold`` in ``export_kwargs``).
        tokenizer: decodes the prompt and logit tokens (default labels ``tok{id}``).
        details: optional ``{node_id: entry}`` shown in a node's panel (node ids as
            :func:`node_ids`). An entry is one of, or a list of: a :class:`TrustedHTML` (or
            ``{"html": TrustedHTML(…)}``) — an HTML snippet inserted as is, the only way to put
            markup in the page; a plain ``str``, ``{"text": str}`` or ``{"html": str}`` — shown as
            text (escaped: ``<script>`` or ``<img onerror=…>`` in it is displayed, never run); a list
            of ``(context, activation)`` pairs or
            ``{"contexts": [...], "title": str}`` — a table of top activating contexts, shaded by
            activation; a 1-/2-D tensor or ``{"heatmap": values, "rows": labels, "cols": labels,
            "title": str}`` — a heatmap (e.g. a Lorsa head's z pattern, query × key positions).
        path: also write the page there (parents created).
        title: the page title (default: the prompt).
        clicked: a node id whose panel opens on load (stored as ``qParams.clickedId``; a
            ``#node=<id>`` URL hash takes precedence).
        export_kwargs: passed to :func:`to_neuronpedia` (``slug`` defaults to ``"graph"``).

    Returns:
        The HTML text. The graph is embedded as JSON in ``<script type="application/json"
        id="graph-data">`` with ``<``, ``>`` and ``&`` escaped, so token strings cannot close the script.

    Raises:
        ValueError: a ``details`` entry of an unsupported form, ``clicked`` not among the drawn nodes,
            or :func:`to_neuronpedia`'s errors.
        ArgumentError: a ``details`` key that is no node id of ``graph``.
    """
    export_kwargs.setdefault("slug", "graph")
    data = to_neuronpedia(graph, prune_result, tokenizer=tokenizer, **export_kwargs)
    known = {n["node_id"] for n in data["nodes"]}
    if clicked is not None:
        if clicked not in known:
            raise ValueError(f"clicked={clicked!r} is not an exported node")
        data["qParams"]["clickedId"] = clicked
    given = normalize_details(details)
    unknown = sorted(set(given) - set(node_ids(graph)))
    if unknown:  # a typo or another graph's ids: refused, never silently left out
        raise ArgumentError(f"render_html(details=...): {len(unknown)} node id(s) not in this graph, e.g. "
                            f"{unknown[:3]}; ids are node_ids(graph) (circuit-tracer's scheme, e.g. '2_145_5')")
    blocks = {k: v for k, v in given.items() if k in known}  # nodes pruned from the drawing: nothing to show
    payload = embed_json({"graph": data, "details": blocks})
    page_title = html.escape(title if title is not None else (graph.prompt or "attribution graph"))
    n_nodes, n_links = len(data["nodes"]), len(data["links"])
    text = ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<title>{page_title}</title><style>{_STYLE}</style></head><body>"
            f"<div id='main'><h1>{page_title} — {n_nodes} nodes, {n_links} links</h1><div id='legend'></div></div>"
            "<div id='panel'><p>Click a node.</p></div>"
            f"<script type='application/json' id='graph-data'>{payload}</script>"
            f"<script>{_SCRIPT}</script></body></html>\n")
    if path is not None:
        from .._atomic import atomic_file

        atomic_file(path, text.encode("utf-8"))  # a sibling temporary renamed over `path`
    return text
