"""On-disk activation cache: one pass, several sites; the cached stream equals the live one; clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import tiny_nnsight, tiny_training_setup
from hypothesis import given
from hypothesis import strategies as st

from nnsight_lorsa.envoy.read import Site
from nnsight_lorsa.errors import ActivationCacheError, CheckpointError
from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig
from nnsight_lorsa.training import ActivationSource, TrainConfig, Trainer
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
