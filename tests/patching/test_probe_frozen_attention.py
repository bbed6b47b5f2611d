"""Probe of frozen attention (independent review): several invokes, a skipped attention and an SAE splice against the
pattern-holding Hugging Face reference; gradients through a frozen trace (refused)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_sae, pattern_held_logits, random_ids, tiny_nnsight

from nnsight_lorsa import ReplacementModel, SAESet, get_adapter
from nnsight_lorsa.errors import ArgumentError
from nnsight_lorsa.patching import Feature, MHSAHead, ablate, freeze_attention

H = 1


held = pattern_held_logits


def zero_head(hf, st, rows, pos, d):
    def f(module, args):
        if not st["record"]:
            z = args[0].clone()
            z[rows, pos, H * d:(H + 1) * d] = 0
            return (z, *args[1:])
    return hf.model.layers[0].self_attn.o_proj.register_forward_pre_hook(f)


def rel(a, b, mask=None):
    d = (a.double() - b.double()).abs()
    if mask is not None:
        d = d.amax(-1)[mask]
    return float(d.max() / b.abs().max())


def test_several_invokes_frozen_from_the_second_match_the_reference(monkeypatch):
    model, hf = tiny_nnsight("qwen3")
    adapter = get_adapter(model)
    rm = ReplacementModel(model)
    p1, p2, p3 = [0, 5, 6, 7, 8, 9, 10, 11, 40, 41], [0, 11, 12, 13, 14, 15], [0, 30, 31, 32, 33, 34, 35, 36]
    record = freeze_attention(rm, [p1, p2, p3])
    t = MHSAHead(0, H)

    def run(frozen):
        with torch.no_grad(), model.trace() as tracer:
            with tracer.invoke([p1]):
                pass
            with tracer.invoke([p2, p3]):
                rm.prepare([t], frozen=frozen)
                ablate(rm(t), positions=[-2])
            with tracer.invoke():
                out = model.lm_head.output.save()
        return out
    got, live = run(record), run(None)  # before held(): it leaves the patterns held until the test ends
    enc = model.tokenizer.pad({"input_ids": [p1, p2, p3]}, return_tensors="pt")
    want = held(hf, monkeypatch, dict(enc), lambda st: [zero_head(hf, st, slice(1, None), -2, adapter.head_dim)])
    mask = enc["attention_mask"].bool()
    assert rel(got, want, mask) < 2e-5
    assert rel(live, want, mask) > 1e-3


def test_a_skipped_attention_and_an_sae_in_a_frozen_trace_match_the_reference(monkeypatch):
    model, hf = tiny_nnsight("qwen3")
    adapter = get_adapter(model)
    sae = make_sae()
    rm = ReplacementModel(model, saes=SAESet(model, {"model.layers.0": sae}))
    ids = random_ids(2, 10, seed=3)
    record = freeze_attention(rm, ids)
    t, pos = MHSAHead(0, H), 3

    def run(frozen):
        with torch.no_grad(), model.trace(ids):
            rm.prepare([t], frozen=frozen)
            ablate(rm(t), positions=[pos])
            attn = model.model.layers[1].self_attn
            attn.skip((torch.zeros_like(attn.inputs[1]["hidden_states"]) + 0.5, None))
            out = model.lm_head.output.save()
        return out

    got, live = run(record), run(None)  # before held(): it leaves the patterns held until the test ends
    with torch.no_grad():
        acts = sae.encode(hf(input_ids=ids, output_hidden_states=True).hidden_states[1])
    f = int(acts[0, 4].argmax())
    target = Feature("model.layers.0", f)
    with torch.no_grad(), model.trace(ids):
        rm.prepare([target], frozen=record)
        ablate(rm(target), positions=[4])
        got_sae = model.lm_head.output.save()

    def hooks(st):
        skip = hf.model.layers[1].self_attn.register_forward_hook(
            lambda m, a, o: o if st["record"] else (torch.zeros_like(o[0]) + 0.5, None))
        return [zero_head(hf, st, slice(None), pos, adapter.head_dim), skip]
    want = held(hf, monkeypatch, {"input_ids": ids}, hooks)
    assert rel(got, want) < 2e-5
    assert rel(live, want) > 1e-3
    # an SAE feature ablated at layer 0's output (error term on) under frozen attention

    def sae_hook(st):
        def fh(m, a, o):
            h = o[0] if isinstance(o, tuple) else o
            if st["record"]:
                return o
            new = h.clone()
            new[:, 4] -= sae.encode(h)[:, 4, f, None] * sae.W_dec[f]
            return (new, *o[1:]) if isinstance(o, tuple) else new
        return [hf.model.layers[0].register_forward_hook(fh)]
    assert rel(got_sae, held(hf, monkeypatch, {"input_ids": ids}, sae_hook)) < 2e-5


def test_gradients_through_a_frozen_trace_are_refused():
    """A backward through a frozen trace is refused by name (until 2026-11-30 the heads' z of every layer whose input
    moved was detached: no gradient through those attentions' values, the embeddings' 72% off the pattern-holding
    reference's); its forward is the frozen one, with gradients enabled too."""
    model, hf = tiny_nnsight("llama")
    rm = ReplacementModel(model)
    ids = random_ids(2, 9, seed=4)
    t = MHSAHead(0, 1)
    record = freeze_attention(rm, ids)
    with torch.no_grad(), model.trace(ids):
        rm.prepare([t], frozen=record)
        ablate(rm(t), positions=[2])
        want = model.lm_head.output.save()
    with model.trace(ids):
        rm.prepare([t], frozen=record)
        ablate(rm(t), positions=[2])
        out = model.lm_head.output.save()
    assert torch.equal(out.detach(), want)
    with pytest.raises(ArgumentError, match="backward pass reached the frozen attention"):
        out[:, -1].sum().backward()
