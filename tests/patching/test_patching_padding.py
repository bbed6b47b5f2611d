"""Padded batches in the patching experiments: every result equals the prompts run one by one, or is refused.

nnsight pads the prompts of one trace (token-id lists or texts of different lengths) on the left for a causal
model; a dict input may carry its own (right-padded) ``attention_mask``. A padded position is no token of its
row: means over it, patching between batches padded differently, edits at it and a metric read there were
silent wrong results (docs/reliability.md, "Batches, padding, invokes, generation").

Reference: each prompt alone (no padding), the same experiment; the spec for refusals is written here, from
the lengths, independently of the code.
"""

from __future__ import annotations

import nnsight
import pytest
import torch
from helpers import VOCAB, make_lorsa, make_transcoder, tiny_nnsight, unembed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnsight_lorsa import LorsaSet, TranscoderSet, get_adapter
from nnsight_lorsa.errors import ArgumentError, TraceOrderError
from nnsight_lorsa.patching import (
    Feature,
    LorsaHead,
    MHSAHead,
    ReplacementModel,
    ablate,
    ablation_effect,
    activation_patching,
    head_swap,
    mean_activations,
    padding_mask,
    path_patching,
    read,
)

LAYER = 1
TARGETS = [MHSAHead(0, 1), LorsaHead(LAYER, 5), Feature(LAYER, 3, kind="transcoder")]


@pytest.fixture(scope="module")
def setup():
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    r = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: make_lorsa(hf, adapter, LAYER)}),
                         transcoders=TranscoderSet(model, {LAYER: make_transcoder()}))
    return model, r


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[0, *torch.randint(2, VOCAB, (n - 1,), generator=g).tolist()] for n in lengths]


IDS = dict(correct_ids=torch.tensor([5, 6, 7]), incorrect_ids=torch.tensor([8, 9, 10]))


def row(ids: dict, i: int) -> dict:
    return {k: v[i:i + 1] for k, v in ids.items()}


@torch.no_grad()
def test_means_over_padded_prompts_are_over_their_tokens(setup):
    _, r = setup
    ps = prompts([9, 5, 7], seed=21)
    means = mean_activations(r, TARGETS, ps)
    alone = [mean_activations(r, TARGETS, [p], per_position=True) for p in ps]
    for t in TARGETS:
        want = torch.cat([a[t] for a in alone]).mean(0)  # every token of every prompt, once
        assert torch.allclose(means[t], want, rtol=1e-5, atol=1e-7), t  # was 22% off: pads averaged in
    with pytest.raises(ArgumentError, match=r"per_position=True.*rows \[1, 2\]"):
        mean_activations(r, TARGETS, ps, per_position=True)


@torch.no_grad()
def test_patching_between_prompts_padded_differently_is_refused(setup):
    _, r = setup
    clean, corrupt = prompts([9, 5, 7], seed=21), prompts([7, 9, 5], seed=22)
    with pytest.raises(ArgumentError, match=r"activation_patching: the clean and corrupt prompts are padded "
                                            r"differently \(rows \[0, 1, 2\]\)"):
        activation_patching(r, clean, corrupt, TARGETS, **IDS)
    with pytest.raises(ArgumentError, match=r"path_patching: the clean and corrupt prompts are padded differently"):
        path_patching(r, clean, [MHSAHead(0, 1)], corrupt=corrupt, **IDS)


@torch.no_grad()
def test_patching_padded_alike_equals_each_pair_alone(setup):
    _, r = setup
    clean, corrupt = prompts([9, 5, 7], seed=21), prompts([9, 5, 7], seed=23)
    ap = activation_patching(r, clean, corrupt, TARGETS, **IDS)
    pp = path_patching(r, clean, [MHSAHead(0, 1)], corrupt=corrupt, **IDS)
    for i in range(3):
        one = activation_patching(r, clean[i:i + 1], corrupt[i:i + 1], TARGETS, **row(IDS, i))
        assert torch.allclose(ap.patched[:, i], one.patched[:, 0], atol=1e-5)
        assert torch.allclose(ap.clean[i], one.clean[0], atol=1e-5)
        one_pp = path_patching(r, clean[i:i + 1], [MHSAHead(0, 1)], corrupt=corrupt[i:i + 1], **row(IDS, i))
        assert torch.allclose(pp.effect[:, i], one_pp.effect[:, 0], atol=1e-5)


