"""Issue 23, class 3: an activation cache does not trust its shards. Swapped shards, a shard copied from another
cache, edited values, a NaN, and shard paths with ``..`` or an absolute path are each refused with
:class:`ActivationCacheError` naming the file — with or without ``checksums.json`` (per-shard hashes in the
cache's own manifest, the windows against the manifest's dataset hash and order, finiteness, contained paths).
Explicit cases of the probe, and generated tampering (hypothesis)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import random_ids, tiny_nnsight, tiny_training_setup
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from nnsight_lorsa.envoy.read import Site
from nnsight_lorsa.errors import ActivationCacheError
from nnsight_lorsa.training import TokenDataset
from nnsight_lorsa.training.activation_cache import ActivationCache, site_name, write_activation_cache

S0, S1, S2 = "shard_00000.safetensors", "shard_00001.safetensors", "shard_00002.safetensors"


@pytest.fixture(scope="module")
def setup():
    return tiny_training_setup()


@pytest.fixture(scope="module")
def caches(setup, tmp_path_factory):
    """The cache (48 windows, shards of 20/20/8), one of other windows, one of the same windows from another model."""
    model, hf, adapter, data = setup
    sites = [Site.resid_post(adapter, 1), Site.mlp_output(adapter, 0)]
    root = tmp_path_factory.mktemp("caches")
    main = write_activation_cache(model, sites, data, root / "main", batch_size=10, windows_per_shard=20)
    other_data = TokenDataset(random_ids(batch=48, seq=16, seed=11))
    other = write_activation_cache(model, sites, other_data, root / "other", batch_size=10, windows_per_shard=20)
    other_model, _ = tiny_nnsight("llama", seed=7)
    same_windows = write_activation_cache(other_model, sites, data, root / "same_windows", batch_size=10,
                                          windows_per_shard=20)
    return main.directory, other.directory, same_windows.directory, site_name(sites[0])


def _copy(src: Path, dst: Path, *, checksums: bool = True, shard_hashes: bool = True) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    if not checksums:
        (dst / "checksums.json").unlink()
    if not shard_hashes:  # a cache as written before the per-shard hashes
        m = json.loads((dst / "manifest.json").read_text())
        for s in m["shards"]:
            s.pop("sha256"), s.pop("tokens_sha256")
        (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def _edit_manifest(d: Path, edit) -> None:
    m = json.loads((d / "manifest.json").read_text())
    edit(m)
    (d / "manifest.json").write_text(json.dumps(m))


def _read_all(d: Path) -> None:
    cache = ActivationCache(d)
    for key in [*cache.sites, "input_ids", "loss_mask"]:
        cache.windows(key, torch.arange(cache.n_windows))


def _edit_shard(d: Path, file: str, edit) -> None:
    tensors = load_file(d / file)
    edit(tensors)
    save_file(tensors, d / file)


def test_new_caches_record_per_shard_hashes(caches):
    m = json.loads((caches[0] / "manifest.json").read_text())
    assert all(len(s["sha256"]) == 64 and len(s["tokens_sha256"]) == 64 for s in m["shards"])


@pytest.mark.parametrize("checksums", [True, False])
def test_swapped_shards_are_refused_at_open(caches, tmp_path, checksums):
    d = _copy(caches[0], tmp_path / "c", checksums=checksums)
    (d / S0).rename(d / "tmp")
    (d / S1).rename(d / S0)
    (d / "tmp").rename(d / S1)
    with pytest.raises(ActivationCacheError, match=rf"{S0}: its windows are not the ones the manifest lists"):
        ActivationCache(d)


def test_swapped_shards_of_an_old_cache_fail_the_dataset_hash(caches, tmp_path):
    d = _copy(caches[0], tmp_path / "c", checksums=False, shard_hashes=False)
    (d / S0).rename(d / "tmp")
    (d / S1).rename(d / S0)
    (d / "tmp").rename(d / S1)
    with pytest.raises(ActivationCacheError, match=r"manifest\.json: the shards' windows, in manifest order"):
        ActivationCache(d)


@pytest.mark.parametrize("checksums", [True, False])
def test_a_shard_of_other_windows_is_refused_at_open(caches, tmp_path, checksums):
    d = _copy(caches[0], tmp_path / "c", checksums=checksums)
    shutil.copy(caches[1] / S1, d / S1)
    with pytest.raises(ActivationCacheError, match=rf"{S1}: its windows are not the ones"):
        ActivationCache(d)


@pytest.mark.parametrize("checksums", [True, False])
def test_a_shard_of_the_same_windows_from_another_model_is_refused_when_read(caches, tmp_path, checksums):
    d = _copy(caches[0], tmp_path / "c", checksums=checksums)
    shutil.copy(caches[2] / S1, d / S1)
    cache = ActivationCache(d)  # the windows agree; the values are another model's
    cache.windows("input_ids", torch.arange(20))  # shard 0 is intact
    with pytest.raises(ActivationCacheError, match=rf"{S1}: altered checkpoint file"):
        cache.windows(caches[3], torch.tensor([25]))
    with pytest.raises(ActivationCacheError, match=rf"{S1}: altered"):
        ActivationCache(d).verify()


@pytest.mark.parametrize("checksums", [True, False])
def test_edited_values_are_refused(caches, tmp_path, checksums):
    d = _copy(caches[0], tmp_path / "c", checksums=checksums)
    _edit_shard(d, S2, lambda t: t[caches[3]][3, 5, 1].add_(0.5))
    with pytest.raises(ActivationCacheError, match=rf"{S2}: altered checkpoint file"):
        _read_all(d)


@pytest.mark.parametrize("hashes", [True, False])
def test_a_nan_is_refused(caches, tmp_path, hashes):
    d = _copy(caches[0], tmp_path / "c", checksums=hashes, shard_hashes=hashes)
    _edit_shard(d, S1, lambda t: t[caches[3]][7, 2, 0].fill_(float("nan")))
    match = rf"{S1}: altered checkpoint file" if hashes else rf"{S1}: tensor '{caches[3]}' has 1 non-finite values"
    with pytest.raises(ActivationCacheError, match=match):
        _read_all(d)
    with pytest.raises(ActivationCacheError, match=match):
        ActivationCache(d).verify()


def test_an_old_cache_without_hashes_still_loads_and_reads_the_same(caches, tmp_path):
    d = _copy(caches[0], tmp_path / "c", checksums=False, shard_hashes=False)
    old, new = ActivationCache(d), ActivationCache(caches[0])
    old.verify()
    idx = torch.tensor([0, 19, 20, 47, 3])
    assert torch.equal(old.windows(caches[3], idx), new.windows(caches[3], idx))


@pytest.mark.parametrize("file", ["../main/shard_00000.safetensors", "/etc/passwd", "./shard_00000.safetensors",
                                  "sub/../shard_00000.safetensors", "", 3, None, "a\\b"])
@pytest.mark.parametrize("checksums", [True, False])
def test_shard_paths_outside_the_directory_are_refused(caches, tmp_path, file, checksums):
    d = _copy(caches[0], tmp_path / "c", checksums=checksums)
    _edit_manifest(d, lambda m: m["shards"][0].update(file=file))
    with pytest.raises(ActivationCacheError, match=r"manifest\.json: key 'shards\[0\]\.file'"):
        ActivationCache(d)


def test_an_absolute_path_to_a_real_shard_elsewhere_is_refused(caches, tmp_path):
    d = _copy(caches[0], tmp_path / "c", checksums=False)
    _edit_manifest(d, lambda m: m["shards"][0].update(file=str(caches[0] / S0)))
    with pytest.raises(ActivationCacheError, match=r"not a relative file name inside"):
        ActivationCache(d)


def test_a_symlinked_shard_leading_outside_is_refused(caches, tmp_path):
    d = _copy(caches[0], tmp_path / "c", checksums=False)
    (d / S0).unlink()
    (d / S0).symlink_to(caches[0] / S0)
    with pytest.raises(ActivationCacheError, match=rf"{S0}: key 'shards\[0\]\.file' leads outside"):
        ActivationCache(d)


def test_a_shard_listed_twice_is_refused(caches, tmp_path):
    d = _copy(caches[0], tmp_path / "c", checksums=False)
    _edit_manifest(d, lambda m: m["shards"][1].update(file=S0))
    with pytest.raises(ActivationCacheError, match=r"shards\[1\]\.file' lists 'shard_00000\.safetensors' twice"):
        ActivationCache(d)


@pytest.mark.parametrize(("where", "value"), [("n_windows", True), ("n_windows", "48"), ("seq_len", 16.0),
                                              ("dataset_hash", 3), ("shards", {}), ("sites", []), ("model", "m")])
def test_manifest_fields_of_the_wrong_type_are_refused(caches, tmp_path, where, value):
    d = _copy(caches[0], tmp_path / "c", checksums=False)
    _edit_manifest(d, lambda m: m.update({where: value}))
    with pytest.raises(ActivationCacheError, match=rf"manifest\.json: key '{where}'"):
        ActivationCache(d)


def test_a_model_producing_nan_writes_no_cache(setup, tmp_path):
    model, hf, adapter, data = setup
    with torch.no_grad():
        saved = hf.model.layers[0].mlp.down_proj.weight.clone()
        hf.model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    try:
        with pytest.raises(ActivationCacheError, match=r"non-finite values \(NaN/inf\) in windows 0\.\.9"):
            write_activation_cache(model, [Site.mlp_output(adapter, 0)], data, tmp_path / "nan", batch_size=10)
    finally:
        with torch.no_grad():
            hf.model.layers[0].mlp.down_proj.weight.copy_(saved)
    assert not (tmp_path / "nan").exists()


# ------------------------------------------------------------------ generated tampering
TAMPER = st.sampled_from(["value", "nan", "inf", "swap_rows", "token", "swap_files", "foreign"])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=TAMPER, shard=st.integers(0, 2), row=st.integers(0, 7), pos=st.integers(0, 15),
       checksums=st.booleans(), shard_hashes=st.booleans())
def test_generated_tampering_is_refused_naming_a_file(caches, tmp_path, kind, shard, row, pos, checksums,
                                                      shard_hashes):
    main, other, _, site = caches
    if kind == "value" and not checksums and not shard_hashes:
        return  # a finite value edited in a cache without any hash: nothing can tell (docs/reliability.md)
    d = _copy(main, tmp_path / "g", checksums=checksums, shard_hashes=shard_hashes)
    file = f"shard_{shard:05d}.safetensors"

    def edit(t):
        if kind == "value":
            t[site][row, pos, 0].add_(1.0)
        elif kind in ("nan", "inf"):
            t[site][row, pos, 0].fill_(float(kind))
        elif kind == "swap_rows":  # two neighbouring windows of this shard (the last shard may be short)
            r = row % (t["input_ids"].shape[0] - 1)
            for k in t:
                t[k][[r, r + 1]] = t[k][[r + 1, r]].clone()
        else:  # token
            t["input_ids"][row, pos] = (t["input_ids"][row, pos] + 1) % 64

    if kind == "swap_files":
        a, b = file, f"shard_{(shard + 1) % 2:05d}.safetensors"  # the two shards of 20 windows
        (d / a).rename(d / "tmp")
        (d / b).rename(d / a)
        (d / "tmp").rename(d / b)
    elif kind == "foreign":
        shutil.copy(other / file, d / file)
    else:
        _edit_shard(d, file, edit)
    ids = load_file(main / file)["input_ids"]
    if kind == "swap_rows" and torch.equal(*ids[[row % (ids.shape[0] - 1), row % (ids.shape[0] - 1) + 1]].unbind()):
        return  # two equal windows swapped: nothing changed
    with pytest.raises(ActivationCacheError, match=r"shard_0000[0-2]\.safetensors|manifest\.json"):
        _read_all(d)
        ActivationCache(d).verify()
