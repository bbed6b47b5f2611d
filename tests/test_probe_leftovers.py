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

import copy
import functools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import generated, make_lorsa, make_transcoders, tiny_nnsight
from hypothesis import strategies as st
from test_probe_interrupt import FAILURES
from torch.utils._python_dispatch import TorchDispatchMode

import nnsight_lorsa.envoy.replacement_set as replacement_set
import nnsight_lorsa.training.objective_base as objective_base
from nnsight_lorsa import LorsaSet, ReplacementModel, TranscoderSet
from nnsight_lorsa._placement import OFFLOAD_ATTR
from nnsight_lorsa.modules.activations import AbsTopK, BatchTopK, GroupMax, JumpReLU, TopK
from nnsight_lorsa.modules.clt import CLTConfig, CrossLayerTranscoder
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
from nnsight_lorsa.modules.transcoder import SkipTranscoder, Transcoder, TranscoderConfig
from nnsight_lorsa.training.lorsa_objective import LorsaObjective
from nnsight_lorsa.training.lorsa_recipe import HeadBalance
from nnsight_lorsa.training.master_weights import MasterWeights
from nnsight_lorsa.training.objective_base import TrainingState
from nnsight_lorsa.training.objectives import _objective_for


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


# ------------------------------------------------------------------ 1. the fold, row chunk by row chunk
def former_fold(obj, module):
    """The fold as it was until 2026-11-28 (written out here): a deep copy of the module as held inside
    ``editing`` (a bf16 module's fp32 masters), folded whole in place."""
    out = copy.deepcopy(module)
    if isinstance(module, CrossLayerTranscoder):
        kw = {"dtype": module.W_enc.dtype, "device": module.W_enc.device}
        s_in = torch.tensor(obj.s_in_layers, **kw)[:, None, None]
        s_out = torch.tensor(obj.s_out_layers, **kw)[:, None, None]
        out.eval()
        out.W_enc.mul_(s_in)
        for layer in range(out.n_layers):
            out.W_dec(layer).div_(s_out[layer:, 0, 0][None, :, None])
        out.b_dec.div_(s_out[:, 0])
        if out.W_skip is not None:
            out.W_skip.mul_(s_in / s_out)
        return out
    if isinstance(obj, LorsaObjective):
        for w in (out.W_Q, out.W_K, out.W_V):
            w.mul_(obj.s_in)
        out.W_O.div_(obj.s_out)
        if out.b_D is not None:
            out.b_D.div_(obj.s_out)
        norm = out.W_O.norm(dim=1).clamp_min(1e-12)
        out.W_O.div_(norm[:, None])
        out.W_V.mul_(norm[:, None])
        out.b_V.mul_(norm)
        if obj.balance is not None and bool((obj.balance.log_gain != 0).any()):
            g = obj.balance.gain().to(out.W_V)
            out.W_V.mul_(g[:, None])
            out.b_V.mul_(g)
            out.W_O.div_(g[:, None])
        return out
    out.eval()
    out.W_enc.mul_(obj.s_in)
    out.W_dec.div_(obj.s_out)
    out.b_dec.div_(obj.s_out)
    if getattr(out, "W_skip", None) is not None:
        out.W_skip.mul_(obj.s_in / obj.s_out)
    if isinstance(out.activation, (TopK, AbsTopK, GroupMax)):
        common = out.W_dec.norm(dim=-1).mean().clamp_min(1e-12)
        out.W_dec.div_(common)
        out.W_enc.mul_(common)
        out.b_enc.mul_(common)
    elif not isinstance(out.activation, BatchTopK):
        norm = out.W_dec.norm(dim=-1).clamp_min(1e-12)
        out.W_dec.div_(norm[:, None])
        out.W_enc.mul_(norm[None, :])
        out.b_enc.mul_(norm)
        if isinstance(out.activation, JumpReLU):
            out.activation.threshold.mul_(norm)
    return out


SPARSE_ACTS = {"relu": {}, "jumprelu": {"threshold": 0.05}, "topk": {"k": 4}, "abstopk": {"k": 4},
               "groupmax": {"k": 4}, "batchtopk": {"k": 4}}


