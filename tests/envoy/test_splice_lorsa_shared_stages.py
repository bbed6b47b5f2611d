"""A spliced Lorsa computes its queries, keys, values and (edits allowing) ``z_pre`` once per site and forward, also
when the splice runs it twice.

With ``error=True`` and its internals read or edited in the trace (every ``attribute(rm, tracer=tracer)`` too), the
splice runs the Lorsa twice at a site: its clean pass (stood down: the error term subtracts it) and its live pass
(edits applied), on the same input. Both projected q, k, v and attended (the Q/K projections + RoPE are half a Lorsa
forward at the paper's shape). The live pass now gets copies of the clean pass's q, k (after QK-norm and RoPE) and v
-- no hook point lies before them -- and of its ``z_pre`` when ``hook_q``/``hook_k``/``hook_v`` passed those copies
on unedited (``modules.sparse_coder.shared_pre``, the encoder sharing's helper): same input tensor (object, version),
same positions and mask, same parameters, same grad mode. Counted against one module forward (the top-k and the
decode stay per pass: an edit may change them); the logits are the former ones bit for bit with an edit at every
hook point, and with the input replaced or edited in place (sharing refused), and a traced attribution graph is the
former one bit for bit (``share_encoder_matmul`` switched off gives the former computation).
"""

from __future__ import annotations

import nnsight
import pytest
import torch
from helpers import attribution_setup, make_lorsa, random_ids, rm, tiny_nnsight
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import nnsight_lorsa.envoy.splice_chain as splice_chain_module
from nnsight_lorsa import LorsaSet, get_adapter
from nnsight_lorsa.attribution import attribute
from nnsight_lorsa.modules import Lorsa, LorsaConfig, RotaryConfig
from nnsight_lorsa.modules.lorsa import LorsaKV
from nnsight_lorsa.modules.sparse_coder import end_encoder_matmul, share_encoder_matmul

MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.matmul", "aten.linear")


class Stages(TorchDispatchMode):
    """Counts the matmuls (and concatenations) reading W_Q's, W_K's, W_V's and W_O's storages, and the attention
    kernels."""

    def __init__(self, lorsa) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.storages = {name: getattr(lorsa, name).untyped_storage().data_ptr() for name in ("W_Q", "W_K", "W_V",
                                                                                             "W_O")}
        self.counts = dict.fromkeys([*self.storages, "sdpa"], 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func.overloadpacket)
        if "scaled_dot_product" in name or name == "aten._safe_softmax":  # SDPA, fused or its math path
            self.counts["sdpa"] += 1
        if name in MATMULS or name == "aten.cat":  # (with x's gradient: one matmul of the W_Q, W_K concatenated)
            ptrs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                    if isinstance(t, torch.Tensor)}
            for w, ptr in self.storages.items():
                self.counts[w] += ptr in ptrs
        return func(*args, **(kwargs or {}))


def _setup():  # type: ignore[no-untyped-def]
    model, hf = tiny_nnsight("llama")
    lorsa = make_lorsa(hf, get_adapter(model), 1)
    return model, LorsaSet(model, {1: lorsa}), lorsa.eval()


EDITS = ["read", "q", "k", "v", "q-read", "z_pre", "z", "out", "input-replaced", "input-in-place"]


def _run(model, lorsas, edit: str) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad(), model.trace(random_ids()):
        envoy = lorsas.replace(layer=1, error=True)
        if edit == "read":
            envoy.hook_z.output.save()
        elif edit == "q":
            envoy.hook_q.output[:, :, 2:] *= 1.5  # in place
        elif edit == "k":
            envoy.hook_k.output = envoy.hook_k.output * 0.5  # replaced
        elif edit == "v":
            envoy.hook_v.output[:, 1] = 3.0
        elif edit == "q-read":  # read only: z_pre is still shared
            envoy.hook_q.output.save()
        elif edit == "z_pre":
            envoy.hook_z_pre.output[:, -1, 3] = 5.0
        elif edit == "z":
            envoy.hook_z.output[:, -1, 3] = 2.0
        elif edit == "out":
            envoy.hook_out.output *= 0.5
        elif edit == "input-replaced":
            envoy.input = envoy.input * 0.5
        else:
            envoy.input[:, 1] *= -1.0
        out = model.output.logits.save()
    return out


