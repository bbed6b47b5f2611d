"""Frozen attention, an independent review's cases (each kills a mutation the other frozen-attention tests let live):
a skipped decoder layer, an edit of an attention's own input, an MHSA head edited at a layer whose input moved, an
embedding edit — each against the pattern-holding Hugging Face reference (``helpers.pattern_holding_attention``);
the chunked correction equal to the whole one; a second record in one trace, other padding of the same ids, and a
backward through a layer whose input did not move, refused by name; ``Lorsa.forward(qk_input=...)`` outside a splice
(queries and keys of one input, values of another) against its own pattern and values."""

from __future__ import annotations

import pytest
import torch
from helpers import make_lorsa, pattern_held_logits, random_ids, tiny_nnsight

import nnsight_lorsa.envoy.frozen_attention as frozen_attention
from nnsight_lorsa import ReplacementModel, get_adapter
from nnsight_lorsa.errors import ArgumentError, ShapeError
from nnsight_lorsa.patching import MHSAHead, ablate, freeze_attention, scale

BOUND = 2e-5


held = pattern_held_logits


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.abs().max())


def z_hook(st, d, head, positions, factor):
    """A pre-hook of an output projection multiplying head ``head``'s columns of ``z`` at ``positions`` by
    ``factor`` (0: ablation) once the record is made."""
    def hook(module, args):
        if not st["record"]:
            z = args[0].clone()
            z[:, positions, head * d:(head + 1) * d] *= factor
            return (z, *args[1:])
    return hook


@pytest.fixture(scope="module")
def llama():
    model, hf = tiny_nnsight("llama")
    return model, hf, get_adapter(model), random_ids(2, 9, seed=4)


def test_a_skipped_decoder_layer_leaves_the_later_layers_frozen(llama, monkeypatch):
    """``layers[1].skip(...)``: the worker passes over it (its skip gate) and freezes layer 2."""
    model, hf, adapter, ids = llama
    rm = ReplacementModel(model)
    record = freeze_attention(rm, ids)
    t = MHSAHead(0, 1)

    def run(frozen):
        with torch.no_grad(), model.trace(ids):
            rm.prepare([t], frozen=frozen)
            ablate(rm(t), positions=[2])
            layer = model.model.layers[1]
            layer.skip(layer.inputs[0][0] * 1.5)  # (this transformers' decoder layer returns a tensor)
            out = model.lm_head.output.save()
        return out
    got, live = run(record), run(None)

    def hooks(st):
        def skip(module, args, out):
            return out if st["record"] else (args[0] * 1.5, *out[1:]) if isinstance(out, tuple) else args[0] * 1.5
        return [hf.model.layers[0].self_attn.o_proj.register_forward_pre_hook(z_hook(st, adapter.head_dim, 1, 2, 0)),
                hf.model.layers[1].register_forward_hook(skip)]
    want = held(hf, monkeypatch, {"input_ids": ids}, hooks)
    assert rel(got, want) < BOUND
    assert rel(live, want) > 1e-3


def test_an_edit_of_an_attentions_own_input_is_frozen(llama, monkeypatch):
    """The trace body replaces layer 1's attention input: the worker reads it after the body's edit there
    (``serve_last``, though it went ahead of the body at layer 0), so the pattern stays the recorded one and the
    values are the edited input's."""
    model, hf, adapter, ids = llama
    rm = ReplacementModel(model)
    record = freeze_attention(rm, ids)
    v = torch.randn(adapter.d_model, generator=torch.Generator().manual_seed(0))

    def run(frozen):
        with torch.no_grad(), model.trace(ids):
            rm.prepare([], frozen=frozen)
            model.model.embed_tokens.output[:, 2] -= v  # layer 0's input moves: its correction (serve_first)
            attn = model.model.layers[1].self_attn
            args, kwargs = attn.inputs
            h = kwargs["hidden_states"].clone()  # a new tensor: the worker must read the inputs after this edit
            h[:, 3] += v
            attn.inputs = (args, {**kwargs, "hidden_states": h})
            out = model.lm_head.output.save()
        return out
    got, live = run(record), run(None)

    def hooks(st):
        def pre(module, args, kwargs):
            if not st["record"]:
                h = kwargs["hidden_states"].clone()
                h[:, 3] += v
                return args, {**kwargs, "hidden_states": h}

        def embed(module, args, out):
            if not st["record"]:
                out = out.clone()
                out[:, 2] -= v
                return out
        return [hf.model.layers[1].self_attn.register_forward_pre_hook(pre, with_kwargs=True),
                hf.model.embed_tokens.register_forward_hook(embed)]
    want = held(hf, monkeypatch, {"input_ids": ids}, hooks)
    assert rel(got, want) < BOUND
    assert rel(live, want) > 1e-3


