"""Mutation probe, round 7 (envoy sets and splices): tests for the mutants that survived the area's tests
(docs/reliability.md, "Mutation probe, round 7: envoy sets and splices"). Each compares against an independent
reference: the documented check, plain PyTorch forward hooks on the Hugging Face model, or the config file."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import (
    N_HEADS,
    VOCAB,
    D,
    head_logits,
    make_clt,
    make_sae,
    make_transcoder,
    random_ids,
    tiny_hf_model,
    tiny_llama_shared,
    tiny_nnsight,
)

from nnsight_lorsa import CLTSet, ReplacementModel, SAESet, TranscoderSet, get_adapter
from nnsight_lorsa._placement import offloaded
from nnsight_lorsa.envoy import Feature, MHSAHead
from nnsight_lorsa.envoy.targets import TargetIndexError
from nnsight_lorsa.envoy.tokens import ids_only_tokenizer, load_tokenizer
from nnsight_lorsa.errors import ConfigMismatchError


@pytest.fixture(scope="module")
def llama():
    return tiny_llama_shared()  # read only here: the one tiny Llama the process shares


@contextlib.contextmanager
def transcoder_hook(hf, adapter, layer: int, tc):
    """Plain PyTorch: MLP ``layer``'s output replaced by ``tc`` of the MLP's input."""
    handle = adapter.mlp_module(hf, layer).register_forward_hook(lambda m, args, out: tc(args[0]))
    try:
        yield
    finally:
        handle.remove()


# ------------------------------------------------------------------ SAESet / TranscoderSet checks
@pytest.mark.parametrize("width", [D // 2, 2 * D])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_an_sae_of_another_width_is_refused_at_every_site_of_known_width(family, width):
    """SAESet's documented check: a decoder layer, its attention or MLP and the embedding (GPT-2: ``wte`` and the
    residual's start ``drop``) have width d_model; an SAE of another d_in (narrower or wider) is refused when the set
    is built, not later in a trace."""
    model, _ = tiny_nnsight(family)
    adapter = get_adapter(model)
    sites = sorted({adapter.embed_path, adapter.residual_start_path, adapter.layer_path(1), adapter.attention_path(1),
                    adapter.mlp_path(1)})
    for site in sites:
        with pytest.raises(ConfigMismatchError, match=f"d_in={width}"):
            SAESet(model, {site: make_sae(d_in=width)})
    assert sorted(SAESet(model, {site: make_sae() for site in sites})) == sorted(sites)  # d_model fits each


def test_a_transcoder_trained_for_another_layer_is_refused(llama):
    model, _, _ = llama
    for trained in (0, 2):
        with pytest.raises(ConfigMismatchError, match=f"trained for layer {trained}, not layer 1"):
            TranscoderSet(model, {1: make_transcoder(layer=trained)})
    assert list(TranscoderSet(model, {1: make_transcoder(layer=1)})) == [1]


def test_each_transcoder_sits_at_its_own_layers_mlp(llama):
    """``site_path(L)`` is layer L's MLP (where the set places the module and where ``ReplacementModel.replace`` orders
    its splice), for every layer."""
    model, _, adapter = llama
    tcs = TranscoderSet(model, {layer: make_transcoder(seed=layer) for layer in range(adapter.n_layers)})
    assert [tcs.site_path(layer) for layer in tcs] == [f"model.layers.{layer}.mlp" for layer in range(adapter.n_layers)]


# ------------------------------------------------------------------ ReplacementModel
def test_targets_one_past_the_last_head_or_feature_are_refused(llama):
    """``rm(target)`` checks the index against ``[0, n)`` before anything runs: an MHSA head ``n_heads`` would be an
    empty column slice of the output projection's input (an ablation of nothing), a feature ``d_sae`` an index
    error deep in the trace."""
    model, _, adapter = llama
    site = adapter.layer_path(1)
    rm = ReplacementModel(model, saes={site: make_sae()}, transcoders={1: make_transcoder()})
    for target in (MHSAHead(1, N_HEADS), Feature(site, 128, "sae"), Feature(1, 128, "transcoder")):
        with pytest.raises(TargetIndexError, match="out of range"):
            rm(target)
    for target in (MHSAHead(1, N_HEADS - 1), Feature(site, 127, "sae"), Feature(1, 127, "transcoder")):
        assert rm(target).target == target


@torch.no_grad()
def test_replace_error_false_overrides_the_bundles_error_flag(llama):
    """``rm.replace(error=False)`` on a bundle built with ``error=True``: the transcoder's output alone reaches the
    model (plain-hook reference), not the model's own MLP output."""
    model, hf, adapter = llama
    tc = make_transcoder()
    rm = ReplacementModel(model, transcoders={1: tc})
    assert rm.error is True
    ids = random_ids()
    ref = head_logits(hf, ids)
    with transcoder_hook(hf, adapter, 1, tc):
        want = head_logits(hf, ids)
    assert (want - ref).abs().max() > 1e-2 * ref.abs().max()  # the replacement shows
    for error, expected in ((False, want), (True, ref), (None, ref)):
        with rm.trace(ids):
            rm.replace(error=error)
            logits = model.lm_head.output.save()
        assert (logits - expected).abs().max() <= 1e-5 * expected.abs().max(), error


