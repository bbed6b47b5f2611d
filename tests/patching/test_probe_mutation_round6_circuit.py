"""Mutation probe round 6 (docs/reliability.md): circuit discovery (``patching/circuit.py``) against independent
references. Each test was seen failing with a one-line mutant of the module and passing on the clean tree."""

from __future__ import annotations

import pytest
import torch
from helpers import LAYER, N_HEADS, make_lorsa, tiny_nnsight

from nnsight_lorsa import LorsaSet, get_adapter
from nnsight_lorsa.errors import ConfigMismatchError
from nnsight_lorsa.patching import LorsaHead, MHSAHead, ReplacementModel
from nnsight_lorsa.patching.circuit import circuit_size, component_scores, default_ks
from nnsight_lorsa.patching.experiments import ablation_effect, activation_patching
from nnsight_lorsa.patching.tasks import TaskBatch


@pytest.fixture(scope="module")
def setup():
    model, hf = tiny_nnsight("llama")
    lorsa = make_lorsa(hf, get_adapter(model))
    r = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: lorsa}))
    g = torch.Generator().manual_seed(3)
    clean, corrupt = torch.randint(2, 128, (4, 6), generator=g), torch.randint(2, 128, (4, 6), generator=g)
    task = TaskBatch("probe", clean, corrupt, torch.tensor([3, 4, 7, 9]), torch.tensor([5, 6, 8, 10]))
    return r, task


@torch.no_grad()
def test_lorsa_head_scores_are_each_heads_ablation_effect_on_every_prompt(setup):
    """``component_scores`` of every Lorsa head = ``ablation_effect`` of that head alone (``clean − ablated``, a
    separate run per head), including heads that fire only in a later prompt of the batch (mutant: the active heads
    taken from the first prompt only, the others given score 0 without a run)."""
    r, task = setup
    n = r.lorsas[LAYER].cfg.n_ov_heads
    with r.model.trace(task.clean):
        z = r.lorsas.replace(LAYER, error=r.error).hook_z.output.save()
    fires = (z > 0).any(1)  # (batch, n)
    late = fires[1:].any(0) & ~fires[0]
    assert bool(late.any()), "the fixture needs a head that fires only after the first prompt"
    heads = [LorsaHead(LAYER, h) for h in range(n)]
    got = component_scores(r, task, heads)
    kw = {"correct_ids": task.correct_ids, "incorrect_ids": task.incorrect_ids}
    for h in late.nonzero().flatten().tolist()[:4] + [int(fires[0].nonzero()[0])]:
        ab = ablation_effect(r, task.clean, [heads[h]], **kw)
        want = ab.baseline - ab.ablated
        scale = float(ab.baseline.abs().max()) + 1.0
        assert float((got[:, h] - want).abs().max()) <= 1e-5 * scale, (h, got[:, h], want)
    assert (got[:, ~fires.any(0)] == 0).all()  # never firing: zero-ablation is the identity


@torch.no_grad()
def test_patching_scores_are_patched_minus_corrupt(setup):
    """``method="patching"``: ``m_patched − m_corrupt`` of each component (the module docstring; mutant: minus the
    clean metric), from ``activation_patching`` clean → corrupt."""
    r, task = setup
    comps = [MHSAHead(0, h) for h in range(N_HEADS)] + [LorsaHead(LAYER, 0), LorsaHead(LAYER, 1)]
    got = component_scores(r, task, comps, method="patching")
    ap = activation_patching(r, task.clean, task.corrupt, comps, correct_ids=task.correct_ids,
                             incorrect_ids=task.incorrect_ids)
    assert got.shape == (len(task), len(comps))
    want = (ap.patched - ap.corrupt[None]).T
    scale = float(ap.clean.abs().max()) + 1.0
    assert float((got - want).abs().max()) <= 1e-5 * scale
    assert float((ap.clean - ap.corrupt).abs().min()) > 1e-3  # clean ≠ corrupt: the mutant's numbers differ


