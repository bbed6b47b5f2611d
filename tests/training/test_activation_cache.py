"""On-disk activation cache: one pass, several sites; the cached stream equals the live one; clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import tiny_nnsight, tiny_training_setup
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnsight_lorsa.envoy.read import Site
from nnsight_lorsa.errors import ActivationCacheError, CheckpointError
from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig
from nnsight_lorsa.training import ActivationSource, TokenDataset, TrainConfig, Trainer
from nnsight_lorsa.training.activation_cache import ActivationCache, site_name, write_activation_cache


@pytest.fixture(scope="module")
def setup():
    return tiny_training_setup()


@pytest.fixture(scope="module")
def cached(setup, tmp_path_factory):
    model, hf, adapter, data = setup
    # listed out of execution order on purpose; 48 windows in shards of 24 (written 10 at a time)
    sites = [Site.resid_post(adapter, 1), Site.mlp_output(adapter, 1), Site.mlp_input(adapter, 1),
             Site.mlp_output(adapter, 0)]
    d = tmp_path_factory.mktemp("cache")
    cache = write_activation_cache(model, sites, data, d, batch_size=10, windows_per_shard=20)
    return cache, sites


def test_manifest_and_files(setup, cached):
    model, hf, adapter, data = setup
    cache, sites = cached
    m = json.loads((cache.directory / "manifest.json").read_text())
    assert m["n_windows"] == len(data) == 48 and m["seq_len"] == 16 and m["n_tokens"] == 48 * 16
    assert m["n_loss_tokens"] == 48 * 15 and m["dtype"] == "float32"
    assert [s["n_windows"] for s in m["shards"]] == [20, 20, 8]
    assert set(m["sites"]) == {site_name(s) for s in sites}
    assert all(v["d"] == adapter.d_model for v in m["sites"].values())
    assert m["model"]["config_hash"] and len(m["dataset_hash"]) == 64
    # JSON + safetensors only: nothing pickled
    assert {p.suffix for p in cache.directory.iterdir()} == {".json", ".safetensors"}
    assert torch.equal(cache.dataset().tokens, data.tokens)
    cache.check_dataset(data)
    cache.check_model(model)


@pytest.mark.parametrize("kind", ["transcoder", "sae"])
def test_cached_stream_equals_live_stream(setup, cached, kind):
    model, hf, adapter, data = setup
    cache, _ = cached
    if kind == "transcoder":
        live = ActivationSource.transcoder(model, 1, data, batch_size=8, seed=5)
        stream = ActivationSource.transcoder(cache, 1, batch_size=8, seed=5, adapter=adapter)
    else:
        live = ActivationSource.sae(model, Site.resid_post(adapter, 1), data, batch_size=8, seed=5)
        stream = ActivationSource.sae(cache, Site.resid_post(adapter, 1), batch_size=8, seed=5)
    for i in (0, 1, 5, 6, 13):  # 6 batches per epoch: crosses epochs (new permutations)
        a, b = live(i), stream(i)
        assert torch.equal(a.loss_mask, b.loss_mask)
        assert a.x.shape == b.x.shape and a.y.shape == b.y.shape
        assert torch.allclose(a.x, b.x, atol=1e-6, rtol=0) and torch.allclose(a.y, b.y, atol=1e-6, rtol=0)
        if kind == "sae":
            assert b.y is b.x
    assert not torch.equal(stream(0).x, ActivationSource.sae(cache, Site.resid_post(adapter, 1), batch_size=8,
                                                             seed=6)(0).x)  # the seed matters


def test_cached_shards_partition_each_batch(setup, cached):
    model, hf, adapter, data = setup
    cache, _ = cached
    stream = ActivationSource.transcoder(cache, 1, batch_size=8, seed=1, adapter=adapter)
    parts = [stream.shard(r, 3)(4) for r in range(3)]
    whole = stream(4)
    assert [p.x.shape[0] for p in parts] == [3, 3, 2]
    for field in ("x", "y", "loss_mask"):
        assert torch.equal(torch.cat([getattr(p, field) for p in parts]), getattr(whole, field))


def test_training_from_the_cache_equals_training_live(setup, cached):
    model, hf, adapter, data = setup
    cache, _ = cached

    def run(source):
        torch.manual_seed(0)
        tc = Transcoder(TranscoderConfig(d_in=adapter.d_model, d_sae=128, activation="topk",
                                         activation_params={"k": 4}))
        trainer = Trainer(tc, source, TrainConfig(total_steps=5, lr=1e-2, norm_batches=2))
        trainer.train(progress=False)
        return trainer

    live = run(ActivationSource.transcoder(model, 1, data, batch_size=8))
    from_cache = run(ActivationSource.transcoder(cache, 1, batch_size=8, adapter=adapter))
    assert live.s_in == pytest.approx(from_cache.s_in, rel=1e-6)
    for (name, a), b in zip(live.module.state_dict().items(), from_cache.module.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), name


def test_mismatches_raise_clear_errors(setup, cached, tmp_path):
    model, hf, adapter, data = setup
    cache, _ = cached
    d = cache.directory
    assert issubclass(ActivationCacheError, CheckpointError)
    with pytest.raises(ActivationCacheError, match="is not cached"):
        ActivationCache(d, sites=[Site.mlp_input(adapter, 2)])
    with pytest.raises(ActivationCacheError, match="is not cached"):
        ActivationSource.sae(cache, Site("model.layers.0.mlp", "input"))
    name = site_name(Site.mlp_input(adapter, 1))
    with pytest.raises(ActivationCacheError, match=f"{name}.*d={adapter.d_model}, expected d=32"):
        ActivationCache(d, d={name: 32})
    other, _ = tiny_nnsight("qwen2")
    with pytest.raises(ActivationCacheError, match="written from model"):
        ActivationCache(d, model=other)
    with pytest.raises(ActivationCacheError, match="already written"):
        write_activation_cache(model, [Site.mlp_input(adapter, 1)], data, d)
    with pytest.raises(ActivationCacheError, match="not a module"):
        write_activation_cache(model, [Site("model.layers.9.mlp", "input")], data, tmp_path / "bad")
    # a manifest that disagrees with its shards names the file and the key
    broken = tmp_path / "broken"
    shutil.copytree(d, broken)
    m = json.loads((broken / "manifest.json").read_text())
    m["sites"][name]["d"] = 32
    (broken / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ActivationCacheError, match=rf"shard_00000\.safetensors: tensor '{name}' has shape"):
        ActivationCache(broken)
    (broken / "shard_00001.safetensors").unlink()
    m["sites"][name]["d"] = adapter.d_model
    (broken / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ActivationCacheError, match="shard_00001.safetensors: shard listed in the manifest is missing"):
        ActivationCache(broken)
    with pytest.raises(ActivationCacheError, match="no activation-cache manifest"):
        ActivationCache(tmp_path)


def test_cache_refuses_a_model_with_other_weights_and_accepts_a_moved_one(setup, cached):
    model, hf, adapter, data = setup
    cache, _ = cached
    w = hf.model.layers[0].self_attn.q_proj.weight
    saved = w.detach().clone()
    try:
        with torch.no_grad():
            w.add_(0.01 * torch.randn_like(w))  # same config, other weights (a retrained checkpoint)
        with pytest.raises(ActivationCacheError, match="weights differ"):
            cache.check_model(model)
    finally:
        with torch.no_grad():
            w.copy_(saved)
    old = hf.config._name_or_path
    try:
        hf.config._name_or_path = "/elsewhere/same-model"  # the same model loaded from another folder
        cache.check_model(model)
    finally:
        hf.config._name_or_path = old


@given(kind=st.text(max_size=12), path=st.sampled_from(["model.layers.0.mlp", "model.layers.1", ""]))
def test_a_site_of_another_kind_is_an_argument_error(kind, path):
    """``Site(path, kind)``: a kind other than input / output / positions is refused with the package's
    ``ArgumentError`` (a ``ValueError`` too) naming the site and the field; the three kinds are accepted. (Non-string
    fields are refused by the suite's type-hint checker before the constructor runs; without it, by the same check.)"""
    from nnsight_lorsa.errors import ArgumentError

    if kind in ("input", "output", "positions"):
        assert Site(path, kind).kind == kind
        return
    with pytest.raises(ArgumentError, match=r"Site\(.*\)\.kind must be one of") as info:
        Site(path, kind)
    assert isinstance(info.value, ValueError)


def _drawn_mask(kind: str, n: int, seq: int, seed: int) -> torch.Tensor | None:
    """None, right padding (each window's first 1 … seq positions), or a task mask of drawn positions."""
    g = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    if kind == "right":
        return torch.arange(seq)[None, :] < torch.randint(1, seq + 1, (n, 1), generator=g)
    return torch.rand(n, seq, generator=g) < 0.5


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["none", "right", "task"]), st.integers(1, 9), st.integers(1, 4), st.integers(0, 1000))
def test_the_cache_gives_back_its_dataset_ids_and_mask(setup, tmp_path_factory, kind, n, per_shard, seed):
    """``ActivationCache.dataset()`` round-trips the windows *and* their ``target_mask`` (None stays None).
    Before: the ids only — a padded dataset came back with every pad counted (the shards keep ``loss_mask``, whose
    column 0 is always False, so the mask could not be recovered)."""
    model, hf, adapter, data = setup
    ds = TokenDataset(data.tokens[:n], _drawn_mask(kind, n, data.seq_len, seed))
    cache = write_activation_cache(model, [Site.mlp_input(adapter, 0)], ds, tmp_path_factory.mktemp("rt"),
                                   batch_size=3, windows_per_shard=per_shard)
    back = ActivationCache(cache.directory).dataset()
    assert torch.equal(back.tokens, ds.tokens)
    assert (back.target_mask is None) == (ds.target_mask is None)
    if ds.target_mask is not None:
        assert torch.equal(back.target_mask, ds.target_mask)
    # a part of a dataset (split) is not checked again on its own: nor is its cache's
    train, held = TokenDataset(data.tokens[:6], _drawn_mask("right", 6, data.seq_len, seed)).split(0.5)
    again = write_activation_cache(model, [Site.mlp_input(adapter, 0)], held, tmp_path_factory.mktemp("part"))
    assert torch.equal(again.dataset().target_mask, held.target_mask)


