"""A Lorsa's forward and decoding step copy nothing from the host to the model's device.

On CUDA a host-to-device ``.to(device)`` (``non_blocking=False``) waits for every kernel queued before it: one in
every Lorsa forward stalls the host until the layers before it have run, inside ``model.trace`` and at every
``generate`` step. The check runs on the ``meta`` device: every operator whose inputs include a CPU tensor and
whose output is on ``meta`` is such a copy (``tests/helpers.sync_spy``, which also lists device-to-host reads),
for every rope type, with and without autograd.
"""

from __future__ import annotations

import pytest
import torch
from helpers import sync_spy

from nnsight_lorsa.modules import Lorsa, LorsaConfig, RotaryConfig

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
ROTARIES = {
    "none": None,
    "default": RotaryConfig(head_dim=16, rotary_dim=16, base=10000.0),
    "linear": RotaryConfig(head_dim=16, rotary_dim=8, base=500.0, rope_type="linear", scaling={"factor": 2.0}),
    "llama3": RotaryConfig(head_dim=16, rotary_dim=16, base=500000.0, rope_type="llama3", scaling=LLAMA3,
                           interleaved=True),
    "yarn": RotaryConfig(head_dim=16, rotary_dim=16, base=10000.0, rope_type="yarn", attention_scaling=1.2,
                         scaling={"factor": 4.0, "original_max_position_embeddings": 64, "truncate": 0.0},
                         inv_freq_dtype="bfloat16"),
}


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("rotary", list(ROTARIES))
def test_forward_and_step_copy_nothing_from_the_host(rotary: str, grad: bool) -> None:
    cfg = LorsaConfig(d_model=32, n_qk_heads=4, d_qk_head=16, n_ov_heads=64, top_k=6, rotary=ROTARIES[rotary])
    lorsa = Lorsa(cfg, device="meta")
    x = torch.randn(2, 5, 32, device="meta", requires_grad=grad)
    with torch.set_grad_enabled(grad), sync_spy() as spy:
        lorsa(x)
        _, past = lorsa.forward_step(x)
        lorsa.forward_step(torch.randn(2, 1, 32, device="meta"), past=past)
    assert spy.copies == [], f"host-to-device copies in the Lorsa forward ({rotary} RoPE): {spy.copies}"
    assert spy.reads == [], f"device-to-host reads in the Lorsa forward ({rotary} RoPE): {spy.reads}"
