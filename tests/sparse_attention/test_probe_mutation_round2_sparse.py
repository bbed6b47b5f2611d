"""Sparse-attention tests added by the second mutation probe (docs/reliability.md, "Mutation probe, round 2"): each
kills a mutant of ``sparse_attention/`` or ``modules/attention_gate.py`` that the sparse-attention tests let pass.
References in plain torch from the paper's formula (Draye et al. 2025, Eq. 1-3)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nnsight_lorsa.modules.attention_gate import AttentionGate
from nnsight_lorsa.sparse_attention.attention import gated_attention_forward


class _Attention(nn.Module):
    def __init__(self, heads: int, bias: float) -> None:
        super().__init__()
        self.gate = AttentionGate(heads, init_bias=bias)
        self.is_causal = True


@pytest.mark.parametrize(("q_len", "k_len"), [(6, 6), (2, 7), (1, 4)])
def test_gated_attention_without_a_mask_is_causal_from_the_cached_keys_on(q_len, k_len):
    """``attention_mask=None`` (the documented plain causal case): query ``i`` of ``q_len`` is position
    ``k_len − q_len + i`` of the ``k_len`` keys (prefill, and decoding after a cache) and sees the keys up to
    itself, itself included; output ``(A ⊙ softmax(QKᵀ·s)) V`` against a plain-torch reference (mutants: the
    diagonal masked; the queries taken as positions ``0..q_len−1``)."""
    g = torch.Generator().manual_seed(0)
    b, h, d = 2, 3, 8
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=torch.float64) for n in (q_len, k_len, k_len))
    module = _Attention(h, bias=0.3).double().eval()
    with torch.no_grad():
        module.gate.bias.copy_(torch.tensor([0.3, -0.2, 0.1]))
        out, weights = gated_attention_forward(module, q, k, v, None, scaling=0.4)
    scores = q @ k.transpose(-1, -2) * 0.4
    allowed = torch.arange(k_len)[None, :] <= torch.arange(k_len - q_len, k_len)[:, None]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    gate = ((scores + module.gate.bias.detach()[None, :, None, None]) > 0) & allowed
    want = gate * probs
    assert 0 < int(gate.sum()) < int(allowed.sum()) * b * h  # some edges open, some closed
    # the softmax runs in fp32 (as transformers' eager attention), so fp32's rounding bounds the agreement
    assert float((weights - want).abs().max()) <= 1e-6
    assert float((out - (want @ v).transpose(1, 2)).abs().max()) <= 1e-6 * float(v.abs().max())
    assert torch.equal(module.gate.possible_edges, allowed.sum().double().expand(h).float() * b)


def test_the_gate_is_called_with_the_scaled_scores_not_the_masked_logits():
    """The gate's input (its ``.input`` under nnsight) is ``q·kᵀ·scaling`` at every entry, the masked ones included,
    as documented; with a padding mask the gate matrix and the output are the plain-torch ones (mutant: the gate
    called with the scores plus the additive mask, ``≈ −3.4e38`` at the masked entries)."""
    g = torch.Generator().manual_seed(1)
    b, h, n, d = 2, 2, 5, 4
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None, None].repeat(b, 1, 1, 1)
    allowed[1, :, :, 0] = False  # the second row's first key is padding (left),
    allowed[1, :, :, n - 1] = False  # and its last (right: that query row sees real keys but is padding itself)
    mask = torch.zeros(b, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = _Attention(h, bias=0.0).eval()
    seen = {}
    handle = module.gate.register_forward_hook(lambda m, a, o: seen.update(scores=a[0].detach()))
    try:
        with torch.no_grad():
            _, weights = gated_attention_forward(module, q, k, v, mask, scaling=0.5)
    finally:
        handle.remove()
    scores = q @ k.transpose(-1, -2) * 0.5
    assert float((seen["scores"] - scores).abs().max()) <= 1e-6 * float(scores.abs().max())
    # a padded query row (its own key masked) sees no key: the mask's minimum, not -inf (no NaN); its gate is 0
    probs = scores.masked_fill(~allowed, torch.finfo(torch.float32).min).softmax(-1)
    open_ = (scores > 0) & allowed
    want = open_ * probs
    assert float((weights - want).abs().max()) <= 1e-6
    # the statistics count the real query rows only (own key allowed): the right padding's row is left out
    # (mutant: active edges counted on every allowed edge)
    counted = (allowed & allowed.diagonal(dim1=-2, dim2=-1)[..., None]).expand(b, h, n, n)
    assert bool((open_ & allowed & ~counted).any())  # not vacuous
    assert torch.equal(module.gate.active_edges, (open_ & counted).sum(dim=(0, 2, 3)).float())
    assert torch.equal(module.gate.possible_edges, counted.sum(dim=(0, 2, 3)).float())


def test_the_default_scaling_is_one_over_root_head_dim():
    """``scaling=None`` is ``d ** -0.5`` of the head size ``d`` (mutant: of the number of keys)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, n, 9, generator=g) for n in (3, 5, 5))
    module = _Attention(2, bias=30.0).eval()
    with torch.no_grad():
        out, weights = gated_attention_forward(module, q, k, v, None)
        want_out, want = gated_attention_forward(module, q, k, v, None, scaling=9 ** -0.5)
    assert torch.equal(weights, want) and torch.equal(out, want_out)


