"""Attribution-graph cost on the tinyshakespeare replacement model (Lorsa on layer 2, TopK
transcoders on every MLP): batched vs naive, nnsight-traced vs PyTorch hooks, memory vs length.

    python -m benchmarks.bench_attribution [--seq 64] [--batch 64] [--repeats 3] [--threads 1] [--device cuda]

(a) ``attribute(replacement, prompt, batch_size=B)``: the frozen pass and all backward passes in
one ``model.trace``, one target per batch row; (b) the same with PyTorch hooks on the bare model
(the reference engine of ``benchmarks/reference/attribution.py``); (c) the naive method: one backward
pass per target node (hooks, batch 1). Same prompt, same run.
Memory: peak RSS growth (Linux ``VmHWM``, reset before the call) of a fresh process per prompt
length (``--memory-lengths``), next to the formula's terms (docs/attribution.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks._timing import arg, command, parser, start, table, time_interleaved, time_once, write
from benchmarks.reference.attribution import attribute_with_hooks, install_frozen_hooks
from nnsight_lorsa import LorsaSet, ReplacementModel
from nnsight_lorsa.assets import default_corpus_path, default_lorsa_dir, default_transcoder_dir
from nnsight_lorsa.attribution import PruneConfig, attribute
from nnsight_lorsa.attribution.engine import build_graph
from nnsight_lorsa.attribution.replacement import FrozenReplacement
from nnsight_lorsa.attribution.trace import prepare
from nnsight_lorsa.envoy import load_model
from nnsight_lorsa.formats import load

SPARSE_KEEP_MASS = 0.99


def replacement(model):
    lorsas = LorsaSet.from_pretrained(model, default_lorsa_dir())
    tcs = {int(p.name.split("_")[1]): load(p) for p in sorted(default_transcoder_dir().glob("layer_*"))}
    return lorsas, tcs


def prompt_ids(model, seq: int) -> torch.Tensor:
    text = Path(default_corpus_path()).read_text(encoding="utf-8")[20_000:40_000]
    return model.tokenizer(text, return_tensors="pt")["input_ids"][0, :seq]


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_child(seq: int, batch: int, sparse: bool) -> None:
    model = load_model()
    rm = ReplacementModel(model, **dict(zip(("lorsas", "transcoders"), replacement(model), strict=True)))
    ids = prompt_ids(model, seq)
    attribute(rm, ids[:8], batch_size=batch)  # warm up allocator/imports
    before = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS (Linux)
    prune = PruneConfig(0.8, 0.98, keep_mass=SPARSE_KEEP_MASS) if sparse else None
    g = attribute(rm, ids, batch_size=batch, prune=prune)
    after = _status_kb("VmHWM")
    if sparse:
        print(json.dumps({"seq": seq, "mode": "prune_to", "peak_rss_growth_mb": (after - before) / 1024,
                          "kept_nodes": g.n_nodes, "stored_entries": g.meta["pruned"]["stored_entries"],
                          "max_rel_err": float(g.edge_sum_error().max())}))
        return
    rows = int(g.feature_rows.sum())
    n_sources = int(g.n_nodes - len(g.logit_ids))
    print(json.dumps({"seq": seq, "mode": "dense", "peak_rss_growth_mb": (after - before) / 1024, "rows": rows,
                      "n_sources": n_sources,
                      "edge_rows_mb": rows * n_sources * 4 / 2**20,
                      "adjacency_mb": g.n_nodes ** 2 * 4 / 2**20, "multipliers_mb": 2 * batch * n_sources * 4 / 2**20}))


def _saved_storages(roots: list) -> dict[int, int]:
    """``{storage pointer: bytes}`` of every tensor the autograd graph below ``roots`` keeps for backward."""
    seen, stack, out = set(), list(roots), {}
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for name in dir(fn):
            if not name.startswith("_saved_"):
                continue
            try:
                value = getattr(fn, name)
            except RuntimeError:  # freed or not a tensor
                continue
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(t, torch.Tensor):
                    out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        stack.extend(f for f, _ in fn.next_functions)
    return out


def saved_per_copy(model, lorsas, tcs, ids: torch.Tensor, patterns: str, node_vectors: str,
                   batches: tuple[int, int] = (1, 5)) -> dict:
    """What the frozen forward keeps for the backward passes, measured by walking its autograd graph:
    bytes per prompt copy (the slope between two batch sizes) and the batch-independent part
    (one copy of the constants: patterns or queries/keys, pattern rows, decoder/encoder grids)."""
    hf = model._module
    params = {p.untyped_storage().data_ptr() for m in [hf, *(lorsas[k] for k in lorsas), *tcs.values()]
              for p in m.parameters()}
    prepared = prepare(ReplacementModel(model, lorsas=lorsas, transcoders=tcs), ids)
    layout, mhsa, adapter = prepared.layout, prepared.mhsa, prepared.adapter
    total = []
    for b in batches:
        M = torch.ones(b, layout.n_sources, requires_grad=True)
        frozen = FrozenReplacement(layout, M, mhsa, patterns=patterns, node_vectors=node_vectors)
        handles = install_frozen_hooks(hf, adapter, frozen)
        try:
            hf(layout.tokens[None].expand(b, -1), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        stored = _saved_storages([t.grad_fn for t in frozen.target_pieces()])
        total.append(sum(v for k, v in stored.items() if k not in params))
    per_copy = (total[1] - total[0]) / (batches[1] - batches[0])
    return {"seq": int(ids.numel()), "patterns": patterns, "node_vectors": node_vectors,
            "per_copy_mb": per_copy / 2**20,
            "per_copy_per_token_kb": per_copy / ids.numel() / 1024, "shared_mb": (total[0] - per_copy) / 2**20,
            "layers": model._module.config.num_hidden_layers, "d_model": model._module.config.hidden_size}


def main() -> None:
    args = parser(__doc__, seq=64, batch=64, repeats=3, threads=1,
                  device=arg("cpu", "device of the timing runs (e.g. cuda; memory tables are CPU)"),
                  memory_lengths="16,32,64,128,256", memory_child=arg(None, argparse.SUPPRESS, type=int),
                  sparse_child=arg(False, argparse.SUPPRESS), skip_timing=arg(False, "only the memory table"),
                  saved_lengths=arg("", "prompt lengths for the saved-for-backward table")).parse_args()
    if args.memory_child is not None:
        memory_child(args.memory_child, args.batch, args.sparse_child)
        return
    start(args, seed=None)
    model = load_model()
    lorsas, tcs = replacement(model)
    if args.device != "cpu":  # the model, its Lorsa and the transcoders on the device; graphs come back to the host
        model._module.to(args.device)
        for layer in lorsas:
            lorsas[layer].to(args.device)
        tcs = {layer: tc.to(args.device) for layer, tc in tcs.items()}
    ids = prompt_ids(model, args.seq)
    rm = ReplacementModel(model, lorsas=lorsas, transcoders=tcs)

    def run(engine: str, batch: int, node_vectors: str = "auto"):
        if engine == "hooks":
            return lambda: attribute_with_hooks(rm, ids, batch_size=batch, memory=("auto", node_vectors))
        if node_vectors == "auto":
            return lambda: attribute(rm, ids, batch_size=batch)
        # gathered node vectors with the patterns "auto" picks: the private mixed form of memory=
        return lambda: build_graph(rm, ids, batch_size=batch, memory=("auto", node_vectors))

    out: dict = {"command": command(), "seq": args.seq, "batch": args.batch,
                 "threads": args.threads, "device": args.device}
    if not args.skip_timing:
        g = run("nnsight", args.batch)()
        rows = int(g.feature_rows.sum())
        timed = time_interleaved({"nnsight batched": run("nnsight", args.batch),
                                  "hooks batched": run("hooks", args.batch),
                                  "nnsight batched, gathered": run("nnsight", args.batch, "gather")},
                                 repeats=args.repeats, warmup=1)
        naive, naive_s = time_once(run("hooks", 1))
        assert torch.allclose(naive.densify(), g.densify(), atol=1e-5), "naive and batched graphs differ"
        nn_s, hk_s = timed["nnsight batched"]["median_s"], timed["hooks batched"]["median_s"]
        ga_s = timed["nnsight batched, gathered"]["median_s"]
        print(f"prompt {args.seq} tokens, {rows} target rows ({g.summary()}), batch {args.batch}, "
              f"{args.threads} thread(s), {args.device}")
        print(table([("naive (1 backward per target, hooks)", f"{naive_s:.2f}", f"{naive_s / nn_s:.1f}x"),
                     (f"batched hooks (B={args.batch})", f"{hk_s:.2f}", f"{hk_s / nn_s:.2f}x"),
                     (f"batched nnsight (B={args.batch})", f"{nn_s:.2f}", "1.00x"),
                     (f"batched nnsight, gathered node vectors (B={args.batch})", f"{ga_s:.2f}",
                      f"{ga_s / nn_s:.2f}x")],
                    ("method", "seconds", "vs nnsight batched")))
        print(f"nnsight / hooks = {nn_s / hk_s:.3f} (target <= 1.3); naive / nnsight = {naive_s / nn_s:.1f} "
              "(target >= 10)")
        # the matrix arithmetic each method does (torch's FLOP counter: matmul-like ops) and its rate
        flops = {}
        for label, batch in (("batched", args.batch), ("naive", 1)):
            with FlopCounterMode(display=False) as counter:
                run("hooks", batch)()
            flops[label] = counter.get_total_flops()
        rate = flops["batched"] / hk_s
        print(f"matmul GFLOP: batched {flops['batched'] / 1e9:.1f} ({rate / 1e9:.0f} GFLOP/s), naive "
              f"{flops['naive'] / 1e9:.1f}: at the batched rate the naive arithmetic alone takes "
              f"{flops['naive'] / rate:.2f} s, a ceiling of {naive_s / (flops['naive'] / rate):.1f}x for any batching")
        out.update({"gflop_batched": flops["batched"] / 1e9, "gflop_naive": flops["naive"] / 1e9,
                    "batched_gflop_per_s": rate / 1e9})
        out.update({"rows": rows, "summary": g.summary(), "naive_s": naive_s, "timed": timed,
                    "naive_over_nnsight": naive_s / nn_s, "nnsight_over_hooks": nn_s / hk_s})
    saved = [saved_per_copy(model, lorsas, tcs, prompt_ids(model, n), *mode)
             for n in [int(s) for s in args.saved_lengths.split(",") if s]
             for mode in (("store", "grid"), ("sdpa", "grid"), ("sdpa", "gather"))]
    if saved:
        print(table([(m["seq"], m["patterns"], m["node_vectors"], f"{m['per_copy_mb']:.2f}",
                      f"{m['per_copy_per_token_kb']:.1f}",
                      f"{m['per_copy_per_token_kb'] * 1024 / (4 * m['layers'] * m['d_model']):.2f}",
                      f"{m['shared_mb']:.2f}") for m in saved],
                    ("tokens", "patterns", "node vectors", "per copy MB", "per copy per token KB",
                     "÷ (layers·d_model·4 B)", "shared MB")))
        print(f"-> {write('attribution_tinyshakespeare_saved', {'command': out['command'], 'saved': saved})}")
        if not args.memory_lengths:
            return
    memory, sparse, trimmed = [], [], []
    # the same child under glibc's default allocator and with a fixed 1 MiB mmap threshold (large
    # buffers returned to the OS on free), which separates live memory from the allocator's retention
    fixed = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    for seq in [int(s) for s in args.memory_lengths.split(",") if s]:
        for flag, env, into in (([], None, memory), (["--sparse-child"], None, sparse), (["--sparse-child"], fixed,
                                                                                          trimmed)):
            res = subprocess.run([sys.executable, "-m", f"benchmarks.{Path(__file__).stem}", "--memory-child", str(seq),
                                  "--batch", str(args.batch), *flag], capture_output=True, text=True, check=True,
                                 env=env, cwd=Path(__file__).resolve().parent.parent)
            into.append(json.loads(res.stdout.strip().splitlines()[-1]))
    if memory:
        print(table([(m["seq"], m["rows"], m["n_sources"], f"{m['peak_rss_growth_mb']:.0f}",
                      f"{m['edge_rows_mb']:.0f}", f"{m['adjacency_mb']:.0f}", f"{p['peak_rss_growth_mb']:.0f}",
                      f"{t['peak_rss_growth_mb']:.0f}",
                      p["kept_nodes"], p["stored_entries"])
                     for m, p, t in zip(memory, sparse, trimmed, strict=True)],
                    ("tokens", "rows", "sources", "dense: peak MB", "edge rows MB", "adjacency MB",
                     f"prune=, keep_mass {SPARSE_KEEP_MASS}: peak MB", "same, 1 MiB mmap threshold: peak MB",
                     "kept nodes", "stored entries")))
    out.update({"memory": memory, "memory_prune_to": sparse, "memory_prune_to_mmap_1mib": trimmed})
    suffix = f"_threads{args.threads}" if args.device == "cpu" else f"_{args.device}"
    name = "attribution_tinyshakespeare" + ("_memory" if args.skip_timing else suffix)
    print(f"-> {write(name, out)}")


if __name__ == "__main__":
    main()
