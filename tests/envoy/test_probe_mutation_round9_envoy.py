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
from helpers import make_lorsa, random_ids, relative, same_weights, tiny_nnsight, unembed

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


# ----------------------------------------------------------------------------------------------------------- read.py
def hooked_values(hf, adapter, layer: int, ids: torch.Tensor, mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Plain torch reference: layer ``layer``'s attention input / output and the decoder layer's output, from forward
    hooks on the Hugging Face model itself; and how often the last decoder layer ran."""
    got: dict = {"last_ran": 0}
    attn = adapter.attention_module(hf, layer)
    block = hf.model.layers[layer]

    def pre(module, args, kwargs):
        got["x"] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

    def post(module, args, out):
        got["y"] = (out[0] if isinstance(out, tuple) else out).detach().clone()

    def block_post(module, args, out):
        got["resid"] = (out[0] if isinstance(out, tuple) else out).detach().clone()

    def last(module, args, out):
        got["last_ran"] += 1

    hooks = [attn.register_forward_pre_hook(pre, with_kwargs=True), attn.register_forward_hook(post),
             block.register_forward_hook(block_post), hf.model.layers[-1].register_forward_hook(last)]
    try:
        with torch.no_grad():
            hf(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return got


def test_read_sites_honours_the_attention_mask_of_a_left_padded_batch(llama):
    """``read_sites(..., attention_mask=mask)`` reads what the model computes under that mask (its documented
    argument): on a left-padded batch the token rows' attention input and output equal the hooked forward's with the
    same mask — which differs from the unmasked one (the test would pass trivially otherwise)."""
    from nnsight_lorsa.envoy.read import attention_activations

    model, hf, _ = llama
    adapter = get_adapter(model)
    ids = random_ids(2, 7, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 1
    acts = attention_activations(model, LAYER, ids, attention_mask=mask)
    want = hooked_values(hf, adapter, LAYER, ids, mask)
    unmasked = hooked_values(hf, adapter, LAYER, ids, None)
    tok = mask.bool()
    assert relative(acts.x[tok], want["x"][tok]) <= 1e-6 and relative(acts.y[tok], want["y"][tok]) <= 1e-6
    assert relative(unmasked["y"][tok], want["y"][tok]) > 1e-3


def test_a_site_without_a_kind_reads_the_modules_output(llama):
    """``Site(path)``: ``kind`` defaults to ``"output"`` (the dataclass's documented default), the decoder layer's
    output here, not its input."""
    from nnsight_lorsa.envoy.read import Site, read_sites

    model, hf, _ = llama
    adapter = get_adapter(model)
    assert Site(adapter.layer_path(LAYER)).kind == "output"
    ids = random_ids(2, 6, seed=5)
    got = read_sites(model, {"r": Site(adapter.layer_path(LAYER))}, ids)
    want = hooked_values(hf, adapter, LAYER, ids, None)
    assert relative(got["r"], want["resid"]) <= 1e-6


def test_read_sites_stops_after_the_last_site_unless_edits_are_stored(llama):
    """``read_sites`` stops the trace after its last site, so later layers are not computed (the documented cost),
    unless ``model.edit()`` stored edits (nnsight replays them in the trace, the pass then runs to the end); the
    values read are the hooked forward's either way."""
    from nnsight_lorsa.envoy.read import Site, read_sites

    model, hf, lorsa = llama
    adapter = get_adapter(model)
    ids = random_ids(2, 6, seed=6)
    want = hooked_values(hf, adapter, 0, ids, None)
    ran = []
    hook = hf.model.layers[-1].register_forward_hook(lambda module, args, out: ran.append(1))
    try:
        got = read_sites(model, {"r": Site.resid_post(adapter, 0)}, ids)
        assert not ran and relative(got["r"], want["resid"]) <= 1e-6
        with model.edit(inplace=True):
            lorsa.replace(layer=LAYER)
        try:
            got = read_sites(model, {"r": Site.resid_post(adapter, 0)}, ids)
        finally:
            model.clear_edits()
        assert ran and relative(got["r"], want["resid"]) <= 1e-6
    finally:
        hook.remove()


def test_each_named_site_reads_the_value_its_name_says(llama):
    """``Site.mlp_input / mlp_output / attn_input / attn_output / resid_post / attn_positions`` against forward hooks
    on the Hugging Face modules they name (the MLP, the attention, the decoder layer), all read in one trace."""
    from nnsight_lorsa.envoy.read import Site, read_sites

    model, hf, _ = llama
    adapter = get_adapter(model)
    block = hf.model.layers[LAYER]
    mods = {"mlp": block.mlp, "attn": adapter.attention_module(hf, LAYER), "block": block}
    want: dict = {}
    hooks = []
    for name, mod in mods.items():
        hooks.append(mod.register_forward_pre_hook(
            lambda m, a, k, name=name: want.__setitem__(f"{name}_in", (a[0] if a else k["hidden_states"]).clone()),
            with_kwargs=True))
        hooks.append(mod.register_forward_hook(
            lambda m, a, o, name=name: want.__setitem__(f"{name}_out", (o[0] if isinstance(o, tuple) else o).clone())))
    ids = random_ids(2, 6, seed=7)
    try:
        with torch.no_grad():
            hf(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    sites = {"mlp_in": Site.mlp_input(adapter, LAYER), "mlp_out": Site.mlp_output(adapter, LAYER),
             "attn_in": Site.attn_input(adapter, LAYER), "attn_out": Site.attn_output(adapter, LAYER),
             "block_out": Site.resid_post(adapter, LAYER), "positions": Site.attn_positions(adapter, LAYER)}
    got = read_sites(model, sites, ids)
    for name in ("mlp_in", "mlp_out", "attn_in", "attn_out", "block_out"):
        assert relative(got[name], want[name]) <= 1e-6, name
    assert torch.equal(got["positions"].reshape(-1, 6)[0], torch.arange(6))


# -------------------------------------------------------------------------------------------------------- padding.py
def test_padding_mask_is_none_for_a_4d_mask(llama):
    """``padding_mask``: a 4-D ``attention_mask`` (the model's own shape, passed by hand) says nothing about which
    positions are tokens — None, as documented — while the 2-D mask of the same padding gives the rows' tokens."""
    from nnsight_lorsa.patching import padding_mask

    model, hf, _ = llama
    ids = random_ids(2, 5, seed=8)
    mask2d = torch.ones_like(ids)
    mask2d[0, :2] = 0
    causal = torch.ones(5, 5).tril().bool()
    allowed = causal[None, None] & mask2d.bool()[:, None, None, :]
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad(), model.trace(ids, attention_mask=additive):
        four = nnsight.save([padding_mask(model)])
    assert four == [None]
    with torch.no_grad(), model.trace(ids, attention_mask=mask2d):
        two = nnsight.save(padding_mask(model))
    assert torch.equal(two, mask2d.bool())



@pytest.mark.parametrize("clean_padded", [True, False])
def test_a_padded_batch_against_an_unpadded_one_is_padded_differently(clean_padded):
    """``check_same_padding``: None means no row padded, i.e. all ones (``padding_mask``'s documented None); so one
    side padded and the other None is refused whichever side it is, while an all-ones mask equals None."""
    from nnsight_lorsa.envoy.padding import check_same_padding
    from nnsight_lorsa.errors import ArgumentError

    padded = torch.ones(2, 5, dtype=torch.bool)
    padded[1, :2] = False
    clean, corrupt = (padded, None) if clean_padded else (None, padded)
    with pytest.raises(ArgumentError, match=r"padded differently \(rows \[1\]\)"):
        check_same_padding(clean, corrupt, "patching")
    check_same_padding(None, None, "patching")
    check_same_padding(torch.ones(2, 5, dtype=torch.bool), None, "patching")
    check_same_padding(None, torch.ones(2, 5, dtype=torch.bool), "patching")
    check_same_padding(padded, padded.clone(), "patching")


# -------------------------------------------------------------------------------------------------------- targets.py
@pytest.mark.parametrize("head", [True, False, -1, 4])
def test_a_head_index_that_is_no_int_in_range_is_refused(llama, head):
    """``MHSAHead(layer, True)`` is no head (a bool is an ``int`` to Python, not an index to a user): refused with
    ``TargetIndexError`` like an index out of ``[0, n_heads)``, before any model runs; the heads in range bind."""
    from nnsight_lorsa import ReplacementModel
    from nnsight_lorsa.envoy.targets import MHSAHead, TargetIndexError

    model, hf, _ = llama
    r = ReplacementModel(model)
    n = hf.config.num_attention_heads
    assert n == 4
    with pytest.raises(TargetIndexError, match="out of range|must be an int"):  # (a bool: "must be an int" since
        r(MHSAHead(LAYER, head))                                              # 2026-11-30)
    assert [r(MHSAHead(LAYER, h)).target.head for h in range(n)] == list(range(n))


def test_a_target_index_out_of_range_is_an_index_error_like_a_layer_out_of_range(llama):
    """``TargetIndexError`` is an ``IndexError`` (Python's convention for an index outside its range, as
    ``LayerOutOfRangeError`` is): code that catches ``IndexError`` around a bad head catches it."""
    from nnsight_lorsa import ReplacementModel
    from nnsight_lorsa.envoy.targets import MHSAHead

    model, _, _ = llama
    r = ReplacementModel(model)
    for bad in (MHSAHead(LAYER, 4), MHSAHead(99, 0)):
        with pytest.raises(IndexError, match="out of range"):
            r(bad)


# ---------------------------------------------------------------------------------------------- nnsight_internals.py
def test_a_site_with_a_real_child_of_the_splices_name_is_refused_not_shadowed():
    """``attach``: the attention module has a child of its own named ``lorsa`` (the name the splice mounts under);
    ``replace`` refuses it (``TraceOrderError``) instead of hiding that child behind the Lorsa's envoy."""
    from nnsight_lorsa.errors import TraceOrderError

    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsa = LorsaSet(model, {LAYER: make_lorsa(hf, adapter, LAYER)})
    adapter.attention_module(hf, LAYER).add_module("lorsa", torch.nn.Identity())
    with pytest.raises(TraceOrderError, match="already has a child module named 'lorsa'"), model.trace(
            random_ids(1, 5)):
        lorsa.replace(layer=LAYER)
