"""Arithmetic on a model that adds: clean logit difference, circuit size MHSA vs Lorsa, operand plots.

Uses the tiny adder of ``benchmarks/arithmetic_model.py`` (trained first if its cache is missing):

1. which layer's MHSA heads carry the operands to the ``=`` position — activation patching of each
   layer's heads together and path patching of each MHSA head (clean → op2-corrupted prompts,
   only at the ``=`` position; later attention frozen);
2. a Lorsa on that layer's attention, trained with ``Trainer`` on equation rows (cached in
   ``.cache/arithmetic-llama-lorsa``), evaluated by ``evaluate`` (FVU, CE) and by held-out
   exact-match accuracy with the Lorsa spliced (``error=False``);
3. ``circuit_size`` (Draye et al. 2025 §4.2): the MHSA heads of that layer (mean-ablated over the corrupt
   prompts) vs its Lorsa heads active on the prompts (zero-ablated, ``error=False``);
4. operand plots (Lorsa Fig. 7): the z at ``=`` of the most important Lorsa heads over the
   100 × 100 grid (``arithmetic_grid`` + ``plot_operand_grid`` → ``docs/figures/arithmetic_*.png``),
   with the share of each grid's variance explained by op1, op2, the sum, their digits;
5. a head swap (App. D.4) between the two heads that best encode op2, if there are such.

    OMP_NUM_THREADS=1 python -m benchmarks.arithmetic_circuit_size [--retrain-lorsa] [--lorsa-steps 1500]

Writes ``benchmarks/results/arithmetic_circuit_size.json``.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from benchmarks._synthetic import (
    active_lorsa_heads,
    circuit_sizes,
    layer_patching,
    logits_of,
    lorsa_argparser,
    lorsa_last_position_effects,
    open_model,
)
from benchmarks._synthetic import train_lorsa as train_lorsa_on
from benchmarks._timing import arg, command, table, write
from benchmarks.arithmetic_model import CACHE, EQS_PER_ROW, equation_rows, load_or_train, number_id, split_pairs
from nnsight_lorsa import LorsaSet, get_adapter
from nnsight_lorsa.envoy.read import attention_activations
from nnsight_lorsa.patching import MHSAHead, ReplacementModel, logit_difference
from nnsight_lorsa.patching.experiments import ablation_effect, head_swap
from nnsight_lorsa.patching.tasks import arithmetic_grid, arithmetic_task
from nnsight_lorsa.viz.figures import plot_operand_grid

ROOT = Path(__file__).resolve().parent.parent
LORSA_CACHE = ROOT / ".cache" / "arithmetic-llama-lorsa"
FIGURES = ROOT / "docs" / "figures"


def task_pairs(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """``n`` held-out two-digit pairs with sum ≤ 188 (so the wrong answer, sum + 10, is a number token)."""
    _, held = split_pairs()
    pool = [(a, b) for a, b in held if a >= 10 and b >= 10 and a + b <= 188]
    return random.Random(seed).sample(pool, n)


def accuracy(model, pairs: list[tuple[int, int]], lorsas: LorsaSet | None = None, layer: int = 0) -> float:
    tok = model.tokenizer
    task = arithmetic_task(tok, [(a, b) for a, b in pairs])  # clean ids; correct = the sum token
    pred = logits_of(model, task.clean, lorsas, layer)[:, -1].argmax(-1)
    return float((pred == task.correct_ids).float().mean())


def answer_ce(model, pairs: list[tuple[int, int]], layer: int, lorsas: LorsaSet | None = None) -> dict[str, float]:
    """Answer-token CE and exact match after ``[BOS] a + b =``: original, Lorsa spliced (``error=False``),
    and the layer's attention output zeroed (all its MHSA heads zero-ablated)."""
    task = arithmetic_task(model.tokenizer, pairs)
    y = task.correct_ids

    def ce(logits: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits[:, -1].float(), y, reduction="none")

    r = ReplacementModel(model)
    abl = ablation_effect(r, task.clean, [MHSAHead(layer, h) for h in range(get_adapter(model).n_heads)], metric=ce)
    out = {"ce_orig": float(abl.baseline.mean()), "ce_zero": float(abl.ablated.mean())}
    if lorsas is not None:
        lg = logits_of(model, task.clean, lorsas, layer)
        out["ce_spliced"] = float(ce(lg).mean())
        out["ce_recovered"] = (out["ce_zero"] - out["ce_spliced"]) / (out["ce_zero"] - out["ce_orig"])
        out["acc_lorsa"] = float((lg[:, -1].argmax(-1) == y).float().mean())
    out["acc_orig"] = float((logits_of(model, task.clean)[:, -1].argmax(-1) == y).float().mean())
    return {k: round(v, 4) for k, v in out.items()}


