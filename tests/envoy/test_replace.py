"""``LorsaSet.replace`` inside nnsight traces: exactness, internals, edits, cleanup, bad input."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    FAMILIES,
    LAYER,
    TESTS,
    head_logits,
    hooked,
    hooked_logits_with_doubled_attention_input,
    make_lorsa,
    module_state,
    random_ids,
    tiny_nnsight,
    unembed,
)

from nnsight_lorsa import Lorsa, LorsaConfig, LorsaSet, get_adapter
from nnsight_lorsa.errors import ConfigMismatchError, LayerOutOfRangeError, TraceOrderError


@pytest.fixture(params=FAMILIES)
def setup(request):
    model, hf = tiny_nnsight(request.param)
    adapter = get_adapter(model)
    return model, hf, adapter, LorsaSet(model, {LAYER: make_lorsa(hf, adapter)})


@torch.no_grad()
def test_error_term_reproduces_logits(setup):
    model, hf, adapter, lorsas = setup
    ids = random_ids()
    ref = head_logits(hf, ids)
    with model.trace(ids):
        lorsas.replace(layer=LAYER, error=True)
        logits = unembed(model).output.save()
    assert (logits - ref).abs().max() <= 1e-5 * ref.abs().max()  # the relative bound (test_exactness.py)


@torch.no_grad()
def test_replace_matches_hooked_reference_and_changes_output(setup):
    model, hf, adapter, lorsas = setup
    ids = random_ids()
    ref = head_logits(hf, ids)
    with hooked(hf, adapter, {LAYER: lorsas[LAYER]}):
        want = head_logits(hf, ids)
    with model.trace(ids):
        site = lorsas.replace(layer=LAYER)
        z = site.hook_z.output.save()
        out = site.hook_out.output.save()
        logits = unembed(model).output.save()
    assert (logits - want).abs().max() < 1e-5
    assert (logits - ref).abs().max() > 1e-3  # the replacement is not the MHSA
    assert z.shape == (2, 10, lorsas[LAYER].cfg.n_ov_heads)
    assert ((z > 0).sum(-1) <= lorsas[LAYER].cfg.top_k).all()
    assert out.shape == (2, 10, adapter.d_model)


@torch.no_grad()
def test_edit_heads_in_trace_matches_reference(setup):
    model, hf, adapter, lorsas = setup
    ids = random_ids()

    def edit(z):
        z = z.clone()
        z[:, :, 3] = 0
        z[:, :, 5] += 2.0
        return z

    with hooked(hf, adapter, {LAYER: lorsas[LAYER]}, edit=edit):
        want = head_logits(hf, ids)
    with model.trace(ids):
        site = lorsas.replace(layer=LAYER)
        site.hook_z.output[:, :, 3] = 0
        site.hook_z.output[:, :, 5] += 2.0
        logits = unembed(model).output.save()
    assert (logits - want).abs().max() < 1e-5


@torch.no_grad()
def test_error_term_is_held_fixed_under_edits(setup):
    """With error=True an edit changes the output by exactly the edited Lorsa's change."""
    model, hf, adapter, lorsas = setup
    ids = random_ids()
    ref = head_logits(hf, ids)
    lorsa = lorsas[LAYER]
    captured = {}

    def capture(module, args, kwargs, output):
        captured["x"] = adapter.attention_input(args, kwargs)
        captured["out"] = adapter.attention_output(output)
        captured["pos"] = adapter.attention_positions(args, kwargs, captured["x"])

    h = adapter.attention_module(hf, LAYER).register_forward_hook(capture, with_kwargs=True)
    hf(ids)
    h.remove()
    z, _ = lorsa.activation(lorsa.compute_z_pre(captured["x"], captured["pos"]))
    z_edit = z.clone()
    z_edit[:, :, 0] = 3.0
    delta = lorsa.decode(z_edit) - lorsa.decode(z)

    def add_delta(module, args, output):
        return adapter.with_attention_output(output, adapter.attention_output(output) + delta)

    h = adapter.attention_module(hf, LAYER).register_forward_hook(add_delta)
    want = head_logits(hf, ids)
    h.remove()
    with model.trace(ids):
        site = lorsas.replace(layer=LAYER, error=True)
        site.hook_z.output[:, :, 0] = 3.0
        err = site.hook_error.output.save()
        logits = unembed(model).output.save()
    assert (logits - want).abs().max() < 1e-4
    assert (logits - ref).abs().max() > 1e-3
    assert (err - (captured["out"] - lorsa.decode(z))).abs().max() < 1e-5


