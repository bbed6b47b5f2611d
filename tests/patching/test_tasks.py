"""Task builders (tokenizer-aware, fail clearly) and circuit size (Draye et al. 2025 §4.2) vs a manual keep-only run."""

from __future__ import annotations

import pytest
import torch
from helpers import LAYER, N_HEADS, N_LAYERS, make_lorsa, tiny_nnsight, tiny_tokenizer

from nnsight_lorsa import LorsaSet, get_adapter
from nnsight_lorsa.envoy import load_model
from nnsight_lorsa.errors import UndefinedNormalizationError
from nnsight_lorsa.patching import LorsaHead, MHSAHead, ReplacementModel, TargetIndexError
from nnsight_lorsa.patching.circuit import circuit_size, component_scores
from nnsight_lorsa.patching.experiments import ablation_effect
from nnsight_lorsa.patching.tasks import (
    TaskTokenizationError,
    arithmetic_grid,
    arithmetic_task,
    greater_than_task,
    induction_task,
    ioi_task,
)


@pytest.fixture(scope="module")
def shakespeare_tok():
    return load_model().tokenizer


def test_induction_structure():
    tok = tiny_tokenizer()
    t = induction_task(tok, n_prompts=3, seq_len=6, seed=1)
    assert t.clean.shape == t.corrupt.shape == (3, 12)
    assert (t.clean[:, 0] == tok.bos_token_id).all()
    assert torch.equal(t.clean[:, 1:6], t.clean[:, 7:])          # second half repeats the first
    assert torch.equal(t.corrupt[:, 7:], t.clean[:, 7:])         # same tail, nothing to copy from
    assert torch.equal(t.correct_ids, t.clean[:, 6])
    assert not (t.correct_ids == t.incorrect_ids).any()
    with pytest.raises(TaskTokenizationError):
        induction_task(tok, seq_len=10, token_pool=[5, 6, 7])


def test_templates_fail_clearly_on_a_tokenizer_without_names():
    tok = tiny_tokenizer()                                       # word-level "w2 … w127": no names
    with pytest.raises(TaskTokenizationError, match="single-token names"):
        ioi_task(tok)
    with pytest.raises(TaskTokenizationError):
        arithmetic_task(tok, pairs=[(12, 34)])


def test_tasks_on_the_tinyshakespeare_bpe(shakespeare_tok):
    tok = shakespeare_tok
    ioi = ioi_task(tok, n_prompts=4)
    assert ioi.clean.shape == ioi.corrupt.shape
    for row, m in zip(ioi.clean, ioi.meta, strict=True):
        text = tok.decode(row[1:])
        assert text == m["text"] and text.count(m["s"].strip()) == 2 and text.count(m["io"].strip()) == 1
    assert tok.decode(ioi.correct_ids[:1]).strip() == ioi.meta[0]["io"].strip()
    gt = greater_than_task(tok, n_prompts=4)                      # digit tokenizer: final-digit form
    for row, c, i in zip(gt.clean, gt.correct_ids, gt.incorrect_ids, strict=True):
        y = int(tok.decode(row)[-8])                              # "... 1377 to 137": the start year's last digit
        assert int(tok.decode([int(c)])) == y + 1 and int(tok.decode([int(i)])) == y - 1
    ar = arithmetic_task(tok, pairs=[(36, 62), (59, 63)])
    assert tok.decode(ar.correct_ids).replace(" ", "") == "91"   # first digits of 98 and 122
    grid = arithmetic_grid(tok, operands=range(12))
    assert sum(len(g[1]) for g in grid.groups) == 144
    vals = [a.float() * 100 + b for _, a, b in grid.groups]
    g = grid.assemble(vals)
    assert g.shape == (12, 12) and g[3, 7] == 307 and not g.isnan().any()


