"""Mutation probe, round 10 (``formats/saelens_releases.py``): each test here was seen failing with a hand-made
mutant of ``resolve_release`` and passing without (docs/reliability.md, "Mutation probe, round 10: architecture
adapters, SAELens releases and small helpers"). The registry files follow SAELens's ``pretrained_saes.yaml``
layout (``sae_lens/loading/pretrained_saes_directory.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nnsight_lorsa.errors import CheckpointError
from nnsight_lorsa.formats import resolve_release


def _registry(tmp_path: Path, sae: str, release: str = "") -> Path:
    path = tmp_path / "pretrained_saes.yaml"
    path.write_text("rel:\n  repo_id: org/repo\n  conversion_func: null\n" + release
                    + "  saes:\n  - id: blocks.0.hook_resid_pre\n" + sae)
    return path


def test_an_edited_registry_is_read_again(tmp_path):
    """The parsed registry is cached by path *and* modification time: a file rewritten since (a newer sae-lens, an
    edited local registry) resolves to its new entries, not the old ones."""
    path = _registry(tmp_path, "    path: old_folder\n")
    assert resolve_release("rel", "blocks.0.hook_resid_pre", registry=path).path == "old_folder"
    before = path.stat().st_mtime
    path.write_text(path.read_text().replace("old_folder", "new_folder"))
    os.utime(path, (before + 10, before + 10))
    assert resolve_release("rel", "blocks.0.hook_resid_pre", registry=path).path == "new_folder"


@pytest.mark.parametrize("folder", ["sae.pt", "deep/sae.pth", "sae.pkl"])
def test_a_path_with_a_pickle_suffix_is_a_folder_and_nothing_is_unpickled(tmp_path, folder):
    """SAELens's own loader (``conversion_func: null``) fetches ``<path>/cfg.json`` and ``<path>/sae_weights.
    safetensors`` whatever the path's suffix (``gpt2-small-resid-post-v5-32k``: ``v5_32k_layer_0.pt``), so the path
    is a folder: resolved (it was refused as a pickle until 2026-11-29), loaded from its safetensors; a *file* of that
    name (a real pickle) is no folder and is refused by name, never unpickled."""
    import shutil

    from nnsight_lorsa.formats import load

    peers = Path(__file__).resolve().parent.parent / "fixtures" / "peers" / "saelens"
    path = _registry(tmp_path, f"    path: {folder}\n")
    assert resolve_release("rel", "blocks.0.hook_resid_pre", registry=path).path == folder
    repo = tmp_path / "repo"
    shutil.copytree(peers / "standard", repo / folder)
    (repo / folder / "reference.safetensors").unlink()
    assert load(repo, subfolder=folder).cfg.d_in == 16
    shutil.rmtree(repo / folder)
    (repo / folder).write_bytes(b"\x80\x04K\x01.")  # a pickle of the int 1
    with pytest.raises(CheckpointError):
        load(repo, subfolder=folder)


def test_a_boolean_norm_scaling_factor_is_refused(tmp_path):
    """YAML's ``true`` is a bool, which Python counts as the int 1: a factor must be a number, not a flag."""
    path = _registry(tmp_path, "    path: f\n    norm_scaling_factor: true\n")
    with pytest.raises(CheckpointError, match="norm_scaling_factor"):
        resolve_release("rel", "blocks.0.hook_resid_pre", registry=path)


def test_a_release_without_a_repo_id_is_refused_by_name(tmp_path):
    path = tmp_path / "pretrained_saes.yaml"
    path.write_text("rel:\n  conversion_func: null\n  saes:\n  - id: blocks.0.hook_resid_pre\n    path: f\n")
    with pytest.raises(CheckpointError, match="lacks 'repo_id' or 'path'"):
        resolve_release("rel", "blocks.0.hook_resid_pre", registry=path)
