"""Lorsa training recipe: each mechanism on/off, trained from one activation cache.

A model's layer-``L`` attention input/output (the embedded model's by default; ``--model DIR`` any Hugging
Face directory our adapters support) is cached once (``write_activation_cache``) for the training
windows and the held-out windows of the demo (the last 64 windows × 128 tokens of the bundled corpus);
every variant trains from the same cached batches (same seed) and is measured on the held-out
windows: FVU, L0 and dead fraction (heads never active on the held-out tokens) from the cached
activations; with ``--ce`` also CE recovered (``evaluate`` with the Lorsa spliced in), and wall time.

    OMP_NUM_THREADS=1 python -m benchmarks.lorsa_recipe --steps 100 \
        --out benchmarks/results/lorsa_recipe_ablation.json
    OMP_NUM_THREADS=1 python -m benchmarks.lorsa_recipe --steps 600 --variants recipe,old_demo --ce
    OMP_NUM_THREADS=1 python -m benchmarks.lorsa_recipe --model /tmp/ts-gpt2,/tmp/ts-neox \
        --layer all --ce --variants 'recipe:lr=0.004'    # every layer of other models (benchmarks/_tiny_models.py)

The Lorsa is configured from the layer's MHSA (``mhsa_weights``): ``n_qk_heads = 4 × n_heads``,
``d_qk_head = head_dim``, its rotary (none for GPT-2), score scale and QK-norm.

``--export DIR`` writes the training windows, the batch order and the held-out windows as
safetensors (:func:`export`) for the llamascopium head-to-head (``benchmarks/lorsa_llamascopium.py``,
run in the llamascopium venv), then exits without training.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from nnsight_lorsa import Lorsa, LorsaConfig, LorsaSet, get_adapter
from nnsight_lorsa.assets import default_corpus_path
from nnsight_lorsa.envoy import load_model
from nnsight_lorsa.envoy.read import Site
from nnsight_lorsa.modules import SAEConfig, SparseAutoencoder
from nnsight_lorsa.training import (
    ActivationCache,
    ActivationSource,
    LorsaObjective,
    LorsaRecipe,
    TokenDataset,
    TrainConfig,
    Trainer,
    evaluate,
    write_activation_cache,
)

# name -> (TrainConfig overrides, LorsaRecipe overrides, QK/OV from the MHSA)
# the LorsaRecipe defaults before issue 26 made the weak annealed balance and the ||w_o|| split the default
AUXK = {"rank_by_decoder_norm": False, "dead_remedy": "auxk", "remedy_until": 1.0, "balance_max": 8.0}
OLD = {"ov_init": "mhsa", "scale_init": False, "b_d_init": False, **AUXK}
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any], bool]] = {
    "old_demo": ({"lr": 4e-3}, OLD, True),                                  # the former default
    "old_lr1e-3": ({"lr": 1e-3}, OLD, True),
    "old+scale": ({"lr": 4e-3}, {**OLD, "scale_init": True, "b_d_init": True}, True),
    "random_ov+scale": ({"lr": 4e-3}, {**OLD, "ov_init": "random", "scale_init": True, "b_d_init": True}, True),
    "value_svd": ({"lr": 4e-3}, {**OLD, "ov_init": "value_svd"}, True),
    "value_svd+scale": ({"lr": 4e-3}, {**OLD, "ov_init": "value_svd", "scale_init": True, "b_d_init": True}, True),
    "output_svd+scale": ({"lr": 4e-3}, {**OLD, "ov_init": "output_svd", "scale_init": True, "b_d_init": True}, True),
    "recipe": ({}, {}, True),
    # issue 26: the former default (scale in w_v, AuxK) and the authors' split with AuxK, spelled out
    "former_default": ({"lr": 4e-3}, AUXK, True),
    "recipe_w_o": ({"lr": 4e-3}, {**AUXK, "rank_by_decoder_norm": True}, True),
    "recipe_lr4e-3": ({"lr": 4e-3}, {}, True),                             # the default recipe at lr 4e-3
    # issue 26's first default (balance cap 1, decayed to 1 from 50% of the run), before the cap-0.5 balance kept on
    "annealed_balance": ({"lr": 4e-3}, {"remedy_until": 0.5, "balance_max": 1.0}, True),
}


def parse_variant(spec: str) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """A named variant, or ``recipe:key=value,...`` overriding TrainConfig / LorsaRecipe fields."""
    if spec in VARIANTS:
        return VARIANTS[spec]
    base, _, rest = spec.partition(":")
    train, recipe, mhsa = (dict(d) if isinstance(d, dict) else d for d in VARIANTS[base])
    tc_fields = set(TrainConfig.__dataclass_fields__)
    for item in filter(None, rest.split(";")):
        k, v = item.split("=")
        val: Any = None if v == "None" else (v == "True" if v in ("True", "False") else v)
        if isinstance(val, str):
            with contextlib.suppress(ValueError):
                val = int(val) if val.lstrip("-").isdigit() else float(val)
        (train if k in tc_fields else recipe)[k] = val
    return train, recipe, mhsa


def caches(model: Any, layer: int, root: Path) -> tuple[ActivationCache, ActivationCache, TokenDataset]:
    a = get_adapter(model)
    data = TokenDataset.from_text(model.tokenizer, Path(default_corpus_path()).read_text(encoding="utf-8"), 128,
                                  config=model.config)
    train, heldout = data.split(min(0.2, 64 / len(data)))
    sites = {"x": Site.attn_input(a, layer), "y": Site.attn_output(a, layer)}
    out = []
    for name, ds in (("train", train), ("heldout", heldout)):
        d = root / f"L{layer}_{name}"
        if not (d / "manifest.json").exists():
            write_activation_cache(model, sites, ds, d, batch_size=32, windows_per_shard=1024)
        cache = ActivationCache(d, model=model)
        cache.check_dataset(ds)
        out.append(cache)
    return out[0], out[1], heldout


@torch.no_grad()
def heldout_metrics(lorsa: Lorsa, cache: ActivationCache) -> dict[str, float]:
    ids = torch.arange(cache.n_windows)
    x, y, mask = cache.windows("x", ids), cache.windows("y", ids), cache.windows("loss_mask", ids)
    sse = tot = 0.0
    l0 = n = 0.0
    fired = torch.zeros(lorsa.cfg.n_ov_heads, dtype=torch.bool)
    ys = y[mask].double()
    for i in range(0, len(ids), 16):
        out, c = lorsa(x[i:i + 16], return_cache=True)
        m = mask[i:i + 16]
        sse += float((y[i:i + 16] - out)[m].double().pow(2).sum())
        act = c.active[m]
        l0 += float(act.sum())
        n += act.shape[0]
        fired |= act.any(0)
    tot = float((ys - ys.mean(0)).pow(2).sum())
    return {"fvu": sse / tot, "l0": l0 / n, "dead_frac": 1.0 - float(fired.float().mean()), "n_tokens": int(n)}


def export(model: Any, layer: int, train_cache: ActivationCache, held: ActivationCache, steps: int, n_ov: int,
           top_k: int, seed: int, out: Path) -> None:
    """The layer's training batches and held-out windows, for a trainer outside this package.

    ``train.safetensors``: ``x`` (attention input), ``y`` (attention output) ``(n_windows, seq, d_model)``
    float32 and ``loss_mask`` ``(n_windows, seq)`` bool of every training window, and ``batch_windows``
    ``(steps, 16)`` int64: batch ``i`` is windows ``batch_windows[i]`` in that order — exactly what
    ``ActivationSource(train_cache, ..., batch_size=16, seed=seed)(i)`` yields (positions are
    ``0..seq-1``: a cached source has none). ``heldout.safetensors``: ``x``, ``y``, ``loss_mask`` of the
    held-out windows. ``mhsa.safetensors``: the layer's MHSA in head-major form (``W_Q (n_heads, d_model,
    head_dim)``, ``W_K W_V (n_kv_heads, …)``, ``W_O (n_heads, head_dim, d_model)``, biases).
    ``meta.json``: dims, the Lorsa's settings (as :func:`run_variant` builds it), rotary, scale.
    """
    from safetensors.torch import save_file

    a = get_adapter(model)
    mhsa = a.mhsa_weights(model._module, layer)
    source = ActivationSource(train_cache, Site.attn_input(a, layer), Site.attn_output(a, layer), batch_size=16,
                              seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    for name, cache in (("train", train_cache), ("heldout", held)):
        ids = torch.arange(cache.n_windows)
        tensors = {k: cache.windows(k, ids).contiguous() for k in ("x", "y", "loss_mask")}
        if name == "train":
            tensors["batch_windows"] = torch.stack([source.window_ids(i) for i in range(steps)])
        save_file(tensors, str(out / f"{name}.safetensors"))
    save_file({k: getattr(mhsa, k).detach().float().contiguous()
               for k in ("W_Q", "b_Q", "W_K", "b_K", "W_V", "b_V", "W_O", "b_O")}, str(out / "mhsa.safetensors"))
    rot = mhsa.rotary
    meta = {"layer": layer, "d_model": a.d_model, "n_heads": int(mhsa.W_Q.shape[0]),
            "n_kv_heads": int(mhsa.W_K.shape[0]),
            "head_dim": int(mhsa.W_Q.shape[-1]), "scale": mhsa.scale, "seq_len": int(train_cache.manifest["seq_len"]),
            "n_qk_heads": 4 * int(mhsa.W_Q.shape[0]), "d_qk_head": int(mhsa.W_Q.shape[-1]), "n_ov_heads": n_ov,
            "top_k": top_k, "steps": steps, "batch_size": 16, "seed": seed,
            "rotary": None if rot is None else {"rotary_dim": rot.rotary_dim, "base": rot.base,
                                                 "interleaved": rot.interleaved, "rope_type": rot.rope_type,
                                                 "scaling": rot.scaling},
            "train_windows": train_cache.n_windows, "heldout_windows": held.n_windows,
            "model": train_cache.manifest["model"]}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


def run_sae_baseline(model: Any, layer: int, train_cache: ActivationCache, held: ActivationCache, steps: int,
                     n_latents: int, top_k: int, seed: int, lr: float = 4e-3) -> dict[str, Any]:
    """Variant ``sae_topk``: a TopK SAE (``n_latents``, k ``top_k``) on the attention *output* itself,
    trained by the same trainer on the same batches — how many latents a dictionary of that size keeps
    alive on this data when nothing Lorsa-specific (attention patterns, OV heads) is involved."""
    a = get_adapter(model)
    torch.manual_seed(seed)
    sae = SparseAutoencoder(SAEConfig(d_in=a.d_model, d_sae=n_latents, activation="topk",
                                      activation_params={"k": top_k}, hook=Site.attn_output(a, layer).path))
    source = ActivationSource.sae(train_cache, Site.attn_output(a, layer), batch_size=16, seed=seed)
    t0 = time.time()
    trainer = Trainer(sae, source, TrainConfig(total_steps=steps, lr=lr))
    trainer.train(progress=False)
    wall = time.time() - t0
    folded = trainer.folded()
    ids = torch.arange(held.n_windows)
    y = held.windows("y", ids)[held.windows("loss_mask", ids)]
    with torch.no_grad():
        out, acts = folded(y), folded.encode(y)
    yd = y.double()
    row = {"variant": "sae_topk", "layer": layer, "steps": steps, "train_s": round(wall, 1), "lr": lr,
           "fvu": float((yd - out.double()).pow(2).sum() / (yd - yd.mean(0)).pow(2).sum()),
           "l0": float((acts > 0).sum(-1).float().mean()), "dead_frac": float(((acts > 0).sum(0) == 0).float().mean()),
           "n_tokens": int(y.shape[0])}
    print(json.dumps(row), flush=True)
    return row


def run_variant(name: str, model: Any, layer: int, train_cache: ActivationCache, held: ActivationCache,
                heldout: TokenDataset, steps: int, ce: bool, n_ov: int, top_k: int, seed: int) -> dict[str, Any]:
    if name == "sae_topk":
        return run_sae_baseline(model, layer, train_cache, held, steps, n_ov, top_k, seed)
    tc_over, recipe_over, use_mhsa = parse_variant(name)
    a = get_adapter(model)
    mhsa = a.mhsa_weights(model._module, layer)
    torch.manual_seed(seed)
    cfg = LorsaConfig.from_mhsa(mhsa, n_ov_heads=n_ov, top_k=top_k, qk_heads_per_mhsa_head=4, layer=layer)
    lorsa = Lorsa(cfg)
    source = ActivationSource(train_cache, Site.attn_input(a, layer), Site.attn_output(a, layer), batch_size=16,
                              seed=seed)
    t0 = time.time()
    trainer = Trainer(LorsaObjective(lorsa, mhsa=mhsa if use_mhsa else None, recipe=LorsaRecipe(**recipe_over)),
                      source, TrainConfig(total_steps=steps, **tc_over))
    trainer.train(progress=False)
    wall = time.time() - t0
    folded = trainer.folded()
    assert isinstance(folded, Lorsa)
    row: dict[str, Any] = {"variant": name, "layer": layer, "steps": steps, "train_tokens": steps * 16 * 128,
                           "train_s": round(wall, 1),
                           "train_config": tc_over, "recipe": LorsaRecipe(**recipe_over).to_dict(),
                           "init": trainer.objective.init_info,  # type: ignore[attr-defined]
                           "fvu_at": {h["step"]: round(h["fvu"], 4) for h in trainer.history
                                      if h["step"] in (10, 20, 50, 100, 200, 400, 600)}}
    row.update(heldout_metrics(folded, held))
    if ce:
        ev = evaluate(LorsaSet(model, {layer: folded}), heldout, at=layer, batch_size=16)
        row.update(ce_orig=ev.ce_orig, ce_spliced=ev.ce_spliced, ce_zero=ev.ce_zero, ce_recovered=ev.ce_recovered)
    print(json.dumps({k: row[k] for k in row if k not in ("recipe", "train_config")}), flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded",
                   help="comma-separated Hugging Face model directories, run one after the other ('embedded': ours)")
    p.add_argument("--layer", default="2", help="a layer, comma-separated layers, or 'all' (every layer of each model)")
    p.add_argument("--steps", type=int, default=600, help="600 × 16 × 128 = 1.23M tokens (the issue's budget)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; 'recipe:k=v;k=v' overrides")
    p.add_argument("--n-ov", type=int, default=1024)
    p.add_argument("--top-k", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ce", action="store_true")
    p.add_argument("--cache-dir", default="/tmp/nnsight_lorsa_recipe_cache")
    p.add_argument("--out", default=None)
    p.add_argument("--export", default=None, metavar="DIR", help="write the batches (export()) and exit")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.export and ("," in args.model or not args.layer.isdigit()):
        p.error("--export writes one model's one layer: give one --model and one --layer")
    rows: list[dict[str, Any]] = []
    models: dict[str, Any] = {}
    for name in args.model.split(","):
        model = load_model(None if name == "embedded" else name)
        n_layers = get_adapter(model).n_layers
        layers = range(n_layers) if args.layer == "all" else [int(s) for s in args.layer.split(",")]
        info = Path(name, "training.json")
        models[name] = {"model_type": model.config.model_type, "n_layers": n_layers,
                        "training": json.loads(info.read_text()) if name != "embedded" and info.exists() else None}
        root = Path(args.cache_dir)
        if name != "embedded":  # one cache per weights file: a retrained model with the same config gets a new one
            digest = hashlib.sha256(b"".join(f.read_bytes() for f in sorted(Path(name).glob("*.safetensors"))))
            root = root / f"{Path(name).resolve().name}-{digest.hexdigest()[:12]}"
        for layer in layers:
            train_cache, held, heldout = caches(model, layer, root)
            if args.export:
                export(model, layer, train_cache, held, args.steps, args.n_ov, args.top_k, args.seed, Path(args.export))
                return
            for v in args.variants.split(","):
                rows.append({"model": name, **run_variant(v, model, layer, train_cache, held, heldout, args.steps,
                                                          args.ce, args.n_ov, args.top_k, args.seed)})
                if args.out:  # after every row: a long run stopped early keeps what it measured
                    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                    Path(args.out).write_text(json.dumps(
                        {"command": shlex.join(["python", *sys.argv]), "models": models,
                         "layer": int(args.layer) if args.layer.isdigit() else args.layer, "steps": args.steps,
                         "n_ov_heads": args.n_ov, "top_k": args.top_k, "heldout_windows": held.n_windows,
                         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
