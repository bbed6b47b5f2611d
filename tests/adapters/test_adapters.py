"""Architecture adapters against tiny random transformers models (fp32, CPU, no downloads).

For every supported family the adapter's view of a layer -- its input hidden states, positions,
output and head-major MHSA weights -- must reproduce the model's own attention output
(``mhsa_forward``), its own rotary cos/sin, and give an exact QK copy to ``Lorsa.init_from_mhsa``.
"""

from __future__ import annotations

import copy
import dataclasses
import types

import numpy as np
import pytest
import torch
import transformers
from helpers import rope_kwargs
from transformers import AutoModelForCausalLM

from nnsight_lorsa.adapters.base import ArchitectureAdapter, MHSAWeights, check_rope_read, mhsa_forward, mhsa_pattern
from nnsight_lorsa.adapters.gemma import GemmaAdapter
from nnsight_lorsa.adapters.gemma2 import Gemma2Adapter, Gemma3Adapter
from nnsight_lorsa.adapters.gpt2 import GPT2Adapter
from nnsight_lorsa.adapters.llama import LlamaAdapter
from nnsight_lorsa.adapters.neox import GPTNeoXAdapter
from nnsight_lorsa.adapters.olmo2 import Olmo2Adapter
from nnsight_lorsa.adapters.phi3 import Phi3Adapter
from nnsight_lorsa.adapters.registry import get_adapter
from nnsight_lorsa.errors import ConfigMismatchError, LayerOutOfRangeError, UnsupportedArchitectureError
from nnsight_lorsa.modules.lorsa import Lorsa
from nnsight_lorsa.modules.lorsa_config import LorsaConfig
from nnsight_lorsa.modules.rotary import rotary_cos_sin

D_MODEL, N_HEADS, N_LAYERS, VOCAB, BATCH, SEQ = 64, 4, 2, 128, 2, 12
LAYER = 1
TOL = 1e-5

LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
}
_COMMON = {"hidden_size": D_MODEL, "num_attention_heads": N_HEADS, "num_hidden_layers": N_LAYERS,
           "vocab_size": VOCAB, "intermediate_size": 128, "max_position_embeddings": 128}


def _config(family: str) -> transformers.PretrainedConfig:
    if family == "llama":  # GQA + llama3 (NTK-by-parts) rope scaling
        return transformers.LlamaConfig(**_COMMON, num_key_value_heads=2, **rope_kwargs(LLAMA3_ROPE))
    if family == "llama_linear":  # transformers-4 style rope_scaling, still accepted by transformers 5
        return transformers.LlamaConfig(**_COMMON, num_key_value_heads=4,
                                        rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=500.0)
    if family == "mistral":  # sliding window on every layer, shorter than SEQ
        return transformers.MistralConfig(**_COMMON, num_key_value_heads=2, sliding_window=5)
    if family == "qwen2":  # q/k/v biases
        return transformers.Qwen2Config(**_COMMON, num_key_value_heads=2)
    if family == "qwen2_sliding":  # layer 1 is a sliding_attention layer (max_window_layers=1)
        return transformers.Qwen2Config(**_COMMON, num_key_value_heads=2, use_sliding_window=True,
                                        sliding_window=4, max_window_layers=1)
    if family == "qwen3":  # QK-norm, explicit head_dim
        return transformers.Qwen3Config(**_COMMON, num_key_value_heads=2, head_dim=16)
    if family == "neox":  # per-head interleaved fused QKV, partial rotary 0.25
        return transformers.GPTNeoXConfig(**_COMMON, rotary_pct=0.25, rotary_emb_base=10000)
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=D_MODEL, n_head=N_HEADS, n_layer=N_LAYERS, vocab_size=VOCAB,
                                       n_positions=128)
    if family == "gpt2_inv":  # scale /= layer_idx + 1, reordered/upcast eager attention
        return transformers.GPT2Config(n_embd=D_MODEL, n_head=N_HEADS, n_layer=N_LAYERS, vocab_size=VOCAB,
                                       n_positions=128, scale_attn_by_inverse_layer_idx=True,
                                       reorder_and_upcast_attn=True)
    if family in ("gemma2", "gemma2_sliding"):  # query_pre_attn_scalar != head_dim, soft-capping that bites
        return transformers.Gemma2Config(**GEMMA2, **(
            {"layer_types": ["full_attention", "sliding_attention"]} if family == "gemma2_sliding" else {}))
    if family == "gemma3":  # QK-norm (1 + w), RoPE per layer type: layer 0 local (sliding), layer 1 global (1M, x8)
        return transformers.Gemma3TextConfig(**GEMMA3)
    if family == "olmo2":  # QK-norm over the whole projection (GQA: k_norm over 2 KV heads), post-norms only
        return transformers.Olmo2Config(**_COMMON, num_key_value_heads=2, rope_parameters={
            "rope_type": "linear", "rope_theta": 500.0, "factor": 2.0})
    if family == "phi3":  # fused qkv_proj (GQA), partial rotary 0.5, a sliding window on every layer shorter than SEQ
        return transformers.Phi3Config(**_COMMON, num_key_value_heads=2, sliding_window=5, pad_token_id=1,
                                       bos_token_id=0, eos_token_id=1, rope_parameters=PHI3_ROPE)
    if family == "gemma":  # Gemma-1: 1 + weight RMSNorms, scaled embeddings, MQA (one KV head)
        return transformers.GemmaConfig(**_COMMON, num_key_value_heads=1, head_dim=16)
    raise KeyError(family)


