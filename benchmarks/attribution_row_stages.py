"""The attribution stages above the floor, before and after a change, in one run: the phases of ``gpu_scale``'s (d)
(:func:`benchmarks.gpu_scale.phase_times`: ``clean_pass_and_layout``, ``next_rows_influence``, ``record_rows``,
``assemble``, ``other``; ``frozen_forward`` and ``backward`` for scale) at its ``small`` CPU scale, with the Lorsa on
every layer and on one layer, for two trees: ``--before`` (a git commit, extracted with ``git archive`` into a
temporary folder) and this working tree (``after``). Each tree runs in its own process (its ``nnsight_lorsa`` and
``benchmarks.gpu_scale``), the two alternated ``--rounds`` times; per phase the median over every timed call
(``--repeats`` per round, after one untimed call). Each call's graph is digested (SHA-256 of its adjacency,
residuals, values, node ids and computed rows): ``identical`` says the two trees built the same graph bits.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmarks.attribution_row_stages --before 2eea6a9 \\
        --out benchmarks/results/attribution_row_stages_cpu.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._timing import arg, command, parser, write_json

ROOT = Path(__file__).resolve().parent.parent

#: one tree's measurements, run as ``python -c`` in that tree (its package and its ``benchmarks.gpu_scale``);
#: argv: lorsa layers ("all" or a layer), tokens (comma-separated), repeats, rows; prints one JSON line
CHILD = r'''
import gc, hashlib, json, sys, time, torch
from benchmarks import gpu_scale as g
from nnsight_lorsa import LorsaSet, ReplacementModel, TranscoderSet, attribute, get_adapter
from nnsight_lorsa.modules import Transcoder, TranscoderConfig

torch.manual_seed(0)
s, dev, dt = g.SCALES["small"], torch.device("cpu"), torch.float32
model, hf = g.build(s, dev, dt)
adapter = get_adapter(model)
which, tokens, repeats, rows = sys.argv[1], [int(t) for t in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4])
lorsas, tcs = LorsaSet(model), TranscoderSet(model)
for layer in (range(s["n_layers"]) if which == "all" else [int(which)]):
    lorsas[layer] = g.paper_lorsa(s, adapter, hf, layer, dev, dt)
for layer in range(s["n_layers"]):
    tcs[layer] = Transcoder(TranscoderConfig(d_in=s["d_model"], d_sae=s["d_tc"], activation="topk",
                                             activation_params={"k": s["k_tc"]}, layer=layer), device=dev, dtype=dt)
rm = ReplacementModel(model, lorsas=lorsas, transcoders=tcs)


def digest(graph):
    h = hashlib.sha256()
    for t in (graph.densify(), graph.residual, graph.values, graph.layout_ids, graph.feature_rows):
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


out = {}
for n in tokens:
    ids = torch.randint(0, s["vocab"], (1, n), generator=torch.Generator(device="cpu").manual_seed(n))
    attribute(rm, ids, batch_size=4, max_feature_nodes=rows)  # untimed
    calls = []
    for _ in range(repeats):
        gc.collect()
        with g.phase_times(dev) as phases:
            t = time.perf_counter()
            graph = attribute(rm, ids, batch_size=4, max_feature_nodes=rows)
            seconds = time.perf_counter() - t
        calls.append({"seconds": seconds, "phases": {**phases, "other": seconds - sum(phases.values())},
                      "digest": digest(graph)})
        del graph
    out[n] = calls
print(json.dumps(out))
'''


def run_tree(tree: Path, lorsa: str, tokens: list[int], repeats: int, rows: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run([sys.executable, "-c", CHILD, lorsa, ",".join(map(str, tokens)), str(repeats), str(rows)],
                          cwd=tree, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(calls: list[dict[str, Any]]) -> dict[str, Any]:
    names = sorted({k for c in calls for k in c["phases"]})
    return {"seconds_median": statistics.median(c["seconds"] for c in calls),
            "phases_median": {k: statistics.median(c["phases"].get(k, 0.0) for c in calls) for k in names},
            "calls": len(calls), "digests": sorted({c["digest"] for c in calls})}


def main() -> None:
    args = parser(__doc__, before=arg("HEAD", type=str, help="the git commit measured as 'before'"),
                  tokens=arg(nargs="+", type=int, default=[128, 256]), repeats=3, rounds=2, rows=64,
                  lorsa=arg(nargs="+", type=str, default=["all", "1"],
                            help="Lorsa layers of each configuration: 'all' or one layer"),
                  out=arg(None, type=str)).parse_args()
    commit = subprocess.run(["git", "rev-parse", args.before], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    result: dict[str, Any] = {"command": command("OMP_NUM_THREADS=1 PYTHONPATH=."), "before": commit,
                              "after": "working tree at " + subprocess.run(
                                  ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout.strip(), "scale": "small", "device": "cpu", "dtype": "float32",
                              "batch_size": 4, "max_feature_nodes": args.rows, "configs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        before_tree = Path(tmp)
        archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(before_tree)], input=archive, check=True)
        trees = {"before": before_tree, "after": ROOT}
        for lorsa in args.lorsa:
            calls: dict[str, dict[int, list[dict[str, Any]]]] = {k: {n: [] for n in args.tokens} for k in trees}
            for r in range(args.rounds):
                for name, tree in (trees.items() if r % 2 == 0 else reversed(list(trees.items()))):
                    print(f"lorsa {lorsa}: round {r + 1}/{args.rounds}, {name}", flush=True)
                    for n, got in run_tree(tree, lorsa, args.tokens, args.repeats, args.rows).items():
                        calls[name][int(n)] += got
            config: dict[str, Any] = {}
            for n in args.tokens:
                b, a = summary(calls["before"][n]), summary(calls["after"][n])
                config[str(n)] = {"before": b, "after": a, "identical": b["digests"] == a["digests"]
                                  and len(a["digests"]) == 1,
                                  "speedup": {k: b["phases_median"][k] / max(a["phases_median"].get(k, 0.0), 1e-9)
                                              for k in b["phases_median"]}}
                print(lorsa, n, {k: (round(b["phases_median"][k], 4), round(a["phases_median"].get(k, 0.0), 4))
                                 for k in b["phases_median"]}, "identical", config[str(n)]["identical"], flush=True)
            result["configs"]["all_layers" if lorsa == "all" else f"layer_{lorsa}"] = config
    path = write_json(args.out or Path(tempfile.gettempdir()) / "attribution_row_stages.json", result)
    print("wrote", path)


if __name__ == "__main__":
    main()
