"""Kernels one gathered site dispatches (``frozen.GatheredNodes``, issue 21): a write and a read, each forward and
backward, counted per operator under a ``TorchDispatchMode`` (views and metadata left out; their bytes too, as
:mod:`benchmarks.attribution_traffic` counts them), at the Llama-3.1-8B Lorsa site's shape on the GPU's chunk size
(``frozen.NODE_CHUNK_ELEMENTS_DEVICE``, the GPU's paths of :func:`benchmarks.attribution_traffic.gpu_paths`): 4096
tokens, 128 nodes a position over 32 K rows of d 4096, batch 4, bf16 — 64 chunks a pass. On the CPU, no GPU needed:
what a GPU's host would dispatch. ``--before JSON``: an earlier run (e.g. of the tree before a change), embedded.

    OMP_NUM_THREADS=2 PYTHONPATH=. python -m benchmarks.gathered_kernels --out benchmarks/results/gathered_kernels.json
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import torch

import nnsight_lorsa.attribution.frozen as frozen
from benchmarks._timing import arg, command, parser, start, write_json
from benchmarks.attribution_traffic import NO_TRAFFIC, Traffic, gpu_paths
from benchmarks.gathered_nodes import site_inputs


def count(P: int, k: int, d: int, rows: int, batch: int, dtype: torch.dtype) -> dict[str, Any]:
    # the coefficients in fp32, as attribution's (activations times the fp32 multipliers)
    W, idx, pos, coeff, x = site_inputs(P, k, d, rows, batch, dtype, torch.device("cpu"), torch.float32)
    coeff.requires_grad_(True)
    x.requires_grad_(True)
    out: dict[str, Any] = {}
    with gpu_paths():
        nodes = frozen.GatheredNodes(W, idx, frozen.PositionSlots(pos, P), dtype)
        chunks = sum(1 for _ in nodes.slots.spans(frozen._positions_per_chunk(nodes.slots, batch, d, W.device)))
        for name, run in (("write", lambda: nodes.write(coeff)), ("read", lambda: nodes.read(x))):
            mode = Traffic()
            with mode, mode.counting(name):
                y = run()
                y.backward(torch.ones_like(y))
            ops: collections.Counter[str] = collections.Counter()
            for (_, op, _), (calls, _, _, _) in mode.rows.items():
                if op not in NO_TRAFFIC:
                    ops[op] += calls
            kernels = sum(ops.values())
            out[name] = {"kernels": kernels, "per_chunk_pass": kernels / (2 * chunks), "by_operator": dict(ops),
                         "bytes": sum(b for (_, _, b, _) in mode.rows.values())}
    return {"tokens": P, "nodes_per_position": k, "d": d, "batch": batch, "chunks_per_pass": chunks, **out}


def main() -> None:
    args = parser(__doc__, tokens=4096, k=128, d=4096, rows=32768, batch=4, dtype="bfloat16", threads=2,
                  before=arg(None, type=str, help="an earlier run's JSON, embedded as 'before'"),
                  out="benchmarks/results/gathered_kernels.json").parse_args()
    start(args)
    row = count(args.tokens, args.k, args.d, args.rows, args.batch, getattr(torch, args.dtype))
    result: dict[str, Any] = {"command": command(f"OMP_NUM_THREADS={args.threads} PYTHONPATH=."),
                              "torch": torch.__version__, "dtype": args.dtype,
                              "chunk_elements": frozen.NODE_CHUNK_ELEMENTS_DEVICE, **row}
    if args.before:
        result["before"] = json.loads(Path(args.before).read_text())
    print({k: v for k, v in row.items() if k not in ("write", "read")},
          {n: row[n]["kernels"] for n in ("write", "read")})
    write_json(args.out, result)


if __name__ == "__main__":
    main()
