"""Comparison of one case's two graphs (torch + safetensors only; imported by ``run.py``).

circuit-tracer's node order: ``[selected features (rows of active_features[selected_features]) | MLP error nodes,
layer-major (n_f + layer·n_pos + pos) | embeddings (pos) | logits (its target order)]``. Ours: a node table of
``(kind, layer, pos, index)`` with the kinds ``ours.json["kinds"]`` names. A node of ours maps to theirs by:
feature ``(TRANSCODER, L, p, f)`` ↔ their ``(L, p, f)``; ``(MLP_ERROR, L, p)`` ↔ their error ``(L, p)`` for
``p ≥ 1``; ``(EMBEDDING, p)`` ↔ their embedding ``p``; ``(LOGIT, token)`` ↔ their logit of that token. Left out:
our bias nodes (circuit-tracer has none) and the MLP error nodes at position 0 (with ``zero_positions=1`` ours
carry the MLP output there, theirs carry nothing).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

PRUNE_THRESHOLDS = ((0.8, 0.98), (0.5, 0.9))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b| (in float64)."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)


class Case:
    """One case folder's two graphs, and the map from our nodes to theirs (−1: no node of theirs)."""

    def __init__(self, case: Path, ours_stem: str = "ours") -> None:
        self.meta = json.loads((case / "theirs.json").read_text())
        self.theirs = load_file(str(case / "theirs.safetensors"))
        self.ours = load_file(str(case / f"{ours_stem}.safetensors"))
        self.ours_meta = json.loads((case / f"{ours_stem}.json").read_text())
        self.k = self.ours_meta["kinds"]
        n_layers, n_pos = self.meta["n_layers"], self.meta["n_pos"]
        t = self.theirs
        self.their_features = t["active_features"][t["selected_features"]]
        n_f = len(self.their_features)
        err0 = n_f
        emb0 = n_f + n_layers * n_pos
        log0 = emb0 + n_pos
        self.their_logits = t["logit_ids"].tolist()
        n_theirs = t["adjacency"].shape[0]
        if n_theirs != log0 + len(self.their_logits):
            raise ValueError(f"their adjacency has {n_theirs} nodes, the layout {log0 + len(self.their_logits)}")
        self.their_selected = {tuple(r): j for j, r in enumerate(self.their_features.tolist())}
        k = self.k
        idx = []
        for kind, layer, pos, index in zip(*(self.ours[f].tolist() for f in ("kind", "layer", "pos", "index")),
                                           strict=True):
            if kind == k["TRANSCODER"]:
                idx.append(self.their_selected.get((layer, pos, index), -1))
            elif kind == k["MLP_ERROR"]:
                idx.append(err0 + layer * n_pos + pos if pos >= 1 else -1)
            elif kind == k["EMBEDDING"]:
                idx.append(emb0 + pos)
            elif kind == k["LOGIT"]:
                idx.append(log0 + self.their_logits.index(index) if index in self.their_logits else -1)
            else:  # bias nodes
                idx.append(-1)
        self.their_index = torch.tensor(idx)
        self.shared = (self.their_index >= 0).nonzero().flatten()


def compare_graph(case: Path, ours_stem: str = "ours") -> dict[str, Any]:
    """Node sets, activations, error norms, logit targets / probabilities and edges of the two graphs."""
    c = Case(case, ours_stem)
    t, o, k = c.theirs, c.ours, c.k
    kind, layer, pos, index = o["kind"], o["layer"], o["pos"], o["index"]
    res: dict[str, Any] = {"n_theirs_active": int(len(t["active_features"])),
                           "n_theirs_selected": len(c.their_features),
                           "n_ours_features": int((kind == k["TRANSCODER"]).sum())}
    ours_features = {(int(a), int(b), int(i)): j for j, (kk, a, b, i) in
                     enumerate(zip(kind.tolist(), layer.tolist(), pos.tolist(), index.tolist(), strict=True))
                     if kk == k["TRANSCODER"]}
    their_active = {tuple(r): j for j, r in enumerate(t["active_features"].tolist())}
    if len(t["selected_features"]) == len(t["active_features"]):  # full graph: the feature sets
        res["same_feature_set"] = set(ours_features) == set(their_active)
        res["only_ours"] = sorted(set(ours_features) - set(their_active))[:5]
        res["only_theirs"] = sorted(set(their_active) - set(ours_features))[:5]
    else:  # a feature budget: the features whose rows were computed
        rows = {key for key, j in ours_features.items() if bool(o["feature_rows"][j])}
        res["same_visited_set"] = rows == set(c.their_selected)
        res["visited_both"] = len(rows & set(c.their_selected))
        res["n_ours_rows"] = len(rows)
    common = [key for key in their_active if key in ours_features]
    if common:
        a_theirs = t["activation_values"][[their_active[key] for key in common]]
        res["activation_rel"] = rel(o["activation"][[ours_features[key] for key in common]], a_theirs)
    # our error node's activation is its error vector's norm
    err = (kind == k["MLP_ERROR"]) & (pos >= 1)
    res["error_norm_rel"] = rel(o["activation"][err], t["error_vectors"][layer[err], pos[err]].norm(dim=-1))
    ours_logits = index[kind == k["LOGIT"]].tolist()
    res["same_logit_targets"] = ours_logits == c.their_logits
    if set(ours_logits) == set(c.their_logits):
        order = [ours_logits.index(tok) for tok in c.their_logits]
        res["logit_prob_rel"] = rel(o["logit_probs"][order], t["logit_probs"])
    else:
        res["logit_targets_ours"], res["logit_targets_theirs"] = ours_logits, c.their_logits
    sh = c.shared
    a_ours = o["adjacency"][sh][:, sh].double()
    a_theirs = t["adjacency"][c.their_index[sh]][:, c.their_index[sh]].double()
    scale = float(a_theirs.abs().max())
    diff = (a_ours - a_theirs).abs()
    res["shared_nodes"] = int(len(sh))
    res["edges_nonzero_theirs"] = int((a_theirs != 0).sum())
    res["adj_maxdiff_over_maxedge"] = float(diff.max()) / scale
    names = {k["TRANSCODER"]: "feat", k["MLP_ERROR"]: "err", k["EMBEDDING"]: "emb", k["LOGIT"]: "logit"}
    sk = kind[sh]
    res["by_kind"] = {f"{names[s]}->{names[tk]}": float(diff[sk == tk][:, sk == s].max()) / scale
                      for tk in (k["TRANSCODER"], k["LOGIT"]) for s in (k["TRANSCODER"], k["MLP_ERROR"], k["EMBEDDING"])
                      if diff[sk == tk][:, sk == s].numel()}
    ti, si = divmod(int(diff.argmax()), diff.shape[1])
    tj, sj = int(sh[ti]), int(sh[si])
    res["worst_edge"] = {"target": [int(kind[tj]), int(layer[tj]), int(pos[tj]), int(index[tj])],
                         "source": [int(kind[sj]), int(layer[sj]), int(pos[sj]), int(index[sj])],
                         "ours": float(a_ours[ti, si]), "theirs": float(a_theirs[ti, si])}
    return res