def test_with_sets_keeps_the_error_flag(llama):
    model, _, _ = llama
    for error in (False, True):
        rm = ReplacementModel(model, transcoders={1: make_transcoder()}, error=error)
        derived = rm.with_sets(lambda s: s.subset([1]))
        assert derived.error is error and derived.adapter is rm.adapter and list(derived.transcoders) == [1]


def test_a_set_of_another_model_is_refused(llama):
    model, _, _ = llama
    other, _ = tiny_nnsight("llama", seed=1)
    for slot, held in (("transcoders", TranscoderSet(other, {1: make_transcoder()})),
                       ("saes", SAESet(other, {"model.layers.1": make_sae()})),
                       ("transcoders", CLTSet(other, make_clt()))):
        with pytest.raises(ConfigMismatchError, match="another model"):
            ReplacementModel(model, **{slot: held})


# ------------------------------------------------------------------ CLTSet
def test_a_clts_latents_are_every_layers_features(llama):
    model, _, _ = llama
    clt = make_clt(n_layers=2)
    assert CLTSet(model, clt).n_latents() == 2 * 48 == clt.W_enc.shape[0] * clt.W_enc.shape[-1]


def test_a_loaded_clt_takes_the_models_dtype_and_the_offload_flag(tmp_path):
    """``CLTSet.from_pretrained``: ``dtype`` defaults to the model's; ``offload=True`` keeps the CLT on the host."""
    model, _ = tiny_nnsight("llama", dtype=torch.bfloat16)
    CLTSet(tiny_nnsight("llama")[0], make_clt()).save(tmp_path)  # written in fp32
    loaded = CLTSet.from_pretrained(model, tmp_path)
    assert {p.dtype for p in loaded.clt.parameters()} == {torch.bfloat16} and not offloaded(loaded.clt)
    kept = CLTSet.from_pretrained(model, tmp_path, dtype=torch.float32, offload=True)
    assert {p.dtype for p in kept.clt.parameters()} == {torch.float32}
    assert offloaded(kept.clt) and kept.offload


# ------------------------------------------------------------------ tokens
def test_an_ids_only_tokenizer_knows_every_id_and_the_configs_special_tokens(tmp_path):
    """``load_tokenizer`` on a directory without tokenizer files: every id of the vocabulary has a token, the special
    ids are the config's (the first of a list: Llama-3 lists several eos ids), pad defaults to eos."""
    config = tiny_hf_model("llama").config
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 4, [5, 7], None
    config.save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (4, 5, 5)
    assert len(tok) == VOCAB
    assert tok.convert_ids_to_tokens(list(range(VOCAB))) == [f"<id_{i}>" for i in range(VOCAB)]
    assert tok.convert_tokens_to_ids([f"<id_{i}>" for i in range(VOCAB)]) == list(range(VOCAB))
    # an id outside the vocabulary names no special token
    odd = ids_only_tokenizer(VOCAB, bos_token_id=VOCAB, eos_token_id=-1)
    assert odd.bos_token is None and odd.eos_token is None and len(odd) == VOCAB