@torch.no_grad()
def test_the_site_read_and_edited_after_replace_is_the_replacement(setup):
    """The body's reads of the replaced site's own output come after the swap (they were served before it and saw
    the model's MHSA output: a silent wrong read), its edits act on the replacement's output (with ``error=False``
    the swap overwrote them), and an edit of the site's input still reaches the replacement."""
    model, hf, adapter, lorsas = setup
    lorsa = lorsas[LAYER]
    ids = random_ids()
    site = adapter.attention_module(hf, LAYER)
    seen: dict[str, torch.Tensor] = {}
    def keep(name):
        return lambda m, a, kw, out: seen.__setitem__(name, adapter.attention_output(out).clone())
    with hooked(hf, adapter, {LAYER: lorsa}):
        handle = site.register_forward_hook(keep("replaced"), with_kwargs=True)
        want_logits = head_logits(hf, ids)
        handle.remove()
    attention = model.get(adapter.attention_path(LAYER))
    with model.trace(ids):
        lorsas.replace(layer=LAYER, error=False)
        read = attention.output[0].save()
        logits = unembed(model).output.save()
    assert torch.equal(read, seen["replaced"])
    assert (logits - want_logits).abs().max() <= 1e-5 * want_logits.abs().max()
    with model.trace(ids):  # an edit after the swap: zero the attention output
        lorsas.replace(layer=LAYER, error=False)
        attention.output[0][:] = 0
        zeroed = unembed(model).output.save()
    def zero(m, a, kw, out):
        return adapter.with_attention_output(out, torch.zeros_like(adapter.attention_output(out)))
    handle = site.register_forward_hook(zero, with_kwargs=True)
    try:
        want_zeroed = head_logits(hf, ids)
    finally:
        handle.remove()
    assert (zeroed - want_zeroed).abs().max() <= 1e-5 * want_zeroed.abs().max()
    with model.trace(ids):  # an edit of the site's input, made after replace(): the Lorsa reads it
        lorsas.replace(layer=LAYER, error=False)
        args, kwargs = attention.inputs
        x = adapter.attention_input(args, kwargs)
        x[:] = 2 * x
        doubled = unembed(model).output.save()
    want_doubled = hooked_logits_with_doubled_attention_input(hf, adapter, {LAYER: lorsa}, LAYER, ids)
    assert (doubled - want_doubled).abs().max() <= 1e-5 * want_doubled.abs().max()


@torch.no_grad()
def test_several_layers_and_invokes():
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsas = LorsaSet(model, {0: make_lorsa(hf, adapter, 0), 2: make_lorsa(hf, adapter, 2)})
    ids = random_ids(batch=3)
    with hooked(hf, adapter, {0: lorsas[0], 2: lorsas[2]}):
        want = hf(ids).logits
    with model.trace() as tracer:
        with tracer.invoke(ids[:1]):
            sites = lorsas.replace()  # every layer of the set, for this invoke's rows
            z0 = sites[0].hook_z.output.save()
            first = unembed(model).output.save()
        with tracer.invoke(ids[1:]):
            z2 = lorsas.replace()[2].hook_z.output.save()  # the same splices, for these rows too
            rest = unembed(model).output.save()
    assert z0.shape[0] == 1 and z2.shape[0] == 2
    assert (torch.cat([first, rest]) - want).abs().max() < 1e-5



