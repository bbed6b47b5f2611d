"""A Lorsa on a sliding-window layer attends globally in a trace, as it does everywhere else.

A Lorsa has no window of its own (docs/adapters.md: "Lorsa itself is global"): ``Lorsa.forward``, the trainer
(a ``(batch, pos)`` key-padding mask at most), the Llamascopium format (``attn_type`` "global" only) and the
attribution engine all run it causal over every earlier token. ``LorsaSet.replace`` passed it the model's own
4-D mask, which on a sliding layer (Mistral: every layer; Qwen2 ``use_sliding_window``; Gemma-2/3's
``sliding_attention`` layers) also carries the layer's window: on prompts longer than the window the trace's
Lorsa (and so patching, the traced graph, dashboards) saw only the last ``window`` keys — relative error 0.3-1.2
against the module computed by hand, Lorsa node activations 0.5-21 away from the graph's — and ``generate``
refused the second token (the sliding KV cache's mask is over ``window`` keys, not the whole past).

Reference, written here independently of the splice: the Lorsa module on the captured attention input, at the
call's positions, with the batch's ``(batch, pos)`` key-padding mask (the trainer's call).
"""

from __future__ import annotations

import nnsight
import pytest
import torch
from helpers import VOCAB, attribution_setup, make_lorsa, random_ids, rm, tiny_nnsight, unembed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnsight_lorsa import LorsaSet, get_adapter
from nnsight_lorsa.attribution import attribute
from nnsight_lorsa.attribution.graph import LORSA

#: (family, attention implementation, sliding layer with the Lorsa): windows of 4 on layer 1 of Mistral (every
#: layer sliding) and layer 0 of Gemma-2 (eager only) / Gemma-3 (SDPA); Phi-3's layer 1 (every layer sliding)
CASES = [("mistral", "eager", 1), ("mistral", "sdpa", 1), ("gemma2", "eager", 0), ("gemma3", "sdpa", 0),
         ("phi3", "sdpa", 1)]
_SETUPS: dict[tuple[str, str, int], tuple] = {}


def setup(family: str, attn: str, layer: int):
    key = (family, attn, layer)
    if key not in _SETUPS:
        model, hf = tiny_nnsight(family, attn=attn)
        adapter = get_adapter(model)
        assert adapter.sliding_window(layer) == 4
        _SETUPS[key] = (model, adapter, LorsaSet(model, {layer: make_lorsa(hf, adapter, layer)}))
    return _SETUPS[key]


def batch(lengths: list[int], side: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``(batch, max(lengths))`` padded on ``side`` with the pad id 1, and the ``(batch, pos)`` mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.ones(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        ids[row, cols] = torch.randint(2, VOCAB, (n,), generator=g)
        ids[row, cols.start] = 0
        mask[row, cols] = 1
    return ids, mask


def traced_site(model, adapter, lorsas, layer, ids, mask, error):
    """``(x, positions, out)`` of a trace with the Lorsa of ``layer`` replacing its attention: the attention's input
    and positions as the splice reads them, and the Lorsa's output (``hook_out``)."""
    with torch.no_grad(), model.trace(ids, attention_mask=mask):
        site = lorsas.replace(layer, error=error)
        args, kwargs = model.get(adapter.attention_path(layer)).inputs
        x = nnsight.save(adapter.attention_input(args, kwargs))
        positions = nnsight.save(adapter.attention_positions(args, kwargs, x))
        out = site.hook_out.output.save()
    return x, positions, out


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=st.sampled_from(CASES), lengths=st.lists(st.integers(1, 16), min_size=1, max_size=3),
       side=st.sampled_from(["left", "right"]), error=st.booleans(), seed=st.integers(0, 2**16))
def test_the_traced_lorsa_on_a_sliding_layer_is_the_module_on_its_input(case, lengths, side, error, seed):
    model, adapter, lorsas = setup(*case)
    layer = case[2]
    ids, mask = batch(lengths, side, seed)
    x, positions, out = traced_site(model, adapter, lorsas, layer, ids, mask, error)
    with torch.no_grad():
        want = lorsas[layer](x, positions, mask)
    tokens = mask.bool()
    err = float((out - want).abs()[tokens].max() / want.abs()[tokens].max())
    assert err <= 1e-6, (case, lengths, side, err)  # was 0.3-1.2 on prompts longer than the window


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=lambda c: c[0])
def test_the_graph_and_the_traced_pass_see_the_same_lorsa_on_a_sliding_layer(case):
    family, _, layer = case
    model, hf, _, tcs = attribution_setup(family)
    lorsas = {layer: make_lorsa(hf, get_adapter(model), layer)}
    bundle = rm(model, lorsas, tcs)
    ids = random_ids(1, 11, seed=2)[0]
    graph = attribute(bundle, ids, batch_size=40)
    with model.trace(ids[None]) as tracer:
        sites = bundle.replace()
        traced = attribute(bundle, tracer=tracer, batch_size=40)
        z = nnsight.save(sites["lorsas"][layer].hook_z.output)
    n = graph.nodes
    on = n.kind == LORSA
    assert int(on.sum()) > 0
    assert torch.allclose(z[0, n.pos[on], n.index[on]], n.activation[on], rtol=1e-5, atol=1e-6)  # was 0.5 / 21 off
    for name in ("kind", "layer", "pos", "index"):  # the traced pass's graph is the clean one (no edit)
        assert torch.equal(getattr(traced.graph.nodes, name), getattr(n, name)), name


