"""What counting padding would do to the evaluation numbers: the packaged layer-2 Lorsa of the embedded
tinyshakespeare Llama, evaluated on one window per speech (speeches = blank-line separated documents, each
from its start with BOS, right-padded to ``--seq-len``) with the padding excluded (``target_mask``, what
``evaluate`` and the trainer do) and counted (the same windows without a mask).

    python -m benchmarks.padding_metrics_tinyshakespeare [--windows 256] [--seq-len 128]

Writes ``benchmarks/results/padding_metrics_tinyshakespeare.json``.
"""

from __future__ import annotations

from benchmarks._timing import command, embedded, parser, start, write
from nnsight_lorsa.assets import default_corpus_path
from nnsight_lorsa.training import TokenDataset, evaluate


def main() -> None:
    args = parser(__doc__, windows=256, seq_len=128, batch_size=16, threads=1).parse_args()
    start(args)
    model, lorsas = embedded()
    text = default_corpus_path().read_text(encoding="utf-8")
    docs = TokenDataset.from_documents(model.tokenizer, [d for d in text.split("\n\n") if d.strip()], args.seq_len,
                                       config=model.config)
    n = min(args.windows, len(docs))
    tokens, mask = docs.tokens[-n:], docs.target_mask[-n:]
    layer = next(iter(lorsas))
    rows = {}
    for name, data in (("padding_excluded", TokenDataset(tokens, mask)), ("padding_counted", TokenDataset(tokens))):
        rows[name] = evaluate(lorsas, data, at=layer, batch_size=args.batch_size).summary()
        print(name, rows[name])
    payload = {"command": command(), "windows": n, "seq_len": args.seq_len,
               "padded_fraction": round(float(1 - mask[:, 1:].float().mean()), 4), **rows}
    print("padded fraction of predicted positions:", payload["padded_fraction"])
    write("padding_metrics_tinyshakespeare", payload)


if __name__ == "__main__":
    main()