@torch.no_grad()
def test_the_global_circuit_is_the_top_of_the_mean_score_and_an_unreached_threshold_gives_n(setup):
    """``global_circuit()`` = the ``global_k`` components of largest batch-mean score (mutant: the smallest); a
    threshold no ``k`` reaches gives ``n`` per prompt and globally, as documented (mutants: 0); ``ks`` outside
    ``[0, n]`` are refused by name (mutant: ``n + 1`` accepted, a curve point for a circuit that cannot exist)."""
    r, task = setup
    comps = [MHSAHead(layer, h) for layer in (0, 2) for h in range(N_HEADS)]
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(len(task), len(comps), generator=g)
    cs = circuit_size(r, task, comps, scores=scores, ks=[0, 2, 4, 6, 8])
    want = scores.mean(0).argsort(descending=True)[:cs.global_k].tolist()
    assert cs.global_k > 0 and [comps.index(c) for c in cs.global_circuit()] == want
    never = circuit_size(r, task, comps, scores=scores, ks=[0, 8], threshold=1e6)
    assert never.global_k == len(comps) and never.per_prompt_k.tolist() == [len(comps)] * len(task)
    for bad in ([0, len(comps) + 1], [-1, 2]):
        with pytest.raises(ConfigMismatchError, match=rf"ks must lie in \[0, {len(comps)}\]"):
            circuit_size(r, task, comps, scores=scores, ks=bad)


@pytest.mark.parametrize("n", [1, 2, 31, 32, 33, 34, 47, 48, 49, 100, 1000, 4096])
def test_default_ks_count_up_to_32_then_grow_geometrically_to_n(n):
    """``default_ks(n)``: 0…min(n, 32) then steps of at most ×1.5, strictly increasing, ending at ``n``
    (mutants: steps past ``n``, 32 dropped)."""
    ks = default_ks(n)
    assert ks[:min(n, 32) + 1] == list(range(min(n, 32) + 1))
    assert ks[-1] == n and all(a < b for a, b in zip(ks, ks[1:], strict=False))
    assert all(b <= int(a * 1.5) or b == n for a, b in zip(ks[32:], ks[33:], strict=False))


@torch.no_grad()
def test_mhsa_and_lorsa_heads_of_the_same_layer_keep_only_runs_equal_ablating_the_rest(setup):
    """MHSA heads and Lorsa heads of the Lorsa's own layer (error term on: the MHSA edits reach the output through
    it), several keep masks in one trace: each circuit's metric = ``ablation_effect`` of the components it drops
    (a separate run per circuit), per prompt and for the global ranking."""
    r, task = setup
    n_ov = r.lorsas[LAYER].cfg.n_ov_heads
    with r.model.trace(task.clean):
        z = r.lorsas.replace(LAYER, error=r.error).hook_z.output.save()
    lheads = (z > 0).any(1).any(0).nonzero().flatten()[:3].tolist()
    assert len(lheads) == 3 and n_ov > 3
    comps = [MHSAHead(LAYER, h) for h in range(N_HEADS)] + [LorsaHead(LAYER, h) for h in lheads]
    n = len(comps)
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(len(task), n, generator=g)
    cs = circuit_size(r, task, comps, scores=scores, ks=list(range(n + 1)))
    kw = {"correct_ids": task.correct_ids, "incorrect_ids": task.incorrect_ids}
    order_g = scores.mean(0).argsort(descending=True).tolist()
    m_none = ablation_effect(r, task.clean, comps, **kw).ablated
    m_all = ablation_effect(r, task.clean, comps[:1], **kw).baseline
    scale = float(m_all.abs().max()) + 1.0
    for k in (1, 3, 5, n - 1):
        dropped = [comps[i] for i in order_g[k:]]
        m_k = ablation_effect(r, task.clean, dropped, **kw).ablated.mean()
        want = (m_k - m_none.mean()) / (m_all.mean() - m_none.mean())
        assert abs(float(cs.global_curve[k]) - float(want)) <= 1e-4 * scale / float((m_all - m_none).mean().abs())
        for b in range(len(task)):
            drop_b = [comps[i] for i in scores[b].argsort(descending=True)[k:].tolist()]
            m_kb = ablation_effect(r, task.clean[b:b + 1], drop_b, correct_ids=task.correct_ids[b:b + 1],
                                   incorrect_ids=task.incorrect_ids[b:b + 1]).ablated[0]
            want_b = (m_kb - m_none[b]) / (m_all[b] - m_none[b])
            assert abs(float(cs.per_prompt_curve[k, b]) - float(want_b)) <= 1e-4 * scale / float(
                (m_all[b] - m_none[b]).abs()), (k, b)


