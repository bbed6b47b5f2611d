"""Two threads tracing one model: nnsight traces are per-thread; where our code is involved the second
thread gets our ConcurrentTraceError (saying why and what to do), not nnsight's "parent cannot be on a
different thread", and the first thread's trace is unharmed where the refusal comes before nnsight runs."""

from __future__ import annotations

import threading

import nnsight
import pytest
import torch
from helpers import LAYER, make_lorsa, make_transcoder, random_ids, tiny_nnsight

from nnsight_lorsa import LorsaSet, ReplacementModel, TranscoderSet, get_adapter
from nnsight_lorsa.errors import ConcurrentTraceError


@pytest.fixture(scope="module")
def setup():
    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    lorsas = LorsaSet(model, {LAYER: make_lorsa(hf, adapter)})
    rm = ReplacementModel(model, lorsas=lorsas, transcoders=TranscoderSet(model, {0: make_transcoder()}))
    ids = random_ids(1, 6)
    with torch.no_grad():
        reference = hf(ids).logits
    return model, hf, rm, lorsas, ids, reference


def _while_a_traces(setup, in_b):
    """Thread A runs a replacement trace and waits inside it until thread B has run ``in_b``; returns
    (A's logits or error, B's error)."""
    model, hf, rm, lorsas, ids, _ = setup
    inside, b_done = threading.Event(), threading.Event()
    result: dict = {}

    def a() -> None:
        try:
            with rm.trace(ids):
                rm.replace()
                inside.set()
                b_done.wait(60)
                result["a"] = nnsight.save(model.lm_head.output)
        except Exception as e:  # noqa: BLE001 — reported to the test
            result["a"] = e
        finally:
            inside.set()

    def b() -> None:
        inside.wait(60)
        try:
            in_b()
            result["b"] = None
        except Exception as e:  # noqa: BLE001
            result["b"] = e
        finally:
            b_done.set()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return result.get("a"), result.get("b")


def test_replacement_model_trace_in_a_second_thread_is_refused_and_the_first_is_unharmed(setup):
    model, hf, rm, lorsas, ids, reference = setup

    def in_b() -> None:
        with rm.trace(ids):
            rm.replace()

    a, b = _while_a_traces(setup, in_b)
    assert isinstance(b, ConcurrentTraceError), b
    assert "per-thread" in str(b) and "Lock" in str(b)
    assert isinstance(a, torch.Tensor), a  # thread A finished its trace: error terms reproduce the model
    assert torch.allclose(a, reference, atol=1e-5)


def test_attribute_in_a_second_thread_is_refused(setup):
    from nnsight_lorsa.attribution import attribute

    model, hf, rm, lorsas, ids, reference = setup
    a, b = _while_a_traces(setup, lambda: attribute(rm, ids[0], batch_size=8))
    assert isinstance(b, ConcurrentTraceError), b
    assert isinstance(a, torch.Tensor) and torch.allclose(a, reference, atol=1e-5)


def test_replace_inside_a_plain_trace_of_a_second_thread_raises_ours(setup):
    """nnsight itself starts the second thread's trace (no code of ours before it): its replace() sees the
    other thread's workers and raises ours; the first thread may fail too (nnsight's one interleaver per
    model was shared), which is what docs/nnsight.md says."""
    model, hf, rm, lorsas, ids, reference = setup

    def in_b() -> None:
        with model.trace(ids):
            lorsas.replace(LAYER)

    a, b = _while_a_traces(setup, in_b)
    assert isinstance(b, ConcurrentTraceError), b


def test_two_threads_with_a_lock_both_get_the_model(setup):
    """The documented remedy: one trace at a time (a lock around each with-block)."""
    model, hf, rm, lorsas, ids, reference = setup
    lock, outs, errors = threading.Lock(), [], []

    def work() -> None:
        try:
            for _ in range(3):
                with lock, rm.trace(ids):
                    rm.replace()
                    outs.append(nnsight.save(model.lm_head.output))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(outs) == 6 and all(torch.allclose(o, reference, atol=1e-5) for o in outs)
