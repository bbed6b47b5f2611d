"""Shared pieces of the synthetic-task benchmarks (arithmetic, IOI / greater-than).

Model side: :func:`wrap_tokenizer` (a ``tokenizers`` word-level tokenizer as the BOS-prepending
``PreTrainedTokenizerFast`` the task builders and nnsight use) and :func:`train_answer_lm` (a tiny
Llama trained with next-token CE on answer tokens only, warm-up + cosine AdamW, saved with its tokenizer).

Measurement side: :func:`logits_of`, :func:`train_lorsa` (``Trainer`` on given token rows,
cached), :func:`layer_patching` (which layer's MHSA heads matter: activation patching per layer,
path patching per head) and :func:`circuit_sizes` (Draye et al. 2025 §4.2: MHSA heads mean/zero-ablated vs the
Lorsa heads active on the task, zero-ablated, ``error=False``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, processors
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from benchmarks._timing import arg, command, parser, script, start, table, write_json
from nnsight_lorsa import Lorsa, LorsaConfig, LorsaSet, get_adapter
from nnsight_lorsa.assets import BOS_ID, BOS_TOKEN, EOS_ID, EOS_TOKEN
from nnsight_lorsa.patching import LorsaHead, MHSAHead, ReplacementModel, mean_activations, path_patching
from nnsight_lorsa.patching.circuit import CircuitSize, circuit_size
from nnsight_lorsa.patching.experiments import activation_patching
from nnsight_lorsa.patching.tasks import TaskBatch

UNK_TOKEN = "<unk>"


# ------------------------------------------------------------------ model side
def wrap_tokenizer(tok: Tokenizer, vocab: dict[str, int], model_max_length: int = 64) -> PreTrainedTokenizerFast:
    """``tok`` (model + pre-tokenizer [+ decoder] set) with BOS prepended, as a transformers tokenizer."""
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1", special_tokens=[(BOS_TOKEN, BOS_ID)])
    assert vocab[BOS_TOKEN] == BOS_ID and vocab[EOS_TOKEN] == EOS_ID
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                   pad_token=EOS_TOKEN, unk_token=UNK_TOKEN, padding_side="left",
                                   model_max_length=model_max_length)


def train_answer_lm(out_dir: Path, tok: PreTrainedTokenizerFast, vocab_size: int,
                    rows: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]],
                    evaluate: Callable[[LlamaForCausalLM], dict[str, float]], *, steps: int, lr: float,
                    layers: int, d_model: int, heads: int, seed: int,
                    eval_every: int = 250) -> tuple[LlamaForCausalLM, dict[str, Any]]:
    """Train a tiny Llama on ``rows(gen) -> (ids (b, t), answer_mask (b, t))`` with CE on the masked tokens.

    ``evaluate(model)`` runs every ``eval_every`` steps (its values join the curve). Saves model and
    tokenizer to ``out_dir``. Returns ``(model, info)`` with ``n_params``, ``answer_ce_last50``,
    ``curve`` (``[step, CE, *evaluate values]``), ``wall_seconds`` (the training loop).
    """
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    tiny_llama_config = script("tinymodel").tiny_llama_config  # the embedded model's config, scaled
    config = tiny_llama_config(vocab_size, hidden_size=d_model, intermediate_size=4 * d_model,
                               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                               head_dim=d_model // heads, max_position_embeddings=64,
                               rope_original_max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(seed)
    warm = 100
    curve: list[list[float]] = []
    losses: list[float] = []
    for step in range(steps):
        cos = 0.5 * (1 + math.cos(math.pi * (step - warm) / (steps - warm)))
        f = (step + 1) / warm if step < warm else 0.1 + 0.9 * cos
        for g in opt.param_groups:
            g["lr"] = lr * f
        model.train()
        x, mask = rows(gen)
        logits = model(input_ids=x).logits[:, :-1]
        m = mask[:, 1:]
        loss = F.cross_entropy(logits[m], x[:, 1:][m])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            ev = evaluate(model)
            ce = round(sum(losses[-50:]) / len(losses[-50:]), 4)
            curve.append([step + 1, ce, *(round(v, 4) for v in ev.values())])
            print(f"step {step + 1}: answer CE {ce:.4f}  " + "  ".join(f"{k} {v:.4f}" for k, v in ev.items())
                  + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    wall = time.perf_counter() - t0
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    info = {"n_params": sum(p.numel() for p in model.parameters()),
            "answer_ce_last50": round(sum(losses[-50:]) / 50, 4), "curve": curve, "wall_seconds": round(wall, 1)}
    return model, info


def load_or_train(out_dir: Path, train: Callable[..., dict], retrain: bool = False, **kw) -> Path:
    """The cached model directory ``out_dir``, running ``train(out_dir, **kw)`` first if it has no
    ``training.json`` (or ``retrain``)."""
    if retrain or not (out_dir / "training.json").exists():
        train(out_dir, **kw)
    return out_dir


def model_main(doc: str, cache: Path, train: Callable[..., dict], steps: int, summary: tuple[str, ...]) -> None:
    """The model builders' command line: ``[--retrain] [--out DIR] [--steps N] [--batch-size N] [--lr X]
    [--layers N] [--d-model N] [--heads N]``; trains if needed and prints the ``summary`` keys of
    ``training.json``."""
    args = parser(doc, retrain=False, out=arg(cache, "model directory", type=Path), steps=steps, batch_size=128,
                  lr=3e-3, layers=2, d_model=128, heads=4).parse_args()
    start(threads=1, seed=None)
    cmd = command("OMP_NUM_THREADS=1")
    load_or_train(args.out, train, args.retrain, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                  layers=args.layers, d_model=args.d_model, heads=args.heads, command=cmd)
    info = json.loads((args.out / "training.json").read_text())
    print(json.dumps({k: info[k] for k in summary}))


def versions() -> dict[str, Any]:
    import transformers

    return {"torch_threads": torch.get_num_threads(), "torch_version": torch.__version__,
            "transformers_version": transformers.__version__}


# ------------------------------------------------------------------ measurement side
def lorsa_argparser(doc: str, **options: Any) -> argparse.ArgumentParser:
    """The measurement scripts' options: ``--retrain-lorsa --lorsa-steps --n-ov --top-k --n-prompts``, then
    ``options`` (as in ``_timing.parser``)."""
    return parser(doc, retrain_lorsa=False, lorsa_steps=3000, n_ov=256, top_k=8, n_prompts=32, **options)


def open_model(model_dir: Path) -> tuple[Any, dict[str, Any]]:
    """One thread, seed 0; the nnsight model in ``model_dir`` and its ``training.json``."""
    from nnsight_lorsa.envoy import load_model

    start(threads=1)
    return load_model(str(model_dir)), json.loads((model_dir / "training.json").read_text())


def logits_of(model, ids: torch.Tensor, lorsas: LorsaSet | None = None, layer: int = 0) -> torch.Tensor:
    """Logits of ``ids``, with the Lorsa of ``layer`` spliced (``error=False``) if given."""
    with torch.no_grad(), model.trace(ids):
        if lorsas is not None:
            lorsas.replace(layer, error=False)
        out = model.lm_head.output.save()
    return out


def train_lorsa(model, layer: int, train_rows: torch.Tensor, held_rows: torch.Tensor, cache: Path, *, steps: int,
                n_ov: int, top_k: int, retrain: bool, extra: dict[str, Any] | None = None) -> tuple[LorsaSet, dict]:
    """A Lorsa on ``layer``'s attention (``Trainer``, 32 rows a batch, lr 4e-3), cached in ``cache``;
    ``info`` has its config, ``train_seconds`` and ``evaluate`` on ``held_rows`` (FVU, L0, dead, CE)."""
    from nnsight_lorsa.training import ActivationSource, LorsaObjective, TokenDataset, TrainConfig, Trainer, evaluate

    adapter = get_adapter(model)
    mhsa = adapter.mhsa_weights(model._module, layer)
    if (cache / f"layer_{layer}").exists() and (cache / "train.json").exists() and not retrain:
        return LorsaSet.from_pretrained(model, cache), json.loads((cache / "train.json").read_text())
    t0 = time.perf_counter()
    lcfg = LorsaConfig.from_mhsa(mhsa, n_ov_heads=n_ov, top_k=top_k, qk_heads_per_mhsa_head=4, layer=layer,
                                 architecture=adapter.family)
    source = ActivationSource.attention(model, layer, TokenDataset(train_rows), 32, seed=0)
    trainer = Trainer(LorsaObjective(Lorsa(lcfg), mhsa=mhsa), source, TrainConfig(total_steps=steps, lr=4e-3))
    trainer.train(progress=False)
    folded = trainer.folded()
    assert isinstance(folded, Lorsa)
    lorsas = LorsaSet(model, {layer: folded})
    lorsas.save(cache)
    ev = evaluate(lorsas, TokenDataset(held_rows), at=layer, batch_size=64)
    info = {"layer": layer, "n_qk_heads": lcfg.n_qk_heads, "n_ov_heads": n_ov, "top_k": top_k, "steps": steps,
            "batch_rows": 32, **(extra or {}), "train_seconds": round(time.perf_counter() - t0, 1),
            "last_train_fvu": round(trainer.history[-1]["fvu"], 4), "heldout_eval": ev.summary()}
    write_json(cache / "train.json", info)
    return lorsas, info


def layer_patching(model, task: TaskBatch, what: str, last: tuple[str, str] = ("last_position", "at last position"),
                   ) -> tuple[dict[str, Any], torch.Tensor]:
    """Activation patching clean → corrupt of each layer's heads together and path patching of each
    MHSA head (corrupt value, later attention frozen) at the last position and at all positions; printed
    (``last``: the JSON key and the column name of the last position).

    Returns ``(result dict, per-layer sum of the heads' last-position path-patching effect)``."""
    adapter = get_adapter(model)
    n_layers, n_heads = adapter.n_layers, adapter.n_heads
    r0 = ReplacementModel(model)
    heads = [MHSAHead(layer, h) for layer in range(n_layers) for h in range(n_heads)]
    groups = [tuple(MHSAHead(layer, h) for h in range(n_heads)) for layer in range(n_layers)]
    kw = {"correct_ids": task.correct_ids, "incorrect_ids": task.incorrect_ids}
    ap = activation_patching(r0, task.clean, task.corrupt, groups, **kw)
    pp = path_patching(r0, task.clean, heads, corrupt=task.corrupt, positions=-1, **kw)
    pp_all = path_patching(r0, task.clean, heads, corrupt=task.corrupt, **kw)
    layer_rows = [(f"layer {i}", round(float(ap.normalized[i].mean()), 3)) for i in range(n_layers)]
    print(f"\nactivation patching clean -> corrupt ({what}), all heads of a layer, normalized:")
    print(table(layer_rows, ("heads patched", "recovered")))
    head_rows = [(f"L{h.layer}H{h.head}", round(float(pp.normalized[i].mean()), 3),
                  round(float(pp_all.normalized[i].mean()), 3)) for i, h in enumerate(heads)]
    print("\npath patching each MHSA head (corrupt value, later attention frozen), normalized effect:")
    print(table(head_rows, ("head", last[1], "all positions")))
    res = {"activation_patching_layer_normalized": dict(layer_rows),
           "path_patching_head_normalized": {h: {last[0]: e, "all_positions": a} for h, e, a in head_rows}}
    return res, pp.normalized.mean(-1).view(n_layers, n_heads).sum(-1)


def active_lorsa_heads(model, lorsas: LorsaSet, layer: int, ids: torch.Tensor) -> list[LorsaHead]:
    """The Lorsa heads of ``layer`` with z > 0 somewhere after BOS on ``ids`` (``error=False``)."""
    with torch.no_grad(), model.trace(ids):
        z = lorsas.replace(layer, error=False).hook_z.output.save()
    return [LorsaHead(layer, h) for h in (z[:, 1:] > 0).any(0).any(0).nonzero().flatten().tolist()]


def circuit_sizes(model, task: TaskBatch, layer: int, lorsas: LorsaSet,
                  lheads: list[LorsaHead]) -> tuple[dict[str, dict], CircuitSize]:
    """``circuit_size`` (90 %) for the MHSA heads of ``layer`` (mean over the corrupt prompts, and zero)
    and for ``lheads`` (zero, ``error=False``); printed. Returns ``(sizes, the Lorsa CircuitSize)``."""
    r = ReplacementModel(model, lorsas=lorsas, error=False)
    mh = [MHSAHead(layer, h) for h in range(get_adapter(model).n_heads)]
    means = mean_activations(ReplacementModel(model), mh, task.corrupt)
    sizes, cs_l = {}, None
    for label, resolver, comps, mode in (("mhsa_mean", ReplacementModel(model), mh, "mean"),
                                         ("mhsa_zero", ReplacementModel(model), mh, "zero"),
                                         ("lorsa_zero", r, lheads, "zero")):
        cs = circuit_size(resolver, task, comps, mode=mode, means=means if mode == "mean" else None)
        sizes[label] = {"n_components": len(comps), "global_k": cs.global_k,
                        "per_prompt_k_mean": round(float(cs.per_prompt_k.float().mean()), 2),
                        "per_prompt_k_median": float(cs.per_prompt_k.float().median()),
                        "per_prompt_k_max": int(cs.per_prompt_k.max()),
                        "metric_all": round(float(cs.metric_all.mean()), 3),
                        "metric_none": round(float(cs.metric_none.mean()), 3),
                        "global_curve": {int(k): round(float(f), 3) for k, f in zip(cs.ks, cs.global_curve, strict=True)
                                         if int(k) <= 16}}
        if label == "lorsa_zero":
            cs_l = cs
    print(f"\ncircuit size, 90% of the clean logit difference, layer {layer} ({len(task)} prompts):")
    print(table([(k, v["n_components"], v["global_k"], v["per_prompt_k_mean"], v["per_prompt_k_max"],
                  v["metric_all"], v["metric_none"]) for k, v in sizes.items()],
                ("components", "n", "global k", "mean k/prompt", "max k", "LD all", "LD none")))
    assert cs_l is not None
    return sizes, cs_l


def lorsa_last_position_effects(model, task: TaskBatch, lorsas: LorsaSet,
                                lheads: list[LorsaHead]) -> tuple[torch.Tensor, torch.Tensor]:
    """The heads' direct role at the last position: path patching (later attention frozen, ``error=False``)
    there only, zero-ablated and patched from the corrupt prompts. Returns the batch-mean effects
    ``(zero (n,), corrupt (n,))`` (logit difference lost)."""
    r = ReplacementModel(model, lorsas=lorsas, error=False)
    kw = {"correct_ids": task.correct_ids, "incorrect_ids": task.incorrect_ids, "positions": -1}
    ppz = path_patching(r, task.clean, lheads, mode="zero", **kw)
    ppc = path_patching(r, task.clean, lheads, corrupt=task.corrupt, **kw)
    return ppz.effect.mean(-1), ppc.effect.mean(-1)
