"""circuit-tracer's side of the check, run by ``run.py`` in circuit-tracer's own venv (never imports nnsight_lorsa)::

    V/bin/python their_side.py CASE_DIR SPEC_JSON [--prune]

From the case's spec (``cases.py``): a random tiny Hugging Face model of the family with a word-level tokenizer
(``CASE_DIR/model``), the same model as circuit-tracer's TransformerLens ``TransformerLensReplacementModel`` (weights
converted by TransformerLens; its logits must equal the model's), random transcoders made with circuit-tracer's
classes (per-layer ``SingleLayerTranscoder`` sets or a ``CrossLayerTranscoder``, encoder biases calibrated so that a
fraction ``frac`` of the features fire at positions ≥ 1), written with circuit-tracer's ``to_safetensors`` and a
``config.yaml`` (``CASE_DIR/transcoders``) and read back with circuit-tracer's loaders; then circuit-tracer's
``attribute``. TopK sets cannot be written as circuit-tracer files (its config has no word for TopK): their tensors
go to ``transcoders/topk_raw.safetensors`` for our side to build from.

Spec keys read only here: ``ct_no_dedup`` (switch circuit-tracer's ``_deduplicate_attention_buffers`` off) and
``ct_pad_skip`` (circuit-tracer reads a copy of a mixed skip / no-skip set in which every layer without a skip
connection has an all-zero ``W_skip``: ``CASE_DIR/transcoders_ct``; our side reads the mixed set).

Writes ``CASE_DIR/theirs.safetensors`` (token ids, dense adjacency, active / selected features, activations, logit
ids and probabilities, error vectors, the model's last-position logits) and ``CASE_DIR/theirs.json`` (spec, shapes,
circuit-tracer's logits against the model's before and after ``_configure_replacement_model``, the set's skip
flags, versions). With ``--prune``: ``prune_graph`` at (0.8, 0.98) and (0.5, 0.9) and ``compute_graph_scores`` on
the graph ``attribute`` returned, to ``CASE_DIR/theirs_prune.safetensors`` and ``theirs.json["scores"]``.
"""

from __future__ import annotations

import json
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from circuit_tracer.attribution.attribute import attribute
from circuit_tracer.graph import compute_graph_scores, prune_graph
from circuit_tracer.replacement_model.replacement_model_transformerlens import TransformerLensReplacementModel
from circuit_tracer.transcoder.activation_functions import JumpReLU, TopK
from circuit_tracer.transcoder.cross_layer_transcoder import CrossLayerTranscoder, load_clt
from circuit_tracer.transcoder.single_layer_transcoder import (
    SingleLayerTranscoder,
    TranscoderSet,
    load_transcoder_set,
)
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformer_lens import HookedTransformerConfig
from transformers import PreTrainedTokenizerFast

WORDS = ("the", "cat", "sat", "on", "mat", "dog", "ran", "to", "park", "a", "big", "small", "red", "blue",
         "and", "was", "is", "it", "he", "she", "they", "saw", "found", "went", "home", "tree", "house",
         "bird", "sang", "song", "day", "night", "sun", "moon", "star", "sky", "sea", "fish", "boat", "rain")
CPU = torch.device("cpu")
PRUNE_THRESHOLDS = ((0.8, 0.98), (0.5, 0.9))


def tokenizer(path: Path) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over :data:`WORDS` (``<bos>`` 0, ``<unk>`` 1), saved under ``path``."""
    vocab = {"<bos>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", unk_token="<unk>", eos_token="<bos>",
                                   pad_token="<bos>")
    fast.save_pretrained(str(path))
    return fast


def randomize(hf: torch.nn.Module, scale_norm: float = 0.3, scale_bias: float = 0.1) -> None:
    """Norm gains (and LayerNorm biases) ± ``scale_norm``, other biases ± ``scale_bias``: a missed scale shows."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or ".ln_" in name or name.endswith(("ln_f.weight", "ln_f.bias")):
                p.add_(torch.randn_like(p) * scale_norm)
            elif name.endswith("bias"):
                p.add_(torch.randn_like(p) * scale_bias)


