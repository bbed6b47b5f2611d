"""``load(release, sae_id)`` over SAELens's release registry, against a local directory laid out as
the hub repo and a registry file copied from sae-lens's own (``tests/fixtures/peers/saelens/registry``,
written by ``scripts/peer_fixtures/saelens.py``); no network, sae-lens not needed."""

from __future__ import annotations

import shutil
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nnsight_lorsa.errors import ArgumentError, CheckpointError, UnsupportedArchitectureError
from nnsight_lorsa.formats import load, resolve_release, saelens_releases

PEERS = Path(__file__).resolve().parent.parent / "fixtures" / "peers" / "saelens"
REGISTRY = PEERS / "registry" / "pretrained_saes.yaml"


@pytest.fixture()
def hub(tmp_path: Path) -> Path:
    """A registry whose ``tiny-random-saes`` repo is a local directory with the hub layout."""
    repo = tmp_path / "tiny-random-saes"
    for folder in ("norm_expected_average_only_in", "topk_rescale"):
        shutil.copytree(PEERS / folder, repo / folder)
    registry = tmp_path / "pretrained_saes.yaml"
    registry.write_text(REGISTRY.read_text().replace("LOCAL/tiny-random-saes", str(repo)))
    return registry


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.double()).abs().max() / b.double().abs().max())


def test_release_folds_the_recorded_norm_scaling_factor(hub: Path) -> None:
    module = load("tiny-random-saes", "blocks.1.hook_resid_post", release_registry=hub)
    ref = load_file(str(PEERS / "norm_expected_average_only_in" / "reference.safetensors"))
    extra = module.cfg.extra["saelens"]
    assert extra["norm_folded"] and extra["norm_scaling_factor"] == 2.5 == float(ref["norm_scaling_factor"])
    assert extra["release"] == "tiny-random-saes" and extra["path"] == "norm_expected_average_only_in"
    with torch.no_grad():  # SAELens's own from_pretrained result: fold_activation_norm_scaling_factor(2.5)
        assert _rel(module.encode(ref["x"]), ref["feature_acts"]) <= 1e-5
        assert _rel(module(ref["x"]), ref["sae_out"]) <= 1e-5
    given = load("tiny-random-saes", "blocks.1.hook_resid_post", release_registry=hub, norm_scaling_factor=1.0)
    assert given.cfg.extra["saelens"]["norm_scaling_factor"] == 1.0  # an explicit factor wins


def test_release_without_factor_loads_plain(hub: Path) -> None:
    module = load("tiny-random-saes", "blocks.1.hook_resid_post.topk", release_registry=hub)
    ref = load_file(str(PEERS / "topk_rescale" / "reference.safetensors"))
    with torch.no_grad():
        assert _rel(module(ref["x"]), ref["sae_out"]) <= 1e-5


def test_real_registry_entries_resolve() -> None:
    entry = resolve_release("gpt2-small-mlp-tm", "blocks.1.hook_mlp_out", registry=REGISTRY)
    assert (entry.repo_id, entry.path) == ("tommmcgrath/gpt2-small-mlp-out-saes",
                                           "sae_group_gpt2_blocks.1.hook_mlp_out_24576:v0")
    assert entry.norm_scaling_factor == pytest.approx(2.3693984005104283)
    assert entry.config_overrides["dataset_path"] == "Skylion007/openwebtext"
    assert resolve_release("gpt2-small-attn-out-v5-32k", "blocks.0.hook_attn_out",
                           registry=REGISTRY).norm_scaling_factor is None


@pytest.mark.parametrize(("release", "sae_id", "error", "says"), [
    ("gemma-scope-2b-pt-res-canonical", "layer_0/width_16k/canonical", UnsupportedArchitectureError,
     "converter 'gemma_2'"),
    ("gpt2-small-hook-z-kk", "blocks.0.hook_z", UnsupportedArchitectureError, "converter"),
    ("gpt2-small-mlp-tm", "blocks.9.hook_mlp_out", CheckpointError, "no sae_id 'blocks.9.hook_mlp_out'"),
    ("no-such-release", "x", CheckpointError, "no release 'no-such-release'"),
])
def test_release_refusals(release: str, sae_id: str, error: type[Exception], says: str) -> None:
    with pytest.raises(error, match=says):
        load(release, sae_id, release_registry=REGISTRY)


def test_release_arguments(hub: Path) -> None:
    with pytest.raises(ArgumentError, match="subfolder"):
        load("tiny-random-saes", "blocks.1.hook_resid_post", release_registry=hub, subfolder="x")
    with pytest.raises(ArgumentError, match="no sae_id"):
        load(PEERS / "standard", release_registry=hub)


def test_default_registry_is_the_installed_sae_lens(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    hub: Path) -> None:
    package = tmp_path / "site" / "sae_lens"
    package.mkdir(parents=True)
    shutil.copy(hub, package / "pretrained_saes.yaml")
    monkeypatch.setattr(saelens_releases.importlib.util, "find_spec", lambda name: types.SimpleNamespace(
        submodule_search_locations=[str(package)]) if name == "sae_lens" else None)
    assert load("tiny-random-saes", "blocks.1.hook_resid_post").cfg.extra["saelens"]["norm_folded"]
    monkeypatch.setattr(saelens_releases.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match=r"nnsight-lorsa\[saelens\]"):
        load("tiny-random-saes", "blocks.1.hook_resid_post")
