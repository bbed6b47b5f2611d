"""``benchmarks/lorsa_recipe.py`` with a probe every ``log_every`` steps: the training dead fraction, the
``"balance"`` state (fraction of heads under the floor, at the cap, mean log-gain) and, at the steps in
``--probe-at``, the held-out FVU and dead fraction of the Lorsa folded at that step (gains still on are
folded in, so it is the function trained at that step). Same arguments as ``lorsa_recipe.py`` otherwise::

    OMP_NUM_THREADS=1 python -m benchmarks.lorsa_recipe_probe --probe-at 50,100,150,200 \\
        --model H/ts-gpt2 --layer 2 --steps 200 --cache-dir C --variants annealed_balance,recipe_lr4e-3
"""

from __future__ import annotations

import sys
from typing import Any

import benchmarks.lorsa_recipe as R
from nnsight_lorsa.training import Trainer


def main() -> None:
    argv = sys.argv[1:]
    probe_at: set[int] = set()
    if "--probe-at" in argv:
        i = argv.index("--probe-at")
        probe_at = {int(s) for s in argv[i + 1].split(",")}
        del argv[i:i + 2]
    sys.argv[1:] = argv
    held: dict[str, Any] = {}
    train = Trainer.train
    run_variant = R.run_variant

    def probed_train(self: Trainer, *a: Any, **kw: Any) -> Any:
        def on_log(m: dict[str, float]) -> None:
            o = self.objective
            line = f"step {int(m['step']):4d} fvu {m['fvu']:.4f} train_dead {m['dead_frac']:.3f}"
            b = getattr(o, "balance", None)
            if b is not None:
                rec, cfg = o.recipe, o.module.cfg  # type: ignore[attr-defined]
                floor = rec.balance_floor * cfg.top_k / cfg.n_ov_heads
                line += (f" under_floor {float((b.freq < floor).float().mean()):.3f}"
                         f" at_cap {float((b.log_gain >= rec.balance_max - 1e-6).float().mean()):.3f}"
                         f" mean_log_gain {float(b.log_gain.mean()):.3f}")
            if int(m["step"]) in probe_at and "cache" in held:
                h = R.heldout_metrics(self.folded(), held["cache"])  # type: ignore[arg-type]
                line += f" | held-out fvu {h['fvu']:.4f} dead {h['dead_frac']:.3f}"
            print(line, flush=True)

        kw["on_log"] = on_log
        return train(self, *a, **kw)

    def probed_run_variant(name: str, model: Any, layer: int, train_cache: Any, held_cache: Any, *a: Any,
                           **kw: Any) -> dict[str, Any]:
        held["cache"] = held_cache
        return run_variant(name, model, layer, train_cache, held_cache, *a, **kw)

    Trainer.train = probed_train  # type: ignore[method-assign]
    R.run_variant = probed_run_variant
    R.main()


if __name__ == "__main__":
    main()
