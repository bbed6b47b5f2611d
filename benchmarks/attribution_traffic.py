"""Memory traffic and FLOPs of one attribution batch against its floor, operator by operator (issue 21, 4d).

``attribution_flops`` showed the frozen pass computes far fewer FLOPs than the floor (≈ 0.03–0.10× per row at the
8B shape), so what a GPU spends above the floor must be memory traffic, latency or host work. This counts the
first: under a ``TorchDispatchMode``, every aten operator of an ``attribute`` call's stages (``frozen_forward``,
once a call; ``backward`` and ``record_rows``, per batch; :data:`benchmarks.gpu_scale.PHASES`) and of the floor's
pass (:func:`benchmarks.gpu_scale.floor_pass`: forward of B copies, backward to the embeddings), with

* **bytes**: what the operator reads and writes — its tensor inputs and outputs (an in-place operator's ``self``
  once); a gather (``index``, ``index_select``, ``embedding``) its output twice and its indices, a scatter
  (``index_copy_``, ``index_add_``, ``index_put_``) its source twice and its indices (the rows it touches, not the
  whole tensor); views and queries (``is_pinned``) nothing;
* **FLOPs**: torch's ``flop_counter`` registry (matmuls, attention; the CPU's fused attention counted as the
  GPU's, as ``attribution_flops`` does); elementwise work 0;

grouped by operator and by the innermost ``nnsight_lorsa`` frame of its forward (a backward operator's forward
stack from autograd's anomaly mode). The call runs the GPU's paths on the CPU: frozen MHSA by SDPA from stored
queries and keys (``memory=("sdpa", "auto")``), the Lorsa pattern rows by the head product
(``frozen.HEAD_PRODUCT``) and the GPU's step and chunk sizes (``frozen.row_chunk_elements`` /
``node_chunk_elements``); in the model's dtype (bf16 by default).

Each operator's roofline time on a device is ``max(bytes / bandwidth, FLOPs / peak)`` (:data:`DEVICES`: the H100's
and H200's HBM bandwidth, dense bf16/fp16 tensor-core peak, fp32 without TF32); ``per_batch_vs_floor``
sets a batch's (its backward and recorded rows) against the floor's pass, ``frozen_forward_vs_floor`` the call's
one frozen forward — what the GPU would take at full bandwidth and peak, a lower bound to compare the measured
phases with (``gpu_scale``'s ``phases``, ``oprof``'s kernels).

``--scale 8b_wide`` (default): the Llama-3.1-8B layer widths (d 4096, GQA 32/8, d_mlp 14336; the paper's Lorsa,
256 QK heads of 128, 32 K OV heads, top-k 128; TopK transcoders of 32 K features, k 64) on ``--layers`` layers and
a 32 K vocabulary, every layer with a Lorsa and a transcoder: per layer and batch the terms are the 8B's at that
prompt length. ``tiny``: the CI smoke scale.

    OMP_NUM_THREADS=2 PYTHONPATH=. python -m benchmarks.attribution_traffic --tokens 256 512 1024 \\
        --out benchmarks/results/attribution_traffic_8b_wide.json
"""

from __future__ import annotations

import collections
import contextlib
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry, shape_wrapper

from benchmarks._timing import arg, command, parser, start, write_json
from benchmarks.attribution_flops import _sdpa_cpu, _sdpa_cpu_backward, replacement
from benchmarks.gpu_scale import SCALES, build, floor_pass, phases_wrapped

#: the Llama-3.1-8B's layer widths (``gpu_scale``'s ``8b``) on few layers and a 32 K vocabulary
WIDE = {**SCALES["8b"], "vocab": 32000}
#: HBM bytes/s, dense bf16/fp16 and fp32 (no TF32) FLOP/s
DEVICES = {"H100_SXM": {"bandwidth": 3.35e12, "half": 989e12, "fp32": 67e12},
           "H200": {"bandwidth": 4.8e12, "half": 989e12, "fp32": 67e12}}
#: operators that move no data: views, aliases, queries
NO_TRAFFIC = {"view", "_unsafe_view", "as_strided", "select", "slice", "transpose", "t", "expand", "unsqueeze",
              "squeeze", "permute", "detach", "alias", "_reshape_alias", "unbind", "split", "split_with_sizes",
              "narrow", "diagonal", "lift_fresh", "unflatten", "is_pinned", "_has_compatible_shallow_copy_type",
              "is_same_size", "size", "stride", "numel", "dim", "empty", "empty_strided", "new_empty",
              "new_empty_strided", "empty_like", "_local_scalar_dense", "item", "set_", "resize_"}
