"""Our own on-disk format for SAEs, transcoders and CLTs.

A checkpoint is a directory with two files (the layout of :mod:`.lorsa_format`):

``config.json``
    ``{"format": "nnsight-lorsa-sparse-coder", "version": 1, "kind": KIND, "config": cfg.to_dict()}``
    with ``KIND`` one of ``"sae"``, ``"transcoder"``, ``"skip_transcoder"``, ``"clt"``.
``model.safetensors``
    The module's state dict (``W_enc b_enc W_dec b_dec`` [``W_skip``] [``activation.threshold``],
    per layer for a CLT), contiguous CPU tensors. HookPoints carry no state.

Only JSON and safetensors are read (never pickle). Every problem raises
:class:`~nnsight_lorsa.errors.CheckpointError` naming the file and the key. Reader steps
(:class:`~.reader.Reader`): :func:`parse_config`, :func:`load_weights`, :func:`build`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._atomic import atomic_directory
from ..errors import ArgumentError
from ..modules.clt import CLTConfig, CrossLayerTranscoder
from ..modules.sae import SAEConfig, SparseAutoencoder
from ..modules.transcoder import SkipTranscoder, Transcoder, TranscoderConfig
from .files import load_safetensors, read_json_object, read_safetensors_header
from .reader import Parsed, Reader, read
from .validate import Field, check_d_model, check_mapping, check_version, config_errors, read_fields

FORMAT_TAG = "nnsight-lorsa-sparse-coder"
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

SparseModule = SparseAutoencoder | Transcoder | SkipTranscoder | CrossLayerTranscoder

#: kind tag -> (module class, config class)
KINDS: dict[str, tuple[type[nn.Module], type[Any]]] = {
    "sae": (SparseAutoencoder, SAEConfig),
    "transcoder": (Transcoder, TranscoderConfig),
    "skip_transcoder": (SkipTranscoder, TranscoderConfig),
    "clt": (CrossLayerTranscoder, CLTConfig),
}

#: ``config.json``'s envelope, and the sizes its ``config`` object may hold (the rest: the config class)
ENVELOPE = (Field("format", equals=FORMAT_TAG), Field("kind", str, choices=tuple(KINDS)), Field("config", dict))
SIZES = (Field("d_in", size=True, default=None), Field("d_sae", size=True, default=None),
         Field("d_out", size=True, default=None), Field("n_layers", size=True, default=None))

__all__ = ["FORMAT_TAG", "FORMAT_VERSION", "KINDS", "READER", "build", "kind_of", "load_sparse_coder", "load_weights",
           "parse_config", "save_sparse_coder"]


def kind_of(module: nn.Module) -> str | None:
    """The :data:`KINDS` tag of ``module`` (``"sae"``, ``"transcoder"``, ``"skip_transcoder"``, ``"clt"``):
    its class's, else its nearest base class's in the table; None for another module (a Lorsa)."""
    tags = {cls: tag for tag, (cls, _) in KINDS.items()}
    return next((tags[cls] for cls in type(module).__mro__ if cls in tags), None)


def save_sparse_coder(module: nn.Module, directory: str | os.PathLike[str]) -> Path:
    """Write an SAE / (skip) transcoder / CLT as ``config.json`` + ``model.safetensors``; returns the dir.

    Raises:
        ArgumentError: ``module`` is none of those (a misuse, not a file error).
    """
    kind = kind_of(module)
    if kind is None:
        raise ArgumentError(f"save_sparse_coder: cannot save a {type(module).__name__} (an SAE, transcoder, "
                            "skip transcoder or CLT)")
    cfg = getattr(module, "cfg").to_dict()  # noqa: B009
    doc = {"format": FORMAT_TAG, "version": FORMAT_VERSION, "kind": kind, "config": cfg}
    text = json.dumps(doc, indent=2, sort_keys=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in module.state_dict().items()}
    with atomic_directory(directory) as stage:
        stage.save_tensors(WEIGHTS_FILE, state, metadata={"format": FORMAT_TAG, "version": str(FORMAT_VERSION)})
        stage.write_text(CONFIG_FILE, text)
    return Path(directory)


def parse_config(directory: Path, *, d_model: int | None = None) -> Parsed:
    """``config.json``: ``Parsed(directory, SAEConfig | TranscoderConfig | CLTConfig, {"kind"})``.

    Raises:
        CheckpointError: missing file, wrong format tag/version (an int; ``true`` is not 1)/kind, a bad
            config or size (``config.<key>``), an ``extra`` that is not a mapping.
        ConfigMismatchError: ``d_model`` given and different from the checkpoint's ``d_in``.
    """
    config_path = directory / CONFIG_FILE
    doc = read_json_object(config_path)
    read_fields(doc, config_path, ENVELOPE[:1])
    check_version(doc, config_path, FORMAT_VERSION)
    envelope = read_fields(doc, config_path, ENVELOPE[1:])
    kind, raw_cfg = envelope["kind"], envelope["config"]
    read_fields(raw_cfg, config_path, SIZES, prefix="config.")
    if "extra" in raw_cfg:  # null: none (as an absent key)
        raw_cfg = {**raw_cfg, "extra": check_mapping(raw_cfg, "extra", config_path)}
    with config_errors(config_path, "key 'config'"):
        cfg = KINDS[kind][1].from_dict(raw_cfg)
    check_d_model(cfg.d_in, d_model, config_path, "config.d_in")
    return Parsed(directory, cfg, {"kind": kind, "source": f"{CONFIG_FILE} ({kind})"})


def load_weights(directory: Path, parsed: Parsed) -> dict[str, torch.Tensor]:
    """``model.safetensors`` (header read first: a clear error for a missing or corrupt file).

    Raises:
        CheckpointError: missing or unreadable file.
    """
    weights_path = directory / WEIGHTS_FILE
    read_safetensors_header(weights_path)
    return load_safetensors(weights_path)


def build(parsed: Parsed, state: dict[str, torch.Tensor], *, device: torch.device | str | None = None,
          dtype: torch.dtype | None = None) -> Any:
    """The module of the parsed kind with ``state`` (``dtype`` default: the stored dtype, the widest
    where the tensors are stored in several: :func:`.validate.stored_dtype`).

    Raises:
        CheckpointError: missing/unexpected tensor, wrong shape, non-floating or non-finite tensor.
    """
    return parsed.build_module(KINDS[parsed.settings["kind"]][0], state, WEIGHTS_FILE, device=device, dtype=dtype)


READER = Reader("nnsight_lorsa_sparse_coder", (CONFIG_FILE, WEIGHTS_FILE), parse_config, load_weights, build)


def load_sparse_coder(directory: str | os.PathLike[str], **kwargs: Any) -> Any:
    """Inverse of :func:`save_sparse_coder` (a local directory or a hub repo id), in eval mode.

    Source: this package's own format (module docstring); same as
    ``formats.load(directory, format="nnsight_lorsa")`` for a sparse-coder checkpoint.
    ``kwargs``: ``d_model``, ``device``, ``dtype``, ``subfolder``, ``local_files_only``, ``revision``.

    Returns:
        :class:`SparseAutoencoder`, :class:`Transcoder`, :class:`SkipTranscoder` or
        :class:`CrossLayerTranscoder` (``W_enc (d_in, d_sae)``, ``W_dec (d_sae, d_out)``, …).

    Raises:
        CheckpointError: missing file, wrong format tag/version/kind, bad config, tensor problems.
        ConfigMismatchError: ``d_model`` given and different from the checkpoint's ``d_in``.
    """
    return read(READER, directory, **kwargs)
