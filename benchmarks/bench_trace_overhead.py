"""Trace overhead: ``lorsa.replace`` inside ``model.trace`` vs the same splice as a PyTorch hook.

Same model, same inputs, same Lorsa: (a) a plain forward of the Hugging Face model with a
forward hook on the attention that returns the Lorsa output; (b) ``with model.trace(ids):
lorsa.replace(layer=L); logits = model.lm_head.output.save()``. Also (c) an nnsight trace that
only saves the logits vs a plain forward, to separate nnsight's own per-trace cost.

    python -m benchmarks.bench_trace_overhead [--d-model 768] [--seq 256]
"""

from __future__ import annotations

import warnings

import nnsight
import torch
import transformers

from benchmarks._timing import parser, start, table, time_interleaved, write
from benchmarks.reference.tokenizer import tiny_tokenizer
from nnsight_lorsa import Lorsa, LorsaConfig, LorsaSet, get_adapter


def main() -> None:
    args = parser(__doc__, d_model=768, layers=4, seq=256, batch=4, n_ov=6144, repeats=9).parse_args()
    start(args)
    d, heads = args.d_model, args.d_model // 64
    cfg = transformers.LlamaConfig(hidden_size=d, num_attention_heads=heads, num_key_value_heads=heads,
                                   num_hidden_layers=args.layers, intermediate_size=4 * d, vocab_size=4096,
                                   max_position_embeddings=2048)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nnsight.TransformersModel(hf, task="text-generation", tokenizer=tiny_tokenizer(), device="cpu")
    adapter = get_adapter(model)
    layer = args.layers // 2
    w = adapter.mhsa_weights(hf, layer)
    lorsa = Lorsa(LorsaConfig(d_model=d, n_qk_heads=4 * heads, d_qk_head=64, n_ov_heads=args.n_ov, top_k=64,
                              rotary=w.rotary, layer=layer))
    lorsa.init_from_mhsa(w)
    lorsas = LorsaSet(model, {layer: lorsa})
    ids = torch.randint(0, 4096, (args.batch, args.seq))
    attn = adapter.attention_module(hf, layer)

    def hook(module, a, kw, output):
        x = adapter.attention_input(a, kw)
        return adapter.with_attention_output(output, lorsa(x, adapter.attention_positions(a, kw, x)))

    @torch.no_grad()
    def hooked() -> torch.Tensor:
        h = attn.register_forward_hook(hook, with_kwargs=True)
        try:
            return hf(ids, use_cache=False).logits
        finally:
            h.remove()

    @torch.no_grad()
    def traced() -> torch.Tensor:
        with model.trace(ids, use_cache=False):
            lorsas.replace(layer=layer)
            logits = nnsight.save(model.lm_head.output)
        return logits

    @torch.no_grad()
    def plain() -> torch.Tensor:
        return hf(ids, use_cache=False).logits

    @torch.no_grad()
    def plain_trace() -> torch.Tensor:
        with model.trace(ids, use_cache=False):
            logits = nnsight.save(model.lm_head.output)
        return logits

    assert (hooked() - traced()).abs().max() < 1e-4  # same computation
    res = time_interleaved({"hook": hooked, "trace_replace": traced, "forward": plain, "trace": plain_trace},
                           repeats=args.repeats)
    r_replace = res["trace_replace"]["median_s"] / res["hook"]["median_s"]
    r_trace = res["trace"]["median_s"] / res["forward"]["median_s"]
    ms = lambda k: f"{res[k]['median_s'] * 1e3:.1f}"
    rows = [("forward + PyTorch hook splice", ms("hook"), "1.00"),
            ("model.trace + lorsa.replace", ms("trace_replace"), f"{r_replace:.3f}"),
            ("plain forward", ms("forward"), "1.00"),
            ("model.trace (save logits only)", ms("trace"), f"{r_trace:.3f}")]
    print(f"Llama d_model {d}, {args.layers} layers, batch {args.batch}x{args.seq}; Lorsa {args.n_ov} heads at "
          f"layer {layer}; {torch.get_num_threads()} threads")
    print(table(rows, ("variant", "median ms", "ratio")))
    print(f"target: replace-in-trace <= 1.3x hook -> {'PASS' if r_replace <= 1.3 else 'FAIL'} ({r_replace:.3f}x)")
    path = write("trace_overhead", {"args": vars(args), "timings": res, "ratio_replace_vs_hook": r_replace,
                                    "ratio_trace_vs_forward": r_trace, "target": 1.3})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
