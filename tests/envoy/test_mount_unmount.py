"""``nnsight_internals.mount`` / ``unmount`` / ``held_module`` (what ``install_gated_attention`` and the intervened
attribution pass rely on), tested directly (round 9b left #82-#84 unanalysed: only the sparse-attention workflow
reached them): a mounted module is a real child with its envoy; the same module mounts again, another one under a
taken name is refused by name; unmounting removes the child and its envoy, so a later mount under that name gets a
fresh envoy of the new module, and a module nnsight had not instrumented before is left uninstrumented."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_nnsight

from nnsight_lorsa.envoy.nnsight_internals import held_module, is_instrumented, mount, unmount
from nnsight_lorsa.errors import TraceOrderError


def test_mount_unmount_and_mount_again() -> None:
    model, hf = tiny_nnsight("llama")
    site, attn = model.get("model.layers.0.self_attn"), hf.model.layers[0].self_attn
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert held_module(site, "gate") is None
    env = mount(site, "gate", a)
    assert env._module is a and attn.gate is a and held_module(site, "gate") is a
    assert mount(site, "gate", a)._module is a  # the same module again: its envoy
    with pytest.raises(TraceOrderError, match=r"self_attn already has a child module named 'gate'"):
        mount(site, "gate", b)
    assert attn.gate is a  # the refusal changed nothing
    unmount(site, "gate", a, False)
    assert "gate" not in attn._modules and held_module(site, "gate") is None and not is_instrumented(a)
    again = mount(site, "gate", b)
    assert again._module is b and again is not env and attn.gate is b and held_module(site, "gate") is b
    unmount(site, "gate", b, False)
    assert "gate" not in attn._modules


def test_unmount_leaves_a_module_it_did_not_mount_and_one_instrumented_before() -> None:
    model, hf = tiny_nnsight("llama")
    site, attn = model.get("model.layers.0.self_attn"), hf.model.layers[0].self_attn
    a, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    mount(site, "gate", a)
    unmount(site, "gate", other, False)  # not the mounted module: the child stays
    assert attn.gate is a and held_module(site, "gate") is a
    assert is_instrumented(a)
    unmount(site, "gate", a, True)  # instrumented before: its nnsight controllers stay
    assert "gate" not in attn._modules and is_instrumented(a)
