"""``circuit_size``'s recovered fraction and ``relative_effect`` over a zero or rounding-sized denominator
(docs/reliability.md, "Number tasks and rounding-sized gaps probe (2026-11-27)"): the rule and the error of
``normalized`` (``metrics.check_gap``, ``UndefinedNormalizationError``), against the formulas in float64."""

from __future__ import annotations

import random
import re

import pytest
import torch
from helpers import LAYER, N_HEADS, N_LAYERS, generated, make_lorsa, tiny_nnsight
from hypothesis import strategies as st

from nnsight_lorsa import LorsaSet, get_adapter
from nnsight_lorsa.errors import ArgumentError, UndefinedNormalizationError
from nnsight_lorsa.patching import MHSAHead, ReplacementModel, ablation_effect, relative_effect
from nnsight_lorsa.patching.circuit import circuit_size
from nnsight_lorsa.patching.tasks import induction_task

EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def setup():
    model, hf = tiny_nnsight("llama")
    r = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: make_lorsa(hf, get_adapter(model))}))
    task = induction_task(model.tokenizer, n_prompts=3, seq_len=6, seed=0)
    return r, task, [MHSAHead(layer, h) for layer in range(N_LAYERS) for h in range(N_HEADS)]


@torch.no_grad()
def test_a_rounding_sized_gap_is_refused_not_reported_as_fractions(setup):
    """Seen failing: a metric that the components move only within fp32's rounding (``1000 + 1e-4 · logit``: steps of
    6e-5 at 1000) gave ``per_prompt_curve`` values of rounding noise and a ``per_prompt_k`` from them, with no word
    (only ``m_all == m_0`` exactly warned)."""
    r, task, heads = setup
    c = task.correct_ids

    def metric(lg):
        return 1000.0 + 1e-4 * lg[torch.arange(len(c)), -1, c.to(lg.device)].float()

    with pytest.raises(UndefinedNormalizationError, match=r"circuit_size: m_all \(every .* rows \[0, 1, 2\]"):
        circuit_size(r, task, heads, metric=metric, ks=[0, 3])


@torch.no_grad()
def test_a_prompt_whose_metric_does_not_move_is_refused_naming_it(setup):
    """Equal correct and incorrect ids (a logit difference of 0 whatever is kept): the prompt is named by the error
    (until 2026-11-27 a warning and a NaN curve, ``per_prompt_k = n``)."""
    r, task, heads = setup
    bad = task.select([0, 1, 2])
    bad.incorrect_ids[1] = bad.correct_ids[1]
    with pytest.raises(UndefinedNormalizationError, match=r"rows \[1\] \(0 vs 0\)"):
        circuit_size(r, bad, heads, ks=[0, 3])
    cs = circuit_size(r, bad.select([0, 2]), heads, ks=[0, 3])  # the advice: drop the prompt
    assert not cs.per_prompt_curve.isnan().any()


def test_relative_effect_refuses_a_zero_or_rounding_sized_baseline():
    """Seen failing: ``relative_effect(0, 1)`` was ``-inf``, ``(0, 0)`` NaN, a baseline one ulp of the intervened
    value's scale ``-8388607``."""
    for base, new in ((0.0, 1.0), (0.0, 0.0), (torch.tensor([2.0, 0.0]), torch.tensor([1.0, 3.0])),
                      (1e3 * EPS, 1e3)):
        with pytest.raises(UndefinedNormalizationError, match="relative_effect: the baseline and 0 are equal"):
            relative_effect(base, new)
    torch.testing.assert_close(relative_effect(torch.tensor([2.0, -4.0]), 1.0), torch.tensor([0.5, 1.25]))


def test_relative_effect_takes_the_rounding_of_the_logits_dtype(setup):
    """Seen failing: the rule always used fp32's eps, so a bf16 model's baseline of 1/64 of the ablated metric (below
    bf16's rounding at that scale) gave a relative effect of -63 from noise. Now ``rounding`` (default the inputs'
    dtype's eps), which ``ablation_effect`` / ``random_ablation_control`` / ``PathPatchingResult`` set from the
    logits' dtype (``metrics.metric_rounding``: at least fp32's, the metrics' own dtype, for an fp64 model)."""
    from nnsight_lorsa.patching.experiments import AblationResult, RandomControl
    bf16 = torch.finfo(torch.bfloat16).eps
    base, new = torch.tensor([1 / 64, 1.0]), torch.tensor([1.0, 0.5])
    torch.testing.assert_close(relative_effect(base, new), (base - new) / base)  # fp32: defined
    for call in (lambda: relative_effect(base.bfloat16(), new.bfloat16()),
                 lambda: relative_effect(base, new, rounding=bf16),
                 lambda: AblationResult(base, new, bf16).relative,
                 lambda: RandomControl(base[:1], new[None, :1], [()], bf16).relative):
        with pytest.raises(UndefinedNormalizationError, match=r"relative_effect: .* rows \[0\]"):
            call()
    with pytest.raises(ArgumentError, match="rounding must be a number in"):
        relative_effect(base, new, rounding=float("nan"))
    r, task, heads = setup
    for dtype, want in ((torch.bfloat16, bf16), (torch.float64, EPS)):  # fp64 logits: the metrics are fp32 still
        r.model.to(dtype)
        try:
            res = ablation_effect(r, task.clean, heads[:1], correct_ids=task.correct_ids,
                                  incorrect_ids=task.incorrect_ids)
        finally:
            r.model.to(torch.float32)
        assert res.rounding == want, dtype


@generated(40, 2000, seed=st.integers(0, 2**31 - 1))
def test_generated_relative_effects_are_the_formula_or_refused(seed):
    """Baselines from exactly 0 through a few rounding units to 10³ × the intervened values' scale, fp32 / bf16 /
    fp16 tensors or floats: the formula in float64 (relative 1e-5) where ``|b| > 4 · eps · max(|b|, |i|)`` (``eps``:
    the tensors' dtype's, fp32's for floats), else the error naming exactly those elements."""
    rng = random.Random(seed)
    n = rng.randint(1, 5)
    scale = 10 ** rng.uniform(-3, 4)
    inter = torch.tensor([rng.uniform(-1, 1) * scale for _ in range(n)], dtype=torch.float64)
    base = torch.tensor([rng.choice([0.0, rng.randint(-6, 6) * EPS * scale,
                                     rng.uniform(-1, 1) * scale * 10 ** rng.uniform(-3, 3)]) for _ in range(n)],
                        dtype=torch.float64)
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
    b, i = base.to(dtype), inter.to(dtype)
    if dtype == torch.float16:
        b, i = b.clamp(-6e4, 6e4), i.clamp(-6e4, 6e4)
    bd, id_ = b.double(), i.double()
    bf, if_ = bd.float().double(), id_.float().double()
    args = (b, i) if rng.random() < 0.7 or n > 1 else (float(b[0]), float(i[0]))
    eps = torch.finfo(dtype).eps if isinstance(args[0], torch.Tensor) else EPS
    flat = [k for k in range(n) if abs(float(bf[k])) <= 4 * eps * max(abs(float(bf[k])), abs(float(if_[k])))]
    if flat:
        with pytest.raises(UndefinedNormalizationError, match=re.escape(f"rows {flat}")):
            relative_effect(*args)
        return
    got = relative_effect(*args).double()
    torch.testing.assert_close(got.reshape(-1), ((bf - if_) / bf).reshape(-1)[:got.numel()], rtol=1e-5, atol=0)