PHI3_ROPE = {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}
#: Gemma-2: GQA, head_dim 16 scaled by 24 ** -0.5, attention logits capped at 1.5 (random scores reach ~5),
#: final logits at 3; ``gemma2``: layer 1 global (transformers' default alternation), ``gemma2_sliding``:
#: layer 1 a sliding layer with a window of 4 < SEQ
GEMMA2 = {**_COMMON, "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 24,
          "attn_logit_softcapping": 1.5, "final_logit_softcapping": 3.0, "sliding_window": 4}
GEMMA3 = {**_COMMON, "num_key_value_heads": 2, "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 4,
          "layer_types": ["sliding_attention", "full_attention"],
          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}}}
FAMILIES = ["llama", "llama_linear", "mistral", "qwen2", "qwen2_sliding", "qwen3", "neox", "gpt2", "gpt2_inv",
            "gemma2", "gemma2_sliding", "gemma3", "olmo2", "phi3", "gemma"]
ROTARY_FAMILIES = [f for f in FAMILIES if not f.startswith("gpt2")]
#: one RoPE for every layer (Gemma-3: one per layer type, test_gemma3_rope_per_layer_type)
SHARED_ROPE_FAMILIES = [f for f in ROTARY_FAMILIES if f != "gemma3"]
ADAPTER_OF = {"llama": LlamaAdapter, "llama_linear": LlamaAdapter, "mistral": LlamaAdapter,
              "qwen2": LlamaAdapter, "qwen2_sliding": LlamaAdapter, "qwen3": LlamaAdapter,
              "neox": GPTNeoXAdapter, "gpt2": GPT2Adapter, "gpt2_inv": GPT2Adapter,
              "gemma2": Gemma2Adapter, "gemma2_sliding": Gemma2Adapter, "gemma3": Gemma3Adapter,
              "olmo2": Olmo2Adapter, "phi3": Phi3Adapter, "gemma": GemmaAdapter}
#: families whose transformers refuses ``attn_implementation="sdpa"`` (Gemma-2: SDPA has no soft-capping)
NO_SDPA = ("gemma2", "gemma2_sliding")

_MODELS: dict[tuple[str, str], torch.nn.Module] = {}


def tiny_model(family: str, attn: str = "eager") -> torch.nn.Module:
    """A random fp32 model; weights, biases and norm gains all non-trivial (cached per family/impl)."""
    key = (family, attn)
    if key not in _MODELS:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(family), attn_implementation=attn,
                                                 dtype=torch.float32)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                noise = torch.randn(p.shape, generator=g)
                if "norm" in name or ".ln_" in name:
                    p.copy_(1.0 + 0.2 * noise if name.endswith("weight") else 0.1 * noise)
                else:
                    p.copy_(0.15 * noise)
        _MODELS[key] = model.eval()
    return _MODELS[key]


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    positions = torch.arange(SEQ)[None] + torch.tensor([[0], [7]])  # per-row offsets
    return ids, positions


def capture_attention(model, adapter: ArchitectureAdapter, layer: int = LAYER):
    """Run the model; return (args, kwargs, output) of layer ``layer``'s attention call."""
    seen = {}

    def hook(module, args, kwargs, output):
        seen.update(args=args, kwargs=kwargs, output=output)

    handle = adapter.attention_module(model, layer).register_forward_hook(hook, with_kwargs=True)
    ids, positions = _inputs()
    try:
        with torch.no_grad():
            model(input_ids=ids, position_ids=positions)
    finally:
        handle.remove()
    return seen["args"], seen["kwargs"], seen["output"]


# --------------------------------------------------------------------------- registry