def _as_version_1(d) -> None:
    """Rewrite a cache as version 1 wrote it: no ``target_mask`` tensors, version 1, no ``has_target_mask``, no
    per-shard sha256 or checksums.json (the file hashes would name the rewritten shards)."""
    from safetensors.torch import load_file, save_file

    m = json.loads((d / "manifest.json").read_text())
    for s in m["shards"]:
        tensors = load_file(d / s["file"])
        tensors.pop("target_mask", None)
        save_file(tensors, d / s["file"])
        s.pop("sha256")
    m["version"] = 1
    m.pop("has_target_mask", None)
    (d / "manifest.json").write_text(json.dumps(m))
    (d / "checksums.json").unlink()


@pytest.mark.parametrize("kind", ["none", "right", "task"])
def test_a_version_1_cache_loads_and_its_dataset_is_never_silently_unmasked(setup, tmp_path, kind):
    """A cache written before the mask was stored: everything loads as before; ``dataset()`` gives the ids
    without a mask where nothing was masked (its ``loss_mask`` all True past BOS: exact), and an
    ``ActivationCacheError`` saying so where something was (the mask's column 0 is not in the cache)."""
    model, hf, adapter, data = setup
    ds = TokenDataset(data.tokens[:5], _drawn_mask(kind, 5, data.seq_len, 3))
    cache = write_activation_cache(model, [Site.mlp_input(adapter, 0)], ds, tmp_path / "c", windows_per_shard=2)
    loss = cache.windows("loss_mask", torch.arange(5))
    _as_version_1(cache.directory)
    old = ActivationCache(cache.directory)
    assert old.manifest["version"] == 1
    assert torch.equal(old.windows("loss_mask", torch.arange(5)), loss)
    if ds.target_mask is None or bool(ds.target_mask[:, 1:].all()):  # nothing masked past BOS: exact
        back = old.dataset()
        assert torch.equal(back.tokens, ds.tokens) and back.target_mask is None
    else:
        with pytest.raises(ActivationCacheError, match="version 1.*target_mask"):
            old.dataset()
