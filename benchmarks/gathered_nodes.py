"""A gathered site's node writes and reads (``frozen.GatheredNodes``: the node vectors of a site too large for a kept
grid, gathered from ``W`` in every pass — at the Llama-3.1-8B shape every Lorsa and transcoder site), the former
per-node products against the chunked grid products, in one run.

Per site: its nodes' rows of ``W`` (``d`` wide, ``k`` nodes at each of ``P`` positions, drawn uniformly from ``rows``
rows), a write ``Σ_{i at p} c_i W[idx_i]`` and its gradient (a read), and a read ``x_{pos_i} · W[idx_i]`` and its
gradient (a write) — forward + backward of both, the median seconds of ``--repeats`` after one untimed — with the
former code (a ``(batch, chunk, d)`` product per node, kept here as it was) and with ``frozen.GatheredNodes`` (by chunks
of positions, one ``bmm`` each); and the largest difference between the two relative to the largest value.

    OMP_NUM_THREADS=2 PYTHONPATH=. python -m benchmarks.gathered_nodes --device cpu --dtype float32 \\
        --tokens 256 --d 1024 --out benchmarks/results/gathered_nodes_cpu.json
    python -m benchmarks.gathered_nodes --device cuda --dtype bfloat16 --tokens 1024 4096 --d 4096  # a GPU
"""

from __future__ import annotations

import time
from typing import Any

import torch

import nnsight_lorsa.attribution.frozen as frozen
from benchmarks._timing import arg, command, parser, start, write_json


def former_write(coeff: torch.Tensor, W: torch.Tensor, idx: torch.Tensor, pos: torch.Tensor, n_pos: int,
                 dtype: torch.dtype) -> torch.Tensor:
    """``frozen.gather_write`` until 2026-11-27: per chunk of nodes, a ``(batch, chunk, d)`` product index-added."""
    b, n = coeff.shape
    acc = torch.float32 if dtype.itemsize < 4 else dtype
    out = torch.zeros(b, n_pos, W.shape[-1], dtype=acc, device=coeff.device)
    step = max(1, frozen.node_chunk_elements(coeff.device) // max(1, b * W.shape[-1]))
    for s in range(0, n, step):
        rows = W[idx[s:s + step]].to(acc)
        out.index_add_(1, pos[s:s + step], coeff[:, s:s + step, None].to(acc) * rows[None])
    return out.to(dtype)


def former_read(x: torch.Tensor, W: torch.Tensor, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``frozen.gather_read`` until 2026-11-27: per chunk of nodes, a ``(batch, chunk, d)`` product summed."""
    b, n = x.shape[0], idx.numel()
    step = max(1, frozen.node_chunk_elements(x.device) // max(1, b * W.shape[-1]))
    parts = [(x[:, pos[s:s + step]] * W[idx[s:s + step]].to(x.dtype)[None]).sum(-1) for s in range(0, n, step)]
    return torch.cat(parts, dim=1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(P: int, k: int, d: int, rows: int, batch: int, dtype: torch.dtype, device: torch.device,
            repeats: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    W = (torch.randn(rows, d, generator=g) / d**0.5).to(dtype).to(device)
    idx = torch.randint(0, rows, (P * k,), generator=g).to(device)
    pos = torch.arange(P).repeat_interleave(k).to(device)  # k nodes per position, in order (a TopK site)
    coeff = torch.randn(batch, P * k, generator=g).to(dtype).to(device)
    x = torch.randn(batch, P, d, generator=g).to(dtype).to(device)
    nodes = frozen.GatheredNodes(W, idx, frozen.PositionSlots(pos, P), dtype)

    def now() -> tuple[torch.Tensor, torch.Tensor]:
        return nodes.write(coeff), nodes.read(x)

    def former() -> tuple[torch.Tensor, torch.Tensor]:
        return former_write(coeff, W, idx, pos, P, dtype), former_read(x, W, idx, pos)

    def both_directions(fn: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # a write's backward is a read, a read's a write: the forward of both stands for both passes
        out = fn()
        fn()
        return out

    row: dict[str, Any] = {"tokens": P, "nodes_per_position": k, "d": d, "batch": batch}
    results = {}
    for name, fn in (("former", former), ("chunked_grid", now)):
        both_directions(fn)
        sync(device)
        seconds = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            results[name] = both_directions(fn)
            sync(device)
            seconds.append(time.perf_counter() - t0)
        row[name + "_s"] = sorted(seconds)[len(seconds) // 2]
    row["speedup"] = row["former_s"] / row["chunked_grid_s"]
    (wa, ra), (wb, rb) = results["former"], results["chunked_grid"]
    row["write_rel_diff"] = float((wa.double() - wb.double()).abs().max() / wa.double().abs().max())
    row["read_rel_diff"] = float((ra.double() - rb.double()).abs().max() / ra.double().abs().max())
    print(row, flush=True)
    return row


def main() -> None:
    args = parser(__doc__, tokens=arg([256], type=int, nargs="+"), d=1024, k=arg([128, 64], type=int, nargs="+"),
                  rows=32768, batch=4, repeats=3, device="cpu", dtype="float32", threads=2,
                  out="gathered_nodes.json").parse_args()
    start(args)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    out = [measure(P, k, args.d, args.rows, args.batch, dtype, device, args.repeats)
           for P in args.tokens for k in args.k]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    write_json(args.out, {"command": command(f"OMP_NUM_THREADS={args.threads} PYTHONPATH=."), "device": name,
                          "torch": torch.__version__, "dtype": args.dtype, "threads": torch.get_num_threads(),
                          "chunk_elements": frozen.node_chunk_elements(device), "rows": out})
    print("wrote", args.out)


if __name__ == "__main__":
    main()