@pytest.mark.parametrize("family", FAMILIES)
def test_get_adapter_picks_family(family):
    model = tiny_model(family)
    adapter = get_adapter(model)
    assert type(adapter) is ADAPTER_OF[family]
    assert type(get_adapter(model.config)) is ADAPTER_OF[family]
    assert adapter.n_layers == N_LAYERS and adapter.d_model == D_MODEL
    for path in (adapter.embed_path, adapter.final_norm_path, adapter.lm_head_path,
                 adapter.attention_path(LAYER), adapter.mlp_path(LAYER)):
        assert isinstance(adapter.get_module(model, path), torch.nn.Module), path
    # the unembedding is found by what the model exposes, not by a name (GPT-NeoX: embed_out / lm_head)
    assert adapter.get_module(model, adapter.lm_head_path) is model.get_output_embeddings()
    if isinstance(adapter, GPT2Adapter):
        assert isinstance(adapter.get_module(model, adapter.pos_embed_path), torch.nn.Embedding)
        assert adapter.rotary_config() is None
    with pytest.raises(UnsupportedArchitectureError, match="no_such_module"):
        adapter.get_module(model, "no_such_module")


def test_get_adapter_unsupported_names_model_type():
    bert = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=64, vocab_size=50)
    with pytest.raises(UnsupportedArchitectureError, match="'bert'"):
        get_adapter(bert)
    with pytest.raises(UnsupportedArchitectureError, match="made_up_arch"):
        get_adapter(types.SimpleNamespace(model_type="made_up_arch"))
    with pytest.raises(UnsupportedArchitectureError, match="made_up_arch"):
        get_adapter(types.SimpleNamespace(config=types.SimpleNamespace(model_type="made_up_arch")))
    with pytest.raises(UnsupportedArchitectureError):
        get_adapter(object())


@pytest.mark.parametrize("family", ["llama", "neox", "gpt2", "olmo2", "phi3", "gemma"])
def test_check_layer(family):
    adapter = get_adapter(_config(family))
    assert adapter.check_layer(0) == 0 and adapter.check_layer(N_LAYERS - 1) == N_LAYERS - 1
    assert adapter.check_layer(np.int64(1)) == 1
    for bad in (N_LAYERS, -1, True, 1.0, "1"):
        with pytest.raises(LayerOutOfRangeError):
            adapter.check_layer(bad)
    with pytest.raises(LayerOutOfRangeError):
        adapter.attention_path(N_LAYERS)
    with pytest.raises(LayerOutOfRangeError):
        adapter.mhsa_weights(tiny_model(family), -1)


# --------------------------------------------------------------------------- MHSA recompute


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_mhsa_forward_matches_model_attention(family, attn):
    if attn == "sdpa" and family in NO_SDPA:  # transformers' own refusal: nothing to recompute
        with pytest.raises(ValueError, match="scaled_dot_product_attention"):
            tiny_model(family, attn)
        return
    model = tiny_model(family, attn)
    adapter = get_adapter(model)
    args, kwargs, output = capture_attention(model, adapter)
    x = adapter.attention_input(args, kwargs)
    assert x.shape == (BATCH, SEQ, D_MODEL)
    positions = adapter.attention_positions(args, kwargs, x)
    if family in ROTARY_FAMILIES:  # the position_ids given to the model reach the adapter
        assert torch.equal(positions.expand(BATCH, SEQ), _inputs()[1])
    if family == "gpt2_inv" and attn != "eager" and not hasattr(adapter.attention_module(model, LAYER), "scaling"):
        with pytest.raises(ConfigMismatchError, match="scale_attn_by_inverse_layer_idx"):
            adapter.mhsa_weights(model, LAYER)  # transformers 4.x: its SDPA ignores the layer scale
        return
    w = adapter.mhsa_weights(model, LAYER)
    assert isinstance(w, MHSAWeights) and w.d_model == D_MODEL

    expected = adapter.attention_output(output)
    assert expected.shape == (BATCH, SEQ, D_MODEL)
    got = mhsa_forward(w, x, positions)
    assert (got - expected).abs().max().item() < TOL

    per_head = mhsa_forward(w, x, positions, per_head=True)
    assert per_head.shape == (BATCH, SEQ, w.n_heads, D_MODEL)
    assert (per_head.sum(2) + w.b_O - expected).abs().max().item() < TOL


def captured_layer(family: str):
    """``(model, adapter, w, x, positions, expected)``: layer ``LAYER``'s MHSA weights, and its input, positions
    and output in the model's own forward."""
    model = tiny_model(family)
    adapter = get_adapter(model)
    args, kwargs, output = capture_attention(model, adapter)
    x = adapter.attention_input(args, kwargs)
    positions = adapter.attention_positions(args, kwargs, x)
    return model, adapter, adapter.mhsa_weights(model, LAYER), x, positions, adapter.attention_output(output)


