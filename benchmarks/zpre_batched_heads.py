"""Dispatched operators and CPU seconds of one Lorsa layer's recomputed-pattern ``z_pre`` (``frozen.z_pre``: the
frozen pass without stored patterns, a GPU's path), forward + backward, at the Llama-3.1-8B Lorsa's shape.

One layer of the paper's Lorsa (256 QK heads of ``d_qk`` 128, 32768 OV heads in groups of 128; 128 OV heads active
per position, drawn uniformly, so ~0.5 node per QK head and position), batch 4, q/k/v synthesized (no model). On
a GPU each dispatched operator is a kernel launch or host work of a few µs: the count is what the per-head loop
cost there (256+ steps a layer and direction, ~10 launches each). ``--elements`` sets
``frozen.ROW_CHUNK_ELEMENTS`` (the CPU's step budget) for the op count: e.g. ``2**25``, the device's
(``frozen.ROW_CHUNK_ELEMENTS_DEVICE``), counts on the CPU what a GPU dispatches. ``steps``: the steps per
direction from the layout alone (``--steps-only`` lengths are not run: 4096 tokens is ~16× the 1024's CPU time).
``--attribution-tokens``: also a whole ``attribute`` call's seconds (:func:`attribution`). Only the public
``PatternRows`` / ``z_pre`` are used, so the same script measures an older tree (``--before``: its JSON, embedded
as ``before``):

    cd /work/main && OMP_NUM_THREADS=1 PYTHONPATH=/work/main python /path/to/tree/benchmarks/zpre_batched_heads.py \\
        --out /tmp/before.json
    OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmarks.zpre_batched_heads --before /tmp/before.json

Writes ``results/zpre_batched_heads.json``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nnsight_lorsa.attribution.frozen as frozen
from benchmarks._timing import RESULTS, arg, command, parser, start, write_json

N_QK, D_QK, GROUP, ACTIVE = 256, 128, 128, 128


class OpCount(TorchDispatchMode):
    """Counts the aten operators dispatched inside it (``count``): on a GPU each a kernel launch, or more."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        return func(*args, **(kwargs or {}))


