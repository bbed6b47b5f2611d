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

``load_lorsa`` (and :func:`~nnsight_lorsa.formats.load`) also accepts a Hugging Face hub repo id:
a string that is not an existing local path is validated as a repo id and fetched with
``huggingface_hub.snapshot_download`` (only ``config.json`` and ``model.safetensors``).
``huggingface_hub`` is imported only then.

Reader steps (:class:`~.reader.Reader`): :func:`parse_config` -> :class:`LorsaConfig`,
:func:`load_weights` -> state dict, :func:`build` -> :class:`Lorsa`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from .._atomic import atomic_directory
from ..errors import ArgumentError, CheckpointError
from ..modules.lorsa import Lorsa
from ..modules.lorsa_config import LorsaConfig
from .files import load_safetensors, read_json_object, read_safetensors_header
from .reader import Parsed, Reader, read
from .validate import (
    Field,
    adapter_families,
    check_mapping,
    check_tensor_inventory,
    check_version,
    config_errors,
    file_errors,
    read_fields,
    require,
)

FORMAT_TAG = "nnsight-lorsa"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
#: ``config.json``'s envelope, and the sizes of its ``config`` object (the rest: :meth:`LorsaConfig.from_dict`)
ENVELOPE = (Field("format", equals=FORMAT_TAG), Field("config", dict))
SIZES = tuple(Field(key, size=True) for key in ("d_model", "n_qk_heads", "d_qk_head", "n_ov_heads",
                                                               "top_k"))

__all__ = ["CONFIG_FILE", "FORMAT_TAG", "FORMAT_VERSION", "READER", "WEIGHTS_FILE", "build",
           "load_lorsa", "load_weights", "parse_config", "save_lorsa"]


# --------------------------------------------------------------------------- writer
def save_lorsa(lorsa: Any, directory: str | os.PathLike[str]) -> Path:
    """Write ``lorsa`` to ``directory`` (created if needed) as ``config.json`` + ``model.safetensors``.

    Atomic (:func:`nnsight_lorsa._atomic.atomic_directory`): the files and a ``checksums.json``
    manifest are staged in a sibling and swapped in, so a crash leaves the old checkpoint or the new
    one, never a mix. Returns the directory.

    Raises:
        ArgumentError: (a ``TypeError``) ``lorsa`` is not a :class:`Lorsa`.
        CheckpointError: the config (e.g. ``extra``) is not JSON-serialisable.
    """
    if not isinstance(lorsa, Lorsa):
        raise ArgumentError(f"save_lorsa(lorsa=...) expects a Lorsa module, got {type(lorsa).__name__}")
    with file_errors(Path(directory) / CONFIG_FILE,
                     {(TypeError, ValueError): "the Lorsa config is not JSON-serialisable (check cfg.extra): {e}"}):
        config_text = json.dumps(
            {"format": FORMAT_TAG, "version": FORMAT_VERSION, "config": lorsa.cfg.to_dict()},
            indent=2,
            allow_nan=False,
        )
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in lorsa.state_dict().items()}
    with atomic_directory(directory) as stage:
        stage.save_tensors(WEIGHTS_FILE, tensors, metadata={"format": FORMAT_TAG, "version": str(FORMAT_VERSION)})
        stage.write_text(CONFIG_FILE, config_text + "\n")
    return Path(directory)


