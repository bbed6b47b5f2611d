"""Mutation probe, round 10 (``formats/saelens_releases.py``): each test here was seen failing with a hand-made
mutant of ``resolve_release`` and passing without (docs/reliability.md, "Mutation probe, round 10: architecture
adapters, SAELens releases and small helpers"). The registry files follow SAELens's ``pretrained_saes.yaml``
layout (``sae_lens/loading/pretrained_saes_directory.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nnsight_lorsa.errors import CheckpointError, UnsupportedArchitectureError
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
def test_every_pickle_suffix_is_refused(tmp_path, folder):
    """``.pt``, ``.pth`` and ``.pkl`` are all pickles, never loaded (the module docstring's rule)."""
    path = _registry(tmp_path, f"    path: {folder}\n")
    with pytest.raises(UnsupportedArchitectureError, match="pickle"):
        resolve_release("rel", "blocks.0.hook_resid_pre", registry=path)


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