GEN = {"do_sample": False, "pad_token_id": 1}
STEPS = 4


@pytest.mark.parametrize("error", [False, True])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[2]], ids=lambda c: f"{c[0]}-{c[1]}")
def test_generate_with_a_lorsa_on_a_sliding_layer_matches_the_trace_of_the_whole_sequence(case, error):
    """Greedy generation past the window (the model's sliding KV cache keeps the last window only; the Lorsa's
    cache keeps every position) from a left-padded batch: each step's logits are those of the trace of the whole
    sequence at that position (was: ``LorsaError`` at the second token)."""
    model, adapter, lorsas = setup(*case)
    layer = case[2]
    ids, mask = batch([7, 5], "left", seed=3)
    with torch.no_grad(), model.generate({"input_ids": ids, "attention_mask": mask}, max_new_tokens=STEPS,
                                         min_new_tokens=STEPS, **GEN) as tracer:
        lorsas.replace(layer, error=error)
        steps = nnsight.save([])
        for _ in tracer.iter[:STEPS]:
            steps.append(unembed(model).output[:, -1].clone())
        seq = nnsight.save(tracer.result)
    full_mask = torch.cat([mask, torch.ones(2, STEPS - 1, dtype=mask.dtype)], 1)
    positions = (full_mask.cumsum(-1) - 1).clamp_min(0)  # what generate feeds a left-padded batch
    with torch.no_grad(), model.trace(seq[:, :-1], attention_mask=full_mask, position_ids=positions):
        lorsas.replace(layer, error=error)
        whole = unembed(model).output.save()
    want = whole[:, ids.shape[1] - 1:]
    got = torch.stack(steps, 1)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
    assert torch.equal(seq[:, ids.shape[1]:], want.argmax(-1))


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4), side=st.sampled_from(["left", "right"]),
       window=st.integers(1, 6), new=st.sampled_from([None, 1, 2]), kind=st.sampled_from(["sdpa", "eager"]))
def test_the_tokens_of_a_call_are_read_from_any_sliding_mask(lengths, side, window, new, kind):
    """``_own_tokens`` against transformers' own mask builders: the prompt's mask (``new=None``) or a cached step's
    over a sliding cache's last keys; the call's positions that are tokens are those of the 2-D mask."""
    from transformers import masking_utils as mu

    from nnsight_lorsa.envoy.lorsa_set import _own_tokens

    _, mask2d = batch(lengths, side, seed=0)
    total = mask2d.shape[1]
    q = total if new is None else min(new, total)
    past = total - q
    kv_offset = max(0, past - (window - 1)) if new is not None else 0
    kv_length = total - kv_offset
    build = mu.sdpa_mask if kind == "sdpa" else mu.eager_mask
    extra = {"allow_is_causal_skip": False} if kind == "sdpa" else {"dtype": torch.float32}
    mask = build(batch_size=len(lengths), q_length=q, kv_length=kv_length, q_offset=past, kv_offset=kv_offset,
                 mask_function=mu.sliding_window_causal_mask_function(window), attention_mask=mask2d.bool(), **extra)
    got = _own_tokens(mask, len(lengths), q, torch.device("cpu"))
    assert torch.equal(got, mask2d[:, past:].bool())
    assert torch.equal(_own_tokens(None, 2, q, torch.device("cpu")), torch.ones(2, q, dtype=torch.bool))


@settings(max_examples=16, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=st.sampled_from(CASES), lengths=st.lists(st.integers(1, 16), min_size=1, max_size=3),
       padded=st.booleans(), side=st.sampled_from(["left", "right"]), error=st.booleans(),
       seed=st.integers(0, 2**16))
def test_the_traced_lorsa_on_a_sliding_layer_has_the_bits_it_had_when_the_host_read_the_tokens(
        case, lengths, padded, side, error, seed):
    """The splice no longer reads whether the batch has padding (it passes the tokens as a key-padding mask whenever
    the model's mask is a tensor): the Lorsa's output is, bit for bit on the CPU, the module's on what the splice
    passed it before — no mask (plain causal) for a batch without padding, the ``(batch, pos)`` tokens otherwise."""
    model, adapter, lorsas = setup(*case)
    layer = case[2]
    ids, mask = batch(lengths if padded else [max(lengths)] * len(lengths), side, seed)
    x, positions, out = traced_site(model, adapter, lorsas, layer, ids, mask, error)
    with torch.no_grad():
        before = lorsas[layer](x, positions, mask.bool() if not bool(mask.all()) else None)
    assert torch.equal(out, before), (case, lengths, padded, side)