def test_positions_and_window_matter():
    """Guards against a vacuous pass: wrong positions / no sliding window give a different output."""
    model, adapter, w, x, positions, expected = captured_layer("qwen2_sliding")
    assert w.sliding_window == 4 and adapter.mhsa_weights(model, 0).sliding_window is None
    assert (mhsa_forward(w, x, positions) - expected).abs().max() < TOL
    # RoPE is relative: a per-row offset changes nothing, stretched positions do.
    assert (mhsa_forward(w, x, None) - expected).abs().max() < TOL
    assert (mhsa_forward(w, x, 2 * positions) - expected).abs().max() > 1e-3
    full = MHSAWeights(**{**w.__dict__, "sliding_window": None})
    assert (mhsa_forward(full, x, positions) - expected).abs().max() > 1e-3


def test_gemma2_scale_softcap_and_window_matter():
    """Gemma-2's pieces each change the recomputed output (no vacuous pass): its score scale
    ``query_pre_attn_scalar ** -0.5``, the attention soft-cap and the sliding window of a ``sliding_attention``
    layer (a prompt longer than the window); the alternation follows ``config.layer_types``."""
    model, adapter, w, x, positions, expected = captured_layer("gemma2_sliding")
    assert w.softcap == 1.5 and w.sliding_window == 4 < SEQ and w.scale == pytest.approx(24 ** -0.5)
    assert adapter.mhsa_weights(model, 0).sliding_window is None
    default = tiny_model("gemma2")  # transformers' default: sliding from layer 0, every other layer
    assert [get_adapter(default).mhsa_weights(default, i).sliding_window for i in range(N_LAYERS)] == [4, None]
    assert (mhsa_forward(w, x, positions) - expected).abs().max() < TOL
    for change in ({"softcap": None}, {"sliding_window": None}, {"scale": w.head_dim ** -0.5}):
        other = MHSAWeights(**{**w.__dict__, **change})
        assert (mhsa_forward(other, x, positions) - expected).abs().max() > 1e-3, change
    # where the post-norms and soft-caps are, as the adapter names them
    assert adapter.mlp_norm_path(1) == "model.layers.1.pre_feedforward_layernorm"
    assert adapter.attention_post_norm_path(1) == "model.layers.1.post_attention_layernorm"
    assert adapter.mlp_post_norm_path(1) == "model.layers.1.post_feedforward_layernorm"
    assert adapter.final_logit_softcap() == 3.0
    llama = get_adapter(_config("llama"))  # the other families: no post-norms, plain logits
    assert llama.attention_post_norm_path(1) is None and llama.mlp_post_norm_path(1) is None
    assert llama.final_logit_softcap() is None