def variance_explained(grid: torch.Tensor) -> dict[str, float]:
    """R² of the grid ``[op1, op2]`` by the best function of each operand feature (group means)."""
    a = torch.arange(100)[:, None].expand(100, 100)
    b = torch.arange(100)[None, :].expand(100, 100)
    feats = {"op1": a, "op2": b, "sum": a + b, "op1 units": a % 10, "op2 units": b % 10, "op1 tens": a // 10,
             "op2 tens": b // 10, "sum units": (a + b) % 10, "sum tens": (a + b) // 10,
             "sum >= 100": (a + b >= 100).long(), "units carry": (a % 10 + b % 10 >= 10).long()}
    g = grid.flatten().double()
    tot = ((g - g.mean()) ** 2).sum()
    out = {}
    for name, f in feats.items():
        f = f.flatten()
        means = torch.zeros(int(f.max()) + 1, dtype=torch.double).index_add_(0, f, g)
        means /= torch.bincount(f).clamp(min=1)
        out[name] = round(float(1 - ((g - means[f]) ** 2).sum() / tot), 3) if tot > 0 else 0.0
    return out


def train_lorsa(model, layer: int, steps: int, n_ov: int, top_k: int, retrain: bool) -> tuple[LorsaSet, dict]:
    train_pairs, held = split_pairs()
    gen = torch.Generator().manual_seed(7)
    train_rows, _ = equation_rows(torch.tensor(train_pairs), 8192, gen)
    held_rows, _ = equation_rows(torch.tensor(held), 256, gen)
    return train_lorsa_on(model, layer, train_rows, held_rows, LORSA_CACHE, steps=steps, n_ov=n_ov, top_k=top_k,
                          retrain=retrain, extra={"row_tokens": 1 + 6 * EQS_PER_ROW})


