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
* Lorsa error: ``AE_{L}_{p}``, ``L``, ``-2``, ``AE_{L}-{p}`` (circuit-tracer's frontend keys an error node by
  ``{layer}_{feature}_{ctx_idx}__err_idx_{n_pos - ctx_idx}``: ``-1``, the MLP error's, gave the Lorsa error and the
  MLP error of one layer and position one key);
* bias ``b``: ``B_{b}_0``, ``L`` (``n`` for the final norm / unembedding), ``-3 - 2·b``, ``B_{b}-0``.

A Lorsa head of layer ``L`` shares the row of layer ``L``'s transcoder features (circuit-tracer's
frontend draws one row per integer ``layer``); bias nodes sum over positions and sit at ``ctx_idx`` 0
(the final-norm / unembedding biases at ``layer`` ``n``).
``feature_type``: :data:`.graph.KIND_NAMES`. ``influence``: the node's *cumulative* influence rank
score (:attr:`.scores.PruneResult.cumulative`, what circuit-tracer writes there; ``null`` on logit nodes, as
circuit-tracer writes them); ``activation``:
feature activation / Lorsa head ``z``, the error vector's norm for error nodes (circuit-tracer: None),
``None`` for the rest. ``intervened``: ``true`` on a node edited in the traced pass the graph is of
(:attr:`.graph.NodeTable.intervened`; absent otherwise; such a node is exported whatever its influence,
as embeddings and logits are). ``metadata.prompt``: the graph's prompt, or —
for a graph built from token ids — ``tokenizer.decode(tokens)`` (as circuit-tracer's ``attribute`` does).

:func:`nnsight_lorsa.viz.render_html` draws what :func:`to_neuronpedia` exports as one self-contained
HTML page (the graph viewer lives in :mod:`nnsight_lorsa.viz.graph_viewer`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any

from .._checks import check_instance, is_real
from ..errors import ArgumentError, NonFiniteError
from .graph import (
    ATTN_ERROR,
    BIAS,
    EMBEDDING,
    GRAPH_HINT,
    HOST,
    KIND_NAMES,
    LOGIT,
    LORSA,
    MLP_ERROR,
    TRANSCODER,
    Graph,
)
from .scores import PRUNED_HINT, PruneResult, prune

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
        ArgumentError: a graph without logit nodes.
    """
    ids = graph.logit_ids
    if ids.numel() == 0:
        raise ArgumentError(f"graph: no logit nodes (of {graph.n_nodes} nodes), so its number of layers is unknown: "
                            "export a graph that attribute() made (it has at least one logit node)")
    return int(graph.nodes.layer[ids[0]])


@functools.cache
def _byte_level_chars() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the printable character each byte is written as -> the byte
    (the ``bytes_to_unicode`` table of openai/gpt-2 ``src/encoder.py``, which Hugging Face's ``ByteLevel`` uses)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    chars = list(kept)
    shifted = 0
    for b in range(256):
        if b not in kept:  # the other bytes, in order, as the characters from 256 on
            kept.append(b)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(kept, chars, strict=True)}


def _bytes_label(raw: bytes) -> str:
    """``raw`` as text, each byte that starts no complete UTF-8 character written ``<0xNN>``."""
    out, i = [], 0
    while i < len(raw):
        for j in range(min(len(raw), i + 4), i, -1):
            try:
                out.append(raw[i:j].decode("utf-8"))
                i = j
                break
            except UnicodeDecodeError:
                continue
        else:
            out.append(f"<0x{raw[i]:02X}>")
            i += 1
    return "".join(out)


def decode_token(tokenizer: Any, token_id: int, *, partial_bytes: bool = False) -> str:
    """``tokenizer.decode([token_id])``, or ``"tok{token_id}"`` without a tokenizer.

    A token that holds part of a UTF-8 character (byte-level BPE splits one over tokens) decodes alone as
    ``"\ufffd"``, the same for every such token. With ``partial_bytes`` it is labelled by its bytes instead, each
    byte of no complete character written ``<0xNN>`` (``" <0xE2><0x80>"``), as SentencePiece's byte-fallback tokens
    are already named; other tokenizers' tokens keep their decoded text. The graph export leaves it off: its files
    keep circuit-tracer's per-token ``decode`` strings (the viewer draws whole characters, ``viz.token_pieces``);
    the OV logit lens turns it on (a single token, no neighbour to complete it).

    Raises:
        ArgumentError: ``token_id`` outside the tokenizer's vocabulary ``[0, len(tokenizer))`` (a
            tokenizer decodes it as ``''``, which would label the node with nothing); ``tokenizer`` neither None nor
            an object with ``decode``.

    Source: ours (circuit-tracer labels with ``tokenizer.decode`` alone).
    """
    if tokenizer is None:
        return f"tok{token_id}"
    if not callable(getattr(tokenizer, "decode", None)):
        raise ArgumentError(f"tokenizer must be a tokenizer (with decode, e.g. model.tokenizer) or None for tok<id> "
                            f"labels, got a {type(tokenizer).__name__}")
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else getattr(tokenizer, "vocab_size", None)
    if isinstance(size, int) and not 0 <= int(token_id) < size:
        raise ArgumentError(f"token id {int(token_id)} is outside the tokenizer's vocabulary [0, {size}) "
                            "(it would decode as ''); pass the model's own tokenizer, or tokenizer=None for "
                            "tok<id> labels")
    text = str(tokenizer.decode([int(token_id)]))
    if not partial_bytes or "\ufffd" not in text or not hasattr(tokenizer, "convert_ids_to_tokens"):
        return text
    raw = tokenizer.convert_ids_to_tokens(int(token_id))
    if not isinstance(raw, str) or not raw:
        return text
    if re.fullmatch(r"(<0x[0-9A-Fa-f]{2}>)+", raw):  # SentencePiece byte fallback: already its bytes
        return raw
    alphabet = _byte_level_chars()
    if all(ch in alphabet for ch in raw):  # byte-level BPE: the token is its bytes, one character each
        return _bytes_label(bytes(alphabet[ch] for ch in raw))
    return text


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
        return f"AE_{layer}_{pos}", -2, f"AE_{layer}-{pos}"
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
        A JSON-serialisable dict; every ``links[*].weight`` is ``float(graph.edge_values(t, s))`` (the
        direct effect of source on target, in units of the target's pre-activation / demeaned logit), read
        for the kept edges only — from the causal blocks if the graph keeps them: memory ``O(edges +
        nodes)``, never a dense ``n_nodes²`` matrix.

    Raises:
        ConfigMismatchError: (a ``ValueError``) thresholds outside ``[0, 1]``.
        ArgumentError: (a ``ValueError``) a graph without logit nodes, a prune result whose node mask or edge
            index does not fit the graph, a prompt or logit token id outside ``tokenizer``'s vocabulary;
            ``graph`` not a :class:`~.graph.Graph`, ``prune_result`` not None or a :class:`~.scores.PruneResult`,
            ``sparsity_threshold`` not a number in ``[0, 1]``, ``slug`` / ``creator_name`` not a str, ``scan``
            neither None nor a str, ``tokenizer`` neither None nor an object with ``decode``
            (:func:`decode_token`).
        NonFiniteError: a NaN / inf weight on an exported edge, or NaN / inf logit probabilities (strict JSON
            holds neither).

    Source: circuit-tracer ``frontend/graph_models.py`` (field names, node ids).
    """
    check_instance(graph, Graph, "to_neuronpedia", "graph", GRAPH_HINT)
    check_instance(slug, str, "to_neuronpedia", "slug")
    check_instance(creator_name, str, "to_neuronpedia", "creator_name")
    if scan is not None:
        check_instance(scan, str, "to_neuronpedia", "scan", " (or None: the graph's model_type)")
    if prune_result is not None:
        check_instance(prune_result, PruneResult, "to_neuronpedia", "prune_result", PRUNED_HINT)
    if not is_real(sparsity_threshold) or not 0.0 <= sparsity_threshold <= 1.0:
        raise ArgumentError(f"to_neuronpedia(sparsity_threshold=...) must be a number in [0, 1] (a feature-density "
                            f"filter; 1 hides nothing), got {sparsity_threshold!r}")
    if prune_result is None:
        if isinstance(graph.meta, dict) and graph.meta.get("pruned"):
            # the full graph is gone: influence and pruning can only be redone on the kept subgraph
            warnings.warn(
                "to_neuronpedia: this graph was pruned while it was built (attribute(..., prune=...)), so exporting "
                f"prunes it again at node_threshold={node_threshold}, edge_threshold={edge_threshold} on the kept "
                "nodes, with influence recomputed there: fewer nodes and other influence scores than circuit-tracer's "
                "export of the full graph (to_neuronpedia(full, prune(full)) gives those)", stacklevel=2)
        prune_result = prune(graph, node_threshold, edge_threshold)
    N = graph.n_nodes
    e = prune_result.edge_index.to(HOST)  # a prune result made elsewhere (a device) reads like the graph's
    if prune_result.node_mask.shape != (N,) or e.dim() != 2 or e.shape[0] != 2 or (
            e.numel() and not (int(e.min()) >= 0 and int(e.max()) < N)):
        raise ArgumentError(f"to_neuronpedia(prune_result=...): node mask {tuple(prune_result.node_mask.shape)} / "
                            f"edge index {tuple(e.shape)} (node ids in [0, {N}) expected) do not fit a graph of "
                            f"{N} nodes: pass prune(graph) of this graph")
    n, L = graph.nodes, n_layers_of(graph)
    last = int(graph.tokens.numel()) - 1
    triples = [_ids(graph, i, L, last) for i in range(N)]
    ids = [t[0] for t in triples]
    kept = prune_result.node_mask.to(HOST).bool()
    t, s = e.long()
    edges = kept[t] & kept[s]  # the kept edges between kept nodes, in edge_index's (target-major) order
    targets, sources = t[edges], s[edges]
    weights = graph.edge_values(targets, sources).tolist()  # from the causal blocks if kept: no n² matrix
    bad = [i for i, w in enumerate(weights) if not math.isfinite(w)]
    if bad or not bool(graph.logit_probs.isfinite().all()):  # strict JSON has neither; no silent null either
        where = (f"edge {ids[int(sources[bad[0]])]} -> {ids[int(targets[bad[0]])]} = {weights[bad[0]]}" if bad
                 else f"logit probabilities {graph.logit_probs.tolist()}")
        raise NonFiniteError(f"to_neuronpedia: the graph holds NaN or inf values ({where}): a graph built by hand? "
                             "attribute() and Graph.load refuse them", tensor="edges" if bad else "logit_probs")
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
            # influence null, as circuit-tracer writes logit nodes (create_graph_files.py: no influence given; its
            # frontend keeps logits whatever the slider) — a cumulative score here read 1.0000000000000002
            node.update(ctx_idx=n_pos - 1, token_prob=p, is_target_logit=i == top_logit,
                        clerp=f'Output "{tok}" (p={p:.3f})', influence=None)
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

    Raises:
        ArgumentError: ``path`` not a str / ``os.PathLike``; :func:`to_neuronpedia`'s errors (nothing written).

    Source: circuit-tracer ``frontend/graph_models.py`` (field names, node ids).
    """
    from .._atomic import atomic_file
    from ..formats.files import check_path

    check_path(path, "save_neuronpedia", "a .json file")
    p = Path(path)
    kwargs.setdefault("slug", p.stem)
    data = to_neuronpedia(graph, prune_result, **kwargs)
    return atomic_file(p, json.dumps(data, allow_nan=False, indent=1, ensure_ascii=False).encode("utf-8"))
