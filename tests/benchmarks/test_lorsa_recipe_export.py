"""benchmarks/lorsa_recipe.py --export: the written batches are exactly what our ActivationSource yields."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from helpers import tiny_training_setup
from safetensors.torch import load_file

from nnsight_lorsa.envoy.read import Site
from nnsight_lorsa.training import ActivationSource
from nnsight_lorsa.training.activation_cache import write_activation_cache


@pytest.fixture(scope="module")
def recipe():
    return importlib.import_module("benchmarks.lorsa_recipe")


def test_export_matches_the_source(recipe, tmp_path):
    model, hf, adapter, data = tiny_training_setup()
    layer = 1
    train, heldout = data.split(8 / 48)
    sites = {"x": Site.attn_input(adapter, layer), "y": Site.attn_output(adapter, layer)}
    train_cache = write_activation_cache(model, sites, train, tmp_path / "train", batch_size=16)
    held = write_activation_cache(model, sites, heldout, tmp_path / "held", batch_size=16)
    steps, seed = 5, 3  # 40 windows = 2 batches of 16 per epoch: 5 steps cross two reshuffles
    recipe.export(model, layer, train_cache, held, steps, 64, 4, seed, tmp_path / "out")

    t = load_file(str(tmp_path / "out" / "train.safetensors"))
    source = ActivationSource(train_cache, sites["x"], sites["y"], batch_size=16, seed=seed)
    assert t["batch_windows"].shape == (steps, 16)
    assert len({tuple(t["batch_windows"][i].tolist()) for i in range(steps)}) > 2  # not one batch repeated
    for i in range(steps):
        b = source(i)
        ids = t["batch_windows"][i]
        assert torch.equal(ids, source.window_ids(i))
        assert torch.equal(t["x"][ids], b.x) and torch.equal(t["y"][ids], b.y)
        assert torch.equal(t["loss_mask"][ids], b.loss_mask)
    h = load_file(str(tmp_path / "out" / "heldout.safetensors"))
    ids = torch.arange(held.n_windows)
    for k in ("x", "y", "loss_mask"):
        assert torch.equal(h[k], held.windows(k, ids))

    mhsa = adapter.mhsa_weights(model._module, layer)
    w = load_file(str(tmp_path / "out" / "mhsa.safetensors"))
    for k in ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O"):
        assert torch.equal(w[k], getattr(mhsa, k).float())
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert (meta["n_heads"], meta["n_kv_heads"], meta["head_dim"]) == (mhsa.W_Q.shape[0], mhsa.W_K.shape[0],
                                                                       mhsa.W_Q.shape[-1])
    assert (meta["n_ov_heads"], meta["top_k"], meta["steps"], meta["seed"]) == (64, 4, steps, seed)
    assert meta["n_qk_heads"] == 4 * mhsa.W_Q.shape[0] and meta["scale"] == mhsa.scale
    assert meta["rotary"]["interleaved"] == mhsa.rotary.interleaved