def test_gpt2_inverse_layer_scale():
    adapter = get_adapter(_config("gpt2_inv"))
    head_dim = D_MODEL // N_HEADS
    assert adapter.attention_scale(0) == pytest.approx(head_dim ** -0.5)
    assert adapter.attention_scale(1) == pytest.approx(head_dim ** -0.5 / 2)
    assert adapter.mhsa_weights(tiny_model("gpt2_inv"), 1).scale == pytest.approx(head_dim ** -0.5 / 2)
    # a GPT2Attention without `scaling` (transformers 4.x): eager applies the config, SDPA ignores it
    for attn, refused in (("eager", False), ("sdpa", True)):
        model = copy.deepcopy(tiny_model("gpt2_inv", attn))  # the cached one stays intact
        module = adapter.attention_module(model, 1)
        if hasattr(module, "scaling"):
            del module.scaling
        if refused:
            with pytest.raises(ConfigMismatchError, match="attn_implementation='eager'"):
                adapter.mhsa_weights(model, 1)
        else:
            assert adapter.mhsa_weights(model, 1).scale == pytest.approx(head_dim ** -0.5 / 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_with_attention_output_round_trips(family):
    model = tiny_model(family)
    adapter = get_adapter(model)
    args, kwargs, output = capture_attention(model, adapter)
    old = adapter.attention_output(output)
    new = torch.randn_like(old)
    replaced = adapter.with_attention_output(output, new)
    assert adapter.attention_output(replaced) is new
    assert type(replaced) is type(output)
    if isinstance(output, tuple):
        assert len(replaced) == len(output)
        assert all(a is b for a, b in zip(replaced[1:], output[1:], strict=True))
    assert adapter.attention_output(adapter.with_attention_output(replaced, old)) is old

    # Returned from a forward hook, the replacement is what the model uses downstream.
    ids, positions = _inputs()
    with torch.no_grad():
        clean = model(input_ids=ids, position_ids=positions).logits
    module = adapter.attention_module(model, LAYER)

    def run(fn):
        def hook(m, a, k, o):
            return adapter.with_attention_output(o, fn(a, k, o))

        handle = module.register_forward_hook(hook, with_kwargs=True)
        try:
            with torch.no_grad():
                return model(input_ids=ids, position_ids=positions).logits
        finally:
            handle.remove()

    w = adapter.mhsa_weights(model, LAYER)

    def recompute(a, k, o):
        x = adapter.attention_input(a, k)
        return mhsa_forward(w, x, adapter.attention_positions(a, k, x))

    assert (run(recompute) - clean).abs().max() < 1e-4
    assert (run(lambda a, k, o: torch.zeros_like(adapter.attention_output(o))) - clean).abs().max() > 1e-3


# --------------------------------------------------------------------------- rotary


def _rotary_module(model):
    return model.gpt_neox.rotary_emb if hasattr(model, "gpt_neox") else model.model.rotary_emb


@pytest.mark.parametrize("family", SHARED_ROPE_FAMILIES)
def test_rotary_cos_sin_matches_model(family):
    model = tiny_model(family)
    adapter = get_adapter(model)
    cfg = adapter.rotary_config()
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    head_dim = getattr(model.config, "head_dim", None) or head_dim
    assert cfg.head_dim == head_dim and not cfg.interleaved
    if family == "neox":
        assert cfg.rotary_dim == int(head_dim * 0.25) == 4
    if family == "llama":
        assert cfg.rope_type == "llama3" and cfg.scaling["original_max_position_embeddings"] == 32
    positions = torch.stack([torch.arange(40), torch.arange(40) + 90])
    x = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        cos_ref, sin_ref = _rotary_module(model)(x, positions)
    cos, sin = rotary_cos_sin(cfg, positions)
    assert cos.shape == cos_ref.shape == (2, 40, cfg.rotary_dim)
    assert (cos - cos_ref).abs().max() < 1e-6 and (sin - sin_ref).abs().max() < 1e-6


def test_gemma3_rope_per_layer_type():
    """Gemma-3 rotates its global and its sliding layers differently (``rope_parameters`` per layer type): each
    layer's ``rotary_config(layer)`` matches the model's rotary embedding for its type, and differs from the
    other type's; without a layer it is a named error. The sliding layer's attention is recomputed exactly too
    (the global one in test_mhsa_forward_matches_model_attention)."""
    model = tiny_model("gemma3")
    adapter = get_adapter(model)
    positions = torch.stack([torch.arange(40), torch.arange(40) + 90])
    cos_sin = []
    for layer, kind in enumerate(model.config.layer_types):
        cfg = adapter.rotary_config(layer)
        with torch.no_grad():
            cos_ref, sin_ref = model.model.rotary_emb(torch.zeros(1), positions, kind)
        cos, sin = rotary_cos_sin(cfg, positions)
        assert (cos - cos_ref).abs().max() < 1e-6 and (sin - sin_ref).abs().max() < 1e-6, kind
        assert adapter.mhsa_weights(model, layer).rotary == cfg
        cos_sin.append(cos)
    assert (adapter.rotary_config(1).base, adapter.rotary_config(1).rope_type) == (1e6, "linear")
    assert (cos_sin[0] - cos_sin[1]).abs().max() > 1e-2
    args, kwargs, output = capture_attention(model, adapter, layer=0)
    x = adapter.attention_input(args, kwargs)
    w = adapter.mhsa_weights(model, 0)
    assert w.sliding_window == 4 and w.q_norm is not None
    got = mhsa_forward(w, x, adapter.attention_positions(args, kwargs, x))
    assert (got - adapter.attention_output(output)).abs().max() < TOL
    with pytest.raises(ConfigMismatchError, match="rotary_config\\(layer\\)"):
        adapter.rotary_config()


def test_neox_rotary_fraction_from_config_variants():
    cfg5 = transformers.GPTNeoXConfig(hidden_size=64, num_attention_heads=4, rotary_pct=0.5,
                                      rotary_emb_base=500)
    adapter = GPTNeoXAdapter(cfg5)
    assert adapter.rotary_fraction() == 0.5
    assert adapter.rotary_config().rotary_dim == 8 and adapter.rotary_config().base == 500.0
    legacy = types.SimpleNamespace(model_type="gpt_neox", hidden_size=64, num_attention_heads=4,
                                   num_hidden_layers=2, rotary_pct=0.25, rotary_emb_base=300,
                                   rope_scaling=None)
    adapter = GPTNeoXAdapter(legacy)  # transformers-4 style attributes
    assert adapter.rotary_config().rotary_dim == 4 and adapter.rotary_config().base == 300.0


# --------------------------------------------------------------------------- Lorsa init (App. B.3)


def test_olmo2_whole_projection_qk_norm_and_sites():
    """OLMo-2's QK-norm spans the whole projection (``q_norm`` of width ``n_heads * head_dim``): the same gains as
    one RMSNorm per head give another output (no vacuous pass); no pre-norms, post-norms on both sublayers; the
    Lorsa's per-head QK-norm gets each head's slice of the gain, its initial pattern near, not at, the MHSA's."""
    model, adapter, w, x, positions, expected = captured_layer("olmo2")
    assert not w.qk_norm_per_head and w.q_norm is not None and w.k_norm is not None
    assert w.q_norm.shape == (N_HEADS * w.head_dim,) and w.k_norm.shape == (2 * w.head_dim,)
    assert (mhsa_forward(w, x, positions) - expected).abs().max() < TOL
    per_head = MHSAWeights(**{**w.__dict__, "qk_norm_per_head": True, "q_norm": w.q_norm[:w.head_dim],
                              "k_norm": w.k_norm[:w.head_dim]})
    assert (mhsa_forward(per_head, x, positions) - expected).abs().max() > 1e-3
    assert adapter.attention_norm_path(1) is None and adapter.mlp_norm_path(1) is None
    assert adapter.attention_post_norm_path(1) == "model.layers.1.post_attention_layernorm"
    assert adapter.mlp_post_norm_path(1) == "model.layers.1.post_feedforward_layernorm"
    for path in (adapter.attention_post_norm_path(1), adapter.mlp_post_norm_path(1)):
        assert isinstance(adapter.get_module(model, path), torch.nn.Module)
    lorsa = Lorsa(LorsaConfig.from_mhsa(w, n_ov_heads=4 * w.n_heads, top_k=4, qk_heads_per_mhsa_head=2, layer=LAYER))
    lorsa.init_from_mhsa(w, generator=torch.Generator().manual_seed(0))
    assert torch.equal(lorsa.ln_q.w.detach().view(N_HEADS, 2, -1)[:, 0].flatten(), w.q_norm)
    assert torch.equal(lorsa.ln_k.w.detach().view(N_HEADS, 2, -1)[::2, 0].flatten(), w.k_norm)
    got = lorsa.attention_pattern(x, positions=positions)
    ref = mhsa_pattern(w, x, positions).repeat_interleave(2, 1)
    assert 1e-4 < (got - ref).abs().max() < 0.5


def test_phi3_fused_qkv_partial_rotary_window_and_longrope_refused():
    """Phi-3: the fused ``qkv_proj`` sliced ``[q | k | v]`` (a wrong slicing, partial rotary or window changes the
    output: no vacuous pass); ``longrope`` (the 128k checkpoints) is refused by name — never another RoPE."""
    model, adapter, w, x, positions, expected = captured_layer("phi3")
    assert w.sliding_window == 5 < SEQ and w.rotary is not None and w.rotary.rotary_dim == w.head_dim // 2
    assert (mhsa_forward(w, x, positions) - expected).abs().max() < TOL
    for change in ({"sliding_window": None}, {"W_K": w.W_V, "W_V": w.W_K},
                   {"rotary": dataclasses.replace(w.rotary, rotary_dim=w.head_dim)}):
        other = MHSAWeights(**{**w.__dict__, **change})
        assert (mhsa_forward(other, x, positions) - expected).abs().max() > 1e-3, change
    long = transformers.Phi3Config(**_COMMON, num_key_value_heads=2, pad_token_id=1, bos_token_id=0, eos_token_id=1,
                                   original_max_position_embeddings=64, rope_parameters={
                                       "rope_type": "longrope", "rope_theta": 500.0, "short_factor": [1.0] * 8,
                                       "long_factor": [2.0] * 8})
    legacy = copy.deepcopy(tiny_model("phi3").config)  # transformers 4 keeps the factor on the config
    legacy.rope_parameters = None
    legacy.rope_scaling, legacy.rope_theta, legacy.partial_rotary_factor = None, 500.0, 0.5
    assert get_adapter(legacy).rotary_config() == w.rotary
    phi = get_adapter(long)
    with pytest.raises(UnsupportedArchitectureError, match="longrope"):
        phi.rotary_config()
    long_model = AutoModelForCausalLM.from_config(long)
    with pytest.raises(UnsupportedArchitectureError, match="longrope"):
        phi.mhsa_weights(long_model, 0)


def _reference_qk(family: str, model, x: torch.Tensor, positions: torch.Tensor):
    """The model's own rotated queries ``(b, n_heads, s, e)`` and keys ``(b, n_kv, s, e)``."""
    attn = get_adapter(model).attention_module(model, LAYER)
    b, s, _ = x.shape
    if family == "gpt2":
        q, k, _ = attn.c_attn(x).split(D_MODEL, dim=2)
        return (q.view(b, s, N_HEADS, -1).transpose(1, 2), k.view(b, s, N_HEADS, -1).transpose(1, 2))
    cos, sin = _rotary_module(model)(x, positions)
    if family == "neox":
        from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

        qkv = attn.query_key_value(x).view(b, s, N_HEADS, -1).transpose(1, 2)
        q, k, _ = qkv.chunk(3, dim=-1)
        return apply_rotary_pos_emb(q, k, cos, sin)
    if family == "phi3":  # fused [q | k | v], partial rotary
        from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rope

        e, n_kv = attn.head_dim, model.config.num_key_value_heads
        q, k, _ = attn.qkv_proj(x).split([N_HEADS * e, n_kv * e, n_kv * e], dim=-1)
        return phi3_rope(q.view(b, s, -1, e).transpose(1, 2), k.view(b, s, -1, e).transpose(1, 2), cos, sin)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    head_dim = attn.head_dim
    q = attn.q_proj(x).view(b, s, -1, head_dim)
    k = attn.k_proj(x).view(b, s, -1, head_dim)
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    return apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)


