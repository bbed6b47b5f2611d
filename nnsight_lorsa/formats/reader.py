"""A checkpoint reader in three steps, the shape every format module follows (after SAELens's
``loading/pretrained_sae_loaders.py``): ``parse_config(path, **options)`` -> our config objects,
``load_weights(path, config)`` -> a state dict in our layout, ``build(config, state, device=, dtype=)``
-> the module (through :func:`.validate.build_module`). :func:`read` resolves a local directory or
hub repo id and runs the three steps; the registry (:mod:`.registry`) picks the reader by format.
"""

from __future__ import annotations

import contextlib
import glob
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._atomic import check, manifest_of
from .._placement import check_placement_args
from ..errors import ArgumentError
from .files import headers_only, resolve_checkpoint_dir
from .validate import build_module

__all__ = ["Parsed", "Reader", "hub_configs", "hub_weights", "read", "read_dir"]

#: the suffix of the weight files the readers read (everything else they read is a small config)
WEIGHTS_SUFFIX = ".safetensors"


@dataclass
class Parsed:
    """What ``parse_config`` returns: the checkpoint ``directory``, our ``config`` object
    (:class:`~nnsight_lorsa.modules.lorsa_config.LorsaConfig`, ``SAEConfig``, …) and the
    format's own ``settings`` that the weight step still needs (hook names, folds, files)."""

    directory: Path
    config: Any
    settings: dict[str, Any] = field(default_factory=dict)

    def build_module(self, cls: Callable[[Any], Any], state: dict[str, torch.Tensor], file: str, *,
                     device: torch.device | str | None, dtype: torch.dtype | None) -> Any:
        """``cls(config)`` with ``state`` through :func:`.validate.build_module`, errors naming
        ``directory/file`` and ``settings["source"]`` (what the shapes were derived from)."""
        cfg = self.config
        return build_module(lambda: cls(cfg), state, self.directory / file, self.settings.get("source", file),
                            device=device, dtype=dtype)


@dataclass(frozen=True)
class Reader:
    """One on-disk layout and how it becomes our module.

    Attributes:
        name: what it reads, e.g. ``"saelens"``, ``"llamascopium_lorsa"``.
        hub_files: the files it reads, relative to the folder (its config first): a hub load fetches those that
            are no ``.safetensors`` (the configs) first, then the weights (:meth:`weight_files`).
        parse_config: ``(path, **options) -> Parsed`` (validated, nothing allocated).
        load_weights: ``(path, parsed) -> state`` (tensors in our names and layout).
        build: ``(parsed, state, *, device, dtype) -> module`` (validated against the module).
        hub_weights: ``(folder holding the fetched configs) -> patterns`` of the weight files to fetch (default:
            the ``.safetensors`` of ``hub_files`` where the config ``hub_files[0]`` was fetched). Patterns are
            ``fnmatch``'s, whose ``*`` also spans ``/``: a reader whose weights are numbered names them digit by
            digit (circuit-tracer's), never ``*.safetensors``, which would fetch every weight file of the repo.
    """

    name: str
    hub_files: tuple[str, ...]
    parse_config: Callable[..., Any]
    load_weights: Callable[[Path, Any], Any]
    build: Callable[..., Any]
    hub_weights: Callable[[Path], list[str]] | None = None

    def weight_files(self, directory: Path) -> list[str]:
        """The patterns of the weight files to fetch into ``directory``, which holds what :func:`hub_configs`
        fetched (see ``hub_weights``)."""
        if self.hub_weights is not None:
            return list(self.hub_weights(directory))
        if not (directory / self.hub_files[0]).is_file():
            return []
        return [glob.escape(f) for f in self.hub_files if f.endswith(WEIGHTS_SUFFIX)]

    @property
    def options(self) -> frozenset[str]:
        """The keyword options ``parse_config`` takes (beyond the path)."""
        params = list(inspect.signature(self.parse_config).parameters.values())[1:]
        return frozenset(p.name for p in params)


def hub_configs(readers: list[Reader] | tuple[Reader, ...]) -> list[str]:
    """What a hub load of a checkpoint read by one of ``readers`` fetches first: their configs (every ``hub_files``
    entry that is no ``.safetensors``; the manifest ``checksums.json`` is always added by
    :func:`.files.resolve_checkpoint_dir`)."""
    return sorted({f for r in readers for f in r.hub_files if not f.endswith(WEIGHTS_SUFFIX)})


