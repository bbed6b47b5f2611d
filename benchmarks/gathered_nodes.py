"""A gathered site's node writes and reads (``frozen.GatheredNodes``: the node vectors of a site too large for a kept
grid, gathered from ``W`` in every pass — at the Llama-3.1-8B shape every Lorsa and transcoder site), the former
per-node products against the chunked grid products, in one run.

Per site: its nodes' rows of ``W`` (``d`` wide, ``k`` nodes at each of ``P`` positions, drawn uniformly from ``rows``
rows), a write ``Σ_{i at p} c_i W[idx_i]`` and its gradient (a read), and a read ``x_{pos_i} · W[idx_i]`` and its
gradient (a write) — forward + backward of both, the median seconds of ``--repeats`` after one untimed — with the
former code (a ``(batch, chunk, d)`` product per node, kept here as it was) and with ``frozen.GatheredNodes`` (by chunks
of positions, one ``bmm`` each); and the largest difference between the two relative to the largest value.
``--chunks`` (exponents ``e``): the chunked grid again with each chunk held to ``2**e`` numbers instead of
:func:`frozen.node_chunk_elements`'s (``chunked_grid_by_chunk``: seconds per size, the same results) — the chunks
grow the dispatched operators with the prompt (at 4096 tokens on a GPU, 64 chunks of a Lorsa site per pass), so the
device picks its size: more operators against a larger transient grid.

    OMP_NUM_THREADS=2 PYTHONPATH=. python -m benchmarks.gathered_nodes --device cpu --dtype float32 \\
        --tokens 256 --d 1024 --out benchmarks/results/gathered_nodes_cpu.json
    python -m benchmarks.gathered_nodes --device cuda --dtype bfloat16 --tokens 1024 4096 --d 4096 \
        --chunks 23 25 27  # a GPU
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
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


@contextlib.contextmanager
def chunk_elements(n: int | None) -> Iterator[None]:
    """While inside, :func:`frozen.node_chunk_elements` is ``n`` on every device (None: unchanged)."""
    saved = frozen.node_chunk_elements
    if n is not None:
        frozen.node_chunk_elements = lambda device: n  # type: ignore[assignment]
    try:
        yield
    finally:
        frozen.node_chunk_elements = saved  # type: ignore[assignment]


def timed(fn: Any, device: torch.device, repeats: int) -> tuple[float, Any]:
    """``(median seconds, last result)`` of ``fn`` after one untimed call."""
    fn()
    sync(device)
    seconds, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        seconds.append(time.perf_counter() - t0)
    return sorted(seconds)[len(seconds) // 2], out


def site_inputs(P: int, k: int, d: int, rows: int, batch: int, dtype: torch.dtype, device: torch.device,
                coeff_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """``(W, idx, pos, coeff, x)`` of a site of ``k`` nodes at each of ``P`` positions, in order (a TopK site), their
    rows drawn uniformly from ``W: (rows, d)``; ``coeff: (batch, P·k)`` in ``coeff_dtype`` (None: ``dtype``),
    ``x: (batch, P, d)``; seeded."""
    g = torch.Generator().manual_seed(0)
    W = (torch.randn(rows, d, generator=g) / d**0.5).to(dtype).to(device)
    idx = torch.randint(0, rows, (P * k,), generator=g).to(device)
    pos = torch.arange(P).repeat_interleave(k).to(device)
    coeff = torch.randn(batch, P * k, generator=g).to(coeff_dtype or dtype).to(device)
    x = torch.randn(batch, P, d, generator=g).to(dtype).to(device)
    return W, idx, pos, coeff, x


def measure(P: int, k: int, d: int, rows: int, batch: int, dtype: torch.dtype, device: torch.device,
            repeats: int, chunks: list[int] | None = None) -> dict[str, Any]:
    W, idx, pos, coeff, x = site_inputs(P, k, d, rows, batch, dtype, device)
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
        row[name + "_s"], results[name] = timed(lambda fn=fn: both_directions(fn), device, repeats)
    row["speedup"] = row["former_s"] / row["chunked_grid_s"]
    (wa, ra), (wb, rb) = results["former"], results["chunked_grid"]
    row["write_rel_diff"] = float((wa.double() - wb.double()).abs().max() / wa.double().abs().max())
    row["read_rel_diff"] = float((ra.double() - rb.double()).abs().max() / ra.double().abs().max())
    by_chunk = {}
    for e in chunks or []:
        with chunk_elements(2**e):
            seconds, (w, r) = timed(lambda: both_directions(now), device, repeats)
        by_chunk[str(e)] = {"elements": 2**e, "seconds": seconds, "same_results": bool(torch.equal(w, wb))
                            and bool(torch.equal(r, rb))}
    if by_chunk:
        row["chunked_grid_by_chunk"] = by_chunk
    print(row, flush=True)
    return row


def main() -> None:
    args = parser(__doc__, tokens=arg([256], type=int, nargs="+"), d=1024, k=arg([128, 64], type=int, nargs="+"),
                  rows=32768, batch=4, repeats=3, device="cpu", dtype="float32", threads=2,
                  chunks=arg([], type=int, nargs="*", help="chunk sizes to sweep, as exponents of 2"),
                  out="gathered_nodes.json").parse_args()
    start(args)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    out = [measure(P, k, args.d, args.rows, args.batch, dtype, device, args.repeats, args.chunks)
           for P in args.tokens for k in args.k]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    write_json(args.out, {"command": command(f"OMP_NUM_THREADS={args.threads} PYTHONPATH=."), "device": name,
                          "torch": torch.__version__, "dtype": args.dtype, "threads": torch.get_num_threads(),
                          "chunk_elements": frozen.node_chunk_elements(device), "rows": out})
    print("wrote", args.out)


if __name__ == "__main__":
    main()
