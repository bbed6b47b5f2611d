"""Experiments that compare runs must run every one of them through the same replacements: with ``error=False`` a
splice changes the logits by itself, so a run spliced differently from its baseline measures the splice, not the edit
(docs/patching.md: "The clean run, the corrupt baseline and every patched run go through the same replacements").

Found by the patching probe of 2026-11-27 (docs/reliability.md, "Patching and intervened-attribution probe"):
``activation_patching`` spliced, in each trace of ``groups_per_trace`` patched runs, only that chunk's replacements
(its baselines: every group's) — a no-op patch moved the metric by up to 0.31 on a tiny Qwen3 —, and
``random_ablation_control`` measured each draw through the draw's replacements only, against the last draw's
baseline."""

from __future__ import annotations

import pytest
import torch
from helpers import make_sae, random_ids, tiny_nnsight

from nnsight_lorsa import ReplacementModel, SAESet
from nnsight_lorsa.patching import Feature, ablation_effect, activation_patching, random_ablation_control, read


@pytest.fixture(scope="module")
def two_saes():
    """A tiny Llama with two SAEs (layers 0 and 1), spliced without their error terms, a prompt batch, and an SAE
    feature of each site that is inactive on every token of the batch (zeroing or patching it is a no-op)."""
    model, _ = tiny_nnsight("llama")
    sites = ("model.layers.0", "model.layers.1")
    r = ReplacementModel(model, saes=SAESet(model, {s: make_sae(seed=i) for i, s in enumerate(sites)}), error=False)
    ids = random_ids(batch=2, seq=8, seed=4)
    acts: list = []
    with torch.no_grad(), model.trace(ids):
        r.prepare([Feature(s, 0) for s in sites])
        for s in sites:
            acts.append(r.saes.replace(s, error=False).hook_sae_acts_post.output.save())
    idle = [int((a.abs().amax((0, 1)) == 0).nonzero()[0]) for a in acts]
    return r, ids, [Feature(s, i) for s, i in zip(sites, idle, strict=True)]


@torch.no_grad()
@pytest.mark.parametrize("groups_per_trace", [1, 2, 8])
def test_activation_patching_splices_every_group_in_every_chunk(two_saes, groups_per_trace):
    """Clean = corrupt and idle features: every patched run is the corrupt baseline, whatever the chunking."""
    r, ids, idle = two_saes
    res = activation_patching(r, ids, ids, [idle[0], idle[1], tuple(idle)], correct_ids=5, incorrect_ids=6,
                              groups_per_trace=groups_per_trace)
    assert (res.clean - res.corrupt).abs().max() == 0
    assert (res.patched - res.corrupt[None]).abs().max() < 1e-5


@torch.no_grad()
def test_random_ablation_control_measures_every_draw_through_the_pools_replacements(two_saes):
    """Idle features drawn from a pool spanning two SAE sites: each draw's ablation is a no-op, so every sample is
    the baseline (a draw measured through its own site's SAE only differed from the reported baseline)."""
    r, ids, idle = two_saes
    ctl = random_ablation_control(r, ids, idle, 1, n_samples=6, correct_ids=5, incorrect_ids=6)
    assert {d[0] for d in ctl.draws} == set(idle)  # both sites drawn
    assert (ctl.samples - ctl.baseline[None]).abs().max() < 1e-5
    assert ctl.relative.abs().max() < 1e-5
    # the baseline is the pool's replacement model unedited: both SAEs spliced
    with r.model.trace(ids):
        r.prepare(idle)
        read(r(idle[0]))
        read(r(idle[1]))
        logits = r.model.lm_head.output.save()
    want = logits[:, -1, 5] - logits[:, -1, 6]
    assert (ctl.baseline - want).abs().max() < 1e-5
    # ablation_effect of one target: its baseline and ablation through the same replacements (unchanged behaviour)
    ab = ablation_effect(r, ids, [idle[0]], correct_ids=5, incorrect_ids=6)
    assert (ab.ablated - ab.baseline).abs().max() < 1e-5
