"""Gated attention (paper 003, Eq. 2) vs the model's ordinary attention: forward and forward+backward.

Same shapes for all: one Llama attention module (d_model 768, 12 heads x 64, GQA 12/4), batch 4 x 256
tokens, called through the module itself with attention implementation ``eager``, ``sdpa`` and the
gated function (training mode: straight-through sampling, and eval mode: deterministic gate). Medians
of interleaved repeats. Memory: the bytes autograd saves for the backward pass (distinct storages,
counted with ``torch.autograd.graph.saved_tensors_hooks``), i.e. the activation memory of training.

    python -m benchmarks.bench_gated_attention [--batch 4] [--seq 256]
"""

from __future__ import annotations

import torch

from benchmarks._timing import parser, start, table, time_interleaved, write


def saved_bytes(fn) -> int:
    """Bytes of the distinct tensors autograd saves for backward during ``fn()`` (activation memory)."""
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def main() -> None:
    args = parser(__doc__, batch=4, seq=256, repeats=7, threads=1).parse_args()
    start(args)
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    from nnsight_lorsa.modules.attention_gate import AttentionGate
    from nnsight_lorsa.sparse_attention.attention import ATTN_IMPLEMENTATION, register_gated_attention

    register_gated_attention()
    cfg = LlamaConfig(hidden_size=768, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                      intermediate_size=2048, num_hidden_layers=1, vocab_size=128)
    attn = LlamaAttention(cfg, layer_idx=0)
    attn.add_module("gate", AttentionGate(12, init_bias=2.0))
    b, s = args.batch, args.seq
    x = torch.randn(b, s, 768, requires_grad=True)
    pos = torch.arange(s)[None].expand(b, s)
    cos_sin = LlamaRotaryEmbedding(cfg)(x, pos)
    causal = torch.full((s, s), torch.finfo(torch.float32).min).triu(1)[None, None].expand(b, 1, s, s)
    bool_causal = torch.ones(s, s, dtype=torch.bool).tril()[None, None].expand(b, 1, s, s)
    masks = {"eager": causal, "sdpa": bool_causal, ATTN_IMPLEMENTATION: causal}

    def run(impl: str, training: bool, backward: bool):
        def fn() -> None:
            cfg._attn_implementation = impl
            attn.train(training)
            if backward:
                out = attn(x, position_embeddings=cos_sin, attention_mask=masks[impl])[0]
                out.sum().backward()
                x.grad = None
                attn.zero_grad(set_to_none=True)
            else:
                with torch.no_grad():
                    attn(x, position_embeddings=cos_sin, attention_mask=masks[impl])
        return fn

    variants = {
        "eager": ("eager", False), "sdpa": ("sdpa", False),
        "gated_eval": (ATTN_IMPLEMENTATION, False), "gated_train": (ATTN_IMPLEMENTATION, True),
    }
    results = {}
    for mode, backward in (("forward", False), ("forward_backward", True)):
        fns = {name: run(impl, tr, backward) for name, (impl, tr) in variants.items()}
        res = time_interleaved(fns, repeats=args.repeats)
        for name, fn in fns.items():
            res[name]["saved_for_backward_bytes"] = saved_bytes(fn) if backward else 0
        results[mode] = res
    rows = []
    for mode, res in results.items():
        for name, r in res.items():
            t = r["median_s"]
            rows.append((mode, name, f"{t * 1e3:.1f}", f"{t / res['eager']['median_s']:.2f}",
                         f"{t / res['sdpa']['median_s']:.2f}", f"{r['saved_for_backward_bytes'] / 2**20:.1f}"))
    print(f"Llama attention d_model 768, 12 heads (4 KV) x 64, batch {b} x {s}, CPU fp32, {args.threads} thread(s)")
    print(table(rows, ("pass", "variant", "median ms", "x eager", "x sdpa", "saved MiB")))
    path = write("gated_attention_cpu", {"shapes": {"batch": b, "seq": s, "d_model": 768, "heads": 12,
                                                     "kv_heads": 4, "head_dim": 64}, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
