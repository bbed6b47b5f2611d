"""Our own on-disk format for SAEs, transcoders and CLTs, plus helpers shared by the SAE-family loaders.

A checkpoint is a directory with two files (the layout of :mod:`.lorsa_format`):

``config.json``
    ``{"format": "nnsight-lorsa-sparse-coder", "version": 1, "kind": KIND, "config": cfg.to_dict()}``
    with ``KIND`` one of ``"sae"``, ``"transcoder"``, ``"skip_transcoder"``, ``"clt"``.
``model.safetensors``
    The module's state dict (``W_enc b_enc W_dec b_dec`` [``W_skip``] [``activation.threshold``],
    per layer for a CLT), contiguous CPU tensors. HookPoints carry no state.

Only JSON and safetensors are read (never pickle). Every problem raises
:class:`~nnsight_lorsa.errors.CheckpointError` naming the file and the key. The loaders of other
formats (:mod:`.saelens`, :mod:`.sparsify`, :mod:`.circuit_tracer`) build their modules with
:func:`build_module`: allocated on the meta device (no random init), the tensor inventory checked
against the module's own state dict, then loaded strictly.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from ..errors import CheckpointError, ConfigMismatchError
from ..modules.clt import CLTConfig, CrossLayerTranscoder
from ..modules.sae import SAEConfig, SparseAutoencoder
from ..modules.transcoder import SkipTranscoder, Transcoder, TranscoderConfig
from .lorsa_format import (
    check_tensor_inventory,
    load_safetensors,
    read_json_object,
    read_safetensors_header,
    resolve_checkpoint_dir,
)

FORMAT_TAG = "nnsight-lorsa-sparse-coder"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

SparseModule = SparseAutoencoder | Transcoder | SkipTranscoder | CrossLayerTranscoder
M = TypeVar("M", bound=nn.Module)

#: kind tag -> (module class, config class)
KINDS: dict[str, tuple[type[nn.Module], type[Any]]] = {
    "sae": (SparseAutoencoder, SAEConfig),
    "transcoder": (Transcoder, TranscoderConfig),
    "skip_transcoder": (SkipTranscoder, TranscoderConfig),
    "clt": (CrossLayerTranscoder, CLTConfig),
}

__all__ = ["FORMAT_TAG", "FORMAT_VERSION", "build_module", "check_d_model", "load_sparse_coder",
           "save_sparse_coder"]


def build_module(
    factory: Callable[[], M],
    state: Mapping[str, torch.Tensor],
    path: Path,
    source: str,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> M:
    """``factory()`` built on the meta device, checked against ``state`` (file ``path``), then loaded.

    Raises:
        CheckpointError: a missing or unexpected tensor, or one whose shape differs from what
            ``source`` (the config, named in the message) implies — naming ``path`` and the key.
    """
    with torch.device("meta"):
        module = factory()
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    check_tensor_inventory(path, {k: tuple(v.shape) for k, v in state.items()}, expected, source)
    if dtype is not None:
        module = module.to(dtype)
    module.to_empty(device=torch.device("cpu") if device is None else device)
    with torch.no_grad():
        module.load_state_dict(dict(state), strict=True)
    return module.eval()


def check_d_model(found: int, expected: int | None, path: Path, key: str) -> None:
    """ConfigMismatchError naming ``path`` and ``key`` when ``expected`` is given and differs."""
    if expected is not None and found != expected:
        raise ConfigMismatchError(f"{path}: {key} = {found} but the model's d_model is {expected}")


def _kind_of(module: nn.Module) -> str:
    if isinstance(module, CrossLayerTranscoder):
        return "clt"
    if isinstance(module, SkipTranscoder):
        return "skip_transcoder"
    if isinstance(module, Transcoder):
        return "transcoder"
    if isinstance(module, SparseAutoencoder):
        return "sae"
    raise CheckpointError(f"save_sparse_coder: cannot save a {type(module).__name__}")


def save_sparse_coder(module: nn.Module, directory: str | os.PathLike[str]) -> Path:
    """Write an SAE / (skip) transcoder / CLT as ``config.json`` + ``model.safetensors``; returns the dir."""
    import json

    from safetensors.torch import save_file

    kind = _kind_of(module)
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in module.state_dict().items()}
    save_file(state, str(path / WEIGHTS_FILE), metadata={"format": FORMAT_TAG, "version": str(FORMAT_VERSION)})
    cfg = getattr(module, "cfg").to_dict()  # noqa: B009
    doc = {"format": FORMAT_TAG, "version": FORMAT_VERSION, "kind": kind, "config": cfg}
    (path / CONFIG_FILE).write_text(json.dumps(doc, indent=2, sort_keys=True), encoding="utf-8")
    return path


def load_sparse_coder(
    directory: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    d_model: int | None = None,
    local_files_only: bool = False,
    revision: str | None = None,
) -> Any:
    """Inverse of :func:`save_sparse_coder` (a local directory or a hub repo id), in eval mode.

    Raises:
        CheckpointError: missing file, wrong format tag/version/kind, bad config, tensor problems.
        ConfigMismatchError: ``d_model`` given and different from the checkpoint's ``d_in``.
    """
    path = resolve_checkpoint_dir(directory, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE],
                                  local_files_only=local_files_only, revision=revision)
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    doc = read_json_object(config_path)
    if doc.get("format") != FORMAT_TAG:
        raise CheckpointError(f"{config_path}: key 'format' is {doc.get('format')!r}, expected {FORMAT_TAG!r}")
    if doc.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{config_path}: key 'version' is {doc.get('version')!r}, expected {FORMAT_VERSION}")
    kind = doc.get("kind")
    if kind not in KINDS:
        raise CheckpointError(f"{config_path}: key 'kind' is {kind!r}; known: {sorted(KINDS)}")
    cls, cfg_cls = KINDS[kind]
    raw_cfg = doc.get("config")
    if not isinstance(raw_cfg, dict):
        raise CheckpointError(f"{config_path}: key 'config' must be an object")
    try:
        cfg = cfg_cls.from_dict(raw_cfg)
    except CheckpointError as e:
        raise CheckpointError(f"{config_path}: key 'config': {e}") from e
    check_d_model(cfg.d_in, d_model, config_path, "config.d_in")
    read_safetensors_header(weights_path)  # clear error for a missing/corrupt file
    state = load_safetensors(weights_path)
    first = state.get("W_enc")
    return build_module(lambda: cls(cfg), state, weights_path, f"{config_path.name} ({kind})",
                        device=device, dtype=dtype or (first.dtype if first is not None else None))
