"""``error=True`` reproduces the unmodified model's logits on prompts up to the model's context length:
bit for bit since the error term is summed in fp32 (docs/nnsight.md; every dtype in test_placement.py).
The relative bound ``max |Δlogit| ≤ 1e-5 · max |logit|`` stated before that holds a fortiori."""

from __future__ import annotations

import pytest
import torch
from helpers import FAMILIES, make_lorsa, make_sae, make_transcoders, tiny_nnsight, unembed

from nnsight_lorsa import LorsaSet, ReplacementModel, SAESet, TranscoderSet, get_adapter

#: the stated bound (relative to max |logit|, fp32), 10x the largest error measured
BOUND = 1e-5


def _relative_error(model, rm, ids) -> float:
    with torch.no_grad(), model.trace(ids):
        plain = unembed(model).output.save()
    with torch.no_grad(), rm.trace(ids):
        rm.replace()
        replaced = unembed(model).output.save()
    return float((replaced - plain).abs().max() / plain.abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_error_terms_reproduce_the_model_up_to_its_context_length(family):
    model, hf = tiny_nnsight(family)
    adapter = get_adapter(model)
    n_layers, n_ctx = adapter.n_layers, int(hf.config.max_position_embeddings)
    rm = ReplacementModel(
        model, lorsas=LorsaSet(model, {layer: make_lorsa(hf, adapter, layer) for layer in range(n_layers)}),
        transcoders=TranscoderSet(model, make_transcoders(range(n_layers), skip_layer=1)),
        # an SAE on a norm's output (OLMo-2 has no pre-norm: its post-attention norm)
        saes=SAESet(model, {adapter.attention_norm_path(0) or adapter.attention_post_norm_path(0): make_sae()}),
        error=True)
    g = torch.Generator().manual_seed(7)
    for length in (4, n_ctx):
        ids = torch.randint(2, hf.config.vocab_size, (1, length), generator=g)
        err = _relative_error(model, rm, ids)
        assert err == 0.0, (family, length, err)
    # the bound is not vacuous: without error terms the logits move by far more
    rm.error = False
    assert _relative_error(model, rm, ids) > 100 * BOUND


def test_embedded_model_with_its_lorsa_and_transcoders_at_its_context_length():
    from nnsight_lorsa.assets import default_corpus_path, default_lorsa_dir, default_transcoder_dir
    from nnsight_lorsa.envoy import load_model

    model = load_model()
    rm = ReplacementModel(model, lorsas=LorsaSet.from_pretrained(model, default_lorsa_dir()),
                          transcoders=TranscoderSet.from_pretrained(model, default_transcoder_dir()), error=True)
    n_ctx = int(model.config.max_position_embeddings)
    text = default_corpus_path().read_text(encoding="utf-8")[:20_000]
    ids = model.tokenizer(text, return_tensors="pt")["input_ids"][:, :n_ctx]
    assert ids.shape[1] == n_ctx
    assert _relative_error(model, rm, ids) == 0.0
