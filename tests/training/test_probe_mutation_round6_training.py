"""Mutation probe, round 6 (training): tests for mutants of the activation cache's fingerprints and version checks,
``evaluate``'s batching and the CLT's dead fraction that the area's tests let pass (docs/reliability.md, "Mutation
probe, round 6: training"). Each was seen failing with its mutant and passing on the clean tree."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import random_ids, tiny_training_setup
from safetensors.torch import load_file, save_file

from nnsight_lorsa import CLTSet, CrossLayerTranscoder, TranscoderSet
from nnsight_lorsa.envoy.read import Site
from nnsight_lorsa.errors import ActivationCacheError
from nnsight_lorsa.modules.clt import CLTConfig
from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig
from nnsight_lorsa.training import TokenDataset, evaluate
from nnsight_lorsa.training.activation_cache import ActivationCache, write_activation_cache

S0 = "shard_00000.safetensors"


@pytest.fixture(scope="module")
def setup():
    return tiny_training_setup()


@pytest.fixture(scope="module")
def cache_dir(setup, tmp_path_factory) -> Path:
    """A cache of the setup's first 12 windows (one site, shards of 8 and 4)."""
    model, hf, adapter, data = setup
    d = tmp_path_factory.mktemp("cache") / "c"
    write_activation_cache(model, [Site.mlp_output(adapter, 0)], TokenDataset(data.tokens[:12]), d, batch_size=4,
                           windows_per_shard=8)
    return d


def _copy_without_hashes(src: Path, dst: Path, edit=None) -> Path:
    """A copy of the cache without ``checksums.json`` and the manifest's per-shard ``sha256`` (as written before
    they existed), the manifest passed through ``edit``."""
    shutil.copytree(src, dst)
    (dst / "checksums.json").unlink()
    m = json.loads((dst / "manifest.json").read_text())
    for s in m["shards"]:
        s.pop("sha256")
    if edit is not None:
        edit(m)
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


# ------------------------------------------------------------------ the model's fingerprint
def test_a_checkpoint_differing_past_each_parameters_first_value_is_refused(setup, cache_dir):
    """Every parameter changed except its first value (a retrained checkpoint that happens to share it): the strided
    sample of the weights tells it apart (mutant: one value per parameter hashed)."""
    model, hf, adapter, data = setup
    cache = ActivationCache(cache_dir)
    saved = {n: p.detach().clone() for n, p in hf.named_parameters()}
    try:
        with torch.no_grad():
            for p in hf.parameters():
                p.view(-1)[1:] += 0.01
        with pytest.raises(ActivationCacheError, match="weights differ"):
            cache.check_model(model)
    finally:
        with torch.no_grad():
            for n, p in hf.named_parameters():
                p.copy_(saved[n])
    cache.check_model(model)


def test_a_cache_with_the_legacy_config_hash_is_accepted(setup, cache_dir, tmp_path):
    """A cache written by 0.x recorded the SHA-256 of the config's full JSON (``_name_or_path`` included): it is
    checked against the same model, not refused (mutant: the legacy hash not accepted); a legacy hash of another
    config is refused."""
    model, hf, adapter, data = setup
    legacy = hashlib.sha256(hf.config.to_json_string(use_diff=False).encode()).hexdigest()
    d = _copy_without_hashes(cache_dir, tmp_path / "legacy", lambda m: m["model"].update(config_hash=legacy))
    ActivationCache(d, model=model)
    other = hashlib.sha256((hf.config.to_json_string(use_diff=False) + " ").encode()).hexdigest()
    d2 = _copy_without_hashes(cache_dir, tmp_path / "other", lambda m: m["model"].update(config_hash=other))
    with pytest.raises(ActivationCacheError, match="configs differ"):
        ActivationCache(d2, model=model)


@pytest.mark.parametrize("how", ["empty", "absent"])
def test_a_cache_written_before_weights_were_hashed_is_checked_by_its_config(setup, cache_dir, tmp_path, how):
    """No ``weights_hash`` in the manifest (written before weights were hashed): the model is checked by its config
    alone, as documented (mutant: such a cache refused for every model)."""
    model, hf, adapter, data = setup

    def edit(m: dict) -> None:
        if how == "empty":
            m["model"]["weights_hash"] = ""
        else:
            m["model"].pop("weights_hash")

    d = _copy_without_hashes(cache_dir, tmp_path / how, edit)
    ActivationCache(d, model=model)