def hub_weights(readers: list[Reader] | tuple[Reader, ...], directory: Path) -> list[str]:
    """What a hub load fetches once the configs are in ``directory`` (:func:`hub_configs`): every file its manifest
    lists (``checksums.json``, written by every save of this package) and each reader's weights
    (:meth:`Reader.weight_files`); patterns relative to ``directory``, names escaped.

    Raises:
        CheckpointError: a corrupt manifest (naming it).
    """
    names = {glob.escape(name) for name in manifest_of(directory) or {}}
    for reader in readers:
        names.update(reader.weight_files(directory))
    return sorted(names)


def read_dir(reader: Reader, path: Path, *, device: torch.device | str | None = None,
             dtype: torch.dtype | None = None, **options: Any) -> Any:
    """Run ``reader``'s three steps on the local directory ``path``.

    Its ``checksums.json`` (written by every save of this package, :mod:`.._atomic`) is checked when
    present, every listed file's size and sha256, before the module is returned: after the steps, so a
    file the steps refuse (a hand-edited config with a bad key) gets their error, naming the key, and
    a file they accept but that differs from what was saved (a flipped bit in a tensor, a torn or mixed
    directory) gets the manifest's. The manifest is read before the steps and the files checked
    against it after them, so a save swapped in while they ran is refused, not read as a mix.

    ``device="meta"`` (shapes and dtypes, no values) reads the tensor files' headers only
    (:func:`.files.headers_only`: no tensor bytes; the value checks — NaN/inf, a Llamascopium mask's and rotary
    tables' values — are skipped, names, shapes, dtypes and configs checked as for any load) and checks the
    manifest's sizes, not its hashes (which would read every byte).

    Raises:
        ArgumentError: (a ``TypeError``) an option ``reader.parse_config`` does not take.
        CheckpointError: a file listed in ``checksums.json`` is missing, truncated or altered (named).
        CheckpointError, UnsupportedArchitectureError, ConfigMismatchError: from the steps.
    """
    unknown = sorted(set(options) - reader.options)
    if unknown:
        raise ArgumentError(f"the {reader.name} reader takes no option {unknown}; it takes {sorted(reader.options)} "
                            f"(reading {os.fspath(path)})")
    entries = manifest_of(path)
    config = reader.parse_config(path, **options)
    meta = device is not None and torch.device(device).type == "meta"
    with headers_only() if meta else contextlib.nullcontext():
        state = reader.load_weights(path, config)
    module = reader.build(config, state, device=device, dtype=dtype)
    if entries is not None:
        check(path, entries, hashes=not meta)
    return module


def read(reader: Reader, source: str | os.PathLike[str], *, subfolder: str | None = None,
         device: Any = None, dtype: Any = None,  # checked by check_placement_args (a named error)
         local_files_only: bool = False, revision: str | None = None, **options: Any) -> Any:
    """``reader`` applied to a local directory or a hub repo id (``"org/name"``, ``"org/name:folder"``).

    Args:
        source: checkpoint directory, or a Hugging Face repo id when no such local path exists.
        subfolder: a folder inside ``source`` (local or hub).
        device, dtype: where and as what the parameters go (default CPU, the stored dtype: the widest where the
            tensors are stored in several, so every stored value loads exactly; a ``dtype`` given casts each tensor
            to it, rounded once, refusing one whose values it would turn into inf).
        local_files_only, revision: passed to ``huggingface_hub.snapshot_download``.
        options: the reader's own (``d_model``, ``adapter``, ``norm_scaling_factor``, …).

    Raises:
        CheckpointError: an unusable source (see :func:`.files.resolve_checkpoint_dir`) or file.
        TypeError: an unknown option.
        ArgumentError: a ``dtype`` a module cannot compute in, or a ``device`` that is not one; a ``revision``
            with a local path; a hub ``subfolder`` that leaves the repo.
        PlacementError: a ``device`` this machine lacks (``"cuda"`` without CUDA).
    """
    device = check_placement_args(device, dtype, f"loading {source}")
    path = resolve_checkpoint_dir(source, allow_patterns=hub_configs([reader]), subfolder=subfolder,
                                  local_files_only=local_files_only, revision=revision,
                                  then=lambda d: hub_weights([reader], d))
    return read_dir(reader, path, device=device, dtype=dtype, **options)
