"""Llamascopium's side of the Lorsa-analysis check, run by ``run.py`` in the peer's virtual environment (it imports
llamascopium, transformer-lens, torch and safetensors, never nnsight_lorsa)::

    V/bin/python their_side.py MODEL_DIR CASE_DIR OPTS_JSON

Builds one random Lorsa of ``OPTS["layer"]`` (``blocks.L.ln1.hook_normalized`` -> ``blocks.L.hook_attn_out``) with
THEIR ``LowRankSparseAttention``, writes it with THEIR save code (``save_pretrained`` + ``save_hyperparameters``) to
``CASE_DIR/lorsa``, reloads it with THEIR ``SparseDictionary.from_pretrained``, and on random token windows (BOS at
column 0, no BOS elsewhere) computes with THEIR code:

- ``x``: the Lorsa input (their TransformerLens model, default processing) and ``acts``: their ``encode`` (head
  activations);
- ``zp``: their ``encode_z_pattern_for_head`` of every head on the first ``n_zp`` windows ``(n_zp, heads, q, k)``;
- the top activations: their ``FeatureAnalyzer.analyze_chunk`` (one ``top_activations`` subsample of ``n_top``
  windows, BOS and padding ignored as their ``to_activations`` mask does; ``pad_rows`` ``{row: column}`` right-pads
  rows with ``pad``) with their ``LorsaPostAnalysisProcessor`` (the
  dashboards' z-patterns), fed by a minimal activation factory that yields the same windows;
- the OV logit lens: their ``DirectLogitAttributor`` (``top_k``) and the full matrix ``compute_logits_and_d_sae``
  returns, with their ``unembed(ln_final(0))`` (the logits of the zero vector: ``b_U``) to tell bias from head.

Writes ``CASE_DIR/theirs.safetensors`` and ``CASE_DIR/theirs.json``.
"""

from __future__ import annotations

import json
import math
import os
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from llamascopium.analysis.direct_logit_attributor import (
    DirectLogitAttributor,
    DirectLogitAttributorConfig,
    compute_logits_and_d_sae,
)
from llamascopium.analysis.feature_analyzer import FeatureAnalyzer, FeatureAnalyzerConfig
from llamascopium.backend.language_model import LanguageModelConfig, TransformerLensLanguageModel
from llamascopium.models.lorsa import LorsaConfig, LowRankSparseAttention
from llamascopium.models.sparse_dictionary import SparseDictionary
from safetensors.torch import save_file


def load_model(model_dir: Path) -> TransformerLensLanguageModel:
    """Their TransformerLens model of a local Hugging Face folder (fp32, CPU, default processing), loaded by the
    folder's own name from its parent (TransformerLens guesses the architecture from a name holding "llama",
    "gpt2", ...: ``run.py`` names the folders without them)."""
    os.chdir(model_dir.parent)
    cfg = LanguageModelConfig(model_name=model_dir.name, model_from_pretrained_path=model_dir.name,
                              backend="transformer_lens", device="cpu", dtype=torch.float32, local_files_only=True)
    return TransformerLensLanguageModel(cfg)


def make_lorsa(opts: dict[str, Any], d_model: int, case: Path) -> LowRankSparseAttention:
    """A random Lorsa written and reloaded by their code."""
    layer = opts["layer"]
    kw: dict[str, Any] = dict(
        sae_type="lorsa", d_model=d_model, expansion_factor=opts.get("ef", 1), n_qk_heads=opts.get("n_qk", 4),
        d_qk_head=16, positional_embedding_type=opts.get("pe", "rotary"), rotary_dim=16, rotary_base=10000,
        rotary_adjacent_pairs=opts.get("adj", False), n_ctx=64, hook_point_in=f"blocks.{layer}.ln1.hook_normalized",
        hook_point_out=f"blocks.{layer}.hook_attn_out", act_fn=opts.get("act", "topk"), top_k=opts.get("k", 8),
        use_decoder_bias=True, sparsity_include_decoder_norm=opts.get("sidn", False), norm_activation="inference",
        device="cpu", dtype=torch.float32)
    kw.update(opts.get("extra", {}))
    lorsa = LowRankSparseAttention(LorsaConfig(**kw))
    g = torch.Generator().manual_seed(opts["seed"])
    qk_scale = opts.get("qk_scale", 0.15)
    with torch.no_grad():
        for name, p in lorsa.named_parameters():
            scale = {"W_Q": qk_scale, "W_K": qk_scale, "b_Q": 0.1, "b_K": 0.1}.get(name, 0.15)
            v = torch.randn(p.shape, generator=g) * scale
            if name == "W_O":  # heads of different norms, so a decoder-norm convention shows
                v = v * torch.exp(torch.randn(p.shape[0], 1, generator=g) * 0.5)
            if "log_jumprelu_threshold" in name:
                v = math.log(0.05) + torch.randn(p.shape, generator=g) * 0.3
            if name.startswith("ln_"):
                v = 1.0 + v
            p.copy_(v)
    folder = case / "lorsa"
    lorsa.save_pretrained(folder)
    lorsa.cfg.save_hyperparameters(folder)
    again = SparseDictionary.from_pretrained(str(folder), device="cpu", dtype=torch.float32)
    assert isinstance(again, LowRankSparseAttention)
    return again


