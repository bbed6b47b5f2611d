"""Llamascopium's side of the attribution check, run by ``run.py`` in the peer's virtual environment (it imports
llamascopium, torch and safetensors, never nnsight_lorsa)::

    V/bin/python their_side.py MODEL_DIR CASE_DIR OPTS_JSON

For each layer of the Hugging Face model in ``MODEL_DIR`` (loaded as their TransformerLens model), writes a random
Lorsa (``CASE_DIR/lorsa_<L>``, on ``blocks.L.ln1.hook_normalized`` -> ``blocks.L.hook_attn_out``) and a random
transcoder (``CASE_DIR/tc_<L>``, ``blocks.L.ln2.hook_normalized`` -> ``blocks.L.hook_mlp_out``) with THEIR save code,
reloads them with THEIR ``SparseDictionary.from_pretrained``, runs THEIR ``attribute`` (every active feature kept,
QK tracing on) and ``qk_trace`` (top-``qk_big`` terms for the heads ``attribute`` traced), and writes
``CASE_DIR/theirs.safetensors`` (graph, activations, logits, raw caches) and ``CASE_DIR/theirs.json``.

``OPTS_JSON`` (a case of ``run.py``): ``tokens`` and ``seed``, and optionally ``lorsa`` / ``tc`` (false: no
such modules), ``lorsa_act`` / ``tc_act``, ``lorsa_k`` / ``tc_k``, ``lorsa_ef`` / ``tc_ef``, ``n_qk``, ``adj``
(adjacent-pair RoPE), ``sidn`` (``sparsity_include_decoder_norm``), ``qk_scale``, ``b_E_shift``, ``lorsa_extra``
(more ``LorsaConfig`` fields), ``qk`` (false: no QK tracing), ``qk_frac``, ``qk_topk``, ``qk_big``, ``detach_mlp``
(also detach ``blocks.L.hook_mlp_out`` in their attribution, as ours treats an MLP without a transcoder).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import llamascopium.circuits.attribution as ls_attribution
import torch
from llamascopium.backend.language_model import LanguageModelConfig, TransformerLensLanguageModel
from llamascopium.circuits.attribution import attribute, collect_cache, qk_trace
from llamascopium.models.lorsa import LorsaConfig, LowRankSparseAttention
from llamascopium.models.sae import SAEConfig, SparseAutoEncoder
from llamascopium.models.sparse_dictionary import SparseDictionary
from safetensors.torch import save_file


def load_model(model_dir: Path) -> TransformerLensLanguageModel:
    """Their TransformerLens model of a local Hugging Face folder (fp32, CPU, default processing).

    Loaded by the folder's own name from its parent (the working directory changes): TransformerLens guesses the
    architecture from the model name when it contains "llama", "gemma", ... and then never reads ``config.json``,
    so a path such as ``/tmp/llamascopium/...`` would fail. ``run.py`` names the folders ``m_tiny_l`` / ``m_tiny_q``.
    """
    os.chdir(model_dir.parent)
    cfg = LanguageModelConfig(model_name=model_dir.name, model_from_pretrained_path=model_dir.name,
                              backend="transformer_lens", device="cpu", dtype=torch.float32, local_files_only=True)
    return TransformerLensLanguageModel(cfg)


def randomize(module: torch.nn.Module, seed: int, scales: dict[str, float], opts: dict[str, Any]) -> None:
    """Every parameter ~ N(0, scale²) (0.15 unless in ``scales``), in parameter order from one generator; ``b_E``
    shifted by ``b_E_shift``, JumpReLU log-thresholds around log 0.3, norm gains around 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            v = torch.randn(p.shape, generator=g) * scales.get(name, 0.15)
            if name == "b_E":
                v = v + opts.get("b_E_shift", -0.3)
            if "log_jumprelu_threshold" in name:
                v = math.log(0.3) + torch.randn(p.shape, generator=g) * 0.3
            if name.startswith("ln_"):
                v = 1.0 + v
            p.copy_(v.to(p.dtype))


