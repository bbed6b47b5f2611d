"""The Hugging Face Hub layout of replacement sets and attribution graphs, and the two Hub calls.

A Hub repo (or a ``subfolder`` of one) holds exactly what the local ``save`` writes, plus a model card:

====================================  =================================================================
``README.md``                         model card: YAML metadata (``library_name: nnsight-lorsa``, tags,
                                      ``base_model`` when the model has a Hub id), what is inside, the
                                      metrics given to ``push_to_hub(metrics=...)``, how to load it
``layer_<L>/config.json`` +           a Lorsa / transcoder set (``ReplacementSet.save``: one folder per
``layer_<L>/model.safetensors`` +     layer, format ``"nnsight_lorsa"``; an SAE set: one folder per site
``layer_<L>/checksums.json``          path), each folder with its manifest (size + sha256 of each file)
``graph.json`` + ``graph.safetensors``  an attribution graph (``Graph.save``)
``+ checksums.json``
====================================  =================================================================

``push_to_hub`` writes that folder locally first, through the package's one atomic write path
(:mod:`nnsight_lorsa._atomic`: staged, fsynced, manifest last, swapped in), then uploads it with
``HfApi.create_repo(exist_ok=True)`` + ``HfApi.upload_folder``. ``from_pretrained(model, "owner/name")`` /
``Graph.load("owner/name")`` download the files of the layout with ``snapshot_download`` (``revision=``,
``subfolder=``, ``local_files_only=``; each folder's ``checksums.json`` always among the patterns) and read the
snapshot as a local directory, manifests checked. A set comes in two downloads of one commit: the card, the
manifests and every folder's configs (:func:`set_download_patterns`), then the weights those call for at the top
and one folder down (:func:`set_weight_patterns`: the files each manifest lists, each format's weights where its
config came) — not every ``.safetensors`` of the repo. A downloaded set must hold every folder its card lists
(:func:`card_folders`: an interrupted download is refused, not read as a smaller set); without a card, every
folder holding a checkpoint's files must load (a folder with a config but not its weights is refused), and a
folder missing whole is seen only through the set index.

``set.json``, the set index (:data:`SET_INDEX`, written by ``ReplacementSet.save`` since 2026-11-28, so also in every
``push_to_hub`` folder): ``{"format": "nnsight_lorsa.set", "folders": [...]}``, the module folders the directory
holds after the save (the set's own and those an earlier save left there). ``from_pretrained`` of a local
directory or a downloaded snapshot refuses one that lacks a listed folder, or where a listed folder does not load
(a partial copy, an interrupted download: not a smaller set). Directories saved before it have none and load as
before.
``huggingface_hub`` is imported only for a repo id.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .._atomic import atomic_file, is_relative_name
from ..errors import ArgumentError, MissingDependencyError
from .files import read_json_object
from .validate import require

__all__ = ["CARD", "SET_INDEX", "SET_INDEX_FORMAT", "card_folders", "check_push_args", "graph_card",
           "looks_like_repo_id", "metrics_table", "push_folder", "set_card", "set_download_patterns", "set_index",
           "set_index_folders", "set_weight_patterns", "stage_and_push", "write_card"]

#: the model card's file name
CARD = "README.md"
#: the set index's file name (module docstring)
SET_INDEX = "set.json"
#: the set index's ``"format"``
SET_INDEX_FORMAT = "nnsight_lorsa.set"
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+$")


def looks_like_repo_id(source: Any) -> bool:
    """Whether ``source`` is a string of the form ``owner/name`` (optionally ``owner/name:subfolder``) that is
    not an existing local path (nor one a killed save left as ``<path>.old``)."""
    if not isinstance(source, str):
        return False
    if Path(source).exists() or Path(source + ".old").exists():
        return False
    return bool(_REPO_ID.match(source.split(":", 1)[0])) and ".." not in source and "--" not in source


def set_download_patterns(file_patterns: list[str]) -> list[str]:
    """The first ``snapshot_download`` patterns of a set's layout: each config file (:func:`.reader.hub_configs`)
    at the top and in folders (``layer_<L>/config.json``; huggingface_hub matches with ``fnmatch``, whose ``*``
    also spans ``/``: the configs of deeper folders come too, small files), the manifests and the card."""
    names = sorted({*file_patterns, "checksums.json"})
    return [*names, *(f"*/{n}" for n in names), CARD, SET_INDEX]


def set_weight_patterns(readers: list[Any], directory: Path) -> list[str]:
    """The second download of a set (``directory``: the snapshot holding what :func:`set_download_patterns`
    fetched): :func:`.reader.hub_weights` of the top and of each folder directly in it (``layer_<L>/…``), the
    folders' names escaped. Deeper folders, which a set does not read, get none."""
    import glob

    from .reader import hub_weights

    out = hub_weights(readers, directory)
    for folder in sorted(p for p in directory.iterdir() if p.is_dir()) if directory.is_dir() else []:
        out += [f"{glob.escape(folder.name)}/{p}" for p in hub_weights(readers, folder)]
    return out


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def _scalars(metrics: Any, where: str) -> dict[str, Any]:
    """``{name: value}`` of an object with ``to_dict()`` (an ``Evaluation``) or a mapping, without the
    per-feature ``feature_density``, ``None`` values or anything but numbers and lists of numbers."""
    if hasattr(metrics, "to_dict") and callable(metrics.to_dict):
        metrics = metrics.to_dict()
    if not isinstance(metrics, Mapping):
        raise ArgumentError(f"{where}: metrics must be an Evaluation or a mapping of metric names to numbers, got "
                            f"{type(metrics).__name__}")
    out = {}
    for name, value in metrics.items():
        if name == "feature_density":
            continue
        if _number(value) or (isinstance(value, (list, tuple)) and value and all(_number(v) for v in value)):
            out[str(name)] = value
    return out


