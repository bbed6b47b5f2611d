"""RoPE probe: the rotation the adapters describe (``mhsa_weights(root, layer).rotary``, computed by
:func:`~nnsight_lorsa.modules.rotary.rotary_cos_sin`) against what the Hugging Face model itself computes — its
rotary module's cos / sin and its own attention weights (eager, ``output_attentions``) — on the tiny models of every
rotary family, in fp32 and cast after loading to bf16 / fp16.

A model cast with ``.to(torch.bfloat16)`` / ``.half()`` rounds its rotary module's ``inv_freq`` buffer (its forward
upcasts the rounded buffer to fp32); until 2026-11-28 the adapters computed fp32 frequencies from the config, so the
frozen MHSA's patterns drifted from the model's with the position (a row's L1 gap up to 0.06 at 1,024 tokens on the
tiny Qwen3, 6–12x the bf16 rounding of the same comparison with fp32 frequencies). ``RotaryConfig.inv_freq_dtype``
says the frequencies are so rounded, read from the model's buffer by ``ArchitectureAdapter.model_rotary``, which also
refuses (``ConfigMismatchError``) a buffer that no rounding of the config's frequencies equals.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import DEVICES, generated, make_lorsa, tiny_config, tiny_hf_model
from hypothesis import assume
from hypothesis import strategies as st

from nnsight_lorsa import get_adapter
from nnsight_lorsa.adapters.base import mhsa_pattern
from nnsight_lorsa.errors import CheckpointError, ConfigMismatchError, UnsupportedArchitectureError
from nnsight_lorsa.modules.rotary import RotaryConfig, rotary_cos_sin, rotary_inv_freq

#: the tiny models' families with rotary (GPT-2 has none)
ROTARY_FAMILIES = ("llama", "qwen2", "qwen3", "neox", "gemma2", "gemma3", "olmo2", "phi3", "gemma")
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def loud(family: str, dtype: torch.dtype | None = None, fp32_freqs: bool = False) -> torch.nn.Module:
    """The tiny model with its query and key projections x4 (sharp patterns: a rotation's error shows), cast to
    ``dtype`` after building (``.to``: the rotary buffer rounded), or with its fp32 buffers put back
    (``fp32_freqs``: the model as ``from_pretrained(..., dtype=dtype)`` loads it)."""
    hf = tiny_hf_model(family)
    adapter = get_adapter(hf)
    with torch.no_grad():
        for layer in range(adapter.n_layers):
            attn = adapter.attention_module(hf, layer)
            for name in ("q_proj", "k_proj", "query_key_value", "qkv_proj"):
                if hasattr(attn, name):
                    getattr(attn, name).weight.mul_(4)
    fp32 = {n: b.clone() for n, b in hf.named_buffers() if n.endswith("inv_freq")}
    if dtype is not None:
        hf = hf.to(dtype)
    if fp32_freqs:
        for n, b in fp32.items():
            module, _, name = n.rpartition(".")
            setattr(hf.get_submodule(module), name, b)
    return hf


@torch.no_grad()
def pattern_gap(hf: torch.nn.Module, seq: int, seed: int = 0) -> float:
    """The largest L1 distance between a row of the frozen MHSA's pattern (``mhsa_pattern`` of
    ``mhsa_weights(hf, layer)`` at the attention's recorded input) and the same row of the model's own attention
    weights (eager, ``output_attentions=True``), over every layer, head and query."""
    adapter = get_adapter(hf)
    seen: dict[int, torch.Tensor] = {}
    hooks = [adapter.attention_module(hf, i).register_forward_pre_hook(
        lambda m, a, k, i=i: seen.__setitem__(i, adapter.attention_input(a, k)), with_kwargs=True)
        for i in range(adapter.n_layers)]
    try:
        ids = torch.randint(2, 128, (1, seq), generator=torch.Generator().manual_seed(seed))
        own = hf(ids, output_attentions=True).attentions
    finally:
        for h in hooks:
            h.remove()
    return max(float((mhsa_pattern(adapter.mhsa_weights(hf, i), seen[i]).double() - own[i].double())
                     .abs().sum(-1).max()) for i in range(adapter.n_layers))


def check_patterns(family: str, dtype: torch.dtype, seq: int) -> None:
    """The frozen MHSA of the cast model is as close to that model's own patterns as the frozen MHSA of the same
    model with fp32 frequencies is to its (the model's bf16 / fp16 scores and q, k roundings, what is left): within
    1.5x that gap (measured 0.9–1.35x). With fp32 frequencies on the cast model the gap was 3–8x at 256 tokens on
    Qwen3, up to 15x at 512."""
    gap = pattern_gap(loud(family, dtype), seq)
    floor = pattern_gap(loud(family, dtype, fp32_freqs=True), seq)
    assert gap <= 1.5 * floor + 1e-6, (family, dtype, seq, gap, floor)


@pytest.mark.parametrize("dtype", list(HALF.values()), ids=list(HALF))
def test_the_frozen_mhsa_of_a_cast_model_has_its_patterns_at_a_long_prompt(dtype):
    check_patterns("qwen3", dtype, 256)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(HALF.values()), ids=list(HALF))
@pytest.mark.parametrize("family", ROTARY_FAMILIES)
def test_sweep_the_frozen_mhsa_of_a_cast_model_has_its_patterns(family, dtype):
    check_patterns(family, dtype, 1024)


@pytest.mark.parametrize("family", ROTARY_FAMILIES)
def test_the_rotary_is_the_models_own_buffer_and_cos_sin(family):
    """For the model in fp32, cast to bf16 / fp16, and cast back to fp32 (the rounded values kept):
    ``inv_freq_dtype`` is the rounding the buffer holds, and ``rotary_cos_sin`` equals the model's rotary module's
    fp32 cos / sin bit for bit at positions up to 4,096."""
    pos = torch.arange(4096)[None]
    for cast in (None, torch.bfloat16, torch.float16, "bf16-then-fp32"):
        hf = tiny_hf_model(family)
        if cast == "bf16-then-fp32":
            hf = hf.to(torch.bfloat16).float()
        elif cast is not None:
            hf = hf.to(cast)
        adapter = get_adapter(hf)
        want = {None: None, torch.bfloat16: "bfloat16", torch.float16: "float16", "bf16-then-fp32": "bfloat16"}[cast]
        for layer in range(adapter.n_layers):
            rot = adapter.mhsa_weights(hf, layer).rotary
            assert rot is not None and rot.inv_freq_dtype == want, (family, cast, layer, rot)
            rotary = hf.get_submodule(next(n for n, _ in hf.named_modules() if n.endswith("rotary_emb")))
            x = torch.zeros(1, dtype=torch.float32)
            with torch.no_grad():
                if family == "gemma3":
                    cos, sin = rotary(x, pos, adapter.config.layer_types[layer])
                else:
                    cos, sin = rotary(x, pos)
            ours = rotary_cos_sin(rot, pos)
            assert cos.dtype == torch.float32 and torch.equal(ours[0], cos) and torch.equal(ours[1], sin), (
                family, cast, layer)


@generated(4, 60, family=st.sampled_from(ROTARY_FAMILIES), which=st.integers(0, 7), steps=st.sampled_from([1, -1, 3]),
           dtype=st.sampled_from([None, *HALF]))
def test_a_buffer_the_config_does_not_give_is_refused_naming_it(family, which, steps, dtype):
    """A model whose rotary buffer is not the config's frequencies (under any rounding: one element moved by
    ``steps`` units of the buffer's dtype) is a ``ConfigMismatchError`` naming the layer and the buffer (the frozen
    MHSA used the config's, silently, before)."""
    hf = tiny_hf_model(family)
    if dtype is not None:
        hf = hf.to(HALF[dtype])
    adapter = get_adapter(hf)
    layer = 1  # Gemma-3: a full-attention layer (its buffer "full_attention_inv_freq")
    name, buf = next((n, b) for n, b in hf.named_buffers() if n.endswith("inv_freq") and "original" not in n
                     and "sliding" not in n)
    with torch.no_grad():
        i = which % buf.numel()
        for _ in range(abs(steps)):
            buf[i] = torch.nextafter(buf[i], torch.tensor(steps * float("inf"), dtype=buf.dtype))
    # a moved value can land on another rounding of the same frequencies (fp16's 0.0100021 one unit up is bf16's
    # 0.0100098): that buffer IS the bf16-rounded frequencies, rightly accepted; not a draw of this test
    cfg = adapter.rotary_config(layer)
    assume(not any(torch.equal(buf.float(), rotary_inv_freq(dataclasses.replace(cfg, inv_freq_dtype=r)))
                   for r in (None, "bfloat16", "float16")))
    with pytest.raises(ConfigMismatchError, match=rf"layer {layer}: .*{name}"):
        adapter.mhsa_weights(hf, layer)


def test_a_lorsa_from_a_cast_model_keeps_fp32_rope_and_export_refuses_rounded_frequencies(tmp_path):
    """``LorsaConfig.from_mhsa`` drops ``inv_freq_dtype`` (the Lorsa keeps its own fp32 RoPE: documented);
    Llamascopium's config cannot express the rounding: a Lorsa given it anyway is refused at export; an unknown
    rounding is a ``CheckpointError``."""
    from nnsight_lorsa import save

    hf = tiny_hf_model("llama").to(torch.bfloat16)
    adapter = get_adapter(hf)
    assert adapter.mhsa_weights(hf, 1).rotary.inv_freq_dtype == "bfloat16"  # type: ignore[union-attr]
    lorsa = make_lorsa(hf, adapter, 1)
    assert lorsa.cfg.rotary is not None and lorsa.cfg.rotary.inv_freq_dtype is None
    lorsa.cfg.rotary = dataclasses.replace(lorsa.cfg.rotary, inv_freq_dtype="bfloat16")
    with pytest.raises(UnsupportedArchitectureError, match="inv_freq_dtype='bfloat16'"):
        save(lorsa, tmp_path / "l", format="llamascopium")
    with pytest.raises(CheckpointError, match="inv_freq_dtype"):
        RotaryConfig(head_dim=16, rotary_dim=16, inv_freq_dtype="float8_e4m3fn")


def test_a_model_on_meta_takes_the_buffers_dtype():
    """On ``meta`` (a remote model's local copy) there are no values to compare: the buffer's dtype decides."""
    cfg = tiny_hf_model("qwen3").config
    import transformers

    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
    adapter = get_adapter(hf)
    assert adapter.mhsa_weights(hf, 0).rotary.inv_freq_dtype is None  # type: ignore[union-attr]
    assert adapter.mhsa_weights(hf.to(torch.float16), 0).rotary.inv_freq_dtype == "float16"  # type: ignore[union-attr]


# ---- every supported rope type x partial rotary x head dims, against the Hugging Face rotary module --------------

#: families and the rope types their configs take (Phi-3's config turns "yarn" into "longrope" and allows no other)
TYPED_FAMILIES = {"llama": ("default", "linear", "llama3", "yarn"), "qwen2": ("default", "linear", "llama3", "yarn"),
                  "qwen3": ("default", "linear", "llama3", "yarn"), "neox": ("default", "linear", "llama3", "yarn"),
                  "olmo2": ("default", "linear", "llama3", "yarn"), "gemma": ("default", "linear", "llama3", "yarn"),
                  "gemma2": ("default", "linear", "llama3", "yarn"), "gemma3": ("default", "linear", "llama3", "yarn"),
                  "phi3": ("default",)}
#: the families whose attention rotates only the first ``partial_rotary_factor`` of each head
PARTIAL = {"neox": (0.25, 0.5, 1.0), "phi3": (0.5, 0.75, 1.0)}


@st.composite
def rope_params(draw, rope_type: str, partial: float) -> dict:
    """One ``rope_parameters`` dict of ``rope_type`` with drawn values (optional keys drawn absent or None)."""
    p: dict = {"rope_type": rope_type, "rope_theta": draw(st.sampled_from([10000.0, 500000.0, 1e6, 160.0, 12345.5]))}
    if partial != 1.0:
        p["partial_rotary_factor"] = partial
    if rope_type == "linear":
        p["factor"] = draw(st.sampled_from([2.0, 8.0, 0.5]))
    elif rope_type == "llama3":
        p.update(factor=draw(st.sampled_from([8.0, 32.0, 2.0])), low_freq_factor=draw(st.sampled_from([1.0, 2.0])),
                 high_freq_factor=draw(st.sampled_from([4.0, 8.0])),
                 original_max_position_embeddings=draw(st.sampled_from([16, 64, 8192])))
    elif rope_type == "yarn":
        old = draw(st.sampled_from([16, 64, 4096]))
        p.update(factor=draw(st.sampled_from([None, 2.0, 4, 32.0, 40.0])), original_max_position_embeddings=old)
        for key, values in (("beta_fast", [32, 16.0, 64]), ("beta_slow", [1, 2.0, 0.5]), ("mscale", [0.707, 1.0, 1]),
                            ("mscale_all_dim", [0.707, 1.0]), ("attention_factor", [0.9, 1.25]),
                            ("truncate", [True, False])):
            if draw(st.booleans()):
                p[key] = draw(st.sampled_from(values))
    return p


@st.composite
def rope_models(draw) -> tuple[str, object]:
    """(family, transformers config) of a tiny 2-layer model with drawn RoPE: type, partial rotary, head dim."""
    import transformers

    family = draw(st.sampled_from(sorted(TYPED_FAMILIES)))
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    head_dim = 64 // heads
    partial = draw(st.sampled_from(PARTIAL.get(family, (1.0,))))
    assume_even = int(head_dim * partial) % 2 == 0 and int(head_dim * partial) > 0
    if not assume_even:
        partial = 1.0
    common = dict(hidden_size=64, num_attention_heads=heads, num_hidden_layers=2, vocab_size=128,
                  intermediate_size=64, max_position_embeddings=draw(st.sampled_from([128, 4096])))
    kinds = TYPED_FAMILIES[family]
    if family == "gemma3":
        rope = {k: draw(rope_params(draw(st.sampled_from(kinds)), 1.0)) for k in ("sliding_attention",
                                                                               "full_attention")}
        cfg = transformers.Gemma3TextConfig(**common, num_key_value_heads=1, head_dim=head_dim,
                                            layer_types=["sliding_attention", "full_attention"], sliding_window=4096,
                                            rope_parameters=rope, pad_token_id=1, bos_token_id=0, eos_token_id=1)
        return family, cfg
    rope = draw(rope_params(draw(st.sampled_from(kinds)), partial))
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
           "neox": transformers.GPTNeoXConfig, "olmo2": transformers.Olmo2Config, "gemma": transformers.GemmaConfig,
           "gemma2": transformers.Gemma2Config, "phi3": transformers.Phi3Config}[family]
    extra: dict = {"neox": {}, "phi3": {"num_key_value_heads": heads, "original_max_position_embeddings": 4096}}.get(
        family, {"num_key_value_heads": heads})
    if family in ("qwen3", "gemma", "gemma2"):
        extra["head_dim"] = head_dim
    if family in ("olmo2", "gemma", "gemma2", "phi3"):
        extra.update(pad_token_id=1, bos_token_id=0, eos_token_id=1)
    return family, cls(**common, **extra, rope_parameters=rope)


def rotary_module_cos_sin(hf, adapter, layer: int, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own rotary module's cos / sin in fp32 (x fp32) at ``pos`` (1, n)."""
    rotary = next(m for n, m in hf.named_modules() if n.endswith("rotary_emb"))
    x = torch.zeros(1, dtype=torch.float32, device=pos.device)
    with torch.no_grad():
        if adapter.family == "gemma3":
            return rotary(x, pos, adapter.config.layer_types[layer])
        return rotary(x, pos)


@generated(6, 300, drawn=rope_models(), seed=st.integers(0, 2 ** 16))
def test_every_rope_type_is_the_models_own_cos_sin_and_patterns(drawn, seed):
    """Drawn configs (every supported rope type, yarn's optional keys present or not, partial rotary, head dims 8–64,
    Gemma-3's two layer types): ``mhsa_weights(model, layer).rotary`` is accepted by the buffer check (its frequencies
    are the buffer's bit for bit), ``rotary_cos_sin`` equals the Hugging Face rotary module's fp32 cos / sin bit for
    bit at positions 0–8,191, and the frozen MHSA's patterns equal the model's own (eager) within 1e-5 of a row's L1
    at 48 tokens."""
    import transformers

    family, cfg = drawn
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    adapter = get_adapter(hf)
    pos = torch.arange(8192)[None]
    for layer in range(adapter.n_layers):
        rot = adapter.mhsa_weights(hf, layer).rotary
        assert rot is not None and rot.inv_freq_dtype is None
        cos, sin = rotary_module_cos_sin(hf, adapter, layer, pos)
        ours = rotary_cos_sin(rot, pos)
        assert torch.equal(ours[0], cos) and torch.equal(ours[1], sin), (family, layer, rot, cfg.rope_parameters)
    gap = pattern_gap(hf, 48, seed)
    assert gap <= 1e-5, (family, gap, cfg.rope_parameters)


@pytest.mark.parametrize(("beta_fast", "beta_slow", "truncate", "old"), [
    (32, 3, True, 16), (32, 2.5, True, 12), (8, 8, False, 64), (2, 2, False, 16)])
def test_yarn_with_a_collapsed_correction_range_is_the_models_own(beta_fast, beta_slow, truncate, old):
    """A collapsed yarn correction range (``low == high``: transformers moves ``high`` by 0.001, "Prevent
    singularity"), which the drawn sweep above never reaches: with ``truncate`` and ``original_max_position_embeddings
    <= 2π·beta_slow`` both ends clamp to 0 (the first frequency's ramp is 0 / 0 without the guard); with
    ``beta_fast == beta_slow`` and no ``truncate`` both are one number. ``rotary_cos_sin`` equals the Hugging Face
    rotary module's fp32 cos / sin bit for bit at positions 0–4,095."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                                   vocab_size=128, intermediate_size=64, max_position_embeddings=256,
                                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                    "original_max_position_embeddings": old,
                                                    "beta_fast": beta_fast, "beta_slow": beta_slow,
                                                    "truncate": truncate})
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    adapter = get_adapter(hf)
    rot = adapter.mhsa_weights(hf, 0).rotary
    assert rot is not None and rot.rope_type == "yarn"
    pos = torch.arange(4096)[None]
    cos, sin = rotary_module_cos_sin(hf, adapter, 0, pos)
    ours = rotary_cos_sin(rot, pos)
    assert torch.equal(ours[0], cos) and torch.equal(ours[1], sin)


@pytest.mark.parametrize("rope", [
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
     "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}], ids=["dynamic", "longrope"])
def test_sequence_length_dependent_rope_is_refused_saying_why(rope):
    """``dynamic`` / ``longrope`` (their frequencies change with the prompt's length) are a named
    ``UnsupportedArchitectureError`` saying so, from ``rotary_config`` and ``mhsa_weights``."""
    import transformers

    cls = transformers.Phi3Config if rope["rope_type"] == "longrope" else transformers.LlamaConfig
    cfg = cls(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=1, vocab_size=128,
              intermediate_size=64, max_position_embeddings=128, rope_parameters=dict(rope),
              pad_token_id=1, bos_token_id=0, eos_token_id=1,
              **({"original_max_position_embeddings": 64} if cls is transformers.Phi3Config else {}))
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    adapter = get_adapter(hf)
    for call in (lambda: adapter.rotary_config(0), lambda: adapter.mhsa_weights(hf, 0)):
        with pytest.raises(UnsupportedArchitectureError, match=rf"{rope['rope_type']}.*sequence length"):
            call()


def test_a_yarn_lorsa_round_trips_and_llamascopium_refuses_it(tmp_path):
    """A Lorsa initialised from a yarn model carries yarn (its ``truncate``, ``attention_scaling``) through our format
    and rotates as the model; Llamascopium's config cannot express yarn: refused, named."""
    import transformers

    from nnsight_lorsa import load, save

    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                                   vocab_size=128, intermediate_size=64, max_position_embeddings=256,
                                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                    "original_max_position_embeddings": 64, "truncate": False,
                                                    "mscale": 0.707, "mscale_all_dim": 1.0})
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    adapter = get_adapter(hf)
    lorsa = make_lorsa(hf, adapter, 1)
    rot = lorsa.cfg.rotary
    assert rot is not None and rot.rope_type == "yarn" and rot.scaling["truncate"] == 0.0
    assert rot.attention_scaling != 1.0
    assert load(save(lorsa, tmp_path / "ours")).cfg.rotary == rot
    with pytest.raises(UnsupportedArchitectureError, match="yarn"):
        save(lorsa, tmp_path / "theirs", format="llamascopium")


def test_gemma3_yarn_truncates_as_transformers_whatever_the_layer_types_dict_says():
    """transformers reads yarn's ``truncate`` from the global ``rope_parameters`` (``config.rope_parameters.get``),
    so a Gemma-3 layer type's ``truncate: False`` is not applied: the adapter reads it there too (the per-type value
    gives other frequencies than the model's buffer)."""
    import transformers

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0,
                               "original_max_position_embeddings": 64, "truncate": False}}
    cfg = transformers.Gemma3TextConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16, num_hidden_layers=2, vocab_size=128,
        intermediate_size=64, max_position_embeddings=512, layer_types=["sliding_attention", "full_attention"],
        rope_parameters=rope, pad_token_id=1, bos_token_id=0, eos_token_id=1)
    hf = transformers.AutoModelForCausalLM.from_config(cfg)
    adapter = get_adapter(hf)
    rot = adapter.mhsa_weights(hf, 1).rotary
    assert rot is not None and rot.scaling["truncate"] == 1.0
    pos = torch.arange(2048)[None]
    assert all(torch.equal(a, b) for a, b in zip(rotary_cos_sin(rot, pos), rotary_module_cos_sin(hf, adapter, 1, pos),
                                                 strict=True))
    untruncated = dataclasses.replace(rot, scaling={**rot.scaling, "truncate": 0.0})
    assert not torch.equal(rotary_cos_sin(untruncated, pos)[0], rotary_module_cos_sin(hf, adapter, 1, pos)[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_model_built_or_moved_onto_the_device_passes_the_buffer_check_and_rotates_as_it(family, device):
    """Moved there (``.to(device)``, its buffer computed on the CPU) or built there (``with torch.device(device)``: its
    buffer computed by that device's kernels): ``mhsa_weights`` accepts the buffer and ``rotary_cos_sin`` on the
    device equals the model's rotary module's cos / sin there, bit for bit (fp32, positions 0–4,095)."""
    import transformers

    pos = torch.arange(4096, device=device)[None]
    with torch.device(device):
        built = transformers.AutoModelForCausalLM.from_config(tiny_config(family))
    for hf in (tiny_hf_model(family).to(device), built):
        adapter = get_adapter(hf)
        for layer in range(adapter.n_layers):
            rot = adapter.mhsa_weights(hf, layer).rotary
            assert rot is not None
            want = rotary_module_cos_sin(hf, adapter, layer, pos)
            got = rotary_cos_sin(rot, pos)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (family, device, layer)
