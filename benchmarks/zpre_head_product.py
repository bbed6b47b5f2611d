"""The recomputed Lorsa pattern rows' two contractions with the values (``frozen.z_pre``, the frozen pass without
stored patterns), one layer at the Llama-3.1-8B Lorsa's shape, in one run: the *gather* (each node's value column
gathered, multiplied by its row and summed; backward an ``index_add_`` of the rows times the gradients) against the
*head product* (one ``bmm`` of the rows with every OV head's values of the step's QK heads; backward one ``bmm`` with
the gradients scattered on that grid), ``frozen.HEAD_PRODUCT``.

The layer: 256 QK heads of ``d_qk`` 128, 32768 OV heads in groups of 128, 128 OV heads active per position drawn
uniformly (as ``benchmarks/zpre_batched_heads.py``), q/k/v synthesized on ``--device`` in ``--dtype``. Per prompt
length and contraction: the forward + backward's median seconds (the device synchronised), its peak memory above the
inputs (CUDA), and the largest difference between the two contractions' ``z_pre`` and ``grad_v`` relative to the
largest value. The step budget is the device's (``frozen.row_chunk_elements``).

    python -m benchmarks.zpre_head_product --device cuda --dtype bfloat16 --tokens 1024 4096 --batch 2 \\
        --out benchmarks/results/zpre_head_product_<GPU>.json
    OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmarks.zpre_head_product --device cpu --dtype float32 \\
        --tokens 128 --batch 2 --out /tmp/zpre_head_product_cpu.json     # the script's check, not a measurement
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

import nnsight_lorsa.attribution.frozen as frozen
from benchmarks._timing import arg, command, parser, start, write_json

N_QK, D_QK, GROUP, ACTIVE = 256, 128, 128, 128


def layer(pos: int, batch: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    heads = torch.rand(pos, N_QK * GROUP, generator=gen).topk(ACTIVE, dim=-1).indices.reshape(-1)
    qpos = torch.arange(pos).repeat_interleave(ACTIVE)
    uniq, col = torch.unique(heads, return_inverse=True)
    on = {"device": device}
    return {"q": torch.randn(N_QK, pos, D_QK, generator=gen).to(dtype).to(**on),
            "k": torch.randn(N_QK, pos, D_QK, generator=gen).to(dtype).to(**on),
            "v": torch.randn(batch, pos, uniq.numel(), generator=gen).to(dtype).to(**on),
            "grad": torch.randn(batch, heads.numel(), generator=gen).to(dtype).to(**on),
            "group": (heads // GROUP).to(**on), "heads": heads.to(**on), "qpos": qpos.to(**on), "col": col.to(**on)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(case: dict[str, Any], product: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(z_pre, grad_v, seconds)`` of one forward + backward with the contraction ``product`` (the plan made
    inside: it is made once per layer and pass in an attribution too)."""
    old = dict(frozen.HEAD_PRODUCT)
    frozen.HEAD_PRODUCT[device.type] = product
    try:
        v = case["v"].detach().requires_grad_(True)
        sync(device)
        t0 = time.perf_counter()
        rows = frozen.PatternRows(case["q"], case["k"], case["group"], case["qpos"], math.sqrt(D_QK), case["heads"],
                                  GROUP)
        assert bool(rows.group_size) == product
        out = frozen.z_pre(v, rows, case["col"])
        out.backward(case["grad"])
        sync(device)
        seconds = time.perf_counter() - t0
    finally:
        frozen.HEAD_PRODUCT.clear()
        frozen.HEAD_PRODUCT.update(old)
    assert v.grad is not None
    return out.detach(), v.grad, seconds


def measure(pos: int, batch: int, dtype: torch.dtype, device: torch.device, repeats: int) -> dict[str, Any]:
    case = layer(pos, batch, dtype, device)
    row: dict[str, Any] = {"pos": pos, "batch": batch, "nodes": int(case["col"].numel()),
                           "ov_columns": int(case["v"].shape[-1])}
    results = {}
    for name, product in (("gather", False), ("head_product", True)):
        run(case, product, device)  # warm-up (kernels, allocator)
        seconds, peak = [], 0
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            out, grad, s = run(case, product, device)
            seconds.append(s)
            if device.type == "cuda":
                peak = max(peak, torch.cuda.max_memory_allocated(device) - base)
        results[name] = (out, grad)
        row[name] = {"seconds": sorted(seconds)[len(seconds) // 2], "seconds_all": seconds,
                     "peak_bytes": peak if device.type == "cuda" else None}
    (za, ga), (zb, gb) = results["gather"], results["head_product"]
    row["speedup"] = row["gather"]["seconds"] / row["head_product"]["seconds"]
    row["z_pre_rel_diff"] = float((za.double() - zb.double()).abs().max() / za.double().abs().max().clamp_min(1e-30))
    row["grad_v_rel_diff"] = float((ga.double() - gb.double()).abs().max() / ga.double().abs().max().clamp_min(1e-30))
    print(row, flush=True)
    return row


def main() -> None:
    args = parser(__doc__, tokens=arg([1024, 4096], type=int, nargs="+"), batch=2, repeats=3, device="cuda",
                  dtype="bfloat16", out="zpre_head_product.json").parse_args()
    start(args)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows = [measure(pos, args.batch, dtype, device, args.repeats) for pos in args.tokens]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    write_json(args.out, {"command": command(), "device": name, "torch": torch.__version__,
                          "dtype": args.dtype, "step_elements": frozen.row_chunk_elements(device),
                          "shape": {"n_qk": N_QK, "d_qk": D_QK, "ov_per_qk": GROUP, "active_per_position": ACTIVE},
                          "rows": rows})
    print("wrote", args.out)


if __name__ == "__main__":
    main()
