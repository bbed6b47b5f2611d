"""The main job: train a Lorsa on one layer, splice it in a trace, report and show its heads.

``nnsight-lorsa demo`` runs end to end offline on the embedded default (a small Llama-architecture
model trained on tinyshakespeare, shipped in ``nnsight_lorsa/assets``); ``--model DIR`` and
``--text FILE`` take a local Hugging Face model directory and a text file instead (cut into documents on
the tokenizer's EOS text, e.g. ``<|endoftext|>``, else on blank lines: one window from each document's
start, with the model's BOS, short documents padded and their padding left out of CE).
The Lorsa trains with the default :class:`~.training.LorsaRecipe` (QK and OV from the MHSA and one
batch, closed-form output scale and ``b_D``; docs/training.md, "The Lorsa training recipe").
"""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["DemoConfig", "load_model", "run_demo"]


@dataclass
class DemoConfig:
    """What the demo trains and how long."""

    model_dir: str | None = None
    text_path: str | None = None
    layer: int | None = None  # default: the middle layer
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 1500
    n_ov_heads: int | None = None  # default: 8 * d_model (the paper's ratio)
    qk_heads_per_mhsa_head: int = 4
    top_k: int = 16
    lr: float = 4e-3
    heldout_windows: int = 64
    n_show: int = 5
    out_dir: str | None = None
    seed: int = 0
    progress: bool = True


