"""Train TopK transcoders on every MLP and a TopK SAE on the layer-2 residual of the embedded
tinyshakespeare Llama, then evaluate them spliced into the model on held-out windows.

    python -m benchmarks.train_sparse_coders_tinyshakespeare [--steps 1200] [--d-sae 1024] [--k 16]

Same data and held-out split as ``nnsight-lorsa demo`` (the last 64 windows of 128 tokens). Writes
``benchmarks/results/sparse_coders_tinyshakespeare.json`` (command, settings, numbers per dictionary).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from benchmarks._timing import RESULTS, arg, parser, start
from nnsight_lorsa import get_adapter
from nnsight_lorsa.assets import default_corpus_path
from nnsight_lorsa.envoy import load_model
from nnsight_lorsa.envoy.read import Site
from nnsight_lorsa.envoy.sae_set import SAESet
from nnsight_lorsa.envoy.transcoder_set import TranscoderSet
from nnsight_lorsa.formats import save
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig
from nnsight_lorsa.training import ActivationSource, TokenDataset, TrainConfig, Trainer, evaluate


def main() -> None:
    args = parser(__doc__, steps=1200, batch_size=16, seq_len=128, d_sae=1024, k=16, lr=4e-3, sae_layer=2,
                  heldout_windows=64, out=str(RESULTS / "sparse_coders_tinyshakespeare.json"), no_progress=False,
                  save_dir=arg(None, "also save the folded transcoders as DIR/layer_{L} (our safetensors+JSON "
                               "format); the packaged ones: nnsight_lorsa/assets/tinyshakespeare-llama-transcoders"),
                  no_sae=arg(False, "train only the transcoders")).parse_args()
    start(args)
    t0 = time.time()
    model = load_model()
    adapter = get_adapter(model)
    text = Path(default_corpus_path()).read_text(encoding="utf-8")
    data = TokenDataset.from_text(model.tokenizer, text, args.seq_len)
    train, heldout = data.split(min(0.2, args.heldout_windows / len(data)))
    d = adapter.d_model
    params = {"k": args.k}
    jobs: list[tuple[str, Trainer]] = []
    for layer in range(adapter.n_layers):
        tc = Transcoder(TranscoderConfig(d_in=d, d_sae=args.d_sae, activation="topk", activation_params=params,
                                         layer=layer))
        src = ActivationSource.transcoder(model, layer, train, args.batch_size)
        jobs.append((f"transcoder L{layer}", Trainer(tc, src, TrainConfig(total_steps=args.steps, lr=args.lr))))
    site = adapter.layer_path(args.sae_layer)
    if not args.no_sae:
        sae = SparseAutoencoder(SAEConfig(d_in=d, d_sae=args.d_sae, activation="topk", activation_params=params,
                                          hook=site))
        src = ActivationSource.sae(model, Site(site), train, args.batch_size)
        jobs.append((f"SAE {site}", Trainer(sae, src, TrainConfig(total_steps=args.steps, lr=args.lr))))
    results = []
    for name, trainer in jobs:
        t = time.time()
        trainer.train(progress=not args.no_progress)
        t_train = time.time() - t
        coder = trainer.folded()
        if isinstance(coder, Transcoder):
            layer = coder.cfg.layer
            assert layer is not None
            ev = evaluate(TranscoderSet(model, {layer: coder}), heldout)
            if args.save_dir:
                save(coder, Path(args.save_dir) / f"layer_{layer}")
        else:
            assert isinstance(coder, SparseAutoencoder)
            ev = evaluate(SAESet(model, {site: coder}), heldout)
        t_eval = time.time() - t - t_train
        row = {"dictionary": name, "train_seconds": round(t_train, 1), "eval_seconds": round(t_eval, 1),
               "last_train_fvu": round(trainer.history[-1]["fvu"], 4), **ev.summary()}
        print(json.dumps(row), flush=True)
        results.append(row)
    out = {"command": "python " + " ".join(sys.argv), "steps": args.steps, "batch_size": args.batch_size,
           "seq_len": args.seq_len, "d_sae": args.d_sae, "k": args.k, "lr": args.lr,
           "train_tokens_per_dictionary": args.steps * args.batch_size * args.seq_len,
           "heldout_windows": len(heldout), "total_seconds": round(time.time() - t0, 1), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"total {out['total_seconds']} s -> {args.out}")


if __name__ == "__main__":
    main()
