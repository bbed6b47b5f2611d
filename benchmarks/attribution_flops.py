"""FLOPs of attribution against its floor, counted and analytic, extrapolated to the Llama-3.1-8B shape (issue 21, 4d).

Is "at most 1.5x the floor per target row" (issue 21, goal 4d) below what the frozen replacement pass must compute?
Counts, with ``torch.utils.flop_counter`` on the CPU in fp32 (matmul, batched-matmul and attention FLOPs, 2 per
multiply-add; elementwise work is not counted), at ``gpu_scale``'s ``ratios512`` scale (the 8B's ratios at d_model
512, :data:`benchmarks.gpu_scale.SCALES`) and prompts of P = d/8 … d tokens (the 8B's 512 … 4096):

* the floor of one batch (:func:`benchmarks.gpu_scale.floor_pass`: forward of B prompt copies with the embeddings
  requiring grad, one backward from B targets to the embeddings only);
* one ``attribute`` call split by stage (:data:`benchmarks.gpu_scale.PHASES`), the backward per batch too, with
  the paper's Lorsa (:func:`benchmarks.gpu_scale.paper_lorsa`) on one middle layer and on every layer and TopK
  transcoders on every MLP; memory ``("sdpa", "grid")``: the GPU's pattern path (frozen MHSA by SDPA, Lorsa pattern
  rows recomputed), node vectors on grids (batched matmuls, counted; the gathered path does the same products
  elementwise, which the counter does not see);

and sets them against the analytic counts of :func:`floor_flops` and :func:`attribution_flops` (the same
terms, from the shapes and the layout's node counts: ``agreement`` = counted / analytic) and
:func:`backward_flops` with ``minimum=True`` and :func:`minimum_forward_flops`, what the frozen pass must
compute (docs/attribution.md, "FLOPs against the floor"). ``extrapolated``: the same formulas at the 8B shape
(32 layers, node counts from the ratios: P·top_k Lorsa and P·k transcoder nodes a layer, every OV head active),
per target row against the floor: a call of ``--rows`` rows (the H200 runs: 74 rows in batches of 4) and the
asymptote of many rows (the backward alone).

    python -m benchmarks.attribution_flops --time-repeats 3      # ratios512, P = 64 … 512, ~4 min on 1 core
    python -m benchmarks.attribution_flops --scale tiny --tokens 8 16 --out /tmp/f.json   # smoke

Writes ``results/attribution_flops.json``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from benchmarks._timing import RESULTS, arg, command, parser, start, write_json
from benchmarks.gpu_scale import SCALES, build, floor_pass, paper_lorsa, phase_totals
from nnsight_lorsa import LorsaSet, ReplacementModel, TranscoderSet, attribute, get_adapter
from nnsight_lorsa.modules import Transcoder, TranscoderConfig

#: the memory mode counted: SDPA from frozen queries and keys (the GPU's), node vectors on grids
MEMORY = ("sdpa", "grid")
#: the H200 runs of ``gpu_scale`` (benchmarks/results/gpu_scale_8b_NVIDIA_H200.json): batch 4, 64 features + 10 logits
H200_ROWS, H200_BATCH, N_LOGITS = 74, 4, 10


class _Global:
    """A stand-in for ``FlopCounterMode``'s module tracker: its backward hooks refuse ``torch.autograd.grad``
    (the floor's backward, "A leaf node was passed to _will_engine_execute_node"); only the global total is used."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _Global:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _sdpa_cpu(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(sdpa_flop_count(q, k, v))


def _sdpa_cpu_backward(grad_out: Any, q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(sdpa_backward_flop_count(grad_out, q, k, v))


class FlopCounter(FlopCounterMode):
    """``FlopCounterMode`` without its module tracker (:class:`_Global`), counting the CPU's fused attention kernel
    as the GPU's (torch's registry knows the CUDA kernels only: forward ``4·P²·d_head`` a head, backward
    ``2·(3·d_qk + 2·d_v)·P²`` — the kernel's dq, dk, dv, as FlashAttention's and the memory-efficient kernel's)."""

    def __init__(self) -> None:
        aten = torch.ops.aten
        super().__init__(display=False, custom_mapping={
            aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward})
        self.mod_tracker = _Global()  # type: ignore[assignment]


# ------------------------------------------------------------------------------------------------ analytic
def model_forward_flops(s: dict[str, Any], P: int, logits: int) -> int:
    """The plain model's forward on one copy of ``P`` tokens, ``logits`` positions unembedded."""
    d, hd = s["d_model"], s["d_model"] // s["n_heads"]
    d_kv = s["n_kv"] * hd
    lin = 2 * P * d * (2 * d + 2 * d_kv) + 6 * P * d * s["d_mlp"]
    return s["n_layers"] * (lin + 4 * P * P * d) + 2 * logits * d * s["vocab"]


def floor_flops(s: dict[str, Any], P: int, B: int) -> int:
    """:func:`benchmarks.gpu_scale.floor_pass`: per copy the forward (the last position unembedded) and the backward
    to the input, ``2·L·(2Pd(2d + 2d_kv) + 6Pd·d_mlp) + 14·L·P²d + 4dV`` (SDPA: forward ``4P²d``, backward ``10P²d``
    — the kernel computes dq, dk and dv)."""
    d, hd = s["d_model"], s["d_model"] // s["n_heads"]
    d_kv = s["n_kv"] * hd
    lin = 2 * P * d * (2 * d + 2 * d_kv) + 6 * P * d * s["d_mlp"]
    return B * (s["n_layers"] * (2 * lin + 14 * P * P * d) + 4 * d * s["vocab"])


def counts_at(s: dict[str, Any], P: int, lorsa_layers: list[int]) -> dict[str, Any]:
    """The layout's node counts as the ratios give them: P·top_k Lorsa nodes (every OV head active: ``u = n_ov``
    once P·top_k ≥ n_ov), P·k transcoder nodes a layer, :data:`N_LOGITS` logits."""
    return {"lorsa_nodes": {L: P * s["top_k"] for L in lorsa_layers},
            "lorsa_heads": {L: min(s["n_ov"], P * s["top_k"]) for L in lorsa_layers},
            "tc_nodes": {L: P * s["k_tc"] for L in range(s["n_layers"])}, "n_logits": N_LOGITS}


def _dims(s: dict[str, Any]) -> tuple[int, int, int]:
    """``(d_model, head_dim, d_kv)`` of a scale (the Lorsa's QK heads are the MHSA's head dim wide)."""
    d, hd = s["d_model"], s["d_model"] // s["n_heads"]
    return d, hd, s["n_kv"] * hd


def lorsa_slots(c: dict[str, Any], layer: int, P: int, B: int, d_qk: int) -> int:
    """The pattern rows a Lorsa layer's recomputed ``z_pre`` computes per pass: its nodes on
    :func:`~nnsight_lorsa.attribution.frozen.plan_rows`'s padded slots (the CPU's step budget: the counter runs on
    the CPU) where the layout's nodes per QK head are known (``c["lorsa_qk_counts"]``), else its nodes (the
    ratios' even spread: no padding)."""
    from nnsight_lorsa.attribution.frozen import plan_rows, row_chunk_elements

    counts = c.get("lorsa_qk_counts", {}).get(layer)
    if counts is None:
        return c["lorsa_nodes"][layer]
    _, steps = plan_rows(counts, P, B, d_qk, row_chunk_elements(torch.device("cpu")))
    return sum(st.heads * st.width for st in steps)


def attribution_flops(s: dict[str, Any], P: int, B: int, c: dict[str, Any], *, head_last_only: bool = True,
                      layout_decode: bool = False, qk_twice: bool = False) -> dict[str, int]:
    """What ``attribute`` computes once a call (matmul FLOPs), by stage, for node counts ``c`` (:func:`counts_at`, or
    the measured layout's): ``clean_pass_and_layout`` (the model on one copy, every position unembedded; each Lorsa's
    forward: q, k ``4Pd·n_qk·d_qk``, v ``2Pd·n_ov``, SDPA ``2P²(n_qk·d_qk + n_ov)``; each transcoder's encoder
    ``2Pd·d_tc``); ``frozen_forward`` (the model's modules on copy 0, and per layer: a frozen MHSA's q, k once
    ``2Pd(d + d_kv)``, per copy v ``2Pd·d_kv``, SDPA ``4P²d``, o ``2Pd²``; a Lorsa's q, k once, per copy v of the
    ``u`` active OV heads ``2Pd·u``, its ``n`` nodes' pattern rows once ``2sP·d_qk`` (``s`` their padded slots,
    :func:`lorsa_slots`; their ``z_pre``, elementwise since 2026-11-27, not counted) and writes ``2nd`` per copy,
    the error ``2nd`` once; a transcoder's ``m`` nodes' reads and writes ``4md`` per copy, its error ``2md`` once;
    the frozen unembedding ``2PdV`` on copy 0 and the targets ``2dT`` per copy). The switches: ``head_last_only``
    (the model's own unembedding on copy 0's last position only, not ``2PdV``); ``layout_decode`` (the layout's
    Lorsa forward also decodes, ``2P·n_ov·d``); ``qk_twice`` (a frozen MHSA's q, k computed once for each of the two
    constants)."""
    d, d_qk, d_kv = _dims(s)
    L, V, T = s["n_layers"], s["vocab"], c["n_logits"]
    qk_l = 4 * P * d * s["n_qk"] * d_qk
    clean = model_forward_flops(s, P, P)
    frozen = model_forward_flops(s, P, 1 if head_last_only else P) + 2 * P * d * V + 2 * B * d * T
    for layer in range(L):
        m = c["tc_nodes"].get(layer, 0)
        clean += 2 * P * d * s["d_tc"]
        frozen += 4 * B * m * d + 2 * m * d
        if layer in c["lorsa_nodes"]:
            n, u = c["lorsa_nodes"][layer], c["lorsa_heads"][layer]
            clean += qk_l + 2 * P * d * s["n_ov"] + 2 * P * P * (s["n_qk"] * d_qk + s["n_ov"])
            clean += 2 * P * s["n_ov"] * d if layout_decode else 0
            # the pattern rows on the padded slots; their z_pre contraction is elementwise (not counted)
            frozen += qk_l + 2 * B * P * d * u + 2 * lorsa_slots(c, layer, P, B, d_qk) * P * d_qk + 2 * B * n * d
            frozen += 2 * n * d
        else:
            frozen += (2 if qk_twice else 1) * 2 * P * d * (d + d_kv)
            frozen += B * (2 * P * d * d_kv + 4 * P * P * d + 2 * P * d * d)
    return {"clean_pass_and_layout": clean, "frozen_forward": frozen}


#: a target row's site: ``("logit", None)``, ``("lorsa", layer)`` (read at the attention's input) or ``("tc", layer)``
Site = tuple[str, Any]


def _order(site: Site, n_layers: int) -> tuple[int, int]:
    """Where a site's read is in forward order: a Lorsa's before its layer's attention, a transcoder's after it."""
    kind, layer = site
    return (n_layers, 9) if kind == "logit" else (layer, 1 if kind == "lorsa" else 3)


def backward_flops(s: dict[str, Any], P: int, B: int, c: dict[str, Any], sites: list[Site], *,
                   minimum: bool = False, stored: bool = True) -> int:
    """One backward of a batch whose rows sit at ``sites``: it starts at the highest read and passes every site
    below it. The frozen model is linear, its node activations constants, so the gradient reaches a site's inputs
    only through a frozen MHSA's OV circuit (v ``2Pd·d_kv``, SDPA ``10P²d``: the kernel's dq, dk and dv, o ``2Pd²``
    per copy) and otherwise runs down the residual stream: a replaced site costs its nodes' edges only (the writes'
    transposes, ``2nd`` or ``2md`` per copy). Each target site is read once more: a transcoder's ``2md`` per copy, a
    Lorsa's values ``2Pd·u`` per copy and its pattern rows ``2nP·d_qk`` (recomputed, once a pass; its ``z_pre``'s
    ``2nP`` a copy are elementwise: not counted), the logits ``2dT`` per copy. ``minimum``: what the backward must
    compute — the SDPA's ``grad_v = Aᵀg`` only, ``2P²d`` through a stored pattern (``stored``; else ``4P²d``, the
    pattern recomputed), the Lorsa's ``z_pre`` ``2nP`` per copy, its pattern rows stored (``stored``) or recomputed."""
    d, d_qk, d_kv = _dims(s)
    L = s["n_layers"]
    top = max(_order(x, L) for x in sites)
    sdpa = (2 if stored else 4) * P * P * d if minimum else 10 * P * P * d
    total = 0
    for layer in range(L):
        if (layer, 2) < top:  # the attention's output site
            if layer in c["lorsa_nodes"]:
                total += 2 * B * c["lorsa_nodes"][layer] * d
            else:
                total += B * (2 * P * d * d + sdpa + 2 * P * d * d_kv)
        if (layer, 4) < top:  # the MLP's output site
            total += 2 * B * c["tc_nodes"].get(layer, 0) * d
    for kind, layer in set(sites):
        if kind == "logit":
            total += 2 * B * d * c["n_logits"]
        elif kind == "tc":
            total += 2 * B * c["tc_nodes"][layer] * d
        else:
            n, u = c["lorsa_nodes"][layer], c["lorsa_heads"][layer]
            rows = 0 if minimum and stored else 2 * (n if minimum else lorsa_slots(c, layer, P, B, d_qk)) * P * d_qk
            total += 2 * B * P * d * u + rows + (2 * B * n * P if minimum else 0)
    return total


def worst_sites(s: dict[str, Any], c: dict[str, Any], B: int) -> list[Site]:
    """The costliest batch: a logit row (every site below) and ``B − 1`` Lorsa rows at the highest Lorsa layers (the
    dearest reads), or transcoder rows where there is no Lorsa."""
    lorsa = sorted(c["lorsa_nodes"], reverse=True)[:B - 1]
    tcs = [("tc", s["n_layers"] - 1 - i) for i in range(B - 1 - len(lorsa))]
    return [("logit", None), *[("lorsa", x) for x in lorsa], *tcs]


def minimum_forward_flops(s: dict[str, Any], P: int, c: dict[str, Any]) -> int:
    """What a call must compute once besides its backwards: the clean pass (the model on one copy, the last position
    unembedded) and the active set (every Lorsa's forward without its output, every transcoder's encoder), whose
    queries, keys and values are the frozen constants; the frozen forward's values are the clean pass's."""
    return attribution_flops(s, P, 1, c, layout_decode=False)["clean_pass_and_layout"] - 2 * (P - 1) * s["d_model"] \
        * s["vocab"]


def per_row(s: dict[str, Any], P: int, B: int, rows: int, c: dict[str, Any]) -> dict[str, float]:
    """Analytic FLOPs per batch of ``B`` rows against the floor, every batch the costliest (:func:`worst_sites`): a
    call of ``rows`` rows and the asymptote of many rows (the backward alone); the minimum likewise (patterns and
    pattern rows stored, or recomputed)."""
    a, floor, worst = attribution_flops(s, P, B, c), floor_flops(s, P, B), worst_sites(s, c, B)
    batches = -(-rows // B)
    back = backward_flops(s, P, B, c, worst)
    low, low_r = (backward_flops(s, P, B, c, worst, minimum=True, stored=st) for st in (True, False))
    return {"call": ((a["clean_pass_and_layout"] + a["frozen_forward"]) / batches + back) / floor,
            "asymptote": back / floor, "minimum_call": (minimum_forward_flops(s, P, c) / batches + low) / floor,
            "minimum_asymptote_stored": low / floor, "minimum_asymptote_recomputed": low_r / floor}


# ---------------------------------------------------------------------------------------------- measured
def replacement(s: dict[str, Any], model: Any, hf: Any, lorsa_layers: Any,
                dtype: torch.dtype = torch.float32) -> ReplacementModel:
    """The paper's Lorsa on ``lorsa_layers`` and TopK transcoders on every MLP (CPU, in ``dtype``), as gpu_scale (d)
    (also :mod:`benchmarks.attribution_traffic`'s)."""
    adapter, dev = get_adapter(model), torch.device("cpu")
    lorsas, tcs = LorsaSet(model), TranscoderSet(model)
    for L in lorsa_layers:
        lorsas[L] = paper_lorsa(s, adapter, hf, L, dev, dtype)
    for L in range(s["n_layers"]):
        tcs[L] = Transcoder(TranscoderConfig(d_in=s["d_model"], d_sae=s["d_tc"], activation="topk",
                                             activation_params={"k": s["k_tc"]}, layer=L), device=dev, dtype=dtype)
    return ReplacementModel(model, lorsas=lorsas, transcoders=tcs)


def layout_counts(rm: ReplacementModel, ids: torch.Tensor) -> tuple[dict[str, Any], Any]:
    """The node counts of the prompt's layout (as :func:`counts_at`), and a map from a target row to its site."""
    from nnsight_lorsa.attribution.trace import prepare

    lay = prepare(rm, ids[0]).layout
    c = {"lorsa_nodes": {x.layer: int(x.lorsa_pos.numel()) for x in lay.layers if x.lorsa is not None},
         "lorsa_heads": {x.layer: int(x.lorsa_head.unique().numel()) for x in lay.layers if x.lorsa is not None},
         "tc_nodes": {x.layer: int(x.tc_pos.numel()) for x in lay.layers if x.transcoder is not None},
         "n_logits": int(lay.n_logits),
         "lorsa_qk_counts": {x.layer: torch.bincount(x.lorsa_head // x.lorsa.cfg.group_size,
                                                     minlength=x.lorsa.cfg.n_qk_heads).tolist()
                             for x in lay.layers if x.lorsa is not None}}
    spans = [(x.lorsa_start, x.lorsa_start + c["lorsa_nodes"][x.layer], ("lorsa", x.layer))
             for x in lay.layers if x.lorsa is not None]
    spans += [(x.tc_start, x.tc_start + c["tc_nodes"][x.layer], ("tc", x.layer))
              for x in lay.layers if x.transcoder is not None]

    def site(row: int) -> Site:
        return next((where for lo, hi, where in spans if lo <= row < hi), ("logit", None))

    return c, site


def measure(s: dict[str, Any], hf: Any, rm: ReplacementModel, P: int, B: int, rows: int,
            time_repeats: int = 1) -> dict[str, Any]:
    """Counted FLOPs of the floor and of one ``attribute`` call by stage, with the analytic; CPU seconds of the call
    and of the floor, counted and (median of ``time_repeats`` runs) not."""
    from nnsight_lorsa.attribution.replacement import FrozenReplacement

    ids = torch.randint(0, s["vocab"], (1, P), generator=torch.Generator().manual_seed(P))
    with FlopCounter() as counter:
        t = time.perf_counter()
        floor_pass(hf, ids, B)
        floor_seconds = time.perf_counter() - t
    floor = counter.get_total_flops()
    batches_rows: list[list[int]] = []
    objective = FrozenReplacement.objective

    def logged(self: Any, rows: list[int]) -> torch.Tensor:
        batches_rows.append(list(rows))
        return objective(self, rows)

    FrozenReplacement.objective = logged  # type: ignore[method-assign]
    try:
        with FlopCounter() as counter, phase_totals(counter.get_total_flops) as (phases, calls):
            t = time.perf_counter()
            graph = attribute(rm, ids, batch_size=B, max_feature_nodes=rows, memory=MEMORY)
            seconds = time.perf_counter() - t
            total = counter.get_total_flops()
    finally:
        FrozenReplacement.objective = objective  # type: ignore[method-assign]
    uncounted = []  # the same call timed outside the counter (its dispatch mode costs Python time per op)
    for _ in range(time_repeats):
        t = time.perf_counter()
        attribute(rm, ids, batch_size=B, max_feature_nodes=rows, memory=MEMORY)
        uncounted.append(time.perf_counter() - t)
    t = time.perf_counter()
    floor_pass(hf, ids, B)
    floor_uncounted = time.perf_counter() - t
    n_rows = int(graph.feature_rows.sum())
    batches = len(batches_rows)
    c, site = layout_counts(rm, ids)
    analytic = attribution_flops(s, P, B, c)
    counted = {**phases, "other": total - sum(phases.values())}
    back = calls.get("backward", [])
    back_analytic = [backward_flops(s, P, B, c, [site(r) for r in rs]) for rs in batches_rows]
    return {
        "tokens": P, "batch": B, "target_rows": n_rows, "batches": batches, "counts": c,
        "floor_flops": floor, "floor_flops_analytic": floor_flops(s, P, B),
        "floor_agreement": floor / floor_flops(s, P, B), "flops": counted, "flops_total": total,
        "backward_flops_per_batch": back, "backward_flops_per_batch_analytic": back_analytic,
        "analytic": analytic,
        "agreement": {**{k: counted.get(k, 0) / analytic[k] for k in ("clean_pass_and_layout", "frozen_forward")},
                      "backward": sum(back) / sum(back_analytic)},
        "per_row_vs_floor_flops": total / batches / floor,
        "per_row_vs_floor_flops_backward_max": max(back) / floor,
        "per_row_vs_floor_analytic": per_row(s, P, B, n_rows, c),
        "seconds_counted": seconds, "floor_seconds_counted": floor_seconds,
        "seconds": sorted(uncounted)[len(uncounted) // 2] if uncounted else None, "seconds_runs": uncounted,
        "floor_seconds": floor_uncounted,
        "edge_sum_error_max": float(graph.edge_sum_error("mass").max()),
    }


def extrapolate(tokens: list[int], B: int, rows: int) -> dict[str, Any]:
    """The analytic per-row ratios at the 8B shape (``gpu_scale.SCALES['8b']``), the Lorsa on layer 15 and on
    every layer."""
    s = SCALES["8b"]
    out: dict[str, Any] = {}
    for name, layers in (("one_layer", [s["layer"]]), ("all_layers", list(range(s["n_layers"])))):
        out[name] = [{"tokens": P, **per_row(s, P, B, rows, counts_at(s, P, layers)),
                      "floor_flops": floor_flops(s, P, B)} for P in tokens]
    return out


def main() -> None:
    args = parser(__doc__, scale=arg("ratios512", choices=sorted(SCALES)),
                  tokens=arg(nargs="+", type=int, default=[64, 128, 256, 512]), batch=4,
                  rows=arg(8, help="max_feature_nodes of each attribute call (plus the logit rows)"),
                  time_repeats=arg(1, help="untimed-by-the-counter runs of each call, for its seconds (median)"),
                  threads=1, out=arg(None, type=str)).parse_args()
    start(args)
    s = SCALES[args.scale]
    model, hf = build(s, torch.device("cpu"), torch.float32)
    result: dict[str, Any] = {"scale": args.scale, "shapes": s, "memory": list(MEMORY), "torch": torch.__version__,
                              "batch": args.batch, "command": command()}
    path = args.out or RESULTS / "attribution_flops.json"
    for name, layers in (("one_layer", [s["layer"]]), ("all_layers", list(range(s["n_layers"])))):
        rm = replacement(s, model, hf, layers)
        result[name] = []
        for P in args.tokens:
            row = measure(s, hf, rm, P, args.batch, args.rows, args.time_repeats)
            result[name].append(row)
            print(name, P, {k: round(v, 3) for k, v in row["agreement"].items()}, "floor",
                  round(row["floor_agreement"], 3), "per row", round(row["per_row_vs_floor_flops"], 3),
                  "backward max", round(row["per_row_vs_floor_flops_backward_max"], 3), flush=True)
            write_json(path, result)
    result["extrapolated_8b"] = extrapolate([512, 1024, 2048, 4096], H200_BATCH, H200_ROWS)
    for name, rows in result["extrapolated_8b"].items():
        for r in rows:
            print("8b", name, {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
    write_json(path, result)
    print("wrote", path)


if __name__ == "__main__":
    main()
