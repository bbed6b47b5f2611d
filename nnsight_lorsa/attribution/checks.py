"""Scores and checks of an attribution graph that run a model: circuit metrics by ablation in the real
model, and the exactness checks by intervention in the frozen model (the pure tensor math — influence,
pruning, replacement/completeness scores — is :mod:`.scores`).

*Circuit metrics* (:func:`circuit_metrics`; *From Tokenization to Attribution Graphs* §11, after Ameisen et al.
2025, *Circuit Tracing*): the circuit is the pruned graph's feature nodes. Ablations run in the *real* model with
the replacements spliced with their error terms (:class:`~nnsight_lorsa.envoy.replacement_model.ReplacementModel`,
``error=True``): an unedited run is the model itself, and zeroing a feature propagates through everything
downstream, nonlinearities included. Completeness (§11.1): ``1 − Δℓ(all circuit features ablated) / Δℓ(baseline)``;
minimality (§11.2): each feature's effect ``Δℓ(baseline) − Δℓ(feature ablated)`` and the fraction with ``|effect| ≥
min_effect · |Δℓ(baseline)|``; faithfulness (§11.3): Spearman's ρ between each feature's influence and ``|effect|``.
``Δℓ`` is the demeaned logit of the graph's most likely target token at the last position, or a logit difference
with ``incorrect_token``.

*Checks* (circuit-tracer's verification): an edge ``s → t`` is the change in ``t`` when ``s``'s
contribution is added once more with every other node's output held fixed — a forward of the
frozen model with ``M[s] = 2`` (:func:`.trace.frozen_logits`), independent of the backward passes
that computed the graph (:func:`intervention_edges`); with every multiplier 1 the frozen model with
its error nodes is the model (:func:`replacement_logits`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .._checks import is_int, is_real
from .._repr import FieldsRepr
from ..envoy.nnsight_internals import vocabulary_size
from ..envoy.replacement_model import ReplacementModel, check_replacement_model
from ..envoy.targets import Feature, LorsaHead, index_at
from ..errors import ArgumentError, ConfigMismatchError
from .graph import HOST, LORSA, TRANSCODER, Graph
from .layout import Layout
from .scores import PruneResult, check_pruned_graph
from .trace import frozen_logits, prepare


@dataclass(repr=False)
class CircuitMetrics(FieldsRepr):
    """``baseline``/``ablated``: Δℓ without / with the whole circuit ablated; ``effects: (n,)`` single
    ablations; ``attribution: (n,)`` the features' influence; ``completeness``, ``minimal_fraction``,
    ``faithfulness`` (Spearman ρ) as in the module docstring; ``nodes``: the circuit's graph node ids.

    Source: *From Tokenization to Attribution Graphs* §11 (completeness, minimality, faithfulness); Ameisen et al.
    2025, *Circuit Tracing*.
    """

    baseline: float
    ablated: float
    completeness: float
    effects: torch.Tensor
    attribution: torch.Tensor
    minimal_fraction: float
    faithfulness: float
    nodes: torch.Tensor


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation (Pearson correlation of the ranks; ties broken by order)."""
    if a.numel() < 2:
        return float("nan")
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-30))


def _targets(graph: Graph, node_ids: torch.Tensor) -> list[tuple[Any, int]]:
    out: list[tuple[Any, int]] = []
    n = graph.nodes
    for i in node_ids.tolist():
        layer, idx, pos = int(n.layer[i]), int(n.index[i]), int(n.pos[i])
        target = LorsaHead(layer, idx) if int(n.kind[i]) == LORSA else Feature(layer, idx, "transcoder")
        out.append((target, pos))
    return out


