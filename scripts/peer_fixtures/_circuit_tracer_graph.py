"""The graph half of ``circuit_tracer.py`` (circuit-tracer's venv): one tiny model + transcoders that both
circuit-tracer (TransformerLens backend) and nnsight-lorsa (Hugging Face + nnsight) can build, and
circuit-tracer's own exported graph JSON for one prompt.

``OUT/model/``: a 2-layer GPT-2 (random, ``torch.manual_seed(0)``; HF ``config.json`` +
``model.safetensors``) with a word-level tokenizer (``tokenizer.json``; ``<bos>`` = id 0);
``OUT/transcoders/``: per-layer ReLU transcoders (``SingleLayerTranscoder.to_safetensors`` + ``config.yaml``,
hooks ``mlp.hook_in`` / ``mlp.hook_out``); ``OUT/circuit_tracer_graph.json``: ``attribute`` (the prompt as
token ids) + ``create_graph_files`` with ``node_threshold = edge_threshold = 1`` (every node that has an
edge); ``OUT/prompt.json``: the token ids, the model's logits on them (HF and TransformerLens agree, checked
here) and the attribution settings.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import yaml
from circuit_tracer.attribution.attribute import attribute
from circuit_tracer.replacement_model.replacement_model_transformerlens import TransformerLensReplacementModel
from circuit_tracer.transcoder.single_layer_transcoder import SingleLayerTranscoder, TranscoderSet
from circuit_tracer.utils.create_graph_files import create_graph_files
from tokenizers import Tokenizer, models, pre_tokenizers
from transformer_lens import HookedTransformerConfig
from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

WORDS = ('the', 'cat', 'sat', 'on', 'mat', 'dog', 'ran', 'to', 'park', 'a', 'big', 'small', 'red', 'blue',
         'and', 'was', 'is', 'it', 'he', 'she', 'they', 'saw', 'found', 'went', 'home', 'tree', 'house',
         'bird', 'sang', 'song', 'day', 'night')
PROMPT = "the cat sat on the mat and the dog ran to the"
D_MODEL, N_LAYERS, N_HEADS, D_TC = 16, 2, 2, 32
SETTINGS = {"max_n_logits": 3, "desired_logit_prob": 0.95, "batch_size": 64, "node_threshold": 1.0,
            "edge_threshold": 1.0}


def _tokenizer(path: Path) -> PreTrainedTokenizerFast:
    vocab = {"<bos>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", unk_token="<unk>", eos_token="<bos>")
    fast.save_pretrained(str(path))
    return fast


def _hf_model(path: Path, vocab: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=D_MODEL, n_layer=N_LAYERS, n_head=N_HEADS,
                     activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                     layer_norm_epsilon=1e-5, bos_token_id=0, eos_token_id=0, initializer_range=0.3)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # non-trivial biases and norms
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def _transcoders(path: Path) -> TranscoderSet:
    g = torch.Generator().manual_seed(1)
    tcs = {}
    for layer in range(N_LAYERS):
        tc = SingleLayerTranscoder(D_MODEL, D_TC, torch.nn.functional.relu, layer, device=torch.device("cpu"),
                                   dtype=torch.float32)
        with torch.no_grad():
            tc.W_enc.copy_(torch.randn(D_TC, D_MODEL, generator=g) * 0.3)
            tc.b_enc.copy_(torch.randn(D_TC, generator=g) * 0.5 - 0.6)  # sparse: roughly a quarter active
            tc.W_dec.copy_(torch.randn(D_TC, D_MODEL, generator=g) * 0.2)
            tc.b_dec.copy_(torch.randn(D_MODEL, generator=g) * 0.05)
        tcs[layer] = tc
    ts = TranscoderSet(tcs, feature_input_hook="mlp.hook_in", feature_output_hook="mlp.hook_out", scan="tiny-gpt2")
    ts.to_safetensors(str(path))
    (path / "config.yaml").write_text(yaml.safe_dump({
        "model_kind": "transcoder_set", "feature_input_hook": "mlp.hook_in", "feature_output_hook": "mlp.hook_out",
        "scan": "tiny-gpt2", "transcoders": [f"layer_{i}.safetensors" for i in range(N_LAYERS)]}, sort_keys=False))
    return ts


def write_graph(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(out / "model")
    hf = _hf_model(out / "model", len(tok))
    ts = _transcoders(out / "transcoders")
    cfg = HookedTransformerConfig(
        n_layers=N_LAYERS, d_model=D_MODEL, d_head=D_MODEL // N_HEADS, n_heads=N_HEADS, d_mlp=4 * D_MODEL,
        n_ctx=32, d_vocab=len(tok), act_fn="gelu_new", normalization_type="LN", eps=1e-5,
        positional_embedding_type="standard", original_architecture="GPT2LMHeadModel",
        tokenizer_name=str(out / "model"), model_name="tiny-gpt2", default_prepend_bos=True, device="cpu",
        dtype=torch.float32)
    model = TransformerLensReplacementModel(cfg)
    model.load_and_process_state_dict(convert_gpt2_weights(hf, cfg), fold_ln=False, center_writing_weights=False,
                                      center_unembed=False, fold_value_biases=False)
    ids = torch.tensor([tok.bos_token_id] + tok(PROMPT, add_special_tokens=False).input_ids)
    with torch.no_grad():
        hf_logits = hf(ids[None]).logits[0]
        tl_logits = model(ids[None])[0]
    assert float((hf_logits - tl_logits).abs().max()) < 1e-4, "TransformerLens and HF disagree"
    model._configure_replacement_model(ts)
    graph = attribute(ids, model, max_n_logits=SETTINGS["max_n_logits"],
                      desired_logit_prob=SETTINGS["desired_logit_prob"], batch_size=SETTINGS["batch_size"])
    with tempfile.TemporaryDirectory() as tmp:
        create_graph_files(graph, "tiny-gpt2-graph", tmp, scan="tiny-gpt2", node_threshold=SETTINGS["node_threshold"],
                           edge_threshold=SETTINGS["edge_threshold"])
        data = json.loads((Path(tmp) / "tiny-gpt2-graph.json").read_text())
    (out / "circuit_tracer_graph.json").write_text(json.dumps(data, separators=(",", ":")) + "\n")
    (out / "prompt.json").write_text(json.dumps({
        "token_ids": ids.tolist(), "logits_last": hf_logits[-1].tolist(), "settings": SETTINGS,
        "n_active_features": int(graph.active_features.shape[0]),
        "logit_targets": [int(t.vocab_idx) if hasattr(t, "vocab_idx") else int(t[1]) for t in graph.logit_targets],
    }, indent=1) + "\n")
