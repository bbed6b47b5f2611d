"""The Hugging Face Hub (issue 25): ``push_to_hub(repo_id)`` / ``from_pretrained(model, repo_id)`` for Lorsa and
transcoder sets, ``push_to_hub`` / ``Graph.load(repo_id)`` for graphs, in the documented Hub layout
(``nnsight_lorsa.formats.hub``). Never over the network: ``HfApi.create_repo`` / ``HfApi.upload_folder`` and
``snapshot_download`` are replaced by a fake Hub, a local directory per repo that the uploads write and the
downloads read, applying the allow / delete patterns with huggingface_hub's own matcher."""

from __future__ import annotations

import hashlib
import inspect
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    attribution_setup,
    make_lorsa,
    make_sae,
    make_transcoders,
    random_ids,
    rm,
    same_weights,
    tiny_nnsight,
)

from nnsight_lorsa import Graph, LorsaSet, SAESet, TranscoderSet, attribute, get_adapter
from nnsight_lorsa.errors import ArgumentError, CheckpointError, MissingDependencyError

huggingface_hub = pytest.importorskip("huggingface_hub")
from huggingface_hub.utils import filter_repo_objects  # noqa: E402


def files_under(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


class FakeHub:
    """Repos as folders under ``root``; records every call."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root, self.calls, self.commits = root, [], set()
        hub = self

        def create_repo(api, repo_id, *, repo_type=None, private=None, exist_ok=False, **kwargs):
            hub.calls.append(("create_repo", repo_id, {"repo_type": repo_type, "private": private,
                                                       "exist_ok": exist_ok, **kwargs}))
            (hub.root / repo_id).mkdir(parents=True, exist_ok=True)
            return f"https://huggingface.co/{repo_id}"

        def upload_folder(api, *, repo_id, folder_path, path_in_repo=None, commit_message=None,
                          delete_patterns=None, repo_type=None, **kwargs):
            hub.calls.append(("upload_folder", repo_id, {"path_in_repo": path_in_repo, "repo_type": repo_type,
                                                         "commit_message": commit_message,
                                                         "delete_patterns": delete_patterns,
                                                         "files": files_under(Path(folder_path)), **kwargs}))
            dest = hub.root / repo_id / (path_in_repo or "")
            uploaded = set(files_under(Path(folder_path)))
            if dest.is_dir() and delete_patterns:
                stale = [f for f in files_under(dest) if f not in uploaded]
                for rel in filter_repo_objects(stale, allow_patterns=delete_patterns):
                    (dest / rel).unlink()
            for rel in uploaded:
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(Path(folder_path) / rel, dest / rel)
            return f"https://huggingface.co/{repo_id}/commit/{len(hub.calls)}"

        def snapshot_download(repo_id, *, allow_patterns=None, revision=None, local_files_only=False, **kwargs):
            hub.calls.append(("snapshot_download", repo_id, {"allow_patterns": allow_patterns, "revision": revision,
                                                             "local_files_only": local_files_only, **kwargs}))
            src = hub.root / repo_id
            if not src.is_dir():
                raise huggingface_hub.errors.RepositoryNotFoundError(f"404: {repo_id}")
            # one snapshot folder per commit, which later downloads of that commit add to (as huggingface_hub's
            # cache does): the commit is the repo's content now, or the one asked for by its hash
            state = hashlib.sha1(repr([(r, (src / r).stat().st_size, (src / r).stat().st_mtime_ns)
                                       for r in files_under(src)]).encode()).hexdigest()
            commit = revision if revision in hub.commits else state
            hub.commits.add(commit)
            snapshot = hub.root.parent / "snapshots" / repo_id.replace("/", "--") / commit
            snapshot.mkdir(parents=True, exist_ok=True)
            for rel in filter_repo_objects(files_under(src), allow_patterns=allow_patterns):
                (snapshot / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src / rel, snapshot / rel)
            return str(snapshot)

        monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
        monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)

    def repo(self, repo_id: str) -> Path:
        return self.root / repo_id

    def named(self, name: str) -> list[dict]:
        return [kw for call, _, kw in self.calls if call == name]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # repo ids are no local paths here
    return FakeHub(tmp_path / "hub", monkeypatch)


@pytest.fixture(scope="module")
def tiny():
    model, hf = tiny_nnsight("llama")
    return model, hf, get_adapter(model)


def test_a_lorsa_set_round_trips_through_the_hub_layout(hub, tiny):
    model, hf, adapter = tiny
    lorsas = LorsaSet(model, {1: make_lorsa(hf, adapter, 1), 2: make_lorsa(hf, adapter, 2, seed=1)})
    metrics = {"fvu": 0.1234, "l0": 7.5, "dead_frac": 0.25, "ce_recovered": 0.9, "feature_density": [0.1]}
    url = lorsas.push_to_hub("me/tiny-lorsa", metrics=metrics, private=True, token="hf_x")
    assert url.startswith("https://huggingface.co/me/tiny-lorsa/commit/")
    (create,) = hub.named("create_repo")
    assert create["exist_ok"] is True and create["private"] is True and create["repo_type"] == "model"
    (upload,) = hub.named("upload_folder")
    assert upload["path_in_repo"] is None and upload["delete_patterns"] == ["layer_*"]
    layout = ["README.md", "layer_1/checksums.json", "layer_1/config.json", "layer_1/model.safetensors",
              "layer_2/checksums.json", "layer_2/config.json", "layer_2/model.safetensors", "set.json"]
    assert upload["files"] == layout == files_under(hub.repo("me/tiny-lorsa"))

    card = (hub.repo("me/tiny-lorsa") / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: nnsight-lorsa\ntags:\n- nnsight-lorsa\n")
    assert "- lorsa\n" in card.split("---")[1]
    assert "| metric | value |" in card and "| fvu | 0.1234 |" in card and "| ce_recovered | 0.9 |" in card
    assert "feature_density" not in card
    assert "LorsaSet.from_pretrained(model, 'me/tiny-lorsa')" in card
    assert "n_ov_heads=" in card and "`layer_2/`" in card

    back = LorsaSet.from_pretrained(model, "me/tiny-lorsa", revision="v1")
    configs, weights = hub.named("snapshot_download")  # the card and configs, then the weights they call for
    assert configs["revision"] == "v1" and "*/config.json" in configs["allow_patterns"]
    assert not any(p.endswith(".safetensors") for p in configs["allow_patterns"])
    assert weights["revision"] in hub.commits and "layer_1/model.safetensors" in weights["allow_patterns"]
    assert back.layers == [1, 2]
    for layer in (1, 2):
        assert same_weights(back[layer], lorsas[layer]) and back[layer].cfg == lorsas[layer].cfg


def test_a_transcoder_set_in_a_subfolder_with_per_layer_metrics(hub, tiny):
    model, _, _ = tiny
    tcs = TranscoderSet(model, make_transcoders((0, 1, 2)))
    tcs.push_to_hub("me/mix", subfolder="tiny/transcoders", metrics={0: {"fvu": 0.5}, 2: {"fvu": 0.25, "l0": 6}},
                    commit_message="transcoders v1")
    (upload,) = hub.named("upload_folder")
    assert upload["path_in_repo"] == "tiny/transcoders" and upload["commit_message"] == "transcoders v1"
    where = hub.repo("me/mix") / "tiny/transcoders"
    assert "layer_2/model.safetensors" in files_under(where)
    card = (where / "README.md").read_text()
    assert "| layer | fvu | l0 |" in card and "| 2 | 0.25 | 6 |" in card and "| 0 | 0.5 |  |" in card
    assert "TranscoderSet.from_pretrained(model, 'me/mix:tiny/transcoders')" in card
    assert "- transcoder\n" in card

    for source, kwargs in (("me/mix", {"subfolder": "tiny/transcoders"}), ("me/mix:tiny/transcoders", {})):
        back = TranscoderSet.from_pretrained(model, source, **kwargs)
        assert list(back) == [0, 1, 2]
        assert all(same_weights(back[k], tcs[k]) for k in back)

    # a later push of fewer layers leaves no stale layer folder behind (deleted in the same commit)
    TranscoderSet(model, {1: tcs[1]}).push_to_hub("me/mix", subfolder="tiny/transcoders")
    assert sorted({f.split("/")[0] for f in files_under(where)}) == ["README.md", "layer_1", "set.json"]
    assert list(TranscoderSet.from_pretrained(model, "me/mix:tiny/transcoders")) == [1]


def test_an_sae_set_keyed_by_site_round_trips(hub, tiny):
    model, _, _ = tiny
    saes = SAESet(model, {"model.layers.1": make_sae(), "model.layers.2": make_sae(seed=1)})
    saes.push_to_hub("me/saes", metrics={"model.layers.1": {"fvu": 0.3}})
    (upload,) = hub.named("upload_folder")
    assert upload["delete_patterns"] is None  # site folders: nothing else of the repo is touched
    assert "model.layers.2/model.safetensors" in files_under(hub.repo("me/saes"))
    card = (hub.repo("me/saes") / "README.md").read_text()
    assert "- sparse-autoencoder\n" in card and "| site | fvu |" in card and "| model.layers.1 | 0.3 |" in card
    back = SAESet.from_pretrained(model, "me/saes")
    assert list(back) == ["model.layers.1", "model.layers.2"]
    assert all(same_weights(back[k], saes[k]) for k in back)


def test_a_graph_round_trips_through_the_hub_layout(hub):
    model, _, lorsas, tcs = attribution_setup("llama")
    graph = attribute(rm(model, lorsas, tcs), random_ids(1, 4, seed=5)[0], batch_size=16)
    graph.prompt = "ROMEO: ```soft```"
    graph.push_to_hub("me/graphs", subfolder="romeo", metrics={"replacement_score": 0.75})
    where = hub.repo("me/graphs") / "romeo"
    assert files_under(where) == ["README.md", "checksums.json", "graph.json", "graph.safetensors"]
    card = (where / "README.md").read_text()
    assert "- attribution-graph\n" in card and "| replacement_score | 0.75 |" in card
    assert "Graph.load('me/graphs:romeo')" in card and "| lorsa_heads |" in card
    for back in (Graph.load("me/graphs", subfolder="romeo", revision="main"), Graph.load("me/graphs:romeo")):
        assert back.prompt == graph.prompt and back.meta == graph.meta
        assert torch.equal(back.densify(), graph.densify()) and torch.equal(back.values.nan_to_num(),
                                                                            graph.values.nan_to_num())
    assert {d["revision"] for d in hub.named("snapshot_download")} == {"main", None}


def test_an_altered_file_on_the_hub_is_caught_by_its_manifest(hub, tiny):
    model, hf, adapter = tiny
    LorsaSet(model, {1: make_lorsa(hf, adapter, 1)}).push_to_hub("me/l")
    weights = hub.repo("me/l") / "layer_1/model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(altered|sha256)"):
        LorsaSet.from_pretrained(model, "me/l")


def test_a_missing_repo_is_a_checkpoint_error_naming_it(hub, tiny):
    model, _, _ = tiny
    with pytest.raises(CheckpointError, match="'me/absent'.*could not be fetched"):
        LorsaSet.from_pretrained(model, "me/absent")
    with pytest.raises(CheckpointError, match="'me/absent'"):
        Graph.load("me/absent")


def test_a_local_directory_named_like_a_repo_id_is_read_locally(hub, tiny):
    model, hf, adapter = tiny
    lorsas = LorsaSet(model, {1: make_lorsa(hf, adapter, 1)})
    lorsas.save(Path("me") / "local")  # cwd is tmp_path: "me/local" is a directory here
    back = LorsaSet.from_pretrained(model, "me/local")
    assert same_weights(back[1], lorsas[1]) and hub.named("snapshot_download") == []


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"repo_id": "no-owner"}, "repo_id must be a Hugging Face repo id 'owner/name'"),
    ({"repo_id": "a/b/c"}, "repo_id must be"),
    ({"repo_id": 3}, "repo_id must be"),
    ({"repo_id": "me/x", "subfolder": "../up"}, "subfolder must be a relative folder path"),
    ({"repo_id": "me/x", "subfolder": "/abs"}, "subfolder must be"),
    ({"repo_id": "me/x", "private": "yes"}, "private must be None, True or False"),
    ({"repo_id": "me/x", "commit_message": " "}, "commit_message must be a non-empty str"),
    ({"repo_id": "me/x", "metrics": [0.5]}, "metrics must be an Evaluation or a mapping"),
    ({"repo_id": "me/x", "metrics": {"note": "text"}}, "metrics hold no number"),
])
def test_bad_push_arguments_are_refused_before_anything_is_written(hub, tiny, kwargs, match):
    model, hf, adapter = tiny
    lorsas = LorsaSet(model, {1: make_lorsa(hf, adapter, 1)})
    push = inspect.unwrap(LorsaSet.push_to_hub)  # a user's wrong types reach our checks, not the test-time type check
    with pytest.raises(ArgumentError, match=rf"LorsaSet\.push_to_hub: {match}"):
        push(lorsas, **kwargs)
    assert hub.calls == []


def test_an_empty_set_is_not_published(hub, tiny):
    model, _, _ = tiny
    with pytest.raises(ArgumentError, match="the set is empty"):
        LorsaSet(model, {}).push_to_hub("me/x")
    assert hub.calls == []


def test_pushing_without_huggingface_hub_is_a_named_error(tiny, monkeypatch, tmp_path):
    model, hf, adapter = tiny
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(MissingDependencyError, match="huggingface_hub"):
        LorsaSet(model, {1: make_lorsa(hf, adapter, 1)}).push_to_hub("me/x")