def drawn_module(kind: str, act: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "lorsa":
        _, hf, adapter = world()
        return make_lorsa(hf, adapter, 1, seed=seed)
    if kind == "clt":
        clt = CrossLayerTranscoder(CLTConfig(d_in=12, d_sae=20, n_layers=3, activation=act,
                                             activation_params=SPARSE_ACTS[act], skip=seed % 2 == 0))
        for p in clt.parameters():
            p.data.normal_(0, 0.5)
        return clt
    if kind == "sae":
        m = SparseAutoencoder(SAEConfig(d_in=12, d_sae=40, activation=act, activation_params=SPARSE_ACTS[act]))
    else:
        cls = SkipTranscoder if kind == "skip" else Transcoder
        m = cls(TranscoderConfig(d_in=12, d_out=10, d_sae=40, activation=act, activation_params=SPARSE_ACTS[act]))
    for name, p in m.named_parameters():
        if "threshold" not in name:
            p.data.normal_(0, 0.5)
    return m


def bits(module: torch.nn.Module) -> dict:
    return {k: (v.dtype, tuple(v.shape), v.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            for k, v in module.state_dict().items()}


@generated(12, 200, kind=st.sampled_from(["lorsa", "sae", "transcoder", "skip", "clt"]),
           act=st.sampled_from(sorted(SPARSE_ACTS)), dtype=st.sampled_from([torch.float32, torch.bfloat16,
                                                                             torch.float16]),
           s_in=st.floats(0.05, 20), s_out=st.floats(0.05, 20), chunk=st.integers(1, 400), seed=st.integers(0, 99),
           gain=st.booleans())
def test_the_chunked_fold_bit_equals_the_former_fold(kind, act, dtype, s_in, s_out, chunk, seed, gain):
    """``objective.fold`` (row chunks of ``chunk`` elements written into the rounded copy) bit-equals the former
    fold (the whole module copied as held in ``editing``, folded in place, each parameter then rounded once) for
    every objective, activation and master dtype (bf16 / fp16: fp32 masters holding values off the low-precision
    grid; fp32: none); a Lorsa with balancing gains (``gain``). State dicts compared byte for byte, dtypes too."""
    module = drawn_module(kind, act, seed).to(dtype)
    obj = _objective_for(module)
    g = torch.Generator().manual_seed(seed)
    masters = MasterWeights(module.parameters())
    masters.add_buffers(module)
    with torch.no_grad():
        for m in [*masters.masters(), *masters.buffer_masters()]:
            m.add_(1e-3 * torch.randn(m.shape, generator=g) * m.abs().clamp_min(1e-3))  # off the bf16 grid
        masters.round_()
        masters.round_buffers_()
    if kind == "clt":
        n = module.n_layers
        obj.s_in_layers = [s_in * (1 + 0.1 * i) for i in range(n)]
        obj.s_out_layers = [s_out * (1 - 0.05 * i) for i in range(n)]
    else:
        obj.s_in, obj.s_out = s_in, (s_in if kind == "sae" else s_out)
    if kind == "lorsa" and gain:
        obj.balance = HeadBalance(module.cfg.n_ov_heads, module.cfg.top_k)
        obj.balance.log_gain = 0.3 * torch.randn(module.cfg.n_ov_heads, generator=g)
    state = TrainingState(SimpleNamespace(masters=masters))
    with masters.editing(module):
        want = former_fold(obj, module)
    low = {name: p.dtype for name, p in module.named_parameters() if masters.has(p)}  # (outside: the module's own
    for name, q in want.named_parameters():  # parameters again) each fp32 copy rounded once, as the former fold did
        if name in low and q.dtype != low[name]:
            q.data = q.data.to(low[name])
    with pytest.MonkeyPatch.context() as mp, masters.editing(module):
        mp.setattr(objective_base, "FOLD_CHUNK", chunk)
        got = obj.fold(state)
    assert type(got) is type(want) and got.training == want.training
    assert bits(got) == bits(want), f"{kind} {act} {dtype}: the fold differs"


class _Largest(TorchDispatchMode):
    """Records the largest float32 tensor any op allocates (elements; not the views it returns)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.op = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {a.untyped_storage().data_ptr() for a in [*args, *(kwargs or {}).values()]
                 if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:  # (views of an input allocate nothing)
            if (isinstance(t, torch.Tensor) and t.dtype == torch.float32
                    and t.untyped_storage().data_ptr() not in given and t.numel() > self.largest):
                self.largest, self.op = t.numel(), str(func)
        return out


@pytest.mark.parametrize("kind", ["lorsa", "sae", "skip", "clt"])
def test_a_bf16_fold_holds_no_fp32_copy_of_a_parameter(kind):
    """A bf16 module's fold (fp32 masters) never makes an fp32 tensor larger than a row chunk (``FOLD_CHUNK``
    elements, or one row / the norms vector where that is larger): no fp32 copy of the module or of a whole
    parameter (the former fold: a deep copy of the fp32 masters, 2x the bf16 module, then each rounded: 2.5x)."""
    module = drawn_module(kind, "jumprelu", 0).to(torch.bfloat16)
    obj = _objective_for(module)
    if kind == "clt":
        obj.s_in_layers, obj.s_out_layers = [2.0, 3.0, 4.0], [0.5, 0.25, 0.2]
    else:
        obj.s_in, obj.s_out = 2.0, (2.0 if kind == "sae" else 0.5)
    masters = MasterWeights(module.parameters())
    chunk = 64
    biggest = max(p.numel() for p in module.parameters())
    allowed = max(chunk, *(p.shape[0] for p in module.parameters() if p.dim()),
                  *(p[0].numel() for p in module.parameters() if p.dim() > 1))
    assert biggest > 2 * allowed, "the module is too small to tell a chunk from a parameter"
    with pytest.MonkeyPatch.context() as mp, masters.editing(module):
        mp.setattr(objective_base, "FOLD_CHUNK", chunk)
        spy = _Largest()
        with spy:
            obj.fold(TrainingState(SimpleNamespace(masters=masters)))
    assert spy.largest <= allowed, f"{kind}: an fp32 tensor of {spy.largest} elements (a chunk: {allowed}; {spy.op})"


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc (VmHWM reset)")
@pytest.mark.parametrize("name", ["SAE", "Lorsa", "TopK transcoder", "CLT"])
def test_peak_host_memory_of_a_bf16_fold(name):
    """``Trainer.folded()`` of a 68-84 MB bf16 module with fp32 masters, in a fresh interpreter
    (``benchmarks/host_memory_paths.py``): the peak is the folded copy plus row chunks, ≤ 2.2x (measured 1.04-1.14x;
    in some runs 1.8-2.0x, docs/reliability.md; the former fold: 2.4-2.5x)."""
    from benchmarks.host_memory_paths import CASES, measure

    (_, setup, op, _), = [c for c in CASES if c[0] == f"Trainer.folded ({name}, bf16 + fp32 masters)"]
    row = measure(setup, op)
    assert row["peak"] <= 2.2, f"{name}: peak {row['peak']:.2f}x the bf16 module"