def test_a_head_edited_where_the_input_moved_acts_on_the_frozen_z(llama, monkeypatch):
    """An upstream edit moves layer 1's input; a head of layer 1 ablated there acts after the correction
    (``serve_first``): its frozen ``z`` is zeroed, not ``z`` plus a correction."""
    model, hf, adapter, ids = llama
    rm = ReplacementModel(model)
    record = freeze_attention(rm, ids)
    t0, t1 = MHSAHead(0, 1), MHSAHead(1, 2)

    def run(frozen):
        with torch.no_grad(), model.trace(ids):
            rm.prepare([t0, t1], frozen=frozen)
            scale(rm(t0), 4.0, positions=[1, 2])
            ablate(rm(t1), positions=[5])
            out = model.lm_head.output.save()
        return out
    got, live = run(record), run(None)
    d = adapter.head_dim
    want = held(hf, monkeypatch, {"input_ids": ids}, lambda st: [
        hf.model.layers[0].self_attn.o_proj.register_forward_pre_hook(z_hook(st, d, 1, [1, 2], 4.0)),
        hf.model.layers[1].self_attn.o_proj.register_forward_pre_hook(z_hook(st, d, 2, 5, 0.0))])
    assert rel(got, want) < BOUND
    assert rel(live, want) > 1e-3


def test_an_embedding_edit_is_frozen_from_layer_0(llama, monkeypatch):
    model, hf, adapter, ids = llama
    rm = ReplacementModel(model)
    record = freeze_attention(rm, ids)
    v = torch.randn(adapter.d_model, generator=torch.Generator().manual_seed(1))

    def run(frozen):
        with torch.no_grad(), model.trace(ids):
            rm.prepare([], frozen=frozen)
            model.model.embed_tokens.output[:, 3] += v
            out = model.lm_head.output.save()
        return out
    got, live = run(record), run(None)

    def hooks(st):
        def edit(module, args, out):
            if not st["record"]:
                out = out.clone()
                out[:, 3] += v
                return out
        return [hf.model.embed_tokens.register_forward_hook(edit)]
    want = held(hf, monkeypatch, {"input_ids": ids}, hooks)
    assert rel(got, want) < BOUND
    assert rel(live, want) > 1e-3


def test_the_correction_in_head_chunks_is_the_whole_one(llama, monkeypatch):
    model, hf, adapter, ids = llama
    rm = ReplacementModel(model)
    record = freeze_attention(rm, ids)
    t = MHSAHead(0, 1)

    def run():
        with torch.no_grad(), model.trace(ids):
            rm.prepare([t], frozen=record)
            scale(rm(t), 5.0, positions=[2, 3])
            out = model.lm_head.output.save()
        return out
    whole = run()
    for elements in (1, 2 * ids.shape[0] * ids.shape[1] ** 2):  # one head a step; two (and a last odd one: 4 heads)
        monkeypatch.setattr(frozen_attention, "CHUNK_ELEMENTS", elements)
        assert rel(run(), whole) < 1e-6


def test_misuse_the_other_tests_leave_out_is_refused(llama):
    model, hf, adapter, ids = llama
    rm = ReplacementModel(model)
    record, again = freeze_attention(rm, ids), freeze_attention(rm, ids)
    with pytest.raises(ArgumentError, match="another FrozenAttention"), torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(ids[:1]):
            rm.prepare([], frozen=record)
        with tracer.invoke(ids[1:]):
            rm.prepare([], frozen=again)
    # the same token ids with other padding: other patterns
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    padded = freeze_attention(rm, {"input_ids": ids, "attention_mask": mask})
    with pytest.raises(ArgumentError, match="other padding"), torch.no_grad(), model.trace(ids):
        rm.prepare([], frozen=padded)
    # a backward through a frozen attention whose input did not move (the edit is at the last layer) is refused too:
    # the live z's gradient has the pattern term the frozen model has not
    last = MHSAHead(adapter.n_layers - 1, 1)
    with model.trace(ids):
        rm.prepare([last], frozen=record)
        ablate(rm(last), positions=[2])
        logits = model.lm_head.output.save()
    with pytest.raises(ArgumentError, match="backward pass reached the frozen attention"):
        logits.sum().backward()


@torch.no_grad()
def test_lorsa_forward_with_qk_input_outside_a_splice(llama):
    """``Lorsa.forward(x, qk_input=y)``: the patterns of ``y`` and the values of ``x`` — in the plain forward
    (``heads``) and the cached step (``forward_step``) — and a ``qk_input`` of another shape refused by name."""
    model, hf, adapter, _ = llama
    lorsa = make_lorsa(hf, adapter, layer=1)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(2, 7, adapter.d_model, generator=g), torch.randn(2, 7, adapter.d_model, generator=g)
    pos = torch.arange(7)
    A, v = lorsa.attention_pattern(y, positions=pos), lorsa.values(x)
    b, p, n_ov = v.shape
    z_pre = torch.einsum("bhij,bjhg->bihg", A, v.view(b, p, A.shape[1], n_ov // A.shape[1])).reshape(b, p, n_ov)
    z, _ = lorsa.activation(z_pre)
    want = lorsa.decode(z)
    scale_ = float(want.abs().max())
    assert float((lorsa(x, pos, qk_input=y) - want).abs().max()) <= 1e-5 * scale_
    out, cache = lorsa(x, pos, qk_input=y, return_cache=True)
    assert float((cache.z_pre - z_pre).abs().max()) <= 1e-5 * float(z_pre.abs().max())
    assert float((lorsa.forward_step(x, pos, qk_input=y)[0] - want).abs().max()) <= 1e-5 * scale_
    assert float((lorsa(x, pos) - want).abs().max()) > 1e-3 * scale_  # the queries' input matters here
    with pytest.raises(ShapeError, match="qk_input"):  # (below forward: jaxtyping's check of the tests comes first)
        lorsa._z_pre_kv(x, pos, None, None, qk_input=y[:, :5])
