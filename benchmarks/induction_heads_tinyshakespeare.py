"""Induction heads of the embedded tinyshakespeare model, found with path patching (Lorsa paper §6).

On repeated-token prompts (word-like tokens of the model's BPE; clean ``[BOS] s s[:-1]`` predicts
``s[-1]``, corrupt ``[BOS] s' s[:-1]`` has nothing to copy from):

1. path patching (sender ← corrupt value, later attention frozen, receiver = logits) of every
   MHSA head (layers 0–3) and of every Lorsa head of layer 2 active on these prompts; the
   total effect (no freezing) alongside;
2. circuit size (Draye et al. 2025 §4.2): how many components recover 90% of the clean logit difference —
   the 4 MHSA heads of layer 2 vs the Lorsa heads of layer 2 (the only layer with a Lorsa), and
   all 16 MHSA heads;
3. a head swap (App. D.4) of the top induction Lorsa head;
4. dashboards of the top induction Lorsa heads, a z-pattern figure and the Fig. 13 histogram
   into ``docs/figures/``; JSON into ``benchmarks/results/``.

    OMP_NUM_THREADS=1 python -m benchmarks.induction_heads_tinyshakespeare
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch

from benchmarks._timing import RESULTS, embedded, write_json
from nnsight_lorsa.analysis.heads import collect_top_activations, mhsa_correlation, ov_logit_lens
from nnsight_lorsa.assets import default_corpus_path
from nnsight_lorsa.envoy.read import attention_activations
from nnsight_lorsa.patching import LorsaHead, MHSAHead, ReplacementModel, logit_difference, mean_activations
from nnsight_lorsa.patching.circuit import circuit_size
from nnsight_lorsa.patching.experiments import head_swap
from nnsight_lorsa.patching.path_patching import HeadInput, path_patching
from nnsight_lorsa.patching.tasks import induction_task
from nnsight_lorsa.training import TokenDataset
from nnsight_lorsa.viz.dashboard import head_dashboard_data, write_dashboard
from nnsight_lorsa.viz.figures import plot_heads_spanned, plot_z_pattern

ROOT = Path(__file__).resolve().parents[1]
FIG = ROOT / "docs" / "figures"
OUT = RESULTS / "induction_heads_tinyshakespeare.json"
LAYER = 2


def main() -> dict:
    t0 = time.perf_counter()
    model, lorsa = embedded()
    r = ReplacementModel(model, lorsas=lorsa)
    tok = model.tokenizer
    words = [i for i in range(len(tok)) if re.fullmatch(r" ?[A-Za-z]{2,}", tok.decode([i]))]
    task = induction_task(tok, n_prompts=16, seq_len=12, seed=0, token_pool=words)
    kw = {"correct_ids": task.correct_ids, "incorrect_ids": task.incorrect_ids}
    res: dict = {"task": {"n_prompts": len(task), "seq_len": 12, "prompt_tokens": int(task.clean.shape[1]),
                          "token_pool": len(words), "example": tok.decode(task.clean[0])}}

    # 1. path patching: MHSA heads of every layer, Lorsa heads of layer 2
    mhsa = [MHSAHead(layer, h) for layer in range(4) for h in range(4)]
    pp = path_patching(r, task.clean, mhsa, corrupt=task.corrupt, **kw)
    tot = path_patching(r, task.clean, mhsa, corrupt=task.corrupt, freeze=False, **kw)
    res["clean_logit_diff"] = round(float(pp.clean.mean()), 3)
    res["corrupt_logit_diff"] = round(float(pp.corrupt.mean()), 3)
    res["mhsa_path_effect"] = {f"L{t[0].layer}.{t[0].head}": round(float(e), 3)
                               for t, e in zip(pp.senders, pp.effect.mean(-1), strict=True)}
    res["mhsa_total_effect"] = {f"L{t[0].layer}.{t[0].head}": round(float(e), 3)
                                for t, e in zip(tot.senders, tot.effect.mean(-1), strict=True)}
    # K-composition: previous-layer heads -> the keys of the layer-3 heads only
    rk = path_patching(r, task.clean, [h for h in mhsa if h.layer < 2], corrupt=task.corrupt, **kw,
                       receivers=[HeadInput(MHSAHead(3, h), "k") for h in range(4)])
    res["mhsa_path_effect_via_layer3_keys"] = {f"L{t[0].layer}.{t[0].head}": round(float(e), 3)
                                               for t, e in zip(rk.senders, rk.effect.mean(-1), strict=True)}
    t1 = time.perf_counter()
    with torch.no_grad(), model.trace(torch.cat([task.clean, task.corrupt])):
        z = lorsa.replace(LAYER, error=True).hook_z.output.save()
    active = ((z[:, 1:] > 0).any(0).any(0)).nonzero().flatten().tolist()
    lheads = [LorsaHead(LAYER, h) for h in active]
    lp = path_patching(r, task.clean, lheads, corrupt=task.corrupt, groups_per_trace=16, **kw)
    eff = lp.effect.mean(-1)
    order = eff.argsort(descending=True).tolist()
    res["lorsa_candidates"] = len(lheads)
    res["lorsa_path_patching_seconds"] = round(time.perf_counter() - t1, 1)
    res["lorsa_top_path_effect"] = [{"head": lheads[i].head, "effect": round(float(eff[i]), 3),
                                     "normalized": round(float(lp.normalized[i].mean()), 3)} for i in order[:10]]
    res["lorsa_path_effect_sum"] = round(float(eff.sum()), 3)
    top_heads = [lheads[i].head for i in order[:3]]

    # 2. circuit size: 90% of the clean logit difference
    means = mean_activations(r, mhsa, task.corrupt)
    sizes = {}
    for name, comps, mode in (("mhsa_layer2", [MHSAHead(LAYER, h) for h in range(4)], "mean"),
                              ("mhsa_all_layers", mhsa, "mean"),
                              ("lorsa_layer2", lheads, "zero")):
        cs = circuit_size(r, task, comps, mode=mode, means=means if mode == "mean" else None)
        sizes[name] = {"n_components": len(comps), "ablation": mode, "global_k": cs.global_k,
                       "per_prompt_k_mean": round(float(cs.per_prompt_k.float().mean()), 2),
                       "per_prompt_k": cs.per_prompt_k.tolist(),
                       "metric_all_ablated": round(float(cs.metric_none.mean()), 3),
                       "metric_none_ablated": round(float(cs.metric_all.mean()), 3),
                       "global_circuit": [f"L{c.layer}.{c.head}" for c in cs.global_circuit()]}
    res["circuit_size"] = sizes

    # 3. head swap (App. D.4) of the top induction head into another head of its QK group
    g = lorsa[LAYER].cfg.group_size
    h = top_heads[0]
    to = (h // g) * g + (h % g + 1) % g
    base, swapped = head_swap(r, LAYER, h, to, task.clean)
    ld_base = logit_difference(base, task.correct_ids, task.incorrect_ids)
    ld_swap = logit_difference(swapped, task.correct_ids, task.incorrect_ids)
    _, _, lens_from = ov_logit_lens(r, LAYER, [h, to], 5)
    res["head_swap"] = {"from": h, "to": to, "logit_diff_before": round(float(ld_base.mean()), 3),
                        "logit_diff_after": round(float(ld_swap.mean()), 3),
                        "from_promotes": lens_from[0] if lens_from else None,
                        "to_promotes": lens_from[1] if lens_from else None}

    # 4. dashboards, z-pattern, Fig. 13
    text = default_corpus_path().read_text(encoding="utf-8")
    corpus = TokenDataset.from_text(tok, text[:200_000], 64).tokens[:96]
    top = collect_top_activations(r, LAYER, corpus, n_top=8)
    corr = mhsa_correlation(r, LAYER, corpus)
    spanned = corr.heads_spanned()
    act_sp = spanned[spanned > 0]  # -1: contributions summing to <= 0, n undefined (dropped, as the figure does)
    res["heads_spanned"] = {"active_heads": int((corr.count > 0).sum()),
                            "undefined_heads": int((spanned == -1).sum()),
                            "distribution": {str(k): int(v) for k, v in enumerate(torch.bincount(act_sp)) if k}}
    res["activation_frequency_top_heads"] = {str(x): round(float(top.frequency[x]), 4) for x in top_heads}
    FIG.mkdir(parents=True, exist_ok=True)
    plot_heads_spanned(spanned, FIG / "fig13_heads_spanned_tinyshakespeare.png",
                       title=f"tinyshakespeare L{LAYER}: {int(act_sp.numel())} Lorsa heads with a defined n")
    pages = []
    for rank, head in enumerate(top_heads):
        i = order[rank]
        data = head_dashboard_data(r, LAYER, head, top, corpus, correlation=corr,
                                   extra={"induction path effect": f"{float(eff[i]):.3f}"})
        pages.append(str(write_dashboard(FIG / f"lorsa_L{LAYER}_H{head}.html", data).relative_to(ROOT)))
    res["dashboards"] = pages
    act = attention_activations(model, LAYER, task.clean[:1])
    zp = lorsa[LAYER].z_pattern(act.x.float(), [top_heads[0]], act.positions)[0, 0]
    plot_z_pattern(zp, [tok.decode([int(t)]) for t in task.clean[0]], FIG / f"z_pattern_L{LAYER}_H{top_heads[0]}.png",
                   title=f"Lorsa L{LAYER}.H{top_heads[0]} on an induction prompt")
    res["seconds"] = round(time.perf_counter() - t0, 1)
    write_json(OUT, res)
    return res


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
