"""``replace()`` inside ``tracer.invoke``: it replaces that invoke's rows only (docs/nnsight.md, "Rules of the road").

The rows of an invoke that did not call ``replace`` get the site's true output bit for bit (compared with the
same batched trace without any replacement); the rows of one that did get what a trace of that prompt alone with
the replacement gives. Reading or editing a replacement's internals from an invoke it does not replace raises
``InvokeRowsError``; ``model.trace(prompt)`` and an empty ``tracer.invoke()`` replace the whole batch.
"""

from __future__ import annotations

import nnsight
import pytest
import torch
from helpers import LAYER, make_clt, make_lorsa, make_transcoder, random_ids, tiny_nnsight, unembed

from nnsight_lorsa import CLTSet, LorsaSet, TranscoderSet, get_adapter
from nnsight_lorsa.errors import InvokeRowsError, TraceOrderError

ATOL = 1e-5  # a row of a batched trace vs the same prompt alone (fp32 rounding of batched matmuls)


@pytest.fixture(scope="module")
def setup():
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsas = LorsaSet(model, {0: make_lorsa(hf, adapter, 0), LAYER: make_lorsa(hf, adapter, LAYER)})
    return model, lorsas, TranscoderSet(model, {LAYER: make_transcoder()})


def two_invokes(model, ids: torch.Tensor, first=None, second=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of ``ids[:1]`` and ``ids[1:]`` run as two invokes of one trace, ``first()`` / ``second()`` called
    at the top of each (None: nothing)."""
    with model.trace() as tracer:
        with tracer.invoke(ids[:1]):
            if first is not None:
                first()
            a = unembed(model).output.save()
        with tracer.invoke(ids[1:]):
            if second is not None:
                second()
            b = unembed(model).output.save()
    return a, b


def alone(model, ids: torch.Tensor, setup=None) -> torch.Tensor:
    """Logits of ``ids`` in a trace of their own, ``setup()`` first (None: the plain model)."""
    with model.trace(ids):
        if setup is not None:
            setup()
        logits = unembed(model).output.save()
    return logits


@torch.no_grad()
@pytest.mark.parametrize("error", [False, True])
def test_replace_in_one_invoke_replaces_its_rows_only(setup, error):
    model, lorsas, _ = setup
    ids = random_ids(batch=2)
    plain_a, plain_b = two_invokes(model, ids)
    clean, rep = two_invokes(model, ids, second=lambda: lorsas.replace(layer=LAYER, error=error))
    assert torch.equal(clean, plain_a)  # the invoke that did not replace: the model's own output, bit for bit
    want = alone(model, ids[1:], lambda: lorsas.replace(layer=LAYER, error=error))
    assert (rep - want).abs().max() < ATOL
    if not error:
        assert (rep - plain_b).abs().max() > 1e-3  # the replacement is not the MHSA: this row was replaced


@torch.no_grad()
def test_edits_and_multi_site_chains_stay_in_their_rows(setup):
    """An edit of the internals with the error term (the clean pass apart) and a CLT (one splice over every MLP):
    the invoke that did not replace still gets the model's own output, bit for bit."""
    model, lorsas, _ = setup
    clts = CLTSet(model, make_clt())
    ids = random_ids(batch=2)
    plain_a, _ = two_invokes(model, ids)

    def edited() -> None:
        lorsas.replace(LAYER, error=True).hook_z.output[..., 3] = 0

    for setup_b in (edited, clts.replace):
        clean, rep = two_invokes(model, ids, second=setup_b)
        assert torch.equal(clean, plain_a)
        assert (rep - alone(model, ids[1:], setup_b)).abs().max() < ATOL


@torch.no_grad()
def test_two_invokes_replace_different_layers_and_sets(setup):
    model, lorsas, transcoders = setup
    ids = random_ids(batch=2)
    a, b = two_invokes(model, ids, first=lambda: lorsas.replace(layer=0), second=lambda: lorsas.replace(LAYER))
    assert (a - alone(model, ids[:1], lambda: lorsas.replace(layer=0))).abs().max() < ATOL
    assert (b - alone(model, ids[1:], lambda: lorsas.replace(LAYER))).abs().max() < ATOL
    a, b = two_invokes(model, ids, first=lambda: lorsas.replace(LAYER), second=lambda: transcoders.replace(LAYER))
    assert (a - alone(model, ids[:1], lambda: lorsas.replace(LAYER))).abs().max() < ATOL
    assert (b - alone(model, ids[1:], lambda: transcoders.replace(LAYER))).abs().max() < ATOL


@torch.no_grad()
def test_every_invoke_or_an_empty_one_replaces_the_whole_batch(setup):
    model, lorsas, _ = setup
    ids = random_ids(batch=3)
    want = alone(model, ids, lambda: lorsas.replace(LAYER))
    a, b = two_invokes(model, ids, first=lambda: lorsas.replace(LAYER), second=lambda: lorsas.replace(LAYER))
    assert (torch.cat([a, b]) - want).abs().max() < ATOL
    with model.trace() as tracer:
        with tracer.invoke(ids[:1]):
            a = unembed(model).output.save()
        with tracer.invoke(ids[1:]):
            b = unembed(model).output.save()
        with tracer.invoke():  # the whole batch
            lorsas.replace(LAYER)
    assert (torch.cat([a, b]) - want).abs().max() < ATOL


@torch.no_grad()
def test_misuse_across_invokes_raises_named_errors(setup):
    """Internals read or edited where the replacement does not replace; a replace() too late for its rows."""
    model, lorsas, _ = setup
    ids = random_ids(batch=2)
    with pytest.raises(InvokeRowsError, match=r"on rows \[1, 2\).*for rows \[0, 1\)"), model.trace() as tracer:
        with tracer.invoke(ids[1:]):
            site = lorsas.replace(LAYER)
        with tracer.invoke(ids[:1]):
            site.hook_z.output.save()  # rows [0, 1) replaced (the first invoke's), read from rows [1, 2)
    with pytest.raises(InvokeRowsError), model.trace() as tracer:
        with tracer.invoke(ids[:1]):
            site = lorsas.replace(LAYER)
        with tracer.invoke(ids[1:]):
            site.hook_z.output[..., 3] = 0  # an edit too
    with pytest.raises(InvokeRowsError, match="whole batch"), model.trace() as tracer:
        with tracer.invoke(ids[:1]):
            site = lorsas.replace(LAYER)
        with tracer.invoke(ids[1:]):
            pass
        with tracer.invoke():
            site.hook_z.output.save()
    # a later invoke's replace() after the model ran the site: its rows cannot be replaced any more
    with pytest.raises(TraceOrderError, match=r"for rows \[1, 2\).*already ran"), model.trace() as tracer:
        with tracer.invoke(ids[:1]):
            lorsas.replace(LAYER)
        with tracer.invoke(ids[1:]):
            model.model.layers[LAYER].output.save()
            lorsas.replace(LAYER)


@torch.no_grad()
def test_internals_per_invoke(setup):
    model, lorsas, _ = setup
    ids = random_ids(batch=3)
    with model.trace() as tracer:
        with tracer.invoke(ids[:1]):
            z0 = lorsas.replace(LAYER).hook_z.output.save()
        with tracer.invoke(ids[1:]):
            z1 = lorsas.replace(LAYER).hook_z.output.save()
    with model.trace(ids):
        z = lorsas.replace(LAYER).hook_z.output.save()
    assert z0.shape[0] == 1 and z1.shape[0] == 2
    assert (torch.cat([z0, z1]) - z).abs().max() < ATOL


@torch.no_grad()
def test_generate_with_two_invokes_replaces_one():
    model, hf = tiny_nnsight("llama")
    lorsas = LorsaSet(model, {LAYER: make_lorsa(hf, get_adapter(model))})
    ids = random_ids(batch=2, seq=6)
    gen = {"max_new_tokens": 3, "min_new_tokens": 3, "do_sample": False, "pad_token_id": 1}

    def run(replace_first: bool, replace_second: bool) -> tuple[torch.Tensor, torch.Tensor]:
        with model.generate(**gen) as tracer:
            with tracer.invoke(ids[:1]):
                if replace_first:
                    lorsas.replace(LAYER)
                la = nnsight.save([])
                for _ in tracer.iter[:3]:
                    la.append(unembed(model).output[:, -1].clone())
            with tracer.invoke(ids[1:]):
                if replace_second:
                    lorsas.replace(LAYER)
                lb = nnsight.save([])
                for _ in tracer.iter[:3]:
                    lb.append(unembed(model).output[:, -1].clone())
        return torch.stack(list(la), 1), torch.stack(list(lb), 1)

    plain_a, _ = run(False, False)
    _, both_b = run(True, True)
    clean_a, rep_b = run(False, True)
    assert torch.equal(clean_a, plain_a)  # every step of the invoke that did not replace: bit for bit
    assert (rep_b - both_b).abs().max() < ATOL
