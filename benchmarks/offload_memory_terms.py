"""The device terms of offloaded replacement modules (``offload_fetch``, ``offload_rows``) against what the frozen pass
holds, on the CPU (issue 21, goal 4(d): the H200's offloaded all-layer runs peaked at 0.72–0.89× the estimate).

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmarks.offload_memory_terms [--tokens 128 256 512] [--batch 4]

``benchmarks/gpu_scale.py``'s ``small`` scale (a random Llama of 4 layers, d 512, GQA 8/2, the 8B's ratios: a
Lorsa of ``n_ov = 4 d`` OV heads and QK heads of ``H·d_head = 4 d`` on every layer, TopK transcoders of ``8 d``
features on every MLP), fp32, ``memory="lean"`` (no stored patterns, every site gathers: the GPU's path at 1024–4096
tokens), 64 feature rows, batch 4. On a CPU model an offloaded module computes where it is stored, so the device
copies are made real as ``tests/attribution/test_attribution_offload.py`` does: ``fetch`` replaced by a clone and
the rows placement forced (``"device"``: every block kept; ``"partial"``: the first half of the blocks in the
forward's order). Each call's allocation-level peak (:func:`benchmarks._alloc_peak.allocation_peak`: every CPU
tensor, the host rows included) and the peak inside each phase (``gpu_scale.PHASES``, from the same allocation
events: the most held between the phase's entry and exit), for the resident modules and for each placement; the
offload's own bytes are the difference, set against ``offload_fetch + offload_rows`` (``estimate_layout`` with the
placement, the device path) and against the kept rows alone. And (``per_copy``, ``--per-copy`` lengths) what one
prompt copy adds with a Lorsa on every layer and with none (:func:`per_copy_growth`). Writes
``results/offload_memory_terms.json``.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks._alloc_peak import allocation_series
from benchmarks._timing import arg, command, parser, write
from benchmarks.gpu_scale import SCALES, build, paper_lorsa, phases_wrapped
from nnsight_lorsa import LorsaSet, ReplacementModel, TranscoderSet, get_adapter
from nnsight_lorsa.attribution import attribute
from nnsight_lorsa.attribution.budget import estimate_layout, layout_for_estimate
from nnsight_lorsa.attribution.offload import offload_blocks, offload_terms
from nnsight_lorsa.attribution.options import AttributionOptions


@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextlib.contextmanager
def device_copies(rows: Any) -> Iterator[None]:
    """``fetch`` a real copy (a clone, as to another device) and the rows placement forced to ``rows``."""
    import nnsight_lorsa._placement as placement
    import nnsight_lorsa.attribution.budget as budget
    import nnsight_lorsa.attribution.replacement as replacement

    def fetch(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        return t.to(device).clone()

    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(placement, "fetch", fetch))
        stack.enter_context(patched(replacement, "fetch", fetch))
        stack.enter_context(patched(budget, "rows_placement",
                                    lambda offloaded_any, *a, **k: rows if offloaded_any else None))
        yield


def labelled_phases() -> Any:
    """Each phase of :data:`benchmarks.gpu_scale.PHASES` run inside ``record_function("phase:<name>")``."""
    def labelling(name: str, fn: Any) -> Any:
        def labelled(*args: Any, **kwargs: Any) -> Any:
            with record_function(f"phase:{name}"):
                return fn(*args, **kwargs)
        return labelled

    return phases_wrapped(labelling)


def phase_peaks(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, int, dict[str, int]]:
    """``(fn(*args, **kwargs), peak, {phase: peak inside it})``: :func:`benchmarks._alloc_peak.allocation_peak`'s
    running sum (the blocks the call allocates, less those of them it frees), its largest value overall and within
    each phase's ``record_function`` window (the most held between its entry and exit)."""
    with labelled_phases(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn(*args, **kwargs)
    series, windows = allocation_series(prof, "phase:")
    peak = max((h for _, h in series), default=0)
    peaks: dict[str, int] = {}
    for name, t0, t1 in windows:
        inside = [h for t, h in series if t0 <= t <= t1]
        if inside:
            peaks[name] = max(peaks.get(name, 0), max(inside))
    return out, peak, peaks


def per_copy_growth(model: Any, lorsas: dict[int, Any], tcs: Any, s: dict[str, Any], tokens: list[int], rows: int,
                    memory: str) -> list[dict[str, Any]]:
    """What one prompt copy adds to the frozen pass with a Lorsa on every layer and with none (every attention a
    frozen MHSA, through the CPU's SDPA with ``memory="lean"``), resident modules: the peaks inside ``backward`` and
    ``frozen_forward`` at batch 8 less those at batch 4, over 4, in numbers per ``(layer, d_model, position)``
    (fp32), next to ``frozen_per_copy_bytes``'s count (``per_copy_term``)."""
    out = []
    L, d = s["n_layers"], s["d_model"]
    for P in tokens:
        ids = torch.randint(0, s["vocab"], (1, P), generator=torch.Generator().manual_seed(P))[0]
        for name, layers in (("every_layer_lorsa", range(L)), ("no_lorsa", [])):
            chosen = LorsaSet(model, {layer: lorsas[layer] for layer in layers})
            chosen.offload = tcs.offload = False  # resident (a module stays marked offloaded until set)
            rep = ReplacementModel(model, lorsas=chosen, transcoders=tcs)
            got = {}
            for batch in (4, 8):
                gc.collect()
                _, _, phases = phase_peaks(attribute, rep, ids, batch_size=batch, max_feature_nodes=rows, memory=memory)
                layout, info = layout_for_estimate(rep, ids, AttributionOptions(batch_size=batch, memory=memory,
                                                                                max_feature_nodes=rows))
                est = estimate_layout(layout, batch_size=batch, max_feature_nodes=rows, **info)
                got[batch] = (phases, est.terms["frozen_per_copy"])
            row = {"tokens": P, "model": name, "per_copy_term": got[4][1]}
            for phase in ("backward", "frozen_forward"):
                growth = (got[8][0][phase] - got[4][0][phase]) / 4
                row[f"{phase}_growth_per_copy"] = growth
                row[f"{phase}_numbers_per_LdP"] = growth / (L * d * P * 4)
            out.append(row)
            print(row, flush=True)
    return out


def main() -> None:
    args = parser(__doc__, tokens=arg(nargs="+", type=int, default=[128, 256, 512]), batch=4, rows=64,
                  scale=arg("small", choices=sorted(SCALES)), memory="lean",
                  per_copy=arg(nargs="*", type=int, default=[128, 256],
                               help="prompt lengths of the per-copy comparison (every layer a Lorsa / none)"),
                  name="offload_memory_terms").parse_args()
    s = SCALES[args.scale]
    torch.manual_seed(0)
    model, hf = build(s, torch.device("cpu"), torch.float32)
    adapter = get_adapter(model)
    lorsas, tcs = LorsaSet(model), TranscoderSet(model)
    from nnsight_lorsa.modules import Transcoder, TranscoderConfig

    for L in range(s["n_layers"]):
        lorsas[L] = paper_lorsa(s, adapter, hf, L, torch.device("cpu"), torch.float32)
        tcs[L] = Transcoder(TranscoderConfig(d_in=s["d_model"], d_sae=s["d_tc"], activation="topk",
                                             activation_params={"k": s["k_tc"]}, layer=L))
        with torch.no_grad():
            for p in tcs[L].parameters():
                p.normal_(0, 0.02)
    per_copy = per_copy_growth(model, dict(lorsas.items()), tcs, s, args.per_copy, args.rows, args.memory)
    runs = []
    for P in args.tokens:
        ids = torch.randint(0, s["vocab"], (1, P), generator=torch.Generator().manual_seed(P))[0]
        kw = dict(batch_size=args.batch, max_feature_nodes=args.rows, memory=args.memory)
        lorsas.offload = tcs.offload = False  # resident: each module read where it is (no copy of its rows)
        resident = ReplacementModel(model, lorsas=lorsas, transcoders=tcs)
        gc.collect()
        t = time.perf_counter()
        _, base_peak, base_phases = phase_peaks(attribute, resident, ids, **kw)
        row: dict[str, Any] = {"tokens": P, "resident_peak": base_peak, "resident_phase_peaks": base_phases,
                               "resident_seconds": time.perf_counter() - t}
        lorsas.offload = tcs.offload = True
        off = ReplacementModel(model, lorsas=lorsas, transcoders=tcs)
        layout, info = layout_for_estimate(off, ids, AttributionOptions(batch_size=args.batch, memory=args.memory,
                                                                        max_feature_nodes=args.rows))
        blocks = offload_blocks(layout, d_model=info["d_model"], node_vectors=info["node_vectors"],
                                itemsize=info["model_itemsize"])
        half = frozenset(key for key, _ in blocks[:len(blocks) // 2])
        cpu_est = estimate_layout(layout, batch_size=args.batch, max_feature_nodes=args.rows, **info)
        row["estimate_cpu_host_bytes"] = cpu_est.host_bytes
        row["estimate_cpu_terms"] = dict(cpu_est.terms)
        row["blocks"] = len(blocks)
        row["block_bytes_sum"] = sum(b for _, b in blocks)
        row["block_bytes_max"] = max(b for _, b in blocks)
        for label, rows in (("device", "device"), ("partial", half)):
            terms = offload_terms(layout, d_model=info["d_model"], node_vectors=info["node_vectors"],
                                  itemsize=info["model_itemsize"], rows=rows, blocks=blocks)
            gpu = estimate_layout(layout, batch_size=args.batch, max_feature_nodes=args.rows, offload_rows=rows,
                                  blocks=blocks, **{**info, "device": "cuda"})
            gc.collect()
            with device_copies(rows):
                t = time.perf_counter()
                graph, peak, phases = phase_peaks(attribute, off, ids, **kw)
            row[label] = {"peak": peak, "phase_peaks": phases, "seconds": time.perf_counter() - t,
                          "offload_peak_minus_resident": peak - base_peak,
                          "phase_minus_resident": {k: v - base_phases.get(k, 0) for k, v in phases.items()},
                          "offload_fetch": terms["offload_fetch"], "offload_rows": terms["offload_rows"],
                          "kept_bytes": graph.meta.get("offload_rows_kept_bytes"),
                          "offload_rows_label": graph.meta.get("offload_rows"),
                          "gpu_path_device_bytes": gpu.device_bytes, "gpu_path_terms": dict(gpu.terms)}
            del graph
        runs.append(row)
        print({k: v for k, v in row.items() if not k.startswith("estimate_cpu_terms")}, flush=True)
    payload = {"command": command(), "scale": args.scale, "shapes": s, "runs": runs, "per_copy": per_copy}
    print(f"-> {write(args.name, payload)}")


if __name__ == "__main__":
    main()
