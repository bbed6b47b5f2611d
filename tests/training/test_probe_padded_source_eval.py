"""Training-step probe, part 2: what a training batch holds, and ``evaluate``'s numbers, on ragged right-padded windows.

Drawn datasets: windows ``[BOS] + real tokens + padding`` with a drawn real length per window (so rows of one batch
end at different positions) and a drawn pad id, ``target_mask`` marking the real tokens. The reference runs the
Hugging Face model with plain forward hooks on each window *cut to its real length* (no padding at all):

* ``ActivationSource`` (transcoder: MLP input → output; Lorsa: attention input → output, positions): at every
  real position the batch's ``x`` / ``y`` are the unpadded window's; ``loss_mask`` is exactly the real non-BOS
  positions;
* ``evaluate`` of a transcoder (each activation, ReLU / TopK / AbsTopK / GroupMax / JumpReLU): FVU, L0 and dead
  fraction over the real non-BOS tokens (a feature fires where non-zero), CE of the model / spliced / MLP
  zero-ablated over the predictions of real tokens, KL(orig ‖ spliced), CE recovered, token count.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import VOCAB, tiny_training_setup
from hypothesis import given, settings
from hypothesis import strategies as st

from nnsight_lorsa import TranscoderSet
from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig
from nnsight_lorsa.training import ActivationSource, TokenDataset, evaluate

LAYER = 1


@functools.lru_cache(maxsize=1)
def _setup():
    return tiny_training_setup()


@st.composite
def ragged(draw) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``(tokens, target_mask, lengths)``: windows of ``seq`` positions, ``lengths[w]`` real ones (BOS included)."""
    n, seq = draw(st.integers(2, 5)), draw(st.integers(3, 9))
    lengths = [draw(st.integers(2, seq)) for _ in range(n)]
    pad = draw(st.integers(1, VOCAB - 1))
    g = torch.Generator().manual_seed(draw(st.integers(0, 10_000)))
    tokens = torch.randint(2, VOCAB, (n, seq), generator=g)
    tokens[:, 0] = 0
    mask = torch.arange(seq)[None] < torch.tensor(lengths)[:, None]
    tokens[~mask] = pad
    return tokens, mask, lengths


def _hooked(hf, module, ids, replace=None):
    """``(logits, module input, module output)`` of ``hf`` on ``ids (batch, n)``; ``replace(x, out)``: the output
    used."""
    seen = {}

    def hook(m, args, kwargs, out):
        x = args[0] if args else kwargs["hidden_states"]
        seen["x"], seen["y"] = x, out[0] if isinstance(out, tuple) else out
        if replace is not None:
            new = replace(x, seen["y"])
            return (new, *out[1:]) if isinstance(out, tuple) else new
        return None

    h = module.register_forward_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            logits = hf(ids).logits
    finally:
        h.remove()
    return logits, seen["x"], seen["y"]


