"""The attribution stages above the floor, before and after a change, in one run: the phases of ``gpu_scale``'s (d)
(:func:`benchmarks.gpu_scale.phase_times`: ``clean_pass_and_layout``, ``next_rows_influence``, ``record_rows``,
``assemble``, ``other``; ``frozen_forward`` and ``backward`` for scale) at its ``small`` CPU scale, with the Lorsa on
every layer and on one layer (``--prune``: also or instead pruned while built, ``PruneConfig(keep_mass=...)``, with
the pruned assembly's allocations — ops that allocate, bytes — counted under the profiler in one more call), for two
trees: ``--before`` (a git commit, extracted with ``git archive`` into a
temporary folder) and this working tree (``after``). Each tree runs in its own process (its ``nnsight_lorsa`` and
``benchmarks.gpu_scale``), the two alternated ``--rounds`` times; per phase the median over every timed call
(``--repeats`` per round, after one untimed call). Each call's graph is digested (SHA-256 of its adjacency,
residuals, values, node ids and computed rows): ``identical`` says the two trees built the same graph bits.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmarks.attribution_row_stages --before 2eea6a9 \\
        --out benchmarks/results/attribution_row_stages_cpu.json
    OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmarks.attribution_row_stages --before 25aa388 --prune 0.9 \\
        --lorsa all --wide-cols 0 --tokens 128 256 512 --out benchmarks/results/attribution_row_stages_prune_cpu.json
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
from nnsight_lorsa.attribution import PruneConfig
prune = None if sys.argv[5] == "none" else PruneConfig(keep_mass=float(sys.argv[5]))
kw = {"batch_size": 4, "max_feature_nodes": rows or None, "prune": prune}
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
    attribute(rm, ids, **kw)  # untimed
    calls = []
    for _ in range(repeats):
        gc.collect()
        with g.phase_times(dev) as phases:
            t = time.perf_counter()
            graph = attribute(rm, ids, **kw)
            seconds = time.perf_counter() - t
        calls.append({"seconds": seconds, "phases": {**phases, "other": seconds - sum(phases.values())},
                      "digest": digest(graph)})
        del graph
    if prune is not None:  # one more call: the pruned assembly's allocations, under the profiler (not timed)
        import nnsight_lorsa.attribution.engine as engine
        from torch.profiler import ProfilerActivity, profile
        original = engine.assemble_pruned

        def profiled(*a, **k):
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as p:
                got = original(*a, **k)
            sizes = [e.self_cpu_memory_usage for e in p.events() if e.self_cpu_memory_usage > 0]
            calls[0]["assemble_allocations"] = {"ops_allocating": len(sizes), "bytes": sum(sizes)}
            return got

        engine.assemble_pruned = profiled
        attribute(rm, ids, **kw)
        engine.assemble_pruned = original
    out[n] = calls
print(json.dumps(out))
'''

#: the stored rows' stages at the 8B shape's node count, without a model: 74 rows (10 logit rows, 64 feature rows in
#: 16 levels of 4, each row with an edge from every deeper level's rows and ``--wide-entries`` others) over
#: ``--wide-cols`` sources, stored in batches of 4 (``record``), then the influence ranking over all of them as
#: :meth:`RowScheduler.feature_influence` runs it — every node (``influence``) and with 256 sources left out
#: (``influence_masked``, as bias nodes are) — 17 steps of the series; argv: columns, entries per row, repeats
WIDE = r'''
import json, sys, time, torch
from nnsight_lorsa.attribution.rows import SparseRows

n_cols, per_row, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
g = torch.Generator().manual_seed(0)
levels, width, n_logits = 16, 4, 10
node = torch.cat([torch.arange(levels * width) * (n_cols // (levels * width + 1)),
                  torch.full((n_logits,), n_cols)])  # feature rows' columns, then the logit rows (no column)
order = list(range(levels * width, levels * width + n_logits)) + list(range(levels * width))
level = [r // width for r in range(levels * width)] + [-1] * n_logits
batches = []
for i in range(0, len(order), 4):
    grads = torch.zeros(len(order[i:i + 4]), n_cols)
    for j, r in enumerate(order[i:i + 4]):
        grads[j, torch.randint(0, n_cols, (per_row,), generator=g)] = torch.randn(per_row, generator=g)
        grads[j, node[:levels * width]] = 0  # the rows' own columns: only the levels' edges (a DAG of 16 levels)
        deeper = [c for c in range(levels * width) if level[c] > level[r]]
        grads[j, node[deeper]] = torch.rand(len(deeper), generator=g) + 0.5
    batches.append(grads)
row_node = node[order]
weight = torch.where(row_node >= n_cols, 1.0 / n_logits, 0.0).double()
mask = torch.ones(n_cols + 1, dtype=torch.bool)
mask[torch.randperm(n_cols - 1, generator=g)[:256] + 1] = False
mask[node] = True
out = {"record": [], "influence": [], "influence_masked": []}
for _ in range(repeats):
    rows = SparseRows(n_cols)
    t = time.perf_counter()
    for grads in batches:
        rows.append(grads)
    out["record"].append(time.perf_counter() - t)
    t = time.perf_counter()
    full = rows.influence(row_node, weight)
    out["influence"].append(time.perf_counter() - t)
    t = time.perf_counter()
    masked = rows.influence(row_node, weight, mask)
    out["influence_masked"].append(time.perf_counter() - t)
    del rows
import hashlib
out["digest"] = hashlib.sha256(full.numpy().tobytes() + masked.numpy().tobytes()).hexdigest()
print(json.dumps(out))
'''


def run_tree(tree: Path, lorsa: str, tokens: list[int], repeats: int, rows: int, prune: str = "none"
             ) -> dict[str, Any]:
    return _child(tree, CHILD, lorsa, ",".join(map(str, tokens)), str(repeats), str(rows), prune)


def _child(tree: Path, code: str, *argv: str) -> Any:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run([sys.executable, "-c", code, *argv], cwd=tree, env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def summary(calls: list[dict[str, Any]]) -> dict[str, Any]:
    names = sorted({k for c in calls for k in c["phases"]})
    allocations = [c["assemble_allocations"] for c in calls if "assemble_allocations" in c]
    return {**({"assemble_allocations": allocations[0]} if allocations else {}),
            "seconds_median": statistics.median(c["seconds"] for c in calls),
            "phases_median": {k: statistics.median(c["phases"].get(k, 0.0) for c in calls) for k in names},
            "calls": len(calls), "digests": sorted({c["digest"] for c in calls})}


def main() -> None:
    args = parser(__doc__, before=arg("HEAD", type=str, help="the git commit measured as 'before'"),
                  tokens=arg(nargs="+", type=int, default=[128, 256]), repeats=3, rounds=2,
                  rows=arg(64, "the feature budget (0: none, every feature row)"),
                  lorsa=arg(nargs="*", type=str, default=["all", "1"],
                            help="Lorsa layers of each configuration: 'all' or one layer"),
                  prune=arg(["none"], nargs="+", type=str,
                            help="per configuration: 'none' (no pruning) or a keep_mass — attribute(prune=PruneConfig("
                                 "keep_mass=...)), the pruned assembly's allocations counted in one more call"),
                  wide_cols=arg(6_300_000, help="sources of the model-free wide rows (0: skip them); the 8B shape's "
                                                "all-layer graph at 1024 tokens has ~6.3M"),
                  wide_entries=arg(20_000, help="random entries per wide row (besides the deeper rows' columns)"),
                  out=arg(None, type=str)).parse_args()
    commit = subprocess.run(["git", "rev-parse", args.before], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    result: dict[str, Any] = {"command": command("OMP_NUM_THREADS=1 PYTHONPATH=."), "before": commit,
                              "after": "working tree at " + subprocess.run(
                                  ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout.strip(), "scale": "small", "device": "cpu", "dtype": "float32",
                              "batch_size": 4, "max_feature_nodes": args.rows or None, "configs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        before_tree = Path(tmp)
        archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(before_tree)], input=archive, check=True)
        trees = {"before": before_tree, "after": ROOT}
        for lorsa, prune in ((lorsa, prune) for lorsa in args.lorsa for prune in args.prune):
            calls: dict[str, dict[int, list[dict[str, Any]]]] = {k: {n: [] for n in args.tokens} for k in trees}
            for r in range(args.rounds):
                for name, tree in (trees.items() if r % 2 == 0 else reversed(list(trees.items()))):
                    print(f"lorsa {lorsa}, prune {prune}: round {r + 1}/{args.rounds}, {name}", flush=True)
                    for n, got in run_tree(tree, lorsa, args.tokens, args.repeats, args.rows, prune).items():
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
            key = "all_layers" if lorsa == "all" else f"layer_{lorsa}"
            result["configs"][key if prune == "none" else f"{key}_prune_keep_mass_{prune}"] = config
        if args.wide_cols:
            wide: dict[str, dict[str, list[float]]] = {}
            for r in range(args.rounds):
                for name, tree in (trees.items() if r % 2 == 0 else reversed(list(trees.items()))):
                    print(f"wide rows ({args.wide_cols} sources): round {r + 1}/{args.rounds}, {name}", flush=True)
                    got = _child(tree, WIDE, str(args.wide_cols), str(args.wide_entries), str(args.repeats))
                    into = wide.setdefault(name, {"digest": []})  # type: ignore[arg-type]
                    into["digest"].append(got.pop("digest"))
                    for k, v in got.items():
                        into.setdefault(k, []).extend(v)
            result["wide"] = {"sources": args.wide_cols, "entries_per_row": args.wide_entries, "rows": 74,
                              "identical": len(set(wide["before"]["digest"] + wide["after"]["digest"])) == 1,
                              **{name: {k: statistics.median(v) for k, v in got.items() if k != "digest"}
                                 for name, got in wide.items()}}
            print("wide", result["wide"], flush=True)
    path = write_json(args.out or Path(tempfile.gettempdir()) / "attribution_row_stages.json", result)
    print("wrote", path)


if __name__ == "__main__":
    main()
