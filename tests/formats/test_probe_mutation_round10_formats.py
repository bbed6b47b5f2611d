"""Mutation probe, round 10 (docs/reliability.md): the Hub layout's helpers (``formats/hub.py``), the reader's
``device="meta"`` path (``formats/reader.py``) and the gate files (``formats/gate_format.py``), each test seen
failing with the mutant it names and passing without. No network: the Hub calls are replaced by recorders."""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

import pytest
import torch

from nnsight_lorsa.errors import ArgumentError, CheckpointError
from nnsight_lorsa.formats import hub, reader
from nnsight_lorsa.formats.gate_format import GateConfig, GateSet
from nnsight_lorsa.formats.registry import load, save
from nnsight_lorsa.modules.attention_gate import AttentionGate


def _card_meta(card: Path) -> list[str]:
    """The YAML metadata lines of a model card (between the two ``---``)."""
    lines = card.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "---"
    return lines[1:lines.index("---", 1)]


def test_a_local_model_path_is_never_published_as_the_cards_base_model(tmp_path, monkeypatch):
    """(Mutant: ``write_card`` writes ``base_model`` for any name.) The module docstring: ``base_model`` only
    "when the model has a Hub id"; a local path (an absolute one, one that exists here) is not one."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "mine").mkdir(parents=True)
    for local in ("/home/me/models/llama", "models/mine"):
        card = hub.write_card(tmp_path / "a", title="t", tags=["x"], base_model=local, body="b")
        assert not any(line.startswith("base_model") for line in _card_meta(card)), local
    card = hub.write_card(tmp_path / "a", title="t", tags=["x"], base_model="meta-llama/Llama-3.2-1B", body="b")
    assert "base_model: meta-llama/Llama-3.2-1B" in _card_meta(card)


def test_a_graphs_card_lists_no_folders_and_a_sets_card_lists_its_own(tmp_path):
    """(Mutant: ``card_folders`` returns ``[]`` for a card listing none.) Its docstring: None where the card
    lists none (a graph's), the folders in order for a set's."""
    hub.graph_card(tmp_path / "g", prompt="hi", n_tokens=2, counts={"features": 3}, meta={}, metrics_table="",
                   repo_id="me/g", subfolder=None)
    assert hub.card_folders(tmp_path / "g") is None
    modules = [(5, "layer_5", torch.nn.Identity()), (1, "layer_1", torch.nn.Identity())]
    hub.set_card(tmp_path / "s", kind="LorsaSet", what="Lorsa", key_name="layer", modules=modules, config=None,
                 metrics_table="", repo_id="me/s", subfolder=None)
    assert hub.card_folders(tmp_path / "s") == ["layer_5", "layer_1"]


def test_a_set_index_listing_a_folder_twice_is_refused(tmp_path):
    """(Mutant: the distinctness check of ``set_index_folders`` dropped.) Its docstring: the folders must be
    distinct relative names, else a CheckpointError naming the file."""
    (tmp_path / hub.SET_INDEX).write_text(json.dumps(hub.set_index(["layer_0", "layer_1"])))
    assert hub.set_index_folders(tmp_path) == ["layer_0", "layer_1"]
    (tmp_path / hub.SET_INDEX).write_text(json.dumps(hub.set_index(["layer_0", "layer_0"])))
    with pytest.raises(CheckpointError, match="distinct"):
        hub.set_index_folders(tmp_path)


def test_a_mapping_whose_keys_are_not_all_set_keys_is_one_column_of_metrics():
    """(Mutant: ``any`` for ``all`` in ``metrics_table``.) Its docstring: one row per key only "when every key of
    the mapping is one of ``keys``"; otherwise the mapping is ``{name: number}``, one column."""
    table = hub.metrics_table({"fvu": 0.25, 3: 0.5}, keys=[3, 4])
    assert table.splitlines() == ["| metric | value |", "|---|---|", "| fvu | 0.25 |", "| 3 | 0.5 |"]
    rows = hub.metrics_table({3: {"fvu": 0.25}, 4: {"fvu": 0.5}}, keys=[3, 4])
    assert rows.splitlines() == ["| layer | fvu |", "|---|---|", "| 3 | 0.25 |", "| 4 | 0.5 |"]


class _Recorder:
    """``HfApi.create_repo`` / ``upload_folder`` replaced: the keyword arguments of each call, nothing sent."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        huggingface_hub = pytest.importorskip("huggingface_hub")
        self.calls: list[tuple[str, dict]] = []
        rec = self

        def create_repo(api, repo_id, **kwargs):
            rec.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))

        def upload_folder(api, **kwargs):
            rec.calls.append(("upload_folder", kwargs))
            return "https://huggingface.co/commit/1"

        monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
        monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)


def test_the_subfolder_is_uploaded_to_as_a_plain_relative_path(tmp_path, monkeypatch):
    """(Mutant: ``path_in_repo`` given the subfolder as spelled.) ``sets/a/`` is the folder ``sets/a`` of the
    repo, the path the card's load line names (``owner/name:sets/a``)."""
    rec = _Recorder(monkeypatch)
    (tmp_path / "f").mkdir()
    hub.push_folder(tmp_path / "f", "me/repo", subfolder="sets/a/")
    (upload,) = [kw for name, kw in rec.calls if name == "upload_folder"]
    assert upload["path_in_repo"] == "sets/a" and upload["repo_id"] == "me/repo"
    hub.push_folder(tmp_path / "f", "me/repo")
    assert [kw for name, kw in rec.calls if name == "upload_folder"][-1]["path_in_repo"] is None


def test_stage_and_push_passes_private_to_the_repo_it_creates(tmp_path, monkeypatch):
    """(Mutant: ``private`` dropped from what ``stage_and_push`` hands ``push_folder``.) A private push creates
    a private repo."""
    rec = _Recorder(monkeypatch)
    hub.stage_and_push(lambda d: d.mkdir(parents=True), "me/repo", private=True)
    (create,) = [kw for name, kw in rec.calls if name == "create_repo"]
    assert create["private"] is True and create["exist_ok"] is True
    with pytest.raises(ArgumentError, match="private"):
        hub.stage_and_push(lambda d: d.mkdir(parents=True), "me/repo", private="yes")


def test_the_weight_patterns_of_a_folder_with_glob_characters_match_only_its_files(tmp_path):
    """(Mutant: the folder's name not escaped in ``set_weight_patterns``.) The patterns are ``fnmatch``'s
    (huggingface_hub's matcher): ``f[0]/model.safetensors`` must match that file, not ``f0/model.safetensors``."""
    from nnsight_lorsa.formats.lorsa_format import READER

    for name in ("f[0]", "f0"):
        (tmp_path / name).mkdir()
        for file in READER.hub_files:
            (tmp_path / name / file).write_text("{}")
    patterns = hub.set_weight_patterns([READER], tmp_path)
    weights = [f for f in READER.hub_files if f.endswith(".safetensors")]
    assert weights
    for name in ("f[0]", "f0"):
        for w in weights:
            matched = [p for p in patterns if fnmatch.fnmatchcase(f"{name}/{w}", p)]
            assert len(matched) == 1 and matched[0].endswith(w), (name, w, patterns)


def _gate_dir(tmp_path: Path) -> Path:
    gates = {layer: AttentionGate(4, 0.0) for layer in range(2)}
    with torch.no_grad():
        for layer, g in gates.items():
            g.bias.copy_(torch.arange(4.0) + layer)
    return save(GateSet(GateConfig("llama", 2, 4), gates), tmp_path / "g", format="sparse_attention")


@pytest.mark.parametrize("device", ["meta", torch.device("meta")])
def test_a_meta_load_reads_headers_only_however_meta_is_spelled(tmp_path, monkeypatch, device):
    """(Mutants: ``device == "meta"`` for ``torch.device(device).type == "meta"``; ``hashes=True`` on a meta
    load.) ``read_dir``'s docstring: ``device="meta"`` reads the tensor files' headers only and checks the
    manifest's sizes, not its hashes; ``torch.device("meta")`` is the same device."""
    directory = _gate_dir(tmp_path)
    entered, hashed = [], []
    real_headers, real_check = reader.headers_only, reader.check

    def spy_headers():
        entered.append(True)
        return real_headers()

    def spy_check(path, entries, *, hashes=True):
        hashed.append(hashes)
        return real_check(path, entries, hashes=hashes)

    monkeypatch.setattr(reader, "headers_only", spy_headers)
    monkeypatch.setattr(reader, "check", spy_check)
    gate_set = load(directory, format="sparse_attention", device=device)
    assert entered == [True] and hashed == [False]
    assert {p.device.type for g in gate_set.gates.values() for p in g.parameters()} == {"meta"}
    entered.clear(), hashed.clear()
    on_cpu = load(directory, format="sparse_attention")
    assert entered == [] and hashed == [True]
    assert torch.equal(on_cpu[1].bias, torch.arange(4.0) + 1)


def test_the_gate_file_holds_fp32_biases_whatever_the_gates_dtype(tmp_path):
    """(Mutant: ``.float()`` dropped in ``GateSet.files``.) The module docstring: ``layers.<L>.bias`` is float32;
    a gate cast with its model (``model.to(bfloat16)``) is written as fp32 of the same values."""
    gate = AttentionGate(4, 0.0).to(torch.bfloat16)
    with torch.no_grad():
        gate.bias.copy_(torch.tensor([0.5, -1.25, 3.0, 0.0]))
    tensors, _ = GateSet(GateConfig("llama", 1, 4), {0: gate}).files()
    assert tensors["layers.0.bias"].dtype == torch.float32
    assert torch.equal(tensors["layers.0.bias"], torch.tensor([0.5, -1.25, 3.0, 0.0]))


def test_a_hub_load_fetches_every_file_the_manifest_lists_and_no_weights_without_their_config(tmp_path):
    """(Mutants: the manifest's names left out of ``hub_weights``; ``Reader.weight_files`` without its config
    check.) ``hub_weights``' docstring: every file ``checksums.json`` lists, plus each reader's weights; the
    default ``weight_files``: the weights only where the config ``hub_files[0]`` was fetched (an SAE beside a
    model's ``model.safetensors`` must not fetch the model)."""
    from nnsight_lorsa._atomic import manifest_of
    from nnsight_lorsa.formats.gate_format import READER as GATES
    from nnsight_lorsa.formats.lorsa_format import READER as LORSA

    directory = _gate_dir(tmp_path)
    listed = sorted(manifest_of(directory) or {})
    assert listed == ["sparse_attention.json", "sparse_attention.safetensors"]
    (directory / "sparse_attention.safetensors").unlink()  # the second download's: not fetched yet
    assert reader.hub_weights([GATES, LORSA], directory) == listed
    assert LORSA.weight_files(directory) == [] and GATES.weight_files(tmp_path / "empty") == []
    assert GATES.weight_files(directory) == ["sparse_attention.safetensors"]