def test_a_saved_sae_set_reloads_each_sae_at_its_folders_site_not_its_files_record(llama, tmp_path):
    """``SAESet.save`` writes each SAE to a folder named by its site; ``from_pretrained`` reads that folder's name as
    the site (``key_of_folder``: the file's own record counts only when the name is no site), so an SAE placed at
    another site than the one its config records comes back where it was placed."""
    model, _, adapter = llama
    moved = make_sae(seed=1)
    moved.cfg.hook = adapter.layer_path(1)  # trained on layer 1's output, placed on layer 2's
    SAESet(model, {adapter.layer_path(2): moved, adapter.layer_path(0): make_sae(seed=2)}).save(tmp_path)
    back = SAESet.from_pretrained(model, tmp_path)
    assert sorted(back) == [adapter.layer_path(0), adapter.layer_path(2)]
    x = torch.randn(3, D)
    assert torch.equal(back[adapter.layer_path(2)](x), moved(x))


@torch.no_grad()
def test_an_sae_on_a_transcoders_mlp_reconstructs_the_transcoders_output(llama):
    """``rm.replace()`` splices in model order, a transcoder before an SAE at the same MLP (ties: lorsas, transcoders,
    saes), so the SAE reads and reconstructs the transcoder's output: plain-hook reference, the two hooks in that
    order. Spliced the other way round (and without error terms) the transcoder would discard the SAE's output."""
    model, hf, adapter = llama
    tc, sae = make_transcoder(), make_sae()
    mlp = adapter.mlp_module(hf, 1)
    seen: list = []

    def sae_hook(module, args, out):
        seen.append(sae.encode(out))
        return sae(out)

    ids = random_ids()
    handles = [mlp.register_forward_hook(lambda m, args, out: tc(args[0])), mlp.register_forward_hook(sae_hook)]
    try:
        want = head_logits(hf, ids)
    finally:
        for h in handles:
            h.remove()
    rm = ReplacementModel(model, transcoders={1: tc}, saes={adapter.mlp_path(1): sae}, error=False)
    with rm.trace(ids):
        sites = rm.replace()
        acts = sites["saes"][adapter.mlp_path(1)].hook_sae_acts_post.output.save()
        logits = model.lm_head.output.save()
    assert (acts - seen[0]).abs().max() <= 1e-5 * seen[0].abs().max()
    assert (logits - want).abs().max() <= 1e-5 * want.abs().max()


def test_targets_sort_in_the_order_the_model_computes_them(llama):
    """At one MLP the transcoder's features come before those of an SAE on that MLP's output (it reads the transcoder's
    output), which come before an SAE on the layer's output."""
    model, _, adapter = llama
    mlp, layer = adapter.mlp_path(1), adapter.layer_path(1)
    rm = ReplacementModel(model, transcoders={1: make_transcoder()}, saes={mlp: make_sae(), layer: make_sae(seed=1)})
    order = [Feature(1, 0, "transcoder"), Feature(mlp, 0, "sae"), Feature(layer, 0, "sae")]
    assert rm.sort(reversed(order)) == order


def test_a_directory_without_tokenizer_files_or_a_config_is_a_named_error(tmp_path):
    """No tokenizer files and no ``config.json`` (or no directory at all) was transformers' ``OSError`` about reaching
    huggingface.co, though the load is offline (2026-11-29, fourth session): now a ``CheckpointError`` naming the
    directory."""
    from nnsight_lorsa.errors import CheckpointError

    for d in (tmp_path, tmp_path / "missing"):
        with pytest.raises(CheckpointError, match=rf"load_tokenizer\('{d}'\): none of the tokenizer files"):
            load_tokenizer(d)
