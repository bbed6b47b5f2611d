"""Circuit size on the seed-003 tasks for the tinyshakespeare model: MHSA heads vs Lorsa heads.

For IOI (App. A.2), greater-than (App. A.1) and the arithmetic template ``op1 + op2 =`` (paper
Fig. 7), built for the embedded model's BPE by ``nnsight_lorsa.patching.tasks``: the clean and
corrupt logit differences, and how many components recover 90 % of the clean logit difference
(Draye et al. 2025 §4.2) — the 4 MHSA heads of layer 2 (mean-ablated over the corrupt prompts) vs the
Lorsa heads of layer 2 active on the prompts (zero-ablated), and all 16 MHSA heads. A task the
tokenizer cannot serve is reported as such. The 4-layer model was not trained for these tasks:
the numbers say how little of each behaviour it has, not how a real model solves them.

    OMP_NUM_THREADS=1 python -m benchmarks.tasks_circuit_size_tinyshakespeare
"""

from __future__ import annotations

import json
import time

import torch

from benchmarks._timing import RESULTS, command, embedded, write_json
from nnsight_lorsa.patching import LorsaHead, MHSAHead, ReplacementModel, logit_difference, mean_activations
from nnsight_lorsa.patching.circuit import circuit_size
from nnsight_lorsa.patching.tasks import TaskTokenizationError, arithmetic_task, greater_than_task, ioi_task

LAYER = 2


def logit_diff(model, r, prompts, task) -> float:
    with torch.no_grad(), model.trace(prompts):
        logits = model.lm_head.output.save()
    return float(logit_difference(logits, task.correct_ids, task.incorrect_ids).mean())


def main() -> None:
    t0 = time.perf_counter()
    model, lorsa = embedded()
    tok = model.tokenizer
    r = ReplacementModel(model, lorsas=lorsa)
    builders = {"ioi": lambda: ioi_task(tok, 16), "greater_than": lambda: greater_than_task(tok, 16),
                "arithmetic": lambda: arithmetic_task(tok, [(a, b) for a in range(10, 26, 2) for b in (11, 13)])}
    results: dict = {"command": command("OMP_NUM_THREADS=1")}
    for name, build in builders.items():
        try:
            task = build()
        except TaskTokenizationError as e:
            results[name] = {"error": str(e)}
            print(f"{name}: not servable by this tokenizer: {e}")
            continue
        res: dict = {"n_prompts": len(task), "clean_logit_diff": round(logit_diff(model, r, task.clean, task), 3),
                     "corrupt_logit_diff": round(logit_diff(model, r, task.corrupt, task), 3)}
        with torch.no_grad(), model.trace(task.clean):
            z = lorsa.replace(LAYER, error=True).hook_z.output.save()
        lheads = [LorsaHead(LAYER, int(h)) for h in (z[:, 1:] > 0).any(0).any(0).nonzero().flatten()]
        mhsa = [MHSAHead(layer, h) for layer in range(4) for h in range(4)]
        means = mean_activations(r, mhsa, task.corrupt)
        sizes = {}
        for label, comps, mode in (("mhsa_layer2", [MHSAHead(LAYER, h) for h in range(4)], "mean"),
                                   ("lorsa_layer2", lheads, "zero"), ("mhsa_all_layers", mhsa, "mean")):
            if not comps:
                continue
            cs = circuit_size(r, task, comps, mode=mode, means=means if mode == "mean" else None)
            sizes[label] = {"n_components": len(comps), "global_k": cs.global_k,
                            "per_prompt_k_mean": round(float(cs.per_prompt_k.float().mean()), 2)}
        res["circuit_size"] = sizes
        results[name] = res
        print(name, json.dumps(res))
    results["total_seconds"] = round(time.perf_counter() - t0, 1)
    out = write_json(RESULTS / "tasks_circuit_size_tinyshakespeare.json", results)
    print(f"-> {out}")


if __name__ == "__main__":
    main()