@torch.no_grad()
def test_nothing_survives_the_trace_even_on_error(setup):
    model, hf, adapter, lorsas = setup
    ids = random_ids()
    before = module_state(hf)
    ref = hf(ids).logits
    with model.trace(ids):
        lorsas.replace(layer=LAYER).hook_z.output.save()
    assert module_state(hf) == before
    assert torch.equal(hf(ids).logits, ref)
    with pytest.raises(RuntimeError, match="boom"), model.trace(ids):
        lorsas.replace(layer=LAYER)
        unembed(model).output.save()
        raise RuntimeError("boom")
    assert module_state(hf) == before
    assert torch.equal(hf(ids).logits, ref)
    lorsa = lorsas[LAYER]
    assert all("forward" not in m.__dict__ for m in lorsa.modules())  # nnsight's controller removed


@torch.no_grad()
@pytest.mark.parametrize("error", [False, True])
def test_tracer_stop_after_reading_leaves_nothing_behind(error):
    """``tracer.stop()`` right after reading the Lorsa (the model does not run on) works, and
    the next traces that splice it again are served (nnsight's envoy registry kept the hook
    points of a stopped splice: OutOfOrderError on ``hook_z`` in the following trace)."""
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsas = LorsaSet(model, {LAYER: make_lorsa(hf, adapter)})
    ids = random_ids()
    with model.trace(ids):
        z_full = lorsas.replace(layer=LAYER, error=error).hook_z.output.save()
    for _ in range(2):
        with model.trace(ids) as tracer:
            z = lorsas.replace(layer=LAYER, error=error).hook_z.output.save()
            tracer.stop()
        assert torch.equal(z, z_full)
    with model.trace(ids):
        z_again = lorsas.replace(layer=LAYER, error=not error).hook_z.output.save()
    assert torch.equal(z_again, z_full)
    assert "lorsa" not in dict(adapter.attention_module(hf, LAYER).named_children())


@torch.no_grad()
def test_replace_after_layer_ran_is_a_clear_error():
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsas = LorsaSet(model, {LAYER: make_lorsa(hf, adapter)})
    with pytest.raises(TraceOrderError, match="already ran"), model.trace(random_ids()):
        model.model.layers[2].output.save()
        lorsas.replace(layer=LAYER)


def test_bad_layers_and_shapes():
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsa = make_lorsa(hf, adapter)
    with pytest.raises(LayerOutOfRangeError, match="out of range"):
        LorsaSet(model, {7: lorsa})
    with pytest.raises(ConfigMismatchError, match="layer 1"):
        LorsaSet(model, {2: lorsa})  # trained for layer 1
    wrong = Lorsa(LorsaConfig(d_model=32, n_qk_heads=2, d_qk_head=16, n_ov_heads=8, top_k=2))
    with pytest.raises(ConfigMismatchError, match="d_model=32"):
        LorsaSet(model, {1: wrong})
    with pytest.raises(LayerOutOfRangeError, match="no Lorsa for layer 0"):
        LorsaSet(model, {1: lorsa})[0]


REMOTE_LOCAL_SCRIPT = """
import sys, torch, nnsight, nnsight_lorsa
from helpers import random_ids, tiny_nnsight, unembed
from helpers import LAYER, make_lorsa
from nnsight_lorsa import LorsaSet, get_adapter
model, hf = tiny_nnsight("llama")
adapter = get_adapter(model)
lorsas = LorsaSet(model, {LAYER: make_lorsa(hf, adapter)})
ids = random_ids()
nnsight.register(nnsight_lorsa)
with model.trace(ids):
    site = lorsas.replace(layer=LAYER)
    site.hook_z.output[:, :, 2] = 0
    z_local = nnsight.save(site.hook_z.output)
    logits_local = nnsight.save(unembed(model).output)
with model.trace(ids, remote="local"):
    site = lorsas.replace(layer=LAYER)
    site.hook_z.output[:, :, 2] = 0
    z = nnsight.save(site.hook_z.output)
    logits = nnsight.save(unembed(model).output)
assert torch.equal(z, z_local) and torch.equal(logits, logits_local), (z - z_local).abs().max()
assert "lorsa" not in dict(adapter.attention_module(hf, LAYER).named_children())
print("ok")
"""


