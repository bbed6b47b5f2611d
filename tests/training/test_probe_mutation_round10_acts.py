"""Mutation probe, round 10 (docs/reliability.md): activation collection (``training/activations.py``): the batch's
move to a module's device and dtype, the source's site checks, shards and masks; each test seen failing with the
mutant it names and passing without.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import tiny_training_setup

from nnsight_lorsa.envoy.read import Site
from nnsight_lorsa.training.activations import ActivationSource, Batch

CPU = torch.device("cpu")


@functools.cache
def _setup():  # type: ignore[no-untyped-def]
    return tiny_training_setup()


def test_batch_to_casts_x_and_y_even_when_the_masks_are_already_there():
    """Batch.to's documented rule: ``x`` / ``y`` in ``dtype`` (an SAE batch's ``y is x`` kept shared), the masks and
    positions moved only, ``self`` only when nothing changes (mutant A1: ``any`` for ``all`` returned the fp32 batch
    as soon as the mask was already on the CPU; A2: a transcoder's ``y`` replaced by its ``x``)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 5, generator=g)
    mask, positions = torch.ones(2, 3, dtype=torch.bool), torch.arange(3)
    batch = Batch(x=x, y=y, loss_mask=mask, positions=positions)
    out = batch.to(CPU, torch.bfloat16)
    assert out is not batch
    assert out.x.dtype == out.y.dtype == torch.bfloat16
    assert torch.equal(out.x, x.to(torch.bfloat16)) and torch.equal(out.y, y.to(torch.bfloat16))
    assert out.loss_mask is mask and out.positions is positions and out.attn_mask is None
    assert batch.x.dtype == torch.float32  # the original untouched
    sae = Batch(x=x, y=x, loss_mask=mask)
    moved = sae.to(CPU, torch.float64)
    assert moved.y is moved.x and moved.x.dtype == torch.float64
    assert batch.to(CPU, torch.float32) is batch


def test_a_tuple_of_sites_is_stacked_like_a_list():
    """ActivationSource's documented rule: ``x`` a Site or a *sequence* of Sites, stacked ``(n_sites, batch, pos, d)``;
    each slice is that site's own single-site batch (mutant A4: only a ``list`` stacked, a tuple read its first site
    alone)."""
    model, _, adapter, data = _setup()
    sites = (Site.mlp_input(adapter, 0), Site.resid_post(adapter, 1))
    src = ActivationSource(model, sites, dataset=data, batch_size=3, seed=1)
    assert src.stacked and src.n_layers == 2 and src.d_model == adapter.d_model
    got = src(2)
    assert got.x.shape[0] == 2 and got.y is got.x
    for i, site in enumerate(sites):
        alone = ActivationSource(model, site, dataset=data, batch_size=3, seed=1)(2)
        assert torch.equal(got.x[i], alone.x)
        assert torch.equal(got.loss_mask, alone.loss_mask)


def test_a_clt_source_of_every_layer_named_by_its_count_is_the_default_one():
    """ActivationSource.clt's documented range: ``n_layers`` from 1 to the model's layer count, layers ``0 … n−1``;
    the model's own count gives the default source, one more is refused (mutant A5: ``check_layer(n_layers)``
    refused the model's own count)."""
    from nnsight_lorsa.errors import LayerOutOfRangeError

    model, _, adapter, data = _setup()
    n = adapter.n_layers
    full = ActivationSource.clt(model, data, batch_size=2, n_layers=n)
    assert full.x_sites == ActivationSource.clt(model, data, batch_size=2).x_sites
    assert full.n_layers == n and full.y_sites[-1] == Site.mlp_output(adapter, n - 1)
    assert ActivationSource.clt(model, data, batch_size=2, n_layers=1).x_sites == (Site.mlp_input(adapter, 0),)
    for bad in (0, n + 1):
        with pytest.raises(LayerOutOfRangeError):
            ActivationSource.clt(model, data, batch_size=2, n_layers=bad)


@pytest.mark.parametrize(("rank", "world"), [(2, 2), (3, 3), (-1, 2), (1, 1)])
def test_a_shard_rank_outside_the_world_is_refused_by_name(rank, world):
    """ActivationSource.shard's documented rule: ``rank`` in ``[0, world)``, else ``ArgumentError`` (mutant A6:
    ``rank == world`` accepted, an ``IndexError`` at the first batch)."""
    from nnsight_lorsa.errors import ArgumentError

    model, _, adapter, data = _setup()
    src = ActivationSource(model, Site.mlp_input(adapter, 0), dataset=data, batch_size=4)
    with pytest.raises(ArgumentError, match=r"rank=.* is not in \[0, world="):
        src.shard(rank, world)


def test_shards_partition_each_batch_in_order():
    """``shard(r, w)``: rank ``r``'s contiguous part of each batch's windows as ``torch.tensor_split`` cuts them, the
    parts in order making the whole batch (mutant A7: ``chunk``, whose parts differ for 6 windows of 4 ranks)."""
    model, _, adapter, data = _setup()
    src = ActivationSource(model, Site.mlp_input(adapter, 0), dataset=data, batch_size=6, seed=3)
    for world in (1, 2, 4, 5):
        parts = [src.shard(r, world).window_ids(1) for r in range(world)]
        assert [len(p) for p in parts] == [len(t) for t in torch.arange(6).tensor_split(world)]
        assert torch.equal(torch.cat(parts), src.window_ids(1))


def test_a_cached_source_refuses_positions_by_name(tmp_path):
    """ActivationSource's documented rule: positions are read live only; a cache holds none, and a cached source
    asked for them raises ``ActivationCacheError`` (mutant A13: accepted, every batch's ``positions`` silently None,
    a Lorsa then trained without its RoPE positions)."""
    from nnsight_lorsa.errors import ActivationCacheError
    from nnsight_lorsa.training import TokenDataset
    from nnsight_lorsa.training.activation_cache import write_activation_cache

    model, _, adapter, data = _setup()
    small = TokenDataset(data.tokens[:4])
    sites = [Site.attn_input(adapter, 1), Site.attn_output(adapter, 1)]
    cache = write_activation_cache(model, sites, small, tmp_path / "cache", batch_size=4)
    with pytest.raises(ActivationCacheError, match="positions are not cached"):
        ActivationSource(cache, sites[0], sites[1], positions=Site.attn_positions(adapter, 1))
    assert ActivationSource(cache, sites[0], sites[1], batch_size=2)(0).positions is None
