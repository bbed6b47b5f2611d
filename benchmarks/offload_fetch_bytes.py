"""Bytes each fetch of an offloaded module copies to the device (one ``resident`` block: ``_placement.fetched_bytes``
of its selection), before and after the changes of 2026-11-27, on ``meta`` (no storage, no GPU): the paper Lorsa and
TopK transcoder at the Llama-3.1-8B shape in bf16 (``offload_estimate_8b``'s) with a skip cross-layer transcoder of
that shape (32 layers, ``d_sae`` the transcoder's), and at ``gpu_scale``'s ``small`` and ``ratios512`` scales in fp32
(head dim ``d_model / n_heads``, as ``LorsaConfig.from_mhsa``).

    python -m benchmarks.offload_fetch_bytes

Per shape and block, ``whole`` (the module), ``before`` and ``after`` bytes:

* frozen pass, a Lorsa's queries and keys: the whole Lorsa before, all but its OV circuit (``offload.LORSA_OV``) after;
* frozen pass, a transcoder's MLP site: the whole module before, all but its encoder and decoders after
  (``offload.coder_site_leave``); a CLT's site: every layer's ``W_skip`` before, its own ``W_skip[layer]`` after
  (``layout.coder_layer_parts`` of ``layout.SITE_PARTS``);
* clean pass (``layout.build_layout``), a Lorsa's heads: the whole Lorsa before, all but ``W_O`` / ``b_D``
  (``layout.LORSA_OUT``) after; a transcoder's encoder: the whole module before, all but its decoders and ``W_skip``
  (``layout.coder_decoders``) after, a CLT's its own layer's ``W_enc[layer]`` / ``b_enc[layer]`` of the stacks
  (``layout.coder_layer_parts`` of ``layout.ENCODER_PARTS``).

Writes ``results/offload_fetch_bytes.json`` (``--name``).
"""

from __future__ import annotations

import torch

from benchmarks._timing import command, parser, write
from benchmarks.gpu_scale import SCALES
from benchmarks.offload_estimate_8b import SHAPE, offloaded_modules
from nnsight_lorsa import Lorsa, LorsaConfig
from nnsight_lorsa._placement import fetched_bytes
from nnsight_lorsa.attribution.layout import (
    ENCODER_PARTS,
    LORSA_OUT,
    SITE_PARTS,
    coder_decoders,
    coder_layer_parts,
)
from nnsight_lorsa.attribution.offload import LORSA_OV, coder_site_leave, module_bytes
from nnsight_lorsa.modules import Transcoder, TranscoderConfig
from nnsight_lorsa.modules.clt import CLTConfig, CrossLayerTranscoder


def scale_modules(name: str) -> tuple[Lorsa, Transcoder]:
    """The Lorsa and transcoder of ``gpu_scale``'s scale ``name`` on ``meta``, fp32."""
    s = SCALES[name]
    lorsa = Lorsa(LorsaConfig(d_model=s["d_model"], n_qk_heads=s["n_qk"], d_qk_head=s["d_model"] // s["n_heads"],
                              n_ov_heads=s["n_ov"], top_k=s["top_k"], layer=0), device="meta", dtype=torch.float32)
    tc = Transcoder(TranscoderConfig(d_in=s["d_model"], d_sae=s["d_tc"], activation="topk",
                                     activation_params={"k": s["k_tc"]}, layer=0), device="meta", dtype=torch.float32)
    return lorsa, tc


def clt_8b() -> CrossLayerTranscoder:
    """A skip CLT at the 8B shape on ``meta``, bf16 (``d_sae`` per layer: the transcoder's)."""
    s = SHAPE
    # torch's default device meta too: the CLT's random init draws on it (on the CPU: 141 GB of decoders)
    with torch.device("meta"):
        return CrossLayerTranscoder(CLTConfig(d_in=s["d_model"], d_sae=s["d_tc"], n_layers=s["n_layers"], skip=True,
                                              activation="topk", activation_params={"k": s["tc_k"]}),
                                    device="meta", dtype=torch.bfloat16)


def coder_rows(tc: torch.nn.Module, view: torch.nn.Module) -> dict[str, dict[str, int]]:
    """The frozen-pass site and clean-pass encoder fetches of a transcoder or CLT ``tc`` (``view``: the layer the
    site serves, ``tc`` itself for a per-layer transcoder)."""
    whole = module_bytes(tc)
    parts = coder_layer_parts(view, SITE_PARTS)
    site_before = fetched_bytes(tc, coder_site_leave(tc) - set(parts))  # a CLT: every layer's W_skip
    return {"site": {"whole": whole, "before": whole if not parts else site_before,
                     "after": fetched_bytes(tc, coder_site_leave(tc), parts)},
            "clean_encode": {"whole": whole, "before": whole,
                             "after": fetched_bytes(tc, coder_decoders(tc), coder_layer_parts(view, ENCODER_PARTS))}}


def main() -> None:
    args = parser(__doc__, name="offload_fetch_bytes").parse_args()
    clt = clt_8b()
    shapes = [("8b bf16", offloaded_modules()), *((n, scale_modules(n)) for n in ("small", "ratios512"))]
    out: dict[str, dict] = {}
    for name, (lorsa, tc) in shapes:
        whole = module_bytes(lorsa)
        rows = {"lorsa_qk": {"whole": whole, "before": whole, "after": fetched_bytes(lorsa, LORSA_OV)},
                "lorsa_clean_heads": {"whole": whole, "before": whole, "after": fetched_bytes(lorsa, LORSA_OUT)},
                **{f"transcoder_{k}": v for k, v in coder_rows(tc, tc).items()}}
        if name == "8b bf16":  # the first layer's site (every layer's slice is the same size)
            rows |= {f"clt_{k}": v for k, v in coder_rows(clt, clt.by_layer()[0]).items()}
        out[name] = rows
        for block, r in rows.items():
            print(f"{name} {block}: whole {r['whole']} B, before {r['before']} B -> after {r['after']} B", flush=True)
    print(f"-> {write(args.name, {'command': command(), 'bytes': out})}")


if __name__ == "__main__":
    main()
