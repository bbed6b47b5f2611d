"""Probe: leftovers of the host-memory and interruption probes, round 2 (docs/reliability.md, "Leftovers probe").

1. ``Trainer.folded()`` of a bf16 / fp16 module (fp32 masters) folds parameter by parameter in row chunks straight
   into the low-precision output: its state bit-equals the former fold (a deep copy of the fp32 masters, folded
   whole, each parameter then rounded), for every objective and master dtype; its peak is measured in a fresh
   interpreter (``benchmarks/host_memory_paths.py``; slow).
2. ``ReplacementModel(offload=...)`` is all or nothing: a switch failing on some set leaves every set's flag and
   every module's mark and tensors as before.
3. ``set[key] = module`` whose placement fails leaves the module exactly as before (mark, tensors) and the set
   unchanged.

Failures are injected with the interruption probes' stand-ins (``FAILURES``: ``Ctrl-C``, a CUDA out-of-memory
error, a ``RuntimeError``) on CPU: a stand-in for ``place`` / ``store_on_host`` that moves part of the module (new
tensors in place of some parameters and buffers) and raises.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import generated, make_lorsa, make_transcoders, tiny_nnsight
from hypothesis import strategies as st
from test_probe_interrupt import FAILURES

import nnsight_lorsa.envoy.replacement_set as replacement_set
from nnsight_lorsa import LorsaSet, ReplacementModel, TranscoderSet
from nnsight_lorsa._placement import OFFLOAD_ATTR


def held_state(module: torch.nn.Module) -> tuple:
    """What a placement changes on ``module``: its offload mark (or its absence), and per parameter / buffer the
    object, its storage, device and dtype."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return (module.__dict__.get(OFFLOAD_ATTR, "absent"),
            [(n, id(t), t.data_ptr(), t.device, t.dtype) for n, t in tensors])


def half_move(calls: list[int], k: int, failure: str):
    """A stand-in for ``place`` / ``store_on_host``: its ``k``-th call replaces the module's first parameter's tensor
    and first buffer by copies (a move half done), then raises ``FAILURES[failure]``; other calls do nothing."""
    def stand_in(module, *args, **kwargs):
        calls[0] += 1
        if calls[0] == k:
            with torch.no_grad():
                p = next(module.parameters())
                p.data = p.data.clone()
                for sub in module.modules():
                    for name, b in sub._buffers.items():
                        if b is not None:
                            sub._buffers[name] = b.clone()
                            break
            raise FAILURES[failure]()
    return stand_in


@functools.cache
def world():
    from nnsight_lorsa import get_adapter

    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(hf)
    return model, hf, adapter


def fresh_sets():
    model, hf, adapter = world()
    lorsas = LorsaSet(model, {layer: make_lorsa(hf, adapter, layer) for layer in range(adapter.n_layers)})
    tcs = TranscoderSet(model, make_transcoders(range(adapter.n_layers), skip_layer=1))
    return model, lorsas, tcs


# ------------------------------------------------------------------ 2. ReplacementModel(offload=...): all or nothing
@generated(4, 40, start=st.booleans(), k=st.integers(1, 6), failure=st.sampled_from(sorted(FAILURES)),
           bare=st.booleans())
def test_a_failed_model_level_offload_switch_leaves_every_set_as_before(start, k, failure, bare):
    """``ReplacementModel(model, lorsas=..., transcoders=..., offload=not start)`` whose k-th module move fails
    (half done; the 3 Lorsas move first, then the 3 transcoders; ``bare``: the transcoders given as a mapping):
    every set's flag, every module's mark and tensors are as before; the retry switches all."""
    model, lorsas, tcs = fresh_sets()
    lorsas.offload = tcs.offload = start
    mods = [*lorsas.values(), *tcs.values()]
    before = [held_state(m) for m in mods]
    calls = [0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replacement_set, "place", half_move(calls, k, failure))
        mp.setattr(replacement_set, "store_on_host", half_move(calls, k, failure))
        if bare:  # the bare transcoders are marked, then placed by their new set (k counts those placements)
            tcs_given = dict(tcs.items())
        with pytest.raises(type(FAILURES[failure]())):
            ReplacementModel(model, lorsas=lorsas, transcoders=tcs_given if bare else tcs, offload=not start)
        assert lorsas.offload is start, f"failed at move {k}: the Lorsas' flag stayed switched"
        assert tcs.offload is start, f"failed at move {k}: the transcoders' flag stayed switched"
        assert [held_state(m) for m in mods] == before, f"failed at move {k}: a module left switched or moved"
        rm = ReplacementModel(model, lorsas=lorsas, transcoders=tcs, offload=not start)  # the retry
        assert rm.lorsas.offload is (not start) and rm.transcoders.offload is (not start)


# ------------------------------------------------------------------ 3. set[key] = module whose placement fails
@generated(4, 40, offload=st.sampled_from([None, True, False]), marked=st.sampled_from(["absent", True, False]),
           which=st.sampled_from(["lorsas", "transcoders"]), failure=st.sampled_from(sorted(FAILURES)),
           replace=st.booleans())
def test_a_failed_placement_leaves_the_module_and_the_set_as_before(offload, marked, which, failure, replace):
    """``set[key] = module`` whose placement fails half done (the set's flag ``offload`` or the module's own mark
    ``marked`` deciding it): the module's mark (or its absence) and its tensors are as before, and the set holds
    what it held (``replace``: a key it holds)."""
    model, hf, adapter = world()
    _, lorsas, tcs = fresh_sets()
    s = {"lorsas": lorsas, "transcoders": tcs}[which]
    if offload is not None:
        s.offload = offload
    key = 1
    if not replace:
        s._by_key.pop(key)
    new = make_lorsa(hf, adapter, key, seed=3) if which == "lorsas" else make_transcoders([key], seed=3)[key]
    if marked != "absent":
        new.__dict__[OFFLOAD_ATTR] = marked
    before, held = held_state(new), dict(s._by_key)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replacement_set, "place", half_move([0], 1, failure))
        mp.setattr(replacement_set, "store_on_host", half_move([0], 1, failure))
        with pytest.raises(type(FAILURES[failure]())):
            s[key] = new
    assert held_state(new) == before, "the module was left marked or half moved"
    assert dict(s._by_key) == held and all(s._by_key[k] is held[k] for k in held), "the set changed"
    s[key] = new  # the retry places it
    assert s[key] is new
