"""How exactly replacements with error terms (``error=True``) reproduce the unmodified model's logits.

For the embedded tinyshakespeare model (context length 512) with its shipped Lorsa (layer 2) and TopK
transcoders (every MLP), spliced together with ``ReplacementModel(..., error=True).replace()``, on prompts
from the corpus of 16 tokens up to the model's ``max_position_embeddings``: the relative error
``max |logits_replaced − logits_model| / max |logits_model|`` in fp32 (and bf16 for scale). The bound stated
in docs/nnsight.md and tested in ``tests/envoy/test_exactness.py`` is taken from these numbers with margin.

    python -m benchmarks.error_term_exactness        # -> benchmarks/results/error_term_exactness.json
"""

from __future__ import annotations

import torch

from benchmarks._timing import embedded, parser, start, table, write
from nnsight_lorsa import ReplacementModel, TranscoderSet
from nnsight_lorsa.assets import default_corpus_path, default_transcoder_dir


def relative_error(model, rm, ids) -> float:
    with torch.no_grad(), model.trace(ids):
        plain = model.lm_head.output.save()
    with torch.no_grad(), rm.trace(ids):
        rm.replace()
        replaced = model.lm_head.output.save()
    return float((replaced.float() - plain.float()).abs().max() / plain.float().abs().max())


def main() -> None:
    args = parser(__doc__, threads=1, prompts=4).parse_args()
    start(args)
    model, lorsas = embedded()
    transcoders = TranscoderSet.from_pretrained(model, default_transcoder_dir())
    rm = ReplacementModel(model, lorsas=lorsas, transcoders=transcoders, error=True)
    n_ctx = int(model.config.max_position_embeddings)
    text = default_corpus_path().read_text(encoding="utf-8")
    corpus = model.tokenizer(text[:200_000], return_tensors="pt")["input_ids"][0]
    rows, results = [], []
    for length in (16, 128, n_ctx):
        errs = []
        for i in range(args.prompts):
            start_at = (i * 7919) % (corpus.numel() - length)
            errs.append(relative_error(model, rm, corpus[start_at:start_at + length][None]))
        results.append({"length": length, "max_relative_error": max(errs), "errors": errs})
        rows.append((length, f"{max(errs):.2e}"))
    print(table(rows, ("prompt tokens", "max |Δlogit| / max |logit| (fp32)")))
    write("error_term_exactness", {"args": vars(args), "n_ctx": n_ctx, "results": results})


if __name__ == "__main__":
    main()