def load_model(model_dir: str | None = None) -> Any:
    """An nnsight ``TransformersModel`` from a local Hugging Face directory (default: the embedded one).

    Loads offline (``HF_HUB_OFFLINE=1`` unless already set): nothing is downloaded.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from nnsight import TransformersModel
    from transformers import AutoTokenizer

    from .assets import default_model_dir

    path = str(model_dir or default_model_dir())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tokenizer = AutoTokenizer.from_pretrained(path)
        return TransformersModel(path, task="text-generation", tokenizer=tokenizer, dispatch=True,
                                 dtype=torch.float32, device="cpu")


def _context(tokenizer: Any, ids: torch.Tensor, pos: int, width: int = 12) -> str:
    left = tokenizer.decode(ids[max(1, pos - width):pos])
    tok = tokenizer.decode(ids[pos:pos + 1])
    right = tokenizer.decode(ids[pos + 1:pos + 4])
    return (left + "[[" + tok + "]]" + right).replace("\n", "⏎")


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Train, evaluate, splice and inspect; return (and optionally write) the measured numbers."""
    from .adapters.registry import get_adapter
    from .analysis.top_activations import TopActivations
    from .assets import default_corpus_path
    from .envoy.lorsa_set import LorsaSet
    from .envoy.read import attention_activations
    from .modules.lorsa import Lorsa
    from .modules.lorsa_config import LorsaConfig
    from .training import ActivationSource, TokenDataset, TrainConfig, Trainer, evaluate

    torch.manual_seed(cfg.seed)
    t0 = time.time()
    model = load_model(cfg.model_dir)
    adapter = get_adapter(model)
    layer = adapter.n_layers // 2 if cfg.layer is None else adapter.check_layer(cfg.layer)
    text = Path(cfg.text_path or default_corpus_path()).read_text(encoding="utf-8")
    # the embedded corpus is one document (consecutive windows, the numbers in docs/training.md);
    # a --text file is cut into documents (EOS text, else blank lines), one window at each start
    data = TokenDataset.from_text(model.tokenizer, text, cfg.seq_len, config=model.config,
                                  document_separator="auto" if cfg.text_path else None)
    train, heldout = data.split(min(0.2, cfg.heldout_windows / len(data)))
    mhsa = adapter.mhsa_weights(model._module, layer)
    n_ov = cfg.n_ov_heads or 8 * adapter.d_model
    lcfg = LorsaConfig(
        d_model=adapter.d_model, n_qk_heads=mhsa.n_heads * cfg.qk_heads_per_mhsa_head, d_qk_head=mhsa.head_dim,
        n_ov_heads=n_ov, top_k=cfg.top_k, rotary=mhsa.rotary, attn_scale=1.0 / mhsa.scale,
        qk_norm=mhsa.q_norm is not None, qk_norm_eps=mhsa.qk_norm_eps, layer=layer, architecture=adapter.family,
    )
    lorsa = Lorsa(lcfg)
    print(f"model: {cfg.model_dir or 'embedded tinyshakespeare Llama'} ({adapter.family}, {adapter.n_layers} layers, "
          f"d_model {adapter.d_model}); corpus: {len(data)} windows x {cfg.seq_len} tokens"
          f"{' (one per document, from its start)' if data.target_mask is not None else ''}")
    print(f"Lorsa for layer {layer}: {lcfg.n_qk_heads} QK heads x {lcfg.d_qk_head}, {n_ov} OV heads, top_k {cfg.top_k}")
    source = ActivationSource.attention(model, layer, train, cfg.batch_size, seed=cfg.seed)
    trainer = Trainer(lorsa, source, TrainConfig(total_steps=cfg.steps, lr=cfg.lr), mhsa=mhsa)
    trainer.train(progress=cfg.progress)
    t_train = time.time() - t0
    folded = trainer.folded()
    assert isinstance(folded, Lorsa)
    lorsas = LorsaSet(model, {layer: folded})

    ev = evaluate(lorsas, heldout, at=layer, batch_size=cfg.batch_size)
    numbers = ev.summary()
    print(f"\nheld-out evaluation ({ev.n_tokens} tokens):")
    print(f"  FVU {ev.fvu:.4f}   L0 {ev.l0:.2f}   dead heads {ev.dead_frac:.1%}")
    print(f"  CE orig {ev.ce_orig:.4f}   CE lorsa {ev.ce_spliced:.4f}   CE zero-ablated {ev.ce_zero:.4f}   "
          f"(CE recovered {ev.ce_recovered:.1%})")

    # the flagship: replace MHSA by Lorsa inside a trace and read its heads there
    import nnsight

    prompt = "ROMEO:\nBut soft, what light through yonder window breaks?"
    with model.trace(prompt):
        site = lorsas.replace(layer=layer)
        z = nnsight.save(site.hook_z.output)
        logits = nnsight.save(model.lm_head.output)
    next_tok = model.tokenizer.decode(logits[0, -1].argmax())
    active = (z[0, -1] > 0).nonzero().flatten().tolist()
    print(f"\nwith model.trace(prompt): lorsa.replace(layer={layer}) -> next token {next_tok!r}; "
          f"{len(active)} heads active on the last token: {active[:10]}")

    # top heads with their top-activating contexts and z-patterns
    top = TopActivations.empty(n_ov, n_top=3)
    keep = torch.ones(heldout.tokens.shape, dtype=torch.bool) if heldout.target_mask is None \
        else heldout.target_mask.clone()
    keep[:, 0] = False  # BOS and padding never shown
    for i in range(0, len(heldout), cfg.batch_size):
        ids = heldout.tokens[i:i + cfg.batch_size]
        with model.trace(ids, use_cache=False):
            z_b = nnsight.save(lorsas.replace(layer=layer).hook_z.output)
        top.update(z_b, i, keep[i:i + cfg.batch_size])
    shown = []
    print(f"\ntop {cfg.n_show} heads (by max activation) on held-out text:")
    for h in top.top_heads(cfg.n_show):
        print(f"  head {h} (QK group {h // lcfg.group_size}, active on {top.frequency[h]:.2%} of tokens)")
        for v, w, p in zip(top.values[h].tolist(), top.window[h].tolist(), top.position[h].tolist(), strict=True):
            if w < 0:
                continue
            ids = heldout.tokens[w]
            act = attention_activations(model, layer, ids[None], adapter=adapter)
            zp = folded.z_pattern(act.x, [h], act.positions)[0, 0, p, : p + 1]
            keys = zp.abs().topk(min(3, p + 1)).indices.tolist()
            contrib = ", ".join(f"{model.tokenizer.decode(ids[k:k + 1])!r}@{k - p}:{zp[k]:+.2f}" for k in keys)
            print(f"    z={v:6.2f}  {_context(model.tokenizer, ids, p)}")
            print(f"             z-pattern (key, offset, contribution): {contrib}")
            shown.append({"head": h, "z": v, "window": w, "position": p})
    result = {"layer": layer, "config": lcfg.to_dict(), "steps": cfg.steps, "batch_size": cfg.batch_size,
              "seq_len": cfg.seq_len, "train_seconds": round(t_train, 1), "total_seconds": round(time.time() - t0, 1),
              "eval": numbers, "top_heads": shown}
    print(f"\ntotal time {result['total_seconds']} s (training {result['train_seconds']} s)")
    if cfg.out_dir:
        out = Path(cfg.out_dir)
        lorsas.save(out / "lorsa")
        (out / "demo_results.json").write_text(json.dumps(result, indent=1))
        print(f"saved Lorsa and results to {out}")
    return result