# not OLMo-2: its QK-norm spans the whole projection, the Lorsa's is per head (``init_from_mhsa``: "near, not at");
# Gemma-3's RoPE per layer type: test_gemma3_rope_per_layer_type
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "neox", "gpt2", "gemma2", "gemma", "phi3"])
def test_lorsa_init_from_mhsa_copies_qk(family):
    model = tiny_model(family)
    adapter = get_adapter(model)
    w = adapter.mhsa_weights(model, LAYER)
    qk_rep = 2
    cfg = LorsaConfig(
        d_model=D_MODEL, n_qk_heads=qk_rep * w.n_heads, d_qk_head=w.head_dim,
        n_ov_heads=qk_rep * w.n_heads * 4,
        top_k=4, rotary=w.rotary, qk_norm=w.q_norm is not None, qk_norm_eps=w.qk_norm_eps,
        layer=LAYER, architecture=adapter.family,
    )
    lorsa = Lorsa(cfg)
    lorsa.init_from_mhsa(w, generator=torch.Generator().manual_seed(0))

    g = torch.Generator().manual_seed(3)
    x = torch.randn(BATCH, SEQ, D_MODEL, generator=g)
    _, positions = _inputs()
    with torch.no_grad():
        q, k = lorsa.qk(x, positions)
        q_ref, k_ref = _reference_qk(family, model, x, positions)
    assert q.shape == (BATCH, cfg.n_qk_heads, SEQ, w.head_dim)
    kv_group = w.n_heads // w.n_kv_heads
    for j in range(cfg.n_qk_heads):
        h = j // qk_rep
        assert (q[:, j] - q_ref[:, h]).abs().max() < TOL, (j, h)
        assert (k[:, j] - k_ref[:, h // kv_group]).abs().max() < TOL, (j, h)
    # Each OV head descends from MHSA head (head // G) // qk_rep: its w_v lies in that head's V span.
    W_V = w.W_V.repeat_interleave(kv_group, 0)  # (n_heads, d_model, head_dim)
    for ov in (0, cfg.n_ov_heads - 1):
        m = ov // cfg.group_size // qk_rep
        sol = torch.linalg.lstsq(W_V[m], lorsa.W_V[ov].detach()[:, None]).solution
        assert (W_V[m] @ sol - lorsa.W_V[ov].detach()[:, None]).abs().max() < 1e-4


# not OLMo-2 (whole-projection QK-norm: near, not at) nor Phi-3 (window 4 on every layer, shorter than SEQ: the
# MHSA's pattern is windowed, a Lorsa's global by design — docs/adapters.md)
@pytest.mark.parametrize("family", ["llama", "neox", "gpt2", "gpt2_inv", "qwen3", "gemma3", "gemma"])
def test_lorsa_from_mhsa_reproduces_the_heads_attention_pattern(family):
    """A Lorsa configured from ``mhsa_weights`` alone, as the training recipe does (rotary, score scale,
    QK-norm), and initialised with ``init_from_mhsa`` has every QK head's attention pattern equal to its
    MHSA head's in the model's own eager attention: GPT-2 (Conv1D fused QKV, learned positions: no
    rotary; ``gpt2_inv``: score scale / (layer + 1)), GPT-NeoX (partial rotary, per-head interleaved
    fused QKV), Llama (GQA, llama3 RoPE scaling), Qwen3 (QK-norm)."""
    model = tiny_model(family)
    adapter = get_adapter(model)
    args, kwargs, output = capture_attention(model, adapter)
    x = adapter.attention_input(args, kwargs)
    positions = adapter.attention_positions(args, kwargs, x)
    expected = output[1]  # eager attention weights (batch, n_heads, q, k)
    assert expected.shape == (BATCH, N_HEADS, SEQ, SEQ)
    w = adapter.mhsa_weights(model, LAYER)
    assert (w.rotary is None) == family.startswith("gpt2")
    if family == "neox":
        assert w.rotary is not None and w.rotary.rotary_dim == w.head_dim // 4  # rotary_pct 0.25
    qk_rep = 4
    cfg = LorsaConfig.from_mhsa(w, n_ov_heads=qk_rep * w.n_heads * 2, top_k=4, qk_heads_per_mhsa_head=qk_rep,
                                layer=LAYER)
    lorsa = Lorsa(cfg)
    lorsa.init_from_mhsa(w, generator=torch.Generator().manual_seed(0))
    got = lorsa.attention_pattern(x, positions=positions)
    assert got.shape == (BATCH, cfg.n_qk_heads, SEQ, SEQ)
    ref = expected.repeat_interleave(qk_rep, 1)  # QK head j copies MHSA head j // qk_rep
    assert (got - ref).abs().max().item() < TOL
    # not trivially uniform: the heads attend differently
    assert (expected[:, 0] - expected[:, 1]).abs().max().item() > 1e-2


def test_lorsa_from_gemma2_mhsa_has_the_uncapped_pattern():
    """A Lorsa's QK heads have no soft-capping (the Lorsa paper's softmax of ``q·k / attn_scale``):
    ``from_mhsa`` + ``init_from_mhsa`` on Gemma-2 copy the score scale (``query_pre_attn_scalar``) and
    ``W_Q``/``W_K``, so each QK head's pattern is its MHSA head's *without* the cap — equal to
    ``mhsa_pattern`` of the weights with ``softcap=None``, not to the model's capped pattern."""
    model = tiny_model("gemma2_sliding")
    adapter = get_adapter(model)
    w = adapter.mhsa_weights(model, 0)  # a global layer (the Lorsa itself is global)
    cfg = LorsaConfig.from_mhsa(w, n_ov_heads=2 * w.n_heads * 2, top_k=4, qk_heads_per_mhsa_head=2, layer=0)
    assert cfg.scale == pytest.approx(24 ** 0.5)
    lorsa = Lorsa(cfg)
    lorsa.init_from_mhsa(w, generator=torch.Generator().manual_seed(0))
    x = torch.randn(BATCH, SEQ, D_MODEL, generator=torch.Generator().manual_seed(4))
    got = lorsa.attention_pattern(x)
    uncapped = mhsa_pattern(MHSAWeights(**{**w.__dict__, "softcap": None}), x).repeat_interleave(2, 1)
    assert (got - uncapped).abs().max() < TOL
    assert (got - mhsa_pattern(w, x).repeat_interleave(2, 1)).abs().max() > 1e-3


def test_rope_settings_a_transformers_4_model_would_ignore_are_refused() -> None:
    """transformers 4 reads ``rope_scaling`` / ``rope_theta`` only: a transformers-5 ``rope_parameters``
    alone (its model would run unscaled RoPE) is a named error there; both keys, or transformers 5, pass."""
    v5_only = types.SimpleNamespace(rope_parameters=dict(LLAMA3_ROPE), rope_scaling=None, rope_theta=10000.0)
    with pytest.raises(ConfigMismatchError, match=r"rope_parameters.*transformers 4\.x ignores.*rope_scaling"):
        check_rope_read(v5_only, transformers_major=4)
    check_rope_read(v5_only, transformers_major=5)
    scaling = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    both = types.SimpleNamespace(rope_parameters=dict(LLAMA3_ROPE), rope_scaling=scaling, rope_theta=10000.0)
    check_rope_read(both, transformers_major=4)
    other_theta = types.SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                                        rope_scaling=None, rope_theta=10000.0)
    with pytest.raises(ConfigMismatchError, match="rope_theta=10000"):
        check_rope_read(other_theta, transformers_major=4)
    # the adapter checks on construction, with the installed transformers
    LlamaAdapter(transformers.LlamaConfig(**_COMMON, num_key_value_heads=2, **rope_kwargs(LLAMA3_ROPE)))
