"""SAELens's release registry: ``(release, sae_id)`` -> hub repo, folder and recorded settings.

SAELens users load pretrained SAEs as ``SAE.from_pretrained(release, sae_id)``; the names resolve
through ``sae_lens/pretrained_saes.yaml`` (``sae_lens/loading/pretrained_saes_directory.py``)::

    <release>:
      repo_id: org/name              the Hugging Face repo
      conversion_func: null | name   null: SAELens's own layout (cfg.json + sae_weights.safetensors)
      config_overrides: {...}        merged over each cfg.json (optional)
      saes:
      - id: blocks.0.hook_mlp_out    the sae_id
        path: folder/in/repo         the folder of that SAE
        norm_scaling_factor: 1.05    for normalize_activations = "expected_average_only_in" (optional)

:func:`resolve_release` reads that file — the one inside the installed ``sae-lens`` (optional extra
``pip install nnsight-lorsa[saelens]``; found without importing it), or any file in that format
given as ``registry=`` — and ``formats.load(release, sae_id)`` loads the SAE with our SAELens
reader, folding the recorded ``norm_scaling_factor`` as ``from_pretrained`` does. Releases whose
files need one of SAELens's converters (``conversion_func`` not null: Gemma Scope ``.npz``,
dictionary_learning, …) are refused by name; where one of our formats reads those files,
``load(repo_id, subfolder=path, format=...)`` loads them.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..errors import ArgumentError, UnsupportedArchitectureError
from .validate import file_errors, refuse, require, require_file

REGISTRY_FILE = "pretrained_saes.yaml"

__all__ = ["REGISTRY_FILE", "SAELensRelease", "installed_registry", "resolve_release"]


@dataclass(frozen=True)
class SAELensRelease:
    """One SAE of a SAELens release, as its registry records it.

    Attributes:
        release, sae_id: the names ``SAE.from_pretrained`` takes.
        repo_id: the Hugging Face repo (or a local directory laid out as it).
        path: the SAE's folder in the repo.
        norm_scaling_factor: the dataset-wide input scale of ``expected_average_only_in`` SAEs, if recorded.
        config_overrides: keys merged over the SAE's ``cfg.json``.

    Source: SAELens ``sae_lens/loading/pretrained_saes_directory.py`` (``pretrained_saes.yaml``).
    """

    release: str
    sae_id: str
    repo_id: str
    path: str
    norm_scaling_factor: float | None = None
    config_overrides: dict[str, Any] = field(default_factory=dict)


def installed_registry() -> Path:
    """``pretrained_saes.yaml`` of the installed ``sae-lens`` (located, not imported).

    Raises:
        CheckpointError: sae-lens is not installed (``pip install nnsight-lorsa[saelens]``), or its
            package holds no registry file.
    """
    spec = importlib.util.find_spec("sae_lens")
    require(spec is not None and spec.submodule_search_locations, None,
            "SAELens release names need SAELens's registry: install it with `pip install nnsight-lorsa[saelens]`, "
            f"or pass release_registry=<a {REGISTRY_FILE} path>")
    assert spec is not None and spec.submodule_search_locations is not None
    path = Path(next(iter(spec.submodule_search_locations))) / REGISTRY_FILE
    require(path.is_file(), path, "the installed sae-lens has no release registry file")
    return path


@lru_cache(maxsize=4)
def _read(path: Path, mtime: float) -> dict[str, Any]:
    import yaml

    unreadable = (yaml.YAMLError, OSError, UnicodeDecodeError, RecursionError)
    with file_errors(path, {unreadable: "not readable YAML ({e})"}), path.open(encoding="utf-8") as f:
        data = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    require(isinstance(data, dict), path, "not a SAELens release registry (expected a mapping of releases)")
    return data  # type: ignore[no-any-return]


def resolve_release(release: Any, sae_id: Any, *,  # each a str, checked below (a named error)
                    registry: str | os.PathLike[str] | None = None) -> SAELensRelease:
    """Look ``(release, sae_id)`` up in SAELens's registry (module docstring).

    Args:
        release: a release name, e.g. ``"gpt2-small-res-jb"``.
        sae_id: an SAE id of that release, e.g. ``"blocks.8.hook_resid_pre"``.
        registry: a ``pretrained_saes.yaml`` (default: the installed sae-lens's, :func:`installed_registry`).

    Raises:
        ArgumentError: ``release`` or ``sae_id`` not a str.
        CheckpointError: no registry, an unknown release or sae_id (the message lists some valid
            ones), an entry without ``repo_id`` / ``path``, a malformed entry (``saes`` not a list, a ``path``
            outside the repo, a ``norm_scaling_factor`` that is not a number, ``config_overrides`` not a mapping).
        UnsupportedArchitectureError: the release needs a SAELens converter (``conversion_func``). (A ``path``
            ending ``.pt`` is a folder, as for SAELens's loader; nothing is ever unpickled.)

    Source: SAELens ``sae_lens/loading/pretrained_saes_directory.py`` (``pretrained_saes.yaml``).
    """
    for name, value in (("release", release), ("sae_id", sae_id)):
        if not isinstance(value, str):
            raise ArgumentError(f"resolve_release: {name} must be a str (a name of SAELens's registry), got {value!r} "
                                f"({type(value).__name__})")
    path = Path(registry) if registry is not None else installed_registry()
    require_file(path, " (the release registry)")
    data = _read(path.resolve(), path.stat().st_mtime)
    entry = data.get(release)
    if not isinstance(entry, dict):
        near = sorted(str(r) for r in data if release.split("-")[0] in str(r))[:8] or sorted(map(str, data))[:8]
        refuse(path, f"no release {release!r}" + ("" if entry is None else f" (its entry is a {type(entry).__name__}, "
                                                                            "not a mapping)") + f"; e.g. {near}")
    listed = entry.get("saes", [])
    require(isinstance(listed, list), path, f"release {release!r}: 'saes' must be a list of SAE entries, got "
                                            f"{type(listed).__name__}")
    saes = {s.get("id"): s for s in listed if isinstance(s, dict) and isinstance(s.get("id"), str)}
    require(sae_id in saes, path, f"release {release!r} has no sae_id {sae_id!r}; valid ids include {list(saes)[:8]}")
    converter = entry.get("conversion_func")
    if converter is not None:
        raise UnsupportedArchitectureError(
            f"release {release!r} needs SAELens's converter {converter!r} (its files are not in SAELens's own "
            f"layout); if one of our formats reads them, use load({entry.get('repo_id')!r}, "
            f"subfolder={str(saes[sae_id].get('path'))!r}, format=...)")
    sae = saes[sae_id]
    repo_id, folder = entry.get("repo_id"), sae.get("path")
    if not isinstance(repo_id, str) or folder is None:
        refuse(path, f"release {release!r} / {sae_id!r} lacks 'repo_id' or 'path'")
    folder = str(folder)
    require(not folder.startswith("/") and ".." not in folder.split("/"), path,
            f"release {release!r} / {sae_id!r}: 'path' {folder!r} is not a folder inside the repo {repo_id!r} "
            "(absolute, or with a '..' part)")
    # a path ending .pt is a folder here (SAELens's own loader, conversion_func null, fetches <path>/cfg.json and
    # <path>/sae_weights.safetensors: gpt2-small-resid-post-v5-32k's v5_32k_layer_<i>.pt); it was refused as a
    # pickle until 2026-11-29. Nothing is unpickled either way: a file of that name is no folder to read
    factor = sae.get("norm_scaling_factor")
    require(factor is None or (isinstance(factor, (int, float)) and not isinstance(factor, bool)), path,
            f"release {release!r} / {sae_id!r}: 'norm_scaling_factor' must be a number, got {factor!r}")
    overrides = entry.get("config_overrides") or {}
    require(isinstance(overrides, dict), path, f"release {release!r}: 'config_overrides' must be a mapping of "
                                               f"cfg.json keys, got {type(overrides).__name__}")
    return SAELensRelease(release=release, sae_id=sae_id, repo_id=repo_id, path=folder,
                          norm_scaling_factor=None if factor is None else float(factor),
                          config_overrides=dict(overrides))
