"""A transcoder whose circuit-tracer hooks say it writes ``hook_mlp_out`` on Gemma-2 / Gemma-3 replaces
``post_feedforward_layernorm``'s output through ``TranscoderSet.replace`` (the envoy path, not only attribution):

- ``replace(error=True)`` with no edit gives the plain trace's logits bit for bit;
- ``replace()`` gives the logits of the Hugging Face model with that norm's output swapped for the transcoder's output
  by plain forward hooks (an independent reference), for each place the file may say it reads (the MLP's input,
  ``hook_resid_mid`` = the pre-MLP norm's input, ``ln2.hook_normalized`` = ``x / rms(x)`` of it);
- the features read through the envoy are the transcoder's encoding of that input, and zeroing them gives the
  reference with the decoder's bias and the skip path alone written after the post-norm."""

from __future__ import annotations

from typing import Any

import nnsight
import pytest
import torch
from helpers import circuit_tracer_hooked, head_logits, make_transcoder, random_ids, relative, tiny_nnsight, unembed

from nnsight_lorsa import TranscoderSet

LAYER = 1
READS = ("mlp.hook_in", "hook_resid_mid", "ln2.hook_normalized")


def _read(layer_module: torch.nn.Module, hook_in: str, resid_mid: torch.Tensor, mlp_in: torch.Tensor) -> torch.Tensor:
    """What the file says the transcoder reads, computed by hand from the decoder layer's tensors."""
    if hook_in == "mlp.hook_in":
        return mlp_in
    if hook_in == "hook_resid_mid":
        return resid_mid
    norm = layer_module.pre_feedforward_layernorm
    x = resid_mid.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps)).to(resid_mid.dtype)


@torch.no_grad()
def _reference(hf: torch.nn.Module, tc: Any, hook_in: str, ids: torch.Tensor, zero_features: bool = False) -> tuple:
    """(logits, features) of the Hugging Face model with layer LAYER's ``post_feedforward_layernorm`` output
    replaced by the skip transcoder's output on what it reads (forward hooks; the transcoder in plain torch)."""
    layer_module = hf.model.layers[LAYER]
    seen: dict[str, torch.Tensor] = {}

    def keep_mid(module: torch.nn.Module, args: tuple) -> None:
        seen["mid"] = args[0]

    def keep_in(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        seen["in"] = args[0] if args else kwargs["hidden_states"]

    def swap(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        x = _read(layer_module, hook_in, seen["mid"], seen["in"])
        pre = x @ tc.W_enc + tc.b_enc  # TopK (k 8), plain torch: the k largest pre-activations, ReLU'd
        top = pre.topk(8, dim=-1)
        feats = torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())
        seen["feats"] = feats
        if zero_features:
            feats = torch.zeros_like(feats)
        return feats @ tc.W_dec + tc.b_dec + x @ tc.W_skip.T

    handles = [layer_module.pre_feedforward_layernorm.register_forward_pre_hook(keep_mid),
               layer_module.mlp.register_forward_pre_hook(keep_in, with_kwargs=True),
               layer_module.post_feedforward_layernorm.register_forward_hook(swap)]
    try:
        logits = head_logits(hf, ids)
    finally:
        for h in handles:
            h.remove()
    return logits, seen["feats"]


@pytest.mark.parametrize("hook_in", READS)
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_hook_mlp_out_transcoders_replace_the_post_norm_output_through_the_envoy(family: str, hook_in: str) -> None:
    model, hf = tiny_nnsight(family)
    ids = random_ids(2, 9, seed=5)
    tc = circuit_tracer_hooked(make_transcoder(skip=True, seed=7), hook_in, "hook_mlp_out")
    tcs = TranscoderSet(model, {LAYER: tc})
    assert tcs.site(LAYER).site_paths == (f"model.layers.{LAYER}.post_feedforward_layernorm",)

    with model.trace(ids):
        plain = nnsight.save(unembed(model).output)
    with model.trace(ids):
        tcs.replace(LAYER, error=True)
        kept = nnsight.save(unembed(model).output)
    assert torch.equal(kept, plain)

    ref_logits, ref_feats = _reference(hf, tc, hook_in, ids)
    with model.trace(ids):
        env = tcs.replace(LAYER)
        feats = nnsight.save(env.hook_sae_acts_post.output)
        logits = nnsight.save(unembed(model).output)
    assert relative(feats.detach(), ref_feats) < 1e-5
    assert relative(logits, ref_logits) < 1e-5
    assert relative(logits, plain) > 1e-3  # the swap is visible: the reference is not the plain model

    zero_logits, _ = _reference(hf, tc, hook_in, ids, zero_features=True)
    with model.trace(ids):
        env = tcs.replace(LAYER)
        env.hook_sae_acts_post.output[:] = 0
        zeroed = nnsight.save(unembed(model).output)
    assert relative(zeroed, zero_logits) < 1e-5
    assert relative(zeroed, ref_logits) > 1e-3