def build(family: str, spec: dict[str, Any], n_vocab: int) -> tuple[Any, HookedTransformerConfig, Any]:
    """(Hugging Face model, TransformerLens config, TransformerLens weight conversion) of a tiny ``family`` model."""
    d, n_layers, n_heads = spec.get("d_model", 32), spec.get("n_layers", 3), spec.get("n_heads", 4)
    dh = spec.get("d_head", d // n_heads)
    kv = spec.get("n_kv", n_heads // 2)
    dm = spec.get("d_mlp", 2 * d)
    pad = spec.get("pad", 0)
    torch.manual_seed(spec["seed"])
    common = dict(n_layers=n_layers, d_model=d, d_head=dh, n_heads=n_heads, d_mlp=dm, n_ctx=64, d_vocab=n_vocab,
                  dtype=torch.float32, device="cpu", default_prepend_bos=False, tokenizer_prepends_bos=True)
    rotary = dict(positional_embedding_type="rotary", rotary_adjacent_pairs=False, rotary_dim=dh, final_rms=True,
                  gated_mlp=True, normalization_type="RMS")
    if family == "llama":
        from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights as conv
        from transformers import LlamaConfig, LlamaForCausalLM

        hf = LlamaForCausalLM(LlamaConfig(
            vocab_size=n_vocab, hidden_size=d, intermediate_size=dm, num_hidden_layers=n_layers,
            num_attention_heads=n_heads, num_key_value_heads=kv, head_dim=dh, max_position_embeddings=64,
            rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=0.2, tie_word_embeddings=False, bos_token_id=0,
            eos_token_id=0, pad_token_id=pad, hidden_act="silu"))
        cfg = HookedTransformerConfig(**common, **rotary, eps=1e-5, act_fn="silu",
                                      n_key_value_heads=kv if kv != n_heads else None, rotary_base=10000,
                                      original_architecture="LlamaForCausalLM")
    elif family == "gemma2":
        from transformer_lens.pretrained.weight_conversions.gemma import convert_gemma_weights as conv
        from transformers import Gemma2Config, Gemma2ForCausalLM

        window = spec.get("window")
        hf = Gemma2ForCausalLM(Gemma2Config(
            vocab_size=n_vocab, hidden_size=d, intermediate_size=dm, num_hidden_layers=n_layers,
            num_attention_heads=n_heads, num_key_value_heads=kv, head_dim=dh, max_position_embeddings=64,
            rms_norm_eps=1e-6, rope_theta=10000.0, initializer_range=0.2, tie_word_embeddings=True, bos_token_id=0,
            eos_token_id=0, pad_token_id=pad, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=dh,
            sliding_window=window or 4096, attn_logit_softcapping=spec.get("attn_cap", 5.0),
            final_logit_softcapping=spec.get("final_cap", 3.0), attn_implementation="eager"))
        cfg = HookedTransformerConfig(
            **common, **rotary, eps=1e-6, act_fn="gelu_pytorch_tanh", n_key_value_heads=kv if kv != n_heads else None,
            rotary_base=10000, use_attn_scale=True, attn_scores_soft_cap=spec.get("attn_cap", 5.0),
            output_logits_soft_cap=spec.get("final_cap", 3.0), use_normalization_before_and_after=True,
            use_local_attn=bool(window), window_size=window,
            attn_types=["local" if i % 2 == 0 else "global" for i in range(n_layers)] if window else None,
            original_architecture="Gemma2ForCausalLM")
    elif family == "gemma3":
        from transformer_lens.pretrained.weight_conversions.gemma import convert_gemma_weights as conv
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        window = spec.get("window", 4096)
        types = spec.get("layer_types", ["sliding_attention", "full_attention"] * 2)[:n_layers]
        hf = Gemma3ForCausalLM(Gemma3TextConfig(
            vocab_size=n_vocab, hidden_size=d, intermediate_size=dm, num_hidden_layers=n_layers,
            num_attention_heads=n_heads, num_key_value_heads=kv, head_dim=dh, max_position_embeddings=64,
            rms_norm_eps=1e-6, rope_theta=1e6, rope_local_base_freq=10000.0, query_pre_attn_scalar=dh,
            sliding_window=window, layer_types=types, hidden_activation="gelu_pytorch_tanh", initializer_range=0.2,
            tie_word_embeddings=True, final_logit_softcapping=None, attn_logit_softcapping=None, bos_token_id=0,
            eos_token_id=0, pad_token_id=pad, attn_implementation="eager"))
        cfg = HookedTransformerConfig(
            **common, **rotary, eps=1e-6, act_fn="gelu_pytorch_tanh", n_key_value_heads=kv if kv != n_heads else None,
            rotary_base=1000000, rotary_base_local=10000, use_attn_scale=True, use_qk_norm=True,
            use_normalization_before_and_after=True, use_local_attn=True, window_size=window,
            attn_types=["local" if t == "sliding_attention" else "global" for t in types],
            original_architecture="Gemma3ForCausalLM")
    elif family in ("qwen2", "qwen3"):
        if family == "qwen2":
            from transformer_lens.pretrained.weight_conversions.qwen2 import convert_qwen2_weights as conv
            from transformers import Qwen2Config as Config
            from transformers import Qwen2ForCausalLM as Model

            extra = {}
        else:
            from transformer_lens.pretrained.weight_conversions.qwen3 import convert_qwen3_weights as conv
            from transformers import Qwen3Config as Config
            from transformers import Qwen3ForCausalLM as Model

            extra = {"head_dim": dh}
        hf = Model(Config(
            vocab_size=n_vocab, hidden_size=d, intermediate_size=dm, num_hidden_layers=n_layers,
            num_attention_heads=n_heads, num_key_value_heads=kv, max_position_embeddings=64, rms_norm_eps=1e-6,
            rope_theta=10000.0, initializer_range=0.2, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
            pad_token_id=pad, hidden_act="silu", use_sliding_window=False, **extra))
        cfg = HookedTransformerConfig(
            **common, **rotary, eps=1e-6, act_fn="silu", n_key_value_heads=kv, rotary_base=10000,
            use_attn_scale=True, use_qk_norm=family == "qwen3",
            original_architecture="Qwen2ForCausalLM" if family == "qwen2" else "Qwen3ForCausalLM")
    elif family == "gpt2":
        from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights as conv
        from transformers import GPT2Config, GPT2LMHeadModel

        hf = GPT2LMHeadModel(GPT2Config(
            vocab_size=n_vocab, n_positions=64, n_embd=d, n_layer=n_layers, n_head=n_heads,
            activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            layer_norm_epsilon=1e-5, bos_token_id=0, eos_token_id=0, initializer_range=0.2))
        cfg = HookedTransformerConfig(**{**common, "d_mlp": 4 * d, "d_head": d // n_heads}, act_fn="gelu_new",
                                      normalization_type="LN", eps=1e-5, positional_embedding_type="standard",
                                      original_architecture="GPT2LMHeadModel")
    else:
        raise ValueError(f"unknown family {family!r}")
    hf = hf.eval().float()
    randomize(hf)
    if spec.get("zero_wpe"):
        with torch.no_grad():
            hf.transformer.wpe.weight.zero_()
    return hf, cfg, conv


def calibrate(pre: torch.Tensor, frac: float, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Encoder bias with about ``frac`` of the features active at positions ≥ 1 of ``pre`` ((pos, d_tc) encoder
    pre-activations without bias), and a JumpReLU threshold."""
    q = torch.quantile(pre[1:], 1 - frac, dim=0)
    b = -q + 0.05 * torch.randn(q.shape, generator=g)
    thr = (0.3 * (pre[1:] + b).abs().mean(0)).clamp_min(1e-3) * torch.rand(q.shape, generator=g) * 2
    return b, thr


def to_bf16(tc_dir: Path) -> None:
    """Rewrite every safetensors file of ``tc_dir`` in bfloat16 (both sides read them back as float32)."""
    for f in tc_dir.glob("*.safetensors"):
        t = load_file(str(f))
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in t.items()}, str(f))


def transcoder_inputs(model: TransformerLensReplacementModel, cache: Any, ids: torch.Tensor,
                      in_hook: str) -> torch.Tensor:
    """``(n_layers, pos, d_model)``: what each layer's transcoder reads, as TransformerLens gives it."""
    n_layers = model.cfg.n_layers
    if in_hook != "mlp.hook_in":
        return torch.stack([cache[f"blocks.{layer}.{in_hook}"][0] for layer in range(n_layers)])
    got: dict[int, torch.Tensor] = {}
    handles = [model.blocks[layer].mlp.register_forward_pre_hook(
        lambda m, a, layer=layer: got.__setitem__(layer, a[0][0].detach())) for layer in range(n_layers)]
    with torch.no_grad():
        model(ids[None])
    for h in handles:
        h.remove()
    return torch.stack([got[layer] for layer in range(n_layers)])


def per_layer_set(spec: dict[str, Any], x_in: torch.Tensor, d: int, case: Path,
                  g: torch.Generator) -> tuple[Any, dict[str, Any]]:
    """Random per-layer transcoders, written and read back by circuit-tracer (TopK: raw tensors, in memory)."""
    n_layers = x_in.shape[0]
    in_hook, out_hook = spec["hooks"]
    d_tc, frac = spec.get("d_tc", 48), spec.get("frac", 0.2)
    tc_dir = case / "transcoders"
    tcs = {}
    for layer in range(n_layers):
        act = spec["act"] if isinstance(spec["act"], str) else spec["act"][layer]
        skip = spec.get("skip", False)
        skip = skip if isinstance(skip, bool) else skip[layer]
        activation = (JumpReLU(torch.zeros(d_tc), 0.1) if act == "jumprelu"
                      else TopK(spec.get("k", 6)) if act == "topk" else F.relu)
        tc = SingleLayerTranscoder(d, d_tc, activation, layer, skip_connection=skip, device=CPU, dtype=torch.float32)
        with torch.no_grad():
            w = torch.randn(d_tc, d, generator=g) / x_in[layer].norm(dim=-1).mean() * 2
            tc.W_enc.copy_(w)
            b, thr = calibrate(x_in[layer] @ w.T, frac, g)
            tc.b_enc.copy_(b)
            if act == "jumprelu":
                tc.activation_function.threshold.copy_(thr)
                if spec.get("neg_threshold"):  # about 30 % of the thresholds below zero
                    neg = torch.rand(thr.shape, generator=g) < 0.3
                    tc.activation_function.threshold[neg] = -0.5 * thr[neg]
            tc.W_dec.copy_(torch.randn(d_tc, d, generator=g) * 0.3)
            tc.b_dec.copy_(torch.randn(d, generator=g) * 0.1)
            if skip:
                tc.W_skip.copy_(torch.randn(d, d, generator=g) * 0.1)
        tcs[layer] = tc
    info: dict[str, Any] = {}
    if "topk" in spec["act"]:
        tc_dir.mkdir(parents=True, exist_ok=True)
        save_file({f"{k}_{layer}": v.detach().contiguous() for layer, tc in tcs.items()
                   for k, v in tc.state_dict().items()}, str(tc_dir / "topk_raw.safetensors"))
        return TranscoderSet(tcs, feature_input_hook=in_hook, feature_output_hook=out_hook, scan="probe"), info
    TranscoderSet(tcs, feature_input_hook=in_hook, feature_output_hook=out_hook, scan="probe").to_safetensors(
        str(tc_dir))
    (tc_dir / "config.yaml").write_text(yaml.safe_dump({
        "model_kind": "transcoder_set", "feature_input_hook": in_hook, "feature_output_hook": out_hook,
        "scan": "probe", "transcoders": [f"layer_{i}.safetensors" for i in range(n_layers)]}, sort_keys=False))
    if spec.get("store_bf16"):
        to_bf16(tc_dir)
    read_dir = tc_dir
    if spec.get("ct_pad_skip"):  # the same transcoders, an all-zero W_skip where a layer has none
        read_dir = case / "transcoders_ct"
        read_dir.mkdir(exist_ok=True)
        for layer in range(n_layers):
            t = load_file(str(tc_dir / f"layer_{layer}.safetensors"))
            t.setdefault("W_skip", torch.zeros(d, d))
            save_file(t, str(read_dir / f"layer_{layer}.safetensors"))
        (read_dir / "config.yaml").write_text((tc_dir / "config.yaml").read_text())
    ts = load_transcoder_set({i: str(read_dir / f"layer_{i}.safetensors") for i in range(n_layers)}, "probe",
                             in_hook, out_hook, device=CPU, dtype=torch.float32, lazy_encoder=False,
                             lazy_decoder=False)
    info["skip_per_layer"] = [tc.W_skip is not None for tc in ts]
    info["set_skip_connection"] = bool(ts.skip_connection)  # circuit-tracer: layer 0's flag for the whole set
    return ts, info


def cross_layer_set(spec: dict[str, Any], x_in: torch.Tensor, d: int, case: Path,
                    g: torch.Generator) -> CrossLayerTranscoder:
    """A random cross-layer transcoder, written and read back by circuit-tracer."""
    n_layers = x_in.shape[0]
    in_hook, out_hook = spec["hooks"]
    d_tc, frac, act = spec.get("d_tc", 48), spec.get("frac", 0.2), spec["act"]
    tc_dir = case / "transcoders"
    clt = CrossLayerTranscoder(n_layers, d_tc, d, activation_function="jump_relu" if act == "jumprelu" else "relu",
                               skip_connection=False, lazy_decoder=False, lazy_encoder=False, device=CPU,
                               dtype=torch.float32, feature_input_hook=in_hook, feature_output_hook=out_hook)
    with torch.no_grad():
        for layer in range(n_layers):
            w = torch.randn(d_tc, d, generator=g) / x_in[layer].norm(dim=-1).mean() * 2
            clt.W_enc[layer].copy_(w)
            b, thr = calibrate(x_in[layer] @ w.T, frac, g)
            clt.b_enc[layer].copy_(b)
            if act == "jumprelu":
                clt.activation_function.threshold[layer, 0].copy_(thr)
            clt.W_dec[layer].copy_(torch.randn(d_tc, n_layers - layer, d, generator=g) * 0.2)
            clt.b_dec[layer].copy_(torch.randn(d, generator=g) * 0.1)
    clt.to_safetensors(str(tc_dir))
    (tc_dir / "config.yaml").write_text(yaml.safe_dump({
        "model_kind": "cross_layer_transcoder", "feature_input_hook": in_hook, "feature_output_hook": out_hook,
        "scan": "probe"}, sort_keys=False))
    if spec.get("store_bf16"):
        to_bf16(tc_dir)
    return load_clt(str(tc_dir), feature_input_hook=in_hook, feature_output_hook=out_hook, scan="probe", device=CPU,
                    dtype=torch.float32, lazy_decoder=False)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a − b| / max |b|."""
    return float((a - b).abs().max() / b.abs().max())


def main() -> None:
    torch.set_num_threads(1)
    case, spec = Path(sys.argv[1]), json.loads(sys.argv[2])
    do_prune = "--prune" in sys.argv[3:]
    case.mkdir(parents=True, exist_ok=True)
    tok = tokenizer(case / "model")
    hf, cfg, conv = build(spec["family"], spec, len(tok))
    hf.save_pretrained(str(case / "model"), safe_serialization=True)
    cfg.tokenizer_name = str(case / "model")
    model = TransformerLensReplacementModel(cfg)
    model.load_and_process_state_dict(conv(hf, cfg), fold_ln=False, center_writing_weights=False,
                                      center_unembed=False, fold_value_biases=False)
    g = torch.Generator().manual_seed(spec["seed"] + 1000)
    ids = torch.cat([torch.tensor([0]), torch.randint(2, len(tok), (spec.get("n_tokens", 8) - 1,), generator=g)])
    with torch.no_grad():
        hf_logits = hf(ids[None]).logits[0]
        tl_logits, cache = model.run_with_cache(ids[None])
        tl_logits = tl_logits[0]
    before = rel(tl_logits, hf_logits)
    if before > 1e-4:
        raise SystemExit(f"TransformerLens logits {before:.2e} (relative) off the model's: not the same model")
    x_in = transcoder_inputs(model, cache, ids, spec["hooks"][0])
    if spec["kind"] == "clt":
        ts, info = cross_layer_set(spec, x_in, cfg.d_model, case, g), {}
    else:
        ts, info = per_layer_set(spec, x_in, cfg.d_model, case, g)
    if spec.get("ct_no_dedup"):  # keep each layer's own rotary tables (Gemma-3: local and global RoPE bases)
        model._deduplicate_attention_buffers = lambda: None
    model._configure_replacement_model(ts)
    ctx = model.setup_attribution(ids)
    kw: dict[str, Any] = dict(batch_size=spec.get("batch", 64), max_n_logits=spec.get("max_n_logits", 10),
                              desired_logit_prob=spec.get("desired_logit_prob", 0.95))
    if spec.get("max_feature_nodes"):
        kw["max_feature_nodes"] = spec["max_feature_nodes"]
    if spec.get("update_interval"):
        kw["update_interval"] = spec["update_interval"]
    if spec.get("targets"):
        kw["attribution_targets"] = torch.tensor(spec["targets"])
    t0 = time.process_time()
    graph = attribute(ids, model, **kw)
    attribute_cpu_s = time.process_time() - t0
    with torch.no_grad():  # the model circuit-tracer attributed, against the Hugging Face model
        after = rel(model(ids[None])[0], hf_logits)
    save_file({
        "ids": ids, "adjacency": graph.adjacency_matrix.float().contiguous(),
        "active_features": graph.active_features.long().contiguous(),
        "activation_values": graph.activation_values.float().contiguous(),
        "selected_features": graph.selected_features.long().contiguous(),
        "logit_ids": torch.tensor([int(t.vocab_idx) for t in graph.logit_targets]),
        "logit_probs": graph.logit_probabilities.float().contiguous(),
        "error_vectors": ctx.error_vectors.float().contiguous(),
        "hf_logits_last": hf_logits[-1].contiguous(),
    }, str(case / "theirs.safetensors"))
    meta: dict[str, Any] = {
        "spec": spec, "n_layers": cfg.n_layers, "n_pos": len(ids), "n_active": int(graph.active_features.shape[0]),
        "n_selected": int(len(graph.selected_features)),
        "zero_positions": [model.zero_positions.start, model.zero_positions.stop],
        "logits_vs_model_rel": {"before_configure": before, "after_configure": after},
        "attribute_cpu_s": attribute_cpu_s, **info,
        "versions": {p: version(p) for p in ("circuit-tracer", "torch", "transformers", "transformer-lens")},
    }
    if do_prune:
        masks = {}
        for nt, et in PRUNE_THRESHOLDS:
            pr = prune_graph(graph, nt, et)
            masks[f"node_mask_{nt}_{et}"] = pr.node_mask.contiguous()
            masks[f"edge_mask_{nt}_{et}"] = pr.edge_mask.contiguous()
        save_file(masks, str(case / "theirs_prune.safetensors"))
        replacement, completeness = compute_graph_scores(graph)
        meta["scores"] = {"replacement": float(replacement), "completeness": float(completeness)}
    (case / "theirs.json").write_text(json.dumps(meta, indent=1))
    print(json.dumps({k: meta[k] for k in ("n_active", "n_selected", "logits_vs_model_rel")}))


if __name__ == "__main__":
    main()