def test_the_eval_gate_is_closed_on_a_zero_logit():
    """Evaluation: ``A = [scores + b > 0]``, closed where the logit is exactly 0 (mutant: ``>= 0``)."""
    gate = AttentionGate(2, init_bias=0.0).eval()
    with torch.no_grad():
        gate.bias.copy_(torch.tensor([0.5, -0.25]))
    scores = torch.tensor([-0.5, 0.25, 1.0, -1.0]).repeat(1, 2, 4, 1)  # a zero logit in each head
    valid = torch.ones(4, 4, dtype=torch.bool)
    with torch.no_grad():
        got = gate(scores, valid)
    want = (scores + gate.bias.detach()[None, :, None, None] > 0).float()
    assert torch.equal(got, want) and int(got.sum()) == 12


@pytest.mark.parametrize("temperature", [0.25, 3.0])
def test_the_training_gate_backward_is_the_tempered_sigmoid_of_the_noisy_logit(temperature):
    """Training: forward ``[l + L > 0]``, backward ``σ((l + L) / T)``'s derivative, with ``L = log u − log(1 − u)``
    of the gate's own uniform draw (replayed from the seed): ``∂A/∂s = σ'((l + L)/T) / T`` (mutant: ``(l + L)·T``,
    the same at the tests' ``T = 1``)."""
    gate = AttentionGate(3, init_bias=0.2, temperature=temperature).train()
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(2, 3, 4, 4, generator=g, requires_grad=True)
    valid = torch.ones(4, 4, dtype=torch.bool).tril()
    torch.manual_seed(7)
    out = gate(scores, valid)
    out.sum().backward()
    torch.manual_seed(7)
    u = torch.rand_like(scores).clamp(1e-6, 1.0 - 1e-6)
    noisy = scores.detach() + 0.2 + torch.log(u) - torch.log1p(-u)
    soft = torch.sigmoid(noisy / temperature)
    assert torch.equal(out.detach(), ((noisy > 0) & valid).float())
    want = torch.where(valid, soft * (1 - soft) / temperature, 0.0)
    assert float((scores.grad - want).abs().max()) <= 1e-6 * float(want.abs().max())


def test_decoding_counts_the_query_rows_whose_own_key_is_real():
    """After a cache (2 queries, positions 3 and 4, of 5 keys; key 0 left padding) both query rows are real and
    count their allowed edges: 3 + 4 (mutant: a row's own key read at ``arange(q)``, i.e. key 0, the padding)."""
    gate = AttentionGate(1, init_bias=1.0).eval()
    valid = torch.arange(5)[None, :] <= torch.tensor([3, 4])[:, None]
    valid[:, 0] = False
    with torch.no_grad():
        gate(torch.zeros(1, 1, 2, 5), valid[None, None])
    assert gate.possible_edges.tolist() == [7.0]
    assert float(gate.expected_edges) == pytest.approx(7 * float(torch.sigmoid(torch.tensor(1.0))), rel=1e-6)


def test_the_expected_edge_fraction_is_the_mean_gate_probability_over_the_causal_edges():
    """``expected_edge_fraction`` (the training's sparsity term): ``Σ σ(s + b) / #allowed`` over every layer, head
    and causal edge of the last forward, from the scores each gate got, by hand (mutant: not divided by the number
    of allowed edges — a term hundreds of times larger than the paper's ``E|A|`` fraction)."""
    from helpers import random_ids, tiny_hf_model

    from nnsight_lorsa.sparse_attention import install_gated_attention
    from nnsight_lorsa.sparse_attention.install import expected_edge_fraction

    hf = tiny_hf_model("llama")
    gates = install_gated_attention(hf, init_bias=0.5)
    seen = []
    hooks = [gate.register_forward_hook(lambda m, a, o: seen.append((a[0].detach(), m.bias.detach())))
             for gate in gates.values()]
    ids = random_ids(2, 6, seed=4)
    try:
        hf.train()
        hf(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
        hf.eval()
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    num = sum(float(torch.sigmoid(s.float() + b[None, :, None, None]).masked_fill(~causal, 0).sum()) for s, b in seen)
    den = sum(int(causal.sum()) * s.shape[0] * s.shape[1] for s, _ in seen)
    got = expected_edge_fraction(hf)
    assert got.requires_grad
    assert 0 < float(got.detach()) < 1 and float(got.detach()) == pytest.approx(num / den, rel=1e-6)