@settings(max_examples=6, deadline=None)
@given(data=ragged(), batch_size=st.integers(1, 3), seed=st.integers(0, 5), index=st.integers(0, 3))
def test_a_padded_batch_holds_the_unpadded_windows_activations(data, batch_size, seed, index):
    model, hf, adapter, _ = _setup()
    tokens, mask, lengths = data
    ds = TokenDataset(tokens, mask)
    for kind in ("transcoder", "attention"):
        if kind == "transcoder":
            source, module = ActivationSource.transcoder(model, LAYER, ds, batch_size=batch_size, seed=seed), \
                adapter.mlp_module(hf, LAYER)
        else:
            source, module = ActivationSource.attention(model, LAYER, ds, batch_size=batch_size, seed=seed), \
                adapter.attention_module(hf, LAYER)
        b = source(index)
        ids = source.window_ids(index)
        assert len(set(ids.tolist())) == len(ids) == min(batch_size, len(tokens))
        for row, w in enumerate(ids.tolist()):
            n = lengths[w]
            _, x, y = _hooked(hf, module, tokens[w, :n][None])
            torch.testing.assert_close(b.x[row, :n], x[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(b.y[row, :n], y[0], rtol=1e-5, atol=1e-5)
            want = [False] + [True] * (n - 1) + [False] * (tokens.shape[1] - n)
            assert b.loss_mask[row].tolist() == want, (kind, w, b.loss_mask[row].tolist())
            if kind == "attention":
                assert b.positions is not None
                pos = b.positions.reshape(-1, b.positions.shape[-1])  # (pos,), (1, pos) or (batch, pos)
                pos = pos[row if pos.shape[0] > 1 else 0]
                assert pos[:n].tolist() == list(range(n))


ACTS = [("relu", {}), ("topk", {"k": 5}), ("abstopk", {"k": 5}), ("groupmax", {"k": 8}),
        ("jumprelu", {"threshold": 0.2})]


def reference_evaluation(hf, adapter, tc, tokens, lengths):
    """The numbers of ``evaluate`` from forward hooks on each window cut to its real length."""
    mlp = adapter.mlp_module(hf, LAYER)
    ys, outs, acts = [], [], []
    ce = {"orig": 0.0, "spliced": 0.0, "zero": 0.0}
    kl, n_pred = 0.0, 0
    for w, n in enumerate(lengths):
        ids = tokens[w, :n][None]
        lo, x, y = _hooked(hf, mlp, ids)
        with torch.no_grad():
            ls, _, _ = _hooked(hf, mlp, ids, lambda x_, out: tc(x_))
            lz, _, _ = _hooked(hf, mlp, ids, lambda x_, out: torch.zeros_like(out))
            ys.append(y[0, 1:].double())
            outs.append(tc(x[0, 1:]).double())
            acts.append(tc.encode(x[0, 1:]))
        tgt = ids[0, 1:]
        for name, logits in (("orig", lo), ("spliced", ls), ("zero", lz)):
            ce[name] += float(torch.nn.functional.cross_entropy(logits[0, :-1].double(), tgt, reduction="sum"))
        lp, lq = lo[0, :-1].double().log_softmax(-1), ls[0, :-1].double().log_softmax(-1)
        kl += float((lp.exp() * (lp - lq)).sum())
        n_pred += n - 1
    y, out, a = torch.cat(ys), torch.cat(outs), torch.cat(acts)
    fired = a != 0
    return {"fvu": float((y - out).pow(2).sum() / (y - y.mean(0)).pow(2).sum()),
            "l0": float(fired.sum(-1).double().mean()), "dead_frac": float((~fired.any(0)).double().mean()),
            "ce_orig": ce["orig"] / n_pred, "ce_spliced": ce["spliced"] / n_pred, "ce_zero": ce["zero"] / n_pred,
            "kl": kl / n_pred, "n_tokens": n_pred}


@pytest.mark.parametrize(("activation", "params"), ACTS)
@settings(max_examples=3, deadline=None)
@given(data=ragged(), batch_size=st.integers(1, 4), tc_seed=st.integers(0, 100))
def test_evaluate_on_padded_windows_matches_the_unpadded_reference(activation, params, data, batch_size, tc_seed):
    model, hf, adapter, _ = _setup()
    tokens, mask, lengths = data
    torch.manual_seed(tc_seed)
    tc = Transcoder(TranscoderConfig(d_in=adapter.d_model, d_sae=32, activation=activation,
                                     activation_params=params)).eval()
    with torch.no_grad():
        tc.b_enc.normal_(0, 0.3)
        tc.b_dec.normal_(0, 0.1)
        tc.W_dec.mul_(0.5)
    ev = evaluate(TranscoderSet(model, {LAYER: tc}), TokenDataset(tokens, mask), at=LAYER, batch_size=batch_size)
    want = reference_evaluation(hf, adapter, tc, tokens, lengths)
    assert ev.n_tokens == want["n_tokens"]
    for name in ("fvu", "l0", "dead_frac", "ce_orig", "ce_spliced", "ce_zero", "kl"):
        got = getattr(ev, name)
        assert got == pytest.approx(want[name], rel=1e-4, abs=1e-6), (activation, name, got, want[name])
    # CE recovered from its parts (a small ce_zero − ce_orig makes it ill-conditioned: compared through them)
    assert ev.ce_recovered == pytest.approx((ev.ce_zero - ev.ce_spliced) / (ev.ce_zero - ev.ce_orig), rel=1e-12)


def test_evaluate_counts_negative_abstopk_features_as_firing_in_a_clt():
    """``evaluate``'s L0 / dead fraction counted a feature only where positive (its ``feature_density`` counted it
    where non-zero): an AbsTopK coder's negative features were missed — L0 3.0 instead of k = 5 above, and here a
    CLT's per-layer L0 2.13 / 2.62 / 2.47 instead of 5. Every token keeps exactly k non-zero features."""
    from nnsight_lorsa import CLTSet, CrossLayerTranscoder
    from nnsight_lorsa.modules.clt import CLTConfig

    model, hf, adapter, data = _setup()
    torch.manual_seed(0)
    clt = CrossLayerTranscoder(CLTConfig(d_in=adapter.d_model, d_sae=32, n_layers=adapter.n_layers,
                                         activation="abstopk", activation_params={"k": 5})).eval()
    ev = evaluate(CLTSet(model, clt), TokenDataset(data.tokens[:4]), batch_size=4)
    assert ev.l0 == [5.0] * adapter.n_layers, ev.l0
