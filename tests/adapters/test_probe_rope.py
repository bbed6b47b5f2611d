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
from helpers import generated, make_lorsa, tiny_hf_model
from hypothesis import strategies as st

from nnsight_lorsa import get_adapter
from nnsight_lorsa.adapters.base import mhsa_pattern
from nnsight_lorsa.errors import CheckpointError, ConfigMismatchError, UnsupportedArchitectureError
from nnsight_lorsa.modules.rotary import RotaryConfig, rotary_cos_sin

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