def write_and_reload(module: LowRankSparseAttention | SparseAutoEncoder, folder: Path) -> SparseDictionary:
    """Save with their code (weights + config), reload with their ``from_pretrained``."""
    module.save_pretrained(folder)
    module.cfg.save_hyperparameters(folder)
    return SparseDictionary.from_pretrained(str(folder), device="cpu", dtype=torch.float32)


def make_modules(opts: dict[str, Any], case: Path, n_layers: int, d_model: int) -> list[SparseDictionary]:
    """Per layer: the Lorsa, then the transcoder (those the case asks for), written and reloaded by their code."""
    seed = opts.get("seed", 0)
    qk_scale = opts.get("qk_scale", 0.08)
    modules = []
    for layer in range(n_layers):
        if opts.get("lorsa", True):
            kw = dict(sae_type="lorsa", d_model=d_model, expansion_factor=opts.get("lorsa_ef", 0.5),
                      n_qk_heads=opts.get("n_qk", 4), d_qk_head=16, positional_embedding_type="rotary", rotary_dim=16,
                      rotary_base=10000, rotary_adjacent_pairs=opts.get("adj", False), n_ctx=64,
                      hook_point_in=f"blocks.{layer}.ln1.hook_normalized",
                      hook_point_out=f"blocks.{layer}.hook_attn_out", act_fn=opts.get("lorsa_act", "topk"),
                      top_k=opts.get("lorsa_k", 6), use_decoder_bias=True,
                      sparsity_include_decoder_norm=opts.get("sidn", False), norm_activation="inference",
                      device="cpu", dtype=torch.float32)
            kw.update(opts.get("lorsa_extra", {}))
            lorsa = LowRankSparseAttention(LorsaConfig(**kw))
            randomize(lorsa, seed * 100 + layer, {"W_Q": qk_scale, "W_K": qk_scale, "b_Q": 0.1, "b_K": 0.1}, opts)
            modules.append(write_and_reload(lorsa, case / f"lorsa_{layer}"))
        if opts.get("tc", True):
            kw = dict(sae_type="sae", d_model=d_model, expansion_factor=opts.get("tc_ef", 2),
                      hook_point_in=f"blocks.{layer}.ln2.hook_normalized",
                      hook_point_out=f"blocks.{layer}.hook_mlp_out", act_fn=opts.get("tc_act", "topk"),
                      top_k=opts.get("tc_k", 6), use_decoder_bias=True,
                      sparsity_include_decoder_norm=opts.get("sidn", False), norm_activation="inference",
                      device="cpu", dtype=torch.float32)
            tc = SparseAutoEncoder(SAEConfig(**kw))
            randomize(tc, seed * 100 + 50 + layer, {}, opts)
            modules.append(write_and_reload(tc, case / f"tc_{layer}"))
    return modules


def detach_mlp_outputs() -> None:
    """Make their attribution also detach every ``blocks.L.hook_mlp_out`` (on top of its norm-scale hooks)."""
    original = ls_attribution.ln_detach_hooks

    def hooks(model: Any) -> list[str]:
        return original(model) + [f"blocks.{i}.hook_mlp_out" for i in range(len(model.blocks))]

    ls_attribution.ln_detach_hooks = hooks


