"""Frozen attention under an intervention: its cost against its floor, and its result against the floor's.

The floor is what frozen attention needs at least: two forward passes of the Hugging Face model, one recording
every attention pattern on the unedited prompt and one holding them under the edit (``eager_attention_forward``
replaced by a pattern-holding one, the edit an MHSA head zeroed by a forward pre-hook on ``o_proj``). Ours:
``record = freeze_attention(rm, ids)`` (one trace) and a trace with ``rm.prepare([head], frozen=record)`` and
``ablate(rm(head), positions=...)``; beside it the same edit unfrozen (one trace). Also checked: ours equals the
floor's logits (relative to max |logit|).

    python -m benchmarks.frozen_attention [--d-model 512] [--layers 8] [--seq 128] [--batch 2]
"""

from __future__ import annotations

import importlib
import warnings

import nnsight
import torch
import transformers

from benchmarks._timing import parser, start, table, time_interleaved, write
from benchmarks.reference.tokenizer import tiny_tokenizer
from nnsight_lorsa import ReplacementModel, get_adapter
from nnsight_lorsa.patching import MHSAHead, ablate, freeze_attention


def main() -> None:
    args = parser(__doc__, d_model=512, layers=8, seq=128, batch=2, repeats=7).parse_args()
    start(args)
    d, heads = args.d_model, args.d_model // 64
    cfg = transformers.LlamaConfig(hidden_size=d, num_attention_heads=heads, num_key_value_heads=heads // 4,
                                   num_hidden_layers=args.layers, intermediate_size=4 * d, vocab_size=4096,
                                   max_position_embeddings=2048, initializer_range=0.05)
    cfg._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nnsight.TransformersModel(hf, task="text-generation", tokenizer=tiny_tokenizer(), device="cpu")
    adapter = get_adapter(model)
    rm = ReplacementModel(model)
    ids = torch.randint(0, 4096, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    head, pos = MHSAHead(0, 1), args.seq // 2

    @torch.no_grad()
    def unfrozen() -> torch.Tensor:
        with model.trace(ids, use_cache=False):
            rm.prepare([head])
            ablate(rm(head), positions=[pos])
            logits = nnsight.save(model.lm_head.output)
        return logits

    @torch.no_grad()
    def frozen() -> torch.Tensor:
        record = freeze_attention(rm, ids)
        with model.trace(ids, use_cache=False):
            rm.prepare([head], frozen=record)
            ablate(rm(head), positions=[pos])
            logits = nnsight.save(model.lm_head.output)
        return logits

    arch = importlib.import_module(type(hf).__module__)
    original = arch.eager_attention_forward
    held: dict = {}
    state = {"record": True}

    def holding(module, query, key, value, attention_mask, *a, **kw):  # type: ignore[no-untyped-def]
        if state["record"]:
            out, w = original(module, query, key, value, attention_mask, *a, **kw)
            held[id(module)] = w
            return out, w
        w = held[id(module)]
        return torch.matmul(w, arch.repeat_kv(value, module.num_key_value_groups)).transpose(1, 2).contiguous(), w

    proj = adapter.attention_module(hf, head.layer).o_proj
    e = adapter.head_dim

    def zero_head(module, a):  # type: ignore[no-untyped-def]
        if not state["record"]:
            z = a[0].clone()
            z[:, pos, head.head * e:(head.head + 1) * e] = 0
            return (z, *a[1:])

    @torch.no_grad()
    def floor() -> torch.Tensor:
        arch.eager_attention_forward = holding
        h = proj.register_forward_pre_hook(zero_head)
        try:
            state["record"] = True
            hf(ids, use_cache=False)
            state["record"] = False
            return hf(ids, use_cache=False).logits
        finally:
            h.remove()
            arch.eager_attention_forward = original

    want, got, free = floor(), frozen(), unfrozen()
    scale = float(want.abs().max())
    rel = float((got - want).abs().max()) / scale
    rel_free = float((free - want).abs().max()) / scale
    res = time_interleaved({"floor": floor, "frozen": frozen, "unfrozen": unfrozen}, repeats=args.repeats)
    ratio = res["frozen"]["median_s"] / res["floor"]["median_s"]
    ms = lambda k: f"{res[k]['median_s'] * 1e3:.1f}"
    rows = [("floor: HF record + pattern-holding edited forward", ms("floor"), "1.00"),
            ("ours: freeze_attention + frozen edited trace", ms("frozen"), f"{ratio:.2f}"),
            ("ours unfrozen: one edited trace", ms("unfrozen"),
             f"{res['unfrozen']['median_s'] / res['floor']['median_s']:.2f}")]
    print(f"Llama d_model {d}, {args.layers} layers, GQA {heads}/{heads // 4}, batch {args.batch}x{args.seq}; "
          f"{torch.get_num_threads()} threads")
    print(table(rows, ("variant", "median ms", "x floor")))
    print(f"logits vs the floor's: frozen {rel:.2e}, unfrozen {rel_free:.2e} of max |logit|")
    path = write("frozen_attention", {"args": vars(args), "timings": res, "ratio_frozen_vs_floor": ratio,
                                      "frozen_vs_floor_rel": rel, "unfrozen_vs_floor_rel": rel_free})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
