"""``estimate_memory``'s terms at the Llama-3.1-8B shape of issue 21, from a synthetic layout (no model, no GPU).

    python -m benchmarks.attribution_host_estimate_8b [--tokens 512 1024 2048 4096 8192] [--rows 64] [--batch 4]

The prompt's nodes as ``benchmarks/gpu_scale.py`` (d) makes them with ``--attr-lorsa 15``: 32 layers, d 4096,
the Lorsa paper's Lorsa (256 QK heads of 128, top-k 128) on layer 15, TopK transcoders (k 64) on all 32 MLPs
— exactly ``k`` active nodes per position and module (TopK), no bias nodes, 10 logits — on a CUDA bf16 model
(no stored patterns; fp32 edges). For each length: the host estimate (the rows term: the stored sparse rows and
the graph's adjacency), the device estimate, the host estimate with ``prune=`` (``pruned_host_bytes``; its
pruning term: the edge scores' bound and the kept graph's — its kept rows' blocks —, and what a dense ``k × k`` kept
graph would be bounded by, ``k ≤ 64 + 10 +`` every error and embedding node), and the host estimate the dense
``N²`` adjacency gave before
(``rows`` with ``4 B · N²`` in place of the blocks' bound; issue 21 measured its 512/1024-token values on an
H200: 1.46 / 5.3 GB). Predictions of the memory model only — the measured host peaks are in
``attribution_memory_terms_budget.json`` (embedded model, CPU) — and, for the lengths the H200 runs of
``gpu_scale.py`` (d) recorded (``gpu_scale_8b_NVIDIA_H200.json``, batch 4), their device peak above the resident
weights next to the device estimate (the GPU's fitted per-copy coefficient) and to what the frozen pass's terms
counted from the structure give at this shape (``device_bytes_structural``: the CPU's SDPA counts, the model's
own parts — logits, MLP — included; the GPU's kernels keep more).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks._timing import RESULTS, arg, command, parser, write
from nnsight_lorsa.attribution.budget import budget_blocks_bytes, estimate_layout
from nnsight_lorsa.attribution.graph import ATTN_ERROR, EMBEDDING, LOGIT, LORSA, MLP_ERROR, TRANSCODER, NodeTable
from nnsight_lorsa.attribution.layout import LayerLayout, Layout

SHAPE = dict(n_layers=32, d_model=4096, n_heads=32, lorsa_layer=15, n_qk=256, d_qk=128, n_ov=32768, lorsa_k=128,
             tc_k=64, n_logits=10, n_kv=8, head_dim=128, vocab=128256, d_mlp=14336)
#: the H200 runs of ``benchmarks/gpu_scale.py`` (d) at this shape: their device peaks above the resident weights
H200 = RESULTS / "gpu_scale_8b_NVIDIA_H200.json"


def synthetic_layout(P: int, s: dict = SHAPE, *, lorsa: Any = None, transcoder: Any = None,
                     lorsa_layers: Any = None, ids: Any = None) -> Layout:
    """The layout of a ``P``-token prompt with ``s["lorsa_k"]`` active heads and ``s["tc_k"]`` active features per
    position: a Lorsa on ``lorsa_layers`` (default: ``s["lorsa_layer"]`` alone; an attention error node per position
    there), a transcoder on every MLP. ``lorsa`` / ``transcoder``: the modules the layers name (default: stand-ins
    with the Lorsa's QK shape and group size, ``s["n_ov"] // s["n_qk"]``, and a resident transcoder); ``ids(kind,
    n)``: the ``n`` heads (``"lorsa"``) or features (``"tc"``) of a layer's nodes, called per layer, Lorsa first
    (default: all 0)."""
    ar = torch.arange(P)
    layers, feats, errors, col = [], [], [], 0
    if lorsa is None:
        lorsa = SimpleNamespace(cfg=SimpleNamespace(n_qk_heads=s["n_qk"], d_qk_head=s["d_qk"],
                                                   group_size=max(1, s["n_ov"] // s["n_qk"])))
    if transcoder is None:
        transcoder = SimpleNamespace(weights_owner=None)  # resident (offload_terms: nothing offloaded)
    with_lorsa = {s["lorsa_layer"]} if lorsa_layers is None else set(lorsa_layers)
    if ids is None:
        def ids(kind: str, n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.long)
    for layer in range(s["n_layers"]):
        lay = LayerLayout(layer=layer)
        if layer in with_lorsa:
            lay.lorsa, lay.lorsa_pos, lay.lorsa_start = lorsa, ar.repeat_interleave(s["lorsa_k"]), col
            lay.lorsa_head = ids("lorsa", lay.lorsa_pos.numel())
            col += lay.lorsa_pos.numel()
            feats.append(NodeTable.make(LORSA, layer, lay.lorsa_pos, lay.lorsa_head))
        lay.transcoder, lay.tc_pos, lay.tc_start = transcoder, ar.repeat_interleave(s["tc_k"]), col
        lay.tc_feat = ids("tc", lay.tc_pos.numel())
        col += lay.tc_pos.numel()
        feats.append(NodeTable.make(TRANSCODER, layer, lay.tc_pos, lay.tc_feat))
        layers.append(lay)
    n_features = col
    for lay in layers:
        if lay.lorsa is not None:
            lay.attn_err_start, col = col, col + P
            errors.append(NodeTable.make(ATTN_ERROR, lay.layer, ar, -1))
        lay.mlp_err_start, col = col, col + P
        errors.append(NodeTable.make(MLP_ERROR, lay.layer, ar, -1))
    emb_start, col = col, col + P
    logits = torch.arange(s["n_logits"])
    nodes = NodeTable.cat([*feats, *errors, NodeTable.make(EMBEDDING, -1, ar, ar),
                           NodeTable.make(LOGIT, s["n_layers"], torch.full((s["n_logits"],), P - 1), logits)])
    return Layout(tokens=ar, layers=layers, emb_start=emb_start, n_sources=col, n_features=n_features, bias={},
                  logit_tokens=logits, logit_probs=torch.full((s["n_logits"],), 0.09), nodes=nodes)


def main() -> None:
    args = parser(__doc__, tokens=arg(nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192]), rows=64,
                  batch=4, name="attribution_host_estimate_8b").parse_args()
    s, runs = SHAPE, []
    recorded = {r["tokens"]: r["device_peak_above_resident"] for r in json.loads(H200.read_text())["d_attribution"]
                if args.batch == 4} if H200.exists() else {}
    for P in args.tokens:
        layout = synthetic_layout(P)
        heads = {L: s["n_heads"] for L in range(s["n_layers"]) if s["lorsa_layer"] != L}
        est = estimate_layout(layout, n_layers=s["n_layers"], d_model=s["d_model"], mhsa_heads=heads,
                              batch_size=args.batch, prune=False, max_feature_nodes=args.rows,
                              store_patterns=False, model_itemsize=2, edge_itemsize=4, device="cuda",
                              module_itemsize=2)
        t = est.terms
        n = layout.n_sources - layout.n_features + args.rows + layout.n_logits
        blocks = budget_blocks_bytes(layout, t["n_rows"], args.rows, 4)
        dense_before = t["rows"] - blocks + 4 * n * n + t["fixed"]  # the estimate before: no selection/assembly
        pruned = estimate_layout(layout, n_layers=s["n_layers"], d_model=s["d_model"], mhsa_heads=heads,
                                 batch_size=args.batch, prune=True, max_feature_nodes=args.rows,
                                 store_patterns=False, model_itemsize=2, edge_itemsize=4, device="cuda",
                                 module_itemsize=2)
        widths = {layer: (s["n_heads"] * s["head_dim"], s["n_kv"] * s["head_dim"]) for layer in heads}
        structural = estimate_layout(layout, n_layers=s["n_layers"], d_model=s["d_model"], mhsa_heads=heads,
                                     batch_size=args.batch, prune=False, max_feature_nodes=args.rows,
                                     store_patterns=False, model_itemsize=2, edge_itemsize=4, device="cpu",
                                     module_itemsize=2, mhsa_widths=widths, vocab=s["vocab"], d_mlp=s["d_mlp"])
        h200 = recorded.get(P)
        if h200 is not None:
            print(f"H200 {P}: measured {h200 / 1e9:.2f} GB, estimate {est.device_bytes / 1e9:.2f} "
                  f"({h200 / est.device_bytes:.3f}), structural {structural.device_bytes / 1e9:.2f} "
                  f"({h200 / structural.device_bytes:.3f})", flush=True)
        runs.append({"tokens": P, "n_nodes": n, "device_bytes_structural": structural.device_bytes,
                     "h200_device_peak_above_resident": h200,
                     "h200_measured_over_estimate": None if h200 is None else h200 / est.device_bytes,
                     "h200_measured_over_structural": None if h200 is None else h200 / structural.device_bytes,
                     "n_features": layout.n_features, "target_rows": t["n_rows"],
                     "host_bytes": est.host_bytes, "rows_sparse_bytes": t["rows"] - blocks, "rows_blocks_bytes": blocks,
                     "device_bytes": est.device_bytes, "host_bytes_dense_adjacency_before": dense_before,
                     "pruned_host_bytes": pruned.host_bytes, "pruned_kept_graph_bytes": pruned.terms["kept_graph"],
                     "pruned_edge_scores_bytes": pruned.terms["edge_scores"],
                     "pruned_pruning_bytes": pruned.terms["pruning"],
                     "pruned_dense_kept_graph_bound_bytes": 4 * n * n})
        print({k: (f"{v / 1e9:.2f} GB" if k.endswith("bytes") or k.endswith("before") else v)
               for k, v in runs[-1].items()}, flush=True)
        del layout
    print(f"-> {write(args.name, {'command': command(), 'shape': s, 'rows': args.rows, 'runs': runs})}")


if __name__ == "__main__":
    main()
