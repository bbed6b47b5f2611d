"""Frozen-Jacobian attribution graphs over the replacement model (Lorsa + transcoders), exact to
the bias (paper ``004_…`` §9–11, GUIDE §4).

``attribute`` builds a :class:`Graph` (``attribute_from_cache`` the same from an
:class:`AttributionCache` of tensors, without running the model); ``prune`` / ``graph_scores`` apply circuit-tracer's
influence rules; ``qk_attribution`` decomposes a Lorsa head's attention score into node pairs;
``circuit_metrics`` ablates the pruned circuit in the real model; ``to_neuronpedia`` /
``render_html`` export it. Check functions live in :mod:`.verify`.
"""

from .attribute import attribute
from .cached import AttributionCache, attribute_from_cache, cache_for_attribution
from .circuit_metrics import CircuitMetrics, circuit_metrics
from .graph import Graph
from .neuronpedia import save_neuronpedia, to_neuronpedia
from .nodes import ATTN_ERROR, BIAS, EMBEDDING, LOGIT, LORSA, MLP_ERROR, TRANSCODER, NodeTable
from .prune import PruneResult, graph_scores, prune
from .qk import QKAttribution, qk_attribution
from .viewer import render_html

__all__ = ["ATTN_ERROR", "BIAS", "EMBEDDING", "LOGIT", "LORSA", "MLP_ERROR", "TRANSCODER", "AttributionCache",
           "CircuitMetrics", "Graph", "NodeTable", "PruneResult", "QKAttribution", "attribute", "attribute_from_cache",
           "cache_for_attribution", "circuit_metrics", "graph_scores", "prune", "qk_attribution", "render_html",
           "save_neuronpedia", "to_neuronpedia"]
