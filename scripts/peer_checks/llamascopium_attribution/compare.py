"""Comparison of one case's two sides (torch + safetensors only; imported by ``run.py``).

Nodes are matched as tuples ``(kind, layer, pos, index)``: ``("lorsa"|"tc", L, pos, feature)``,
``("attn_err"|"mlp_err", L, pos, -1)``, ``("embed", -1, pos, -1)``, ``("logit", -1, -1, vocab id)``; our bias nodes
are ``("bias", L, -1, name)``. Their QK leaves for biases (per position: ``…sae.hook_b_D``, ``…attn.hook_b_O``,
``…mlp.hook_b_out``, ``…sae.hook_b_Q`` / ``b_K``) are ``("tbias", L, pos, "<attn|mlp>.<b_X>")``.

Relative differences: values by the largest |value| of that kind; edges by the largest |edge| of their graph on the
common nodes; row-sum closures by the largest |value|; QK marginals by the largest |marginal| of ours, pairs by our
largest |pair| (per traced head).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

#: edge / QK differences above TOL x their scale are listed (the probe's threshold)
TOL = 1e-5
NODE_KINDS = ("lorsa", "tc", "logit", "embed", "attn_err", "mlp_err")
OUR_KIND = {"TRANSCODER": "tc", "LORSA": "lorsa", "MLP_ERROR": "mlp_err", "ATTN_ERROR": "attn_err",
            "EMBEDDING": "embed", "BIAS": "bias", "LOGIT": "logit"}
_SITE = re.compile(r"blocks\.(\d+)\.hook_(attn|mlp)_out\.(error|sae\.hook_feature_acts|sae\.hook_b_\w+)$")
_BLOCK_BIAS = re.compile(r"blocks\.(\d+)\.(attn|mlp)\.hook_(b_O|b_out)$")

Node = tuple[str, int, int, Any]


def their_node(key: str, idx: list[int]) -> Node:
    """A node of theirs (a dimension's key and indices) as a node tuple."""
    if key == "logits":
        return ("logit", -1, -1, idx[0])
    if key == "hook_embed":
        return ("embed", -1, idx[0], -1)
    m = _SITE.match(key)
    if m:
        layer, site, what = int(m.group(1)), m.group(2), m.group(3)
        if what == "error":
            return (site + "_err", layer, idx[0], -1)
        if what.startswith("sae.hook_b_"):
            return ("tbias", layer, idx[0], f"{site}.{what.removeprefix('sae.hook_')}")
        return ("lorsa" if site == "attn" else "tc", layer, idx[0], idx[1])
    m = _BLOCK_BIAS.match(key)
    if m is None:
        raise ValueError(f"unknown node key of theirs: {key!r}")
    return ("tbias", int(m.group(1)), idx[0], f"{m.group(2)}.{m.group(3)}")


def our_nodes(table: dict[str, torch.Tensor], kinds: dict[str, int], bias_names: list[str]) -> list[Node]:
    """Our node table (``kind``, ``layer``, ``pos``, ``index`` tensors) as node tuples."""
    name = {v: OUR_KIND[k] for k, v in kinds.items()}
    nodes: list[Node] = []
    for kind, layer, pos, index in zip(*(table[f].tolist() for f in ("kind", "layer", "pos", "index")), strict=True):
        k = name[kind]
        if k == "logit":
            nodes.append(("logit", -1, -1, index))
        elif k == "embed":
            nodes.append(("embed", -1, pos, -1))
        elif k in ("mlp_err", "attn_err"):
            nodes.append((k, layer, pos, -1))
        elif k == "bias":
            nodes.append(("bias", layer, -1, bias_names[index] if index < len(bias_names) else index))
        else:
            nodes.append((k, layer, pos, index))
    return nodes


def decoder_norms(case: Path, nodes: list[Node]) -> torch.Tensor:
    """``‖W_dec[f]‖`` per node (Lorsa ``W_O`` / transcoder ``W_D`` rows of the files they wrote), 1 elsewhere."""
    weights: dict[tuple[str, int], torch.Tensor] = {}
    out = torch.ones(len(nodes), dtype=torch.float64)
    for i, (kind, layer, _, index) in enumerate(nodes):
        if kind in ("lorsa", "tc"):
            if (kind, layer) not in weights:
                w = load_file(str(case / f"{kind}_{layer}" / "sae_weights.safetensors"))
                weights[kind, layer] = (w["W_O"] if kind == "lorsa" else w["W_D"]).double().norm(dim=1)
            out[i] = weights[kind, layer][index]
    return out


def _rows(th: dict[str, torch.Tensor], field: str, names: dict[int, str]) -> list[Node]:
    return [their_node(names[r[0]], [i for i in r[1:] if i >= 0]) for r in th[field].tolist()]


def compare_graph(case: Path, align_sidn: bool = False) -> dict[str, Any]:
    """Their ``attribute`` graph against ours.

    ``align_sidn``: divide our rows, values and activations of feature nodes by the feature's decoder norm (their
    ``sparsity_include_decoder_norm: true`` units)."""
    th = load_file(str(case / "theirs.safetensors"))
    names = {int(k): v for k, v in json.loads((case / "theirs.json").read_text())["keys"].items()}
    ou = load_file(str(case / "ours.safetensors"))
    om = json.loads((case / "ours.json").read_text())
    ours = our_nodes(ou, om["kinds"], om["bias_names"])
    oidx = {n: i for i, n in enumerate(ours)}
    A_o, values, activation = ou["A"].double(), ou["values"].double(), ou["activation"].double()
    if align_sidn:
        c = decoder_norms(case, ours)
        A_o, values, activation = A_o / c[:, None], values / c, activation / c
    rows, cols, act_nodes = _rows(th, "rows", names), _rows(th, "cols", names), _rows(th, "act_nodes", names)
    res: dict[str, Any] = {}

    # node sets, per kind
    nodes = {}
    for kind in NODE_KINDS:
        a = {n for n in rows + cols if n[0] == kind}
        b = {n for n in ours if n[0] == kind}
        nodes[kind] = {"theirs": len(a), "ours": len(b), "equal": a == b}
        if a != b:
            nodes[kind] |= {"only_theirs": sorted(a - b)[:5], "only_ours": sorted(b - a)[:5]}
    res["nodes"] = nodes
    res["node_sets_equal"] = all(v["equal"] for v in nodes.values())

    # values: their activation vector against our values and activations (logits: our value)
    act = {n: float(v) for n, v in zip(act_nodes, th["act"].tolist(), strict=True)}
    res["values"] = {}
    for kind in ("lorsa", "tc", "logit"):
        d = [(v, float(values[oidx[n]]), float(activation[oidx[n]] if kind != "logit" else values[oidx[n]]))
             for n, v in act.items() if n[0] == kind and n in oidx]
        if d:
            scale = max(abs(v) for v, _, _ in d)
            res["values"][kind] = {"n": len(d), "max_rel_vs_values": max(abs(v - ov) for v, ov, _ in d) / scale,
                                   "max_rel_vs_activation": max(abs(v - oa) for v, _, oa in d) / scale}

    # edges on the common nodes
    A_t = th["A"].double()
    ri, ci = [oidx.get(n, -1) for n in rows], [oidx.get(n, -1) for n in cols]
    rk = [i for i, j in enumerate(ri) if j >= 0]
    ck = [i for i, j in enumerate(ci) if j >= 0]
    sub_t = A_t[rk][:, ck]
    sub_o = A_o[[ri[i] for i in rk]][:, [ci[i] for i in ck]]
    scale = float(sub_t.abs().max())
    diff = (sub_t - sub_o).abs()
    res["edges"] = {"rows": len(rk), "cols": len(ck), "largest": scale, "max_abs_diff": float(diff.max()),
                    "max_rel_to_largest": float(diff.max()) / scale}
    mismatch: dict[str, list[float]] = {}
    for a, b in (diff > TOL * scale).nonzero().tolist():
        mismatch.setdefault(f"{rows[rk[a]][0]}<-{cols[ck[b]][0]}", []).append(float(diff[a, b]) / scale)
    res["edge_mismatch_by_kind"] = {k: {"count": len(v), "worst_rel": max(v)} for k, v in mismatch.items()}

    # row sums: theirs alone, + our bias nodes' edges, + our edges from node kinds their graph lacks
    absent = {k for k, v in nodes.items() if v["theirs"] == 0 and v["ours"] > 0}
    bias_cols = [i for i, n in enumerate(ours) if n[0] == "bias"]
    absent_cols = [i for i, n in enumerate(ours) if n[0] == "bias" or n[0] in absent]
    sums = [(float(A_t[a].sum()), float(A_o[oidx[n], bias_cols].sum()), float(A_o[oidx[n], absent_cols].sum()),
             act[n]) for a, n in enumerate(rows) if n in oidx and n in act]
    top = max(abs(v) for *_, v in sums)
    res["row_sums"] = {
        "their_gap_max_rel": max(abs(s - v) for s, _, _, v in sums) / top,
        "their_plus_our_bias_gap_max_rel": max(abs(s + b - v) for s, b, _, v in sums) / top,
        "absent_kinds": sorted(absent),
        "their_plus_our_bias_and_absent_gap_max_rel": max(abs(s + x - v) for s, _, x, v in sums) / top,
    }
    res["ours_edge_sum_error"] = om["edge_sum_error"]
    res["logit_probs_max_abs_diff"] = float((th["probs"] - ou["logit_probs"]).abs().max())
    return res


def decoder_norm_ratio(case: Path) -> dict[str, Any]:
    """Per feature kind: how far our value / their activation is from the feature's decoder norm
    (``max |ratio − ‖W_dec[f]‖| / ‖W_dec[f]‖``) and the ratio's range."""
    th = load_file(str(case / "theirs.safetensors"))
    names = {int(k): v for k, v in json.loads((case / "theirs.json").read_text())["keys"].items()}
    ou = load_file(str(case / "ours.safetensors"))
    om = json.loads((case / "ours.json").read_text())
    ours = our_nodes(ou, om["kinds"], om["bias_names"])
    norm = decoder_norms(case, ours)
    value = {n: (float(ou["values"][i]), float(norm[i])) for i, n in enumerate(ours) if n[0] in ("lorsa", "tc")}
    ratios: dict[str, list[tuple[float, float]]] = {}
    for n, v in zip(_rows(th, "act_nodes", names), th["act"].tolist(), strict=True):
        if n in value:
            ours_v, c = value[n]
            ratios.setdefault(n[0], []).append((ours_v / v, c))
    return {kind: {"n": len(r), "max_rel_ratio_minus_norm": max(abs(q - c) / c for q, c in r),
                   "ratio_min": min(q for q, _ in r), "ratio_max": max(q for q, _ in r)}
            for kind, r in ratios.items()}


def compare_qk(case: Path) -> dict[str, Any] | None:
    """Their ``qk_trace`` marginals and pairs against our ``qk_attribution`` at the same probes (None: no probes).

    Their per-position bias leaves have no one-to-one node of ours (ours sums a decoder bias over positions) and are
    counted, not compared, except the ``b_Q`` / ``b_K`` leaf, compared with our last (bias) entry."""
    tm = json.loads((case / "theirs.json").read_text())
    om = json.loads((case / "ours.json").read_text())
    if not tm["qk"]:
        return None
    t = load_file(str(case / "ours_qk.safetensors"))
    results = []
    for j, r in enumerate(om["qk"]["results"]):
        nodes = our_nodes({f: t[f"p{j}/{f}"] for f in ("kind", "layer", "pos", "index")}, om["kinds"], r["bias_names"])
        results.append(({n: i for i, n in enumerate(nodes)}, t[f"p{j}/pairs"]))
    found: dict[str, list[float]] = {"q_marg": [], "k_marg": [], "pairs": [], "bQK": []}
    other_bias, unmapped = 0, []
    for entry, probe in zip(tm["qk"], om["qk"]["probes"], strict=True):
        idx, pairs = results[probe["result"]]
        nb = len(idx)  # the b_Q / b_K row and column
        # our marginals as QKAttribution.query_marginal / key_marginal give them (sums of the fp32 pair matrix)
        marginals = {"q_marginal": pairs.sum(1), "k_marginal": pairs.sum(0)}
        scale = max(float(m.abs().max()) for m in marginals.values())
        for part, pick in (("q_marginal", "q_marg"), ("k_marginal", "k_marg")):
            for key, ix, v in entry[part]:
                n = their_node(key, ix)
                if n[0] == "tbias":
                    if n[3] in ("attn.b_Q", "attn.b_K"):
                        found["bQK"].append(abs(v - float(marginals[part][nb])) / scale)
                    else:
                        other_bias += 1
                elif n not in idx:
                    unmapped.append(str(n))
                else:
                    found[pick].append(abs(v - float(marginals[part][idx[n]])) / scale)
        pair_scale = float(pairs.abs().max())
        for ka, ia, kb, ib, v in entry["pairs"]:
            a, b = their_node(ka, ia), their_node(kb, ib)
            ga = nb if a[0] == "tbias" and a[3] == "attn.b_Q" else idx.get(a)
            gb = nb if b[0] == "tbias" and b[3] == "attn.b_K" else idx.get(b)
            if ga is None or gb is None:
                unmapped.append(str((a, b)))
            else:
                found["pairs"].append(abs(v - float(pairs[ga, gb])) / pair_scale)
    out: dict[str, Any] = {"n_probes": len(tm["qk"]), "distinct": len(results), "topk": tm["qk_topk"],
                           "kpos_ties": sum(p["tie"] for p in om["qk"]["probes"])}
    for k, v in found.items():
        out[k] = {"n": len(v), "max_rel": max(v, default=None), f"n_over_{TOL:g}": sum(x > TOL for x in v)}
    out["other_bias_entries"] = other_bias
    out["unmapped"] = {"count": len(unmapped), "all_with_their_bias_leaf": all("tbias" in u for u in unmapped),
                       "sample": sorted(set(unmapped))[:3]}
    return out
