"""The replacement modules' forwards neither copy from the host nor read a value back from the device.

On CUDA either one (a ``non_blocking=False`` host-to-device copy, or ``.item()`` / ``int(t)`` / ``nonzero`` ...)
makes the host wait for every kernel queued before it: inside ``model.trace`` until the layers before have run,
and at every ``generate`` step. Checked on ``meta`` under a dispatch-mode spy (``helpers.sync_spy``; the Lorsa:
``test_lorsa_host_copies.py``) for every sparse coder kind and activation, the cross-layer transcoder and the
gated attention function in each gate mode. A ``BatchTopK`` in eval mode chose its rule by reading ``n_updates``
(``int(self.n_updates)``): it is mirrored on the host now, with the same results (checked bit for bit below).
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import ACTIVATION_PARAMS, sync_spy
from hypothesis import given, settings
from hypothesis import strategies as st

from nnsight_lorsa.modules import (
    CLTConfig,
    CrossLayerTranscoder,
    SAEConfig,
    SkipTranscoder,
    SparseAutoencoder,
    Transcoder,
    TranscoderConfig,
)
from nnsight_lorsa.modules.activations import BatchTopK
from nnsight_lorsa.modules.attention_gate import AttentionGate
from nnsight_lorsa.sparse_attention.attention import gated_attention_forward

PARAMS = ACTIVATION_PARAMS
#: a BatchTopK whose threshold was set, and one never trained (eval falls back to the batch rule)
ACTIVATIONS = [*PARAMS, "batchtopk-untrained"]
KINDS = {"sae": lambda **kw: SparseAutoencoder(SAEConfig(d_in=16, d_sae=32, **kw)),
         "sae-layer_norm": lambda **kw: SparseAutoencoder(SAEConfig(d_in=16, d_sae=32,
                                                                    normalize_activations="layer_norm", **kw)),
         "transcoder": lambda **kw: Transcoder(TranscoderConfig(d_in=16, d_sae=32, **kw)),
         "skip-transcoder": lambda **kw: SkipTranscoder(TranscoderConfig(d_in=16, d_sae=32, **kw))}


def _activation(name: str) -> dict:
    act = name.split("-")[0]
    return {"activation": act, "activation_params": PARAMS[act]}


def _ready(module: torch.nn.Module, activation: str) -> torch.nn.Module:
    if activation == "batchtopk":
        for m in module.modules():
            if isinstance(m, BatchTopK):
                m.set_threshold(0.1)
    return module.eval().to("meta")


def _assert_no_sync(spy, what: str) -> None:
    assert spy.copies == [], f"host-to-device copies in {what}: {spy.copies}"
    assert spy.reads == [], f"device-to-host reads in {what}: {spy.reads}"


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_sparse_coder_forward_syncs_nothing(kind: str, activation: str, grad: bool) -> None:
    coder = _ready(KINDS[kind](**_activation(activation)), activation)
    x = torch.randn(2, 5, 16, device="meta", requires_grad=grad)
    with torch.set_grad_enabled(grad), sync_spy() as spy:
        coder(x)
        coder.decode(coder.encode(x))
    _assert_no_sync(spy, f"the {kind} forward ({activation})")


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_clt_forward_syncs_nothing(activation: str, skip: bool) -> None:
    clt = _ready(CrossLayerTranscoder(CLTConfig(d_in=16, d_sae=32, n_layers=3, skip=skip, **_activation(activation))),
                 activation)
    xs = torch.randn(3, 2, 5, 16, device="meta")
    with torch.no_grad(), sync_spy() as spy:
        clt(xs)
        acts = [clt.encode_layer(xs[layer], layer) for layer in range(3)]
        clt.reconstruct_layer(acts, 2, xs[2])
    _assert_no_sync(spy, f"the CLT forward ({activation})")


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("mask", ["none", "float", "bool"])
@pytest.mark.parametrize("mode", ["gated", "dense", "topk"])
def test_gated_attention_syncs_nothing(mode: str, mask: str, training: bool) -> None:
    module = torch.nn.Module()
    module.gate = AttentionGate(4, init_bias=1.0, mode=mode, top_k=2)
    module.to("meta").train(training)
    q, k, v = (torch.randn(2, 4, 5, 8, device="meta") for _ in range(3))
    masks = {"none": None, "float": torch.zeros(2, 1, 5, 5, device="meta"),
             "bool": torch.ones(2, 1, 5, 5, dtype=torch.bool, device="meta")}
    with torch.set_grad_enabled(training), sync_spy() as spy:
        gated_attention_forward(module, q, k[:, :2], v[:, :2], masks[mask], softcap=30.0)
    _assert_no_sync(spy, f"the gated attention ({mode} gate, {mask} mask)")


def _reference(x: torch.Tensor, act: BatchTopK) -> torch.Tensor:
    """The eval rule read straight from the buffers (the code before the host mirror)."""
    if int(act.n_updates) == 0:
        return act.batch_topk(x)
    return x * (x > act.threshold.to(x.dtype)).to(x.dtype)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), theta=st.floats(-1.0, 1.0), n=st.integers(0, 3),
       how=st.sampled_from(["set", "load-cpu", "zero_", "fill_", "deepcopy", "half", "train"]))
def test_batchtopk_host_mirror_gives_the_buffer_rule(seed: int, theta: float, n: int, how: str) -> None:
    """Whatever way ``n_updates`` is written (the module's methods, a loaded state, an in-place write from outside,
    a copy, a cast, training steps), the eval forward applies the rule the buffer holds, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, 32, generator=g)
    act = BatchTopK(k=4, d_sae=32)
    if how == "set":
        act.set_threshold(theta)
    elif how == "load-cpu":
        act.load_state_dict({"threshold": torch.tensor(theta), "n_updates": torch.tensor(n)})
    elif how == "zero_":
        act.set_threshold(theta)
        act.n_updates.zero_()
    elif how == "fill_":
        act.n_updates.fill_(n)
    elif how == "deepcopy":
        act.set_threshold(theta)
        act = copy.deepcopy(act)
        act.n_updates.fill_(n)
    elif how == "half":
        act.set_threshold(theta)
        act = act.half()
        x = x.half()
    else:
        act.train()
        for _ in range(n):
            act(torch.randn(3, 4, 32, generator=g))
    act.eval()
    assert torch.equal(act(x), _reference(x, act))
