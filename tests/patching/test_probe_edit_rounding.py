"""``steer`` / ``scale`` with a tensor value on a bf16 / fp16 site equal the same edit made by hand on the envoy
(``site += delta``, ``site *= alpha``), bit for bit: the sum or product is rounded once, where it is written.

Before, the value was first cast to the site's dtype and the sum / product then computed in it (two roundings):
on a bf16 Llama an fp32 ``delta`` steered into an MHSA head moved the logits by up to 0.0029 from the manual
edit (fp16: 0.0005), a per-row ``alpha`` tensor likewise. Scalars were already exact (a Python number mixes with
a tensor without a cast). Reference: the manual edit, written here on the envoys.
"""

from __future__ import annotations

import torch
from helpers import make_lorsa, random_ids, tiny_hf_model, tiny_nnsight, unembed
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnsight_lorsa import LorsaSet, get_adapter
from nnsight_lorsa.patching import LorsaHead, MHSAHead, ReplacementModel, scale, steer

LAYER, HEAD, LORSA_HEAD = 1, 2, 5
_MODELS: dict[torch.dtype, tuple] = {}


def setup(dtype: torch.dtype):
    if dtype not in _MODELS:
        model, _ = tiny_nnsight("llama", dtype=dtype)
        adapter = get_adapter(model)
        lorsa = make_lorsa(tiny_hf_model("llama"), adapter, LAYER).to(dtype)
        _MODELS[dtype] = (model, adapter, ReplacementModel(model, lorsas=LorsaSet(model, {LAYER: lorsa}), error=True))
    return _MODELS[dtype]


@settings(max_examples=16, deadline=None, suppress_health_check=list(HealthCheck))
@given(dtype=st.sampled_from([torch.bfloat16, torch.float16]), op=st.sampled_from(["steer", "scale"]),
       kind=st.sampled_from(["mhsa", "lorsa"]), per=st.sampled_from(["row", "position", "all"]),
       position=st.integers(0, 7), seed=st.integers(0, 2**16))
def test_a_tensor_edit_on_a_half_site_is_the_manual_edit(dtype, op, kind, per, position, seed):
    model, adapter, r = setup(dtype)
    d = adapter.head_dim
    ids = random_ids(2, 8, seed=3)
    g = torch.Generator().manual_seed(seed)
    shape = {"row": (2, 1), "position": (1, 1), "all": (2, 1)}[per] + ((d,) if kind == "mhsa" else ())
    value = (torch.randn(shape, generator=g) if op == "steer" else 1 + 0.3 * torch.randn(shape, generator=g))
    if per == "all" and kind == "mhsa":
        value = value.expand(2, 1, d)
    edit = steer if op == "steer" else scale
    target = MHSAHead(LAYER, HEAD) if kind == "mhsa" else LorsaHead(LAYER, LORSA_HEAD)
    with torch.no_grad(), model.trace(ids):
        r.replace()
        edit(r(target), value, positions=[position])
        got = unembed(model).output.save()
    with torch.no_grad(), model.trace(ids):
        sites = r.replace()
        if kind == "mhsa":
            site = model.get(adapter.attention_path(LAYER) + ".o_proj").input
            cols = (slice(None), slice(position, position + 1), slice(HEAD * d, (HEAD + 1) * d))
        else:
            site = sites["lorsas"][LAYER].hook_z.output
            cols = (slice(None), slice(position, position + 1), LORSA_HEAD)
        if op == "steer":
            site[cols] += value
        else:
            site[cols] *= value
        want = unembed(model).output.save()
    assert got.dtype == want.dtype == dtype
    assert torch.equal(got, want), float((got.float() - want.float()).abs().max())  # was up to 0.0029 (bf16)
