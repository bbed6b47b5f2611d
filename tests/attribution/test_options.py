"""One options object for attribution (issue 22 item 3): ``attribute``, ``build_graph``, ``estimate_memory``
and ``attribute(rm, tracer=...)`` funnel their settings into :class:`AttributionOptions`, checked once,
before anything runs."""

from __future__ import annotations

import pytest
import torch
from helpers import attribution_setup, random_ids, rm

from nnsight_lorsa.attribution import PruneConfig, attribute, estimate_memory
from nnsight_lorsa.attribution.engine import build_graph
from nnsight_lorsa.attribution.options import AttributionOptions
from nnsight_lorsa.errors import ArgumentError, ConfigMismatchError


@pytest.mark.parametrize("setting,error,match", [
    ({"batch_size": 0}, ConfigMismatchError, "batch_size"),
    ({"max_feature_nodes": 0}, ConfigMismatchError, "max_feature_nodes"),
    ({"max_memory": -1}, ConfigMismatchError, "max_memory"),
    ({"targets": []}, ConfigMismatchError, "targets"),
    ({"targets": [-1]}, ConfigMismatchError, "targets"),
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
                if k in ("batch_size", "memory", "prune", "max_feature_nodes", "dtype", "zero_positions", "targets")}
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


@pytest.mark.parametrize("value,error,match", [
    ("w3", ArgumentError, "one string"),
    ([1.5], ArgumentError, "targets"),
    ([True], ArgumentError, "targets"),
    ([3, "w7"], ArgumentError, "all integer token ids or all token strings"),
    (torch.tensor([3.0]), ArgumentError, "integer token ids"),
    (torch.tensor([[3, 7]]), ArgumentError, "one dimension"),
    ({3: 1}, ArgumentError, "targets"),
    (0.9, ArgumentError, "targets"),
    ([], ConfigMismatchError, "no logit tokens"),
    ([4, -1], ConfigMismatchError, "ids >= 0"),
    ([""], ConfigMismatchError, "empty string"),
])
def test_targets_is_one_checked_value(value, error, match):
    """``targets`` (issue 22): every bad value ends in a named error saying what, before anything runs."""
    from nnsight_lorsa.attribution.logit_targets import check_targets

    with pytest.raises(error, match=match):
        check_targets(value)


@pytest.mark.parametrize("kw,error,match", [
    ({"max_n": 0}, ConfigMismatchError, r"max_n=.*>= 1"),
    ({"cumulative_prob": 1.5}, ConfigMismatchError, r"cumulative_prob=.*\(0, 1\]"),
    ({"cumulative_prob": 0.0}, ConfigMismatchError, "cumulative_prob"),
    ({"cumulative_prob": float("nan")}, ConfigMismatchError, "cumulative_prob"),
])
def test_logit_targets_policy_is_checked(kw, error, match):
    """(Wrongly typed fields — ``max_n=2.5`` — meet the tests' beartype hook first; tests/hostile_cases.py runs
    them without it and requires our ArgumentError.)"""
    from nnsight_lorsa.attribution import LogitTargets

    with pytest.raises(error, match=match):
        LogitTargets(**kw)


def test_targets_normalise_to_one_form():
    from nnsight_lorsa.attribution import LogitTargets
    from nnsight_lorsa.attribution.logit_targets import check_targets

    assert AttributionOptions().targets == LogitTargets() == LogitTargets(max_n=10, cumulative_prob=0.95)
    assert AttributionOptions(targets=torch.tensor([3, 7])).targets == (3, 7) == check_targets([3, 7])
    assert check_targets(torch.tensor(5)) == (5,) and check_targets([" w3"]) == (" w3",)
    np = pytest.importorskip("numpy")
    assert check_targets(np.array([3, 7])) == (3, 7) == check_targets([np.int64(3), np.int32(7)])
    assert all(type(t) is int for t in check_targets(np.array([3, 7])))
    with pytest.raises(ArgumentError, match="targets"):
        check_targets(np.array(["w3"], dtype=object))
    with pytest.raises(ArgumentError, match="targets"):
        check_targets(np.array([[3, 7]]))
    assert AttributionOptions(targets=[3, 7]) == AttributionOptions(targets=(3, 7))


@pytest.mark.parametrize("old,new", [({"logit_tokens": [3]}, "targets=[id"),
                                     ({"desired_logit_prob": 0.9}, "cumulative_prob"),
                                     ({"max_n_logits": 3}, "LogitTargets(max_n")])
def test_old_logit_settings_are_refused_with_their_new_spelling(old, new):
    """No silent aliasing: the three old settings end in ArgumentError naming ``targets=``'s spelling, from
    every entry point, before any model runs."""
    model, _, lorsas, tcs = attribution_setup("llama")
    r, ids = rm(model, lorsas, tcs), random_ids(1, 6, seed=1)[0]
    for call in (lambda: attribute(r, ids, **old), lambda: build_graph(r, ids, **old),
                 lambda: estimate_memory(r, ids, **old), lambda: AttributionOptions.of(old)):
        with pytest.raises(ArgumentError, match=next(iter(old))) as e:
            call()
        assert new in str(e.value)
    with pytest.raises(TypeError, match="unexpected keyword"):
        attribute(r, ids, logit_token=[3])


def test_each_way_of_naming_targets_gives_the_same_graph():
    """The default, its explicit policy, ids as a list / tensor, and the same tokens as strings: the same
    graph (every edge bit-equal); a tighter policy keeps a prefix of the default's logits."""
    from nnsight_lorsa.attribution import LogitTargets

    model, _, lorsas, tcs = attribution_setup("llama")
    r, ids = rm(model, lorsas, tcs), random_ids(1, 6, seed=1)[0]
    base = attribute(r, ids, batch_size=16)
    same = attribute(r, ids, batch_size=16, targets=LogitTargets(max_n=10, cumulative_prob=0.95))
    assert torch.equal(base.densify(), same.densify())
    top = base.nodes.index[base.logit_ids].tolist()
    assert 1 <= len(top) <= 10
    by_ids = attribute(r, ids, batch_size=16, targets=top)
    by_tensor = attribute(r, ids, batch_size=16, targets=torch.tensor(top))
    by_text = attribute(r, ids, batch_size=16, targets=model.tokenizer.convert_ids_to_tokens(top))
    for g in (by_ids, by_tensor, by_text):
        assert g.nodes.index[g.logit_ids].tolist() == top
        assert torch.equal(g.densify(), base.densify())
    one = attribute(r, ids, batch_size=16, targets=LogitTargets(max_n=1))
    assert one.nodes.index[one.logit_ids].tolist() == top[:1]
    with pytest.raises(ConfigMismatchError, match="2 tokens"):
        attribute(r, ids, targets=["w3 w7"])


def test_logit_targets_take_the_fewest_tokens_that_reach_the_probability():
    """Mutation probe (2026-11-28): ``LogitTargets`` keeps the most likely tokens up to the first whose cumulative
    probability reaches ``cumulative_prob`` (circuit-tracer: ``searchsorted(cumsum, p) + 1``), capped by ``max_n``;
    keeping one fewer passed every other test (the peer graph's target count is set by its ``max_n``)."""
    from nnsight_lorsa.attribution import LogitTargets
    from nnsight_lorsa.attribution.logit_targets import target_logits

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = 3 * torch.randn(40, generator=g)
        p_want = float(torch.rand((), generator=g)) * 0.98 + 0.01
        max_n = int(torch.randint(1, 12, (), generator=g))
        probs, order = logits.softmax(-1).sort(descending=True)
        n = min(int(torch.searchsorted(probs.cumsum(0), torch.tensor(p_want))) + 1, max_n)
        ids, p = target_logits(logits, LogitTargets(max_n=max_n, cumulative_prob=p_want))
        assert ids.tolist() == order[:n].tolist()
        assert torch.allclose(p, probs[:n], rtol=1e-6, atol=0)
