"""Mutation probe, round 9 (Lorsa sets, reading internals and nnsight internals): tests for the mutants that survived
the area's tests (docs/reliability.md, "Mutation probe, round 9: Lorsa sets, reading internals and nnsight
internals"). Each compares against an independent reference: the documented rule (``generate`` settings a Lorsa can
follow, the padding checks), the unmodified model or a plain torch forward hook."""

from __future__ import annotations

import shutil

import nnsight
import pytest
import torch
import transformers
from helpers import make_lorsa, random_ids, same_weights, tiny_nnsight, unembed

from nnsight_lorsa import Lorsa, LorsaConfig, LorsaSet, get_adapter
from nnsight_lorsa.envoy import lorsa_set as lorsa_set_module
from nnsight_lorsa.envoy.lorsa_set import check_generation
from nnsight_lorsa.errors import ConfigMismatchError, UnsupportedGenerationError

LAYER = 1


@pytest.fixture(scope="module")
def llama():
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    return model, hf, LorsaSet(model, {LAYER: make_lorsa(hf, adapter, LAYER)})


# ------------------------------------------------------------------------------------------------- check_generation
@pytest.mark.parametrize("kwargs", [{"num_beams": 1}, {"num_beam_groups": 1}, {"num_beams": 1, "num_beam_groups": 1},
                                    {"penalty_alpha": 0.0}, {"prompt_lookup_num_tokens": 0},
                                    {"assistant_model": None}, {"num_beams": None}])
def test_greedy_settings_spelled_out_are_not_refused(kwargs):
    """``num_beams=1`` / ``num_beam_groups=1`` (one beam, one group) and a zero / unset contrastive or prompt-lookup
    setting are plain greedy or sampled decoding (transformers' meaning of those values): allowed, as the error
    message itself says (``num_beams=1``)."""
    check_generation(kwargs)
    check_generation({}, transformers.GenerationConfig(**{k: v for k, v in kwargs.items() if k != "assistant_model"}))


@pytest.mark.parametrize("kwargs", [{"num_beams": 2}, {"num_beam_groups": 2}, {"penalty_alpha": 0.6},
                                    {"prompt_lookup_num_tokens": 3}])
def test_a_generation_config_given_to_generate_is_read_for_what_the_kwargs_leave_unset(kwargs):
    """``generate(ids, generation_config=GenerationConfig(num_beams=2))``: the config passed to the call counts
    (transformers reads it before the model's own), so the beam search is refused like the keyword itself."""
    given = transformers.GenerationConfig(**kwargs)
    with pytest.raises(UnsupportedGenerationError, match=next(iter(kwargs))):
        check_generation({"generation_config": given}, transformers.GenerationConfig())
    with pytest.raises(UnsupportedGenerationError, match=next(iter(kwargs))):
        check_generation(kwargs, transformers.GenerationConfig())
    # the call's own kwarg wins over its generation_config, which wins over the model's
    check_generation({**{k: 1 if "beam" in k else 0 for k in kwargs}, "generation_config": given})
    check_generation({"generation_config": transformers.GenerationConfig(num_beams=1)},
                     transformers.GenerationConfig(num_beams=2))


def test_generate_with_a_beam_search_generation_config_is_refused_before_any_token(llama):
    """End to end: nnsight hands ``generate``'s ``generation_config`` to the traced call; ``replace`` refuses it
    before the model runs (a Lorsa keeps its own keys and values, which beams would reorder)."""
    model, _, lorsa = llama
    reached = []
    config = transformers.GenerationConfig(num_beams=2, max_new_tokens=3, pad_token_id=1)
    with pytest.raises(UnsupportedGenerationError, match="num_beams=2"), model.generate(
            random_ids(1, 6), generation_config=config):
        lorsa.replace(layer=LAYER)
        reached.append(nnsight.save(unembed(model).output))
    assert not reached