def metrics_table(metrics: Any, keys: list[Any] | None = None, key_name: str = "layer",
                  where: str = "push_to_hub") -> str:
    """A Markdown table of ``metrics``: an ``Evaluation`` or ``{name: number}`` (one column), or, when every
    key of the mapping is one of ``keys``, ``{key: Evaluation | {name: number}}`` (one row per key).
    Empty string for ``None``.

    Raises:
        ArgumentError: ``metrics`` (or a per-key entry) is neither an Evaluation nor a mapping, or holds no number.
    """
    if metrics is None:
        return ""
    if isinstance(metrics, Mapping) and keys and metrics and all(k in keys for k in metrics):
        rows = {k: _scalars(v, f"{where}: metrics[{k!r}]") for k, v in metrics.items()}
        names = sorted({n for r in rows.values() for n in r})
        if not names:
            raise ArgumentError(f"{where}: metrics hold no number")
        lines = [f"| {key_name} | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        lines += [f"| {k} | " + " | ".join(_fmt(r.get(n, "")) for n in names) + " |" for k, r in rows.items()]
        return "\n".join(lines)
    flat = _scalars(metrics, where)
    if not flat:
        raise ArgumentError(f"{where}: metrics hold no number")
    return "\n".join(["| metric | value |", "|---|---|", *(f"| {n} | {_fmt(v)} |" for n, v in flat.items())])


def write_card(directory: str | os.PathLike[str], *, title: str, tags: list[str], base_model: str | None,
               body: str) -> Path:
    """Write the model card ``directory/README.md`` (YAML metadata, then ``# title`` and ``body``) atomically
    (:func:`nnsight_lorsa._atomic.atomic_file`); returns its path."""
    meta = ["---", "library_name: nnsight-lorsa", "tags:", *(f"- {t}" for t in tags)]
    if base_model is not None and looks_like_repo_id(base_model):
        meta.append(f"base_model: {base_model}")
    meta.append("---")
    text = "\n".join(meta) + f"\n\n# {title}\n\n{body.strip()}\n"
    return atomic_file(Path(directory) / CARD, text.encode("utf-8"))


_CARD_ROW = re.compile(r"^\| [^|\n]* \| `([^`/\n]+)/` \| ", re.MULTILINE)


def card_folders(directory: str | os.PathLike[str]) -> list[str] | None:
    """The module folders a replacement set's model card (``directory/README.md``, written by :func:`set_card`)
    lists, in its order; None where ``directory`` holds no card of ours (``library_name: nnsight-lorsa``) or the
    card lists none (a graph's). What ``from_pretrained`` checks a downloaded set against: a folder the card lists
    that the snapshot lacks is an incomplete download, not a smaller set."""
    card = Path(directory) / CARD
    try:
        text = card.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not text.startswith("---\nlibrary_name: nnsight-lorsa\n"):
        return None
    return _CARD_ROW.findall(text) or None


def set_index(folders: list[str]) -> dict[str, Any]:
    """The set index (module docstring) listing ``folders``, as written to ``SET_INDEX``."""
    return {"format": SET_INDEX_FORMAT, "folders": list(folders)}


def set_index_folders(directory: str | os.PathLike[str]) -> list[str] | None:
    """The module folders the set index ``directory/set.json`` lists, in its order; None where ``directory`` holds
    none (a set saved before 2026-11-28, another library's folder). What ``from_pretrained`` checks a set's
    directory against, local or downloaded: a listed folder that is missing or does not load is a partial copy.

    Raises:
        CheckpointError: the file is not JSON, not a set index (``"format"``), or its ``"folders"`` are not distinct
            relative folder names (naming the file).
    """
    path = Path(directory) / SET_INDEX
    if not path.exists():
        return None
    data = read_json_object(path)
    require(data.get("format") == SET_INDEX_FORMAT, path, f'not a set index: its "format" is not {SET_INDEX_FORMAT!r}')
    folders = data.get("folders")
    require(isinstance(folders, list) and len(set(map(str, folders))) == len(folders)
            and all(map(is_relative_name, folders)), path,
            f'"folders" must be a list of distinct relative folder names, got {folders!r}')
    return [str(f) for f in folders or []]


def _target(repo_id: str, subfolder: str | None) -> str:
    """How the loaders spell ``repo_id`` (+ ``subfolder``): ``"owner/name"`` or ``"owner/name:folder"``."""
    return f"{repo_id}:{subfolder.strip('/')}" if subfolder else repo_id


def set_card(directory: str | os.PathLike[str], *, kind: str, what: str, key_name: str,
             modules: list[tuple[Any, str, Any]], config: Any, metrics_table: str, repo_id: str,
             subfolder: str | None) -> Path:
    """Write the model card of a replacement set (``kind``: ``"LorsaSet"`` …; ``what``: ``"Lorsa"``,
    ``"transcoder"``, ``"SAE"``) holding ``modules`` = ``[(key, folder, module)]`` of the model whose HF
    ``config`` is given: what it holds (each module's sizes), the metrics table, how to load it. A local model is
    named by its folder's name only (no local path is published); a Hub one is also the card's ``base_model``."""
    model_name = getattr(config, "_name_or_path", None) or None
    if model_name is not None and not looks_like_repo_id(model_name):
        model_name = os.path.basename(os.path.normpath(str(model_name))) or None
    family = getattr(config, "model_type", None)
    fields = ("n_ov_heads", "n_qk_heads", "d_qk_head", "top_k", "d_in", "d_sae", "d_out", "activation")
    rows = []
    for key, folder, module in modules:
        cfg = getattr(module, "cfg", None)
        shown = ", ".join(f"{f}={getattr(cfg, f)}" for f in fields if getattr(cfg, f, None) is not None)
        rows.append(f"| {key} | `{folder}/` | {type(module).__name__} | {shown} |")
    n = len(modules)
    body = "\n".join([
        f"A {kind} ({n} {what}{'s' if n != 1 else ''}) for `{model_name or 'its model'}`"
        f"{f' ({family})' if family else ''}, published with nnsight-lorsa (`pip install nnsight-lorsa`) "
        "in its Hub layout.",
        "", f"| {key_name} | folder | module | config |", "|---|---|---|---|", *rows, "",
        "## Metrics", "", metrics_table or "No metrics were given when this was published.", "",
        "## Use", "", "```python", f"from nnsight_lorsa import {kind}", "",
        f"replacements = {kind}.from_pretrained(model, {_target(repo_id, subfolder)!r})   # model: the nnsight model",
        "with model.trace(prompt):",
        "    sites = replacements.replace()   # every module of the set, this trace only",
        "```", "",
        "## Layout", "",
        f"Each folder (`{modules[0][1]}/` …) holds `config.json` + `model.safetensors` (format `nnsight_lorsa`) "
        "and `checksums.json` (each file's size and sha256, checked on load).",
    ])
    return write_card(directory, title=f"{kind} for {model_name or 'a model'}",
                      tags=["nnsight-lorsa", "mechanistic-interpretability",
                            {"SAE": "sparse-autoencoder"}.get(what, what.lower())],
                      base_model=model_name, body=body)


def graph_card(directory: str | os.PathLike[str], *, prompt: str, n_tokens: int, counts: dict[str, int],
               meta: dict[str, Any], metrics_table: str, repo_id: str, subfolder: str | None) -> Path:
    """Write the model card of an attribution graph: the prompt, the node counts (``Graph.summary()``), the
    replaced layers from ``meta``, the metrics table, how to load it."""
    shown = {k: meta[k] for k in ("model_type", "lorsa_layers", "transcoder_layers") if k in meta}
    body = "\n".join([
        f"An attribution graph of one prompt ({n_tokens} tokens), computed with nnsight-lorsa (frozen attention "
        "and norms, Lorsa heads and transcoder features as nodes; each node's edges sum exactly to its value, "
        "bias nodes included).", "",
        "```text", prompt.replace("```", "` ` `"), "```", "",
        "| " + " | ".join(counts) + " |", "|---" * len(counts) + "|",
        "| " + " | ".join(str(v) for v in counts.values()) + " |", "",
        *(f"- {k}: `{v}`" for k, v in shown.items()), "",
        "## Metrics", "", metrics_table or "No metrics were given when this was published.", "",
        "## Use", "", "```python", "from nnsight_lorsa import Graph", "",
        f"graph = Graph.load({_target(repo_id, subfolder)!r})", "```", "",
        "Files: `graph.json` (prompt, bias names, settings), `graph.safetensors` (tokens, nodes, adjacency, "
        "values), `checksums.json` (each file's size and sha256, checked on load).",
    ])
    return write_card(directory, title="Attribution graph",
                      tags=["nnsight-lorsa", "mechanistic-interpretability", "attribution-graph"],
                      base_model=None, body=body)


def push_folder(folder: Path, repo_id: Any, *, subfolder: Any = None, private: Any = None,
                token: str | None = None, commit_message: Any = "Upload with nnsight-lorsa",
                delete_patterns: list[str] | None = None, where: str = "push_to_hub") -> str:
    """Upload ``folder`` to the Hub model repo ``repo_id`` (created if missing, ``exist_ok=True``), at
    ``subfolder`` (default: the repo's top); remote files under that path matching ``delete_patterns`` that
    the upload does not replace are deleted in the same commit. Returns the commit's URL.

    Raises:
        ArgumentError: ``repo_id`` is not ``owner/name``, ``subfolder`` is not a relative folder path, or
            ``commit_message`` is empty.
        MissingDependencyError: ``huggingface_hub`` is not installed.
    """
    check_push_args(repo_id, subfolder, commit_message, where, private)
    try:
        from huggingface_hub import HfApi
    except ImportError as e:
        raise MissingDependencyError(f"{where} needs huggingface_hub: pip install huggingface_hub "
                                     "(it comes with pip install nnsight-lorsa)") from e
    api = HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    info = api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=str(folder),
                             path_in_repo=subfolder.strip("/") if subfolder else None,
                             commit_message=commit_message, delete_patterns=delete_patterns)
    return str(info)


