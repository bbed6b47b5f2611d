"""Circuit metrics of a pruned graph by ablation in the real model (paper ``004_…`` §11).

The circuit is the pruned graph's feature nodes (transcoder features and Lorsa heads, each at its
position). Ablations run in the *real* model with the replacements spliced with their error terms
(:class:`~nnsight_lorsa.patching.ReplacementModel`, ``error=True``): an unedited run is the model itself,
and zeroing a feature propagates through everything downstream, nonlinearities included.

- completeness (§11.1): ``1 − Δℓ(all circuit features ablated) / Δℓ(baseline)``;
- minimality (§11.2): the effect ``Δℓ(baseline) − Δℓ(feature i ablated)`` of each circuit feature
  alone, and the fraction of features whose ``|effect| ≥ min_effect · |Δℓ(baseline)|``;
- faithfulness (§11.3): Spearman's ρ between each feature's attribution (its influence on the
  logits in the graph) and ``|effect|``.

``Δℓ`` is the demeaned logit of the graph's most likely target token at the last position (what the
graph's logit node attributes), or a logit difference when ``incorrect_token`` is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._repr import FieldsRepr
from ..envoy.replacement_model import ReplacementModel
from ..envoy.targets import Bound, Feature, LorsaHead
from ..patching.experiments import logits_envoy
from ..patching.interventions import ablate
from .graph import Graph
from .nodes import LORSA, TRANSCODER
from .prune import PruneResult


@dataclass(repr=False)
class CircuitMetrics(FieldsRepr):
    """``baseline``/``ablated``: Δℓ without / with the whole circuit ablated; ``effects: (n,)`` single
    ablations; ``attribution: (n,)`` the features' influence; ``completeness``, ``minimal_fraction``,
    ``faithfulness`` (Spearman ρ) as in the module docstring; ``nodes``: the circuit's graph node ids."""

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
    with torch.no_grad(), model.trace() as tracer:
        for group in ablations:
            with tracer.invoke(ids[None]):
                ordered = sorted(group, key=lambda tp: replacement.order(tp[0]))
                replacement.prepare([t for t, _ in ordered])
                for target, pos in ordered:
                    ablate(Bound(target, replacement), "zero", None, pos)
                saved.append(logits_envoy(replacement).output[0, -1].save())
    out = []
    for last in saved:
        if incorrect is None:
            out.append(last[token] - last.mean())
        else:
            out.append(last[token] - last[incorrect])
    return torch.stack(out).float().cpu()


def circuit_metrics(model: Any, graph: Graph, pruned: PruneResult, *, lorsas: Any = None, transcoders: Any = None,
                    incorrect_token: int | None = None, min_effect: float = 0.01, chunk: int = 16) -> CircuitMetrics:
    """Completeness, minimality and faithfulness of the pruned circuit (module docstring).

    ``lorsas``/``transcoders``: the :class:`~nnsight_lorsa.LorsaSet` / :class:`~nnsight_lorsa.TranscoderSet`
    the graph was built with.
    """
    replacement = ReplacementModel(model, lorsas=lorsas, transcoders=transcoders, error=True)
    kind = graph.nodes.kind
    nodes = (pruned.node_mask & ((kind == TRANSCODER) | (kind == LORSA))).nonzero().flatten()
    token = int(graph.nodes.index[graph.logit_ids[graph.logit_probs.argmax()]])
    members = _targets(graph, nodes)
    ids = graph.tokens
    base, whole = _delta(replacement, ids, [[], members], token, incorrect_token).tolist()
    singles = [[m] for m in members]
    effects = torch.cat([base - _delta(replacement, ids, singles[i:i + chunk], token, incorrect_token)
                         for i in range(0, len(singles), chunk)]) if singles else torch.zeros(0)
    attribution = pruned.node_influence[nodes].float()
    completeness = 1.0 - whole / base if base != 0 else float("nan")
    minimal = float((effects.abs() >= min_effect * abs(base)).float().mean()) if len(effects) else float("nan")
    return CircuitMetrics(baseline=base, ablated=whole, completeness=completeness, effects=effects,
                          attribution=attribution, minimal_fraction=minimal,
                          faithfulness=spearman(attribution, effects.abs()), nodes=nodes)
