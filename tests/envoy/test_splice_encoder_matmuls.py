"""A spliced sparse coder multiplies its encoder once per site and forward, also when the splice runs it twice.

With ``error=True`` and its internals read or edited in the trace, the splice runs the module twice at a site: its
clean pass (stood down: the error term subtracts it) and its live pass (edits applied), on the same input. Both
computed ``x W_enc + b_enc``: two ``(tokens, d_in) × (d_in, d_sae)`` matmuls where the module's forward does one
(the attribution of a traced pass reads the features: every traced graph paid it). The live pass now gets a copy of
the clean pass's pre-activation when it is the same computation (``modules.sparse_coder.share_encoder_matmul``): same
input tensor, unmodified, same weights. Counted against one module forward; the outputs are the former ones bit for
bit, with edits of the features, of the pre-activations and of the module's input (replaced or in place)
(``share_encoder_matmul`` switched off gives the former computation).
"""

from __future__ import annotations

import pytest
import torch
from helpers import ACTIVATION_PARAMS, random_ids, tiny_nnsight
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import nnsight_lorsa.envoy.splice_chain as splice_chain_module
from nnsight_lorsa import CLTSet, SAESet, TranscoderSet, get_adapter
from nnsight_lorsa.modules import (
    CLTConfig,
    CrossLayerTranscoder,
    SAEConfig,
    SparseAutoencoder,
    Transcoder,
    TranscoderConfig,
)

MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.matmul", "aten.linear")


class EncoderMatmuls(TorchDispatchMode):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.storage = weight.untyped_storage().data_ptr()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if str(func.overloadpacket) in MATMULS and any(
                isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == self.storage
                for t in tree_flatten((args, kwargs))[0]):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _setup(kind: str):  # type: ignore[no-untyped-def]
    """(model, replace() -> envoy of the module's hooks, hook index, the module, its encoder weight)."""
    model, _ = tiny_nnsight("llama")
    d = get_adapter(model).d_model
    torch.manual_seed(0)
    if kind == "transcoder":
        t = Transcoder(TranscoderConfig(d_in=d, d_sae=64, activation="topk", activation_params={"k": 6}))
        s = TranscoderSet(model, {1: t})
        module = t
        replace = lambda: s.replace(layer=1, error=True)  # noqa: E731
    elif kind == "sae":
        sae = SparseAutoencoder(SAEConfig(d_in=d, d_sae=64, activation="jumprelu",
                                          activation_params=ACTIVATION_PARAMS["jumprelu"]))
        s = SAESet(model, {"model.layers.1": sae})
        module = sae
        replace = lambda: s.replace(error=True)["model.layers.1"]  # noqa: E731
    else:
        clt = CrossLayerTranscoder(CLTConfig(d_in=d, d_sae=32, n_layers=3, activation="relu"))
        s = CLTSet(model, clt)
        module = clt
        replace = lambda: s.replace(error=True)  # noqa: E731
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)
    return model, replace, module.eval()


def _hooks(envoy, kind: str, name: str):  # type: ignore[no-untyped-def]
    hook = getattr(envoy, name)
    return hook[1] if kind == "clt" else hook


KINDS = ["transcoder", "sae", "clt"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_read_of_the_features_with_error_terms_multiplies_the_encoder_once(kind: str) -> None:
    model, replace, module = _setup(kind)
    ids = random_ids()
    x = torch.randn(2, 10, module.cfg.d_in)
    with EncoderMatmuls(module.W_enc) as one, torch.no_grad():
        (module.encode_layer(x, 0) if kind == "clt" else module(x))
    with EncoderMatmuls(module.W_enc) as spy, torch.no_grad(), model.trace(ids):
        envoy = replace()
        _hooks(envoy, kind, "hook_sae_acts_post").output.save()
        model.output.save()
    sites = 3 if kind == "clt" else 1
    assert one.count == 1
    assert spy.count == sites * one.count, f"{spy.count} encoder matmuls for {sites} site(s) (was 2 each)"


EDITS = ["read", "features", "pre", "input-replaced", "input-in-place"]


def _run(model, replace, module, kind: str, edit: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad(), model.trace(random_ids()):
        envoy = replace()
        target = envoy  # the module's own input: a transcoder's or an SAE's (a CLT's layers are no calls of it)
        if edit == "read":
            _hooks(envoy, kind, "hook_sae_acts_post").output.save()
        elif edit == "features":
            _hooks(envoy, kind, "hook_sae_acts_post").output[:, -1, 3] = 2.0
        elif edit == "pre":
            _hooks(envoy, kind, "hook_sae_acts_pre").output[:, 2:] *= 1.5
        elif edit == "input-replaced":
            target.input = target.input * 0.5
        else:
            target.input[:, 1] *= -1.0
        out = model.output.logits.save()
    return out


@pytest.mark.parametrize(("kind", "edit"), [(k, e) for k in KINDS for e in EDITS
                                           if not (k == "clt" and e.startswith("input"))])
def test_the_outputs_are_the_former_ones_bit_for_bit(kind: str, edit: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, replace, module = _setup(kind)
    now = _run(model, replace, module, kind, edit)
    monkeypatch.setattr(splice_chain_module, "share_encoder_matmul", lambda m: False)
    before = _run(model, replace, module, kind, edit)
    assert torch.equal(now, before), (kind, edit, float((now - before).abs().max()))
    plain = _run(model, replace, module, kind, "read")  # every edit changes the logits (the edit ran)
    assert edit == "read" or not torch.equal(now, plain), (kind, edit)