def _delta(replacement: ReplacementModel, ids: torch.Tensor, ablations: list[list[tuple[Any, int]]], token: int,
           incorrect: int | None) -> torch.Tensor:
    """Δℓ for each ablation set (one invoke each; the empty set is the baseline)."""
    model = replacement.model
    saved = []
    every = [t for group in ablations for t, _ in group]  # each invoke through the same splices (the baseline too):
    with torch.no_grad(), model.trace() as tracer:       # a splice replaces the rows of the invokes that call it
        for group in ablations:
            with tracer.invoke(ids[None]):
                ordered = sorted(group, key=lambda tp: replacement.order(tp[0]))
                replacement.prepare(every)
                for target, pos in ordered:  # zero ablation of the target at its position
                    tensor, cols = replacement.location(target)
                    tensor[index_at(cols, pos)] = 0
                saved.append(model.get(replacement.adapter.lm_head_path).output[0, -1].save())
    out = []
    for last in saved:
        if incorrect is None:
            out.append(last[token] - last.mean())
        else:
            out.append(last[token] - last[incorrect])
    return torch.stack(out).float().cpu()


def circuit_metrics(replacement: ReplacementModel, graph: Graph, pruned: PruneResult, *,
                    incorrect_token: int | None = None, min_effect: float = 0.01, chunk: int = 16) -> CircuitMetrics:
    """Completeness, minimality and faithfulness of the pruned circuit (module docstring; paper
    *From Tokenization to Attribution Graphs* §11, after Ameisen et al. 2025), by zero-ablating its feature nodes in
    the real model.

    Args:
        replacement: the :class:`~nnsight_lorsa.envoy.replacement_model.ReplacementModel` the graph
            was built with (spliced with error terms whatever its ``error``).
        graph, pruned: the graph and its :func:`prune` result (the circuit: kept features / heads).
        incorrect_token: measure ``logit[top token] − logit[incorrect_token]`` instead of the
            demeaned logit.
        min_effect: the minimality threshold, a fraction of ``|Δℓ(baseline)|``.
        chunk: single ablations per trace (one invoke each).

    Returns:
        :class:`CircuitMetrics` (logit units; ``effects``/``attribution`` ``(n_circuit,)``).

    Raises:
        ArgumentError: before the model runs: ``replacement`` not a ReplacementModel, ``graph`` / ``pruned`` not a
            Graph / PruneResult, ``pruned`` not of this graph (another node count), ``incorrect_token`` not None
            or a token id of the model's vocabulary (``-1`` is no id: it would read the last logit), ``min_effect``
            not a finite number ≥ 0, ``chunk`` not an int ≥ 1.

    Source: *From Tokenization to Attribution Graphs* §11 (completeness, minimality, faithfulness); Ameisen et al.
    2025, *Circuit Tracing*.
    """
    replacement = check_replacement_model(replacement, "circuit_metrics")
    check_pruned_graph(graph, pruned, "circuit_metrics")
    vocab = vocabulary_size(replacement.model)
    if incorrect_token is not None and (not is_int(incorrect_token) or incorrect_token < 0
                                        or (vocab is not None and incorrect_token >= vocab)):
        raise ArgumentError(f"circuit_metrics(incorrect_token=...) must be None or a token id in [0, {vocab}), got "
                            f"{incorrect_token!r}")
    if not is_real(min_effect) or not math.isfinite(min_effect) or min_effect < 0:
        raise ArgumentError(f"circuit_metrics(min_effect=...) must be a finite number >= 0, got {min_effect!r}")
    if not is_int(chunk) or chunk < 1:
        raise ArgumentError(f"circuit_metrics(chunk=...) must be an int >= 1, got {chunk!r}")
    replacement = ReplacementModel(replacement.model, lorsas=replacement.lorsas,
                                   transcoders=replacement.transcoders, error=True, adapter=replacement.adapter)
    kind = graph.nodes.kind
    nodes = (pruned.node_mask & ((kind == TRANSCODER) | (kind == LORSA))).nonzero().flatten()
    token = int(graph.nodes.index[graph.logit_ids[graph.logit_probs.argmax()]])
    members = _targets(graph, nodes)
    ids = graph.tokens
    base, whole = _delta(replacement, ids, [[], members], token, incorrect_token).tolist()
    singles = [[m] for m in members]
    effects = torch.cat([base - _delta(replacement, ids, singles[i:i + chunk], token, incorrect_token)
                         for i in range(0, len(singles), chunk)]) if singles else torch.zeros(0, device=HOST)
    attribution = pruned.node_influence[nodes].float()
    completeness = 1.0 - whole / base if base != 0 else float("nan")
    minimal = float((effects.abs() >= min_effect * abs(base)).float().mean()) if len(effects) else float("nan")
    return CircuitMetrics(baseline=base, ablated=whole, completeness=completeness, effects=effects,
                          attribution=attribution, minimal_fraction=minimal,
                          faithfulness=spearman(attribution, effects.abs()), nodes=nodes)