def test_check_dataset_refuses_other_windows_of_the_same_shape(setup, cache_dir):
    """``check_dataset``: the cache's own windows pass; other windows of the same shape, or one token changed, are
    refused (mutant: only the shape compared)."""
    model, hf, adapter, data = setup
    cache = ActivationCache(cache_dir)
    cache.check_dataset(TokenDataset(data.tokens[:12]))
    with pytest.raises(ActivationCacheError, match="different token dataset"):
        cache.check_dataset(TokenDataset(data.tokens[12:24]))
    edited = data.tokens[:12].clone()
    edited[11, 15] = (edited[11, 15] + 1) % 100
    with pytest.raises(ActivationCacheError, match="different token dataset"):
        cache.check_dataset(TokenDataset(edited))


# ------------------------------------------------------------------ the shards' contents
@pytest.mark.parametrize("window", [0, 62, 63, 64])
def test_a_nan_in_any_window_of_a_long_shard_is_refused(setup, tmp_path, window):
    """One shard of 65 windows (the finiteness scan reads 64 at a time) with one NaN in window ``window``: refused
    when verified, naming the windows read (mutant: the last window of each 64 not scanned)."""
    model, hf, adapter, data = setup
    ds = TokenDataset(random_ids(batch=65, seq=4, seed=5))
    site = Site.mlp_output(adapter, 0)
    cache = write_activation_cache(model, [site], ds, tmp_path / "src", batch_size=65, windows_per_shard=256)
    name = next(iter(cache.sites))
    d = _copy_without_hashes(cache.directory, tmp_path / "c")
    tensors = load_file(d / S0)
    tensors[name][window, 2, 3] = float("nan")
    save_file(tensors, d / S0)
    lo = 0 if window < 64 else 64
    with pytest.raises(ActivationCacheError, match=rf"has 1 non-finite values \(NaN/inf\) in windows {lo}\.\."):
        ActivationCache(d).verify()


def test_a_version_2_shard_without_its_target_mask_is_refused_at_open(cache_dir, tmp_path):
    """A version 2 cache records every window's ``target_mask``: a shard without it is refused when the cache is
    opened, naming the shard and the tensor (mutant: the tensor only required above version 2)."""
    d = _copy_without_hashes(cache_dir, tmp_path / "c")
    tensors = load_file(d / S0)
    tensors.pop("target_mask")
    save_file(tensors, d / S0)
    with pytest.raises(ActivationCacheError, match=rf"{S0}: missing tensor 'target_mask'"):
        ActivationCache(d)


def test_a_shard_starting_at_the_wrong_window_is_refused_at_open(cache_dir, tmp_path):
    """Shards of 8 and 4 windows: a manifest saying the second starts at window 9 (no checksums to catch the edit) is
    refused when opened, naming the shard (mutant: starts not checked; window 8 then read from no shard)."""
    d = _copy_without_hashes(cache_dir, tmp_path / "c", lambda m: m["shards"][1].update(start=9))
    with pytest.raises(ActivationCacheError, match=r"shard_00001\.safetensors: starts at window 9, expected 8"):
        ActivationCache(d)


def test_a_stored_target_mask_that_does_not_give_the_loss_mask_is_refused(setup, tmp_path):
    """A version 2 shard whose ``target_mask`` was altered (one kept position dropped) no longer gives its
    ``loss_mask``: ``dataset()`` refuses it rather than hand back the altered mask (mutant: not compared)."""
    model, hf, adapter, data = setup
    ds = TokenDataset(data.tokens[:4], torch.ones(4, data.seq_len, dtype=torch.bool))
    cache = write_activation_cache(model, [Site.mlp_output(adapter, 0)], ds, tmp_path / "src")
    d = _copy_without_hashes(cache.directory, tmp_path / "c")
    tensors = load_file(d / S0)
    tensors["target_mask"][2, 5] = False
    save_file(tensors, d / S0)
    with pytest.raises(ActivationCacheError, match="target_mask does not give their loss_mask"):
        ActivationCache(d).dataset()