class NodeKeys:
    """Their node dimensions as ``(n, 3)`` int rows ``(key id, index 0, index 1 or -1)``; ``names`` maps ids back."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def rows(self, dimension: Any) -> torch.Tensor:
        rows = []
        for node in dimension:
            key = self.ids.setdefault(node.key, len(self.ids))
            idx = node.indices[0].tolist()
            rows.append([key] + idx + [-1] * (2 - len(idx)))
        return torch.tensor(rows, dtype=torch.long).reshape(-1, 3)

    @property
    def names(self) -> dict[int, str]:
        return {v: k for k, v in self.ids.items()}


def qk_entries(result: Any, features: Any) -> list[dict[str, Any]]:
    """One entry per traced head: its node, and the (key, indices, value) terms of both marginals and the pairs."""
    entries = []
    for i, node in enumerate(features):
        entry: dict[str, Any] = {"key": node.key, "idx": node.indices[0].tolist()}
        for part in ("q_marginal", "k_marginal"):
            v = getattr(result, part).value[i]
            entry[part] = [[n.key, n.indices[0].tolist(), float(x)]
                           for n, x in zip(v.dimensions[0], v.value, strict=True)]
        v = result.pairs.value[i]
        entry["pairs"] = [[a.key, a.indices[0].tolist(), b.key, b.indices[0].tolist(), float(x)]
                          for a, b, x in zip(v.dimensions[0], v.dimensions[1], v.value, strict=True)]
        entries.append(entry)
    return entries


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    model_dir, case, opts = Path(argv[0]).resolve(), Path(argv[1]).resolve(), json.loads(argv[2])
    case.mkdir(parents=True, exist_ok=True)
    if opts.get("detach_mlp"):
        detach_mlp_outputs()
    model = load_model(model_dir)
    modules = make_modules(opts, case, model.cfg.n_layers, model.cfg.d_model)

    tokens = torch.tensor(opts["tokens"])
    with torch.no_grad():
        _, cache = collect_cache(model, tokens[None].repeat(2, 1), modules)
    n_feat = sum(int((cache[m.cfg.hook_point_out + ".sae.hook_feature_acts.post"][0] != 0).sum()) for m in modules)
    print("active features", n_feat)

    t0 = time.time()
    res = attribute(model, tokens, modules, max_n_logits=opts.get("max_n_logits", 10), desired_logit_prob=0.95,
                    batch_size=opts.get("batch", 64), max_features=n_feat, enable_qk_tracing=opts.get("qk", True),
                    qk_top_fraction=opts.get("qk_frac", 0.3), qk_topk=opts.get("qk_topk", 10))
    attribute_s = time.time() - t0
    print("attribute s", attribute_s)

    keys = NodeKeys()
    out = {"A": res.attribution.data.detach().float(), "rows": keys.rows(res.attribution.dimensions[0]),
           "cols": keys.rows(res.attribution.dimensions[1]), "act": res.activations.data.detach().float(),
           "act_nodes": keys.rows(res.activations.dimensions[0]), "logits": res.logits[0].float(),
           "probs": res.probs.float(), "logit_ids": torch.tensor(res.logit_token_ids)}
    for m in modules:  # raw caches: feature activations, error terms, Lorsa attention scores
        hp = m.cfg.hook_point_out
        out[f"cache/{hp}/acts"] = cache[hp + ".sae.hook_feature_acts.post"][0].detach()
        out[f"cache/{hp}/error"] = cache[hp + ".error.post"][0].detach()
        if isinstance(m, LowRankSparseAttention):
            out[f"cache/{hp}/score"] = cache[hp + ".sae.hook_attn_score"][0].detach()

    qk_big = opts.get("qk_big", 60)
    qk: list[dict[str, Any]] = []
    if opts.get("qk", True) and res.qk_trace_results is not None:
        features = res.qk_trace_results.q_marginal.dimensions[0]
        qk = qk_entries(qk_trace(model, tokens, modules, features, topk=qk_big, batch_size=1), features)

    save_file({k: v.contiguous() for k, v in out.items()}, str(case / "theirs.safetensors"))
    meta = {"keys": keys.names, "opts": opts, "n_feat": n_feat, "qk_topk": qk_big, "qk": qk,
            "attribute_s": attribute_s,
            "versions": {p: version(p) for p in ("llamascopium", "torch", "transformer-lens", "transformers")}}
    (case / "theirs.json").write_text(json.dumps(meta))
    print("done", tuple(out["A"].shape), "keys", meta["keys"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
