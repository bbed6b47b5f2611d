"""Cost of the inf / NaN check of an fp16 replacement's output (``splice_chain.check_overflow``).

An fp16 replacement's output is read once per replaced site before it enters the model (one ``isfinite().all()``
reduction over ``(batch, pos, d_model)`` and one value read back: a device sync); bf16 / fp32 replacements are
not read. Measured: (a) the check alone on an fp16 ``(tokens, d_model)`` output, for a few sizes, vs the forward of
an SAE (``expansion`` x ``d_model`` latents) on the same input in fp32 (the cheaper bound on a CPU, where fp16
matmuls are several times slower than fp32 ones; on a GPU the sync, not the reduction, is the check's cost);
(b) a ``model.trace`` of an fp16 random Llama with an fp16 SAE on every layer's output (``error`` off and on),
with the check vs with it replaced by a no-op (interleaved medians).

    python -m benchmarks.bench_fp16_output_check [--sizes 512x512 2048x1024] [--d-model 256] [--seq 64]
"""

from __future__ import annotations

import warnings

import nnsight
import torch
import transformers

from benchmarks._timing import arg, parser, start, table, time_interleaved, write
from benchmarks.reference.tokenizer import tiny_tokenizer
from nnsight_lorsa import ReplacementModel, SAESet
from nnsight_lorsa._placement import overflowed
from nnsight_lorsa.envoy import splice_chain
from nnsight_lorsa.modules import SAEConfig, SparseAutoencoder


def check_vs_forward(tokens: int, d: int, expansion: int, dev: torch.device, repeats: int) -> dict:
    """(a): the check on an fp16 ``(tokens, d)`` output vs an fp32 SAE forward of that shape."""
    sae = SparseAutoencoder(SAEConfig(d_in=d, d_sae=expansion * d, activation="relu")).to(dev)
    x = torch.randn(tokens, d, device=dev)
    out = x.half()

    def check() -> None:
        overflowed(out)

    @torch.no_grad()
    def forward() -> None:
        sae(x)
        if dev.type == "cuda":
            torch.cuda.synchronize()

    res = time_interleaved({"check": check, "sae_forward_fp32": forward}, repeats=repeats)
    return {"tokens": tokens, "d_model": d, **res,
            "ratio": res["check"]["median_s"] / res["sae_forward_fp32"]["median_s"],
            "ns_per_element": res["check"]["median_s"] * 1e9 / (tokens * d)}


def main() -> None:
    args = parser(__doc__, sizes=arg(["512x512", "2048x1024", "4096x2048"], nargs="+"), d_model=256, layers=4,
                  seq=64, batch=2, expansion=4, repeats=7, threads=1, device="cpu").parse_args()
    start(args)
    dev, half = torch.device(args.device), torch.float16
    alone = [check_vs_forward(*map(int, size.split("x")), args.expansion, dev, args.repeats) for size in args.sizes]
    d = args.d_model
    cfg = transformers.LlamaConfig(hidden_size=d, num_attention_heads=d // 64, num_key_value_heads=d // 64,
                                   num_hidden_layers=args.layers, intermediate_size=4 * d, vocab_size=4096,
                                   max_position_embeddings=2048)
    hf = transformers.LlamaForCausalLM(cfg).eval().to(dev, half)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nnsight.TransformersModel(hf, task="text-generation", tokenizer=tiny_tokenizer(), device=args.device)
    saes = {f"model.layers.{i}": SparseAutoencoder(SAEConfig(d_in=d, d_sae=args.expansion * d, activation="relu"))
            .to(dev, half) for i in range(args.layers)}
    ids = torch.randint(0, 4096, (args.batch, args.seq), device=dev)

    def traced(error: bool) -> torch.Tensor:
        rm = ReplacementModel(model, saes=SAESet(model, saes), error=error)
        with torch.no_grad(), model.trace(ids, use_cache=False):
            rm.replace()
            logits = nnsight.save(model.lm_head.output)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return logits

    real = splice_chain.check_overflow

    def without(error: bool) -> torch.Tensor:
        splice_chain.check_overflow = lambda *a: None
        try:
            return traced(error)
        finally:
            splice_chain.check_overflow = real

    fns = {"trace_checked": lambda: traced(False), "trace_unchecked": lambda: without(False),
           "trace_error_checked": lambda: traced(True), "trace_error_unchecked": lambda: without(True)}
    assert torch.equal(traced(True), without(True))  # the check changes nothing where nothing overflows
    res = time_interleaved(fns, repeats=args.repeats)
    ms = lambda k: res[k]["median_s"] * 1e3
    rows = [(f"check alone, {a['tokens']} x {a['d_model']}", f"{a['check']['median_s'] * 1e3:.3f}",
             f"{a['ratio']:.4f} of an fp32 SAE forward ({a['sae_forward_fp32']['median_s'] * 1e3:.1f} ms); "
             f"{a['ns_per_element']:.2f} ns/element") for a in alone]
    ratios = {}
    for error in (False, True):
        tag = "trace_error" if error else "trace"
        ratios[tag] = ms(f"{tag}_checked") / ms(f"{tag}_unchecked")
        rows += [(f"trace, {args.layers} fp16 SAEs, error={error}, checked", f"{ms(f'{tag}_checked'):.1f}",
                  f"{ratios[tag]:.4f}"),
                 (f"trace, {args.layers} fp16 SAEs, error={error}, no check", f"{ms(f'{tag}_unchecked'):.1f}",
                  "1.0000")]
    print(f"check sizes {args.sizes}; fp16 Llama d_model {d}, {args.layers} layers, batch {args.batch}x{args.seq}, "
          f"SAEs {args.expansion}x; {args.device}, {torch.get_num_threads()} threads")
    print(table(rows, ("variant", "median ms", "ratio")))
    path = write(f"fp16_output_check_{dev.type}", {"args": vars(args), "check_alone": alone, "timings": res,
                                                    "ratios": ratios})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
