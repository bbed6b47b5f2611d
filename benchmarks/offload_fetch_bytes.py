"""Bytes one frozen-pass fetch of an offloaded module copies to the device, before (the whole module) and since
2026-11-27 (what the block reads: a Lorsa's queries and keys without its OV circuit, ``offload.LORSA_OV``; a
transcoder's MLP site without its encoder and decoders, ``offload.coder_site_leave``), on ``meta`` (no storage, no
GPU): the paper Lorsa and TopK transcoder at the Llama-3.1-8B shape in bf16 (``offload_estimate_8b``'s), and at
``gpu_scale``'s ``small`` and ``ratios512`` scales in fp32 (head dim ``d_model / n_heads``, as
``LorsaConfig.from_mhsa``).

    python -m benchmarks.offload_fetch_bytes
"""

from __future__ import annotations

import torch

from benchmarks.gpu_scale import SCALES
from benchmarks.offload_estimate_8b import offloaded_modules
from nnsight_lorsa import Lorsa, LorsaConfig
from nnsight_lorsa._placement import fetched_bytes
from nnsight_lorsa.attribution.offload import LORSA_OV, coder_site_leave, module_bytes
from nnsight_lorsa.modules import Transcoder, TranscoderConfig


def scale_modules(name: str) -> tuple[Lorsa, Transcoder]:
    """The Lorsa and transcoder of ``gpu_scale``'s scale ``name`` on ``meta``, fp32."""
    s = SCALES[name]
    lorsa = Lorsa(LorsaConfig(d_model=s["d_model"], n_qk_heads=s["n_qk"], d_qk_head=s["d_model"] // s["n_heads"],
                              n_ov_heads=s["n_ov"], top_k=s["top_k"], layer=0), device="meta", dtype=torch.float32)
    tc = Transcoder(TranscoderConfig(d_in=s["d_model"], d_sae=s["d_tc"], activation="topk",
                                     activation_params={"k": s["k_tc"]}, layer=0), device="meta", dtype=torch.float32)
    return lorsa, tc


def main() -> None:
    shapes = [("8b bf16", offloaded_modules()), *((n, scale_modules(n)) for n in ("small", "ratios512"))]
    for name, (lorsa, tc) in shapes:
        print(f"{name}: Lorsa {module_bytes(lorsa)} -> {fetched_bytes(lorsa, LORSA_OV)} B; "
              f"transcoder {module_bytes(tc)} -> {fetched_bytes(tc, coder_site_leave(tc))} B")


if __name__ == "__main__":
    main()
