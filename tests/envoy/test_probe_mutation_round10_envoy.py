"""Mutation probe, round 10 (docs/reliability.md): ``envoy/loading.py``'s error paths, each test seen failing with
the mutant it names and passing without. Nothing is loaded: nnsight's ``TransformersModel`` is replaced by a stub
that fails as a real load can."""

from __future__ import annotations

import nnsight
import pytest
import torch

from nnsight_lorsa.envoy import load_model
from nnsight_lorsa.errors import CheckpointError


def _failing_load(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    def load(*args, **kwargs):
        raise error

    monkeypatch.setattr(nnsight, "TransformersModel", load)


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   MemoryError("cannot allocate")])
def test_running_out_of_memory_is_not_reported_as_a_damaged_checkpoint(monkeypatch, error):
    """(Mutant: only LorsaError re-raised as is.) Out of memory is the machine's limit, not the checkpoint's fault:
    the error itself reaches the caller, not a CheckpointError saying the weights could not be loaded."""
    _failing_load(monkeypatch, error)
    with pytest.raises(type(error)) as info:
        load_model()
    assert info.value is error and not isinstance(info.value, CheckpointError)


def test_a_weights_failure_is_named_by_the_first_line_of_its_cause(monkeypatch):
    """(Mutant: ``_first_line`` takes the last line.) transformers' messages run over many lines; the
    CheckpointError names the cause's class and its first line, the one that says what failed."""
    _failing_load(monkeypatch, RuntimeError("Error(s) in loading state_dict for LlamaForCausalLM:\n"
                                            "\tsize mismatch for lm_head.weight\n\tYou may consider ..."))
    with pytest.raises(CheckpointError, match=r"\(RuntimeError: Error\(s\) in loading state_dict for LlamaForCausal"
                                              r"LM:\)$") as info:
        load_model()
    assert "consider" not in str(info.value)
