"""The attribution-graph viewer: one self-contained HTML page per pruned graph (no network access).

:func:`render_html` draws the nodes :func:`~nnsight_lorsa.attribution.export.to_neuronpedia` exports:
one column per token position (the tokens label the x axis; bias nodes, which sum over positions, get
their own column on the left; a column is as wide as its busiest cell needs, so positions holding only
an embedding stay narrow), one row per layer's attention and one per its MLP (embeddings at the bottom,
logits on top), links as lines whose width is proportional to ``|weight|`` (green positive, red
negative), nodes coloured by kind with a colour legend above the graph. A token that decodes on its own
to ``\ufffd`` (part of a character byte-level BPE split over tokens) is labelled with its piece of the
decoded prompt (:func:`~.page.token_pieces`): the character on the token that completes it, nothing on the
others (a ``\ufffd`` that no token completes — one in the prompt, or a byte of ids cut mid-character — on the
token after it), so the labels join to the decoded prompt; the JSON keeps circuit-tracer's per-token
``prompt_tokens``.

Zoom: the toolbar's buttons (fit to width, ``−``, ``+``, ``1:1``) and Ctrl + mouse wheel (or a
trackpad pinch) zoom around the pointer. First paint: the whole graph fitted to the window's width
when that keeps nodes at least :data:`MIN_FIRST_SCALE` of their size, else that scale with the view
scrolled to the right end — the last positions, where the logits and the last token's Lorsa heads sit.
The row names (``emb``, ``L2 attn``, …, ``logits``) stay at the left edge as the graph scrolls.

Clicking a node opens a side panel with its label, activation, influence, its strongest incoming and
outgoing links and optional per-node details (top activating contexts, a Lorsa head's z pattern,
text; HTML only as :class:`TrustedHTML`). Opening the file with ``#node=<node_id>`` opens that node's
panel on load.

The page's script is the package file ``nnsight_lorsa/viz/static/graph.js`` (inlined into the page).
SVG elements carry ``data-node-id`` and ``data-kind`` (the ``feature_type``; ``circle.node``) and
``data-source`` / ``data-target`` (``line.link``) attributes; the side panel is ``#panel``, the
legend ``#legend``, the zoom toolbar ``#zoom`` (its scale in ``#zoom-level`` and in the SVG's
``data-scale``).
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..attribution.export import node_ids, to_neuronpedia
from ..attribution.graph import Graph
from ..attribution.scores import PruneResult
from ..errors import ArgumentError, NonFiniteError
from .page import embed_json, static_text, token_pieces

__all__ = ["MIN_FIRST_SCALE", "TrustedHTML", "normalize_details", "render_html"]

#: the smallest zoom of the first paint (1 = the layout's size: 5 px node radius, 13 px token labels)
MIN_FIRST_SCALE = 0.6


def _heatmap(values: Any, rows: Sequence[str] | None = None, cols: Sequence[str] | None = None,
             title: str = "") -> dict[str, Any]:
    """A heatmap block of ``values`` (a real 1-D / 2-D array or tensor, any float dtype and device: shown as fp32).

    Raises:
        ArgumentError: complex, bool or ``meta`` values, a shape that is not 1-D / 2-D, or labels that do not fit.
        NonFiniteError: an inf value (NaN is shown as an empty cell), or an fp64 one beyond float32's range."""
    if isinstance(values, torch.Tensor) and (values.is_complex() or values.dtype == torch.bool or values.is_meta):
        raise ArgumentError(f"a heatmap needs real numbers on a device with data, got a {values.dtype} tensor on "
                            f"{values.device}")
    try:
        v = torch.as_tensor(values, device="cpu")
    except (TypeError, ValueError, RuntimeError) as e:
        raise ArgumentError(f"a heatmap needs a 1-D or 2-D array of numbers, got {type(values).__name__}: {e}") from e
    if v.is_complex() or v.dtype == torch.bool:
        raise ArgumentError(f"a heatmap needs real numbers, got {v.dtype}")
    v = v.to(torch.float32)
    if v.dim() == 1:
        v = v[None]
    if v.dim() != 2:
        raise ArgumentError(f"a heatmap needs a 1-D or 2-D array, got shape {tuple(v.shape)}")
    r = [str(x) for x in rows] if rows is not None else [str(i) for i in range(v.shape[0])]
    c = [str(x) for x in cols] if cols is not None else [str(i) for i in range(v.shape[1])]
    if len(r) != v.shape[0] or len(c) != v.shape[1]:
        raise ArgumentError(f"heatmap labels {len(r)}×{len(c)} do not fit values {tuple(v.shape)}")
    if bool(torch.isinf(v).any()):
        i, j = (int(x) for x in torch.isinf(v).nonzero()[0])
        raise NonFiniteError(f"heatmap {title!r}: values[{i}, {j}] (row {r[i]!r}, column {c[j]!r}) is inf (or beyond "
                             "float32's range): its colour scale would show every other cell as 0", tensor="heatmap")
    vals = [[None if x != x else float(x) for x in row] for row in v.tolist()]
    return {"type": "heatmap", "title": title, "rows": r, "cols": c, "values": vals}