# --------------------------------------------------------------------------- reader
def parse_config(directory: Path) -> Parsed:
    """``config.json`` of ``directory``: ``Parsed(directory, LorsaConfig)`` (tag, version, sizes validated).

    Raises:
        CheckpointError: missing/invalid JSON, wrong ``format`` / ``version`` (``true`` is not 1), a
            size that is not a positive int (``config.<key>``), an ``architecture`` that is neither
            null nor an adapter family (``"llama"``, ``"gpt_neox"``, ``"gpt2"``), an ``extra`` that is
            not a mapping, an invalid config (naming the file and the key).
        UnsupportedArchitectureError: an unsupported RoPE type.
    """
    path = directory / CONFIG_FILE
    raw = read_json_object(path)
    read_fields(raw, path, ENVELOPE[:1])
    check_version(raw, path, FORMAT_VERSION)
    cfg_dict = read_fields(raw, path, ENVELOPE[1:])["config"]
    read_fields(cfg_dict, path, [f for f in SIZES if f.key in cfg_dict], prefix="config.")  # present: not null
    if "extra" in cfg_dict:  # null: none (as an absent key)
        cfg_dict = {**cfg_dict, "extra": check_mapping(cfg_dict, "extra", path)}
    arch = cfg_dict.get("architecture")
    require(arch is None or (isinstance(arch, str) and arch in adapter_families()), path,
            f"key 'config.architecture' is {arch!r}; expected null or an adapter family: {sorted(adapter_families())}")
    with config_errors(path, "key 'config' is invalid", (CheckpointError, ValueError, TypeError),
                       unsupported="key 'config'"):
        return Parsed(directory, LorsaConfig.from_dict(cfg_dict), {"source": CONFIG_FILE})


def load_weights(directory: Path, parsed: Parsed) -> dict[str, torch.Tensor]:
    """``model.safetensors``: header tag and tensor shapes checked against the config before loading.

    Raises:
        CheckpointError: missing/corrupt file, wrong header ``format``, missing/unexpected tensor,
            a shape disagreeing with ``config.json``.
    """
    weights = directory / WEIGHTS_FILE
    shapes, metadata = read_safetensors_header(weights)
    require(metadata.get("format", FORMAT_TAG) == FORMAT_TAG, weights,
            f"header metadata 'format' is {metadata.get('format')!r}, expected {FORMAT_TAG!r}")
    expected = {k: tuple(v.shape) for k, v in Lorsa(parsed.config, device="meta").state_dict().items()}
    check_tensor_inventory(weights, shapes, expected, source=CONFIG_FILE)
    return load_safetensors(weights)


def build(parsed: Parsed, state: dict[str, torch.Tensor], *, device: torch.device | str | None = None,
          dtype: torch.dtype | None = None) -> Lorsa:
    """The :class:`Lorsa` of the parsed config with ``state``, allocated on ``device`` (default CPU)
    without random init (``dtype`` default: the stored dtype, the widest where the tensors are stored in several:
    :func:`.validate.stored_dtype`); in eval mode.

    Raises:
        CheckpointError: a non-floating or non-finite tensor (:func:`.validate.build_module`).
    """
    return parsed.build_module(Lorsa, state, WEIGHTS_FILE, device=device, dtype=dtype)


READER = Reader("nnsight_lorsa", (CONFIG_FILE, WEIGHTS_FILE), parse_config, load_weights, build)


def load_lorsa(directory: str | os.PathLike[str], **kwargs: Any) -> Lorsa:
    """Load a Lorsa written by :func:`save_lorsa` from a local directory or a hub repo id.

    Source: this package's own format (module docstring). Same as
    ``formats.load(directory, format="nnsight_lorsa")`` for a Lorsa checkpoint.

    Args:
        directory: checkpoint directory, or a Hugging Face repo id (``"org/name"``) when no such
            local path exists.
        kwargs: ``device`` (default CPU), ``dtype`` (default: the stored dtype, the widest where
            the tensors are stored in several; given, every tensor is cast to it),
            ``subfolder``, ``local_files_only`` / ``revision`` (``huggingface_hub.snapshot_download``).

    Returns:
        The module in eval mode; ``W_Q (n_qk_heads, d_model, d_qk_head)`` … as in :class:`Lorsa`.

    Raises:
        CheckpointError: missing file, bad JSON, wrong format tag/version, invalid config,
            missing/unexpected tensor, shape, dtype or non-finite values disagreeing with the
            config (the message names the file and the key), or an invalid/unfetchable repo id.
        UnsupportedArchitectureError: the config names an unsupported RoPE type.
    """
    return read(READER, directory, **kwargs)  # type: ignore[no-any-return]
