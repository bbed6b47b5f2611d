"""Mutation probe, round 8 (set loading, offload and CLT subsets): tests for the mutants that survived the area's
tests (docs/reliability.md, "Mutation probe, round 8: set loading, offload and CLT subsets"). Each compares against
an independent reference: the documented rule (``from_pretrained``'s key, the ``offload`` switch's rollback), the
module's own forward, or a save / load round trip."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from helpers import D, make_clt, make_lorsa, make_sae, same_weights, tiny_llama_shared

from nnsight_lorsa import CLTSet, LorsaSet, ReplacementModel, SAESet
from nnsight_lorsa._placement import offloaded, set_offload
from nnsight_lorsa.envoy import replacement_set
from nnsight_lorsa.errors import ConfigMismatchError
from nnsight_lorsa.formats import load as load_module
from nnsight_lorsa.formats import save as save_module


@pytest.fixture(scope="module")
def llama():
    return tiny_llama_shared()  # read only here: the one tiny Llama the process shares


# ------------------------------------------------------------------------------------------ load_keyed / key_of_folder
def test_a_mapping_key_places_a_checkpoint_whatever_its_folder_or_record_says(llama, tmp_path):
    """``from_pretrained(model, {key: source})``: the key given places the module (load_keyed's documented
    ``{key: source}``), not the site its folder is named after nor the one its config records."""
    model, _, adapter = llama
    sae = make_sae(seed=3)
    sae.cfg.hook = adapter.layer_path(0)
    SAESet(model, {adapter.layer_path(0): sae}).save(tmp_path)
    back = SAESet.from_pretrained(model, {adapter.layer_path(2): tmp_path / adapter.layer_path(0)})
    assert list(back) == [adapter.layer_path(2)]
    x = torch.randn(3, D)
    assert torch.equal(back[adapter.layer_path(2)](x), sae(x))


def test_two_checkpoints_for_one_layer_are_refused(llama, tmp_path):
    """Two sources that both hold layer 1: refused (``ConfigMismatchError``, "a second Lorsa for layer 1"),
    not the second silently kept."""
    model, hf, adapter = llama
    for name, seed in (("a", 1), ("b", 2)):
        LorsaSet(model, {1: make_lorsa(hf, adapter, 1, seed=seed)}).save(tmp_path / name)
    with pytest.raises(ConfigMismatchError, match=r"second Lorsa for layer 1 \(the first came from layer_1\)"):
        LorsaSet.from_pretrained(model, [tmp_path / "a", tmp_path / "b"])


def test_a_layer_folder_names_the_layer_and_a_renamed_one_is_refused(llama, tmp_path):
    """``layer_<L>`` names the layer (the file's record counts only where the name is none): a folder renamed by
    hand to another layer is refused (the Lorsa records layer 1), not loaded at its recorded layer."""
    model, hf, adapter = llama
    lorsa = make_lorsa(hf, adapter, 1, seed=4)
    LorsaSet(model, {1: lorsa}).save(tmp_path / "set")
    back = LorsaSet.from_pretrained(model, tmp_path / "set")
    assert list(back) == [1] and same_weights(back[1], lorsa)
    shutil.copytree(tmp_path / "set" / "layer_1", tmp_path / "renamed" / "layer_2")
    with pytest.raises(ConfigMismatchError, match="trained for layer 1, not layer 2"):
        LorsaSet.from_pretrained(model, tmp_path / "renamed")


def test_a_folder_named_after_no_site_loads_at_the_sae_files_own_site(llama, tmp_path):
    """An SAE folder whose name is no module path (``my_sae``): ``key_of_folder`` is None and the file's own
    record of its site counts."""
    model, _, adapter = llama
    sae = make_sae(seed=5)
    sae.cfg.hook = adapter.layer_path(1)
    save_module(sae, tmp_path / "my_sae")
    back = SAESet.from_pretrained(model, tmp_path)
    assert list(back) == [adapter.layer_path(1)]
    assert same_weights(back[adapter.layer_path(1)], sae)


# ------------------------------------------------------------------------------------------------ the offload switch
class Injected(Exception):
    pass


@pytest.mark.parametrize("failure", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("value", [True, False])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_failed_switch_restores_mixed_marks_and_every_module(llama, value, k, failure):
    """A set whose modules are marked differently (flag unset, layer 0 offloaded, 1 not, 2 offloaded): ``set.offload
    = value`` whose ``k``-th module move fails (RuntimeError: an OOM's stand-in; Ctrl-C) leaves every module's own
    mark, where it is, and the flag (unset: it reads whether every module is offloaded) as before — the documented
    rollback. The moves are stand-ins that record where each module is."""
    model, hf, adapter = llama
    marks = {0: True, 1: False, 2: True}
    modules = {layer: make_lorsa(hf, adapter, layer, seed=layer) for layer in marks}
    for layer, mark in marks.items():
        set_offload(modules[layer], mark)
    s = LorsaSet(model, modules)
    assert s._offload is None and s.offload is False
    where = {layer: ("host" if mark else "device") for layer, mark in marks.items()}
    by_id = {id(m): layer for layer, m in modules.items()}
    calls = [0]

    def move(to: str):
        def stand_in(module, *args, **kwargs):
            calls[0] += 1
            if calls[0] == k:
                raise failure("injected")
            where[by_id[id(module)]] = to
        return stand_in

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replacement_set, "place", move("device"))
        mp.setattr(replacement_set, "store_on_host", move("host"))
        with pytest.raises(failure):
            s.offload = value
        assert s._offload is None and s.offload is False
        assert {layer: offloaded(m) for layer, m in modules.items()} == marks
        assert where == {layer: ("host" if mark else "device") for layer, mark in marks.items()}


def test_a_failed_switch_keeps_the_sets_own_flag_for_modules_added_later(llama):
    """``set.offload = True`` then a switch to False that fails part-way: the flag stays True (the documented
    rollback: "the flag ... as before"), so a module added afterwards is offloaded like the others, not left on
    the device because the flag was dropped to unset."""
    model, hf, adapter = llama
    s = LorsaSet(model, {0: make_lorsa(hf, adapter, 0, seed=0), 1: make_lorsa(hf, adapter, 1, seed=1)})
    s.offload = True

    def fail(*args, **kwargs):
        raise Injected("injected")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replacement_set, "place", fail)
        with pytest.raises(Injected):
            s.offload = False
    assert s._offload is True and all(offloaded(m) for m in s.values())
    fresh = make_lorsa(hf, adapter, 2, seed=2)
    assert not offloaded(fresh)
    s[2] = fresh
    assert offloaded(s[2])


def test_a_failed_model_level_switch_gives_each_set_back_its_own_flag(llama):
    """``ReplacementModel(..., offload=False)`` over two sets flagged offloaded whose switch fails in the second
    set: all or nothing, so the first set's flag is True again (not unset): a module added to it afterwards is
    offloaded like the others."""
    model, hf, adapter = llama
    lorsas = LorsaSet(model, {0: make_lorsa(hf, adapter, 0, seed=0), 1: make_lorsa(hf, adapter, 1, seed=1)})
    saes = SAESet(model, {adapter.layer_path(0): make_sae(seed=1)})
    lorsas.offload = saes.offload = True
    calls = [0]

    def fail_third(*args, **kwargs):  # the two Lorsas move, the SAE's move fails
        calls[0] += 1
        if calls[0] == 3:
            raise Injected("injected")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replacement_set, "place", fail_third)
        with pytest.raises(Injected):
            ReplacementModel(model, lorsas=lorsas, saes=saes, offload=False)
    assert calls[0] == 3
    assert lorsas._offload is True and saes._offload is True
    fresh = make_lorsa(hf, adapter, 2, seed=2)
    lorsas[2] = fresh
    assert offloaded(fresh)


# ------------------------------------------------------------------------------------------------------- CLT sets
def test_a_clt_subset_is_the_transformed_clt_whatever_the_keys(llama):
    """``CLTSet.subset(keys, transform)``: the CLT passed through ``transform`` (a copy cast to fp64 here, as for a
    remote run), ``keys`` selecting nothing (it spans every MLP); the original is untouched."""
    model, _, _ = llama
    clt = make_clt(n_layers=2)
    s = CLTSet(model, clt)
    cast = []

    def to64(m):
        cast.append(copy.deepcopy(m).to(torch.float64))
        return cast[-1]

    for keys in (None, [0, 1], ["clt"]):
        sub = s.subset(keys, transform=to64)
        assert isinstance(sub, CLTSet) and sub.clt is cast[-1] and sub.clt is not clt
        assert next(sub.clt.parameters()).dtype == torch.float64 and next(clt.parameters()).dtype == torch.float32
        assert same_weights(sub.clt.float(), clt)
    assert s.subset().clt is clt


def test_a_saved_clt_lies_in_the_sets_own_folder_and_loads_back(llama, tmp_path):
    """``CLTSet.save(d)`` writes the CLT where the set's ``folder`` says (``"."``: ``d`` itself, what the card of
    ``push_to_hub`` lists): ``formats.load(d / folder)`` reads it back, weights equal, and so does
    ``CLTSet.from_pretrained(model, d)``."""
    model, _, _ = llama
    clt = make_clt(n_layers=2, seed=3)
    s = CLTSet(model, clt)
    s.save(tmp_path)
    assert s.folder("clt") == "."
    assert (tmp_path / s.folder("clt") / "config.json").is_file()
    assert same_weights(load_module(tmp_path / s.folder("clt")), clt)
    assert same_weights(CLTSet.from_pretrained(model, tmp_path).clt, clt)


def test_a_subset_keeps_exactly_the_keys_it_names(llama):
    """``ReplacementSet.subset(keys)`` (what ``remote`` ships): a per-layer set keeps the layers among ``keys`` (none
    for an empty list; keys it lacks skipped), an SAE set the sites among them and those inside the layers among them;
    each kept module is ``transform``'s output."""
    model, hf, adapter = llama
    lorsas = LorsaSet(model, {layer: make_lorsa(hf, adapter, layer, seed=layer) for layer in (0, 1, 2)})
    for keys in ([], [1], [2, 5], [0, 1, 2], None):
        want = [0, 1, 2] if keys is None else [k for k in keys if k in (0, 1, 2)]
        sub = lorsas.subset(keys, transform=copy.deepcopy)
        assert list(sub) == want, keys
        assert all(sub[k] is not lorsas[k] and same_weights(sub[k], lorsas[k]) for k in sub)
    sites = [adapter.layer_path(0), adapter.layer_path(2)]
    saes = SAESet(model, {site: make_sae(seed=i) for i, site in enumerate(sites)})
    assert list(saes.subset([sites[1]])) == [sites[1]]
    assert list(saes.subset([sites[0], 7])) == [sites[0]]
    # layer numbers keep the SAEs inside those layers' blocks (until 2026-11-29 an SAE set kept every site)
    assert list(saes.subset([1])) == [] and list(saes.subset([])) == [] and list(saes.subset([2])) == [sites[1]]
    assert list(saes.subset([0, sites[1]])) == sites and list(saes.subset(None)) == sites