def test_a_read_of_the_heads_with_error_terms_projects_and_attends_once() -> None:
    model, lorsas, lorsa = _setup()
    x = torch.randn(2, 10, lorsa.cfg.d_model)
    with Stages(lorsa) as one, torch.no_grad():
        lorsa(x)
    with Stages(lorsa) as spy, torch.no_grad(), model.trace(random_ids()):
        lorsas.replace(layer=1, error=True).hook_z.output.save()
        model.output.save()
    assert one.counts["W_Q"] >= 1 and one.counts["sdpa"] >= 1
    want = {**one.counts, "W_O": 2 * one.counts["W_O"]}  # the decode: once per pass
    assert spy.counts == want, f"{spy.counts} for one site, one module forward: {one.counts} (was 2 each)"


@pytest.mark.parametrize(("edit", "shares"), [("q-read", {"W_Q", "W_K", "W_V", "sdpa"}),
                                              ("q", {"W_Q", "W_K", "W_V"}), ("v", {"W_Q", "W_K", "W_V"}),
                                              ("input-replaced", set()), ("input-in-place", set())])
def test_what_is_shared_under_edits(edit: str, shares: set) -> None:
    """An edit at hook_q/hook_k/hook_v: q, k, v shared, the attention not; the input edited: nothing shared."""
    model, lorsas, lorsa = _setup()
    with Stages(lorsa) as one, torch.no_grad():
        lorsa(torch.randn(2, 10, lorsa.cfg.d_model))
    with Stages(lorsa) as spy:
        _run(model, lorsas, edit)
    want = {w: n * (1 if w in shares else 2) for w, n in one.counts.items()}
    assert spy.counts == want, (edit, spy.counts, want)


