"""A Lorsa spliced with ``error=True`` and read in the trace: FLOPs and CPU time of one trace with the two passes'
q, k, v (and z_pre) shared (``modules.sparse_coder.share_encoder_matmul``) and without (the former computation).

The embedded tinyshakespeare Llama (d_model 128) with a bigger random Lorsa at layer 1 (``--qk-per-head`` QK heads
per MHSA head, ``--n-ov`` OV heads, top-k ``--top-k``), ``--batch`` × ``--seq`` random tokens, ``hook_z`` read (the
splice then runs the clean pass apart, then the live one). FLOPs: ``torch.utils.flop_counter.FlopCounterMode`` over
one trace; time: medians of ``--repeats`` traces, the two variants interleaved. docs/nnsight.md cites the result.

    OMP_NUM_THREADS=1 python -m benchmarks.splice_lorsa_two_passes
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks._timing import command, embedded, parser, start, time_interleaved, write


def main() -> None:
    args = parser(__doc__, threads=1, repeats=7, batch=4, seq=64, n_ov=8192, top_k=64, qk_per_head=16,
                  layer=1).parse_args()
    start(args)
    import nnsight_lorsa.envoy.splice_chain as splice_chain
    from nnsight_lorsa import Lorsa, LorsaConfig, LorsaSet, get_adapter

    model, _ = embedded()
    adapter = get_adapter(model)
    w = adapter.mhsa_weights(model._module, args.layer)
    cfg = LorsaConfig.from_mhsa(w, n_ov_heads=args.n_ov, top_k=args.top_k, qk_heads_per_mhsa_head=args.qk_per_head,
                                layer=args.layer)
    lorsa = Lorsa(cfg)
    lorsa.init_from_mhsa(w, generator=torch.Generator().manual_seed(0))
    lorsas = LorsaSet(model, {args.layer: lorsa})
    ids = torch.randint(0, model.tokenizer.vocab_size, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(1))
    shared = splice_chain.share_encoder_matmul

    def trace(share: bool) -> torch.Tensor:
        splice_chain.share_encoder_matmul = shared if share else (lambda m: False)  # type: ignore[assignment]
        try:
            with torch.no_grad(), model.trace(ids):
                lorsas.replace(layer=args.layer, error=True).hook_z.output.save()
                out = model.output.logits.save()
        finally:
            splice_chain.share_encoder_matmul = shared
        return out

    assert torch.equal(trace(True), trace(False))
    flops = {}
    for name, share in (("before", False), ("after", True)):
        with FlopCounterMode(display=False) as counter:
            trace(share)
        flops[name] = counter.get_total_flops()
    times = time_interleaved({"before": lambda: trace(False), "after": lambda: trace(True)}, repeats=args.repeats)
    payload = {"command": command("OMP_NUM_THREADS=1"), "config": vars(args),
               "lorsa": {"n_qk_heads": cfg.n_qk_heads, "d_qk_head": cfg.d_qk_head, "n_ov_heads": cfg.n_ov_heads,
                         "d_model": cfg.d_model},
               "gflop_per_trace": {k: v / 1e9 for k, v in flops.items()},
               "time_per_trace": times, "logits_bit_identical": True}
    print(payload)
    write("splice_lorsa_two_passes", payload)


if __name__ == "__main__":
    main()
