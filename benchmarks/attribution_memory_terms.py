"""Where an attribution's memory goes, term by term: RSS at the phases of one ``attribute`` call.

    python -m benchmarks.attribution_memory_terms [--lengths 64,128,256] [--batch 64] [--name attribution_memory_terms]
        [--modes dense,pruned,budget,sparse,budget_pruned] [--budget 64] [--keep-mass 0.9] [--node-threshold 0.8]

The embedded tinyshakespeare Llama with its packaged transcoders on all four MLPs (no Lorsa), one thread, a fresh
process per length and mode (``dense``: the full graph; ``pruned``: ``prune=PruneConfig(0.8, 0.98)``, equal to dense
pruning; ``budget``: ``max_feature_nodes=--budget``, unpruned, with ``estimate_memory``'s prediction and the bytes the
graph's adjacency holds; the two modes pruned on sparse rows: ``sparse``: ``prune=PruneConfig(--node-threshold, 0.98,
keep_mass=--keep-mass)``, ``budget_pruned``: ``max_feature_nodes=--budget`` with ``prune=PruneConfig(--node-threshold,
0.98)`` — these also record the entries among the node-pruned nodes, ``among_entries``, which the edge scores cover,
and the kept graph's size). The phases are read by wrapping the engine's steps (``prepare``, the frozen pass
``attribute_in_trace``, each ``RowStore.record``, ``assemble`` / ``assemble_pruned``, the budget's
``RowScheduler.feature_influence``) and reading Linux's ``VmRSS`` / ``VmHWM`` (reset before the call, and again — the
call's peak so far kept — at the assembly and at each selection, whose own peaks are then measured): *clean pass*
(peak growth up to the layout), *frozen pass* (peak growth from there to the end of the second batch: the forward over
``B`` copies and one backward), *rows* (RSS growth from then to the end of the frozen pass: the stored rows, and the
allocator's retention), *rows held* (the bytes the stored rows hold as the assembly starts — blocks, or sparse entries
+ 16 B per row — plus, unpruned with a budget, the graph's blocks), *assembly* (peak growth during assembly /
pruning), *selection* (the largest peak growth of one influence estimate, the heap trimmed first), the call's peak,
and ``estimate_memory``'s prediction of each term (``predicted``). After the call the assembly runs once more on the
same stored rows under ``benchmarks._alloc_peak.allocation_peak``: ``assembly_alloc_mb``, the most tensor memory it
allocates at once — reproducible to the byte, where the resident-set peak moves by MBs with the heap's state. Run
against another checkout (its directory first on ``PYTHONPATH``) to compare versions; the numbers of this one and of
``main`` before this round are in docs/attribution.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def child(seq: int, batch: int, mode: str, budget: int = 64, keep_mass: float = 0.9,
          node_threshold: float = 0.8) -> None:
    import torch

    import nnsight_lorsa.attribution.rows as rows_module
    from benchmarks._alloc_peak import allocation_peak
    from nnsight_lorsa import ReplacementModel
    from nnsight_lorsa._memory import release_free_memory
    from nnsight_lorsa.assets import default_corpus_path, default_transcoder_dir
    from nnsight_lorsa.attribution import PruneConfig, attribute, estimate_memory
    from nnsight_lorsa.envoy import load_model
    from nnsight_lorsa.formats import load

    engine = sys.modules["nnsight_lorsa.attribution.engine"]
    torch.set_num_threads(1)
    model = load_model()
    tcs = {int(p.name.split("_")[1]): load(p) for p in sorted(default_transcoder_dir().glob("layer_*"))}
    rm = ReplacementModel(model, transcoders=tcs)
    text = Path(default_corpus_path()).read_text(encoding="utf-8")[20_000:40_000]
    ids = model.tokenizer(text, return_tensors="pt")["input_ids"][0, :seq]
    prune = {"pruned": PruneConfig(0.8, 0.98), "budget_pruned": PruneConfig(node_threshold, 0.98),
             "sparse": PruneConfig(node_threshold, 0.98, keep_mass=keep_mass)}.get(mode)
    mfn = budget if mode in ("budget", "budget_pruned") else None
    attribute(rm, ids[:8], batch_size=batch, prune=prune, max_feature_nodes=mfn)  # warm-up
    marks: dict[str, tuple[int, int]] = {}
    seen = {"hwm": 0, "selection": 0, "rows_held": 0, "assembly": 0}

    def mark(name: str) -> None:  # (RSS, the peak so far: across the resets below)
        marks[name] = (_kb("VmRSS"), max(_kb("VmHWM"), seen["hwm"]))

    def reset_peak() -> None:  # VmHWM := VmRSS, the call's peak so far kept
        seen["hwm"] = max(seen["hwm"], _kb("VmHWM"))
        Path("/proc/self/clear_refs").write_text("5")

    def held(store) -> int:  # bytes the stored rows hold: blocks, or sparse entries + per-row float64 vectors
        if isinstance(store, rows_module.SparseRows):
            return sum(b.fill * (b.col.element_size() + b.val.element_size()) for b in store.blocks) + 16 * store.n_rows
        return int(getattr(store, "nbytes", 0))

    for fn in ("prepare", "attribute_in_trace", "assemble", "assemble_pruned"):
        orig = getattr(engine, fn)

        def wrapped(*a, _orig=orig, _name=fn, **k):
            mark(f"start {_name}")
            if _name.startswith("assemble"):  # the assembly's own peak: VmHWM reset (the call's kept)
                seen["rows_held"] = held(a[1].rows)
                seen["assembly_call"] = (_orig, a, k)  # run again after the call, for its allocation-level peak
                reset_peak()
            out = _orig(*a, **k)
            if _name.startswith("assemble"):
                seen["assembly"] = _kb("VmHWM") - marks[f"start {_name}"][0]
            mark(f"end {_name}")
            return out

        setattr(engine, fn, wrapped)
    record = rows_module.RowStore.record
    calls = [0]

    def counted(self, rows, grads):
        calls[0] += 1
        if calls[0] == 3:
            mark("batch 2 done")
        return record(self, rows, grads)

    rows_module.RowStore.record = counted
    influence = rows_module.RowScheduler.feature_influence

    def selection(self):  # the influence-ordered selection's own peak (heap trimmed, VmHWM reset, the call's kept)
        release_free_memory()  # else the batch's freed temporaries, still in the heap, hide its allocations
        reset_peak()
        start = _kb("VmRSS")
        out = influence(self)
        seen["selection"] = max(seen["selection"], _kb("VmHWM") - start)
        return out

    rows_module.RowScheduler.feature_influence = selection
    pruned_on: list = []  # prune_rows's rows and masks (references), to count the entries it scored after the call
    prune_rows = rows_module.prune_rows

    def spied(rows, row_node, row_weight, node_mask, *a, **k):
        pruned_on[:] = [rows, row_node, node_mask]
        return prune_rows(rows, row_node, row_weight, node_mask, *a, **k)

    rows_module.prune_rows = spied
    mark("begin")
    Path("/proc/self/clear_refs").write_text("5")
    mark("begin")
    g = attribute(rm, ids, batch_size=batch, prune=prune, max_feature_nodes=mfn)
    mark("end")
    base = marks["begin"][0]
    asm = "assemble_pruned" if prune is not None else "assemble"
    mb = 1 / 1024
    out = {"seq": seq, "mode": mode, "batch": batch,
           "clean_pass_mb": (marks["end prepare"][1] - base) * mb,
           "frozen_pass_mb": (marks["batch 2 done"][1] - marks["end prepare"][0]) * mb,
           "rows_mb": (marks["end attribute_in_trace"][0] - marks["batch 2 done"][0]) * mb,
           "assembly_mb": seen["assembly"] * mb,
           "peak_mb": (max(seen["hwm"], marks["end"][1], marks[f"start {asm}"][1]) - base) * mb, "n_nodes": g.n_nodes,
           "stored_entries": (g.meta.get("pruned") or {}).get("stored_entries"),
           "selection_mb": seen["selection"] * mb, "rows_held_mb": seen["rows_held"] / 2**20}
    assembly, a, k = seen.pop("assembly_call")
    out["assembly_alloc_mb"] = allocation_peak(assembly, *a, **k)[1] / 2**20
    del assembly, a, k
    if pruned_on:  # the stored entries among the node-pruned nodes (what the edge scores cover), the kept graph
        rows, row_node, node_mask = pruned_on
        ns = rows.n_cols if hasattr(rows, "n_cols") else rows.rows.n_cols  # entries (before), the store's view
        out.update(among_entries=rows.count_edges(node_mask[:ns], node_mask[row_node]), keep_mass=prune.keep_mass,
                   node_threshold=prune.node_threshold,
                   kept_adjacency_mb=g.n_nodes ** 2 * g.residual.element_size() / 2**20)
        pruned_on.clear()
    # the memory model's prediction of each term, for every mode (MB; frozen = per copy × batch + shared)
    est = estimate_memory(rm, ids, batch_size=batch, prune=prune, max_feature_nodes=mfn)
    t = est.terms
    out["predicted"] = {"frozen_pass_mb": (t["frozen_per_copy"] * batch + t["frozen_shared"]) / 2**20,
                        "rows_mb": t["rows"] / 2**20, "pruning_mb": t["pruning"] / 2**20,
                        "selection_mb": t["selection"] / 2**20, "fixed_mb": t["fixed"] / 2**20,
                        "host_mb": est.host_bytes / 2**20, "stored_entries": t["stored_entries"]}
    if mode == "budget":  # the adjacency the graph holds (blocks, or a dense matrix in older versions) and the estimate
        blocks = g.block_adjacency
        out["rows_held_mb"] += (blocks.nbytes if blocks is not None else 0) / 2**20  # the sparse rows + the blocks
        out.update(budget=mfn, feature_rows=int(g.feature_rows.sum()),
                   adjacency_mb=(blocks.nbytes if blocks is not None else g.densify().nbytes) / 2**20,
                   dense_adjacency_mb=g.n_nodes ** 2 * 4 / 2**20, estimate_host_mb=est.host_bytes / 2**20,
                   estimate_rows_mb=est.terms["rows"] / 2**20)
    print(json.dumps(out))


def main() -> None:
    from benchmarks._timing import arg, command, parser, write

    args = parser(__doc__, lengths="64,128,256", batch=64, modes="dense,pruned", budget=64,
                  name="attribution_memory_terms", child=arg("", argparse_suppress()),
                  keep_mass=0.9, node_threshold=0.8, seq=arg(0, argparse_suppress())).parse_args()
    if args.child:
        child(args.seq, args.batch, args.child, args.budget, args.keep_mass, args.node_threshold)
        return
    runs = []
    for seq in [int(s) for s in args.lengths.split(",") if s]:
        for mode in args.modes.split(","):
            res = subprocess.run([sys.executable, "-m", f"benchmarks.{Path(__file__).stem}", "--child", mode, "--seq",
                                  str(seq), "--batch", str(args.batch), "--budget", str(args.budget),
                                  "--keep-mass", str(args.keep_mass), "--node-threshold", str(args.node_threshold)],
                                 capture_output=True, text=True,
                                 env=dict(os.environ), cwd=Path(__file__).resolve().parent.parent)
            if res.returncode != 0:
                raise RuntimeError(res.stderr[-3000:])
            runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), flush=True)
    print(f"-> {write(args.name, {'command': command(), 'runs': runs})}")


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
