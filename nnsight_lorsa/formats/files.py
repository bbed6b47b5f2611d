"""Reading checkpoint files: local directories or Hugging Face hub snapshots, JSON / YAML configs,
safetensors headers and tensors.

Nothing here unpickles: only JSON, YAML (``yaml.safe_load``) and safetensors are read. Every problem
raises :class:`~nnsight_lorsa.errors.CheckpointError` naming the file. ``huggingface_hub`` is
imported only when a source is not a local path.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch

from .._atomic import MANIFEST, resolve
from .._checks import check_flag
from ..errors import ArgumentError
from .validate import file_errors, require, require_file

__all__ = ["checkpoint_name", "headers_only", "load_safetensors", "read_json_object", "read_safetensors_header",
           "read_yaml_object", "refuse_local_revision", "resolve_checkpoint_dir"]


def check_path(path: Any, where: str, what: str = "a directory or a Hugging Face repo id") -> None:
    """Refuse a path that is neither a ``str`` nor an ``os.PathLike`` (e.g. ``None``) with our error, before
    any use of it (Python's own is a bare ``TypeError`` from deep inside ``pathlib`` / ``os``).

    Raises:
        ArgumentError: ``path`` is not a ``str`` / ``os.PathLike``; the message names ``where``.

    Source: ours (every reader's and writer's first check).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentError(f"{where}: the path must be a str or os.PathLike ({what}), got a {type(path).__name__}")


def check_hub_args(where: str, subfolder: Any, revision: Any, local_files_only: Any) -> None:
    """The hub arguments of a load (:func:`resolve_checkpoint_dir`, ``Graph.load``): ``subfolder`` and ``revision``
    None or a str, ``local_files_only`` a bool — checked for a local path too, where the last two are not read.

    Raises:
        ArgumentError: naming ``where`` and the argument.

    Source: ours (``huggingface_hub.snapshot_download``'s arguments).
    """
    check_flag(local_files_only, "local_files_only", where)
    if revision is not None and not isinstance(revision, str):
        raise ArgumentError(f"{where}: revision must be None or a str (a branch, tag or commit), got {revision!r}")
    if subfolder is not None and not isinstance(subfolder, str):
        raise ArgumentError(f"{where}: subfolder must be None or a str (a folder inside the source), got a "
                            f"{type(subfolder).__name__}")


def resolve_checkpoint_dir(
    source: str | os.PathLike[str],
    *,
    allow_patterns: list[str],
    subfolder: str | None = None,
    local_files_only: bool = False,
    revision: str | None = None,
    then: Callable[[Path], list[str]] | None = None,
) -> Path:
    """A local checkpoint directory for ``source``: a local directory, or a downloaded hub snapshot.

    ``source`` is used as a local directory when it exists (or is a :class:`~pathlib.Path`; or
    ``<source>.old`` when only that exists: a save killed between its two renames, :mod:`.._atomic`);
    ``subfolder`` is then a folder inside it. Otherwise ``source`` must be a valid Hugging Face
    repo id, or ``"repo_id:subfolder"`` (the Llamascopium hub layout); the files matching
    ``allow_patterns`` (relative to ``subfolder``) and the manifest ``checksums.json`` are fetched with
    ``huggingface_hub.snapshot_download`` (``local_files_only`` and ``revision`` passed through)
    and ``snapshot/subfolder`` is returned. With ``then``, ``then(snapshot/subfolder)`` — given what that first
    download fetched (the configs) — names further patterns (relative to ``subfolder``: the files the configs call
    for), fetched by a second download of the same commit. A local directory is returned as it is (``then`` unused).

    Raises:
        CheckpointError: the path is a file, a :class:`Path` that does not exist, a string that
            is neither a directory nor a valid repo id, the download failed (the message names the
            repo, the revision and the subfolder), or ``subfolder`` is not a folder there.
        ArgumentError: a hub ``subfolder`` that is absolute or has a ``..`` part (it would leave the repo); a
            ``revision`` with a local path (it has none: the revision asked for would not be the one read); a
            ``subfolder`` or ``revision`` that is not a str; ``local_files_only`` not a bool.
    """
    check_path(source, "load")
    check_hub_args("load", subfolder, revision, local_files_only)
    local = resolve(Path(source))
    if isinstance(source, Path) or local.exists():
        refuse_local_revision(source, revision)
        require(local.exists(), None, f"checkpoint directory {str(local)!r} does not exist")
        require(local.is_dir(), None, f"{str(local)!r} is a file; expected a checkpoint directory")
        if subfolder:
            local = local / subfolder
            require(local.is_dir(), None, f"checkpoint directory {str(local)!r} does not exist")
        return local
    repo_id = os.fspath(source)
    if subfolder is None and ":" in repo_id:
        repo_id, subfolder = repo_id.split(":", 1)
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    with file_errors(repr(repo_id), {HFValidationError: "neither an existing local directory nor a valid Hugging "
                                                         "Face repo id ({e})"}):
        validate_repo_id(repo_id)
    subfolder = _repo_folder(repo_id, subfolder)
    prefix = f"{subfolder}/" if subfolder else ""
    where = f"{repo_id!r} (revision {revision or 'main'!r}" + (f", subfolder {subfolder!r})" if subfolder else ")")
    # network, auth, missing repo, unknown revision, offline cache miss, an incomplete cached snapshot: all end the load
    with file_errors(where, {Exception: "not a local directory and could not be fetched from the Hugging "
                                        f"Face hub (local_files_only={local_files_only}): {{type}}: {{e}}"}):
        snapshot = snapshot_download(
            repo_id=repo_id,
            # the manifest too, whatever the reader's files: read_dir checks the files against it
            allow_patterns=[prefix + p for p in sorted({*allow_patterns, MANIFEST})],
            local_files_only=local_files_only,
            revision=revision,
        )
    path = Path(snapshot) / subfolder if subfolder else Path(snapshot)
    # the folder may hold no config (circuit-tracer's numbered weights alone): its weights make it, if any
    more = then(path) if then is not None else []
    if more:
        with file_errors(where, {Exception: "not a local directory and could not be fetched from the Hugging "
                                            f"Face hub (local_files_only={local_files_only}): {{type}}: {{e}}"}):
            snapshot = snapshot_download(
                repo_id=repo_id, allow_patterns=[prefix + p for p in more], local_files_only=local_files_only,
                revision=Path(snapshot).name,  # the commit of the configs just read, whatever a branch says now
            )
        path = Path(snapshot) / subfolder if subfolder else Path(snapshot)
    require(path.is_dir(), None, f"hub repo {where} has no folder {subfolder!r}")
    return path


def refuse_local_revision(source: str | os.PathLike[str], revision: str | None, caller: str = "") -> None:
    """Refuse ``revision`` with a local ``source``: a local directory has no revisions, so the one asked for would
    not be the one read (a local directory wins over a repo id of the same spelling).

    Raises:
        ArgumentError: ``revision`` is not None; ``caller`` (e.g. ``"Graph.load: "``) prefixes the message.
    """
    if revision is not None:
        raise ArgumentError(f"{caller}{os.fspath(source)!r} is a local path, which has no revisions; "
                            f"revision={revision!r} applies to a Hugging Face repo id (a local directory wins over a "
                            "repo id of the same spelling: run elsewhere, or pass revision=None)")


def _repo_folder(repo_id: str, subfolder: Any) -> str | None:
    """``subfolder`` as a folder inside the repo, as its paths are spelled (``a/./b/`` is ``a/b``; ``None``, ``""``
    or ``"."``: its top).

    Raises:
        ArgumentError: not a str, an absolute path or one with a ``..`` part (``snapshot / "/x"`` is ``/x``,
            and ``..`` climbs out of the snapshot: files that are not the repo's would load as its own).
    """
    if subfolder is None or subfolder == "":
        return None
    if not isinstance(subfolder, str) or subfolder.startswith("/") or ".." in subfolder.split("/"):
        raise ArgumentError(f"{repo_id!r}: subfolder must be a relative folder path inside the repo (no '..', not "
                            f"absolute), got {subfolder!r}")
    # as the repo's paths are spelled (the download patterns match them as strings): no "", "." parts
    return "/".join(part for part in subfolder.split("/") if part not in ("", ".")) or None


def checkpoint_name(directory: Path) -> str | None:
    """The name a checkpoint folder gives its module (a sparsify hookpoint is its folder's name): the folder's
    name, or None for the top of a ``huggingface_hub`` cache snapshot (``models--owner--name/snapshots/<commit>``,
    what :func:`resolve_checkpoint_dir` returns for a repo's top), whose name is a commit hash, not the repo's."""
    parent = directory.parent
    if parent.name == "snapshots" and parent.parent.name.startswith(("models--", "datasets--", "spaces--")):
        return None
    return directory.name


def read_json_object(path: Path) -> dict[str, Any]:
    """Parse ``path`` as a JSON object.

    Raises:
        CheckpointError: the file is missing, unreadable, not JSON, or not an object (naming the file).
    """
    require_file(path)
    # RecursionError: e.g. "[[[[…]]]]" nested deeper than the interpreter's stack
    with file_errors(path, {json.JSONDecodeError: "invalid JSON ({e})",
                            (OSError, UnicodeDecodeError): "cannot read ({e})",
                            RecursionError: "JSON nested too deeply to parse"}):
        data = json.loads(path.read_text(encoding="utf-8"))
    require(isinstance(data, dict), path, f"expected a JSON object, got {type(data).__name__}")
    return data  # type: ignore[no-any-return]


def read_yaml_object(path: Path) -> dict[str, Any]:
    """``path`` as a YAML mapping (``{}`` when the file is absent or empty).

    Raises:
        CheckpointError: unreadable YAML, or not a mapping (naming the file).
    """
    if not path.is_file():
        return {}
    import yaml

    with file_errors(path, {(yaml.YAMLError, OSError, UnicodeDecodeError, RecursionError): "not readable YAML ({e})"}):
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if data is None:
        return {}
    require(isinstance(data, dict), path, f"expected a mapping, got {type(data).__name__}")
    return data  # type: ignore[no-any-return]


def read_safetensors_header(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """``(shapes, metadata)`` from a safetensors file's header, without reading the tensors.

    Raises:
        CheckpointError: the file is missing or not a readable safetensors file.
    """
    from safetensors import safe_open

    require_file(path)
    # safetensors raises its own error types for corrupt headers
    with file_errors(path, {Exception: "not a readable safetensors file ({type}: {e})"}), \
            safe_open(str(path), framework="pt") as f:
        names = list(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in names}
        metadata = dict(f.metadata() or {})
    return shapes, metadata


#: set while a ``device="meta"`` load reads its files (:func:`headers_only`)
_HEADERS_ONLY: ContextVar[bool] = ContextVar("nnsight_lorsa_headers_only", default=False)

#: safetensors' dtype names (the header's ``dtype`` field) -> torch dtypes
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


@contextmanager
def headers_only() -> Iterator[None]:
    """Within it, :func:`load_safetensors` reads each file's header only: every tensor of more than one element
    comes back as an empty ``meta`` tensor of its stored shape and dtype (no tensor bytes read); scalars (a
    Llamascopium file's dataset-norm factors, which a reader checks and folds) are read. What a ``device="meta"``
    load reads its files under (:func:`.reader.read_dir`)."""
    token = _HEADERS_ONLY.set(True)
    try:
        yield
    finally:
        _HEADERS_ONLY.reset(token)


def _header_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as :func:`headers_only` gives them (meta, scalars read; a dtype not
    in ``_SAFETENSORS_DTYPES`` read, so that the reader refuses it as a full load would)."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        for key in list(f.keys()):
            piece = f.get_slice(key)
            shape, dtype = tuple(piece.get_shape()), _SAFETENSORS_DTYPES.get(piece.get_dtype())
            numel = 1
            for s in shape:
                numel *= s
            out[key] = f.get_tensor(key) if dtype is None or numel <= 1 else \
                torch.empty(shape, dtype=dtype, device="meta")
    return out


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file, on CPU; under :func:`headers_only`, those of more than one element as
    empty ``meta`` tensors of their stored shape and dtype, from the header (no tensor bytes read).

    Raises:
        CheckpointError: the file is missing or its tensors cannot be read (or, under :func:`headers_only`, its
            header).
    """
    from safetensors.torch import load_file

    require_file(path)
    if _HEADERS_ONLY.get():
        with file_errors(path, {Exception: "cannot load tensors ({type}: {e})"}):
            return _header_tensors(path)
    with file_errors(path, {Exception: "cannot load tensors ({type}: {e})"}):
        tensors = load_file(str(path), device="cpu")
    return tensors