def check_push_args(repo_id: Any, subfolder: Any, commit_message: Any, where: str, private: Any = None) -> None:
    """Raise :class:`ArgumentError` (naming ``where``) for a ``repo_id`` that is not ``owner/name``, a
    ``subfolder`` that is not a relative folder path, an empty ``commit_message``, or ``private`` not a
    bool or None."""
    if not isinstance(repo_id, str) or not _REPO_ID.match(repo_id) or ".." in repo_id or "--" in repo_id:
        raise ArgumentError(f"{where}: repo_id must be a Hugging Face repo id 'owner/name', got {repo_id!r}")
    if subfolder is not None and (not isinstance(subfolder, str) or not subfolder.strip("/")
                                  or subfolder.startswith("/") or ".." in subfolder.split("/")):
        raise ArgumentError(f"{where}: subfolder must be a relative folder path in the repo, got {subfolder!r}")
    if not isinstance(commit_message, str) or not commit_message.strip():
        raise ArgumentError(f"{where}: commit_message must be a non-empty str, got {commit_message!r}")
    if private is not None and not isinstance(private, bool):
        raise ArgumentError(f"{where}: private must be None, True or False, got {private!r}")


def stage_and_push(write: Callable[[Path], None], repo_id: Any, *, subfolder: Any = None, private: Any = None,
                   commit_message: Any = "Upload with nnsight-lorsa", where: str = "push_to_hub", **kwargs: Any) -> str:
    """Check the arguments, write the layout with ``write(directory)`` into a temporary directory, then
    :func:`push_folder` it (``kwargs``: ``token``, ``delete_patterns``)."""
    import tempfile

    check_push_args(repo_id, subfolder, commit_message, where, private)
    kwargs.update(subfolder=subfolder, private=private, commit_message=commit_message, where=where)
    with tempfile.TemporaryDirectory(prefix="nnsight-lorsa-hub-") as tmp:
        folder = Path(tmp) / "repo"
        write(folder)
        return push_folder(folder, repo_id, **kwargs)
