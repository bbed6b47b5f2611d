"""The package's own on-disk format for a :class:`~nnsight_lorsa.modules.lorsa.Lorsa`.

A checkpoint is a directory with two files:

``config.json``
    ``{"format": "nnsight-lorsa", "version": 1, "config": LorsaConfig.to_dict()}``.
``model.safetensors``
    The module's state dict (``W_Q W_K b_Q b_K W_V b_V W_O`` and, per config, ``b_D``,
    ``ln_q.w``, ``ln_k.w``) as contiguous CPU tensors, with header metadata
    ``{"format": "nnsight-lorsa", "version": "1"}``. HookPoints carry no state.

Loading never unpickles anything: only JSON and safetensors are read. Every problem (missing
file, bad JSON, wrong format tag, missing/unexpected tensor, a shape that disagrees with the
config) raises :class:`~nnsight_lorsa.errors.CheckpointError` naming the file and the key.

``load_lorsa`` also accepts a Hugging Face hub repo id: a string that is not an existing local
path is validated as a repo id and fetched with ``huggingface_hub.snapshot_download`` (only
``config.json`` and ``model.safetensors``). ``huggingface_hub`` is imported only then.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, UnsupportedArchitectureError
from ..modules.lorsa import Lorsa
from ..modules.lorsa_config import LorsaConfig

FORMAT_TAG = "nnsight-lorsa"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

__all__ = ["CONFIG_FILE", "FORMAT_TAG", "FORMAT_VERSION", "WEIGHTS_FILE", "load_lorsa", "save_lorsa"]


# --------------------------------------------------------------------------- shared helpers
def resolve_checkpoint_dir(
    source: str | os.PathLike[str],
    *,
    allow_patterns: list[str],
    subfolder: str | None = None,
    local_files_only: bool = False,
    revision: str | None = None,
) -> Path:
    """A local checkpoint directory for ``source``: a local directory, or a downloaded hub snapshot.

    ``source`` is used as a local directory when it exists (or is a :class:`~pathlib.Path`).
    Otherwise it must be a valid Hugging Face repo id; the files matching ``allow_patterns``
    are fetched with ``huggingface_hub.snapshot_download`` (``local_files_only`` and
    ``revision`` passed through) and ``snapshot/subfolder`` is returned.

    Raises:
        CheckpointError: the path is a file, a :class:`Path` that does not exist, a string that
            is neither a directory nor a valid repo id, or the download failed.
    """
    local = Path(source)
    if isinstance(source, Path) or local.exists():
        if not local.exists():
            raise CheckpointError(f"checkpoint directory {str(local)!r} does not exist")
        if not local.is_dir():
            raise CheckpointError(f"{str(local)!r} is a file; expected a checkpoint directory")
        return local
    repo_id = os.fspath(source)
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise CheckpointError(
            f"{repo_id!r} is neither an existing local directory nor a valid Hugging Face repo id ({e})"
        ) from e
    try:
        snapshot = snapshot_download(
            repo_id=repo_id,
            allow_patterns=allow_patterns,
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
    """Parse ``path`` as a JSON object; CheckpointError naming the file otherwise."""
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e})") from e
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_safetensors_header(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """``(shapes, metadata)`` from a safetensors file's header, without reading the tensors."""
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
    """All tensors of a safetensors file, on CPU."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except Exception as e:
        raise CheckpointError(f"{path}: cannot load tensors ({type(e).__name__}: {e})") from e


def check_tensor_inventory(
    path: Path, found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], source: str
) -> None:
    """Raise CheckpointError naming ``path`` and the keys when ``found`` differs from ``expected``."""
    problems = []
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        problems.append(f"missing tensors {missing}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    for key in sorted(set(found) & set(expected)):
        if tuple(found[key]) != tuple(expected[key]):
            problems.append(
                f"tensor {key!r} has shape {tuple(found[key])} but {source} implies {tuple(expected[key])}"
            )
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))


def build_lorsa(
    cfg: LorsaConfig,
    state: dict[str, torch.Tensor],
    *,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> Lorsa:
    """A Lorsa with ``state`` loaded (strict), allocated directly on ``device`` without random init."""
    module = Lorsa(cfg, device="meta", dtype=dtype)
    module.to_empty(device=torch.device("cpu") if device is None else device)
    with torch.no_grad():
        module.load_state_dict(state, strict=True)
    return module.eval()


# --------------------------------------------------------------------------- public API
def save_lorsa(lorsa: Lorsa, directory: str | os.PathLike[str]) -> Path:
    """Write ``lorsa`` to ``directory`` (created if needed) as ``config.json`` + ``model.safetensors``.

    Existing files of the same names are replaced (each written to a temporary name first).
    Returns the directory.

    Raises:
        TypeError: ``lorsa`` is not a :class:`Lorsa`.
        CheckpointError: the config (e.g. ``extra``) is not JSON-serialisable.
    """
    from safetensors.torch import save_file

    if not isinstance(lorsa, Lorsa):
        raise TypeError(f"save_lorsa expects a Lorsa module, got {type(lorsa).__name__}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    try:
        config_text = json.dumps(
            {"format": FORMAT_TAG, "version": FORMAT_VERSION, "config": lorsa.cfg.to_dict()},
            indent=2,
            allow_nan=False,
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"Lorsa config is not JSON-serialisable (check cfg.extra): {e}") from e
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in lorsa.state_dict().items()}
    weights, config = out / WEIGHTS_FILE, out / CONFIG_FILE
    tmp_w, tmp_c = out / f".{WEIGHTS_FILE}.tmp", out / f".{CONFIG_FILE}.tmp"
    save_file(tensors, str(tmp_w), metadata={"format": FORMAT_TAG, "version": str(FORMAT_VERSION)})
    tmp_c.write_text(config_text + "\n", encoding="utf-8")
    os.replace(tmp_w, weights)
    os.replace(tmp_c, config)
    return out


def _parse_config(path: Path) -> LorsaConfig:
    raw = read_json_object(path)
    if raw.get("format") != FORMAT_TAG:
        raise CheckpointError(f"{path}: key 'format' is {raw.get('format')!r}, expected {FORMAT_TAG!r}")
    if raw.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: key 'version' is {raw.get('version')!r}; this package reads version {FORMAT_VERSION}"
        )
    cfg_dict = raw.get("config")
    if not isinstance(cfg_dict, dict):
        raise CheckpointError(f"{path}: key 'config' must be a JSON object, got {type(cfg_dict).__name__}")
    try:
        return LorsaConfig.from_dict(cfg_dict)
    except UnsupportedArchitectureError as e:
        raise UnsupportedArchitectureError(f"{path}: key 'config': {e}") from e
    except (CheckpointError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: key 'config' is invalid: {e}") from e


def load_lorsa(
    directory: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    local_files_only: bool = False,
    revision: str | None = None,
) -> Lorsa:
    """Load a Lorsa written by :func:`save_lorsa` from a local directory or a hub repo id.

    Args:
        directory: checkpoint directory, or a Hugging Face repo id (``"org/name"``) when no such
            local path exists.
        device: where the parameters go (default CPU).
        dtype: parameter dtype (default: the dtype stored for ``W_Q``).
        local_files_only, revision: passed to ``huggingface_hub.snapshot_download`` for repo ids.

    Returns:
        The module in eval mode.

    Raises:
        CheckpointError: missing file, bad JSON, wrong format tag/version, invalid config,
            missing/unexpected tensor, shape or dtype disagreeing with the config (the message
            names the file and the key), or an invalid/unfetchable repo id.
        UnsupportedArchitectureError: the config names an unsupported RoPE type.
    """
    path = resolve_checkpoint_dir(
        directory,
        allow_patterns=[CONFIG_FILE, WEIGHTS_FILE],
        local_files_only=local_files_only,
        revision=revision,
    )
    cfg = _parse_config(path / CONFIG_FILE)
    weights = path / WEIGHTS_FILE
    shapes, metadata = read_safetensors_header(weights)
    if metadata.get("format", FORMAT_TAG) != FORMAT_TAG:
        raise CheckpointError(
            f"{weights}: header metadata 'format' is {metadata['format']!r}, expected {FORMAT_TAG!r}"
        )
    expected = {k: tuple(v.shape) for k, v in Lorsa(cfg, device="meta").state_dict().items()}
    check_tensor_inventory(weights, shapes, expected, source=CONFIG_FILE)
    state = load_safetensors(weights)
    for key, tensor in state.items():
        if not tensor.is_floating_point():
            raise CheckpointError(f"{weights}: tensor {key!r} has non-floating dtype {tensor.dtype}")
    return build_lorsa(cfg, state, device=device, dtype=state["W_Q"].dtype if dtype is None else dtype)