def test_ioi_orders_and_greater_than_years(shakespeare_tok):
    """IOI in both of Wang et al.'s patterns (the IO named first or second); greater-than from chosen
    start years; bad values raise before anything is built."""
    from nnsight_lorsa.errors import ConfigMismatchError

    tok = shakespeare_tok
    mixed = ioi_task(tok, n_prompts=6, order="mixed", seed=2)
    for m in mixed.meta:
        io, s = m["io"].strip(), m["s"].strip()
        first = m["text"].index(io) < m["text"].index(s)
        assert first == (m["order"] == "ABBA") and m["text"].count(s) == 2
    assert [m["order"] for m in mixed.meta] == ["BABA", "ABBA"] * 3
    assert all(m["order"] == "ABBA" for m in ioi_task(tok, n_prompts=3, order="ABBA").meta)
    with pytest.raises(ConfigMismatchError, match="order"):
        ioi_task(tok, order="AABB")
    gt = greater_than_task(tok, n_prompts=8, years=[23, 57])          # final-digit form: decade, digit
    assert {m["text"].split("year ")[1][:4] for m in gt.meta} <= {"1323", "1357"}
    with pytest.raises(ConfigMismatchError, match="years"):
        greater_than_task(tok, years=[40])                             # last digit 0: no "one less" digit
    with pytest.raises(ConfigMismatchError, match="years"):
        greater_than_task(tok, years=[])


@torch.no_grad()
def test_circuit_size_matches_manual_keep_only():
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsa = LorsaSet(model, {LAYER: make_lorsa(hf, adapter)})
    r = ReplacementModel(model, lorsas=lorsa)
    task = induction_task(model.tokenizer, n_prompts=3, seq_len=6, seed=0)
    heads = [MHSAHead(layer, h) for layer in range(N_LAYERS) for h in range(N_HEADS)]
    cs = circuit_size(r, task, heads)
    n = len(heads)
    assert cs.ks[0] == 0 and cs.ks[-1] == n
    torch.testing.assert_close(cs.per_prompt_curve[0], torch.zeros(3))
    torch.testing.assert_close(cs.per_prompt_curve[-1], torch.ones(3))
    assert ((cs.per_prompt_k >= 0) & (cs.per_prompt_k <= n)).all()
    # scores = single-head ablation effects
    ab = ablation_effect(r, task.clean, [heads[5]], correct_ids=task.correct_ids, incorrect_ids=task.incorrect_ids)
    torch.testing.assert_close(cs.scores[:, 5], ab.baseline - ab.ablated, atol=1e-4, rtol=1e-4)
    # the global curve at k = 3: ablate all but the global top 3 with the existing API
    k_i = int((cs.ks == 3).nonzero())
    top = set(cs.scores.mean(0).argsort(descending=True)[:3].tolist())
    rest = [h for i, h in enumerate(heads) if i not in top]
    kw = {"correct_ids": task.correct_ids, "incorrect_ids": task.incorrect_ids}
    m3 = ablation_effect(r, task.clean, rest, **kw).ablated.mean()
    m0 = ablation_effect(r, task.clean, heads, **kw).ablated.mean()
    m_all = ablation_effect(r, task.clean, heads[:1], **kw).baseline.mean()
    torch.testing.assert_close(cs.global_curve[k_i], (m3 - m0) / (m_all - m0), atol=1e-4, rtol=1e-4)
    want_k = int(cs.ks[(cs.global_curve >= 0.9).nonzero()[0]])
    assert cs.global_k == want_k and len(cs.global_circuit()) == want_k
    # Lorsa heads as components: inactive heads score 0 without running; bad heads raise first
    lheads = [LorsaHead(LAYER, h) for h in range(lorsa[LAYER].cfg.n_ov_heads)]
    sc = component_scores(r, task, lheads)
    assert sc.shape == (3, len(lheads)) and (sc != 0).any()
    with pytest.raises(TargetIndexError):
        circuit_size(r, task, [LorsaHead(LAYER, 10_000)])


@torch.no_grad()
def test_circuit_size_refuses_a_prompt_whose_metric_does_not_move():
    """A prompt whose correct and incorrect ids are the same has a logit difference of 0 with any components kept:
    its recovered fraction is 0/0. It used to come back as ``per_prompt_k = n`` with no word, then with a warning and
    a NaN curve; now ``UndefinedNormalizationError`` names the prompt, as ``normalized`` does (the rule of
    ``metrics.check_gap``; ``tests/patching/test_probe_rounding_gaps.py``)."""
    model, hf = tiny_nnsight("llama")
    r = ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: make_lorsa(hf, get_adapter(model))}))
    task = induction_task(model.tokenizer, n_prompts=3, seq_len=6, seed=0)
    task.incorrect_ids[1] = task.correct_ids[1]
    heads = [MHSAHead(layer, h) for layer in range(N_LAYERS) for h in range(N_HEADS)]
    with pytest.raises(UndefinedNormalizationError, match=r"circuit_size: m_all \(every .* rows \[1\]"):
        circuit_size(r, task, heads)
