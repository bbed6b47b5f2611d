"""When and why Lorsa heads die: held-out FVU and dead fraction during one recipe run, then the dead heads
split into "negative pre-activation on every held-out token" and "positive somewhere, never in the top-k".

Same cache, Lorsa and batches as ``benchmarks/lorsa_recipe.py`` (layer 2 of the embedded model, 1024 OV
heads, k 16); the run is identical to that script's row for the same variant (same seed).

    OMP_NUM_THREADS=1 python -m benchmarks.lorsa_dead_heads 'recipe:lr=0.004' 600
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import benchmarks.lorsa_recipe as B
from nnsight_lorsa import Lorsa, LorsaConfig, get_adapter
from nnsight_lorsa.envoy import load_model
from nnsight_lorsa.envoy.read import Site
from nnsight_lorsa.training import ActivationSource, LorsaObjective, LorsaRecipe, TrainConfig, Trainer


def main() -> None:
    spec, steps = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    model, layer = load_model(), 2
    train_cache, held, _ = B.caches(model, layer, Path("/tmp/nnsight_lorsa_recipe_cache"))
    tc, rc, _ = B.parse_variant(spec)
    a = get_adapter(model)
    mhsa = a.mhsa_weights(model._module, layer)
    torch.manual_seed(0)
    cfg = LorsaConfig.from_mhsa(mhsa, n_ov_heads=1024, top_k=16, qk_heads_per_mhsa_head=4, layer=layer)
    source = ActivationSource(train_cache, Site.attn_input(a, layer), Site.attn_output(a, layer), batch_size=16,
                              seed=0)
    trainer = Trainer(LorsaObjective(Lorsa(cfg), mhsa=mhsa, recipe=LorsaRecipe(**rc)),
                      source, TrainConfig(total_steps=steps, **tc))
    ids = torch.arange(held.n_windows)
    X, Y, M = held.windows("x", ids), held.windows("y", ids), held.windows("loss_mask", ids)

    @torch.no_grad()
    def probe() -> tuple[float, float, torch.Tensor, torch.Tensor]:
        f = trainer.folded()
        counts, z_max, sse = torch.zeros(1024), torch.full((1024,), -torch.inf), 0.0
        for i in range(0, len(ids), 16):
            out, c = f(X[i:i + 16], return_cache=True)
            m = M[i:i + 16]
            counts += c.active[m].sum(0)
            z_max = torch.maximum(z_max, c.z_pre[m].amax(0))
            sse += float((Y[i:i + 16] - out)[m].double().pow(2).sum())
        ys = Y[M].double()
        return sse / float((ys - ys.mean(0)).pow(2).sum()), float((counts == 0).float().mean()), counts, z_max

    curve = []
    for stop in sorted({1, *range(steps // 12 or 1, steps + 1, steps // 12 or 1), steps}):
        trainer.train(stop - trainer.step, progress=False)
        fv, dead, counts, z_max = probe()
        curve.append({"step": trainer.step, "fvu": round(fv, 4), "dead_frac": round(dead, 4)})
        print(json.dumps(curve[-1]), flush=True)
    dead = counts == 0
    alive = counts[~dead].sort(descending=True).values
    summary = {"variant": spec, "steps": steps, "curve": curve, "dead": int(dead.sum()),
               "dead_negative_everywhere": int((dead & (z_max <= 0)).sum()),
               "dead_outcompeted": int((dead & (z_max > 0)).sum()),
               "alive_firing_quantiles": [int(alive[int(q * (len(alive) - 1))]) for q in (0, .25, .5, .75, 1)],
               "alive_per_qk_group": torch.bincount((torch.arange(1024) // cfg.group_size)[~dead],
                                                    minlength=cfg.n_qk_heads).tolist()}
    print(json.dumps({k: v for k, v in summary.items() if k != "curve"}), flush=True)


if __name__ == "__main__":
    main()