def test_replace_under_nnsight_remote_local_simulation():
    """nnsight's LocalSimulationBackend serializes the trace (our code by value) and runs it back.

    Run in a fresh interpreter without the test-time type-checking hook: its wrappers are not
    picklable, and remote code must not depend on them anyway.
    """
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    done = subprocess.run([sys.executable, "-c", REMOTE_LOCAL_SCRIPT], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_replace_refuses_bad_keys_and_calls_outside_a_trace_with_named_errors():
    from helpers import make_transcoder

    from nnsight_lorsa import TranscoderSet
    from nnsight_lorsa.errors import ArgumentError, TraceOrderError

    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsas = LorsaSet(model, {LAYER: make_lorsa(hf, adapter)})
    tcs = TranscoderSet(model, {0: make_transcoder()})
    for bad in (2.0, "2", True, [], [1.5]):
        for s in (lorsas, tcs):
            with pytest.raises(ArgumentError, match="layer index|names nothing"), model.trace(random_ids()):
                s.replace(bad)
    for s in (lorsas, tcs):
        with pytest.raises(TraceOrderError, match="inside a model.trace"):
            s.replace(LAYER if s is lorsas else 0)
    import numpy as np

    with model.trace(random_ids()):  # numpy / tensor integers are layer indices too
        one = lorsas.replace(np.int64(LAYER))
        z = one.hook_z.output.save()
    assert z.shape[-1] == lorsas[LAYER].cfg.n_ov_heads


@pytest.mark.parametrize("second", ["other_error_flag", "other_module", "same"])
def test_a_second_replace_of_a_site_in_one_trace_must_agree_with_the_first(second):
    """A site is spliced once per trace: a second ``replace`` of it with another ``error`` flag or another
    module raises (it used to be ignored silently: the first won); the same call again returns the same envoy."""
    from nnsight_lorsa.errors import ArgumentError

    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsas = LorsaSet(model, {LAYER: make_lorsa(hf, adapter)})
    others = LorsaSet(model, {LAYER: make_lorsa(hf, adapter, seed=1)})
    before = module_state(hf)
    ids = random_ids(1, 8)
    if second == "same":
        with torch.no_grad(), model.trace(ids):
            a = lorsas.replace(layer=LAYER, error=True)
            b = lorsas.replace(layer=LAYER, error=True)
            assert a.path == b.path
            unembed(model).output.save()
    else:
        with pytest.raises(ArgumentError, match=r"self_attn is already replaced in this trace"), \
                torch.no_grad(), model.trace(ids):
            lorsas.replace(layer=LAYER, error=True)
            if second == "other_error_flag":
                lorsas.replace(layer=LAYER, error=False)
            else:
                others.replace(layer=LAYER, error=True)
            unembed(model).output.save()
    assert module_state(hf) == before


def test_the_lorsa_envoy_serves_its_own_input_and_output():
    """The envoy ``replace`` returns is a whole envoy: ``.input`` is the attention input the Lorsa reads and
    ``.output`` its output (what ``hook_out`` carries); both were a misleading OutOfOrderError before."""
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsa = make_lorsa(hf, adapter)
    ids = random_ids(1, 8)
    with torch.no_grad(), model.trace(ids):
        site = LorsaSet(model, {LAYER: lorsa}).replace(layer=LAYER)
        x = site.input.save()
        hook_out = site.hook_out.output.save()
        out = site.output.save()
    with torch.no_grad():
        want = lorsa(x)
    assert x.shape == (1, 8, adapter.d_model)
    assert torch.equal(out, hook_out) and torch.allclose(out, want, rtol=1e-5, atol=1e-6)
