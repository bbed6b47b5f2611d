"""Offloaded replacement modules (``ReplacementSet.offload``, ``ReplacementModel(offload=True)``): weights
stored on the host, each module copied to its site's device for its step only (``_placement.resident``).

On a CPU-only machine the copy to the "device" is ``t.to("cpu")``, which returns ``t`` itself; so the
mechanics are tested with ``fetch`` replaced by a real copy (``clone``): the results are bit-identical
to the resident modules', every module is fetched once per site and forward pass, its own parameters are
back in place after each step, and no copy outlives the forward pass (weak references). The CUDA case
(``gpu``) moves the model to the device and checks that the modules stay on the host.
"""

from __future__ import annotations

import gc
import weakref

import nnsight
import pytest
import torch
from helpers import DEVICES, LAYER, make_clt, make_lorsa, make_sae, make_transcoders, random_ids, tiny_nnsight, unembed

import nnsight_lorsa._placement as placement
from nnsight_lorsa import CLTSet, LorsaSet, ReplacementModel, TranscoderSet, get_adapter
from nnsight_lorsa.errors import ArgumentError
from nnsight_lorsa.patching import LorsaHead, ablate

GEN = {"do_sample": False, "pad_token_id": 1}


def bundle(model, hf, clt: bool = False, offload: bool = False) -> ReplacementModel:
    adapter = get_adapter(hf)
    lorsas = {layer: make_lorsa(hf, adapter, layer) for layer in range(adapter.n_layers)}
    tcs = CLTSet(model, make_clt(adapter.n_layers, skip=True)) if clt else \
        make_transcoders(range(adapter.n_layers), skip_layer=1)
    return ReplacementModel(model, lorsas=lorsas, transcoders=tcs, saes={adapter.attention_norm_path(0): make_sae()},
                            offload=offload)


def modules_of(rm: ReplacementModel) -> list[torch.nn.Module]:
    return [m for _, s in rm.sets() for m in s.values()]


def logits(model, ids, rm, edit=None):
    with torch.no_grad(), model.trace(ids):
        sites = rm.replace()
        if edit is not None:
            edit(sites)
        out = unembed(model).output.save()
    return out


class Fetches:
    """``fetch`` replaced by a real copy; counts each module's ``resident`` entries and keeps weak
    references to every copy."""

    def __init__(self, monkeypatch) -> None:
        self.entered: list[int] = []
        self.copies: list[weakref.ref] = []
        self.inside: list[bool] = []
        enter = placement.resident.__enter__

        def fetch(t, device):
            c = t.to(device).clone()
            self.copies.append(weakref.ref(c))
            return c

        def counting_enter(res):
            self.entered.append(id(res.module))
            out = enter(res)
            # inside the step: the module's parameters are the copies, not its own
            self.inside.append(all(any(p is r() for r in self.copies) for p in res.module.parameters()))
            return out

        monkeypatch.setattr(placement, "fetch", fetch)
        monkeypatch.setattr(placement.resident, "__enter__", counting_enter)

    def alive(self) -> int:
        gc.collect()
        return sum(r() is not None for r in self.copies)


