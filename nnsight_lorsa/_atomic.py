"""Atomic, verified directory writes: the one write path of every writer of the package (modules in
every format, attribution graphs, activation caches, sparse-attention gates, training checkpoints).

A save stages every file in a sibling ``<dir>.tmp-<pid>-<hex>``, fsyncs each file, writes a manifest
(each file's size and sha256; :data:`MANIFEST`, or ``manifest.json`` for training checkpoints) last,
fsyncs the directory, and only then swaps it in: ``<dir>`` → ``<dir>.old``, the staging directory →
``<dir>``, remove ``<dir>.old``. A crash (a kill, a power cut) at any point leaves either the previous
complete directory or the new complete one, never a mix: :func:`resolve` renames ``<dir>.old`` back
when ``<dir>`` is missing (a crash between the two renames), and a later save cleans up what a killed
one left. Entries of an existing ``<dir>`` that the new save does not write and that the old manifest
does not list (a README, a model saved beside the gates, the subfolders of a set) are carried over
into the new directory as hard links (copies where the filesystem has none).

A load calls :func:`verify` when the manifest is present: every listed file's size and sha256 must
match, else :class:`~nnsight_lorsa.errors.CheckpointError` names the file. A directory without a
manifest (written by an older version or by another library) is read as before, unchecked.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import CheckpointError, LorsaError, SaveError

#: the manifest beside the files of a module, graph, cache or gate directory
MANIFEST = "checksums.json"
#: what the manifest's ``format`` key holds
MANIFEST_FORMAT = 1

__all__ = ["MANIFEST", "Staging", "atomic_directory", "atomic_file", "check", "manifest_of", "resolve", "verify",
           "verify_file"]


def _boundary(event: str) -> None:
    """Called after each step of a save (half a file written, a file written, a rename); a no-op.
    Crash-injection tests replace it to stop the process at every file boundary."""


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file or a directory's entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_relative_name(name: object) -> bool:
    """Whether ``name`` is a non-empty relative POSIX name of a file or folder inside a directory: no absolute
    path, no ``..``, no backslash, no surrounding whitespace (what :class:`Staging` writes and the set index
    lists)."""
    if not isinstance(name, str) or not name or name != name.strip() or "\\" in name:
        return False
    p = PurePosixPath(name)
    return not p.is_absolute() and all(part not in ("", ".", "..") for part in p.parts)


def _check_name(name: str) -> str:
    if not is_relative_name(name):
        raise CheckpointError(f"{name!r}: not a relative file name inside the directory")
    return PurePosixPath(name).as_posix()


class Staging:
    """The staging directory of one :func:`atomic_directory` save: write files with :meth:`write_bytes`,
    :meth:`write_text`, :meth:`write_json`, :meth:`save_tensors`, or write them at :attr:`path` yourself
    and :meth:`record` them (:meth:`record_all` records everything not yet recorded)."""

    def __init__(self, path: Path, boundary: Callable[[str], Any]) -> None:
        self.path = path
        self.files: dict[str, dict[str, Any]] = {}
        self._boundary = boundary

    def _target(self, name: str) -> Path:
        name = _check_name(name)
        if name in self.files:
            raise CheckpointError(f"{name}: written twice in one save")
        target = self.path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write ``data`` as ``name`` (fsynced), and record it."""
        target = self._target(name)
        half = len(data) // 2
        view = memoryview(data)  # slices of a view copy nothing (bytes slices copy)
        with open(target, "wb") as f:
            f.write(view[:half])
            f.flush()
            self._boundary(f"partial:{name}")
            f.write(view[half:])
            f.flush()
            os.fsync(f.fileno())
        self.files[_check_name(name)] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        self._boundary(f"file:{name}")

    def write_text(self, name: str, text: str) -> None:
        """:meth:`write_bytes` of ``text`` in UTF-8."""
        self.write_bytes(name, text.encode("utf-8"))

    def write_json(self, name: str, obj: Any, **dumps: Any) -> None:
        """:meth:`write_text` of ``json.dumps(obj, **dumps)``."""
        self.write_text(name, json.dumps(obj, **dumps))

    def save_tensors(self, name: str, tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> None:
        """Write ``tensors`` (CPU, contiguous) as the safetensors file ``name``, streamed from the tensors'
        memory (``safetensors.torch.save_file``: no serialised copy of the file in memory — issue 21: the
        in-memory ``save`` held the whole file, and its two halves again, 2x a module at the paper's scale);
        then fsynced and hashed from the file (:meth:`record`). The ``partial:{name}`` boundary falls after
        the data is written and before it is flushed and recorded."""
        from safetensors.torch import save_file

        target = self._target(name)
        save_file(tensors, str(target), metadata=metadata)
        self._boundary(f"partial:{name}")
        self.record(name)

    def record(self, name: str) -> None:
        """Record ``name``, a file written at ``path / name`` by other code (fsynced and hashed here)."""
        name = _check_name(name)
        p = self.path / name
        if not p.is_file():
            raise CheckpointError(f"{p}: not written")
        _fsync(p)
        self.files[name] = {"size": p.stat().st_size, "sha256": _sha256_file(p)}
        self._boundary(f"file:{name}")

    def record_all(self) -> None:
        """:meth:`record` every file under :attr:`path` not recorded yet (in sorted order)."""
        for p in sorted(self.path.rglob("*")):
            name = p.relative_to(self.path).as_posix()
            if p.is_file() and name not in self.files:
                self.record(name)


def _old_manifest_names(d: Path, manifest: str | None) -> set[str]:
    if manifest is None:
        return set()
    try:
        files = json.loads((d / manifest).read_text(encoding="utf-8"))["files"]
        return {str(n) for n in files}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def _link_tree(src: Path, dst: Path) -> None:
    """``dst`` as a copy of ``src`` whose files are hard links (copies where links fail)."""

    def link(s: str, t: str) -> None:
        try:
            os.link(s, t)
        except OSError:
            shutil.copy2(s, t)

    if src.is_dir() and not src.is_symlink():
        shutil.copytree(src, dst, symlinks=True, copy_function=link)
    elif src.is_symlink():
        os.symlink(os.readlink(src), dst)
    else:
        link(str(src), str(dst))


def _carry_over(old: Path, staging: Staging, manifest: str | None, replace: bool) -> None:
    """Link into the staging directory the entries of ``old`` the new save neither writes nor replaces:
    not the old manifest, nor a name the new save wrote, nor (``replace``) a file the old manifest
    lists. Without ``replace`` the old manifest's entries of the files carried over are kept."""
    if not replace:
        try:
            previous = (manifest_of(old, manifest=manifest) if manifest is not None else None) or {}
        except CheckpointError:
            previous = {}
        for entry in sorted(old.rglob("*")):
            rel = entry.relative_to(old).as_posix()
            if rel == manifest or (staging.path / rel).exists() or not (entry.is_file() or entry.is_symlink()):
                continue
            (staging.path / rel).parent.mkdir(parents=True, exist_ok=True)
            _link_tree(entry, staging.path / rel)
            if rel in previous:
                size, sha = previous[rel]
                staging.files[rel] = {"size": size, "sha256": sha}
        return
    own = {manifest} if manifest is not None else set()
    listed = _old_manifest_names(old, manifest) | own
    written_tops = {n.split("/", 1)[0] for n in staging.files} | {p.name for p in staging.path.iterdir()} | own
    for entry in sorted(old.iterdir()):
        if entry.name in written_tops:
            continue
        if entry.is_file() and entry.name in listed:
            continue
        if entry.is_dir() and any(n.startswith(entry.name + "/") for n in listed):
            # a folder the old save wrote: carry only what it did not write
            for p in sorted(entry.rglob("*")):
                rel = p.relative_to(old).as_posix()
                if (p.is_file() or p.is_symlink()) and rel not in listed and not (staging.path / rel).exists():
                    (staging.path / rel).parent.mkdir(parents=True, exist_ok=True)
                    _link_tree(p, staging.path / rel)
            continue
        _link_tree(entry, staging.path / entry.name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # alive, someone else's; or not a pid
        return True
    return True


def _remove_stale_temporaries(d: Path) -> None:
    """Remove ``<d>.tmp-<pid>[-<hex>]`` left by saves whose process is gone (killed mid-save)."""
    for tmp in d.parent.glob(f"{d.name}.tmp-*"):
        pid = tmp.name[len(d.name) + len(".tmp-"):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _target_dir(directory: str | os.PathLike[str]) -> Path:
    """The real path of ``directory`` (a symlink to a directory keeps pointing at the new content)."""
    d = Path(directory)
    if d.is_symlink():
        d = Path(os.path.realpath(d))
    d = d.absolute()
    cwd = Path.cwd()
    if d.exists() and (d.resolve() == cwd.resolve() or d.resolve() in cwd.resolve().parents):
        raise CheckpointError(f"{directory}: is the working directory (or holds it); save into a subfolder "
                              "(a save replaces the whole directory)")
    return d


@contextmanager
def atomic_directory(directory: str | os.PathLike[str], *, manifest: str | None = MANIFEST, carry: bool = True,
                     replace: bool = True, replaceable: Callable[[Path], bool] | None = None,
                     boundary: Callable[[str], Any] | None = None) -> Iterator[Staging]:
    """Stage a directory's files and swap it in as ``directory`` when the ``with`` block ends (module
    docstring); an exception in the block leaves ``directory`` untouched and removes the staging.

    Args:
        manifest: the manifest's file name (None: none written; a set's folders, each with its own). carry: link
            unrelated entries of the old directory into the new one (training checkpoints: no). replace: the new
            save replaces every file the old manifest lists (a module, a graph); False: only the files it writes
            (gates saved beside a model), the others keep their manifest entries. replaceable:
            ``(old directory) -> bool``; False refuses.
        boundary: called after each step (default: this module's ``_boundary``, looked up at each call).

    Raises:
        CheckpointError: ``directory`` is a file, the working directory, or not ``replaceable``.
        SaveError: an ``OSError`` inside the block (disk full, permission, I/O; its ``__cause__``): the staging
            is removed and ``directory`` is untouched; or one while swapping the directories in (the message says
            which is in place). Other exceptions propagate as they are: in the block or before the new directory is
            renamed in, ``directory`` is left as it was; after, it is the new one (no ``.old``, no staging left).
    """
    d = _target_dir(directory)
    if d.exists() and not d.is_dir():
        raise CheckpointError(f"{d}: exists and is not a directory; refusing to replace it")
    if d.exists() and replaceable is not None and not replaceable(d):
        raise CheckpointError(f"{d}: exists and is not a checkpoint directory; refusing to replace it")
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = d.with_name(f"{d.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    old = d.with_name(f"{d.name}.old")
    tmp.mkdir()
    stage = Staging(tmp, boundary if boundary is not None else (lambda e: _boundary(e)))
    try:
        yield stage
        previous = d if d.is_dir() else old if old.is_dir() else None
        if carry and previous is not None:
            _carry_over(previous, stage, manifest, replace)
        if manifest is not None:
            text = json.dumps({"format": MANIFEST_FORMAT, "files": stage.files}, indent=1)
            with open(tmp / manifest, "wb") as f:
                f.write(text.encode())
                f.flush()
                os.fsync(f.fileno())
            stage._boundary(f"file:{manifest}")
        for sub in sorted({p.parent for p in tmp.rglob("*")}, key=lambda p: -len(p.parts)):
            _fsync(sub)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, LorsaError):  # disk full, permission, I/O: named
            raise SaveError(f"{d}: the save failed while writing its files ({type(e).__name__}: {e}); the "
                            "previous files there are intact (nothing was replaced)") from e
        raise
    try:
        if d.exists():
            if old.exists():  # a leftover of an earlier interrupted swap; `d` is complete
                shutil.rmtree(old)
            d.rename(old)
            stage._boundary("rename:old")
        tmp.rename(d)
        _fsync(d.parent)
        stage._boundary("rename:new")
        if old.exists():
            shutil.rmtree(old)
            _fsync(d.parent)
        stage._boundary("removed:old")
    except BaseException as e:  # in this process (Ctrl-C, a rename's OSError): the old directory back, or the new
        swapped = not tmp.exists()  # one whole; until 2026-11-28 `d` stayed missing beside `.old` and the staging
        if swapped:
            shutil.rmtree(old, ignore_errors=True)
        else:
            if not d.exists() and old.is_dir():
                old.rename(d)
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, LorsaError):
            raise SaveError(f"{d}: the save failed while swapping the directories in ({type(e).__name__}: {e}); "
                            + ("the new files are in place" if swapped else "the previous files there are intact "
                               "(nothing was replaced)")) from e
        raise
    _remove_stale_temporaries(d)


def atomic_file(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write the single file ``path`` atomically: a sibling temporary, fsynced, renamed over ``path``
    (a crash leaves the old file or the new one). Returns ``path``.

    Raises:
        SaveError: an ``OSError`` (disk full, permission, I/O; its ``__cause__``) while writing: the temporary is
            removed and ``path`` is as before (the old file, or none); or one while syncing the folder after the
            rename (the new file is in place). Until 2026-11-28 the bare ``OSError``, naming no file of ours.
    """
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _boundary(f"file:{p.name}")
        os.replace(tmp, p)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and not isinstance(e, LorsaError):
            raise SaveError(f"{p}: the write failed ({type(e).__name__}: {e}); the file there before, if any, is "
                            "intact (nothing was replaced)") from e
        raise
    try:
        _fsync(p.parent)
    except OSError as e:
        raise SaveError(f"{p}: written and renamed into place, but syncing its folder failed ({type(e).__name__}: "
                        f"{e}); the new file is in place") from e
    _boundary("rename:new")
    for stale in p.parent.glob(f".{p.name}.tmp-*"):  # left by writes whose process is gone
        pid = stale.name[len(p.name) + len("..tmp-"):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            stale.unlink(missing_ok=True)
    return p


def resolve(directory: str | os.PathLike[str]) -> Path:
    """``directory``; when only ``<directory>.old`` exists (a save killed between its two renames), the
    old directory is renamed back first (the interrupted save rolled back), or, while a live process's
    save is between those renames, or where the rename fails (read-only), ``<directory>.old`` itself."""
    d = Path(directory)
    if not d.name:  # "." (also ""), "/": no sibling ``.old`` to name
        return d
    old = d.with_name(f"{d.name}.old")
    if d.exists() or not old.is_dir():
        return d
    for tmp in d.parent.glob(f"{d.name}.tmp-*"):
        pid = tmp.name[len(d.name) + len(".tmp-"):].split("-", 1)[0]
        if pid.isdigit() and (int(pid) == os.getpid() or _alive(int(pid))):
            return old
    try:
        old.rename(d)
    except OSError:
        return d if d.is_dir() else old
    return d


def _manifest_entries(mpath: Path) -> list[tuple[str, int, str]]:
    try:
        files = json.loads(mpath.read_text(encoding="utf-8"))["files"]
        entries = [(str(name), int(e["size"]), str(e["sha256"])) for name, e in files.items()]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError,
            RecursionError) as e:
        raise CheckpointError(f"{mpath}: corrupt checkpoint manifest ({e!r})") from e
    for name, _, _ in entries:
        try:
            _check_name(name)
        except CheckpointError as e:
            raise CheckpointError(f"{mpath}: corrupt checkpoint manifest (bad file name {name!r})") from e
    return entries


def verify_file(directory: Path, name: str, size: int, sha256: str | None, manifest: str = MANIFEST,
                optional: bool = True) -> None:
    """Check ``directory / name`` against its manifest entry (``sha256`` None: the size only). ``optional``: the
    directory loads without its manifest (then the message on an altered file says to delete it; a training
    checkpoint's is required, and deleting it would leave the checkpoint unloadable).

    Raises:
        CheckpointError: the file is missing, truncated or altered (naming it).
    """
    path = directory / name
    if not path.is_file():
        raise CheckpointError(f"{path}: missing checkpoint file (listed in {manifest})")
    actual = path.stat().st_size
    if actual != size:
        raise CheckpointError(f"{path}: truncated or altered checkpoint file ({actual} bytes, "
                              f"{manifest} records {size})")
    if sha256 is not None and _sha256_file(path) != sha256:
        fix = (f"if you edited it on purpose, delete {manifest}" if optional else
               f"a checkpoint of this kind needs its {manifest}: restore the file, or save the checkpoint again")
        raise CheckpointError(f"{path}: altered checkpoint file (sha256 differs from {manifest}; {fix})")


def manifest_of(directory: str | os.PathLike[str], *, manifest: str = MANIFEST) -> dict[str, tuple[int, str]] | None:
    """``{name: (size, sha256)}`` from ``directory``'s manifest, or None when it has none.

    Raises:
        CheckpointError: the manifest is corrupt.
    """
    mpath = Path(directory) / manifest
    if not mpath.is_file():
        return None
    return {name: (size, sha) for name, size, sha in _manifest_entries(mpath)}


def check(directory: str | os.PathLike[str], entries: dict[str, tuple[int, str]], *, manifest: str = MANIFEST,
          hashes: bool = True, optional: bool = True) -> None:
    """Check the files of ``directory`` against ``entries`` (:func:`manifest_of`; ``optional``: as
    :func:`verify_file`'s).

    Raises:
        CheckpointError: a file is missing, truncated or altered (naming it).
    """
    for name, (size, sha) in entries.items():
        verify_file(Path(directory), name, size, sha if hashes else None, manifest, optional)


def verify(directory: str | os.PathLike[str], *, manifest: str = MANIFEST, required: tuple[str, ...] = (),
           optional: bool = True, hashes: bool = True) -> dict[str, tuple[int, str]]:
    """Check every file listed in ``directory``'s manifest; return ``{name: (size, sha256)}``
    (``{}`` when there is no manifest and ``optional``). ``hashes=False`` checks sizes only.

    Raises:
        CheckpointError: the manifest is missing (unless ``optional``) or corrupt, misses one of
            ``required``, or a file is missing, truncated or altered (naming it).
    """
    d = Path(directory)
    entries = manifest_of(d, manifest=manifest)
    if entries is None:
        if optional:
            return {}
        raise CheckpointError(f"{d / manifest}: missing checkpoint manifest (an incomplete checkpoint, or one "
                              "written before manifests existed; re-save it with this version)")
    for name in required:
        if name not in entries:
            raise CheckpointError(f"{d / name}: missing checkpoint file (not listed in {manifest})")
    check(d, entries, manifest=manifest, hashes=hashes, optional=optional)
    return entries
