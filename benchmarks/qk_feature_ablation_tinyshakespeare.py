"""Lorsa paper App. F.1 on the embedded tinyshakespeare model: which SAE features of the layer-2 attention input
drive the Q and K of the induction Lorsa heads (H802, H777; both read QK head 12).

    OMP_NUM_THREADS=1 python -m benchmarks.qk_feature_ablation_tinyshakespeare [--heads 802 777] [--windows 256]

No SAE on the attention input is packaged (``nnsight_lorsa/assets`` has the Lorsa and MLP transcoders only), so
the first run trains a TopK SAE on the output of ``model.layers.2.input_layernorm`` (= the Lorsa's input) with
the repo's ``Trainer`` and caches it under ``.cache/`` (git-ignored); later runs load it
(``--retrain`` to redo). The last ``--windows`` windows of the corpus are held out from the SAE's training
and are the analysis corpus. Writes ``benchmarks/results/qk_feature_ablation_tinyshakespeare.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from benchmarks._timing import arg, command, embedded, parser, table, write
from nnsight_lorsa import ReplacementModel, get_adapter
from nnsight_lorsa.analysis import qk_feature_impacts
from nnsight_lorsa.assets import default_corpus_path
from nnsight_lorsa.envoy.read import Site, attention_activations
from nnsight_lorsa.envoy.sae_set import SAESet
from nnsight_lorsa.formats import load, save
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
from nnsight_lorsa.training import ActivationSource, TokenDataset, TrainConfig, Trainer, evaluate

LAYER = 2
ROOT = Path(__file__).resolve().parent.parent


def get_sae(model, train: TokenDataset, heldout: TokenDataset, args) -> tuple[SparseAutoencoder, dict]:
    adapter = get_adapter(model)
    site = adapter.attention_norm_path(LAYER)  # its output is what the attention (and the Lorsa) reads
    cache = Path(args.sae_dir)
    info: dict = {"site": site + " (output)", "dir": str(cache.relative_to(ROOT) if cache.is_relative_to(ROOT)
                                                           else cache)}
    if (cache / "config.json").exists() and not args.retrain:
        sae = load(cache)
        info.update({**json.loads((cache / "train_info.json").read_text()), "trained_now": False})
    else:
        sae = SparseAutoencoder(SAEConfig(d_in=adapter.d_model, d_sae=args.d_sae, activation="topk",
                                          activation_params={"k": args.k}, hook=site))
        source = ActivationSource.sae(model, Site(site), train, args.batch_size)
        trainer = Trainer(sae, source, TrainConfig(total_steps=args.steps, lr=args.lr))
        t = time.perf_counter()
        trainer.train(progress=False)
        folded = trainer.folded()
        assert isinstance(folded, SparseAutoencoder)
        sae = folded
        save(sae, cache)
        train = {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
                 "train_windows": len(train), "train_seconds": round(time.perf_counter() - t, 1),
                 "last_train_fvu": round(trainer.history[-1]["fvu"], 4)}
        (cache / "train_info.json").write_text(json.dumps({"train": train}))
        info.update({"train": train, "trained_now": True})
    sae.eval()
    ev = evaluate(SAESet(model, {site: sae}), heldout, max_batches=args.eval_batches)
    info.update({"d_sae": sae.cfg.d_sae, "activation": sae.cfg.activation, **sae.cfg.activation_params,
                 "heldout_eval": {k: v for k, v in ev.summary().items()
                                  if k in ("fvu", "l0", "dead_frac", "ce_orig", "ce_spliced", "ce_zero",
                                           "ce_recovered", "kl", "n_tokens")}})
    return sae, info


def context(tok, ids: torch.Tensor, pos: int, width: int = 10) -> str:
    left = tok.decode(ids[max(1, pos - width):pos])
    return (left + "[[" + tok.decode(ids[pos:pos + 1]) + "]]").replace("\n", "⏎")


@torch.no_grad()
def feature_token_stats(model, sae, tokens: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(n_features, vocab)`` counts of the token at / the token before the positions where each feature is
    active, over the analysis corpus (BOS positions left out)."""
    vocab = max(len(model.tokenizer), int(tokens.max()) + 1)
    at = torch.zeros(sae.cfg.d_sae, vocab, dtype=torch.long)
    before = torch.zeros_like(at)
    for i in range(0, tokens.shape[0], batch_size):
        ids = tokens[i:i + batch_size]
        acts = sae.encode(attention_activations(model, LAYER, ids).x)
        acts[:, 0] = 0
        b, s, f = acts.nonzero(as_tuple=True)
        at.index_put_((f, ids[b, s]), torch.ones_like(f), accumulate=True)
        before.index_put_((f, ids[b, s - 1]), torch.ones_like(f), accumulate=True)
    return at, before


