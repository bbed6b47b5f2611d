"""Mutation probe, round 9b (nnsight internals: workers and registrations): tests for the mutants of
``envoy/nnsight_internals.py`` that survived the area's tests (docs/reliability.md, "Mutation probe, round 9b: nnsight
internals"). Each compares against an independent reference: the documented rule of the function (its docstring),
the model without the splice, or a plain torch forward hook."""

from __future__ import annotations

import nnsight
import pytest
import torch
from helpers import (
    head_logits,
    hooked,
    hooked_logits_with_doubled_attention_input,
    make_lorsa,
    random_ids,
    tiny_nnsight,
    unembed,
)
from nnsight.intervention.envoy import Envoy

from nnsight_lorsa import LorsaSet, get_adapter
from nnsight_lorsa.envoy.nnsight_internals import mount, unmount
from nnsight_lorsa.errors import UnsupportedGenerationError

LAYER = 1


# ------------------------------------------------------------------------------------------------- registrations
@torch.no_grad()
def test_a_module_spliced_in_an_ended_trace_leaves_no_registration_behind():
    """``_forget`` drops the interleaver's registration of the replacement module itself, not only its hook points'
    (its docstring): with the envoy ``replace`` returned still held after the trace, the model's interleaver has no
    entry for the Lorsa, and mounting the same module elsewhere later gives it its own envoy at the mounted path —
    not the ended envoy of the earlier trace (nnsight aliases a module it already has an envoy for)."""
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsa = make_lorsa(hf, adapter, LAYER)
    lorsas = LorsaSet(model, {LAYER: lorsa})
    kept = []  # the envoy kept after the trace, as a user's variable is
    with model.trace(random_ids(1, 5)):
        kept.append(lorsas.replace(layer=LAYER))
    (ended,) = kept
    site = model.model.layers[0].mlp
    mounted = mount(site, "probe", lorsa)
    try:
        assert type(mounted) is Envoy
        assert mounted.path == f"{site.path}.probe"
        assert mounted is not ended
    finally:
        unmount(site, "probe", lorsa, False)
    assert "probe" not in dict(hf.model.layers[0].mlp.named_children())
    assert ended.path == f"{model.model.layers[LAYER].self_attn.path}.lorsa"  # still held here
    assert not any(m is lorsa for m in (getattr(e, "_module", None) for e in model.interleaver.envoys.values()))


# ------------------------------------------------------------------------------------------------------- workers
@torch.no_grad()
def test_the_splice_reads_its_sites_input_as_the_trace_body_set_it():
    """``spawn_worker`` appends the splice's worker after the trace body's (its docstring; the splice reads the site's
    input "as the body's edits left it"): the attention's input set by the body after ``replace`` reaches the Lorsa.
    Reference: plain torch hooks, a pre-hook doubling the attention's ``hidden_states`` and the Lorsa's forward hook
    (``helpers.hooked``), which sees the doubled input."""
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsa = make_lorsa(hf, adapter, LAYER)
    lorsas = LorsaSet(model, {LAYER: lorsa})
    ids = random_ids(2, 6)
    want = hooked_logits_with_doubled_attention_input(hf, adapter, {LAYER: lorsa}, LAYER, ids)
    with hooked(hf, adapter, {LAYER: lorsa}):
        undoubled = head_logits(hf, ids)
    assert (want - undoubled).abs().max() > 1e-3  # the doubling shows in the logits
    with model.trace(ids):
        lorsas.replace(layer=LAYER)
        attn = model.model.layers[LAYER].self_attn
        attn.inputs = ((), {**attn.inputs[1], "hidden_states": 2 * attn.inputs[1]["hidden_states"]})
        logits = unembed(model).output.save()
    assert (logits - want).abs().max() <= 1e-5 * want.abs().max()


def test_beam_search_asked_in_a_params_only_invoke_is_refused_for_a_lorsa():
    """``run_kwargs``: the traced call's keyword arguments include those of an invoke that brings no rows (nnsight
    folds them into ``Batcher.extra_kwargs`` and lays them onto the ``generate`` call, its documented rule), so
    ``num_beams=2`` given there is refused for a Lorsa (``UnsupportedGenerationError``) as it is when passed to
    ``model.generate`` itself (``test_generate.py``), not run with a cache that cannot follow the beams."""
    model, hf = tiny_nnsight("llama")
    lorsas = LorsaSet(model, {LAYER: make_lorsa(hf, get_adapter(model), LAYER)})
    reached = []
    with pytest.raises(UnsupportedGenerationError, match="num_beams"), model.generate(
            max_new_tokens=3, pad_token_id=1) as tracer:
        with tracer.invoke(random_ids(1, 6)):
            lorsas.replace(layer=LAYER)
            reached.append(nnsight.save(unembed(model).output))
        with tracer.invoke(num_beams=2):
            pass
    assert not reached
