"""IOI and greater-than on a model that does them: logit difference, circuit size MHSA vs Lorsa, top heads.

Uses the tiny Llama of ``benchmarks/ioi_greater_than_model.py`` (trained first if its cache is
missing); for each task (``ioi_task``, template 0, both names held out; ``greater_than_task``,
"war", century 13, held-out start years; 32 prompts each):

1. clean / corrupt logit difference and held-out accuracy (all templates / nouns) through nnsight;
2. which layer's MHSA heads matter — activation patching of each layer's heads together and path
   patching of each MHSA head (clean → corrupt, later attention frozen) — as in
   ``benchmarks/arithmetic_circuit_size.py`` (shared code in ``benchmarks/_synthetic.py``);
3. a Lorsa on that layer's attention (``Trainer`` on mixed task rows, cached in
   ``.cache/ioi-greater-than-llama-lorsa/layer<L>``): FVU, L0, dead fraction, and the task metrics
   with the Lorsa spliced (``error=False``);
4. ``circuit_size`` (Draye et al. 2025 §4.2, 90 %): the layer's MHSA heads (mean-ablated over the corrupt
   prompts, and zero-ablated) vs its Lorsa heads active on the prompts (zero-ablated);
5. the top Lorsa heads by path patching at the last position (zero-ablated), described on a wider
   batch (IOI: 200 prompts over all names; greater-than: every start year 02…97): where they fire
   (the IO names / start years), what they read (share of |z-pattern| at the last position per key
   role: IO / S1 / S2 names, start year, other tokens by position) and what they write (``ov_logit_lens``).

    OMP_NUM_THREADS=1 python -m benchmarks.ioi_greater_than_circuit_size [--retrain-lorsa] [--lorsa-steps 3000]

Writes ``benchmarks/results/ioi_greater_than_circuit_size.json``.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

import benchmarks._synthetic as syn
import benchmarks.ioi_greater_than_model as igt
from benchmarks._timing import command, table, write
from benchmarks.ioi_greater_than_model import CACHE, HELD_NAMES, HELD_YEARS, load_or_train, start_year
from nnsight_lorsa import LorsaSet, ReplacementModel
from nnsight_lorsa.analysis.heads import ov_logit_lens
from nnsight_lorsa.envoy.read import attention_activations
from nnsight_lorsa.patching import logit_difference
from nnsight_lorsa.patching.tasks import TaskBatch, greater_than_task, ioi_task

ROOT = Path(__file__).resolve().parent.parent
LORSA_CACHE = ROOT / ".cache" / "ioi-greater-than-llama-lorsa"


def circuit_tasks(tok, n: int) -> dict[str, TaskBatch]:
    """The two measured batches: IOI (template 0, held-out name pairs) and greater-than ("war", 13YY
    with YY held out)."""
    gt = greater_than_task(tok, 20 * n, seed=100, noun="war")
    rows = [i for i, m in enumerate(gt.meta) if start_year(m["text"]) in HELD_YEARS]
    return {"ioi": ioi_task(tok, n, names=HELD_NAMES, seed=100), "greater_than": gt.select(rows[:n])}


def description_task(tok, name: str) -> TaskBatch:
    """A wider batch to describe heads on: IOI over all 20 names (200 prompts, template 0); greater-than
    one prompt per start year 1302…1397 ("war")."""
    if name == "ioi":
        return ioi_task(tok, 200, seed=200)
    gt = greater_than_task(tok, 3000, seed=200, noun="war")
    first = {start_year(m["text"]): i for i, m in reversed(list(enumerate(gt.meta)))}
    return gt.select([first[y] for y in sorted(first)])


def heldout_metrics(model, held: dict[str, list[TaskBatch]], lorsas: LorsaSet | None = None,
                    layer: int = 0) -> dict[str, float]:
    """Accuracy and mean logit difference per task over all held-out batches (optionally Lorsa-spliced)."""
    out = {}
    for name, batches in held.items():
        acc = ld = 0.0
        n = 0
        for t in batches:
            lg = syn.logits_of(model, t.clean, lorsas, layer)
            acc += igt.task_accuracy(t, lg, model.tokenizer) * len(t)
            ld += float(logit_difference(lg, t.correct_ids, t.incorrect_ids).sum())
            n += len(t)
        out[f"{name}_accuracy"] = round(acc / n, 4)
        out[f"{name}_logit_diff"] = round(ld / n, 3)
        out[f"{name}_n"] = n
    return out


def key_roles(task: TaskBatch, tok) -> list[list[str]]:
    """A label per prompt token: IOI ``IO`` / ``S1`` / ``S2``; greater-than ``YY`` / ``century``; else the
    token and its position, e.g. ``" went"@6`` (one template per batch, so positions line up)."""
    years = igt.year_values(tok)
    roles = []
    for row, c, w in zip(task.clean.tolist(), task.correct_ids.tolist(), task.incorrect_ids.tolist(), strict=True):
        r = ["BOS"] + [f"{tok.decode([t])!r}@{j}" for j, t in enumerate(row[1:], 1)]
        s_seen = 0
        for j, t in enumerate(row[1:], 1):
            if task.name == "ioi" and t == c:
                r[j] = "IO"
            elif task.name == "ioi" and t == w:
                s_seen += 1
                r[j] = f"S{s_seen}"
            elif task.name == "greater_than" and years[t] >= 0:
                r[j] = "YY"
            elif task.name == "greater_than" and tok.decode([t]).strip().isdigit():
                r[j] = "century"
        roles.append(r)
    return roles


def describe_heads(model, lorsas: LorsaSet, layer: int, task: TaskBatch, heads: list[int]) -> list[dict]:
    """Per head: activity at the last position (clean / corrupt; the IO names / start years of the
    prompts where it fires and where not), z-pattern share per key role there, and the OV logit lens:
    the tokens it promotes most and suppresses most."""
    tok = model.tokenizer
    with torch.no_grad(), model.trace(task.clean):
        zc = lorsas.replace(layer, error=False).hook_z.output[:, -1, heads].save()
    with torch.no_grad(), model.trace(task.corrupt):
        zk = lorsas.replace(layer, error=False).hook_z.output[:, -1, heads].save()
    x = attention_activations(model, layer, task.clean).x
    zp = lorsas[layer].z_pattern(x, heads)[:, :, -1].abs()  # (b, heads, key pos)
    roles = key_roles(task, tok)
    names = sorted({r for row in roles for r in row})
    rm = ReplacementModel(model, lorsas=lorsas)
    _, _, ranked = ov_logit_lens(rm, layer, heads, k=len(tok), tokenizer=tok)  # every token, by logit
    assert ranked is not None
    key = [m["io"].strip() if task.name == "ioi" else start_year(m["text"]) for m in task.meta]
    out = []
    for j, h in enumerate(heads):
        share = {n: 0.0 for n in names}
        for b, row in enumerate(roles):
            tot = float(zp[b, j].sum()) or 1.0
            for p, role in enumerate(row):
                share[role] += float(zp[b, j, p]) / tot / len(roles)
        out.append({"head": h, "active_frac_last": round(float((zc[:, j] > 0).float().mean()), 3),
                    "z_last_clean": round(float(zc[:, j].mean()), 3),
                    "z_last_corrupt": round(float(zk[:, j].mean()), 3),
                    "active_for": sorted({key[b] for b in range(len(key)) if zc[b, j] > 0}),
                    "inactive_for": sorted({key[b] for b in range(len(key)) if zc[b, j] <= 0}),
                    "reads_at_last": {n: round(v, 3) for n, v in sorted(share.items(), key=lambda kv: -kv[1])
                                      if v >= 0.01},
                    "ov_logit_lens_top": ranked[j][:6], "ov_logit_lens_bottom": ranked[j][::-1][:6]})
    return out


def main() -> None:
    args = syn.lorsa_argparser(__doc__ or "").parse_args()
    t0 = time.perf_counter()
    model, info = syn.open_model(load_or_train(CACHE))
    tok = model.tokenizer
    held = igt.heldout_tasks(tok)
    res: dict = {"command": command("OMP_NUM_THREADS=1"), "model": {
        k: info[k] for k in ("layers", "d_model", "heads", "n_params", "steps", "wall_seconds", "held_names",
                             "held_years", "heldout")}}
    res["model"]["heldout_nnsight"] = heldout_metrics(model, held)
    print(f"model: held-out (nnsight) {res['model']['heldout_nnsight']}")
    tasks = circuit_tasks(tok, args.n_prompts)
    res["tasks"] = {}
    for name, task in tasks.items():
        clean = logit_difference(syn.logits_of(model, task.clean), task.correct_ids, task.incorrect_ids)
        corrupt = logit_difference(syn.logits_of(model, task.corrupt), task.correct_ids, task.incorrect_ids)
        res["tasks"][name] = {"n_prompts": len(task), "example": task.meta[0]["text"],
                              "example_corrupt": task.meta[0]["corrupt_text"],
                              "clean_logit_diff": round(float(clean.mean()), 3),
                              "clean_logit_diff_min": round(float(clean.min()), 3),
                              "corrupt_logit_diff": round(float(corrupt.mean()), 3)}
        print(f"{name} ({len(task)} held-out prompts, e.g. {task.meta[0]['text']!r}): clean LD {clean.mean():.3f} "
              f"(min {clean.min():.3f}), corrupt LD {corrupt.mean():.3f}")

    # 1. which layer's heads matter, per task
    for name, task in tasks.items():
        lp, by_layer = syn.layer_patching(model, task, f"{name} corrupt prompts")
        res["tasks"][name]["layer_patching"] = lp
        res["tasks"][name]["lorsa_layer"] = int(by_layer.argmax())
        res["tasks"][name]["path_patching_layer_sum"] = [round(float(x), 3) for x in by_layer]
        print(f"-> {name}: Lorsa layer {int(by_layer.argmax())} (sum of its heads' path-patching effect at the last "
              f"position: {[round(float(x), 3) for x in by_layer]})")

    # 2. one Lorsa per chosen layer, on mixed task rows
    rng = random.Random(7)
    train_rows, held_rows = igt.task_rows(tok, 8192, rng)[0], igt.task_rows(tok, 256, rng)[0]
    lorsas_by_layer: dict[int, tuple[LorsaSet, dict]] = {}
    res["lorsa"] = {}
    for layer in sorted({t["lorsa_layer"] for t in res["tasks"].values()}):
        lorsas, linfo = syn.train_lorsa(model, layer, train_rows, held_rows, LORSA_CACHE / f"layer{layer}",
                                    steps=args.lorsa_steps, n_ov=args.n_ov, top_k=args.top_k,
                                    retrain=args.retrain_lorsa, extra={"row_tokens": int(train_rows.shape[1])})
        linfo = {**linfo, "heldout_spliced": heldout_metrics(model, held, lorsas, layer)}
        lorsas_by_layer[layer] = (lorsas, linfo)
        res["lorsa"][f"layer_{layer}"] = linfo
        print(f"\nLorsa layer {layer}: {json.dumps(linfo)}")

    # 3. circuit size and the top heads, per task
    for name, task in tasks.items():
        tr = res["tasks"][name]
        layer = tr["lorsa_layer"]
        lorsas = lorsas_by_layer[layer][0]
        tr["clean_logit_diff_spliced"] = round(float(logit_difference(
            syn.logits_of(model, task.clean, lorsas, layer), task.correct_ids, task.incorrect_ids).mean()), 3)
        print(f"\n=== {name}: layer {layer}, clean LD with the Lorsa spliced {tr['clean_logit_diff_spliced']}")
        lheads = syn.active_lorsa_heads(model, lorsas, layer, task.clean)
        tr["circuit_size"], cs_l = syn.circuit_sizes(model, task, layer, lorsas, lheads)
        mean_score = cs_l.scores.mean(0)
        eff_z, eff_c = syn.lorsa_last_position_effects(model, task, lorsas, lheads)
        order = eff_z.argsort(descending=True)
        top = [lheads[int(i)].head for i in order[:6]]
        desc = {d["head"]: d for d in describe_heads(model, lorsas, layer, description_task(tok, name), top)}
        tr["lorsa_top_heads"] = []
        for i in order[:12]:
            h = lheads[int(i)].head
            e = {"head": h, "pp_zero_last": round(float(eff_z[i]), 3), "pp_corrupt_last": round(float(eff_c[i]), 3),
                 "circuit_ablation_score": round(float(mean_score[i]), 3)}
            if h in desc:
                e.update({k: v for k, v in desc[h].items() if k != "head"})
            tr["lorsa_top_heads"].append(e)
        tr["lorsa_top_heads_by_circuit_score"] = [lheads[int(i)].head for i in mean_score.argsort(descending=True)[:12]]
        print(f"\n{name}: Lorsa heads by path-patching effect at the last position (logit difference lost):")
        print(table([(e["head"], e["pp_zero_last"], e["pp_corrupt_last"], e["circuit_ablation_score"],
                      e.get("active_frac_last", ""),
                      ", ".join(f"{k} {v}" for k, v in list(e.get("reads_at_last", {}).items())[:3]),
                      " ".join(e.get("ov_logit_lens_top") or [])) for e in tr["lorsa_top_heads"][:6]],
                    ("head", "pp zero", "pp corrupt", "ablation score", "active", "reads at last", "OV promotes")))
        mh = sorted(tr["layer_patching"]["path_patching_head_normalized"].items(),
                    key=lambda kv: -kv[1]["last_position"])
        tr["mhsa_top_heads"] = [{"head": h, **v} for h, v in mh[:4]]
    res["total_seconds"] = round(time.perf_counter() - t0, 1)
    out = write("ioi_greater_than_circuit_size", res)
    print(f"-> {out}")


if __name__ == "__main__":
    main()
