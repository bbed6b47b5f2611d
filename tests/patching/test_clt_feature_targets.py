"""A cross-layer transcoder's features as intervention targets: ``Feature(layer, index, kind="transcoder")`` on a
``ReplacementModel`` holding a ``CLTSet`` (circuit-tracer's ``feature_intervention`` on CLT features; until
2026-11-29 refused, "edit them on the CLT's envoy"). Each edit through ``nnsight_lorsa.patching`` equals the same
edit made by hand on the CLT's envoy (``hook_sae_acts_post[layer].output``), bit for bit; an edit to layer ``l``'s
features moves every MLP output ``l' ≥ l``; a patch to the clean value is no edit."""

from __future__ import annotations

import pytest
import torch
from helpers import circuit_tracer_hooked, make_clt, random_ids, tiny_nnsight

from nnsight_lorsa import CLTSet, ReplacementModel
from nnsight_lorsa.envoy.targets import Feature, TargetIndexError
from nnsight_lorsa.errors import LayerOutOfRangeError
from nnsight_lorsa.patching import ablate, patch, read, scale, steer

HOOKS = {"llama": None, "gemma2": ("hook_resid_mid", "hook_mlp_out")}  # Gemma-2: the post-MLP norm's output


def world(family):
    model, hf = tiny_nnsight(family)
    clt = make_clt()
    if HOOKS[family] is not None:
        circuit_tracer_hooked(clt, *HOOKS[family])
    return model, CLTSet(model, clt)


def by_hand(model, clt_set, ids, edits, error=True):
    """Logits with ``edits`` ``[(layer, index, position, fn)]`` applied on the CLT's envoy, in layer order."""
    with torch.no_grad(), model.trace(ids):
        env = clt_set.replace(error=error)
        for layer, index, pos, fn in sorted(edits, key=lambda e: e[0]):
            acts = env.hook_sae_acts_post[layer].output
            acts[:, pos, index] = fn(acts[:, pos, index])
        logits = model.lm_head.output.save()
    return logits


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("error", [True, False])
def test_patching_a_clt_feature_equals_the_edit_on_the_envoy(family, error):
    model, clt_set = world(family)
    rm = ReplacementModel(model, transcoders=clt_set, error=error)
    ids = random_ids(2, 6, seed=1)
    targets = [Feature(0, 5, kind="transcoder"), Feature(2, 11, kind="transcoder")]
    with torch.no_grad(), model.trace(ids):
        rm.prepare(targets)
        clean = read(rm(targets[0])).save()
        ablate(rm(targets[0]), positions=[3])
        scale(rm(targets[1]), 2.5, positions=[4])
        got = model.lm_head.output.save()
    want = by_hand(model, clt_set, ids, [(0, 5, 3, torch.zeros_like), (2, 11, 4, lambda a: a * 2.5)], error)
    assert torch.equal(got, want)
    with torch.no_grad(), model.trace(ids):
        rm.prepare(targets)
        plain = model.lm_head.output.save()
    assert float(clean[:, 3].abs().max()) > 0 and not torch.equal(got, plain)  # an edit that moves the logits


def test_an_edit_moves_every_later_mlp_and_a_clean_patch_is_no_edit():
    model, clt_set = world("llama")
    rm = ReplacementModel(model, transcoders=clt_set)
    ids = random_ids(1, 6, seed=2)
    f = Feature(0, 7, kind="transcoder")
    with torch.no_grad(), model.trace(ids):
        rm.prepare([f])
        plain = model.lm_head.output.save()
    with torch.no_grad(), model.trace(ids):
        rm.prepare([f])
        patch(rm(f), read(rm(f)))  # the clean value: nothing moves
        same = model.lm_head.output.save()
    assert torch.equal(same, plain)
    recons: list = []  # filled inside the traces (objects from outside keep what is appended)
    base: list = []
    with torch.no_grad(), model.trace(ids):
        env = rm.replace()["transcoders"]
        steer(rm(f), 3.0)
        for layer in range(3):
            recons.append(env.hook_sae_recons[layer].output.save())
    with torch.no_grad(), model.trace(ids):
        env = rm.replace()["transcoders"]
        for layer in range(3):
            base.append(env.hook_sae_recons[layer].output.save())
    moved = [not torch.equal(a, b) for a, b in zip(recons, base, strict=True)]
    assert moved == [True, True, True]  # layer 0's decoders write MLPs 0, 1, 2


def test_clt_feature_targets_are_checked_before_anything_runs():
    model, clt_set = world("llama")
    rm = ReplacementModel(model, transcoders=clt_set)
    with pytest.raises(LayerOutOfRangeError, match="layer 9"):
        rm.check(Feature(9, 0, kind="transcoder"))
    with pytest.raises(TargetIndexError):
        rm.check(Feature(1, clt_set.clt.cfg.d_sae, kind="transcoder"))


def test_circuit_metrics_of_a_clt_graph_ablate_its_features():
    """``circuit_metrics`` zero-ablates a CLT graph's circuit features (was: refused, the CLT's features no targets):
    a single feature's effect equals the same ablation made by hand on the CLT's envoy."""
    from nnsight_lorsa.attribution import attribute, circuit_metrics, prune

    model, clt_set = world("llama")
    rm = ReplacementModel(model, transcoders=clt_set)
    ids = random_ids(1, 6, seed=3)[0]
    g = attribute(rm, ids, batch_size=32)
    cm = circuit_metrics(rm, g, prune(g))
    assert len(cm.nodes) > 0
    token = int(g.nodes.index[g.logit_ids[g.logit_probs.argmax()]])
    i = int(cm.nodes[0])
    layer, index, pos = int(g.nodes.layer[i]), int(g.nodes.index[i]), int(g.nodes.pos[i])
    last = by_hand(model, clt_set, ids[None], [(layer, index, pos, torch.zeros_like)])[0, -1]
    assert abs(float(cm.effects[0]) - (cm.baseline - float(last[token] - last.mean()))) < 1e-4


def test_path_patching_names_a_clt_feature_sender():
    from nnsight_lorsa.errors import ConfigMismatchError
    from nnsight_lorsa.patching import HeadInput, MHSAHead, path_patching

    model, clt_set = world("llama")
    rm = ReplacementModel(model, transcoders=clt_set)
    ids = random_ids(1, 6, seed=4)
    with pytest.raises(ConfigMismatchError, match="cross-layer transcoder's feature"):
        path_patching(rm, ids, [Feature(0, 1, kind="transcoder")], corrupt=ids,
                      receivers=[HeadInput(MHSAHead(2, 0), "v")])