@pytest.mark.parametrize("edit", EDITS)
def test_the_outputs_are_the_former_ones_bit_for_bit(edit: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, lorsas, _ = _setup()
    now = _run(model, lorsas, edit)
    monkeypatch.setattr(splice_chain_module, "share_encoder_matmul", lambda m: False)
    before = _run(model, lorsas, edit)
    assert torch.equal(now, before), (edit, float((now - before).abs().max()))
    plain = _run(model, lorsas, "read")  # every edit changes the logits (the edit ran)
    assert edit in ("read", "q-read") or not torch.equal(now, plain), edit


def _traced_graph(model, bundle, ids: torch.Tensor, edit: str):  # type: ignore[no-untyped-def]
    with model.trace(ids) as tracer:
        spliced = bundle.replace()
        handle = attribute(bundle, tracer=tracer, batch_size=40)
        if edit == "z":
            spliced["lorsas"][1].hook_z.output[0, 3, 5] += 1.0
        elif edit == "q":
            spliced["lorsas"][1].hook_q.output[:, :, 2:] *= 1.5
        logits = nnsight.save(model.lm_head.output)
    return handle.graph, logits


@pytest.mark.parametrize("edit", ["none", "z", "q"])
def test_a_traced_attribution_graph_is_the_former_one_bit_for_bit(edit: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _, lorsas, tcs = attribution_setup("llama")
    bundle = rm(model, lorsas, tcs)
    ids = random_ids(1, 8, seed=2)[0]
    lorsa = lorsas[1]
    with Stages(lorsa) as spy:
        now, logits_now = _traced_graph(model, bundle, ids, edit)
    monkeypatch.setattr(splice_chain_module, "share_encoder_matmul", lambda m: False)
    with Stages(lorsa) as spy_before:
        before, logits_before = _traced_graph(model, bundle, ids, edit)
    assert spy.counts["W_V"] < spy_before.counts["W_V"], (spy.counts, spy_before.counts)
    same = lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)  # noqa: E731 (bit for bit)
    same(logits_now, logits_before)
    for field in ("kind", "layer", "pos", "index", "activation", "intervened"):
        same(getattr(now.nodes, field), getattr(before.nodes, field))
    same(now.feature_rows, before.feature_rows)
    same(now.values, before.values)  # (NaN: no value, as before)
    same(now.densify(), before.densify())


# ---- the module alone: two calls under share_encoder_matmul, as a splice makes them (plain PyTorch hooks edit)
HOOKS = ["hook_q", "hook_k", "hook_v", "hook_z_pre", "hook_z", "hook_out"]
ROPE = RotaryConfig(head_dim=8, rotary_dim=8, base=10000.0)


def _two_calls(lorsa, x, positions, mask, past, grad: bool, edit: str | None, hook: str, weight_edit: bool,
               shared: bool):  # type: ignore[no-untyped-def]
    """(first output, second output, counts, x's gradient): the second call with ``edit`` at ``hook``."""
    x = x.detach().clone().requires_grad_(grad)
    spy = Stages(lorsa)
    with torch.set_grad_enabled(grad), spy:
        if shared:
            share_encoder_matmul(lorsa)
        try:
            first = lorsa(x, positions, mask, past=past, kv_out={})
            if weight_edit:
                with torch.no_grad():
                    lorsa.W_V[0] += 0.0  # the same values, the version moved: not the same computation
            handle = None
            if edit == "in-place":
                handle = getattr(lorsa, hook).register_forward_hook(lambda m, a, out: out.mul_(1.25))
            elif edit == "replaced":
                handle = getattr(lorsa, hook).register_forward_hook(lambda m, a, out: out * 1.25)
            elif edit == "input":
                with torch.no_grad():
                    x[:, 0] *= 1.0  # the same values, the version moved
            try:
                second = lorsa(x, positions, mask, past=past, kv_out={})
            finally:
                if handle is not None:
                    handle.remove()
        finally:
            end_encoder_matmul(lorsa)
    grad_x = torch.autograd.grad(second.square().sum(), x)[0] if grad else None  # (not counted)
    return first, second, spy.counts, grad_x


@settings(max_examples=30, deadline=None)
@given(edit=st.sampled_from([None, "in-place", "replaced", "input"]), hook=st.sampled_from(HOOKS),
       qk_norm=st.booleans(), rotary=st.booleans(), masked=st.booleans(), with_past=st.booleans(),
       positions=st.booleans(), grad=st.booleans(), weight_edit=st.booleans(), seed=st.integers(0, 99))
def test_two_calls_of_the_module_share_what_no_edit_reaches(edit, hook, qk_norm, rotary, masked, with_past,
                                                             positions, grad, weight_edit, seed) -> None:
    torch.manual_seed(seed)
    cfg = LorsaConfig(d_model=24, n_qk_heads=3, d_qk_head=8, n_ov_heads=48, top_k=5, qk_norm=qk_norm,
                      rotary=ROPE if rotary else None)
    lorsa = Lorsa(cfg)
    with torch.no_grad():
        for p in lorsa.parameters():
            p.add_(0.1 * torch.randn_like(p))
    b, s, n_past = 2, 6, 3
    x = torch.randn(b, s, 24)
    past = LorsaKV(torch.randn(b, 3, n_past, 8), torch.randn(b, n_past, 48)) if with_past else None
    keys = s + (n_past if with_past else 0)
    mask = None
    if masked:
        mask = torch.ones(b, keys, dtype=torch.long)
        mask[0, :2] = 0
    pos = torch.arange(keys - s, keys) if positions else None
    state = {k: v.clone() for k, v in lorsa.state_dict().items()}
    now = _two_calls(lorsa, x, pos, mask, past, grad, edit, hook, weight_edit, shared=True)
    lorsa.load_state_dict(state)
    before = _two_calls(lorsa, x, pos, mask, past, grad, edit, hook, weight_edit, shared=False)
    for a, c in zip(now[:2], before[:2], strict=True):
        assert torch.equal(a, c)
    if grad:
        assert torch.equal(now[3], before[3])
    counts, base = now[2], before[2]
    if edit == "input" or weight_edit:
        assert counts == base  # nothing shared
        return
    assert counts["W_Q"] * 2 == base["W_Q"] and counts["W_V"] * 2 == base["W_V"]  # q, k, v: once
    attention_shared = edit is None or hook not in ("hook_q", "hook_k", "hook_v")
    assert counts["sdpa"] * (2 if attention_shared else 1) == base["sdpa"], (counts, base)
    assert counts["W_O"] == base["W_O"]  # the decode: each call
