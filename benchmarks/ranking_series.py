"""The feature budget's influence ranking on stored rows shaped like the 8B all-layer graph's, the former series
(one pass over every weighted row's entries per step) against the collapsed one (steps over the row nodes' columns,
binary-searched; one pass over every entry), in one run.

The rows are synthetic, as a budgeted attribution stores them (:class:`nnsight_lorsa.attribution.rows.SparseRows`):
``--layers`` layers of ``--cols / --layers`` sources each; ``--logits`` logit rows read every source, feature rows (at
sources of uniformly drawn layers) read every source of the layers below; ``--density`` of those entries non-zero
(the 8B shape's all-layer run at 1024 tokens: 6.36 M sources, 74 rows, 394 M stored entries, ~85 % of the possible
ones). Rankings as :class:`~nnsight_lorsa.attribution.rows.RowScheduler` runs them: after the logit rows, then every
``--interval`` batches of ``--batch`` feature rows. Per ranking: the seconds of each series, the influence's largest
difference relative to its largest value, and whether the top ``interval · batch`` unvisited features are the same.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmarks.ranking_series --out benchmarks/results/ranking_series.json
"""

from __future__ import annotations

import time
from typing import Any

import torch

from benchmarks._timing import command, parser, start, write_json
from nnsight_lorsa.attribution.nodes import HOST
from nnsight_lorsa.attribution.rows import SparseRows
from nnsight_lorsa.attribution.scores import row_influence


def former(rows: SparseRows, node: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The series as ranked until 2026-11-27 (``scores.row_influence`` then): ``Σ_k (w_k Â)``, each step a pass over
    every weighted row's entries at every column, into one reused vector."""
    den = rows.abs_total.clamp_min(1e-30)
    step = torch.empty(rows.n_cols, dtype=torch.float64, device=HOST)
    is_col = node < rows.n_cols
    cur = rows.weighted_abs(weight, None, den, out=step)
    total = cur.clone()
    while True:
        w = torch.zeros_like(weight)
        w[is_col] = cur[node[is_col]]
        if not bool(w.any()):
            return total
        cur = rows.weighted_abs(w, None, den, out=step)
        total += cur


def main() -> None:
    args = parser(__doc__, cols=1_600_000, layers=32, features=64, logits=10, batch=4, interval=4, density=0.85,
                  repeats=2, threads=1, out="benchmarks/results/ranking_series.json").parse_args()
    start(args)
    g = torch.Generator().manual_seed(0)
    per_layer = args.cols // args.layers
    n_cols = per_layer * args.layers
    feature_layer = torch.randint(1, args.layers, (args.features,), generator=g)
    feature_node = feature_layer * per_layer + torch.randint(0, per_layer, (args.features,), generator=g)
    order = [n_cols + i for i in range(args.logits)] + feature_node.tolist()
    rows = SparseRows(n_cols)
    done: list[int] = []
    runs: list[dict[str, Any]] = []

    def add(nodes: list[int]) -> None:
        grads = torch.zeros(len(nodes), n_cols, dtype=torch.float32)
        for i, nd in enumerate(nodes):
            upto = n_cols if nd >= n_cols else (nd // per_layer) * per_layer
            v = torch.randn(upto, generator=g)
            v[torch.rand(upto, generator=g) > args.density] = 0
            grads[i, :upto] = v
        rows.append(grads)
        done.extend(nodes)

    def rank() -> None:
        node = torch.tensor(done, dtype=torch.long)
        weight = torch.where(node >= n_cols, torch.rand(node.numel(), generator=g, dtype=torch.float64), 0.0)
        times: dict[str, list[float]] = {"former": [], "collapsed": []}
        out: dict[str, torch.Tensor] = {}
        for _ in range(args.repeats):
            for name, fn in (("former", lambda: former(rows, node, weight)),
                             ("collapsed", lambda: row_influence(rows_source, node, weight, n_cols))):
                t = time.perf_counter()
                out[name] = fn().clone()
                times[name].append(time.perf_counter() - t)
        a, b = out["former"], out["collapsed"]
        visited = torch.zeros(n_cols, dtype=torch.bool)
        visited[node[node < n_cols]] = True
        k = args.interval * args.batch
        top = [x.masked_fill(visited, -1.0).topk(k).indices.sort().values for x in (a, b)]
        runs.append({"rows": len(done), "stored_entries": rows.nnz,
                     "former_s": min(times["former"]), "collapsed_s": min(times["collapsed"]),
                     "speedup": min(times["former"]) / min(times["collapsed"]),
                     "max_rel_diff": float((a - b).abs().max() / a.abs().max().clamp_min(1e-300)),
                     "same_top": bool(torch.equal(top[0], top[1]))})
        print(runs[-1], flush=True)

    from nnsight_lorsa.attribution.rows import _SparseSource
    rows_source = _SparseSource(rows)
    i = 0
    for b in range(0, args.logits, args.batch):
        add(order[b:min(b + args.batch, args.logits)])
    i = args.logits
    while i < len(order):
        rank()
        for _ in range(args.interval):
            if i < len(order):
                add(order[i:i + args.batch])
                i += args.batch
    rank()
    write_json(args.out, {"command": command(f"OMP_NUM_THREADS={args.threads} PYTHONPATH=."),
                          "torch": torch.__version__, "threads": torch.get_num_threads(),
                          "n_cols": n_cols, "layers": args.layers, "density": args.density, "rankings": runs,
                          "total_former_s": sum(r["former_s"] for r in runs),
                          "total_collapsed_s": sum(r["collapsed_s"] for r in runs)})


if __name__ == "__main__":
    main()