def layout_target_nodes(layout: Layout) -> torch.Tensor:
    """Layout node index of each target row (features, then logits)."""
    nf, ns = layout.n_features, layout.n_sources
    return torch.cat([torch.arange(nf, device=HOST), torch.arange(ns, ns + layout.n_logits, device=HOST)])


def intervention_edges(replacement: ReplacementModel, graph: Graph, sources: torch.Tensor, *,
                       batch_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Edges from graph nodes ``sources: (k,)`` into every computed target row, two ways: by
    intervention in the frozen model (``M[s] = 2``, one batch row per source, ``batch_size`` at a
    time) and read from the graph's adjacency (:meth:`.graph.Graph.edge_values`: from the causal blocks if the
    graph keeps them, no dense ``n_nodes²`` matrix).

    Returns ``(by_intervention, from_graph)``, both ``(n_rows, k)`` with rows the graph's computed
    targets in node order. ``replacement`` must be the one the graph was built with; the frozen model runs in
    the dtype the graph was computed in (its ``meta["dtype_option"]``, :func:`.attribute.attribute`'s
    ``dtype=``), so the two agree to that dtype's rounding.

    Raises:
        ConfigMismatchError: the graph's ``meta["dtype_option"]`` names no floating torch dtype.
    """
    option = graph.meta.get("dtype_option")
    dtype = None if option is None else getattr(torch, str(option).removeprefix("torch."), None)
    if option is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigMismatchError(f"the graph's meta['dtype_option'] is {option!r}, not a floating torch dtype "
                                  "(a graph from attribute() records the dtype= it was computed in)")
    prepared = prepare(replacement, graph.tokens, targets=graph.nodes.index[graph.logit_ids],
                       zero_positions=int(graph.meta.get("zero_positions", 0)), dtype=dtype)
    layout, mhsa, adapter, model = prepared.layout, prepared.mhsa, prepared.adapter, replacement.model
    rows = graph.feature_rows.nonzero().flatten()
    col_of = {int(n): i for i, n in enumerate(layout_target_nodes(layout))}
    target_cols = torch.tensor([col_of[int(graph.layout_ids[r])] for r in rows], device=HOST)
    sources = sources.to(HOST, torch.long)  # graph node ids, possibly made on the model's device
    src_cols = graph.layout_ids[sources]
    out = []
    for chunk in src_cols.split(batch_size):
        M = torch.ones(chunk.numel() + 1, layout.n_sources, device=HOST)  # the frozen pass moves it
        M[torch.arange(1, chunk.numel() + 1, device=HOST), chunk] += 1.0
        _, T = frozen_logits(model, adapter, layout, mhsa, M, dtype)
        out.append((T[1:] - T[:1]).T.to(HOST)[target_cols])
    return torch.cat(out, dim=1), graph.edge_values(rows[:, None], sources[None, :])


def replacement_logits(replacement: ReplacementModel, prompt: Any) -> torch.Tensor:
    """``(1, pos, vocab)`` logits of the frozen replacement model with its error nodes on ``prompt``
    (text or ids) — equal to the model's own (check 3 of the exactness tests)."""
    prepared = prepare(replacement, prompt)
    logits, _ = frozen_logits(replacement.model, prepared.adapter, prepared.layout, prepared.mhsa)
    return logits