def row_sums(case: Path) -> dict[str, float]:
    """Row-sum closure of both graphs over our computed feature rows and the logit rows, by the row's mass.

    Ours: ``|Σ_s A[t, s] + residual_t − value_t| / (Σ_s |A[t, s]| + |residual_t|)`` (bias nodes included; the residual
    is the unkept features' share under a feature budget, 0 otherwise). Theirs: the same with their row on the
    shared nodes plus the edges of the sources it has no node for — our bias nodes and position-0 MLP errors — and
    our residual (circuit-tracer keeps neither); a gap left is a share of the value no node of theirs carries."""
    c = Case(case)
    o, t, k = c.ours, c.theirs, c.k
    kind, pos = o["kind"], o["pos"]
    adj = o["adjacency"].double()
    missing = (kind == k["BIAS"]) | ((kind == k["MLP_ERROR"]) & (pos == 0))
    rows = [j for j in range(len(kind)) if (kind[j] == k["TRANSCODER"] and bool(o["feature_rows"][j]))
            or kind[j] == k["LOGIT"]]
    ours_gap, their_gap = 0.0, 0.0
    for j in rows:
        if c.their_index[j] < 0:
            continue
        value, residual = float(o["values"][j]), float(o["residual"][j])
        mass = float(adj[j].abs().sum()) + abs(residual)
        ours_gap = max(ours_gap, abs(float(adj[j].sum()) + residual - value) / mass)
        theirs = float(t["adjacency"][c.their_index[j]].double().sum()) + float(adj[j][missing].sum()) + residual
        their_gap = max(their_gap, abs(theirs - value) / mass)
    return {"ours": ours_gap, "theirs_closed": their_gap, "ours_edge_sum_error_max": float(
        o["edge_sum_error"].nan_to_num().max())}


def compare_prune(case: Path) -> dict[str, Any]:
    """Our ``prune`` / ``graph_scores`` against circuit-tracer's ``prune_graph`` / ``compute_graph_scores``: kept
    nodes and edges on the shared nodes, and the scores."""
    c = Case(case)
    sh, ti = c.shared, c.their_index[c.shared]
    ours = load_file(str(case / "ours_prune.safetensors"))
    theirs = load_file(str(case / "theirs_prune.safetensors"))
    n = len(c.ours["kind"])
    out: dict[str, Any] = {}
    for nt, et in PRUNE_THRESHOLDS:
        om, tm = ours[f"node_mask_{nt}_{et}"][sh], theirs[f"node_mask_{nt}_{et}"][ti]
        ei = ours[f"edge_index_{nt}_{et}"]
        oe = torch.zeros(n, n, dtype=torch.bool)
        oe[ei[0], ei[1]] = True
        oe = oe[sh][:, sh]
        te = theirs[f"edge_mask_{nt}_{et}"][ti][:, ti]
        out[f"{nt}/{et}"] = {
            "nodes_ours": int(om.sum()), "nodes_theirs": int(tm.sum()), "nodes_both": int((om & tm).sum()),
            "edges_ours": int(oe.sum()), "edges_theirs": int(te.sum()), "edges_both": int((oe & te).sum()),
            "ours_bias_nodes_kept": int(ours[f"node_mask_{nt}_{et}"][c.ours["kind"] == c.k["BIAS"]].sum())}
    so, st = c.ours_meta["scores"], c.meta["scores"]
    out["scores_ours"], out["scores_theirs"] = so, st
    out["scores_abs_diff"] = {s: abs(so[s] - st[s]) for s in so}
    return out
