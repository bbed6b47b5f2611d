"""Adapter tests added by the second mutation probe (docs/reliability.md, "Mutation probe, round 2"): each kills a
mutant of ``nnsight_lorsa/adapters`` that the adapter tests let pass. References: the model's own modules and
outputs (transformers), never the adapter's code."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from nnsight_lorsa.adapters.base import _rms, mhsa_forward, norm_gain
from nnsight_lorsa.adapters.registry import get_adapter
from nnsight_lorsa.modules.rotary import rotary_inv_freq

_COMMON = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 64,
           "intermediate_size": 64, "max_position_embeddings": 256}


def _model(config: transformers.PretrainedConfig) -> torch.nn.Module:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.3 * noise if "norm" in name and name.endswith("weight") else 0.3 * noise)
    return model.eval()


def _attention_call(model, adapter, layer: int, ids: torch.Tensor):
    seen = {}

    def hook(module, args, kwargs, output):
        seen.update(args=args, kwargs=kwargs, output=output)

    handle = adapter.attention_module(model, layer).register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        handle.remove()
    x = adapter.attention_input(seen["args"], seen["kwargs"])
    return x, adapter.attention_positions(seen["args"], seen["kwargs"], x), adapter.attention_output(seen["output"])


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("family", ["qwen3", "olmo2"])
def test_qk_norm_eps_is_the_models_own(family):
    """A QK-norm eps far from the 1e-6 default (0.5: it changes the queries by tens of percent) is the model's
    (mutant: ``qk_norm_eps`` fixed at 1e-6, unseen by configs that keep the default)."""
    cls = transformers.Qwen3Config if family == "qwen3" else transformers.Olmo2Config
    extra = {"head_dim": 16} if family == "qwen3" else {}
    model = _model(cls(**_COMMON, num_key_value_heads=2, rms_norm_eps=0.5, **extra))
    adapter = get_adapter(model)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    x, pos, out = _attention_call(model, adapter, 1, ids)
    w = adapter.mhsa_weights(model, 1)
    assert w.qk_norm_eps == 0.5
    assert _rel(mhsa_forward(w, x, pos), out) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("family", ["llama", "olmo2"])
def test_the_qk_norm_rounds_where_the_models_norm_does(family, dtype):
    """``_rms`` (the QK-norm of ``mhsa_qk``) is the model's RMSNorm module bit for bit in half precision: Llama /
    Qwen3 apply the gain after the cast back, ``Olmo2RMSNorm`` before it (mutant: the two orders swapped, one
    rounding apart, invisible in fp32)."""
    width = 48
    if family == "llama":
        from transformers.models.llama.modeling_llama import LlamaRMSNorm as Norm
    else:
        from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm as Norm
    norm = Norm(width, eps=1e-5)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.7 * torch.randn(width, generator=g))
    norm = norm.to(dtype)
    x = (3.0 * torch.randn(4, 7, width, generator=g)).to(dtype)
    with torch.no_grad():
        want = norm(x)
    got = _rms(x, norm.weight.detach(), 1e-5, gain_in_fp32=family == "olmo2")
    assert got.dtype == want.dtype
    assert torch.equal(got, want)


def test_a_transformers4_qwen2_window_starts_at_max_window_layers():
    """A config without ``layer_types`` (transformers 4's Qwen2: ``use_sliding_window``, ``max_window_layers``)
    slides the layers transformers 5 marks ``sliding_attention`` for the same settings: layer ``>=
    max_window_layers`` (mutant: ``>``)."""
    cfg = transformers.Qwen2Config(**{**_COMMON, "num_hidden_layers": 4}, num_key_value_heads=2,
                                   use_sliding_window=True, sliding_window=5, max_window_layers=2)
    want = [5 if t == "sliding_attention" else None for t in cfg.layer_types]
    assert want == [None, None, 5, 5]
    adapter = get_adapter(_model(cfg))
    old = types.SimpleNamespace(**{k: v for k, v in cfg.to_dict().items() if k != "layer_types"})
    old.model_type = "qwen2"
    adapter.config = old
    assert [adapter.sliding_window(i) for i in range(4)] == want


def test_yarn_without_its_optional_keys_is_the_models_own():
    """Yarn with no ``beta_fast`` / ``beta_slow`` (transformers' defaults 32 / 1) and, in a transformers-4 style
    config, no ``original_max_position_embeddings`` (default ``max_position_embeddings``): the frequencies are the
    model's buffer and the attention its own (mutants: ``beta_fast`` default 16; the original length not
    defaulted)."""
    # an original length of 4096: yarn's correction range [2, 6) of the 8 frequencies (beta_fast 16 would give [3, 6))
    cfg = transformers.LlamaConfig(**{**_COMMON, "max_position_embeddings": 16384}, num_key_value_heads=2,
                                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                    "original_max_position_embeddings": 4096})
    model = _model(cfg)
    adapter = get_adapter(model)
    w = adapter.mhsa_weights(model, 0)
    assert torch.equal(rotary_inv_freq(w.rotary), model.model.rotary_emb.inv_freq.float())
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(4))
    x, pos, out = _attention_call(model, adapter, 0, ids)
    assert _rel(mhsa_forward(w, x, pos), out) < 1e-5
    # the same yarn written as transformers 4 kept it (rope_scaling, no original length): the same RoPE as the
    # transformers-5 config whose original length is max_position_embeddings
    cfg5 = transformers.LlamaConfig(**_COMMON, num_key_value_heads=2, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    assert cfg5.rope_parameters["original_max_position_embeddings"] == _COMMON["max_position_embeddings"]
    old = types.SimpleNamespace(**{k: v for k, v in cfg5.to_dict().items() if k != "rope_parameters"})
    old.rope_scaling, old.rope_theta = {"type": "yarn", "factor": 4.0}, 10000.0
    adapter5 = get_adapter(_model(cfg5))
    want = adapter5.rotary_config()
    adapter5.config = old
    assert adapter5.rotary_config() == want


@pytest.mark.parametrize("family", ["gemma", "gemma2"])
def test_norm_gain_is_what_the_models_norm_multiplies_by(family):
    """``norm_gain(norm) · x / rms(x)`` is the model's norm of ``x`` (Gemma: ``1 + weight``; mutant: ``weight``)."""
    cls = transformers.GemmaConfig if family == "gemma" else transformers.Gemma2Config
    model = _model(cls(**_COMMON, num_key_value_heads=1, head_dim=16))
    norm = model.model.layers[0].input_layernorm
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = norm(x)
    got = norm_gain(norm) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)
    assert _rel(got, want) < 1e-6


def test_final_logits_are_the_models_logits():
    """``final_logits(lm_head(h))`` is the model's own logits, Gemma-2's soft-cap included (mutant: the cap without
    the division inside ``tanh``)."""
    model = _model(transformers.Gemma2Config(**_COMMON, num_key_value_heads=1, head_dim=16,
                                             final_logit_softcapping=3.0))
    adapter = get_adapter(model)
    assert adapter.final_logit_softcap() == 3.0
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
        got = adapter.final_logits(model.lm_head(out.hidden_states[-1]))
    assert float(out.logits.abs().max()) > 1.5  # the cap bites
    assert _rel(got, out.logits) < 1e-6