@torch.no_grad()
def test_the_default_metric_on_right_padding_is_refused(setup):
    _, r = setup
    ps = prompts([9, 5, 7], seed=21)
    ids = torch.ones(3, 9, dtype=torch.long)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for i, p in enumerate(ps):  # right padding, given as a dict
        ids[i, :len(p)] = torch.tensor(p)
        mask[i, :len(p)] = 1
    right = {"input_ids": ids, "attention_mask": mask}
    with pytest.raises(ArgumentError, match=r"the metric .*position\(s\) -1 are padding in rows \[1, 2\]"):
        ablation_effect(r, right, TARGETS, **IDS)  # read the pads' logits (row 1: -0.088 for 0.210 alone)
    with pytest.raises(ArgumentError, match=r"the metric .*padding in rows \[1, 2\]"):
        path_patching(r, right, [MHSAHead(0, 1)], mode="zero", **IDS)
    own = ablation_effect(r, right, TARGETS, metric=lambda logits: logits[:, 0, 0])  # a metric of one's own: as is
    assert own.baseline.shape == (3,)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(2, 7), min_size=1, max_size=3), data=st.data())
@torch.no_grad()
def test_positions_at_padding_are_refused(setup, lengths, data):
    """Spec: left padding to n = max(lengths); column p (negative: n + p) is a pad of row i iff p < n − len_i."""
    model, r = setup
    n = max(lengths)
    pos = data.draw(st.integers(-n, n - 1), label="position")
    padded_rows = [i for i, length in enumerate(lengths) if (pos % n) < n - length]
    ps = prompts(lengths, seed=len(lengths) * 10 + n)
    target = MHSAHead(1, 2)

    def run():
        with model.trace(ps):
            mask = nnsight.save(padding_mask(model))
            value = read(r(target), positions=pos)
            ablate(r(target), positions=pos)
            out = unembed(model).output.save()
        return mask, value, out

    if padded_rows:
        with pytest.raises(ArgumentError, match=rf"position\(s\) {pos} are padding in rows \[{padded_rows[0]}"):
            run()
        with pytest.raises(ArgumentError, match=r"padding in rows"):
            ablation_effect(r, ps, [target], positions=pos, **{k: v[:len(ps)] for k, v in IDS.items()})
        return
    mask, value, out = run()
    assert (mask is None) == (len(set(lengths)) == 1)
    assert value.shape == (len(ps), 16) and torch.isfinite(out).all()  # an int position: no position axis


@torch.no_grad()
def test_head_swap_at_a_padded_position_is_refused(setup):
    _, r = setup
    ps = prompts([6, 3], seed=5)
    base, swapped = head_swap(r, LAYER, 5, 6, ps, positions=-1)  # the last token of every row: fine
    assert base.shape == swapped.shape == (2, 6, VOCAB)
    with pytest.raises(ArgumentError, match=r"position\(s\) 1 are padding in rows \[1\]"):
        head_swap(r, LAYER, 5, 6, ps, positions=1)


@torch.no_grad()
def test_padding_mask_comes_first_in_the_body(setup):
    model, r = setup
    ps = prompts([6, 3], seed=5)
    with pytest.raises(TraceOrderError, match="padding_mask"), model.trace(ps):
        model.model.layers[0].output.save()
        padding_mask(model)
    with pytest.raises(TraceOrderError, match="padding_mask"):
        padding_mask(model)  # outside a trace


@torch.no_grad()
def test_prepare_first_in_the_body_arms_the_check(setup):
    """``r.prepare(targets)`` at the top of the body (the documented pattern) reads the mask itself."""
    model, r = setup
    ps = prompts([6, 3], seed=5)
    target = LorsaHead(LAYER, 5)
    with pytest.raises(ArgumentError, match=r"position\(s\) \[0, -1\] are padding in rows \[1\]"), model.trace(ps):
        r.prepare([target])
        ablate(r(target), positions=[0, -1])
    with model.trace(ps):  # every row's last token: fine
        r.prepare([target])
        ablate(r(target), positions=-1)
        out = unembed(model).output.save()
    assert torch.isfinite(out).all()
    with model.trace(ps):  # prepare after the model ran past its inputs: unchecked, as before
        model.model.layers[0].output.save()
        r.prepare([target])
        ablate(r(target), positions=0)


@torch.no_grad()
@pytest.mark.parametrize("target", TARGETS, ids=str)
def test_a_cached_generation_step_takes_position_0_of_a_padded_batch(setup, target):
    """In ``model.generate`` over a left-padded batch, a cached step's positions are the rows' new tokens: an edit at
    ``positions=0`` there is the edit at ``-1`` (the same, only, position). It was refused with the prompt's mask
    (``position(s) 0 are padding in rows [1, 2]``); at the prompt's step (step 0) it still is."""
    model, r = setup
    ps = prompts([9, 4, 7], seed=5)
    gen = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=1)

    def run(position: int):
        with model.generate(ps, **gen) as tracer:
            r.prepare([target])
            for step in tracer.iter[:3]:
                if step >= 1:
                    ablate(r(target), positions=position)
                    read(r(target))  # the step's value, after the edit
            out = nnsight.save(tracer.result)
        return out

    first, last = run(0), run(-1)
    assert torch.equal(first, last)
    with pytest.raises(ArgumentError, match=r"position\(s\) 0 are padding in rows \[1, 2\]"), \
            model.generate(ps, **gen):
        r.prepare([target])
        ablate(r(target), positions=0)
