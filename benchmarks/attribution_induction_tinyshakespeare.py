"""An attribution graph of induction on the tinyshakespeare replacement model.

    python -m benchmarks.attribution_induction_tinyshakespeare

The embedded Llama with its Lorsa (layer 2) and TopK transcoders (every MLP), on a prompt where
it must complete a made-up name it has seen once: "... Good morrow, Zandrofel, ... And I to
Zandrofe" → "l". Reports node/edge counts before and after pruning, the replacement and
completeness scores, the circuit metrics of Ameisen et al. 2025, *Circuit Tracing* (completeness, replacement
score), where the Lorsa heads of the pruned
graph sit, and the QK attribution of the top Lorsa head at the last position. Writes the picture
(``docs/figures/attribution_induction.png``), the viewer (``docs/figures/attribution_induction.html``),
the Neuronpedia JSON and ``benchmarks/results/attribution_induction.json``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nnsight
import torch

from benchmarks._timing import RESULTS, embedded, write_json
from nnsight_lorsa import LorsaSet, ReplacementModel
from nnsight_lorsa.assets import default_lorsa_dir, default_transcoder_dir
from nnsight_lorsa.attribution import (
    attribute,
    circuit_metrics,
    graph_scores,
    prune,
    qk_attribution,
    save_neuronpedia,
)
from nnsight_lorsa.attribution.graph import LORSA, TRANSCODER
from nnsight_lorsa.envoy.transcoder_set import TranscoderSet
from nnsight_lorsa.formats import load
from nnsight_lorsa.viz import render_html
from nnsight_lorsa.viz.graph_plot import plot_graph

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "BRUTUS:\nGood morrow, Zandrofel, I pray you, walk with me.\nCASSIUS:\nAnd I to Zandrofel"


def main() -> None:
    t0 = time.perf_counter()
    model, lorsas = embedded()
    tok = model.tokenizer
    lorsas = LorsaSet.from_pretrained(model, default_lorsa_dir())
    tcs = TranscoderSet(model, {int(p.name.split("_")[1]): load(p)
                                for p in sorted(default_transcoder_dir().glob("layer_*"))})
    rm = ReplacementModel(model, lorsas=lorsas, transcoders=tcs)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"][0]
    ctx, answer = ids[:-1], int(ids[-1])
    tokens = [tok.decode([i]) for i in ctx.tolist()]
    t = time.perf_counter()
    g = attribute(rm, ctx, batch_size=64, progress=True)
    graph_s = time.perf_counter() - t
    pr = prune(g)
    replacement, completeness = graph_scores(g)
    kept = int(pr.node_mask.sum())
    summary_all = g.summary()
    summary_kept = {name: int((pr.node_mask & (g.nodes.kind == kind)).sum())
                    for name, kind in (("features", TRANSCODER), ("lorsa_heads", LORSA))}
    err = g.edge_sum_error()
    top_logit = int(g.nodes.index[g.logit_ids[g.logit_probs.argmax()]])
    print(f"prompt {len(ctx)} tokens; answer {tok.decode([answer])!r}; top logit {tok.decode([top_logit])!r} "
          f"p={float(g.logit_probs.max()):.3f}")
    print(f"graph {graph_s:.1f} s: {summary_all}; pruned: {kept} nodes ({summary_kept}), "
          f"{int(pr.edge_mask.sum())} edges")
    print(f"edge sums: max rel err {float(err.max()):.2e} (median {float(err.median()):.2e}) over {len(err)} rows")
    print(f"replacement score {replacement:.3f}, completeness score {completeness:.3f}")
    # Lorsa heads of the pruned graph
    lor = ((g.nodes.kind == LORSA) & pr.node_mask).nonzero().flatten()
    lor = lor[pr.node_influence[lor].argsort(descending=True)]
    heads = [{"head": int(g.nodes.index[i]), "pos": int(g.nodes.pos[i]), "token": tokens[int(g.nodes.pos[i])],
              "z": round(float(g.nodes.activation[i]), 4), "influence": round(float(pr.node_influence[i]), 4)}
             for i in lor]
    print("Lorsa heads kept:", heads[:8])
    qk = None
    last = [h for h in heads if h["pos"] == len(ctx) - 1]
    if last:
        head = last[0]["head"]
        with torch.no_grad(), model.trace(ctx[None]):
            args, kwargs = model.model.layers[2].self_attn.inputs
            x = nnsight.save(kwargs.get("hidden_states", args[0] if args else None))
        zp = lorsas[2].z_pattern(x, [head])[0, 0, -1]
        key = int(zp.argmax())
        r = qk_attribution(rm, ctx, layer=2, head=head, query_pos=len(ctx) - 1, key_pos=key)
        qk = {"head": head, "query_pos": len(ctx) - 1, "key_pos": key, "key_token": tokens[key],
              "z_pattern_top_keys": [(int(j), tokens[int(j)], round(float(zp[j]), 4))
                                     for j in zp.abs().topk(3).indices],
              "score": r.score, "pairs_sum": float(r.pairs.sum()),
              "top_pairs": [(a_, b_, round(v, 4)) for a_, b_, v in r.top_pairs(8)]}
        print(f"Lorsa head {head} at the last token attends most to {key} {tokens[key]!r}; "
              f"score {r.score:.4f} = Σ pairs {float(r.pairs.sum()):.4f}; top pairs {qk['top_pairs'][:4]}")
    t = time.perf_counter()
    cm = circuit_metrics(rm, g, pr)
    metrics_s = time.perf_counter() - t
    print(f"circuit ({len(cm.nodes)} features/heads): completeness {cm.completeness:.3f} "
          f"(Δℓ {cm.baseline:.3f} → {cm.ablated:.3f} ablated), minimal fraction {cm.minimal_fraction:.3f}, "
          f"faithfulness ρ {cm.faithfulness:.3f}  [{metrics_s:.1f} s]")
    figs = ROOT / "docs" / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    plot_graph(g, pr, tokens=tokens, path=figs / "attribution_induction.png",
               title=f"induction: '...And I to Zandrofe' → {tok.decode([top_logit])!r} "
                     f"({kept} nodes, {int(pr.edge_mask.sum())} edges kept)")
    render_html(g, pr, tokenizer=tok, path=figs / "attribution_induction.html", title="tinyshakespeare induction")
    save_neuronpedia(g, figs / "attribution_induction.neuronpedia.json", pr, slug="tinyshakespeare-induction",
                     tokenizer=tok)
    out = {"command": "python " + " ".join(sys.argv), "prompt": tok.decode(ctx),
           "answer": tok.decode([answer]), "top_logit": tok.decode([top_logit]),
           "top_logit_prob": float(g.logit_probs.max()), "graph_seconds": graph_s, "nodes": summary_all,
           "pruned_nodes": kept, "pruned_kinds": summary_kept, "pruned_edges": int(pr.edge_mask.sum()),
           "edge_sum_max_rel_err": float(err.max()), "edge_sum_median_rel_err": float(err.median()),
           "replacement_score": replacement, "completeness_score": completeness, "lorsa_heads_kept": heads,
           "qk": qk, "circuit": {"n": len(cm.nodes), "completeness": cm.completeness, "baseline": cm.baseline,
                                 "ablated": cm.ablated, "minimal_fraction": cm.minimal_fraction,
                                 "faithfulness_spearman": cm.faithfulness},
           "total_seconds": time.perf_counter() - t0}
    path = write_json(RESULTS / "attribution_induction.json", out)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
