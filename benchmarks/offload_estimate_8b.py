"""``estimate_memory``'s device terms for the H200's offloaded all-layer runs at the Llama-3.1-8B shape, from a
synthetic layout (no model, no GPU): the paper's Lorsa on all 32 layers and TopK transcoders on all 32 MLPs,
offloaded, bf16, batch 4, 64 feature rows (``gpu_scale --offload --attr-lorsa all``;
``d_attribution_offload_all_lorsas`` of ``results/gpu_scale_8b_NVIDIA_H200.json``).

    python -m benchmarks.offload_estimate_8b

Per recorded run: the measured device peak above what was allocated before the call, the estimate the run recorded,
and the estimate now with its terms — the rows as the run kept them (``offload_rows_kept_bytes`` recorded, plus with
``"partial"`` the largest block at its bound, every one of a layer's 32 k rows: 268 MB), the rest from the synthetic
layout (exactly ``k`` active nodes per position and module, uniform OV heads and features over ``frac`` of them:
``--frac 0.74`` reproduces the 25.4 GB of rows the 1024-token run kept with every block on the device). Writes
``results/offload_estimate_8b.json``.
"""

from __future__ import annotations

import json

import torch

from benchmarks._timing import RESULTS, arg, command, parser, write
from benchmarks.attribution_host_estimate_8b import synthetic_layout
from nnsight_lorsa import Lorsa, LorsaConfig
from nnsight_lorsa._placement import set_offload
from nnsight_lorsa.attribution.budget import estimate_layout
from nnsight_lorsa.attribution.layout import Layout
from nnsight_lorsa.modules import Transcoder, TranscoderConfig

#: the shapes of ``benchmarks/gpu_scale.py``'s ``8b`` scale
SHAPE = dict(n_layers=32, d_model=4096, n_qk=256, d_qk=128, n_ov=32768, lorsa_k=128, d_tc=32768, tc_k=64,
             n_logits=10, vocab=128256, d_mlp=14336)
H200 = RESULTS / "gpu_scale_8b_NVIDIA_H200.json"


def offloaded_modules(s: dict = SHAPE) -> tuple[Lorsa, Transcoder]:
    """A paper Lorsa and a TopK transcoder on the ``meta`` device (their bytes, no storage), marked offloaded."""
    lorsa = Lorsa(LorsaConfig(d_model=s["d_model"], n_qk_heads=s["n_qk"], d_qk_head=s["d_qk"], n_ov_heads=s["n_ov"],
                              top_k=s["lorsa_k"], layer=0), device="meta", dtype=torch.bfloat16)
    tc = Transcoder(TranscoderConfig(d_in=s["d_model"], d_sae=s["d_tc"], activation="topk",
                                     activation_params={"k": s["tc_k"]}, layer=0), device="meta", dtype=torch.bfloat16)
    for m in (lorsa, tc):
        set_offload(m, True)
    return lorsa, tc


def all_lorsa_layout(P: int, frac: float, s: dict = SHAPE) -> Layout:
    """A ``P``-token prompt's layout with the Lorsa and the transcoder on every layer: ``lorsa_k`` / ``tc_k`` active
    nodes per position, heads and features uniform over the first ``frac`` of them (seeded)."""
    g = torch.Generator().manual_seed(P)
    lorsa, tc = offloaded_modules(s)
    width = {"lorsa": s["n_ov"], "tc": s["d_tc"]}

    def ids(kind: str, n: int) -> torch.Tensor:
        return torch.randint(0, max(1, int(frac * width[kind])), (n,), generator=g)

    return synthetic_layout(P, s, lorsa=lorsa, transcoder=tc, lorsa_layers=range(s["n_layers"]), ids=ids)


def main() -> None:
    args = parser(__doc__, frac=arg(0.74, help="the share of OV heads and features active somewhere"),
                  name="offload_estimate_8b").parse_args()
    s = SHAPE
    recorded = json.loads(H200.read_text()).get("d_attribution_offload_all_lorsas", [])
    runs = []
    for run in recorded:
        P, batch = run["tokens"], run["batch_size"]
        layout = all_lorsa_layout(P, args.frac)
        est = estimate_layout(layout, n_layers=s["n_layers"], d_model=s["d_model"], mhsa_heads={}, batch_size=batch,
                              prune=False, max_feature_nodes=64, store_patterns=False, node_vectors="auto",
                              model_itemsize=2, edge_itemsize=4, device="cuda", module_itemsize=2, vocab=s["vocab"],
                              d_mlp=s["d_mlp"], offload_rows="host")
        t = dict(est.terms)
        largest = s["n_ov"] * s["d_model"] * 2  # a block's bound: every row of a layer's weight, bf16
        rows = run["offload_rows_kept_bytes"] + (largest if run["offload_rows"] != "device" else 0)
        estimate = est.device_bytes - t["offload_rows"] + rows
        measured = run["device_peak_above_resident"]
        row = {"tokens": P, "offload_rows": run["offload_rows"], "measured": measured,
               "estimate_recorded": run["estimate_device_bytes"],
               "measured_over_recorded": measured / run["estimate_device_bytes"],
               "estimate_now": estimate, "measured_over_now": measured / estimate,
               "now_without_offload_fetch": estimate - t["offload_fetch"], "rows_as_kept": rows,
               "terms_now": {k: t[k] for k in ("frozen_per_copy", "frozen_shared", "offload_fetch", "gather_chunks",
                                               "n_sources")}}
        runs.append(row)
        print({k: (round(v / 1e9, 3) if isinstance(v, int) and k != "tokens" else v) for k, v in row.items()},
              flush=True)
    print(f"-> {write(args.name, {'command': command(), 'shape': s, 'frac': args.frac, 'runs': runs})}")


if __name__ == "__main__":
    main()
