"""TopK transcoder: the sparse training path vs the dense reference, forward and forward+backward.

d_model 768, 24576 features, k 64, 4096 tokens, fp32 (issue 3). In the same run (interleaved
repeats, medians):

* dense reference — ``relu(x W_enc + b_enc)`` → ``topk`` → scatter into a dense ``(n, d_sae)``
  matrix → ``@ W_dec + b_dec``; autograd through all of it;
* ours — ``Transcoder.encode_sparse`` + ``decode_sparse`` (:mod:`nnsight_lorsa.modules.sparse_decode`):
  the same dense encoder matmul and ``topk``, then an ``embedding_bag`` decode, with backward
  passes that touch only the ``k`` selected features per token;
* decode alone — dense ``acts @ W_dec`` vs ``embedding_bag`` for the same selection.

Forward-only timings run under ``torch.no_grad``; forward+backward times the MSE to a random
target and ``backward()`` into ``W_enc, b_enc, W_dec, b_dec`` (the input needs no gradient, as
in training). Both variants are also checked for equal outputs and gradients.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_topk_transcoder --threads 1
"""

from __future__ import annotations

import torch

from benchmarks._timing import command, parser, start, table, time_interleaved, write
from nnsight_lorsa.modules.sparse_decode import SparseActs, sparse_decode, topk_indices
from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig


def main() -> None:
    args = parser(__doc__, threads=1, d_model=768, d_sae=24576, k=64, tokens=4096, repeats=7, warmup=1).parse_args()
    start(args)
    d, f, k, n = args.d_model, args.d_sae, args.k, args.tokens
    tc = Transcoder(TranscoderConfig(d_in=d, d_sae=f, activation="topk", activation_params={"k": k}))
    with torch.no_grad():
        tc.b_enc.normal_(0, 0.1)
        tc.b_dec.normal_(0, 0.1)
    params = [tc.W_enc, tc.b_enc, tc.W_dec, tc.b_dec]
    x = torch.randn(n, d)
    y = torch.randn(n, d)

    def dense_forward() -> torch.Tensor:
        pre = torch.addmm(tc.b_enc, x, tc.W_enc).relu()
        vals, idx = pre.topk(k, dim=-1, sorted=False)
        acts = torch.zeros_like(pre).scatter(-1, idx, vals)
        return torch.addmm(tc.b_dec, acts, tc.W_dec)

    def ours_forward() -> torch.Tensor:
        _, acts = tc.encode_sparse(x)
        return tc.decode_sparse(acts)

    def backward(fn):
        def run() -> None:
            for p in params:
                p.grad = None
            (fn() - y).pow(2).sum(-1).mean().backward()
        return run

    def no_grad(fn):
        def run() -> None:
            with torch.no_grad():
                fn()
        return run

    # correctness in the same run
    outs, grads = [], []
    for fn in (dense_forward, ours_forward):
        backward(fn)()
        grads.append([p.grad.clone() for p in params])
        with torch.no_grad():
            outs.append(fn())
    check = {"max_abs_out_diff": float((outs[0] - outs[1]).abs().max()),
             "max_abs_grad_diff": {name: float((a - b).abs().max()) for name, a, b in
                                   zip(("W_enc", "b_enc", "W_dec", "b_dec"), grads[0], grads[1], strict=True)},
             "max_abs_grad": {name: float(a.abs().max()) for name, a in
                              zip(("W_enc", "b_enc", "W_dec", "b_dec"), grads[0], strict=True)}}
    del outs, grads

    # decode alone, on one fixed selection
    with torch.no_grad():
        pre = torch.addmm(tc.b_enc, x, tc.W_enc)
        rows, cols, offsets = topk_indices(pre, k)
        sel_vals = pre[rows, cols].relu()
        del pre
    vals = sel_vals.clone().requires_grad_(True)
    W_dec = tc.W_dec

    def dense_decode() -> torch.Tensor:
        acts = torch.zeros(n, f).index_put((rows, cols), vals)
        return acts @ W_dec

    def sparse_dec() -> torch.Tensor:
        return sparse_decode(SparseActs(rows=rows, cols=cols, vals=vals, offsets=offsets, d_sae=f), W_dec)

    def decode_backward(fn):
        def run() -> None:
            vals.grad = W_dec.grad = None
            (fn() - y).pow(2).sum(-1).mean().backward()
        return run

    print(f"threads {torch.get_num_threads()}; d_model {d}, d_sae {f}, k {k}, tokens {n}; "
          f"{args.repeats} interleaved repeats", flush=True)
    timings = {
        "forward": time_interleaved({"dense": no_grad(dense_forward), "ours": no_grad(ours_forward)},
                                    args.repeats, args.warmup),
        "forward_backward": time_interleaved({"dense": backward(dense_forward), "ours": backward(ours_forward)},
                                             args.repeats, args.warmup),
        "decode_forward": time_interleaved({"dense": no_grad(dense_decode), "ours": no_grad(sparse_dec)},
                                           args.repeats, args.warmup),
        "decode_forward_backward": time_interleaved({"dense": decode_backward(dense_decode),
                                                     "ours": decode_backward(sparse_dec)},
                                                    args.repeats, args.warmup),
    }
    rows_out, ratios, ratios_min = [], {}, {}
    for what, t in timings.items():
        ratios[what] = t["dense"]["median_s"] / t["ours"]["median_s"]
        ratios_min[what] = t["dense"]["min_s"] / t["ours"]["min_s"]
        rows_out.append((what, f"{1e3 * t['dense']['median_s']:.1f}", f"{1e3 * t['ours']['median_s']:.1f}",
                         f"{ratios[what]:.2f}", f"{1e3 * t['dense']['min_s']:.1f}", f"{1e3 * t['ours']['min_s']:.1f}",
                         f"{ratios_min[what]:.2f}"))
    print(table(rows_out, ("what", "dense median ms", "ours median ms", "ratio", "dense min ms", "ours min ms",
                           "ratio (min)")))
    print(f"max |out diff| {check['max_abs_out_diff']:.2e}; max |grad diff| {check['max_abs_grad_diff']}")
    path = write(f"topk_transcoder_cpu_threads{args.threads}", {
        "command": command("OMP_NUM_THREADS=1"),
        "shape": {"d_model": d, "d_sae": f, "k": k, "tokens": n, "dtype": "float32"},
        "timings": timings, "speedup_dense_over_ours": ratios, "speedup_dense_over_ours_min": ratios_min,
        "check": check,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