# ------------------------------------------------------------------------------------------------ LorsaSet.check / io
def test_a_lorsa_wider_than_the_model_is_refused(llama):
    """``d_model`` must equal the model's (the Lorsa reads and writes its residual stream): wider is refused like
    narrower, before any trace."""
    model, hf, _ = llama
    d = hf.config.hidden_size
    for width in (d // 2, 2 * d):
        wrong = Lorsa(LorsaConfig(d_model=width, n_qk_heads=2, d_qk_head=16, n_ov_heads=8, top_k=2))
        with pytest.raises(ConfigMismatchError, match=f"d_model={width}, the model has {d}"):
            LorsaSet(model, {LAYER: wrong})


def test_a_lorsa_trained_for_layer_0_is_refused_at_another_layer(llama):
    """``cfg.layer`` records the layer it was trained for; 0 is a layer like any other (not "unset")."""
    model, hf, _ = llama
    adapter = get_adapter(model)
    with pytest.raises(ConfigMismatchError, match="trained for layer 0, not layer 1"):
        LorsaSet(model, {1: make_lorsa(hf, adapter, 0)})
    assert list(LorsaSet(model, {0: make_lorsa(hf, adapter, 0)})) == [0]


def test_a_folder_renamed_to_layer_0_names_layer_0(llama, tmp_path):
    """``layer_0`` names layer 0 (from_pretrained's documented rule: the folder's name first, the checkpoint's
    ``cfg.layer`` only where the name is none): a Lorsa of layer 1 copied by hand to ``layer_0`` is refused, not
    quietly loaded back at layer 1; the set saved as it was loads at its own layers."""
    model, hf, _ = llama
    adapter = get_adapter(model)
    lorsas = {0: make_lorsa(hf, adapter, 0, seed=5), 1: make_lorsa(hf, adapter, 1, seed=6)}
    LorsaSet(model, lorsas).save(tmp_path / "set")
    back = LorsaSet.from_pretrained(model, tmp_path / "set")
    assert list(back) == [0, 1] and all(same_weights(back[k], lorsas[k]) for k in (0, 1))
    shutil.copytree(tmp_path / "set" / "layer_1", tmp_path / "renamed" / "layer_0")
    with pytest.raises(ConfigMismatchError, match="trained for layer 1, not layer 0"):
        LorsaSet.from_pretrained(model, tmp_path / "renamed")


def test_beams_from_the_generation_config_are_refused_at_the_first_cached_step_where_the_method_is_unknown(
        llama, monkeypatch):
    """Where ``replace`` cannot tell the traced method (a remote server: ``traced_method`` is None) it ignores the
    model's ``generation_config``; the first cached step then checks it (``LorsaSet.site``'s documented check), so a
    beam search set only there is still refused, not run with a Lorsa that cannot follow the beams."""
    model, hf, lorsa = llama
    monkeypatch.setattr(lorsa_set_module, "traced_method", lambda interleaver: None)
    monkeypatch.setattr(hf.generation_config, "num_beams", 2)
    with pytest.raises(UnsupportedGenerationError, match="num_beams=2"), model.generate(
            random_ids(1, 6), max_new_tokens=3, pad_token_id=1):
        lorsa.replace(layer=LAYER)
    monkeypatch.setattr(hf.generation_config, "num_beams", 1)
    with model.generate(random_ids(1, 6), max_new_tokens=3, min_new_tokens=3, pad_token_id=1) as tracer:
        lorsa.replace(layer=LAYER)
        out = nnsight.save(tracer.result)
    assert out.shape == (1, 9)


# ---------------------------------------------------------------------------------------------------- _own_tokens
@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("new", [None, 5])
def test_a_padded_row_that_the_masking_code_unmasked_is_still_padding(additive, new):
    """transformers 4's SDPA path (``AttentionMaskConverter._unmask_unattended``, torch < 2.5's fix) lets a fully
    masked query row (a left pad: every key up to it is padding) attend everywhere, later keys included; such a row
    is padding all the same (``_own_tokens``' documented rule). Reference: the batch's 2-D mask."""
    from transformers import masking_utils as mu

    from nnsight_lorsa.envoy.lorsa_set import _own_tokens

    mask2d = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1]]).bool()
    total = mask2d.shape[1]
    q = total if new is None else new
    allowed = mu.sdpa_mask(batch_size=3, q_length=q, kv_length=total, q_offset=total - q, allow_is_causal_skip=False,
                           attention_mask=mask2d)
    allowed = allowed | ~allowed.any(-1, keepdim=True)  # the unmasking: fully masked rows attend everywhere
    assert bool(allowed[0, 0, 0].all())  # row 0's first query here is a pad, and now sees later keys too
    mask = allowed if not additive else torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    got = _own_tokens(mask, 3, q, torch.device("cpu"))
    assert torch.equal(got, mask2d[:, total - q:])
