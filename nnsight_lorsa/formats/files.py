"""Reading checkpoint files: local directories or Hugging Face hub snapshots, JSON / YAML configs,
safetensors headers and tensors.

Nothing here unpickles: only JSON, YAML (``yaml.safe_load``) and safetensors are read. Every problem
raises :class:`~nnsight_lorsa.errors.CheckpointError` naming the file. ``huggingface_hub`` is
imported only when a source is not a local path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .._atomic import resolve
from ..errors import CheckpointError

__all__ = ["load_safetensors", "read_json_object", "read_safetensors_header", "read_yaml_object",
           "resolve_checkpoint_dir"]


def resolve_checkpoint_dir(
    source: str | os.PathLike[str],
    *,
    allow_patterns: list[str],
    subfolder: str | None = None,
    local_files_only: bool = False,
    revision: str | None = None,
) -> Path:
    """A local checkpoint directory for ``source``: a local directory, or a downloaded hub snapshot.

    ``source`` is used as a local directory when it exists (or is a :class:`~pathlib.Path`; or
    ``<source>.old`` when only that exists: a save killed between its two renames, :mod:`.._atomic`);
    ``subfolder`` is then a folder inside it. Otherwise ``source`` must be a valid Hugging Face
    repo id, or ``"repo_id:subfolder"`` (the Llamascopium hub layout); the files matching
    ``allow_patterns`` (relative to ``subfolder``) are fetched with
    ``huggingface_hub.snapshot_download`` (``local_files_only`` and ``revision`` passed through)
    and ``snapshot/subfolder`` is returned.

    Raises:
        CheckpointError: the path is a file, a :class:`Path` that does not exist, a string that
            is neither a directory nor a valid repo id, the download failed, or ``subfolder`` is
            not a folder there.
    """
    local = resolve(Path(source))
    if isinstance(source, Path) or local.exists():
        if not local.exists():
            raise CheckpointError(f"checkpoint directory {str(local)!r} does not exist")
        if not local.is_dir():
            raise CheckpointError(f"{str(local)!r} is a file; expected a checkpoint directory")
        if subfolder:
            local = local / subfolder
            if not local.is_dir():
                raise CheckpointError(f"checkpoint directory {str(local)!r} does not exist")
        return local
    repo_id = os.fspath(source)
    if subfolder is None and ":" in repo_id:
        repo_id, subfolder = repo_id.split(":", 1)
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise CheckpointError(
            f"{repo_id!r} is neither an existing local directory nor a valid Hugging Face repo id ({e})"
        ) from e
    prefix = f"{subfolder}/" if subfolder else ""
    try:
        snapshot = snapshot_download(
            repo_id=repo_id,
            allow_patterns=[prefix + p for p in allow_patterns],
            local_files_only=local_files_only,
            revision=revision,
        )
    except Exception as e:  # network, auth, missing repo, offline cache miss: all end the load
        raise CheckpointError(
            f"{repo_id!r} is not a local directory and could not be fetched from the Hugging Face hub "
            f"(local_files_only={local_files_only}): {type(e).__name__}: {e}"
        ) from e
    path = Path(snapshot) / subfolder if subfolder else Path(snapshot)
    if not path.is_dir():
        raise CheckpointError(f"hub repo {repo_id!r} has no folder {subfolder!r}")
    return path


def read_json_object(path: Path) -> dict[str, Any]:
    """Parse ``path`` as a JSON object.

    Raises:
        CheckpointError: the file is missing, unreadable, not JSON, or not an object (naming the file).
    """
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from e
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e
    except RecursionError as e:  # e.g. "[[[[…]]]]" nested deeper than the interpreter's stack
        raise CheckpointError(f"{path}: JSON nested too deeply to parse") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_yaml_object(path: Path) -> dict[str, Any]:
    """``path`` as a YAML mapping (``{}`` when the file is absent or empty).

    Raises:
        CheckpointError: unreadable YAML, or not a mapping (naming the file).
    """
    if not path.is_file():
        return {}
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, OSError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not readable YAML ({e})") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a mapping, got {type(data).__name__}")
    return data


def read_safetensors_header(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """``(shapes, metadata)`` from a safetensors file's header, without reading the tensors.

    Raises:
        CheckpointError: the file is missing or not a readable safetensors file.
    """
    from safetensors import safe_open

    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in names}
            metadata = dict(f.metadata() or {})
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from e
    return shapes, metadata


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file, on CPU.

    Raises:
        CheckpointError: the file is missing or its tensors cannot be read.
    """
    from safetensors.torch import load_file

    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        return load_file(str(path), device="cpu")
    except Exception as e:
        raise CheckpointError(f"{path}: cannot load tensors ({type(e).__name__}: {e})") from e
