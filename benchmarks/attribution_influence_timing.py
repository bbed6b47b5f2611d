"""Wall time of the influence inside ``attribute``: the feature budget's selection (``RowScheduler.feature_influence``,
summed over the call) and the assembly of a graph pruned while built (``assemble_pruned``), on the embedded model.

    python -m benchmarks.attribution_influence_timing [--tokens 128] [--name attribution_influence_timing]

Three calls per run (after a warm-up each): ``max_feature_nodes=64`` (batch 16), the same with ``prune=(0.8, 0.98)``,
and the full graph with ``prune=(0.8, 0.98)`` (batch 64). To compare trees, run it from a directory without a
package of its own with the other tree first on ``PYTHONPATH`` (as ``graph_postprocess_scale``'s docstring shows).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._timing import command, embedded, parser, start, write


def main() -> None:
    args = parser(__doc__, tokens=128, name="attribution_influence_timing").parse_args()
    start(args)
    import nnsight_lorsa
    import nnsight_lorsa.attribution.rows as rows_module
    from nnsight_lorsa import ReplacementModel, TranscoderSet
    from nnsight_lorsa.assets import default_transcoder_dir
    from nnsight_lorsa.attribution import attribute

    engine = sys.modules["nnsight_lorsa.attribution.engine"]
    model, lorsas = embedded()
    tcs = TranscoderSet.from_pretrained(model, default_transcoder_dir())
    rm = ReplacementModel(model, lorsas=lorsas, transcoders=tcs)
    ids = torch.randint(1, 60, (args.tokens,), generator=torch.Generator().manual_seed(0))
    acc = {"feature_influence_s": 0.0, "assemble_pruned_s": 0.0, "selections": 0}

    def timed(fn: Any, key: str) -> Any:
        def wrapped(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = fn(*a, **k)
            acc[key] += time.perf_counter() - t
            acc["selections"] += key == "feature_influence_s"
            return out
        return wrapped

    scheduler = rows_module.RowScheduler
    scheduler.feature_influence = timed(scheduler.feature_influence, "feature_influence_s")  # type: ignore[method-assign]
    engine.assemble_pruned = timed(engine.assemble_pruned, "assemble_pruned_s")
    runs: dict[str, dict[str, Any]] = {}
    for name, kw in (("budget64", dict(batch_size=16, max_feature_nodes=64)),
                     ("budget64_prune", dict(batch_size=16, max_feature_nodes=64, prune=(0.8, 0.98))),
                     ("full_prune", dict(batch_size=64, prune=(0.8, 0.98)))):
        attribute(rm, ids[:8], **kw)
        acc.update(feature_influence_s=0.0, assemble_pruned_s=0.0, selections=0)
        t = time.perf_counter()
        g = attribute(rm, ids, **kw)
        runs[name] = {"total_s": time.perf_counter() - t, "n_nodes": g.n_nodes, **acc}
        print(name, runs[name], flush=True)
    print("->", write(args.name, {"command": command("OMP_NUM_THREADS=1"), "tokens": args.tokens,
                                  "package": str(Path(nnsight_lorsa.__file__).parent), "runs": runs}))


if __name__ == "__main__":
    main()
