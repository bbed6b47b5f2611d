"""Where the Lorsa forward's time goes at the Llama-3.1-8B shape, and which kernel choice is fastest per stage.

Issue 21 (a): the Lorsa forward ran at 2.04x its floor on an H200. This times each stage's alternatives on
the same input, checks each against the module's own stage (max |diff| relative to max |ref|), and writes
the per-stage medians, so the module's choices rest on a measurement:

* QK projection: the fused ``(d_model, 2·n_qk·d_qk)`` weight built by ``cat`` + ``permute`` on every call
  (537 MB copied per call at the 8B shape) vs a batched matmul over the QK heads on the stored
  ``(n_qk, d_model, d_qk)`` weights (no copy);
* top-k: ``topk(k, sorted=False)`` over all OV heads vs an exact two-stage top-k (top-k per chunk of heads,
  then top-k of the candidates);
* decode: scatter into a dense ``(pos, n_ov)`` z and one dense matmul vs ``embedding_bag`` over the k
  active heads' ``w_o`` rows;
* RoPE on the queries: the module's ``apply_rotary`` (three strided kernels on each half of every head) vs
  each pair swapped over the whole head (mul, flip, mul, add), bit-identical. On 2 CPU cores the swap is
  0.5-1.7x the module's time depending on the shape (bf16, 4M elements): it is kept here, not in the module,
  until a GPU measures it (the module's RoPE is ~1.6 ms at the 8B shape on an H200, ~15x its bytes' time).

The forward is also profiled (``forward_kernels``: the top operators by device time per call, ``torch.profiler``),
so that what is left above the floor can be read kernel by kernel.

    python -m benchmarks.lorsa_forward_variants                          # 8B shape on cuda
    python -m benchmarks.lorsa_forward_variants --scale tiny --device cpu --dtype float32
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from benchmarks._timing import RESULTS, arg, parser, profile_table, start, time_interleaved, write_json
from benchmarks.gpu_scale import SCALES, build, paper_lorsa, sync
from nnsight_lorsa import get_adapter
from nnsight_lorsa.modules.rotary import apply_rotary, rotary_cos_sin


def rope_pair_swap(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A candidate for ``apply_rotary`` (half-split, full rotary, no autograd): each (x1, x2) pair swapped over
    the whole head by one ``flip`` of the ``(2, half)`` view, times sin with rotate_half's signs, plus
    ``x·cos`` — four whole-width kernels instead of the module's three strided ones on each half. Same
    roundings as transformers' ``x·cos + rotate_half(x)·sin`` (``-(x2·s)`` rounds as ``-x2·s``): bit-identical."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = cos.shape[-1] // 2
    pairs = sin.view(*sin.shape[:-1], 2, half)
    sin_signed = torch.stack((-pairs[..., 0, :], pairs[..., 1, :]), -2)
    swapped = x.reshape(*x.shape[:-1], 2, half).flip(-2)
    return torch.mul(x, cos).add_(swapped.mul_(sin_signed).flatten(-2))


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x·cos + rotate_half(x)·sin`` (half-split, full rotary), the compiled candidate's source."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def main() -> None:
    args = parser(__doc__, scale=arg("8b", choices=sorted(SCALES)), device="cuda", dtype="bfloat16", seq=2048,
                  repeats=7, chunks=16, out=arg(None, type=str)).parse_args()
    start(args)
    s, dev, dt = SCALES[args.scale], torch.device(args.device), getattr(torch, args.dtype)
    model, hf = build(s, dev, dt)
    lorsa = paper_lorsa(s, get_adapter(model), hf, s["layer"], dev, dt)
    cfg = lorsa.cfg
    h, e, k_top = cfg.n_qk_heads, cfg.d_qk_head, cfg.top_k
    seq = min(args.seq, s["train_seq"]) if args.scale == "tiny" else args.seq
    x = torch.randn(1, seq, s["d_model"], device=dev, dtype=dt)
    x2 = x.reshape(seq, -1)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    out: dict[str, Any] = {"scale": args.scale, "device": name, "dtype": args.dtype, "torch": torch.__version__,
                           "seq": seq, "shapes": {"n_qk": h, "d_qk": e, "n_ov": cfg.n_ov_heads, "top_k": k_top}}
    W_Q, W_K, b_Q, b_K, W_O = (p.detach() for p in (lorsa.W_Q, lorsa.W_K, lorsa.b_Q, lorsa.b_K, lorsa.W_O))

    with torch.no_grad():
        # ---- QK projection (+ RoPE, as the module does)
        def qk_bmm() -> tuple[torch.Tensor, torch.Tensor]:
            q = torch.baddbmm(b_Q[:, None, :], x2.expand(h, -1, -1), W_Q)  # (n_qk, pos, d_qk)
            k = torch.baddbmm(b_K[:, None, :], x2.expand(h, -1, -1), W_K)
            q, k = q[None], k[None]
            if cfg.rotary is not None:
                cos, sin = rotary_cos_sin(cfg.rotary, torch.arange(seq, device=dev))
                q = apply_rotary(q, cos, sin, cfg.rotary.interleaved)
                k = apply_rotary(k, cos, sin, cfg.rotary.interleaved)
            return q, k

        def qk_proj_only_cat() -> torch.Tensor:
            w = torch.cat([W_Q, W_K], 0).permute(1, 0, 2).reshape(x2.shape[1], 2 * h * e)
            return torch.addmm(torch.cat([b_Q, b_K], 0).reshape(-1), x2, w)

        def qk_proj_only_bmm() -> torch.Tensor:
            return torch.baddbmm(b_Q[:, None, :], x2.expand(h, -1, -1), W_Q)

        q_ref, k_ref = lorsa.qk(x)
        q_b, k_b = qk_bmm()
        out["qk_bmm_rel_diff"] = max(rel(q_b, q_ref), rel(k_b, k_ref))

        # ---- RoPE on the queries (heads-first, as Lorsa.qk lays them out)
        q_heads = qk_proj_only_bmm()[None]
        if cfg.rotary is not None:
            cos_q, sin_q = rotary_cos_sin(cfg.rotary, torch.arange(seq, device=dev))
            if not cfg.rotary.interleaved and cfg.rotary.rotary_dim == e:
                out["rope_same_bits"] = bool(torch.equal(apply_rotary(q_heads, cos_q, sin_q),
                                                         rope_pair_swap(q_heads, cos_q, sin_q)))
                rope_variants = {"rope_module": lambda: apply_rotary(q_heads, cos_q, sin_q),
                                 "rope_pair_swap": lambda: rope_pair_swap(q_heads, cos_q, sin_q),
                                 "rope_3d": lambda: apply_rotary(q_heads[0], cos_q, sin_q)}
                # the projection split into the halves of each head: two bmms on the weights' column halves give
                # contiguous (n_qk, pos, d/2) halves, so RoPE's kernels read contiguous operands
                half = e // 2

                def qk_proj_halves() -> tuple[torch.Tensor, torch.Tensor]:
                    xs = x2.expand(h, -1, -1)
                    return (torch.baddbmm(b_Q[:, None, :half], xs, W_Q[..., :half]),
                            torch.baddbmm(b_Q[:, None, half:], xs, W_Q[..., half:]))

                q1, q2 = qk_proj_halves()
                ch, sh = cos_q[..., :half].to(dt), sin_q[..., :half].to(dt)

                def rope_from_halves() -> torch.Tensor:
                    o = torch.empty(h, seq, e, device=dev, dtype=dt)
                    torch.mul(q1, ch, out=o[..., :half]).sub_(q2 * sh)
                    torch.mul(q2, ch, out=o[..., half:]).add_(q1 * sh)
                    return o

                out["rope_halves_same_bits"] = bool(torch.equal(rope_from_halves(), apply_rotary(q_heads, cos_q,
                                                                                                 sin_q)[0]))
                rope_variants |= {"qk_proj_halves": qk_proj_halves, "rope_from_halves": rope_from_halves}
                # what one fused kernel costs (inductor, rounding each product as eager does): the bound on RoPE
                try:
                    import torch._inductor.config as inductor_config

                    compiled = torch.compile(rope_reference, dynamic=False,
                                             options={"emulate_precision_casts": True})
                    out["rope_compiled_same_bits"] = bool(torch.equal(compiled(q_heads, cos_q, sin_q),
                                                                      apply_rotary(q_heads, cos_q, sin_q)))
                    out["rope_compiled_inductor"] = hasattr(inductor_config, "emulate_precision_casts")
                    rope_variants["rope_compiled"] = lambda: compiled(q_heads, cos_q, sin_q)
                except Exception as err:  # no triton / no compiler on this machine: recorded, not fatal
                    out["rope_compiled_error"] = f"{type(err).__name__}: {err}"[:300]
            else:
                rope_variants = {"rope_module": lambda: apply_rotary(q_heads, cos_q, sin_q, cfg.rotary.interleaved)}
        else:
            rope_variants = {}

        # ---- top-k
        z_pre = lorsa.compute_z_pre(x)
        zp2 = z_pre.reshape(seq, -1)

        def topk_flat() -> tuple[torch.Tensor, torch.Tensor]:
            return zp2.topk(k_top, dim=-1, sorted=False)

        n_ov = zp2.shape[1]
        c = args.chunks if n_ov % args.chunks == 0 and n_ov // args.chunks >= k_top else 1

        def topk_two_stage() -> tuple[torch.Tensor, torch.Tensor]:
            v1, i1 = zp2.view(seq, c, n_ov // c).topk(k_top, dim=-1, sorted=False)
            i1 = i1 + (torch.arange(c, device=dev) * (n_ov // c))[None, :, None]
            v2, j = v1.reshape(seq, -1).topk(k_top, dim=-1, sorted=False)
            return v2, i1.reshape(seq, -1).gather(-1, j)

        va, _ = topk_flat()
        vb, ib = topk_two_stage()
        out["topk_two_stage_chunks"] = c
        out["topk_two_stage_same_values"] = bool(torch.equal(va.sort(-1).values, vb.sort(-1).values))
        out["topk_two_stage_indices_match_values"] = bool(torch.equal(zp2.gather(-1, ib), vb))

        # ---- decode
        vals, idx = topk_flat()
        relu = vals.relu()

        def decode_dense() -> torch.Tensor:
            z = torch.zeros_like(zp2).scatter(-1, idx, relu)
            return torch.addmm(lorsa.b_D.detach(), z, W_O) if lorsa.b_D is not None else z @ W_O

        def decode_bag() -> torch.Tensor:
            o = F.embedding_bag(idx, W_O, per_sample_weights=relu, mode="sum")
            return o + lorsa.b_D.detach() if lorsa.b_D is not None else o

        out["decode_bag_rel_diff"] = rel(decode_bag(), decode_dense())

        def timed(fn: Any) -> Any:
            def run() -> None:
                fn()
                sync(dev)
            return run

        variants = {"forward": lambda: lorsa(x), "qk_module": lambda: lorsa.qk(x), "qk_bmm": qk_bmm,
                    "qk_proj_cat": qk_proj_only_cat, "qk_proj_bmm": qk_proj_only_bmm,
                    "values": lambda: lorsa.values(x), "z_pre": lambda: lorsa.compute_z_pre(x),
                    "topk_flat": topk_flat, "topk_two_stage": topk_two_stage,
                    "activation_module": lambda: lorsa.activation(z_pre),
                    "decode_dense": decode_dense, "decode_bag": decode_bag, **rope_variants}
        out["times"] = time_interleaved({k: timed(v) for k, v in variants.items()}, repeats=args.repeats)
        out["forward_kernels"] = profile_table(lambda: lorsa(x), dev)["device" if dev.type == "cuda" else "cpu"]
    for k, v in out["times"].items():
        print(f"{k:20s} {v['median_s'] * 1e3:8.3f} ms")
    print({k: v for k, v in out.items() if k not in ("times", "shapes")})
    safe = "".join(ch if ch.isalnum() else "_" for ch in name)
    write_json(args.out or RESULTS / f"lorsa_forward_variants_{args.scale}_{safe}.json", out)


if __name__ == "__main__":
    main()