@pytest.mark.parametrize("clt", [False, True], ids=["transcoders", "clt"])
def test_offloaded_replace_gives_the_resident_logits_bit_for_bit(clt, monkeypatch):
    """``replace()`` in a trace (error terms off: the replacement's own output reaches the logits) and with
    error terms on an edit: the same logits offloaded as resident; every module fetched once per site, its
    own parameters back after the step, no copy alive after the trace."""
    model, hf = tiny_nnsight("llama")
    rm = bundle(model, hf, clt)
    ids = random_ids(2, 12, seed=11)
    params = {id(m): [id(p) for p in m.parameters()] for m in modules_of(rm)}
    want = logits(model, ids, ReplacementModel(model, **dict(rm.sets()), error=False))

    def edit(sites):
        sites["lorsas"][LAYER].hook_z.output[..., :5] = 0

    want_edit = logits(model, ids, rm, edit)
    rm.lorsas.offload = rm.transcoders.offload = rm.saes.offload = True
    assert all(placement.offloaded(m) for m in modules_of(rm))
    fetches = Fetches(monkeypatch)
    got = logits(model, ids, ReplacementModel(model, **dict(rm.sets()), error=False))
    assert torch.equal(got, want)
    n_sites = {id(m): (hf.config.num_hidden_layers if clt and m is rm.transcoders.clt else 1) for m in modules_of(rm)}
    assert sorted(fetches.entered) == sorted(i for i, n in n_sites.items() for _ in range(n))
    assert fetches.inside and all(fetches.inside)
    for m in modules_of(rm):  # its own parameters back in place, on the host
        assert [id(p) for p in m.parameters()] == params[id(m)]
        assert {p.device.type for p in m.parameters()} == {"cpu"}
    assert fetches.alive() == 0, "a fetched copy outlived the trace"
    assert torch.equal(logits(model, ids, rm, edit), want_edit)
    assert not torch.equal(want, want_edit)  # not vacuous: the edit changes the logits


def test_offloaded_generation_fetches_every_module_once_per_step(monkeypatch):
    """``model.generate`` with an offloaded Lorsa: the same tokens and per-step logits as the resident one,
    one fetch per generated token's forward pass, none kept."""
    model, hf = tiny_nnsight("llama")
    lorsas = LorsaSet(model, {LAYER: make_lorsa(hf, get_adapter(hf), LAYER)})
    ids = random_ids(1, 8, seed=5)

    def run():
        with torch.no_grad(), model.generate(ids, max_new_tokens=4, min_new_tokens=4, **GEN) as tracer:
            lorsas.replace(LAYER, error=False)
            steps = nnsight.save([])
            for _ in tracer.iter[:4]:
                steps.append(unembed(model).output[:, -1].clone())
            out = nnsight.save(tracer.result)
        return out, torch.stack(list(steps))

    want = run()
    lorsas.offload = True
    fetches = Fetches(monkeypatch)
    got = run()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len(fetches.entered) == 4 and fetches.alive() == 0


def test_offloaded_patching_matches_the_resident_one():
    """A patching intervention (zero-ablating Lorsa heads through the bundle): the same logits offloaded."""
    model, hf = tiny_nnsight("llama")
    rm = bundle(model, hf)
    ids = random_ids(2, 10, seed=2)

    def ablated():
        with torch.no_grad(), model.trace(ids):
            rm.prepare([LorsaHead(LAYER, 3)])
            ablate(rm(LorsaHead(LAYER, 3)))
            ablate(rm(LorsaHead(LAYER, 4)))
            out = unembed(model).output.save()
        return out

    want = ablated()
    rm_off = ReplacementModel(model, **dict(rm.sets()), offload=True)
    assert rm_off.lorsas.offload and rm.lorsas.offload  # the flag is the sets'
    assert torch.equal(ablated(), want)


def test_offload_flag_moves_modules_and_is_checked():
    model, hf = tiny_nnsight("llama")
    tcs = TranscoderSet(model, make_transcoders([0, 1]))
    assert tcs.offload is False
    tcs.offload = True
    assert tcs.offload and all(placement.offloaded(m) for m in tcs.values())
    tcs[0] = make_transcoders([0])[0]  # inserted into an offloaded set: offloaded too
    assert placement.offloaded(tcs[0])
    tcs.offload = False
    assert not any(placement.offloaded(m) for m in tcs.values())
    with pytest.raises(ArgumentError, match=r"offload=.*must be True or False"):
        tcs.offload = "yes"
    with pytest.raises(ArgumentError, match=r"ReplacementModel\(offload=.*must be True or False"):
        ReplacementModel(model, transcoders=tcs, offload=1)