def layer(pos: int, batch: int, dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    """q, k ``(256, pos, 128)``, the nodes (128 OV heads per position) and their values ``(batch, pos, u)``."""
    gen = torch.Generator().manual_seed(seed)
    heads = torch.rand(pos, N_QK * GROUP, generator=gen).topk(ACTIVE, dim=-1).indices  # uniform, distinct
    qpos = torch.arange(pos).repeat_interleave(ACTIVE)
    heads = heads.reshape(-1)
    uniq, col = torch.unique(heads, return_inverse=True)
    return {"q": torch.randn(N_QK, pos, D_QK, generator=gen).to(dtype),
            "k": torch.randn(N_QK, pos, D_QK, generator=gen).to(dtype),
            "v": torch.randn(batch, pos, uniq.numel(), generator=gen).to(dtype),
            "group": heads // GROUP, "qpos": qpos, "col": col}


def run(case: dict[str, Any]) -> torch.Tensor:
    v = case["v"].detach().requires_grad_(True)
    rows = frozen.PatternRows(case["q"], case["k"], case["group"], case["qpos"], math.sqrt(D_QK))
    out = frozen.z_pre(v, rows, case["col"])
    out.backward(torch.ones_like(out))
    assert v.grad is not None
    return out.detach()


def steps(group: torch.Tensor, pos: int, batch: int, elements: int) -> dict[str, int]:
    """Steps per direction (forward or backward) from the layout alone: the per-QK-head loop's chunks
    (``ceil(count / (elements // (batch·pos)))`` per head with nodes) and, where this tree has it,
    ``frozen.plan_rows``'s steps."""
    counts = torch.bincount(group, minlength=N_QK).tolist()
    step = max(1, elements // (batch * pos))
    out = {"per_head_loop": sum(-(-c // step) for c in counts if c)}
    if hasattr(frozen, "plan_rows"):
        out["plan_rows"] = len(frozen.plan_rows(counts, pos, batch, D_QK, elements)[1])
    return out


def measure(pos: int, batch: int, dtype: torch.dtype, repeats: int, elements: list[int], run_it: bool
            ) -> dict[str, Any]:
    case = layer(pos, batch, dtype)
    row: dict[str, Any] = {"pos": pos, "batch": batch, "dtype": str(dtype).removeprefix("torch."),
                           "nodes": int(case["col"].numel()), "ov_columns": int(case["v"].shape[-1]),
                           "qk_heads_with_nodes": int(torch.unique(case["group"]).numel()),
                           "steps": {str(e): steps(case["group"], pos, batch, e) for e in elements}}
    if not run_it:  # the layout's steps only
        print(row, flush=True)
        return row
    default = frozen.ROW_CHUNK_ELEMENTS
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = run(case)
        seconds.append(time.perf_counter() - t0)
    row["seconds"] = sorted(seconds)[len(seconds) // 2]
    row["seconds_all"] = seconds
    row["checksum"] = float(out.double().sum())
    row["ops"] = {}
    try:
        for e in elements:
            frozen.ROW_CHUNK_ELEMENTS = e
            with OpCount() as ops:
                run(case)
            row["ops"][str(e)] = ops.count
    finally:
        frozen.ROW_CHUNK_ELEMENTS = default
    print(row, flush=True)
    return row


def attribution(tokens: int, repeats: int, rows: int) -> dict[str, Any]:
    """Seconds of one ``attribute`` call on ``gpu_scale``'s ``small`` random Llama with the paper's Lorsa on every
    layer (no transcoders), ``memory="lean"`` (the recomputed pattern rows; the CPU's default stores them), batch 4,
    ``rows`` feature rows: the medians of ``repeats`` calls after one untimed."""
    from benchmarks.gpu_scale import SCALES, build, paper_lorsa
    from nnsight_lorsa import LorsaSet, ReplacementModel, attribute, get_adapter

    s, dev = SCALES["small"], torch.device("cpu")
    model, hf = build(s, dev, torch.float32)
    adapter = get_adapter(model)
    lorsas = LorsaSet(model)
    for L in range(s["n_layers"]):
        lorsas[L] = paper_lorsa(s, adapter, hf, L, dev, torch.float32)
    rm = ReplacementModel(model, lorsas=lorsas)
    ids = torch.randint(0, s["vocab"], (tokens,), generator=torch.Generator().manual_seed(0))

    def call() -> Any:
        return attribute(rm, ids, batch_size=4, max_feature_nodes=rows, memory="lean")

    call()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        graph = call()
        seconds.append(time.perf_counter() - t0)
    out = {"tokens": tokens, "rows": rows, "batch": 4, "seconds": sorted(seconds)[len(seconds) // 2],
           "seconds_all": seconds, "n_nodes": int(graph.nodes.index.numel()),
           "adjacency_abs_sum": float(graph.densify().double().abs().sum())}
    print(out, flush=True)
    return out


def main() -> None:
    p = parser(__doc__, tokens=arg([1024, 4096], type=int, nargs="+"), batch=4, repeats=3, dtype="float32",
               elements=arg([2**22, 2**25], type=int, nargs="+", help="step budgets to count ops at"),
               before=arg(None, help="an earlier run's JSON (e.g. of the tree before), embedded as 'before'"),
               steps_only=arg([], type=int, nargs="*", help="of --tokens, those only planned (steps, no run)"),
               attribution_tokens=arg(None, type=int, help="also time attribute(memory='lean') at this length"),
               attribution_rows=16, label="", out=str(RESULTS / "zpre_batched_heads.json"))
    args = p.parse_args()
    start(args)
    import json
    from pathlib import Path

    dtype = getattr(torch, args.dtype)
    rows = [measure(pos, args.batch, dtype, args.repeats, args.elements, pos not in args.steps_only)
            for pos in args.tokens]
    out: dict[str, Any] = {"command": command("OMP_NUM_THREADS=1"), "label": args.label,
                           "torch": torch.__version__, "threads": torch.get_num_threads(),
                           "shape": {"n_qk": N_QK, "d_qk": D_QK, "ov_per_qk": GROUP, "active_per_position": ACTIVE},
                           "has_plan_rows": hasattr(frozen, "plan_rows"), "rows": rows}
    if args.attribution_tokens:
        out["attribution"] = attribution(args.attribution_tokens, args.repeats, args.attribution_rows)
    if args.before:
        out = {"before": json.loads(Path(args.before).read_text()), "after": out}
    write_json(args.out, out)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
