"""Lorsa forward vs its floor (one SDPA call + the dense projections) vs per-head Algorithm 1.

Pythia-160M-like dims (Lorsa paper: 6K heads for d_model 768): d_model 768, 96 QK heads x 64,
6144 OV heads, top_k 64, batch 4 x 256 tokens. The floor is what any implementation must do:
the Q/K/V projections, ONE scaled_dot_product_attention call with the same shapes (the OV heads
as value dimension), and the dense output projection. Algorithm 1 of the paper computes each OV
head separately (its own softmax pattern); it is timed on a slice of heads and extrapolated.

    python -m benchmarks.bench_lorsa_forward [--device cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks._timing import parser, start, table, time_interleaved, write
from nnsight_lorsa import Lorsa, LorsaConfig
from nnsight_lorsa.modules import RotaryConfig


def main() -> None:
    args = parser(__doc__, device="cpu", dtype="float32", batch=4, seq=256, repeats=7, algo1_heads=96).parse_args()
    start(args)
    dev, dt = torch.device(args.device), getattr(torch, args.dtype)
    d, n_qk, e, n_ov, k = 768, 96, 64, 6144, 64
    cfg = LorsaConfig(d_model=d, n_qk_heads=n_qk, d_qk_head=e, n_ov_heads=n_ov, top_k=k,
                      rotary=RotaryConfig(head_dim=e, rotary_dim=16, base=10000.0))  # Pythia: 25% rotary
    lorsa = Lorsa(cfg, device=dev, dtype=dt).eval()
    x = torch.randn(args.batch, args.seq, d, device=dev, dtype=dt)
    Wq = lorsa.W_Q.detach().permute(1, 0, 2).reshape(d, n_qk * e)
    Wk = lorsa.W_K.detach().permute(1, 0, 2).reshape(d, n_qk * e)
    Wv, Wo = lorsa.W_V.detach().T.contiguous(), lorsa.W_O.detach()
    b, s, g = args.batch, args.seq, n_ov // n_qk

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    @torch.no_grad()
    def floor() -> None:
        q = (x @ Wq).view(b, s, n_qk, e).transpose(1, 2)
        kk = (x @ Wk).view(b, s, n_qk, e).transpose(1, 2)
        v = (x @ Wv).view(b, s, n_qk, g).transpose(1, 2)
        z = F.scaled_dot_product_attention(q, kk, v, is_causal=True).transpose(1, 2).reshape(b, s, n_ov)
        _ = z @ Wo
        sync()

    @torch.no_grad()
    def ours() -> None:
        lorsa(x)
        sync()

    heads = args.algo1_heads

    @torch.no_grad()
    def algorithm1_slice() -> None:  # paper Algorithm 1: one attention per OV head
        q_all, k_all = lorsa.qk(x)
        v_all = lorsa.values(x)
        causal = torch.ones(s, s, dtype=torch.bool, device=dev).tril()
        for h in range(heads):
            gq = h // g
            a = (q_all[:, gq] @ k_all[:, gq].transpose(-1, -2) / cfg.attn_scale).masked_fill(~causal, -1e30)
            _ = a.softmax(-1) @ v_all[:, :, h:h + 1]
        sync()

    res = time_interleaved({"floor": floor, "lorsa": ours, "algorithm1_slice": algorithm1_slice},
                           repeats=args.repeats)
    ratio = res["lorsa"]["median_s"] / res["floor"]["median_s"]
    algo1_full = res["algorithm1_slice"]["median_s"] * n_ov / heads
    rows = [("floor (SDPA + projections)", f"{res['floor']['median_s'] * 1e3:.1f}", "1.00"),
            ("Lorsa.forward", f"{res['lorsa']['median_s'] * 1e3:.1f}", f"{ratio:.2f}"),
            (f"Algorithm 1, all heads (from {heads})", f"{algo1_full * 1e3:.0f}",
             f"{algo1_full / res['floor']['median_s']:.1f}")]
    print(f"Lorsa forward, d_model {d}, {n_qk}x{e} QK, {n_ov} OV heads, top_k {k}, batch {b}x{s}, "
          f"{args.device} {args.dtype}")
    print(table(rows, ("variant", "median ms", "x floor")))
    print(f"target: Lorsa <= 1.5x floor -> {'PASS' if ratio <= 1.5 else 'FAIL'} ({ratio:.2f}x)")
    path = write(f"lorsa_forward_{args.device}_{args.dtype}", {
        "shapes": {"d_model": d, "n_qk_heads": n_qk, "d_qk_head": e, "n_ov_heads": n_ov, "top_k": k,
                   "batch": b, "seq": s}, "timings": res, "ratio_vs_floor": ratio,
        "algorithm1_extrapolated_s": algo1_full, "target": 1.5})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
