"""The stored rows' sequential float64 sums: ``index_add_`` into one place against :func:`rows.add_in_order`.

The residuals of a budgeted or pruned graph and the ranking's masked row masses are float64 sums of a row's entries in
storage order, one addition at a time (the bits the tests pin). They were an ``index_add_`` of a chunk's entries into
one place; :func:`nnsight_lorsa.attribution.rows.add_in_order` is the last running sum of a host ``cumsum``, a
sequential scan: the same bits. This times both on one chunk (:data:`rows.CHUNK_ENTRIES` entries, as the assembly
passes them: the entries copied out of the store into the float64 buffer, then summed), per entry, interleaved, and
checks the bits on every timed chunk; then, with ``--tokens``, the assembly itself: one ``attribute`` call of
``gpu_scale``'s ``small`` model (Lorsa and TopK transcoder on every layer, CPU, fp32, a budget of 64 feature rows;
with ``keep_mass=0.9`` pruning too) has its ``assemble`` / ``assemble_pruned`` inputs captured, and the assembly is
re-run on them with :func:`~nnsight_lorsa.attribution.rows.add_in_order` and with an ``index_add_`` stand-in (the
former code's sum, in the same process), interleaved; CPU time (``time.process_time``, one thread: what other
processes on the machine do not move) and the graphs' bits compared.

    PYTHONPATH=. python -m benchmarks.sequential_sums --threads 1 --tokens 512 1024 \
        --out benchmarks/results/sequential_sums.json
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch

from benchmarks._timing import arg, command, environment, parser, start, table, time_interleaved, write_json
from nnsight_lorsa.attribution import rows
from nnsight_lorsa.attribution.rows import CHUNK_ENTRIES, add_in_order


def index_add_in_order(total: torch.Tensor, run: torch.Tensor, n: int) -> None:
    """The former sum: ``run[1:n + 1]`` added into ``total`` by ``index_add_`` into one place."""
    total.index_add_(0, torch.zeros(n, dtype=torch.long), run[1:n + 1])


def _digest(graph: Any) -> str:
    h = hashlib.sha256()
    for t in (graph.densify(), graph.residual, graph.values, graph.layout_ids):
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


def assembly(tokens: int, keep_mass: float | None, repeats: int) -> dict[str, Any]:
    """CPU seconds of one assembly (median of ``repeats`` interleaved) with each sum, and whether the graphs agree."""
    from benchmarks import gpu_scale as g
    from benchmarks.attribution_flops import replacement
    from nnsight_lorsa import attribute
    from nnsight_lorsa.attribution import PruneConfig, engine

    torch.manual_seed(0)
    s = g.SCALES["small"]
    model, hf = g.build(s, torch.device("cpu"), torch.float32)
    rm = replacement(s, model, hf, range(s["n_layers"]))
    ids = torch.randint(0, s["vocab"], (1, tokens), generator=torch.Generator().manual_seed(tokens))
    name = "assemble" if keep_mass is None else "assemble_pruned"
    original: Callable[..., Any] = getattr(engine, name)
    seen: dict[str, Any] = {}

    def capture(*a: Any, **k: Any) -> Any:
        seen["args"], seen["kwargs"] = a, k
        return original(*a, **k)

    with mock.patch.object(engine, name, capture):
        attribute(rm, ids, batch_size=4, max_feature_nodes=64,
                  prune=None if keep_mass is None else PruneConfig(keep_mass=keep_mass))
    variants = {"index_add_": index_add_in_order, "add_in_order": add_in_order}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    digests: dict[str, set[str]] = {k: set() for k in variants}
    for _ in range(repeats):
        for k, fn in variants.items():
            with mock.patch.object(rows, "add_in_order", fn):
                t = time.process_time()
                graph = original(*seen["args"], **seen["kwargs"])
                cpu[k].append(time.process_time() - t)
            digests[k].add(_digest(graph))
    med = {k: statistics.median(v) for k, v in cpu.items()}
    return {"tokens": tokens, "keep_mass": keep_mass, "cpu_seconds_median": med, "cpu_seconds": cpu,
            "speedup": med["index_add_"] / med["add_in_order"],
            "identical": len(digests["index_add_"] | digests["add_in_order"]) == 1}


def main() -> None:
    args = parser(__doc__, threads=1, repeats=31, warmup=3, entries=CHUNK_ENTRIES,
                  tokens=arg(nargs="*", type=int, default=[], help="prompt lengths of the assembly A/B (none: skip)"),
                  assembly_repeats=7, out="benchmarks/results/sequential_sums.json").parse_args()
    start(args)
    n = args.entries
    stored = torch.randn(n, dtype=torch.float32) * torch.exp(torch.randn(n) * 8)  # a chunk of stored fp32 entries
    buffer = torch.empty(n + 1, dtype=torch.float64)
    zeros = torch.zeros(n, dtype=torch.long)
    totals = {"index_add_": torch.zeros(1, dtype=torch.float64), "add_in_order": torch.zeros(1, dtype=torch.float64)}

    def index_add() -> None:  # the former code: copy into the buffer, index_add_ into one place
        totals["index_add_"].index_add_(0, zeros, buffer[:n].copy_(stored))

    def in_order() -> None:
        buffer[1:n + 1].copy_(stored)
        add_in_order(totals["add_in_order"], buffer, n)

    times = time_interleaved({"index_add_": index_add, "add_in_order": in_order}, repeats=args.repeats,
                             warmup=args.warmup)
    same = bool(torch.equal(totals["index_add_"].view(torch.int64), totals["add_in_order"].view(torch.int64)))
    ns = {k: v["median_s"] / n * 1e9 for k, v in times.items()}
    print(table([(k, f"{v['median_s'] * 1e3:.3f}", f"{ns[k]:.2f}") for k, v in times.items()],
                ("sum", "ms per chunk", "ns per entry")))
    print("running totals bit-identical after every timed chunk:", same)
    runs = [assembly(t, keep, args.assembly_repeats) for t in args.tokens for keep in (None, 0.9)]
    for r in runs:
        m = r["cpu_seconds_median"]
        print(f"assembly, {r['tokens']} tokens, keep_mass {r['keep_mass']}: CPU {m['index_add_'] * 1e3:.1f} -> "
              f"{m['add_in_order'] * 1e3:.1f} ms ({r['speedup']:.2f}x), graphs identical: {r['identical']}")
    write_json(args.out, {"command": command(), "entries": n, "times": times, "ns_per_entry": ns,
                          "speedup": ns["index_add_"] / ns["add_in_order"], "bit_identical": same,
                          "assembly": runs, "environment": environment()})


if __name__ == "__main__":
    main()
