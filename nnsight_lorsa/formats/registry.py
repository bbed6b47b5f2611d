"""The format registry: one :func:`load` that detects the format, one :func:`save` that writes one.

Each :class:`Format` names the files that identify it (``detect``), the readers it holds
(:class:`~.reader.Reader`: ``parse_config`` -> ``load_weights`` -> ``build``) and how it picks one
(``choose``), and its writers by object type. Detection rules (a local directory):

======================  ==========================================================  =============================
format                  files that identify it                                      reader chosen by
======================  ==========================================================  =============================
``nnsight_lorsa``       ``config.json`` + ``model.safetensors``                     ``config.json`` ``format`` tag
``llamascopium``        ``config.json`` + ``sae_weights.safetensors``               ``config.json`` ``sae_type``
``saelens``             ``cfg.json`` + ``sae_weights.safetensors``; or              ``cfg.json`` present: SAELens's
                        ``params.safetensors`` + ``config.json`` with               layout; else SAELens's
                        ``"architecture": "jump_relu"``, or no ``config.json`` and  ``gemma_3`` converter
                        a folder name with ``layer_<L>`` and a hook word            (GemmaScope-2)
``sparsify``            ``cfg.json`` + ``sae.safetensors``                          (one reader)
``circuit_tracer``      ``config.yaml``, or ``layer_0.safetensors`` / ``W_enc_0…``  ``config.yaml`` ``model_kind``
``sparse_attention``    ``sparse_attention.json`` + ``…_attention.safetensors``    (one reader: the gates)
======================  ==========================================================  =============================

No match, or more than one, raises :class:`~nnsight_lorsa.errors.FormatDetectionError` listing
what was looked for; ``format=`` skips detection. A hub repo id is fetched first, in two downloads of one
commit (under ``subfolder`` or ``"repo_id:subfolder"``): the candidate formats' configs and the manifest, then the
weights those call for (the files the manifest lists, each format's weights where its config came; circuit-tracer's
numbered files digit by digit), never every ``*.safetensors`` of the repo; it is then detected in the snapshot.
:func:`load_all` loads every checkpoint of a folder (a sparsify run, a ``LorsaSet.save`` directory,
a circuit-tracer transcoder set) by name.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._atomic import resolve
from .._checks import refuse_training_space
from .._placement import check_placement_args
from ..errors import (
    ArgumentError,
    FormatDetectionError,
    LorsaError,
    PlacementError,
    UnsupportedArchitectureError,
)
from ..modules.clt import CrossLayerTranscoder
from ..modules.lorsa import Lorsa
from ..modules.sae import SparseAutoencoder
from ..modules.transcoder import Transcoder
from . import (
    circuit_tracer,
    gate_format,
    llamascopium,
    llamascopium_sae,
    lorsa_format,
    saelens,
    saelens_releases,
    sparse_coder_format,
    sparsify,
)
from .files import check_path, read_json_object, resolve_checkpoint_dir
from .reader import Reader, hub_configs, hub_weights, read_dir

__all__ = ["DEFAULT_FORMAT", "FORMATS", "Format", "LoadedModules", "PartialLoadWarning", "checkpoint_folders",
           "detect_format", "load", "load_all", "readers_of", "register_format", "save"]

#: what :func:`save` writes unless told otherwise
DEFAULT_FORMAT = "nnsight_lorsa"
#: options every sparse-coder reader may take; dropped where the chosen reader does not
_SHARED_OPTIONS = frozenset({"adapter", "d_model"})


@dataclass(frozen=True)
class Format:
    """A checkpoint format: how to recognise it, its readers and its writers.

    Attributes:
        name: the ``format=`` name.
        looks_for: the files that identify it (for messages and docs).
        detect: ``(directory) -> bool`` from the files present.
        readers: the :class:`Reader` s it holds.
        choose: ``(directory) -> Reader`` among ``readers`` (may raise a named error).
        writers: ``(types, write)`` pairs; ``write(obj, directory, **options) -> Path``.

    Source: ours (the format registry; the small per-architecture registry of SAELens).
    """

    name: str
    looks_for: str
    detect: Callable[[Path], bool]
    readers: tuple[Reader, ...]
    choose: Callable[[Path], Reader]
    writers: tuple[tuple[type | tuple[type, ...], Callable[..., Path]], ...] = ()

    @property
    def hub_files(self) -> list[str]:
        """The files its readers read (configs and named weights; :attr:`Reader.hub_files`).

        Source: ours (the format registry; the small per-architecture registry of SAELens).
        """
        return sorted({f for r in self.readers for f in r.hub_files})


FORMATS: dict[str, Format] = {}


def register_format(fmt: Format) -> Format:
    """Add (or replace) ``fmt`` in :data:`FORMATS`; returns it.

    Raises:
        ArgumentError: ``fmt`` not a :class:`Format` (the registry is left as it was).

    Source: ours (the format registry; the small per-architecture registry of SAELens).
    """
    if not isinstance(fmt, Format):
        raise ArgumentError(f"register_format: fmt must be a Format(name, looks_for, detect, readers), got a "
                            f"{type(fmt).__name__}")
    FORMATS[fmt.name] = fmt
    return fmt


def _files(*names: str) -> Callable[[Path], bool]:
    return lambda d: all((d / n).is_file() for n in names)


def _by_config_key(config: str, key: str, readers: dict[Any, Reader], default: Reader) -> Callable[[Path], Reader]:
    def choose(directory: Path) -> Reader:
        value = read_json_object(directory / config).get(key)
        return readers.get(value, default) if isinstance(value, str) else default
    return choose


def _one(reader: Reader) -> Callable[[Path], Reader]:
    return lambda _: reader


def _save_transcoder_set(obj: Any, directory: str | os.PathLike[str], **options: Any) -> Path:
    transcoders = obj.transcoders if isinstance(obj, circuit_tracer.CircuitTracerTranscoders) else obj
    return circuit_tracer.save_circuit_tracer_transcoders(transcoders, directory, **options)


_SPARSE = (SparseAutoencoder, Transcoder)
register_format(Format(
    "nnsight_lorsa", "config.json + model.safetensors",
    _files(lorsa_format.CONFIG_FILE, lorsa_format.WEIGHTS_FILE),
    (lorsa_format.READER, sparse_coder_format.READER),
    _by_config_key("config.json", "format", {lorsa_format.FORMAT_TAG: lorsa_format.READER},
                   sparse_coder_format.READER),
    ((Lorsa, lorsa_format.save_lorsa), ((*_SPARSE, CrossLayerTranscoder), sparse_coder_format.save_sparse_coder))))
register_format(Format(
    "llamascopium", "config.json + sae_weights.safetensors",
    llamascopium.has_files,  # or config.json + checkpoints/step_<N>/ only: the reader names the step folder
    (llamascopium.READER, llamascopium_sae.READER),
    _by_config_key("config.json", "sae_type", {"lorsa": llamascopium.READER}, llamascopium_sae.READER),
    ((Lorsa, llamascopium.save_llamascopium_lorsa),)))
def _saelens_reader(directory: Path) -> Reader:
    """SAELens's own layout where ``cfg.json`` is there, else its ``gemma_3`` converter's where
    ``params.safetensors`` is (:mod:`.saelens_releases`)."""
    gemma_3 = (directory / saelens_releases.GEMMA_3_WEIGHTS).is_file() and not (directory / saelens.CFG_FILE).is_file()
    return saelens_releases.GEMMA_3_READER if gemma_3 else saelens.READER


register_format(Format(
    "saelens", "cfg.json + sae_weights.safetensors, or params.safetensors + config.json (architecture jump_relu) "
    "or a GemmaScope-2 folder name (layer_<L>, resid_post / attn_out / mlp_out / transcoder)",
    lambda d: _files(saelens.CFG_FILE, saelens.WEIGHTS_FILE)(d) or saelens_releases.has_gemma_3_files(d),
    (saelens.READER, saelens_releases.GEMMA_3_READER), _saelens_reader, ((_SPARSE, saelens.save_saelens),)))
register_format(Format(
    "sparsify", "cfg.json + sae.safetensors", _files(sparsify.CFG_FILE, sparsify.WEIGHTS_FILE),
    (sparsify.READER,), _one(sparsify.READER), ((_SPARSE, sparsify.save_sparsify),)))
register_format(Format(
    "circuit_tracer", "config.yaml, or layer_0.safetensors / W_enc_0.safetensors",
    lambda d: any((d / n).is_file() for n in ("config.yaml", "layer_0.safetensors", "W_enc_0.safetensors")),
    (circuit_tracer.TRANSCODERS_READER, circuit_tracer.CLT_READER), circuit_tracer.choose_reader,
    ((CrossLayerTranscoder, circuit_tracer.save_circuit_tracer_clt),
     ((dict, circuit_tracer.CircuitTracerTranscoders), _save_transcoder_set))))
register_format(Format(
    "sparse_attention", "sparse_attention.json + sparse_attention.safetensors",
    _files(gate_format.CONFIG_FILE, gate_format.WEIGHTS_FILE), (gate_format.READER,), _one(gate_format.READER),
    ((gate_format.GateSet, gate_format.save_gate_set),)))


def _format(name: str) -> Format:
    if not isinstance(name, str) or name not in FORMATS:
        raise UnsupportedArchitectureError(f"unknown checkpoint format {name!r}; known: {['auto', *FORMATS]}")
    return FORMATS[name]


def readers_of(format: str) -> list[Reader]:
    """The readers of ``format`` (every format's for ``"auto"``): what a hub load fetches the files of
    (:func:`.reader.hub_configs`, then :func:`.reader.hub_weights`).

    Raises:
        UnsupportedArchitectureError: an unknown format.
    """
    formats = FORMATS.values() if format == "auto" else [_format(format)]
    return [r for f in formats for r in f.readers]


def _looked_for() -> str:
    return "; ".join(f"{f.name}: {f.looks_for}" for f in FORMATS.values())


def detect_format(directory: str | os.PathLike[str]) -> str:
    """The format of a local checkpoint directory, from its files (module table).

    Raises:
        FormatDetectionError: no format matches, or several do (the message lists the formats, the
            files each looks for, and what the directory holds).
        ArgumentError: ``directory`` not a str / ``os.PathLike``.

    Source: ours (the format registry; the small per-architecture registry of SAELens).
    """
    check_path(directory, "detect_format", "a directory")
    d = Path(directory)
    found = [f.name for f in FORMATS.values() if d.is_dir() and f.detect(d)]
    if len(found) == 1:
        return found[0]
    held = sorted(p.name for p in d.iterdir())[:12] if d.is_dir() else "nothing (not a directory)"
    if found:
        raise FormatDetectionError(f"{d}: ambiguous checkpoint files: they match formats {found} "
                                   f"({_looked_for()}); it holds {held}; pass format= one of {found}")
    raise FormatDetectionError(f"{d}: no known sparse-coder checkpoint files (nor a Lorsa's); looked for "
                               f"{_looked_for()}; it holds {held}")


def load(
    path_or_repo_id: str | os.PathLike[str],
    sae_id: str | None = None,
    *,
    format: str = "auto",
    subfolder: str | None = None,
    device: Any = None,  # torch.device | str | int | None, checked by check_placement_args (a named error)
    dtype: Any = None,  # torch.dtype | None, likewise
    local_files_only: bool = False,
    revision: str | None = None,
    **options: Any,
) -> Any:
    """Load one checkpoint of any registered format as our module.

    Args:
        path_or_repo_id: a local checkpoint directory, or a Hugging Face repo id (``"org/name"``,
            ``"org/name:folder"``) when no such local path exists; with ``sae_id``: a SAELens
            release name.
        sae_id: an SAE id of the SAELens release ``path_or_repo_id`` (``SAE.from_pretrained(release,
            sae_id)``): resolved through SAELens's registry (:mod:`.saelens_releases`; the installed
            sae-lens's, or ``release_registry=<pretrained_saes.yaml>``), loaded as ``"saelens"`` with
            the registry's ``norm_scaling_factor`` (unless given) and ``config_overrides`` (a
            ``conversion_func: gemma_3`` release, GemmaScope-2: by that converter's reader).
        format: ``"auto"`` (detect, module table) or a name in :data:`FORMATS` (``"nnsight_lorsa"``,
            ``"llamascopium"``, ``"saelens"``, ``"sparsify"``, ``"circuit_tracer"``).
        subfolder: a folder inside ``path_or_repo_id`` (local or hub; a sparsify hookpoint, a SAELens id).
        device, dtype: where and as what the parameters go (default CPU, the stored dtype: the widest where the
            tensors are stored in several, so every stored value loads exactly; a ``dtype`` given casts each tensor
            to it, rounded once, refusing one whose values it would turn into inf).
        local_files_only, revision: passed to ``huggingface_hub.snapshot_download``.
        options: the reader's own: ``d_model`` and ``adapter`` (sparse coders; dropped for readers that
            take neither), ``norm_scaling_factor`` (saelens), ``weights_folded`` (llamascopium),
            ``layer`` (llamascopium Lorsa); ``folder`` / ``repo_id`` (saelens, GemmaScope-2 folders: SAELens's
            folder name and repo, set by a release); ``release_registry`` (with ``sae_id``).

    Returns:
        :class:`~nnsight_lorsa.modules.lorsa.Lorsa`, :class:`SparseAutoencoder`, :class:`Transcoder`
        (or ``SkipTranscoder``), :class:`CrossLayerTranscoder`, or a
        :class:`~.circuit_tracer.CircuitTracerTranscoders` (a circuit-tracer per-layer set), or a
        :class:`~.gate_format.GateSet` (sparse-attention gates, ``"sparse_attention"``), in eval mode.

    Raises:
        FormatDetectionError: ``format="auto"`` and no format, or several, match the files.
        UnsupportedArchitectureError: an unknown ``format``; a setting our modules cannot reproduce.
        CheckpointError: an unusable source or file (naming the file and the key).
        ConfigMismatchError: ``d_model`` given and different from the checkpoint's.
        TypeError: an option the chosen reader does not take.
        ArgumentError: ``sae_id`` with ``subfolder`` or a format other than ``"saelens"``; a ``dtype`` other
            than ``torch.float16`` / ``bfloat16`` / ``float32`` / ``float64``; a ``device`` that is not one; a
            ``revision`` with a local path; a hub ``subfolder`` that is absolute or climbs with ``..``; a
            ``release`` / ``sae_id`` that is not a str; a path that is not a ``str`` / ``os.PathLike``; a
            ``revision`` that is not a str, ``local_files_only`` not a bool.
        PlacementError: a ``device`` this machine lacks (``"cuda"`` without CUDA, a GPU index past the last).

    Source: ours (the format registry; the small per-architecture registry of SAELens).
    """
    check_path(path_or_repo_id, "load")
    device = check_placement_args(device, dtype, f"load({str(path_or_repo_id)!r})")
    if sae_id is not None:
        return _load_release(str(path_or_repo_id), sae_id, format=format, subfolder=subfolder, device=device,
                             dtype=dtype, local_files_only=local_files_only, revision=revision, **options)
    if "release_registry" in options:
        raise ArgumentError("release_registry= applies to a SAELens (release, sae_id); no sae_id was given")
    fmt = None if format == "auto" else _format(format)
    readers = readers_of(format)  # a repo id: their configs first, then the weights those configs call for
    path = resolve_checkpoint_dir(path_or_repo_id, allow_patterns=hub_configs(readers), subfolder=subfolder,
                                  local_files_only=local_files_only, revision=revision,
                                  then=lambda d: hub_weights(readers, d))
    if (isinstance(path_or_repo_id, Path) or resolve(Path(path_or_repo_id)).exists()) \
            and (fmt is None or fmt.name == "saelens"):  # local: a hub snapshot may hold other loads' folders
        nested = _gemma_3_below(path, fmt)
        if nested is not None:
            path, fmt = nested, FORMATS["saelens"]
    fmt = fmt or FORMATS[detect_format(path)]
    reader = fmt.choose(path)
    options = {k: v for k, v in options.items() if k in reader.options or k not in _SHARED_OPTIONS}
    return read_dir(reader, path, device=device, dtype=dtype, **options)


#: how many folder levels below a local directory that is no checkpoint :func:`load` looks for a GemmaScope-2 folder
#: (the Hub repo's top is two above one: ``resid_post/layer_12_width_16k_l0_small``)
NESTED_DEPTH = 2


def _detects(detect: Callable[[Path], bool], p: Path) -> bool:
    """``detect(p)``; a detection that raises (a config there that is no JSON object) counts: files are there."""
    try:
        return bool(detect(p))
    except LorsaError:
        return True


def _gemma_3_below(directory: Path, fmt: Format | None) -> Path | None:
    """The GemmaScope-2 folder to read for a local ``directory`` that no format (``fmt``, default any) recognises:
    the only checkpoint (of any format, ``fmt``'s) from one to :data:`NESTED_DEPTH` levels below it when that is a
    GemmaScope-2 folder (SAELens ``gemma_3`` layout, :func:`.saelens_releases.has_gemma_3_files`); None when the
    directory is a checkpoint itself, or none below is GemmaScope-2's (the caller's detection then says what it says).

    Raises:
        FormatDetectionError: several checkpoints there, one or more of them GemmaScope-2's (the message lists them
            as the ``subfolder=`` to pass).
    """
    formats = list(FORMATS.values()) if fmt is None else [fmt]
    if not directory.is_dir() or any(_detects(f.detect, directory) for f in formats):
        return None
    found: list[Path] = []
    level = [directory]
    for _ in range(NESTED_DEPTH):
        level = sorted((p for d in level for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")),
                       key=lambda p: _natural(p.relative_to(directory).as_posix()))
        found.extend(p for p in level if any(_detects(f.detect, p) for f in formats))
    gemma_3 = [p for p in found if _detects(saelens_releases.has_gemma_3_files, p)]
    if not gemma_3:
        return None
    if len(found) == 1:
        return found[0]
    names = [p.relative_to(directory).as_posix() for p in found]
    raise FormatDetectionError(
        f"{directory}: no checkpoint files here, and {len(found)} checkpoints within {NESTED_DEPTH} levels below it "
        f"({len(gemma_3)} of them GemmaScope-2 / SAELens gemma_3 folders): {names[:20]}"
        + (f" and {len(names) - 20} more" if len(names) > 20 else "")
        + f"; load one with load({str(directory)!r}, subfolder={names[0]!r}) (or its path)")


def _load_release(release: str, sae_id: str, *, format: str, subfolder: str | None,
                  release_registry: str | os.PathLike[str] | None = None, **options: Any) -> Any:
    """:func:`load` of a SAELens ``(release, sae_id)`` (:mod:`.saelens_releases`)."""
    if subfolder is not None or format not in ("auto", "saelens"):
        raise ArgumentError(f"load({release!r}, {sae_id!r}): a SAELens release names its repo folder and format; "
                            f"got subfolder={subfolder!r}, format={format!r}")
    entry = saelens_releases.resolve_release(release, sae_id, registry=release_registry)
    if entry.norm_scaling_factor is not None:
        options.setdefault("norm_scaling_factor", entry.norm_scaling_factor)
    if entry.config_overrides:
        options.setdefault("config_overrides", entry.config_overrides)
    if entry.conversion_func is not None:  # the converter reads SAELens's folder_name and repo_id
        options.setdefault("folder", entry.path)
        options.setdefault("repo_id", entry.repo_id)
    module = load(entry.repo_id, format="saelens", subfolder=entry.path, **options)
    module.cfg.extra["saelens"].update(release=release, sae_id=sae_id, repo_id=entry.repo_id, path=entry.path)
    return module


def _natural(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _named(name: str, obj: Any) -> dict[str, Any]:
    if isinstance(obj, circuit_tracer.CircuitTracerTranscoders):
        return {f"{name}/layer_{layer}": tc for layer, tc in sorted(obj.transcoders.items())}
    return {name: obj}


class PartialLoadWarning(UserWarning):
    """:func:`load_all` loaded some subfolders of a folder and not others.

    Attributes:
        directory: the folder.
        failures: ``{subfolder name: the named error it raised}``.

    Source: ours (the format registry; the small per-architecture registry of SAELens).
    """

    def __init__(self, directory: Path, failures: dict[str, Exception]) -> None:
        self.directory = directory
        self.failures = failures
        listed = "; ".join(f"{name}: {type(e).__name__}: {e}" for name, e in failures.items())
        super().__init__(f"{directory}: {len(failures)} subfolder(s) not loaded: {listed}")


class LoadedModules(dict[str, Any]):
    """What :func:`load_all` returns: ``{name: module}``, plus ``failures``
    (``{subfolder name: error}``; empty when everything loaded).

    Source: ours (the format registry; the small per-architecture registry of SAELens).
    """

    failures: dict[str, Exception]


def _checkpoint_like(p: Path) -> bool:
    """Whether ``p`` holds files a format reads (then it is meant to be a checkpoint, and a failure
    to load it is reported rather than skipped)."""
    names = {n for f in FORMATS.values() for n in f.hub_files if "*" not in n}
    return any((p / n).is_file() for n in names) or any(p.glob("*.safetensors"))


def checkpoint_folders(directory: Path, fmt: Format | None = None) -> list[Path]:
    """The subfolders of ``directory`` that :func:`load_all` reads as modules (in natural order): those a format
    (``fmt``, default any) recognises, or holding files a format reads (:func:`_checkpoint_like`)."""
    subs = sorted((p for p in directory.iterdir() if p.is_dir()), key=lambda p: _natural(p.name)) \
        if directory.is_dir() else []
    return [p for p in subs if any(f.detect(p) for f in (FORMATS.values() if fmt is None else [fmt]))
            or _checkpoint_like(p)]


def load_all(directory: str | os.PathLike[str], *, format: str = "auto", **kwargs: Any) -> LoadedModules:
    """Every module of a checkpoint folder, by name: the folder itself when it is a checkpoint, else
    each subfolder that is one (a sparsify run, a ``LorsaSet.save`` directory), in natural order.

    A circuit-tracer transcoder set yields one entry per layer (``"<name>/layer_<i>"``); a hub repo
    id is one checkpoint (:func:`load`). ``kwargs`` go to :func:`load`. In a folder of checkpoints,
    a subfolder that holds checkpoint files but fails to load (an unsupported architecture, a
    missing weights file) does not stop the others: it is listed in the result's ``failures`` and
    in one :class:`PartialLoadWarning`.

    Returns:
        :class:`LoadedModules` ``{name: module}`` (``name`` = the folder's name) with ``failures``.

    Raises:
        FormatDetectionError: neither the folder nor any subfolder holds a recognisable checkpoint.
        CheckpointError, UnsupportedArchitectureError, ConfigMismatchError: from the readers, when
            the folder itself is the checkpoint, or when no subfolder loaded (the first subfolder's
            error, with every failure listed in the message).
        ArgumentError, PlacementError: a bad ``dtype`` / ``device`` in ``kwargs`` (as :func:`load`), or a
            ``directory`` that is not a ``str`` / ``os.PathLike``, before any folder is read.

    Source: ours (the format registry; the small per-architecture registry of SAELens).
    """
    check_path(directory, "load_all")
    check_placement_args(kwargs.get("device"), kwargs.get("dtype"), f"load_all({str(directory)!r})")
    d = Path(directory)
    local = isinstance(directory, Path) or d.exists()
    result = LoadedModules()
    result.failures = {}
    if not local or kwargs.get("subfolder"):
        result.update(_named(d.name, load(directory, format=format, **kwargs)))
        return result
    fmt = None if format == "auto" else _format(format)
    try:
        if fmt is None:
            detect_format(d)
        elif not (d.is_dir() and fmt.detect(d)):
            raise FormatDetectionError(f"{d}: no {fmt.name} checkpoint files ({fmt.looks_for})")
    except FormatDetectionError:
        candidates = checkpoint_folders(d, fmt)
        if not candidates:
            raise
        for p in candidates:
            try:
                result.update(_named(p.name, load(p, format=format, **kwargs)))
            except LorsaError as e:
                result.failures[p.name] = e
        if result.failures:
            warning = PartialLoadWarning(d, result.failures)
            if not result:
                first = next(iter(result.failures.values()))
                raise type(first)(str(warning)) from first
            warnings.warn(warning, stacklevel=2)
        return result
    result.update(_named(d.name, load(d, format=format, **kwargs)))
    return result


def _check_not_meta(obj: Any, path: Any) -> None:
    """Refuse to save ``obj`` (a module, ``{key: module}``, a set with ``transcoders`` / ``gates``) when some
    module of it has tensors on ``meta``: they hold no values to write."""
    inner = getattr(obj, "transcoders", None) or getattr(obj, "gates", None) or obj
    items = list(inner.items()) if isinstance(inner, dict) else [("", inner)]
    for key, module in items:
        if isinstance(module, torch.nn.Module) and any(
                t.is_meta for t in (*module.parameters(), *module.buffers())):
            what = f"the {type(module).__name__}" + (f" at {key!r}" if key != "" else "")
            raise PlacementError(f"save({str(path)!r}): {what} has its weights on the meta device (never loaded "
                                 "or materialised), so there is nothing to write; load or initialise it first")


def save(obj: Any, path: str | os.PathLike[str], *, format: str = DEFAULT_FORMAT, **options: Any) -> Path:
    """Write ``obj`` to the directory ``path`` (created if needed) in ``format``; returns the directory.

    Writers: ``"nnsight_lorsa"`` (default): a Lorsa, SAE, (skip) transcoder or CLT; ``"saelens"``
    and ``"sparsify"``: an SAE or transcoder; ``"circuit_tracer"``: a CLT, or ``{layer: transcoder}``
    / a :class:`~.circuit_tracer.CircuitTracerTranscoders`; ``"llamascopium"``: a Lorsa;
    ``"sparse_attention"``: a :class:`~.gate_format.GateSet` (the gate files only). ``options`` go
    to the writer (e.g. ``hook_name=`` for SAELens, ``feature_input_hook=`` for circuit-tracer,
    ``hook_point_in=`` / ``hook_point_out=`` / ``n_ctx=`` for Llamascopium).

    Raises:
        UnsupportedArchitectureError: an unknown format, one without a writer, or a module the
            format cannot express (e.g. a non-TopK coder for sparsify).
        ArgumentError: an object the format does not write, or ``path`` not a ``str`` / ``os.PathLike`` (a
            ``TypeError``).
        CheckpointError: a config that is not JSON-serialisable.
        PlacementError: a module (or one of a set's) has its weights on the ``meta`` device (never
            materialised): nothing is written.
        ArgumentError: (also) a module a Trainer is training in place, in its normalised space: save
            ``trainer.folded()``.

    Source: ours (the format registry; the small per-architecture registry of SAELens).
    """
    check_path(path, "save", "a directory")
    _check_not_meta(obj, path)
    for module in (obj.values() if isinstance(obj, Mapping) else [obj]):
        refuse_training_space(module, "save")
    fmt = _format(format)
    if not fmt.writers:
        raise UnsupportedArchitectureError(f"format {format!r} is read-only; writable: "
                                           f"{[f.name for f in FORMATS.values() if f.writers]}")
    for types, write in fmt.writers:
        if isinstance(obj, types):
            return write(obj, path, **options)
    writes = [getattr(t, "__name__", t) for types, _ in fmt.writers
              for t in (types if isinstance(types, tuple) else (types,))]
    raise ArgumentError(f"format {format!r} does not write a {type(obj).__name__}; it writes {writes}")

