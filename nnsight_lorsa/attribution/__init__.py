"""Attribution graphs over the replacement model (Lorsa + transcoders), exact to the bias.

Frozen-Jacobian attribution in the sense of circuit-tracer (Ameisen et al. 2025, *Circuit Tracing*: attribution
graphs, pruning, evaluation; ``circuit_tracer/attribution/attribute.py``): with patterns, norm scales and activations
frozen at the prompt's values, the replacement model is linear in its nodes' writes, and every
target's incoming edges sum to its value — bias nodes included. One front door::

    rm = ReplacementModel(model, lorsas=lorsa_set, transcoders=transcoder_set)
    graph = attribute(rm, "ROMEO:\\nBut soft, what")              # nnsight engine (two traces)
    cache = cache_for_attribution(rm, "ROMEO:\\nBut soft, what")  # one clean trace, saved
    same = attribute(rm, cache)                                   # cached engine, no model forward
    kept = prune(graph)                                           # or attribute(..., prune=PruneConfig())

``targets=`` says which logits the graph is of (None: the top logits to cumulative probability 0.95, at
most 10; ``LogitTargets(max_n=, cumulative_prob=)``; token ids or strings). ``memory="auto" | "fast" |
"lean"`` trades speed for memory on long prompts; ``prune=`` prunes while building (no dense
``n_nodes²`` adjacency). ``graph_scores`` / ``circuit_metrics`` score a graph and its circuit,
``qk_attribution`` decomposes a Lorsa head's attention score into node pairs, ``to_neuronpedia`` /
``save_neuronpedia`` export it (the HTML viewer is :func:`nnsight_lorsa.viz.render_html`). Node kinds are
``Graph.TRANSCODER`` … ``Graph.LOGIT`` (also constants of :mod:`.graph`); the exactness checks
are :func:`.checks.intervention_edges` and :func:`.checks.replacement_logits`.
"""

from .attribute import attribute
from .blocks import BlockAdjacency
from .budget import MemoryEstimate, estimate_memory
from .checks import CircuitMetrics, circuit_metrics
from .engine import cache_for_attribution
from .export import save_neuronpedia, to_neuronpedia
from .graph import Graph
from .intervened import IntervenedAttribution
from .logit_targets import LogitTargets
from .qk import QKAttribution, qk_attribution
from .scores import PruneConfig, PruneResult, graph_scores, prune
from .trace import AttributionCache

__all__ = ["AttributionCache", "BlockAdjacency", "CircuitMetrics", "Graph", "IntervenedAttribution", "LogitTargets",
           "MemoryEstimate", "PruneConfig", "PruneResult", "QKAttribution", "attribute",
           "cache_for_attribution", "circuit_metrics", "estimate_memory", "graph_scores", "prune", "qk_attribution",
           "save_neuronpedia",
           "to_neuronpedia"]
