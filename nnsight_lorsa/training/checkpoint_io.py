"""Atomic, verified checkpoint directories (used by :class:`~.trainer.Trainer` and the sparse-attention
trainer, :class:`~..sparse_attention.train.SparseAttentionTrainer`), through the package's one atomic
write path, :mod:`nnsight_lorsa._atomic`.

A save writes every file into a sibling ``<dir>.tmp-<pid>-<hex>``, fsyncs each file, writes
``manifest.json`` (each file's size and sha256) last, fsyncs the directory, and only then swaps it
in: ``<dir>`` → ``<dir>.old``, the temporary → ``<dir>``, remove ``<dir>.old``. A crash at any
point leaves either the previous complete checkpoint or the new one. A load resolves ``<dir>`` (or
``<dir>.old`` when ``<dir>`` is missing, i.e. a crash between the two renames) and verifies every
file against the manifest before anything is read; unlike a module's, a checkpoint's manifest is required.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .._atomic import atomic_directory, resolve, verify
from .._checks import is_int
from ..errors import ArgumentError, CheckpointError
from ..formats.files import check_path

MANIFEST = "manifest.json"


def _boundary(event: str) -> None:
    """Called after each step of a save (a file written, a rename); a no-op. Tests replace it to stop
    the process at every file boundary."""


def _forward(event: str) -> None:
    if not event.startswith("partial:"):
        _boundary(event)


def _is_replaceable(d: Path, names: tuple[str, ...]) -> bool:
    """An existing directory we may swap out: empty, or a checkpoint (with a manifest, or an older one
    holding ``trainer.json`` or one of the ``names`` this save writes)."""
    return not any(d.iterdir()) or any((d / n).is_file() for n in (MANIFEST, "trainer.json", *names))


def _check_directory(directory: Any) -> None:
    """A checkpoint ``directory`` that is a str / ``os.PathLike`` (:class:`ArgumentError`, not pathlib's
    ``TypeError``): every save, resume and existence check of both trainers comes through here."""
    check_path(directory, "checkpoint", "a checkpoint directory")


def check_checkpointing(checkpoint_dir: Any, checkpoint_every: Any, where: str) -> None:
    """A trainer's ``train(checkpoint_dir=, checkpoint_every=)`` before its first step: ``checkpoint_every`` None or
    an int ≥ 0 (0 / None: at the end only), > 0 only with a ``checkpoint_dir``, which is None, a str or an
    ``os.PathLike`` — a wrong one was found at the first save, after the steps before it ran, and
    ``checkpoint_every`` without a directory saved nothing.

    Raises:
        ArgumentError: naming ``where`` and the argument.
    """
    if checkpoint_every is not None and (not is_int(checkpoint_every) or checkpoint_every < 0):
        raise ArgumentError(f"{where}: checkpoint_every must be a non-negative int, got {checkpoint_every!r}")
    if checkpoint_dir is None:
        if checkpoint_every:
            raise ArgumentError(f"{where}: checkpoint_every={checkpoint_every} without checkpoint_dir saves nothing: "
                                "pass checkpoint_dir= (where the checkpoints go)")
        return
    check_path(checkpoint_dir, where, "a checkpoint directory")


def write_checkpoint(directory: str | Path, files: Mapping[str, bytes | Mapping[str, torch.Tensor]]) -> None:
    """Write ``files`` (name -> content, in order) + the manifest as checkpoint ``directory``, atomically. A content
    that is a mapping of tensors is written as a safetensors file streamed from the tensors (``Staging.save_tensors``:
    no serialised copy of the file in memory; until 2026-11-28 each file was built as bytes first, the module and its
    optimizer state twice over at a save).

    Raises:
        CheckpointError: ``directory`` exists and holds something other than a checkpoint.
    """
    _check_directory(directory)
    for name in files:
        if Path(name).name != name:
            raise CheckpointError(f"{name!r}: a checkpoint file name must not hold a folder")
    with atomic_directory(directory, manifest=MANIFEST, carry=False, boundary=_forward,
                           replaceable=lambda d: _is_replaceable(d, tuple(files))) as stage:
        for name, data in files.items():
            if isinstance(data, bytes):
                stage.write_bytes(name, data)
            else:
                stage.save_tensors(name, dict(data))


def checkpoint_exists(directory: str | Path) -> bool:
    """Whether ``directory`` (or ``<directory>.old``, a save interrupted between its renames) holds
    something a resume must read: a non-empty directory (:func:`verified_checkpoint` then checks it)."""
    _check_directory(directory)
    d = Path(directory)
    return any(p.is_dir() and any(p.iterdir()) for p in (d, d.with_name(f"{d.name}.old")))


def verified_checkpoint(directory: str | Path, required: tuple[str, ...] = ()) -> tuple[Path, set[str]]:
    """``(directory, the file names its manifest lists)``: the complete checkpoint at ``directory``
    (or ``<directory>.old`` when a crash interrupted a save between its two renames), every file
    checked against the manifest, which must list each of ``required``.

    Raises:
        CheckpointError: no checkpoint there, the manifest is absent or corrupt (e.g. a checkpoint
            written before manifests existed), or a file is missing, truncated or altered (named).
    """
    _check_directory(directory)
    d = resolve(directory)
    if not d.is_dir():
        raise CheckpointError(f"{d}: no checkpoint directory")
    listed = verify(d, manifest=MANIFEST, required=required, optional=False)
    for name in listed:
        if Path(name).name != name:
            raise CheckpointError(f"{d / MANIFEST}: corrupt checkpoint manifest (bad file name {name!r})")
    return d, set(listed)
