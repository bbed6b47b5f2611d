"""One options object for attribution (issue 22 item 3): ``attribute``, ``build_graph``, ``estimate_memory``
and ``attribute(rm, tracer=...)`` funnel their settings into :class:`AttributionOptions`, checked once,
before anything runs."""

from __future__ import annotations

import pytest
import torch
from helpers import attribution_setup, random_ids, rm

from nnsight_lorsa.attribution import PruneConfig, attribute, estimate_memory
from nnsight_lorsa.attribution.attribute import build_graph
from nnsight_lorsa.attribution.options import AttributionOptions
from nnsight_lorsa.errors import ArgumentError, ConfigMismatchError


@pytest.mark.parametrize("setting,error,match", [
    ({"batch_size": 0}, ConfigMismatchError, "batch_size"),
    ({"max_feature_nodes": 0}, ConfigMismatchError, "max_feature_nodes"),
    ({"max_memory": -1}, ConfigMismatchError, "max_memory"),
    ({"desired_logit_prob": 1.5}, ConfigMismatchError, "desired_logit_prob"),
    ({"dtype": torch.int64}, ArgumentError, "dtype"),
    ({"remote": "yes"}, ArgumentError, "remote"),
    ({"zero_positions": -1}, ConfigMismatchError, "zero_positions"),
    ({"qk_heads": -2}, ConfigMismatchError, "qk_heads"),
    ({"memory": "dense"}, ConfigMismatchError, "memory"),
    ({"memory": ("dense", "grid")}, ConfigMismatchError, "patterns"),
    ({"prune": (0.8, 1.5)}, ConfigMismatchError, "edge_threshold"),
])
def test_every_setting_is_checked_once_by_every_entry_point(setting, error, match):
    """The same check, the same error, from the options object and from each entry point that takes it;
    no model runs (the checks come first). (A value of the wrong annotated type — ``batch_size=2.0`` — is
    caught here by the tests' beartype hook before our check, which raises ArgumentError in use.)"""
    model, _, lorsas, tcs = attribution_setup("llama")
    r, ids = rm(model, lorsas, tcs), random_ids(1, 6, seed=1)[0]
    with pytest.raises(error, match=match):
        AttributionOptions(**setting)
    with pytest.raises(error, match=match):
        build_graph(r, ids, **setting)
    if isinstance(setting.get("memory"), tuple):  # the (patterns, node_vectors) pair is build_graph's alone
        return
    with pytest.raises(error, match=match):
        attribute(r, ids, **setting)
    estimate = {k: v for k, v in setting.items()
                if k in ("batch_size", "memory", "prune", "max_feature_nodes", "dtype", "zero_positions")}
    if estimate:
        with pytest.raises(error, match=match):
            estimate_memory(r, ids, **estimate)


def test_options_are_normalised_and_shared():
    o = AttributionOptions(prune=(0.7, 0.9), memory="fast")
    assert o.prune == PruneConfig(0.7, 0.9) and o.modes == ("store", "grid")
    assert AttributionOptions.of({"batch_size": 8}) == AttributionOptions(batch_size=8)
    with pytest.raises(TypeError, match="unknown attribution setting"):
        AttributionOptions.of({"batchsize": 8})
    model, _, lorsas, tcs = attribution_setup("llama")
    r, ids = rm(model, lorsas, tcs), random_ids(1, 6, seed=1)[0]
    with pytest.raises(ArgumentError, match="not both"):
        build_graph(r, ids, options=AttributionOptions(), batch_size=8)
    a = build_graph(r, ids, options=AttributionOptions(batch_size=16))
    b = attribute(r, ids, batch_size=16)
    assert torch.equal(a.densify(), b.densify()) and a.meta == b.meta
