"""Where an attribution's memory goes, term by term: RSS at the phases of one ``attribute`` call.

    python -m benchmarks.attribution_memory_terms [--lengths 64,128,256] [--batch 64] [--name attribution_memory_terms]
        [--modes dense,pruned,budget] [--budget 64]

The embedded tinyshakespeare Llama with its packaged transcoders on all four MLPs (no Lorsa), one thread,
a fresh process per length and mode (``dense``: the full graph; ``pruned``: ``prune=PruneConfig(0.8, 0.98)``,
equal to dense pruning; ``budget``: ``max_feature_nodes=--budget``, unpruned, with ``estimate_memory``'s
prediction and the bytes the graph's adjacency holds). The phases are read by wrapping the engine's steps
(``prepare``, the frozen pass ``attribute_in_trace``, each ``RowStore.record``, ``assemble`` /
``assemble_pruned``) and reading Linux's ``VmRSS`` / ``VmHWM`` (reset before the call, and in ``budget`` mode
again at the assembly, whose own peak is then measured): *clean pass* (peak growth up to the layout), *frozen pass*
(peak growth from there to the end of the second batch: the forward over ``B`` copies and one backward),
*rows* (RSS growth from then to the end of the frozen pass: the stored rows, and the allocator's retention),
*assembly* (peak growth during assembly / pruning), and the call's peak. Run against another checkout (its
directory first on ``PYTHONPATH``) to compare versions; the numbers of this one and of ``main`` before
this round are in docs/attribution.md.
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


def child(seq: int, batch: int, mode: str, budget: int = 64) -> None:
    import torch

    import nnsight_lorsa.attribution.rows as rows_module
    from nnsight_lorsa import ReplacementModel
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
    prune = PruneConfig(0.8, 0.98) if mode == "pruned" else None
    mfn = budget if mode == "budget" else None
    attribute(rm, ids[:8], batch_size=batch, prune=prune, max_feature_nodes=mfn)  # warm-up
    marks: dict[str, tuple[int, int]] = {}

    def mark(name: str) -> None:
        marks[name] = (_kb("VmRSS"), _kb("VmHWM"))

    for fn in ("prepare", "attribute_in_trace", "assemble", "assemble_pruned"):
        orig = getattr(engine, fn)

        def wrapped(*a, _orig=orig, _name=fn, **k):
            mark(f"start {_name}")
            if mode == "budget" and _name == "assemble":  # the assembly's own peak: VmHWM reset (the call's kept)
                Path("/proc/self/clear_refs").write_text("5")
            out = _orig(*a, **k)
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
    mark("begin")
    Path("/proc/self/clear_refs").write_text("5")
    mark("begin")
    g = attribute(rm, ids, batch_size=batch, prune=prune, max_feature_nodes=mfn)
    mark("end")
    base = marks["begin"][0]
    asm = "assemble_pruned" if mode == "pruned" else "assemble"
    mb = 1 / 1024
    out = {"seq": seq, "mode": mode, "batch": batch,
           "clean_pass_mb": (marks["end prepare"][1] - base) * mb,
           "frozen_pass_mb": (marks["batch 2 done"][1] - marks["end prepare"][0]) * mb,
           "rows_mb": (marks["end attribute_in_trace"][0] - marks["batch 2 done"][0]) * mb,
           "assembly_mb": (marks[f"end {asm}"][1] - marks[f"start {asm}"][0]) * mb,
           "peak_mb": (max(marks["end"][1], marks[f"start {asm}"][1]) - base) * mb, "n_nodes": g.n_nodes,
           "stored_entries": (g.meta.get("pruned") or {}).get("stored_entries")}
    if mode == "budget":  # the adjacency the graph holds (blocks, or a dense matrix in older versions) and the estimate
        blocks = g.block_adjacency
        est = estimate_memory(rm, ids, batch_size=batch, max_feature_nodes=mfn)
        out.update(budget=mfn, feature_rows=int(g.feature_rows.sum()),
                   adjacency_mb=(blocks.nbytes if blocks is not None else g.densify().nbytes) / 2**20,
                   dense_adjacency_mb=g.n_nodes ** 2 * 4 / 2**20, estimate_host_mb=est.host_bytes / 2**20,
                   estimate_rows_mb=est.terms["rows"] / 2**20)
    print(json.dumps(out))


def main() -> None:
    from benchmarks._timing import arg, command, parser, write

    args = parser(__doc__, lengths="64,128,256", batch=64, modes="dense,pruned", budget=64,
                  name="attribution_memory_terms", child=arg("", argparse_suppress()),
                  seq=arg(0, argparse_suppress())).parse_args()
    if args.child:
        child(args.seq, args.batch, args.child, args.budget)
        return
    runs = []
    for seq in [int(s) for s in args.lengths.split(",") if s]:
        for mode in args.modes.split(","):
            res = subprocess.run([sys.executable, "-m", f"benchmarks.{Path(__file__).stem}", "--child", mode, "--seq",
                                  str(seq), "--batch", str(args.batch), "--budget", str(args.budget)],
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