GATHERS = {"index", "index_select", "embedding", "gather"}
SCATTERS = {"index_copy_", "index_copy", "index_add_", "index_add", "index_put_", "_index_put_impl_", "index_put",
            "scatter_", "scatter_add_", "scatter"}
FLOPS = {**flop_registry, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: shape_wrapper(_sdpa_cpu),
         torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: shape_wrapper(_sdpa_cpu_backward)}


def _bytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def op_bytes(name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> int:
    """What an operator reads and writes (module docstring)."""
    if name in NO_TRAFFIC:
        return 0
    if name in GATHERS:
        return 2 * sum(map(_bytes, outputs)) + sum(map(_bytes, inputs[1:]))
    if name in SCATTERS:  # the source read and written where it lands, the indices read
        return sum((2 if t.is_floating_point() else 1) * _bytes(t) for t in inputs[1:])
    seen: set[int] = set()
    total = 0
    for t in [*inputs, *outputs]:  # an in-place op's output is its input: once
        key = id(t)
        if key not in seen:
            seen.add(key)
            total += _bytes(t)
    return total


def frame() -> str:
    """The innermost ``nnsight_lorsa`` frame of what runs now: a backward operator's forward (anomaly mode's
    traceback on the autograd node), else the Python stack; ``"-"`` outside the package."""
    node = torch._C._current_autograd_node()
    stack = node.metadata.get("traceback_") if node is not None else None
    lines = "".join(stack if stack else traceback.format_stack()).splitlines()
    for line in reversed(lines):
        if "nnsight_lorsa/" in line and line.strip().startswith("File"):
            path, lineno, fn = (p.strip() for p in line.strip().split(",")[:3])
            return f"{path.split('nnsight_lorsa/')[-1].rstrip(chr(34))}:{lineno[5:]} {fn[3:]}"
    return "-"


class Traffic(TorchDispatchMode):
    """Per ``(stage, operator, frame)``: calls, bytes, FLOPs and the dtype of its first floating input, while
    :attr:`stage` is set (None: not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.stage: str | None = None
        self.rows: dict[tuple[str, str, str], list[Any]] = collections.defaultdict(lambda: [0, 0, 0, None])

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.stage is None:
            return out
        name = func.overloadpacket.__name__
        inputs = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        outputs = [a for a in tree_leaves(out) if isinstance(a, torch.Tensor)]
        flops = 0
        if func.overloadpacket in FLOPS:
            flops = int(FLOPS[func.overloadpacket](*args, **kwargs, out_val=out))
        row = self.rows[(self.stage, name, frame())]
        row[0] += 1
        row[1] += op_bytes(name, inputs, outputs)
        row[2] += flops
        if row[3] is None:
            row[3] = next((str(t.dtype).replace("torch.", "") for t in inputs if t.is_floating_point()), None)
        return out

    @contextlib.contextmanager
    def counting(self, stage: str) -> Iterator[None]:
        before, self.stage = self.stage, stage
        try:
            yield
        finally:
            self.stage = before


def roofline(rows: list[dict[str, Any]], device: dict[str, float]) -> float:
    """Seconds at full bandwidth and peak, operator by operator (fp32 and fp64 matmuls at the fp32 peak)."""
    total = 0.0
    for r in rows:
        peak = device["half"] if r["dtype"] in ("bfloat16", "float16") else device["fp32"]
        total += max(r["bytes"] / device["bandwidth"], r["flops"] / peak)
    return total


@contextlib.contextmanager
def gpu_paths() -> Iterator[None]:
    """The GPU's pattern-row contraction and step / chunk sizes on the CPU (restored on exit)."""
    from nnsight_lorsa.attribution import frozen

    saved = (dict(frozen.HEAD_PRODUCT), frozen.row_chunk_elements, frozen.node_chunk_elements)
    frozen.HEAD_PRODUCT["cpu"] = True
    frozen.row_chunk_elements = lambda device: frozen.ROW_CHUNK_ELEMENTS_DEVICE  # type: ignore[assignment]
    frozen.node_chunk_elements = lambda device: frozen.NODE_CHUNK_ELEMENTS_DEVICE  # type: ignore[assignment]
    try:
        yield
    finally:
        frozen.HEAD_PRODUCT.clear()
        frozen.HEAD_PRODUCT.update(saved[0])
        frozen.row_chunk_elements, frozen.node_chunk_elements = saved[1], saved[2]  # type: ignore[assignment]


def table(mode: Traffic, stage: str, per: int) -> list[dict[str, Any]]:
    """A stage's rows, per ``per`` (batches or 1), largest traffic first."""
    rows = [{"op": op, "frame": fr, "calls": c / per, "bytes": b / per, "flops": f / per, "dtype": dt}
            for (st, op, fr), (c, b, f, dt) in mode.rows.items() if st == stage]
    return sorted(rows, key=lambda r: -r["bytes"])


def summary(rows: list[dict[str, Any]], top: int) -> dict[str, Any]:
    return {"bytes": sum(r["bytes"] for r in rows), "flops": sum(r["flops"] for r in rows),
            "calls": sum(r["calls"] for r in rows),
            "roofline_s": {name: roofline(rows, dev) for name, dev in DEVICES.items()}, "top": rows[:top]}


def measure(s: dict[str, Any], tokens: int, batch: int, rows: int, dtype: torch.dtype, top: int) -> dict[str, Any]:
    """One prompt length: the floor's pass and one ``attribute`` call, counted."""
    from nnsight_lorsa import attribute

    torch.manual_seed(0)  # the same weights at every prompt length, whichever lengths run before
    model, hf = build(s, torch.device("cpu"), dtype)
    rm = replacement(s, model, hf, range(s["n_layers"]), dtype)
    ids = torch.randint(0, s["vocab"], (1, tokens), generator=torch.Generator(device="cpu").manual_seed(tokens))
    mode = Traffic()
    batches = [0]

    def stage(name: str, fn: Any) -> Any:
        counted = name in ("frozen_forward", "backward", "record_rows")

        def run(*a: Any, **k: Any) -> Any:
            batches[0] += name == "backward"
            if not counted:
                return fn(*a, **k)
            with mode.counting(name):
                return fn(*a, **k)
        return run

    with gpu_paths():
        graph = attribute(rm, ids, batch_size=batch, max_feature_nodes=rows, memory=("sdpa", "auto"))  # warm
        batches[0] = 0
        with torch.autograd.detect_anomaly(check_nan=False), phases_wrapped(stage), mode:
            graph = attribute(rm, ids, batch_size=batch, max_feature_nodes=rows, memory=("sdpa", "auto"))
    with torch.autograd.detect_anomaly(check_nan=False), mode, mode.counting("floor"):
        floor_pass(hf, ids, batch)
    n = batches[0]
    # the backward's rows are recorded inside it: its own operators are the backward's less the recorded rows'
    per_batch = table(mode, "backward", n) + table(mode, "record_rows", n)
    floor = summary(table(mode, "floor", 1), top)
    batch_sum, frozen = summary(sorted(per_batch, key=lambda r: -r["bytes"]), top), summary(
        table(mode, "frozen_forward", 1), top)
    return {"tokens": tokens, "batches": n, "target_rows": int(graph.feature_rows.sum()), "floor": floor,
            "per_batch": batch_sum, "frozen_forward": frozen,
            "per_batch_vs_floor": {"bytes": batch_sum["bytes"] / floor["bytes"],
                                   "flops": batch_sum["flops"] / max(floor["flops"], 1),
                                   **{f"roofline_{k}": batch_sum["roofline_s"][k] / floor["roofline_s"][k]
                                      for k in DEVICES}},
            "frozen_forward_vs_floor": {f"roofline_{k}": frozen["roofline_s"][k] / floor["roofline_s"][k]
                                        for k in DEVICES}}


def main() -> None:
    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
    args = parser(__doc__, scale=arg("8b_wide", choices=["8b_wide", "tiny"]), layers=2,
                  tokens=arg(nargs="+", type=int, default=[256, 512]), batch=4, rows=8, dtype="bfloat16",
                  top=25, threads=None, out="benchmarks/results/attribution_traffic_8b_wide.json").parse_args()
    start(args)
    s = dict(WIDE if args.scale == "8b_wide" else SCALES["tiny"], n_layers=args.layers)
    s["layer"] = min(s["layer"], args.layers - 1)
    dtype = getattr(torch, args.dtype)
    result: dict[str, Any] = {"command": command(f"OMP_NUM_THREADS={torch.get_num_threads()}"),
                              "torch": torch.__version__, "scale": args.scale, "shapes": s, "dtype": args.dtype,
                              "batch": args.batch, "feature_rows": args.rows, "devices": DEVICES, "runs": []}
    for n in args.tokens:
        run = measure(s, n, args.batch, args.rows, dtype, args.top)
        result["runs"].append(run)
        print(n, "tokens:", {k: round(v, 3) for k, v in run["per_batch_vs_floor"].items()},
              "frozen forward", {k: round(v, 3) for k, v in run["frozen_forward_vs_floor"].items()}, flush=True)
        write_json(args.out, result)


if __name__ == "__main__":
    main()