def top_tokens(tok, counts: torch.Tensor, n: int = 3) -> list[str]:
    return [tok.decode([int(t)]) for t in counts.topk(n).indices if counts[t] > 0]


@torch.no_grad()
def describe(model, lorsa, sae, tokens, counts, res, side: str, n: int) -> list[dict]:
    """Top-``n`` features of one side with the token context of their maximum (for K: also the key position
    where the feature is active that carries the most original attention)."""
    tok = model.tokenizer
    g = res.qk_head
    rows = []
    top = res.top_query_features(n) if side == "q" else res.top_key_features(n)
    for f, kl, w, i in top:
        ids = tokens[w]
        row = {"feature": f, "max_kl": kl, "window": w, "position": i, "context": context(tok, ids, i),
               "count": int((res.q_count if side == "q" else res.k_count)[f]),
               "fires_on": top_tokens(tok, counts[0][f]), "fires_after": top_tokens(tok, counts[1][f]),
               "frequency": round(float(counts[0][f].sum()) / res.n_tokens, 4)}  # of the non-BOS tokens
        if side == "k":
            act = attention_activations(model, LAYER, ids[None])
            a = sae.encode(act.x)[0, : i + 1, f]
            pattern = lorsa.attention_pattern(act.x, [g], act.positions)[0, 0, i, : i + 1]
            keys = (a > 0).nonzero().flatten()
            j = int(keys[pattern[keys].argmax()])
            row.update({"n_keys": int(keys.numel()), "key_position": j, "key_attention": round(float(pattern[j]), 3),
                        "key_context": context(tok, ids, j, 6)})
        rows.append(row)
    return rows


def main() -> None:
    args = parser(__doc__, heads=arg([802, 777], nargs="+"),
                  windows=arg(256, "analysis windows (the last of the corpus)"), seq_len=128, top=10,
                  steps=arg(800, "SAE training steps (if not cached)"), batch_size=16, d_sae=1024, k=16, lr=4e-3,
                  eval_batches=8, sae_dir=str(ROOT / ".cache" / "qk_ablation_sae_tinyshakespeare_L2_attn_in"),
                  retrain=False).parse_args()
    t0 = time.perf_counter()
    model, lorsas = embedded()
    lorsa = lorsas[LAYER]
    data = TokenDataset.from_text(model.tokenizer, default_corpus_path().read_text(encoding="utf-8"), args.seq_len)
    train, heldout = data.split(args.windows / len(data))
    sae, sae_info = get_sae(model, train, heldout, args)
    print(f"SAE on {sae_info['site']}: {sae_info}", flush=True)
    tokens = heldout.tokens
    counts = feature_token_stats(model, sae, tokens, 16)
    heads = []
    for head in args.heads:
        t = time.perf_counter()
        res = qk_feature_impacts(ReplacementModel(model, lorsas=lorsas), LAYER, head, sae, tokens, batch_size=16)
        seconds = time.perf_counter() - t
        out = {"head": head, "qk_head": res.qk_head, "n_activations": res.n_activations, "n_tokens": res.n_tokens,
               "seconds": round(seconds, 1),
               "features_with_q_impact": int((res.q_kl > 1e-6).sum()),
               "features_with_k_impact": int((res.k_kl > 1e-6).sum())}
        for side in ("q", "k"):
            out[f"top_{side}"] = describe(model, lorsa, sae, tokens, counts, res, side, args.top)
        heads.append(out)
        print(f"\nLorsa L{LAYER}.H{head} (QK head {res.qk_head}): active at {res.n_activations} of {res.n_tokens} "
              f"tokens; {seconds:.1f} s", flush=True)
        print("Q (feature ablated at the query):")
        print(table([(r["feature"], f"{r['max_kl']:.4f}", r["count"], f"{r['frequency']:.1%}",
                      " ".join(map(repr, r["fires_on"])), r["context"][-36:]) for r in out["top_q"]],
                    ("feature", "max KL", "n", "freq", "fires on", "context of the max (query in [[ ]])")))
        print("K (feature ablated at every key):")
        print(table([(r["feature"], f"{r['max_kl']:.4f}", r["count"], f"{r['frequency']:.1%}",
                      " ".join(map(repr, r["fires_on"])), r["context"][-28:],
                      f"{r['key_context'][-18:]} A={r['key_attention']}") for r in out["top_k"]],
                    ("feature", "max KL", "n", "freq", "fires on", "query context", "key (most attended)")))
    path = write("qk_feature_ablation_tinyshakespeare", {
        "command": command("OMP_NUM_THREADS=1"), "layer": LAYER,
        "analysis_windows": len(heldout), "seq_len": args.seq_len, "sae": sae_info, "heads": heads,
        "total_seconds": round(time.perf_counter() - t0, 1)})
    print(f"\ntotal {time.perf_counter() - t0:.1f} s -> {path}")


if __name__ == "__main__":
    main()