def _contexts(rows: Any, title: str) -> dict[str, Any]:
    """A contexts block: ``(text, activation)`` rows; a NaN activation is shown as "–" (``null``).

    Raises:
        ArgumentError: a row that is no (text, number) pair. NonFiniteError: an infinite activation (the shading is
            relative to the largest)."""
    out = []
    for k, row in enumerate(rows):
        try:
            text, act = row
            a = float(act)
        except (TypeError, ValueError) as e:
            raise ArgumentError(f"contexts {title!r}: row {k} is no (text, activation) pair: {row!r}") from e
        if math.isinf(a):
            raise NonFiniteError(f"contexts {title!r}: row {k} ({str(text)[:40]!r}) has activation {a}: the shading "
                                 "is relative to the largest activation", tensor="contexts")
        out.append([str(text), None if a != a else a])
    return {"type": "contexts", "title": title, "rows": out}


class TrustedHTML(str):
    """An HTML snippet the caller vouches for: :func:`render_html` inserts it into the page as is.

    Every other string in ``details`` (a bare ``str``, ``{"text": …}``, ``{"html": str}``) is shown as
    text — escaped, never run. Wrap only markup you wrote yourself (not token strings, model
    outputs or anything read from a file of unknown origin)::

        details = {node_id: TrustedHTML("<em>copies the previous token</em>")}

    Source: ours (an offline page for the graph JSON of circuit-tracer ``frontend/graph_models.py``).
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
            return _contexts(item["contexts"], str(item.get("title", "Top activations")))
        if "heatmap" in item:
            return _heatmap(item["heatmap"], item.get("rows"), item.get("cols"), str(item.get("title", "")))
        raise ArgumentError(f"render_html(details=...): a details dict needs one of 'html', 'text', 'contexts', "
                            f"'heatmap'; got keys {sorted(item)}")
    if isinstance(item, Sequence) and all(isinstance(x, Sequence) and not isinstance(x, str) and len(x) == 2
                                          and isinstance(x[0], str) for x in item):
        return _contexts(item, "Top activations")
    raise ArgumentError(f"render_html(details=...): unsupported details entry of type {type(item).__name__} (a "
                        "string, TrustedHTML, a dict with 'html' / 'text' / 'contexts' / 'heatmap', or (text, "
                        "activation) pairs)")


def normalize_details(details: Mapping[str, Any] | None) -> dict[str, list[dict[str, Any]]]:
    """``{node_id: [block, …]}`` from :func:`render_html`'s ``details`` (see there).

    Raises:
        ArgumentError: ``details`` not None or a mapping.
        ValueError: an entry of an unsupported form (ArgumentError, a ValueError, for a heatmap that cannot be
            shown: complex, bool or ``meta`` values, not 1-D / 2-D, labels that do not fit).
        NonFiniteError: an inf in a heatmap or a contexts table's activations (``tensor="heatmap"`` /
            ``"contexts"``; NaN is shown as empty / "–"). It was json's bare ``ValueError`` from the page's JSON.
    """
    if details is not None and not isinstance(details, Mapping):
        raise ArgumentError(f"render_html(details=...) must be None or a mapping {{node_id: block}}, got a "
                            f"{type(details).__name__}")
    out: dict[str, list[dict[str, Any]]] = {}
    for node_id, entry in (details or {}).items():
        items = entry if isinstance(entry, list) and entry and all(
            isinstance(x, (Mapping, str, torch.Tensor)) for x in entry) else [entry]
        out[str(node_id)] = [_detail_block(x) for x in items]
    return out

_STYLE = """
body{margin:0;font:13px system-ui,sans-serif;color:#222;display:flex;height:100vh}
#main{flex:1;overflow:auto;position:relative}#panel{width:340px;border-left:1px solid #ccc;padding:10px;
overflow:auto;background:#fafafa}#panel h2{font-size:15px;margin:4px 0 8px}
#panel table{border-collapse:collapse;width:100%}
#panel td,#panel th{border-bottom:1px solid #e4e4e4;padding:2px 4px;text-align:left;vertical-align:top}
#panel .num{text-align:right;font-variant-numeric:tabular-nums}#panel a{cursor:pointer;color:#1558b0}
.node{cursor:pointer;stroke:#333;stroke-width:.7}.node.sel{stroke:#000;stroke-width:2.5}
.link{stroke-linecap:round}.dim{opacity:.08}.token{font-size:12px}.axis{font-size:11px;fill:#666}
#top{position:sticky;left:0;top:0;background:#fff;z-index:2;padding:0 10px 4px;border-bottom:1px solid #eee}
#legend span{display:inline-block;margin-right:10px;white-space:nowrap}
#legend i{display:inline-block;width:10px;height:10px;border-radius:50%;margin-right:3px;vertical-align:middle}
#legend i.edge{width:16px;height:3px;border-radius:0}
#zoom{margin:4px 0}#zoom button{margin-right:4px;min-width:28px}#zoom-level{color:#666;margin-left:6px}
h1{font-size:15px;margin:0;padding:8px 0 4px}
.heat td{width:14px;height:14px;padding:0;border:none}.ctx{font-family:monospace;white-space:pre-wrap}
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
        prune_result: the nodes and edges to draw (default: :func:`~nnsight_lorsa.attribution.prune` with the default
            thresholds, or ``node_threshold`` / ``edge_threshold`` in ``export_kwargs``).
        tokenizer: decodes the prompt and logit tokens (default labels ``tok{id}``).
        details: optional ``{node_id: entry}`` shown in a node's panel (node ids as
            :func:`~nnsight_lorsa.attribution.export.node_ids`). An entry is one of, or a list of: a
            :class:`TrustedHTML` (or ``{"html": TrustedHTML(…)}``) — an HTML snippet inserted as is, the only way to put
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
        export_kwargs: passed to :func:`~nnsight_lorsa.attribution.export.to_neuronpedia` (``slug`` defaults
            to ``"graph"``).

    Returns:
        The HTML text. The graph is embedded as JSON in ``<script type="application/json"
        id="graph-data">`` with ``<``, ``>`` and ``&`` escaped, so token strings cannot close the script.

    Raises:
        ArgumentError: (a ``ValueError``) a ``details`` entry of an unsupported form, ``clicked`` not among the
            drawn nodes, a ``details`` key that is no node id of ``graph``, ``details`` not a mapping, ``path`` not
            None, a str or ``os.PathLike``, ``title`` not None or a str; ``to_neuronpedia``'s errors.
        NonFiniteError: an inf in a ``details`` heatmap or contexts table (:func:`normalize_details`).

    Source: ours (an offline page for the graph JSON of circuit-tracer ``frontend/graph_models.py``).
    """
    if path is not None:
        from ..formats.files import check_path

        check_path(path, "render_html", "an HTML file")
    if title is not None and not isinstance(title, str):
        raise ArgumentError(f"render_html(title=...) must be None (the prompt) or a str, got a {type(title).__name__}")
    export_kwargs.setdefault("slug", "graph")
    data = to_neuronpedia(graph, prune_result, tokenizer=tokenizer, **export_kwargs)
    known = {n["node_id"] for n in data["nodes"]}
    if clicked is not None:
        if not isinstance(clicked, str) or clicked not in known:
            raise ArgumentError(f"render_html(clicked={clicked!r}): not an exported node (of the pruned graph's "
                                f"{len(known)} nodes)")
        data["qParams"]["clickedId"] = clicked
    given = normalize_details(details)
    unknown = sorted(set(given) - set(node_ids(graph)))
    if unknown:  # a typo or another graph's ids: refused, never silently left out
        raise ArgumentError(f"render_html(details=...): {len(unknown)} node id(s) not in this graph, e.g. "
                            f"{unknown[:3]}; ids are node_ids(graph) (circuit-tracer's scheme, e.g. '2_145_5')")
    blocks = {k: v for k, v in given.items() if k in known}  # nodes pruned from the drawing: nothing to show
    labels = list(data["metadata"]["prompt_tokens"])  # circuit-tracer's: each token decoded on its own
    if tokenizer is not None:  # a character split over tokens (byte-level BPE) shown whole, on its last token
        pieces = token_pieces(tokenizer, graph.tokens.tolist())  # a U+FFFD no token completes: on the next one
        labels = [p if "\ufffd" in t or "\ufffd" in p else t for t, p in zip(labels, pieces, strict=True)]
    payload = embed_json({"graph": data, "details": blocks, "minFirstScale": MIN_FIRST_SCALE, "labels": labels})
    page_title = html.escape(title if title is not None else (graph.prompt or "attribution graph"))
    n_nodes, n_links = len(data["nodes"]), len(data["links"])
    text = ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<title>{page_title}</title><style>{_STYLE}</style></head><body>"
            f"<div id='main'><div id='top'><h1>{page_title} — {n_nodes} nodes, {n_links} links</h1>"
            "<div id='zoom'><button id='zoom-fit' title='fit the graph to the window width'>fit width</button>"
            "<button id='zoom-out' title='zoom out (Ctrl + wheel)'>\u2212</button>"
            "<button id='zoom-in' title='zoom in (Ctrl + wheel)'>+</button>"
            "<button id='zoom-reset' title='the layout at its own size'>1:1</button>"
            "<span id='zoom-level'></span></div><div id='legend'></div></div></div>"
            "<div id='panel'><p>Click a node.</p></div>"
            f"<script type='application/json' id='graph-data'>{payload}</script>"
            f"<script>{static_text('graph.js')}</script></body></html>\n")
    if path is not None:
        from .._atomic import atomic_file

        atomic_file(path, text.encode("utf-8"))  # a sibling temporary renamed over `path`
    return text
