"""Tiny random models of every supported family, with a local tokenizer, for the tests.

Nothing is downloaded: configs are built in code, weights are random (biases and norm gains
randomised too, so that a mistake in their handling cannot hide behind zeros and ones).
"""

from __future__ import annotations

import warnings

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

VOCAB = 128
D_MODEL = 64
N_HEADS = 4
N_LAYERS = 3

LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
}
_COMMON = {"hidden_size": D_MODEL, "num_attention_heads": N_HEADS, "num_hidden_layers": N_LAYERS,
           "vocab_size": VOCAB, "intermediate_size": 128, "max_position_embeddings": 128}

FAMILIES = ("llama", "qwen2", "qwen3", "neox", "gpt2")


def tiny_config(family: str) -> transformers.PretrainedConfig:
    if family == "llama":  # GQA + llama3 rope scaling, like Llama-3.1-8B
        return transformers.LlamaConfig(**_COMMON, num_key_value_heads=2, rope_parameters=dict(LLAMA3_ROPE))
    if family == "qwen2":
        return transformers.Qwen2Config(**_COMMON, num_key_value_heads=2)
    if family == "qwen3":
        return transformers.Qwen3Config(**_COMMON, num_key_value_heads=2, head_dim=16)
    if family == "neox":
        return transformers.GPTNeoXConfig(**_COMMON, rotary_pct=0.25, rotary_emb_base=10000)
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=D_MODEL, n_head=N_HEADS, n_layer=N_LAYERS, vocab_size=VOCAB,
                                       n_positions=128)
    raise KeyError(family)


@torch.no_grad()
def tiny_hf_model(family: str, seed: int = 0, attn: str = "eager") -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = tiny_config(family)
    cfg._attn_implementation = attn
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    for name, p in model.named_parameters():
        if name.endswith("bias") or "norm" in name or "ln" in name.split(".")[-2:][0]:
            p.add_(0.1 * torch.randn_like(p))
    return model


def tiny_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """Word-level tokenizer: ``<bos>``=0, ``<eos>``=1 (also pad), then ``w2 … w{vocab-1}``."""
    words = {"<bos>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<eos>", padding_side="left")


def tiny_nnsight(family: str, seed: int = 0, attn: str = "eager"):
    """(nnsight TransformersModel, underlying HF model) for a tiny random model."""
    from nnsight import TransformersModel

    hf = tiny_hf_model(family, seed, attn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = TransformersModel(hf, task="text-generation", tokenizer=tiny_tokenizer())
    return model, hf


def random_ids(batch: int = 2, seq: int = 10, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, seq), generator=g)
    ids[:, 0] = 0
    return ids


def tiny_training_setup():
    """(nnsight model, HF model, adapter, TokenDataset of 48 random windows × 16) for training tests."""
    from nnsight_lorsa import get_adapter
    from nnsight_lorsa.training import TokenDataset

    model, hf = tiny_nnsight("llama")
    return model, hf, get_adapter(model), TokenDataset(random_ids(batch=48, seq=16, seed=3))
