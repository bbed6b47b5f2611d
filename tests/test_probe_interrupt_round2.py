"""Probe, round 2: interruptions and failures part-way leave nothing half done.

docs/reliability.md, "Interruption and failure part-way probe, round 2 (2026-11-28)". The crash-injection helpers
of the first round (``tests/test_probe_interrupt.py``: ``fail_once``, ``failing_at``, ``snapshot``) raise a
``KeyboardInterrupt``, a fake CUDA ``torch.OutOfMemoryError``, a ``RuntimeError`` or (writers) an ``OSError`` of a
full disk at a drawn point of: the switch of ``ReplacementSet.offload`` (moving modules), the first training step of
a trainer (the scale factors and the objective's initialisation), CLT and transcoder training steps, the trainer's
checkpoint write, every writer's file boundaries (modules in every format, sets, graphs, exports, pictures, caches,
gates), ``attribute`` (offloaded, under ``max_memory``) and ``generate`` with replacements. After it: the exception
is the injected one or a named error of ours; the model, modules, flags and files are as before (or as after,
whole); a retry gives the uninterrupted result bit for bit (byte for byte).
"""

from __future__ import annotations

import contextlib
import errno
import functools
from pathlib import Path

import pytest
import torch
from helpers import generated, make_transcoders, random_ids, tiny_nnsight
from hypothesis import strategies as st
from test_probe_interrupt import FAILURES, fail_once, same, same_state, snapshot, trainer_state

import nnsight_lorsa.envoy.replacement_set as replacement_set
from nnsight_lorsa import LorsaSet, TranscoderSet
from nnsight_lorsa._placement import offloaded

WRITE_FAILURES = {**FAILURES, "disk-full": lambda: OSError(errno.ENOSPC, "No space left on device (injected)")}


# ------------------------------------------------------------------ 1. the offload switch failing part-way
@functools.cache
def offload_world():
    from helpers import make_lorsa

    from nnsight_lorsa import get_adapter

    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(hf)
    lorsas = LorsaSet(model, {layer: make_lorsa(hf, adapter, layer) for layer in range(adapter.n_layers)})
    tcs = TranscoderSet(model, make_transcoders(range(adapter.n_layers), skip_layer=1))
    return model, {"lorsas": lorsas, "transcoders": tcs}


@generated(4, 60, which=st.sampled_from(["lorsas", "transcoders"]), start=st.booleans(), k=st.integers(1, 3),
           failure=st.sampled_from(sorted(FAILURES)), split=st.booleans())
def test_a_failed_offload_switch_leaves_the_flag_and_every_module_as_before(which, start, k, failure, split):
    """``set.offload = not start`` whose k-th module move fails (a CUDA OOM copying it to the device, Ctrl-C; on
    this CPU machine the moves are stand-ins that record where each module is — ``split``: the failing move left
    that module half moved): the flag, every module's offload mark and where every module is are as before the
    switch; the switch then retried moves them all."""
    _, sets = offload_world()
    s = sets[which]
    s.offload = start
    where = {id(m): ("host" if start else "device") for m in s.values()}
    calls = [0]

    def move(to: str):
        def stand_in(module, *args, **kwargs):
            calls[0] += 1
            if calls[0] == k:
                if split:
                    where[id(module)] = "split"
                raise FAILURES[failure]()
            where[id(module)] = to
        return stand_in

    marks = [offloaded(m) for m in s.values()]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replacement_set, "place", move("device"))
        mp.setattr(replacement_set, "store_on_host", move("host"))
        with pytest.raises(type(FAILURES[failure]())):
            s.offload = not start
        assert s.offload is start, f"failed at module {k}: the flag reads switched"
        assert [offloaded(m) for m in s.values()] == marks, "a module's mark stayed switched"
        assert all(where[id(m)] == ("host" if start else "device") for m in s.values()), f"left moved: {where}"
        s.offload = not start  # the retry (the stand-ins fail once)
        assert s.offload is (not start) and all(offloaded(m) is (not start) for m in s.values())
        assert all(where[id(m)] == ("device" if start else "host") for m in s.values())
    s.offload = False
