"""What a load by repo id downloads (the hub / viz probe, docs/reliability.md).

A fake *online* Hub: repos are folders; ``huggingface_hub.snapshot_download`` is replaced by one that copies the
files matching ``allow_patterns`` (huggingface_hub's own ``filter_repo_objects``) into one snapshot folder per
commit, which later downloads of that commit add to — what an online download does to the cache — and records
every file it fetched. Each repo holds the checkpoint (or set) to load beside others (a Lorsa set, SAEs, a
circuit-tracer CLT, stray weights, nested deeper): the load must fetch every file of what it reads, no weight file
of anything else, and load what the local folder loads, bit for bit.
"""

from __future__ import annotations

import hashlib
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from helpers import make_clt, make_lorsa, make_sae, make_transcoder, tiny_llama_shared
from hypothesis import example, given
from hypothesis import strategies as st
from test_probe_hub_loading import assert_placed, files_under, probe

from nnsight_lorsa import LorsaSet
from nnsight_lorsa.errors import CheckpointError
from nnsight_lorsa.formats import load, save
from nnsight_lorsa.formats.hub import set_card

huggingface_hub = pytest.importorskip("huggingface_hub")
from huggingface_hub.utils import filter_repo_objects  # noqa: E402


class Remote:
    """Repos as folders under ``root/repos``; an online ``snapshot_download`` into ``root/cache``."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.repos, self.cache = root / "repos", root / "cache"
        self.fetched: dict[str, set[str]] = {}
        self.calls: list[dict] = []

        def snapshot_download(repo_id, *, allow_patterns=None, revision=None, local_files_only=False, **kwargs):
            self.calls.append({"allow_patterns": allow_patterns, "revision": revision})
            src = self.repos / repo_id
            commit = self.commit(repo_id)
            if revision not in (None, "main", commit):
                raise huggingface_hub.errors.RevisionNotFoundError(f"{repo_id}@{revision}")
            snapshot = self.cache / repo_id.replace("/", "--") / commit
            snapshot.mkdir(parents=True, exist_ok=True)
            for rel in filter_repo_objects(files_under(src), allow_patterns=allow_patterns):
                (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src / rel, snapshot / rel)
                self.fetched.setdefault(repo_id, set()).add(rel)
            return str(snapshot)

        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)

    def commit(self, repo_id: str) -> str:
        src = self.repos / repo_id
        return hashlib.sha1(repr([(r, (src / r).read_bytes()) for r in files_under(src)]).encode()).hexdigest()

    def put(self, repo_id: str, src: Path, prefix: str = "") -> None:
        dest = self.repos / repo_id / prefix
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dest, dirs_exist_ok=True)


@pytest.fixture
def remote(tmp_path, monkeypatch):
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # repo ids are no local paths here
    return Remote(tmp_path, monkeypatch)


tiny = tiny_llama_shared


def relu_transcoders(layers) -> dict:
    return {i: make_transcoder(skip=False, seed=i, activation="relu", activation_params={}, layer=i) for i in layers}


def circuit_tracer_named(directory: Path) -> None:
    """A circuit-tracer set whose ``config.yaml`` names its files (as circuit-tracer's hub configs do: ``hf://``
    paths, ``{layer, filepath}`` entries): other names than ``layer_<i>``, no manifest."""
    save(relu_transcoders((0, 1)), directory, format="circuit_tracer")
    (directory / "checksums.json").unlink()
    lines = ["model_kind: transcoder_set", "transcoders:"]
    for i in (0, 1):
        (directory / f"layer_{i}.safetensors").rename(directory / f"tc[{i}]-w.safetensors")
        lines.append(f"- {{layer: {i}, filepath: 'hf://me/elsewhere/tc[{i}]-w.safetensors'}}")
    (directory / "config.yaml").write_text("\n".join(lines) + "\n")


def circuit_tracer_bare(directory: Path) -> None:
    """A circuit-tracer CLT as circuit-tracer writes it: ``W_enc_<i>`` / ``W_dec_<i>`` only (no config, no
    manifest)."""
    save(make_clt(n_layers=2), directory, format="circuit_tracer")
    for name in ("config.yaml", "checksums.json"):
        (directory / name).unlink()


WRITE = {  # kind: write the checkpoint into a folder
    "lorsa": lambda d: save(make_lorsa(tiny()[1], tiny()[2], 1), d),
    "llamascopium_lorsa": lambda d: save(make_lorsa(tiny()[1], tiny()[2], 1), d, format="llamascopium"),
    "skip_transcoder": lambda d: save(make_transcoder(), d),
    "saelens_sae": lambda d: save(make_sae(activation="relu"), d, format="saelens"),
    "sparsify_sae": lambda d: save(make_sae(activation="topk", activation_params={"k": 8}), d, format="sparsify"),
    "circuit_tracer_set": lambda d: save(relu_transcoders((0, 1, 2)), d, format="circuit_tracer"),
    "circuit_tracer_named": circuit_tracer_named,
    "circuit_tracer_clt": circuit_tracer_bare,
}
FORMAT = {"lorsa": "nnsight_lorsa", "llamascopium_lorsa": "llamascopium", "skip_transcoder": "nnsight_lorsa",
          "saelens_sae": "saelens", "sparsify_sae": "sparsify", "circuit_tracer_set": "circuit_tracer",
          "circuit_tracer_named": "circuit_tracer", "circuit_tracer_clt": "circuit_tracer"}


def neighbours(root: Path, where: str) -> None:
    """Other checkpoints beside and below ``where`` in a repo: a Lorsa set (``layer_1/``, a folder name that
    ``layer_*.safetensors`` would match), an SAE and a CLT in nested folders, stray weights."""
    model, hf, adapter = tiny()
    LorsaSet(model, {1: make_lorsa(hf, adapter, 1, seed=3)}).save(root / where / "sets" / "a")
    save(make_sae(seed=4), root / where / "deep" / "er" / "sae")
    save(make_clt(n_layers=2, seed=5), root / where / "clt")
    (root / where / "notes").mkdir(parents=True, exist_ok=True)
    torch.save({}, root / where / "notes" / "scratch.safetensors")  # not read by anyone


def weights(files) -> set[str]:
    return {f for f in files if f.endswith(".safetensors")}


def check_fetch(tmp_path: Path, remote: Remote, kind: str, subfolder: str, given_format: bool, n: int) -> None:
    local = tmp_path / f"ckpt{n}" / (subfolder.rsplit("/", 1)[-1] or "top")
    WRITE[kind](local)
    repo = f"me/r{n}"
    remote.put(repo, local, subfolder)
    neighbours(remote.repos / repo, subfolder)
    fmt = FORMAT[kind] if given_format else "auto"
    kwargs = {"subfolder": subfolder} if subfolder else {}
    hub = load(repo, format=fmt, **kwargs)
    want = {f"{subfolder}/{rel}" if subfolder else rel for rel in files_under(local)}
    got = remote.fetched[repo]
    assert want <= got, sorted(want - got)  # every file of the checkpoint
    assert weights(got) == weights(want), sorted(weights(got) - weights(want))  # and no other's weights
    assert got == want, sorted(got - want)  # nor other configs (none sit at the checkpoint's own level)
    from_folder = load(local, format=fmt)
    hubs, locals_ = (getattr(m, "transcoders", {"": m}) for m in (hub, from_folder))
    assert hubs.keys() == locals_.keys()
    for key, module in locals_.items():
        assert_placed(hubs[key], module, "cpu", next(module.parameters()).dtype)


CASES = st.tuples(st.sampled_from(sorted(WRITE)), st.sampled_from(["", "a", "x/blocks.3.hook_resid_post"]),
                  st.booleans())


@probe(3)
@given(case=CASES)
@example(case=("circuit_tracer_clt", "a", False))  # numbered weights alone in a folder: no config makes the folder
@example(case=("circuit_tracer_named", "", True))  # the files its config.yaml names
def test_a_load_fetches_the_checkpoint_and_nothing_else(tmp_path, remote, case):
    """``*.safetensors`` (circuit-tracer's pattern, among the auto-detection patterns) fetched every weight file of the
    repo at any depth: the Lorsa set's, the nested SAE's, the CLT's, stray ones (seen failing). Now the configs
    first, then the files they (and the manifest) call for; circuit-tracer's numbered files digit by digit."""
    check_fetch(tmp_path, remote, *case, len(list(tmp_path.glob("ckpt*"))))


@pytest.mark.slow
@probe(120)
@given(case=CASES)
def test_a_load_fetches_the_checkpoint_and_nothing_else_sweep(tmp_path, remote, case):
    check_fetch(tmp_path, remote, *case, len(list(tmp_path.glob("ckpt*"))))


def test_a_set_fetches_its_folders_and_nothing_deeper(tmp_path, remote):
    """A Lorsa set at the top of a repo that also holds another set (``more/layer_2``), an SAE and a CLT deeper:
    ``*/model.safetensors`` fetched them all (seen failing). Only the configs of deeper folders come now."""
    model, hf, adapter = tiny()
    lorsas = LorsaSet(model, {1: make_lorsa(hf, adapter, 1), 2: make_lorsa(hf, adapter, 2, seed=1)})
    lorsas.save(tmp_path / "set")
    remote.put("me/sets", tmp_path / "set")
    LorsaSet(model, {2: make_lorsa(hf, adapter, 2, seed=7)}).save(remote.repos / "me/sets" / "more")
    neighbours(remote.repos / "me/sets", "x")
    back = LorsaSet.from_pretrained(model, "me/sets")
    assert back.layers == [1, 2]
    for layer in (1, 2):
        assert_placed(back[layer], lorsas[layer], "cpu", torch.float32, reference=lorsas[layer])
    got = remote.fetched["me/sets"]
    assert weights(got) == {"layer_1/model.safetensors", "layer_2/model.safetensors"}, sorted(weights(got))
    assert set(files_under(tmp_path / "set")) <= got
    # the second download is of the commit the configs came from
    assert remote.calls[-1]["revision"] == remote.commit("me/sets")


def test_a_set_without_a_card_refuses_a_folder_without_its_weights(tmp_path, remote):
    """No card lists the folders of a set saved without one (``save`` + a plain upload): a folder whose config came
    but whose weights did not (an interrupted download, a partial upload) loaded as a smaller set with only a
    ``PartialLoadWarning`` (seen failing). Now a ``CheckpointError`` naming the folder; a folder missing whole
    still cannot be told from a smaller set (documented)."""
    model, hf, adapter = tiny()
    lorsas = LorsaSet(model, {1: make_lorsa(hf, adapter, 1), 2: make_lorsa(hf, adapter, 2, seed=1)})
    lorsas.save(tmp_path / "set")
    remote.put("me/torn", tmp_path / "set")
    (remote.repos / "me/torn" / "layer_2" / "model.safetensors").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(CheckpointError, match=r"'me/torn'.*layer_2.*incomplete download"):
            LorsaSet.from_pretrained(model, "me/torn")
    remote.put("me/gone", tmp_path / "set")
    shutil.rmtree(remote.repos / "me/gone" / "layer_2")
    with pytest.raises(CheckpointError, match=r"'me/gone'.*set\.json\) lists the folders.*\['layer_2'\] are missing"):
        LorsaSet.from_pretrained(model, "me/gone")  # the set index (save's, since 2026-11-28) lists layer_2
    (remote.repos / "me/gone" / "set.json").unlink()  # a set saved before the set index
    assert LorsaSet.from_pretrained(model, "me/gone").layers == [1]  # not seen without a card or an index
    with_card = tmp_path / "carded"
    shutil.copytree(tmp_path / "set", with_card)
    set_card(with_card, kind="LorsaSet", what="Lorsa", key_name="layer",
             modules=[(k, lorsas.folder(k), lorsas[k]) for k in lorsas], config=hf.config, metrics_table="",
             repo_id="me/card", subfolder=None)
    remote.put("me/card", with_card)
    shutil.rmtree(remote.repos / "me/card" / "layer_2")
    with pytest.raises(CheckpointError, match=r"'me/card'.*layer_2.*missing"):
        LorsaSet.from_pretrained(model, "me/card")
