"""Compare one case of the Lorsa-analysis check (``their_side.py`` vs ``our_side.py`` files in ``CASE_DIR``).

Unit convention aligned: with ``sparsity_include_decoder_norm`` our loader folds ``‖W_O[h]‖`` into the head (our
``W_O`` rows unit, our ``z`` = theirs × ‖W_O[h]‖); every per-head quantity of theirs is multiplied by
``s_h = <W_O^theirs[h], W_O^ours[h]> / ‖W_O^ours[h]‖²`` (1 without the fold), their logit-lens rows divided by it.

Relative differences are ``max |ours − theirs| / max |theirs|`` over the compared entries (per quantity, over all
heads), so a quantity near 0 does not inflate them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

TOL = 1e-4  # fp32 on both sides, different summation orders (SDPA vs einsum, folded weights)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a − b| / max |b|`` (0 for empty)."""
    if b.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def lens_rows(t: torch.Tensor) -> torch.Tensor:
    """Logit-lens rows centred over the vocabulary (TransformerLens's ``center_unembed`` shifts each row of theirs by
    a per-head constant) and scaled to unit norm (their ``ln_final`` normalises ``W_O[h]`` itself)."""
    t = t.double() - t.double().mean(-1, keepdim=True)
    return t / t.norm(dim=-1, keepdim=True).clamp_min(1e-30)


def compare_case(case: Path) -> dict[str, Any]:
    theirs, ours = load_file(str(case / "theirs.safetensors")), load_file(str(case / "ours.safetensors"))
    tm, om = json.loads((case / "theirs.json").read_text()), json.loads((case / "ours.json").read_text())
    wt, wo = theirs["W_O"].double(), ours["W_O"].double()
    s = (wt * wo).sum(-1) / (wo * wo).sum(-1)  # (heads,) our z = their z × s
    res: dict[str, Any] = {"w_o_direction_max_rel": rel(wo * s[:, None], wt)}

    # 1. head activations z and the active sets (at the tokens: a right-padded position is a query of padding)
    opts = tm["opts"]
    tok = theirs["tokens"] != opts.get("pad", 1) if opts.get("pad_rows") else torch.ones_like(theirs["tokens"]).bool()
    zt, zo = theirs["acts"].double()[tok] * s, ours["z"].double()[tok]
    res["z_max_rel"] = rel(zo, zt)
    res["active_sets_equal"] = bool(torch.equal(zo != 0, zt != 0))
    res["n_active"] = int((zt != 0).sum())

    # 2. z-patterns, every head, every (query, key)
    res["zp_max_rel"] = rel(ours["zp"].double(), theirs["zp"].double() * s[None, :, None, None])
    res["zp_entries"] = int(theirs["zp"].numel())

    # 3. activation counts, tokens analysed, max activation
    res["counts_equal"] = bool(torch.equal(ours["count"], theirs["act_times"]))
    res["n_tokens"] = {"ours": om["n_tokens"], "theirs": tm["n_analyzed_tokens"]}
    fired = ours["count"] > 0
    res["max_act_max_rel"] = rel(ours["top_values"][fired, 0], theirs["max_feature_acts"].double()[fired] * s[fired])

    # 4. top windows (distinct windows ranked by the window's largest activation) and the dashboards' z-patterns
    window_mismatch, top_pairs, zp_pairs, zp_dropped_max = [], [], [], 0.0
    top_diffs: list[float] = []
    zp_diffs: list[float] = []
    zp_ref: list[float] = []
    top_ref: list[float] = []
    pos_mismatch = []
    for h in range(len(tm["samples"])):
        th = [(smp["context_idx"], max(smp["acts"].values(), default=0.0) * float(s[h]), smp)
              for smp in tm["samples"][h]]
        th = [t for t in th if t[1] > 0]
        oh = [(int(w), float(v)) for w, v in zip(ours["top_window"][h].tolist(), ours["top_values"][h].tolist(),
                                                 strict=True) if w >= 0 and v > 0]
        if sorted(w for w, _, _ in th) != sorted(w for w, _ in oh):
            window_mismatch.append({"head": h, "theirs": [w for w, _, _ in th], "ours": [w for w, _ in oh]})
            continue
        by_w = {w: (v, smp) for w, v, smp in th}
        for w, v in oh:
            top_pairs.append((h, w))
            top_diffs.append(abs(v - by_w[w][0]))
            top_ref.append(abs(by_w[w][0]))
        for ctx in om["dashboards"].get(str(h), []):
            w, p = ctx["window"], ctx["position"]
            smp = by_w[w][1]
            tpos = max(smp["acts"], key=lambda k: smp["acts"][k])
            if int(tpos) != p:
                pos_mismatch.append({"head": h, "window": w, "ours": p, "theirs": int(tpos)})
                continue
            z_q = smp["acts"][str(p)] * float(s[h])
            kept = {k: v * float(s[h]) for q, k, v in smp["zp"] if q == p}
            contrib = ctx["contrib"]  # keys 0..p (window = pos: every key)
            for k, c in enumerate(contrib):
                if k in kept:
                    zp_pairs.append((h, w, p, k))
                    zp_diffs.append(abs(c - kept[k]))
                    zp_ref.append(abs(kept[k]))
                else:  # dropped by their post-analysis: |zp| < 1e-2 · z at the query
                    zp_dropped_max = max(zp_dropped_max, abs(c) / z_q)
    res["top_windows"] = {"heads_compared": len(tm["samples"]) - len(window_mismatch),
                          "window_set_mismatches": window_mismatch[:10],
                          "n_window_set_mismatches": len(window_mismatch), "entries": len(top_pairs),
                          "values_max_rel": max(top_diffs, default=0.0) / max(max(top_ref, default=1.0), 1e-30),
                          "query_position_mismatches": pos_mismatch[:10],
                          "n_query_position_mismatches": len(pos_mismatch)}
    # the dashboards round contributions to 4 decimals: compare within that rounding
    res["dashboard_zp"] = {"entries": len(zp_pairs), "max_abs_diff": max(zp_diffs, default=0.0),
                           "max_rel": max(zp_diffs, default=0.0) / max(max(zp_ref, default=1.0), 1e-30),
                           "rounding": 5e-5,
                           "ours_where_theirs_dropped_max_frac_of_z": zp_dropped_max}

    # 5. OV logit lens / direct logit attribution
    lens_o, dla_t = ours["lens"].double(), theirs["dla_logits"].double()
    bias = theirs["dla_zero"].double()  # their unembed(ln_final(0)): b_U (+ the final LayerNorm's bias, folded)
    lo, lt_nb = lens_rows(lens_o), lens_rows(dla_t - bias)
    res["lens"] = {
        "normalization_type": tm["normalization_type"],
        "rows_max_rel_vs_theirs_minus_bias": float((lo - lt_nb).abs().max() / lt_nb.abs().max()),
        "rows_max_rel_vs_theirs_raw": float((lo - lens_rows(dla_t)).abs().max() / lens_rows(dla_t).abs().max()),
        "bias_max_abs_over_row_max_abs": float(bias.abs().max() / (dla_t - bias).abs().max()),
        "top_ids_equal_vs_theirs_minus_bias": bool(torch.equal(
            ours["lens_top_ids"], (dla_t - bias).topk(ours["lens_top_ids"].shape[1], -1).indices)),
        "top_ids_equal_vs_theirs_raw": bool(torch.equal(ours["lens_top_ids"], theirs["dla_top_ids"])),
        "their_top_logits_match_matrix": rel(theirs["dla_top_logits"].double(),
                                             dla_t.topk(theirs["dla_top_logits"].shape[1], -1).values),
    }
    return res
