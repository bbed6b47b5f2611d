"""A pruned graph assembled from sparse rows, never holding a dense ``n_nodes²`` adjacency.

The same influence pruning as :func:`.prune.prune` (circuit-tracer's rules), run on the stored
entries (:class:`.sparse_rows.SparseRows`): node influence on the logits, node threshold, edge
scores on the node-pruned matrix, edge threshold, dangling features and errors removed. Only the
kept nodes become the :class:`.graph.Graph`; each kept target's edges from everything else (dropped
sources and the entries a row did not keep) are summed into its ``residual``, so that
``Σ adjacency[t] + residual[t]`` is still the target's value — a real check, since the values come
from the forward and the edges from the backward passes.
"""

from __future__ import annotations

from typing import Any

import torch

from .graph import Graph
from .layout import Layout
from .nodes import ATTN_ERROR, BIAS, EMBEDDING, LOGIT, LORSA, MLP_ERROR, TRANSCODER
from .prune import find_threshold
from .schedule import RowScheduler


def assemble_pruned(layout: Layout, scheduler: RowScheduler, values: torch.Tensor, *, node_threshold: float,
                    edge_threshold: float, prompt: str, meta: dict[str, Any]) -> Graph:
    """The pruned :class:`Graph` of the rows in ``scheduler`` (see the module docstring)."""
    nf, ns, nl = layout.n_features, layout.n_sources, layout.n_logits
    sp = scheduler.sparse()
    scheduler.rows = [sp]  # the chunks' copies can go (12 B per stored entry)
    row_node, lw_row = scheduler.row_nodes()
    kind = layout.nodes.kind
    n_all = ns + nl
    visited = torch.zeros(n_all, dtype=torch.bool)
    visited[row_node] = True
    in_graph = visited.clone()
    in_graph[nf:] = True  # errors, embeddings, biases, logits are always graph nodes
    rows_local = sp.local_rows()
    entry_node = row_node.to(torch.int32)[rows_local]  # int32 per stored entry, as the columns
    in_graph_entry = in_graph[sp.col]
    # 1. node influence on the graph (unvisited features are not graph nodes, as in the dense path)
    infl_src = sp.influence(row_node, lw_row, keep=in_graph_entry)
    infl = torch.cat([infl_src, torch.zeros(nl, dtype=torch.float64)])
    infl[~in_graph] = 0
    always = (kind == EMBEDDING) | (kind == BIAS) | (kind == LOGIT)
    node_mask = in_graph & ((infl >= find_threshold(infl[in_graph], node_threshold)) | always)
    # 2. edge scores on the node-pruned matrix
    lw = torch.zeros(n_all, dtype=torch.float64)
    lw[row_node] = lw_row
    alive = node_mask[sp.col] & node_mask[entry_node] & (sp.val != 0)
    infl_pruned = torch.cat([sp.influence(row_node, lw_row, keep=alive), torch.zeros(nl, dtype=torch.float64)])
    den = torch.zeros(sp.n_rows, dtype=torch.float64).index_add(0, rows_local[alive], sp.val[alive].double().abs())
    score = torch.zeros(sp.val.numel(), dtype=torch.float64)
    score[alive] = sp.val[alive].double().abs() / den[rows_local[alive]].clamp_min(1e-30) * (
        infl_pruned + lw)[entry_node[alive]]
    edge = alive & (score >= find_threshold(score[alive], edge_threshold)) if bool(alive.any()) else alive
    # 3. dangling features / errors, until stable
    feature = (kind == TRANSCODER) | (kind == LORSA)
    prunable = feature | (kind == MLP_ERROR) | (kind == ATTN_ERROR)
    while True:
        old = node_mask.clone()
        has_out = torch.zeros(n_all, dtype=torch.bool)
        has_out[sp.col[edge]] = True
        has_in = torch.zeros(n_all, dtype=torch.bool)
        has_in[entry_node[edge]] = True
        node_mask &= ~prunable | has_out
        node_mask &= ~feature | has_in
        node_mask |= always & in_graph
        edge &= node_mask[sp.col] & node_mask[entry_node]
        if torch.equal(old, node_mask):
            break
    # 4. the kept nodes' graph: every stored edge among them, the rest of each row in its residual
    kept = node_mask.nonzero().flatten()
    index = torch.full((n_all,), -1, dtype=torch.long)
    index[kept] = torch.arange(kept.numel())
    n = kept.numel()
    among = node_mask[sp.col] & node_mask[entry_node]
    adjacency = torch.zeros(n, n, dtype=sp.val.dtype)
    adjacency[index[entry_node[among]], index[sp.col[among]]] = sp.val[among]
    outside = torch.zeros(sp.n_rows, dtype=torch.float64).index_add(
        0, rows_local[~among], sp.val[~among].double()) + sp.residual
    residual = torch.zeros(n, dtype=torch.float64)
    computed = torch.zeros(n, dtype=torch.bool)
    row_kept = node_mask[row_node]
    residual[index[row_node[row_kept]]] = outside[row_kept]
    computed[index[row_node[row_kept]]] = True
    all_values = torch.full((n_all,), float("nan"), dtype=values.dtype)
    all_values[:nf] = values[:nf].cpu()
    all_values[ns:] = values[nf:].cpu()
    meta = {**meta, "pruned": {"node_threshold": node_threshold, "edge_threshold": edge_threshold,
                               "keep_mass": scheduler.keep_mass, "stored_entries": int(sp.val.numel())}}
    return Graph(tokens=layout.tokens, nodes=layout.nodes.select(kept), adjacency=adjacency, values=all_values[kept],
                 logit_probs=layout.logit_probs, feature_rows=computed, layout_ids=kept, prompt=prompt, meta=meta,
                 residual=residual.to(adjacency.dtype))
