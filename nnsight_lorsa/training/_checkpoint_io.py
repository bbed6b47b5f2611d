"""Atomic, verified checkpoint directories (used by :class:`~.trainer.Trainer` and the sparse-attention
trainer, :class:`~..sparse_attention.train.SparseAttentionTrainer`).

A save writes every file into a sibling ``<dir>.tmp-<pid>``, fsyncs each file, writes
``manifest.json`` (each file's size and sha256) last, fsyncs the directory, and only then swaps it
in: ``<dir>`` → ``<dir>.old``, ``<dir>.tmp-<pid>`` → ``<dir>``, remove ``<dir>.old``. A crash at any
point leaves either the previous complete checkpoint or the new one. A load resolves ``<dir>`` (or
``<dir>.old`` when ``<dir>`` is missing, i.e. a crash between the two renames) and verifies every
file against the manifest before anything is read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from ..errors import CheckpointError

MANIFEST = "manifest.json"


def _boundary(event: str) -> None:
    """Called after each step of a save (a file written, a rename); a no-op. Tests replace it to stop
    the process at every file boundary."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _is_replaceable(d: Path, names: tuple[str, ...]) -> bool:
    """An existing directory we may swap out: empty, or a checkpoint (with a manifest, or an older one
    holding ``trainer.json`` or one of the ``names`` this save writes)."""
    return not any(d.iterdir()) or any((d / n).is_file() for n in (MANIFEST, "trainer.json", *names))


def write_checkpoint(directory: str | Path, files: dict[str, bytes]) -> None:
    """Write ``files`` (name -> content, in order) + the manifest as checkpoint ``directory``, atomically.

    Raises:
        CheckpointError: ``directory`` exists and holds something other than a checkpoint.
    """
    d = Path(directory)
    if d.exists() and (not d.is_dir() or not _is_replaceable(d, tuple(files))):
        raise CheckpointError(f"{d}: exists and is not a checkpoint directory; refusing to replace it")
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = d.with_name(f"{d.name}.tmp-{os.getpid()}")
    old = d.with_name(f"{d.name}.old")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    manifest = {}
    for name, data in files.items():
        _write(tmp / name, data)
        manifest[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        _boundary(f"file:{name}")
    _write(tmp / MANIFEST, json.dumps({"format": 1, "files": manifest}, indent=1).encode())
    _boundary(f"file:{MANIFEST}")
    _fsync_dir(tmp)
    if d.exists():
        if old.exists():  # a leftover of an earlier interrupted swap; `d` is complete
            shutil.rmtree(old)
        d.rename(old)
        _boundary("rename:old")
    tmp.rename(d)
    _fsync_dir(d.parent)
    _boundary("rename:new")
    if old.exists():
        shutil.rmtree(old)
        _fsync_dir(d.parent)
    _boundary("removed:old")
    _remove_stale_temporaries(d)


def _remove_stale_temporaries(d: Path) -> None:
    """Remove ``<d>.tmp-<pid>`` left by saves whose process is gone (killed mid-save)."""
    for tmp in d.parent.glob(f"{d.name}.tmp-*"):
        pid = tmp.name.rpartition("-")[2]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:  # alive, someone else's
            pass


def checkpoint_exists(directory: str | Path) -> bool:
    """Whether ``directory`` (or ``<directory>.old``, a save interrupted between its renames) holds
    something a resume must read: a non-empty directory (:func:`verified_checkpoint` then checks it)."""
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
    d = Path(directory)
    old = d.with_name(f"{d.name}.old")
    if not d.is_dir() and old.is_dir():
        d = old
    if not d.is_dir():
        raise CheckpointError(f"{d}: no checkpoint directory")
    mpath = d / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{mpath}: missing checkpoint manifest (an incomplete checkpoint, or one written "
                              "before manifests existed; re-save it with this version)")
    try:
        files = json.loads(mpath.read_text())["files"]
        entries = [(str(name), int(e["size"]), str(e["sha256"])) for name, e in files.items()]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{mpath}: corrupt checkpoint manifest ({e!r})") from e
    listed = {name for name, _, _ in entries}
    for name in required:
        if name not in listed:
            raise CheckpointError(f"{d / name}: missing checkpoint file (not listed in {MANIFEST})")
    for name, size, sha in entries:
        path = d / name
        if Path(name).name != name:
            raise CheckpointError(f"{mpath}: corrupt checkpoint manifest (bad file name {name!r})")
        if not path.is_file():
            raise CheckpointError(f"{path}: missing checkpoint file (listed in {MANIFEST})")
        actual = path.stat().st_size
        if actual != size:
            raise CheckpointError(f"{path}: truncated or altered checkpoint file ({actual} bytes, "
                                  f"{MANIFEST} records {size})")
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != sha:
            raise CheckpointError(f"{path}: altered checkpoint file (sha256 differs from {MANIFEST})")
    return d, listed
