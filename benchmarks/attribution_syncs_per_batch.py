"""Would-be device→host syncs per attribution batch (issue 21), counted on CPU with the proxy of
:mod:`benchmarks._sync_points`: a Lorsa + transcoders graph of the bundled tinyshakespeare replacement model
(Lorsa on layer 2, transcoders on every MLP; ``--seq`` tokens, batch 8) in the memory modes default, lean, a
feature budget and pruning while building (from the full graph's blocks; ``prune_sparse``: ``keep_mass=0.9``, the
stored sparse rows; ``prune_budget``: with a feature budget) (the tests' embedded model:
``tests/attribution/test_sync_points.py``).
``--before JSON`` embeds an earlier run (e.g. of the tree before a change) as ``before``.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmarks.attribution_syncs_per_batch --out counts.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks._sync_points import count_syncs
from benchmarks.bench_attribution import prompt_ids, replacement
from nnsight_lorsa import ReplacementModel
from nnsight_lorsa.attribution import PruneConfig, attribute
from nnsight_lorsa.envoy import load_model

MODES: dict[str, dict] = {"default": {}, "lean": {"memory": "lean"}, "budget": {"max_feature_nodes": 24},
                          "prune": {"prune": PruneConfig()},
                          "prune_sparse": {"prune": PruneConfig(keep_mass=0.9)},  # the stored rows' path
                          "prune_budget": {"prune": PruneConfig(), "max_feature_nodes": 24}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--before", type=Path, default=None, help="an earlier run's JSON, embedded as 'before'")
    p.add_argument("--seq", type=int, default=16, help="prompt tokens")
    args = p.parse_args()
    model = load_model()
    lorsas, tcs = replacement(model)
    r, ids = ReplacementModel(model, lorsas=lorsas, transcoders=tcs), prompt_ids(model, args.seq)
    modes = {}
    for name, kw in MODES.items():
        with count_syncs() as counts:
            attribute(r, ids, batch_size=8, **kw)
        s = counts.summary()
        s["max_after_first"] = max(counts.per_batch[1:], default=0)
        s["top_sites"] = counts.top(12)
        modes[name] = s
        print(name, "batches", s["batches"], "first", counts.per_batch[0], "max after the first",
              s["max_after_first"], "mean", s["mean_per_batch"])
    out = {"command": "OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmarks.attribution_syncs_per_batch "
                      + " ".join(sys.argv[1:]),
           "torch": torch.__version__, "model": "bundled tinyshakespeare replacement model (Lorsa on layer 2, "
           f"transcoders on every MLP), {args.seq} tokens, batch 8", "modes": modes}
    if args.before is not None:
        out = {"before": json.loads(args.before.read_text()), "after": out}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