def test_a_component_listed_twice_is_refused_by_name(setup):
    """Found by the probe: a head listed twice is one head, and keeping one copy while the other is ablated ablated
    it (the circuit of ``k`` held fewer than ``k`` heads, without a word); refused before anything runs."""
    r, task = setup
    comps = [MHSAHead(0, 1), LorsaHead(LAYER, 2), MHSAHead(0, 1)]
    with pytest.raises(ConfigMismatchError, match=r"distinct: MHSAHead\(layer=0, head=1\) is listed at 0 and 2"):
        circuit_size(r, task, comps, scores=torch.ones(len(task), 3), ks=[1])
    with pytest.raises(ConfigMismatchError, match="distinct"):
        component_scores(r, task, comps)


def test_a_control_pool_with_a_target_listed_twice_is_refused_by_name(setup):
    """A draw of ``k`` from a pool with a repeat could ablate fewer than ``k`` targets: refused before any run."""
    from nnsight_lorsa.patching import random_ablation_control

    r, task = setup
    with pytest.raises(ConfigMismatchError, match=r"pool's targets must be distinct: MHSAHead\(layer=2, head=0\)"):
        random_ablation_control(r, task.clean, [MHSAHead(2, 0), MHSAHead(2, 1), MHSAHead(2, 0)], 2,
                                correct_ids=task.correct_ids, incorrect_ids=task.incorrect_ids)


@torch.no_grad()
@pytest.mark.parametrize("per_position", [False, True])
def test_mean_ablation_scores_are_ablation_effects_with_the_same_means(setup, per_position):
    """``component_scores(mode="mean")`` of MHSA and Lorsa heads = ``ablation_effect`` of each alone with the same
    means, also per position (``mean_activations(per_position=True)``: a Lorsa head's ``(pos,)`` mean was torch's
    ``RuntimeError: shape '[]' is invalid`` inside the trace); means of another length or width are the
    ``ShapeError`` ``ablation_effect`` names, before anything runs."""
    from nnsight_lorsa.envoy.nnsight_internals import hf_module
    from nnsight_lorsa.errors import ShapeError
    from nnsight_lorsa.patching import mean_activations

    r, task = setup
    comps = [MHSAHead(0, 1), MHSAHead(LAYER, 2), LorsaHead(LAYER, 5), LorsaHead(LAYER, 9)]
    means = mean_activations(r, comps, task.corrupt, per_position=per_position)
    got = component_scores(r, task, comps, mode="mean", means=means)
    kw = {"correct_ids": task.correct_ids, "incorrect_ids": task.incorrect_ids, "mode": "mean", "means": means}
    for i, c in enumerate(comps):
        ab = ablation_effect(r, task.clean, [c], **kw)
        want = ab.baseline - ab.ablated
        assert float((got[:, i] - want).abs().max()) <= 1e-5 * (float(ab.baseline.abs().max()) + 1.0), c
    assert float(got.abs().max()) > 1e-4  # the means move the metric: the scores are not all zero
    short = mean_activations(r, comps, task.corrupt[:, :4], per_position=True)
    calls: list = []
    handle = hf_module(r.model).get_input_embeddings().register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        for bad, match in ((short, "hold 4 positions"), ({**means, comps[0]: torch.zeros(17)}, "must end in head_dim")):
            with pytest.raises(ShapeError, match=match):
                circuit_size(r, task, comps, mode="mean", means=bad)
            with pytest.raises(ShapeError, match=match):
                component_scores(r, task, comps, mode="mean", means=bad)
    finally:
        handle.remove()
    assert calls == []  # refused before the model ran