class Factory:
    """The part of their ``ActivationFactory`` that ``FeatureAnalyzer.analyze_chunk`` and the Lorsa post-analysis
    use: ``process()`` yields batches ``{hook_point_in, tokens, mask, meta: [{"context_idx": i}]}`` (``mask`` as their
    ``TransformerLensLanguageModel.to_activations`` makes it: not BOS, not padding)."""

    def __init__(self, hook: str, x: torch.Tensor, tokens: torch.Tensor, bos: int, pad: int, batch: int) -> None:
        self.hook, self.x, self.tokens, self.bos, self.pad, self.batch = hook, x, tokens, bos, pad, batch

    def process(self, **_: Any):
        for i in range(0, self.tokens.shape[0], self.batch):
            t = self.tokens[i:i + self.batch]
            yield {self.hook: self.x[i:i + self.batch], "tokens": t, "mask": (t.ne(self.bos) & t.ne(self.pad)).int(),
                   "meta": [{"context_idx": i + j} for j in range(t.shape[0])]}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    model_dir, case, opts = Path(argv[0]).resolve(), Path(argv[1]).resolve(), json.loads(argv[2])
    case.mkdir(parents=True, exist_ok=True)
    model = load_model(model_dir)
    lorsa = make_lorsa(opts, model.cfg.d_model, case)
    hook = lorsa.cfg.hook_point_in

    g = torch.Generator().manual_seed(opts["seed"] + 1000)
    n, pos = opts.get("n_windows", 24), opts.get("pos", 16)
    bos = opts.get("bos", 0)
    tokens = torch.randint(2, model.cfg.d_vocab, (n, pos), generator=g)
    tokens[:, 0] = bos
    pad = opts.get("pad", 1)
    for row, col in opts.get("pad_rows", {}).items():  # right padding: their mask leaves it out, as BOS
        tokens[int(row), col:] = pad
    out: dict[str, torch.Tensor] = {"tokens": tokens}
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=[hook])
        x = cache[hook].float()
        out["x"] = x
        out["acts"] = lorsa.encode(x)
        n_zp = opts.get("n_zp", 4)
        heads = torch.arange(lorsa.cfg.n_ov_heads)
        out["zp"] = torch.stack([lorsa.encode_z_pattern_for_head(x[w:w + 1], heads) for w in range(n_zp)])
        out["decoder_norm"] = lorsa.decoder_norm().float()
        out["W_O"] = lorsa.W_O.detach().float()

        # top activations + post analysis (z patterns of the samples)
        n_top = opts.get("n_top", 6)
        analyzer = FeatureAnalyzer(FeatureAnalyzerConfig(
            total_analyzing_tokens=n * pos, subsamples={"top_activations": {"proportion": 1.0, "n_samples": n_top}}))
        factory = Factory(hook, x, tokens, bos, pad, opts.get("batch", 5))
        res = analyzer.analyze_chunk(factory, lorsa)  # type: ignore[arg-type]
        out["act_times"] = torch.tensor([r["act_times"] for r in res])
        out["max_feature_acts"] = torch.tensor([r["max_feature_acts"] for r in res])
        n_analyzed = res[0]["n_analyzed_tokens"]
        samples = []
        for r in res:
            s = r["samplings"][0]
            ctx = s["context_idx"].tolist()
            fa_idx, fa_val = s["feature_acts_indices"], s["feature_acts_values"]  # (2, nnz): sample, position
            zp_idx, zp_val = s["z_pattern_indices"], s["z_pattern_values"]  # (3, nnz): sample, query, key
            per = []
            for j, w in enumerate(ctx):
                m = fa_idx[0] == j
                acts = {int(p): float(v) for p, v in zip(fa_idx[1][m], fa_val[m], strict=True)}
                zm = zp_idx[0] == j
                zps = [[int(q), int(k), float(v)] for q, k, v in zip(zp_idx[1][zm], zp_idx[2][zm], zp_val[zm],
                                                                     strict=True)]
                per.append({"context_idx": int(w), "acts": acts, "zp": zps})
            samples.append(per)

        # OV logit lens (their direct logit attribution)
        logits, _ = compute_logits_and_d_sae(lorsa, model)
        out["dla_logits"] = logits.float()
        out["dla_zero"] = model.unembed(model.ln_final(torch.zeros(1, 1, model.cfg.d_model)))[0, 0].float()
        top_k = opts.get("lens_k", 10)
        dla = DirectLogitAttributor(DirectLogitAttributorConfig(top_k=top_k)).direct_logit_attribute(lorsa, model)
        out["dla_top_logits"] = torch.tensor([[t["logit"] for t in d["top_positive"]] for d in dla])
        out["dla_top_ids"] = logits.topk(top_k, dim=-1).indices

    save_file({k: v.contiguous() for k, v in out.items()}, str(case / "theirs.safetensors"))
    meta = {"opts": opts, "n_analyzed_tokens": n_analyzed, "samples": samples,
            "normalization_type": model.cfg.normalization_type,
            "dla_top_tokens": [[t["token"] for t in d["top_positive"]] for d in dla],
            "versions": {p: version(p) for p in ("llamascopium", "torch", "transformer-lens", "transformers")}}
    (case / "theirs.json").write_text(json.dumps(meta))
    print("done", {k: tuple(v.shape) for k, v in out.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