def _as_version_1(d: Path) -> None:
    """Rewrite a cache as version 1 wrote it: no ``target_mask`` tensors, no ``has_target_mask``, no hashes."""
    m = json.loads((d / "manifest.json").read_text())
    for s in m["shards"]:
        tensors = load_file(d / s["file"])
        tensors.pop("target_mask")
        save_file(tensors, d / s["file"])
        s.pop("sha256")
    m["version"] = 1
    m.pop("has_target_mask")
    (d / "manifest.json").write_text(json.dumps(m))
    (d / "checksums.json").unlink()


@pytest.mark.parametrize("dropped", [[(1, 1)], [(0, 5)], [(4, 1)], [(1, 15), (3, 2)]])
def test_a_version_1_cache_refuses_any_masked_position_naming_its_windows(setup, tmp_path, dropped):
    """A version 1 cache of 5 windows whose mask dropped one position past BOS (``(window, position)``): its mask
    cannot be recovered, so ``dataset()`` refuses it, naming exactly the windows (mutants: position 1 not looked at;
    the last window only; the error naming columns)."""
    model, hf, adapter, data = setup
    mask = torch.ones(5, data.seq_len, dtype=torch.bool)
    for w, p in dropped:
        mask[w, p] = False
    cache = write_activation_cache(model, [Site.mlp_output(adapter, 0)], TokenDataset(data.tokens[:5], mask),
                                   tmp_path / "c", windows_per_shard=2)
    _as_version_1(cache.directory)
    windows = sorted({w for w, _ in dropped})
    with pytest.raises(ActivationCacheError, match=rf"version 1 .* windows \[{', '.join(map(str, windows))}\]:"):
        ActivationCache(cache.directory).dataset()


# ------------------------------------------------------------------ evaluate
def _transcoder(d_model: int) -> Transcoder:
    torch.manual_seed(0)
    tc = Transcoder(TranscoderConfig(d_in=d_model, d_sae=32)).eval()
    with torch.no_grad():
        tc.b_enc.normal_(0, 0.3)
    return tc


def test_max_batches_evaluates_the_first_batches_only(setup):
    """``evaluate(..., max_batches=k)`` evaluates the first ``k`` batches of ``batch_size`` windows: the counted
    predictions are theirs (``k · batch_size · (seq − 1)``, the last partial batch's when ``k`` covers it) and every
    number that of those windows alone (mutants: ``max`` for ``min``, one batch too many)."""
    model, hf, adapter, data = setup
    rs = TranscoderSet(model, {1: _transcoder(adapter.d_model)})
    got = evaluate(rs, TokenDataset(data.tokens[:5]), at=1, batch_size=2, max_batches=1)
    assert got.n_tokens == 2 * (data.seq_len - 1)
    want = evaluate(rs, TokenDataset(data.tokens[:2]), at=1, batch_size=2)
    for key in ("fvu", "l0", "ce_orig", "ce_spliced", "ce_zero", "kl", "l2_ratio"):
        assert getattr(got, key) == pytest.approx(getattr(want, key), rel=1e-6), key
    assert evaluate(rs, TokenDataset(data.tokens[:3]), at=1, batch_size=2, max_batches=5).n_tokens == 3 * (
        data.seq_len - 1)


def test_a_clts_dead_fraction_is_per_layer(setup):
    """A ReLU CLT whose features are constant (``W_enc = 0``): per layer, the features with ``b_enc < 0`` never
    fire and the others always do, so ``dead_frac[l]`` is layer ``l``'s share of negative biases, one value per layer
    (mutant: the mean taken over the layers, one value per feature)."""
    model, hf, adapter, data = setup
    n_layers, d_sae = adapter.n_layers, 16
    clt = CrossLayerTranscoder(CLTConfig(d_in=adapter.d_model, d_sae=d_sae, n_layers=n_layers)).eval()
    dead = [2, 9, 16][:n_layers]
    with torch.no_grad():
        clt.W_enc.zero_()
        for layer, k in enumerate(dead):
            clt.b_enc[layer] = torch.where(torch.arange(d_sae) < k, -1.0, 1.0)
    ev = evaluate(CLTSet(model, clt), TokenDataset(data.tokens[:4]), batch_size=4)
    assert ev.dead_frac == pytest.approx([k / d_sae for k in dead])
    assert ev.l0 == pytest.approx([d_sae - k for k in dead])