@pytest.mark.parametrize("device", DEVICES)
def test_offloaded_modules_stay_on_the_host_with_the_model_on_the_device(device):
    """With the model on ``device``: offloaded modules stay on the host (pinned where CUDA is available) and
    the replaced logits equal the resident modules' (relative bound 1e-6 of max |logit|: the same kernels)."""
    model, hf = tiny_nnsight("llama", device=device)
    rm = bundle(model, hf)
    ids = random_ids(2, 12, seed=3)
    want = logits(model, ids, ReplacementModel(model, **dict(rm.sets()), error=False))
    rm = ReplacementModel(model, **dict(rm.sets()), error=False, offload=True)
    for m in modules_of(rm):
        assert {p.device.type for p in m.parameters()} == {"cpu"}
        if torch.cuda.is_available():
            assert all(p.is_pinned() for p in m.parameters())
    got = logits(model, ids, rm)
    assert got.device.type == torch.device(device).type
    assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())
    for m in modules_of(rm):
        assert {p.device.type for p in m.parameters()} == {"cpu"}


def test_offloaded_modules_never_visit_the_sites_device(monkeypatch, tmp_path):
    """Modules given bare to ``ReplacementModel(..., offload=True)`` (mappings, a CLT) and those read by
    ``from_pretrained(..., offload=True)`` go straight to the host: the set never places them on their
    site's device (at the 8B shape they would not fit there all at once)."""
    import nnsight_lorsa.envoy.replacement_set as replacement_set

    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(hf)
    saved = LorsaSet(model, {LAYER: make_lorsa(hf, adapter, LAYER)})
    saved.save(tmp_path / "lorsas")

    def refuse(module, device, where):
        raise AssertionError(f"{type(module).__name__} for {where} placed on {device}")

    monkeypatch.setattr(replacement_set, "place", refuse)
    rm = ReplacementModel(model, lorsas={LAYER: make_lorsa(hf, adapter, LAYER)},
                          transcoders=make_clt(adapter.n_layers), saes={adapter.attention_norm_path(0): make_sae()},
                          offload=True)
    assert all(placement.offloaded(m) for m in modules_of(rm)) and all(s.offload for _, s in rm.sets())
    loaded = LorsaSet.from_pretrained(model, tmp_path / "lorsas", offload=True)
    assert loaded.offload and placement.offloaded(loaded[LAYER])
    with pytest.raises(ArgumentError, match=r"from_pretrained\(offload=.*must be True or False"):
        LorsaSet.from_pretrained(model, tmp_path / "lorsas", offload="yes")
    with pytest.raises(AssertionError, match="placed on"):  # not vacuous: a resident set does place them
        LorsaSet.from_pretrained(model, tmp_path / "lorsas")


@pytest.mark.parametrize("fmt", ["nnsight_lorsa", "circuit_tracer"])
def test_a_clt_set_loads_offloaded_like_every_set(monkeypatch, tmp_path, fmt):
    """``CLTSet.from_pretrained(..., offload=True)``, as the other sets' (the one contract): the CLT, the
    largest replacement (it spans every MLP), goes straight to the host, never placed on its site's device,
    and replaces as the resident one does; ``offload`` is checked (was a raw TypeError from the reader)."""
    import nnsight_lorsa.envoy.replacement_set as replacement_set
    from nnsight_lorsa import save

    model, hf = tiny_nnsight("llama")
    clt = make_clt(get_adapter(hf).n_layers)
    save(clt, tmp_path / "clt", format=fmt)
    ids = random_ids()
    want = logits(model, ids, ReplacementModel(model, transcoders=CLTSet.from_pretrained(model, tmp_path / "clt")))

    def refuse(module, device, where):
        raise AssertionError(f"{type(module).__name__} for {where} placed on {device}")

    monkeypatch.setattr(replacement_set, "place", refuse)
    loaded = CLTSet.from_pretrained(model, tmp_path / "clt", offload=True)
    assert loaded.offload and placement.offloaded(loaded.clt)
    assert torch.equal(logits(model, ids, ReplacementModel(model, transcoders=loaded)), want)
    with pytest.raises(ArgumentError, match=r"from_pretrained\(offload=.*must be True or False"):
        CLTSet.from_pretrained(model, tmp_path / "clt", offload="yes")