def main() -> None:
    args = lorsa_argparser(__doc__ or "", layer=arg(None, "Lorsa layer (default: the layer path patching picks)",
                                                    type=int)).parse_args()
    t0 = time.perf_counter()
    model, info = open_model(load_or_train(CACHE))
    tok = model.tokenizer
    n_layers = get_adapter(model).n_layers
    _, held = split_pairs()
    res: dict = {"command": command("OMP_NUM_THREADS=1"), "model": {
        k: info[k] for k in ("layers", "d_model", "heads", "n_params", "steps", "heldout_accuracy", "train_accuracy",
                             "wall_seconds")}}
    res["model"]["heldout_accuracy_nnsight"] = accuracy(model, held)
    print(f"model: {n_layers} layers, held-out exact match {res['model']['heldout_accuracy_nnsight']:.4f}")

    task = arithmetic_task(tok, task_pairs(args.n_prompts))
    clean_ld = logit_difference(logits_of(model, task.clean), task.correct_ids, task.incorrect_ids)
    corrupt_ld = logit_difference(logits_of(model, task.corrupt), task.correct_ids, task.incorrect_ids)
    res["task"] = {"n_prompts": len(task), "clean_logit_diff": round(float(clean_ld.mean()), 3),
                   "clean_logit_diff_min": round(float(clean_ld.min()), 3),
                   "corrupt_logit_diff": round(float(corrupt_ld.mean()), 3)}
    print(f"arithmetic_task ({len(task)} held-out prompts): clean LD {clean_ld.mean():.3f} "
          f"(min {clean_ld.min():.3f}), corrupt LD {corrupt_ld.mean():.3f}")

    # 1. which layer moves the operands to '='
    res["layer_patching"], by_layer = layer_patching(model, task, "op2 changed", last=("eq_position", "at '=' only"))
    layer = int(by_layer.argmax()) if args.layer is None else args.layer
    res["lorsa_layer"] = layer
    print(f"-> Lorsa layer {layer} (sum of its heads' path-patching effect at '=': "
          f"{[round(float(x), 3) for x in by_layer]})")

    # 2. the Lorsa
    lorsas, linfo = train_lorsa(model, layer, args.lorsa_steps, args.n_ov, args.top_k, args.retrain_lorsa)
    linfo["heldout_accuracy_spliced"] = accuracy(model, held, lorsas, layer)
    linfo["heldout_answer"] = answer_ce(model, held, layer, lorsas)
    linfo["task_clean_logit_diff_spliced"] = round(float(logit_difference(
        logits_of(model, task.clean, lorsas, layer), task.correct_ids, task.incorrect_ids).mean()), 3)
    res["lorsa"] = linfo
    print(f"\nLorsa layer {layer}: {json.dumps(linfo)}")

    # 3. circuit size
    lheads = active_lorsa_heads(model, lorsas, layer, task.clean)
    res["circuit_size"], cs_l = circuit_sizes(model, task, layer, lorsas, lheads)
    mean_score = cs_l.scores.mean(0)
    # the heads' direct role at '=': path patching (later attention frozen) at the last position only,
    # zero-ablated (op1 and op2 heads alike) and patched from the op2-corrupted prompts
    eff_z, eff_c = lorsa_last_position_effects(model, task, lorsas, lheads)
    order = eff_z.argsort(descending=True)
    top = [lheads[int(i)].head for i in order[:6]]
    res["lorsa_top_heads"] = [{"head": lheads[int(i)].head, "pp_zero_at_eq": round(float(eff_z[i]), 3),
                               "pp_corrupt_op2_at_eq": round(float(eff_c[i]), 3),
                               "circuit_ablation_score": round(float(mean_score[i]), 3)} for i in order[:12]]
    print("\nLorsa heads by path-patching effect at '=' (logit difference lost):")
    print(table([tuple(e.values()) for e in res["lorsa_top_heads"]], tuple(res["lorsa_top_heads"][0])))
    by_score = mean_score.argsort(descending=True)
    res["lorsa_top_heads_by_circuit_score"] = [lheads[int(i)].head for i in by_score[:12]]

    # 4. operand plots over the full grid
    grid = arithmetic_grid(tok)
    ids = grid.groups[0][0]
    zs, zps = [], []
    for s in range(0, len(ids), 2000):
        chunk = ids[s:s + 2000]
        with torch.no_grad(), model.trace(chunk):
            zz = lorsas.replace(layer, error=False).hook_z.output[:, -1, top].save()
        zs.append(zz)
        x = attention_activations(model, layer, chunk).x
        zps.append(lorsas[layer].z_pattern(x, top)[:, :, -1])  # (b, heads, key pos)
    zgrid = grid.assemble([torch.cat(zs)])  # (100, 100, heads)
    zp = torch.cat(zps)
    pos_names = ["BOS", "op1", "+", "op2", "="]
    res["operand_plots"] = []
    for j, h in enumerate(top):
        g = zgrid[..., j]
        ve = variance_explained(g)
        share = zp[:, j].abs().mean(0)
        share = (share / share.sum()).tolist()
        entry = {"head": h, "active_frac": round(float((g > 0).float().mean()), 3), "z_max": round(float(g.max()), 3),
                 "variance_explained": ve,
                 "z_pattern_source_share": {n: round(v, 3) for n, v in zip(pos_names, share, strict=True)}}
        if j < 4:
            path = FIGURES / f"arithmetic_L{layer}_head{h}.png"
            best = max(ve, key=lambda k: ve[k])
            plot_operand_grid(g, path, operands=grid.operands,
                              title=f"Lorsa L{layer} head {h}: z at '=' (best: {best}, R² {ve[best]:.2f})")
            entry["figure"] = str(path.relative_to(ROOT))
        res["operand_plots"].append(entry)
        print(f"head {h}: active {entry['active_frac']:.2f}, reads {entry['z_pattern_source_share']}, R² {ve}")

    # 5. head swap between two heads that read op2
    op2_heads = [e["head"] for e in res["operand_plots"] if e["z_pattern_source_share"]["op2"] > 0.5]
    if len(op2_heads) >= 2:
        a_h, b_h = op2_heads[:2]
        # with the error term, so that the unedited run is the model itself
        rm = ReplacementModel(model, lorsas=lorsas, error=True)
        base, edited = head_swap(rm, layer, a_h, b_h, task.clean, swap=True)
        pb, pe = base[:, -1].argmax(-1), edited[:, -1].argmax(-1)
        num0 = number_id(0)
        res["head_swap"] = {"heads": [a_h, b_h], "changed_frac": round(float((pb != pe).float().mean()), 3),
                            "shift_after_minus_before": (pe - pb).tolist(),
                            "examples": [{"prompt": tok.decode(task.clean[i, 1:]), "before": int(pb[i]) - num0,
                                          "after": int(pe[i]) - num0} for i in range(6)]}
        print(f"head swap {a_h} <-> {b_h}: {json.dumps(res['head_swap'])}")
    res["total_seconds"] = round(time.perf_counter() - t0, 1)
    out = write("arithmetic_circuit_size", res)
    print(f"-> {out}")


if __name__ == "__main__":
    main()
