"""SAELens's release registry: ``(release, sae_id)`` -> hub repo, folder and recorded settings.

SAELens users load pretrained SAEs as ``SAE.from_pretrained(release, sae_id)``; the names resolve
through ``sae_lens/pretrained_saes.yaml`` (``sae_lens/loading/pretrained_saes_directory.py``)::

    <release>:
      repo_id: org/name              the Hugging Face repo
      conversion_func: null | name   null: SAELens's own layout (cfg.json + sae_weights.safetensors)
      config_overrides: {...}        merged over each cfg.json (optional)
      saes:
      - id: blocks.0.hook_mlp_out    the sae_id
        path: folder/in/repo         the folder of that SAE
        norm_scaling_factor: 1.05    for normalize_activations = "expected_average_only_in" (optional)

:func:`resolve_release` reads that file — the one inside the installed ``sae-lens`` (optional extra
``pip install nnsight-lorsa[saelens]``; found without importing it), or any file in that format
given as ``registry=`` — and ``formats.load(release, sae_id)`` loads the SAE with our SAELens
reader, folding the recorded ``norm_scaling_factor`` as ``from_pretrained`` does.

Converters (``conversion_func``): ``gemma_3`` (GemmaScope-2, the ``gemma-scope-2-*`` releases of Gemma-3
dictionaries) is read by :data:`GEMMA_3_READER` (the second reader of format ``"saelens"``), which builds the
config dict and state dict SAELens's ``gemma_3_sae_huggingface_loader`` builds and hands them to our SAELens reader
(:func:`.saelens.parse_raw_config`, :func:`.saelens.convert_state`, :func:`.saelens.build`)::

    <folder>/params.safetensors  w_enc (d_in, d_sae), w_dec (d_sae, d_out), b_enc (d_sae), b_dec (d_out),
                                 threshold (d_sae), [affine_skip_connection (d_in, d_out)] -> W_skip = its transpose
    <folder>/config.json         optional: {"architecture": "jump_relu", "model_name", "hf_hook_point_in",
                                 ["hf_hook_point_out"], ["affine_connection"]}; without it SAELens infers one from the
                                 folder name (``_infer_gemma_3_raw_cfg_dict``)

The hook name comes from the folder name (``layer_<L>`` and, in this order: ``resid_post`` ->
``blocks.L.hook_resid_post``, ``attn_out`` -> ``blocks.L.attn.hook_z``, ``mlp_out`` -> ``blocks.L.hook_mlp_out``,
``transcoder`` -> ``blocks.L.hook_mlp_in`` / ``hook_mlp_out``: ``jumprelu_skip_transcoder`` when the config's
``affine_connection`` is true (``true`` or ``1``; SAELens tests its truthiness, this reader takes a JSON boolean or
0 / 1 and refuses anything else by name — a string, even ``"false"``, is true there), else ``jumprelu_transcoder``;
read at ``hf_hook_point_in``, which must be that layer's ``pre_feedforward_layernorm.output``, the MLP's input). CLT
folders (``clt`` in the name; SAELens reads
``<leaf>.safetensors`` and sums ``w_dec (d_sae, n_layers, d_out)`` over the layers, which makes a single-layer
transcoder that is not the CLT) are refused. Other converters (Gemma Scope ``.npz``, dictionary_learning, …) are
refused by name; where one of our formats reads those files, ``load(repo_id, subfolder=path, format=...)`` loads
them.

A local folder above the SAE's (the repo's top, ``<repo>/resid_post/layer_12_width_16k_l0_small/``, or the hook folder
``<repo>/resid_post/``), which no format recognises, is searched two levels down by ``formats.load``
(:mod:`.registry`): it reads the GemmaScope-2 folder found there when it is the only checkpoint within those levels,
and refuses several by name (:class:`~nnsight_lorsa.errors.FormatDetectionError`), listing them as the
``subfolder=`` to pass.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from ..errors import ArgumentError, LorsaError, UnsupportedArchitectureError
from . import saelens
from .files import load_safetensors, read_json_object, read_safetensors_header
from .reader import Parsed, Reader
from .validate import check_file_tensors, check_size, file_errors, refuse, require, require_file

REGISTRY_FILE = "pretrained_saes.yaml"
#: the ``conversion_func`` values whose files format ``"saelens"`` reads (:data:`GEMMA_3_READER`)
CONVERTERS = ("gemma_3",)
#: GemmaScope-2's files (SAELens ``gemma_3_sae_huggingface_loader``)
GEMMA_3_CONFIG = "config.json"
GEMMA_3_WEIGHTS = "params.safetensors"
#: the tensors of ``params.safetensors`` SAELens reads, and their names in its state dict
GEMMA_3_TENSORS = {"w_enc": "W_enc", "w_dec": "W_dec", "b_enc": "b_enc", "b_dec": "b_dec", "threshold": "threshold"}
GEMMA_3_SKIP = "affine_skip_connection"

__all__ = ["CONVERTERS", "GEMMA_3_CONFIG", "GEMMA_3_READER", "GEMMA_3_TENSORS", "GEMMA_3_WEIGHTS",
           "REGISTRY_FILE", "SAELensRelease", "gemma_3_cfg_dict", "has_gemma_3_files", "installed_registry",
           "load_gemma_3_weights", "parse_gemma_3_config", "resolve_release"]


@dataclass(frozen=True)
class SAELensRelease:
    """One SAE of a SAELens release, as its registry records it.

    Attributes:
        release, sae_id: the names ``SAE.from_pretrained`` takes.
        repo_id: the Hugging Face repo (or a local directory laid out as it).
        path: the SAE's folder in the repo.
        norm_scaling_factor: the dataset-wide input scale of ``expected_average_only_in`` SAEs, if recorded.
        config_overrides: keys merged over the SAE's ``cfg.json``.
        conversion_func: the SAELens converter its files need (None: SAELens's own layout; else one of
            :data:`CONVERTERS`).

    Source: SAELens ``sae_lens/loading/pretrained_saes_directory.py`` (``pretrained_saes.yaml``).
    """

    release: str
    sae_id: str
    repo_id: str
    path: str
    norm_scaling_factor: float | None = None
    config_overrides: dict[str, Any] = field(default_factory=dict)
    conversion_func: str | None = None



def installed_registry() -> Path:
    """``pretrained_saes.yaml`` of the installed ``sae-lens`` (located, not imported).

    Raises:
        CheckpointError: sae-lens is not installed (``pip install nnsight-lorsa[saelens]``), or its
            package holds no registry file.
    """
    spec = importlib.util.find_spec("sae_lens")
    require(spec is not None and spec.submodule_search_locations, None,
            "SAELens release names need SAELens's registry: install it with `pip install nnsight-lorsa[saelens]`, "
            f"or pass release_registry=<a {REGISTRY_FILE} path>")
    assert spec is not None and spec.submodule_search_locations is not None
    path = Path(next(iter(spec.submodule_search_locations))) / REGISTRY_FILE
    require(path.is_file(), path, "the installed sae-lens has no release registry file")
    return path


@lru_cache(maxsize=4)
def _read(path: Path, mtime: float) -> dict[str, Any]:
    import yaml

    unreadable = (yaml.YAMLError, OSError, UnicodeDecodeError, RecursionError)
    with file_errors(path, {unreadable: "not readable YAML ({e})"}), path.open(encoding="utf-8") as f:
        data = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    require(isinstance(data, dict), path, "not a SAELens release registry (expected a mapping of releases)")
    return data  # type: ignore[no-any-return]


def resolve_release(release: Any, sae_id: Any, *,  # each a str, checked below (a named error)
                    registry: str | os.PathLike[str] | None = None) -> SAELensRelease:
    """Look ``(release, sae_id)`` up in SAELens's registry (module docstring).

    Args:
        release: a release name, e.g. ``"gpt2-small-res-jb"``.
        sae_id: an SAE id of that release, e.g. ``"blocks.8.hook_resid_pre"``.
        registry: a ``pretrained_saes.yaml`` (default: the installed sae-lens's, :func:`installed_registry`).

    Raises:
        ArgumentError: ``release`` or ``sae_id`` not a str.
        CheckpointError: no registry, an unknown release or sae_id (the message lists some valid
            ones), an entry without ``repo_id`` / ``path``, a malformed entry (``saes`` not a list, a ``path``
            outside the repo, a ``norm_scaling_factor`` that is not a number, ``config_overrides`` not a mapping).
        UnsupportedArchitectureError: the release needs a SAELens converter (``conversion_func``) other than those
            of :data:`CONVERTERS`; a ``gemma_3`` CLT (``clt`` in its ``path``). (A ``path``
            ending ``.pt`` is a folder, as for SAELens's loader; nothing is ever unpickled.)

    Source: SAELens ``sae_lens/loading/pretrained_saes_directory.py`` (``pretrained_saes.yaml``).
    """
    for name, value in (("release", release), ("sae_id", sae_id)):
        if not isinstance(value, str):
            raise ArgumentError(f"resolve_release: {name} must be a str (a name of SAELens's registry), got {value!r} "
                                f"({type(value).__name__})")
    path = Path(registry) if registry is not None else installed_registry()
    require_file(path, " (the release registry)")
    data = _read(path.resolve(), path.stat().st_mtime)
    entry = data.get(release)
    if not isinstance(entry, dict):
        near = sorted(str(r) for r in data if release.split("-")[0] in str(r))[:8] or sorted(map(str, data))[:8]
        refuse(path, f"no release {release!r}" + ("" if entry is None else f" (its entry is a {type(entry).__name__}, "
                                                                            "not a mapping)") + f"; e.g. {near}")
    listed = entry.get("saes", [])
    require(isinstance(listed, list), path, f"release {release!r}: 'saes' must be a list of SAE entries, got "
                                            f"{type(listed).__name__}")
    saes = {s.get("id"): s for s in listed if isinstance(s, dict) and isinstance(s.get("id"), str)}
    require(sae_id in saes, path, f"release {release!r} has no sae_id {sae_id!r}; valid ids include {list(saes)[:8]}")
    converter = entry.get("conversion_func")
    if converter is not None and converter not in CONVERTERS:
        raise UnsupportedArchitectureError(
            f"release {release!r} needs SAELens's converter {converter!r} (its files are not in SAELens's own "
            f"layout; converters read here: {list(CONVERTERS)}); if one of our formats reads them, use "
            f"load({entry.get('repo_id')!r}, "
            f"subfolder={str(saes[sae_id].get('path'))!r}, format=...)")
    sae = saes[sae_id]
    repo_id, folder = entry.get("repo_id"), sae.get("path")
    if not isinstance(repo_id, str) or folder is None:
        refuse(path, f"release {release!r} / {sae_id!r} lacks 'repo_id' or 'path'")
    folder = str(folder)
    require(not folder.startswith("/") and ".." not in folder.split("/"), path,
            f"release {release!r} / {sae_id!r}: 'path' {folder!r} is not a folder inside the repo {repo_id!r} "
            "(absolute, or with a '..' part)")
    # a path ending .pt is a folder here (SAELens's own loader, conversion_func null, fetches <path>/cfg.json and
    # <path>/sae_weights.safetensors: gpt2-small-resid-post-v5-32k's v5_32k_layer_<i>.pt); it was refused as a
    # pickle until 2026-11-29. Nothing is unpickled either way: a file of that name is no folder to read
    if converter == "gemma_3" and "clt" in folder:  # SAELens's file is <path>.safetensors, not a folder of ours
        raise UnsupportedArchitectureError(f"release {release!r} / {sae_id!r}: {folder!r} is a {_CLT_REFUSAL}")
    factor = sae.get("norm_scaling_factor")
    require(factor is None or (isinstance(factor, (int, float)) and not isinstance(factor, bool)), path,
            f"release {release!r} / {sae_id!r}: 'norm_scaling_factor' must be a number, got {factor!r}")
    overrides = entry.get("config_overrides") or {}
    require(isinstance(overrides, dict), path, f"release {release!r}: 'config_overrides' must be a mapping of "
                                               f"cfg.json keys, got {type(overrides).__name__}")
    return SAELensRelease(release=release, sae_id=sae_id, repo_id=repo_id, path=folder,
                          norm_scaling_factor=None if factor is None else float(factor),
                          config_overrides=dict(overrides), conversion_func=converter)


# ------------------------------------------------------------------ conversion_func: gemma_3 (GemmaScope-2)
#: SAELens's folder-name words, in the order ``get_gemma_3_config_from_hf`` tests them, and the hook each names
_GEMMA_3_HOOKS = (("resid_post", "hook_resid_post"), ("attn_out", "attn.hook_z"), ("mlp_out", "hook_mlp_out"),
                  ("transcoder", "hook_mlp_in"))
_LAYER = re.compile(r"layer_(\d+)")
_CLT_REFUSAL = ("GemmaScope-2 cross-layer transcoder ('clt' in the name); SAELens reads its <name>.safetensors as one "
                "single-layer transcoder whose decoder is w_dec (d_sae, n_layers, d_out) summed over the layers it "
                "writes to, which is not the CLT's computation (each layer gets its own slice): not read here")


def _gemma_3_folder(directory: Path, folder: str | None) -> str:
    """SAELens's ``folder_name``: the release's ``path`` when given, else the directory's last two parts
    (``resid_post/layer_12_width_16k_l0_small``, as in the repo)."""
    return folder if folder is not None else "/".join(directory.parts[-2:])


def _names_gemma_3_hook(folder: str) -> bool:
    """Whether SAELens infers a layer and a hook from ``folder`` (``layer_<L>`` and one of the hook words)."""
    return _LAYER.search(folder) is not None and any(word in folder for word, _ in _GEMMA_3_HOOKS)


def _looks_gemma_3(directory: Path) -> bool:
    """A GemmaScope-2 folder by its config (``config.json`` with ``architecture: jump_relu``) or, without one, by
    its name (:func:`_names_gemma_3_hook`). Raises only as :func:`.files.read_json_object` does."""
    cfg = directory / GEMMA_3_CONFIG
    if cfg.is_file():
        return read_json_object(cfg).get("architecture") == "jump_relu"
    return _names_gemma_3_hook(_gemma_3_folder(directory, None))


def has_gemma_3_files(directory: Path) -> bool:
    """Format detection (:mod:`.registry`): ``params.safetensors`` (no other format reads that name) and either a
    ``config.json`` saying ``"architecture": "jump_relu"`` or none and a folder name SAELens infers a hook from.

    Raises:
        CheckpointError: ``params.safetensors`` is there and ``config.json`` beside it is not a JSON object.

    Source: SAELens ``sae_lens/loading/pretrained_sae_loaders.py`` (``get_gemma_3_config_from_hf``).
    """
    return (directory / GEMMA_3_WEIGHTS).is_file() and _looks_gemma_3(directory)


def _gemma_3_hub_weights(directory: Path) -> list[str]:
    """``params.safetensors`` of a folder that is GemmaScope-2's by its fetched config or its name (a hub load's
    second download); nothing for another format's folder (a config.json that is no JSON object is left to its
    reader to refuse)."""
    try:
        return [GEMMA_3_WEIGHTS] if _looks_gemma_3(directory) else []
    except LorsaError:
        return []


def _infer_raw_cfg(repo_id: str, folder: str, where: Path) -> dict[str, Any]:
    """SAELens ``_infer_gemma_3_raw_cfg_dict``: the ``config.json`` a folder without one stands for.

    Raises:
        CheckpointError: no ``layer_<L>`` or no hook word in ``folder`` (SAELens: ``ValueError``).
    """
    layer_match = _LAYER.search(folder)
    require(layer_match is not None, where, f"no config.json, and the folder name {folder!r} has no 'layer_<L>' to "
                                            "infer one from (SAELens _infer_gemma_3_raw_cfg_dict)")
    assert layer_match is not None
    layer = int(layer_match.group(1))
    out_point: str | None
    if "transcoder" in folder or "clt" in folder:
        in_point = f"model.layers.{layer}.pre_feedforward_layernorm.output"
        out_point = f"model.layers.{layer}.post_feedforward_layernorm.output"
    elif "resid_post" in folder:
        in_point, out_point = f"model.layers.{layer}.output", None
    elif "attn_out" in folder:
        in_point, out_point = f"model.layers.{layer}.self_attn.o_proj.input", None
    elif "mlp_out" in folder:
        in_point, out_point = f"model.layers.{layer}.post_feedforward_layernorm.output", None
    else:
        refuse(where, f"no config.json, and the folder name {folder!r} names no hook (resid_post, attn_out, mlp_out, "
                      "transcoder) to infer one from (SAELens _infer_gemma_3_raw_cfg_dict)")
    cfg: dict[str, Any] = {"architecture": "jump_relu", "model_name": repo_id.replace("gemma-scope-2", "gemma-3"),
                           "hf_hook_point_in": in_point}
    if "transcoder" in folder or "clt" in folder:
        cfg["affine_connection"] = "affine" in folder
    if out_point is not None:
        cfg["hf_hook_point_out"] = out_point
    return cfg


def gemma_3_cfg_dict(directory: Path, *, folder: str | None = None, repo_id: str | None = None,
                     config_overrides: dict[str, Any] | None = None) -> tuple[dict[str, Any], Path]:
    """The SAELens config dict of a GemmaScope-2 folder, as SAELens ``get_gemma_3_config_from_hf`` builds it
    (before ``handle_config_defaulting``), and the file it was read from (``config.json``, or ``params.safetensors``
    when inferred).

    Args:
        directory: the folder (``params.safetensors``, optional ``config.json``).
        folder: SAELens's ``folder_name`` (the release's ``path``); default the directory's last two parts.
        repo_id: the repo (a model name is inferred from it without ``config.json``); default the name of the folder
            above those two parts.
        config_overrides: keys merged over the result (SAELens ``cfg_overrides``).

    Raises:
        UnsupportedArchitectureError: a CLT folder (``clt`` in the name); an ``architecture`` other than
            ``jump_relu``.
        CheckpointError: no layer or hook in the folder name; ``config.json`` not a JSON object, without a string
            ``model_name``, or an ``affine_connection`` that is not true/false/0/1 (SAELens reads a string, even
            ``"false"``, as true); ``params.safetensors`` missing,
            unreadable, or without a 2-D ``w_enc`` (a transcoder: without ``w_dec``).

    Source: SAELens ``sae_lens/loading/pretrained_sae_loaders.py`` (``_infer_gemma_3_raw_cfg_dict``,
    ``get_gemma_3_config_from_hf``).
    """
    name = _gemma_3_folder(directory, folder)
    weights = directory / GEMMA_3_WEIGHTS
    if "clt" in name:
        raise UnsupportedArchitectureError(f"{directory}: {name!r} is a {_CLT_REFUSAL}")
    cfg_path = directory / GEMMA_3_CONFIG
    if cfg_path.is_file():
        raw, source = read_json_object(cfg_path), cfg_path
    else:
        source = weights
        # the repo's name (owner/name, or a local directory laid out as it: its last part), as SAELens's hub repo id
        repo = repo_id if repo_id is not None else directory.parent.parent.name
        if Path(repo).is_absolute() or repo.count("/") > 1:
            repo = Path(repo).name
        raw = _infer_raw_cfg(repo, name, source)
    if raw.get("architecture") != "jump_relu":
        raise UnsupportedArchitectureError(f"{source}: key 'architecture' is {raw.get('architecture')!r}; a "
                                           "GemmaScope-2 (gemma_3) folder is 'jump_relu'")
    layer_match = _LAYER.search(name)
    require(layer_match is not None, source, f"the folder name {name!r} has no 'layer_<L>' (SAELens reads the layer "
                                             "from it)")
    assert layer_match is not None
    layer = int(layer_match.group(1))
    hook = next((h for word, h in _GEMMA_3_HOOKS if word in name), None)
    require(hook is not None, source, f"the folder name {name!r} names no hook (resid_post, attn_out, mlp_out, "
                                      "transcoder; SAELens reads the hook from it)")
    transcoder = hook == "hook_mlp_in"
    shapes, _ = read_safetensors_header(weights)
    enc = shapes.get("w_enc")
    require(enc is not None and len(enc) == 2, weights, f"no 2-D tensor 'w_enc' (d_in, d_sae); found "
                                                        f"{ {k: list(v) for k, v in shapes.items()} }")
    assert enc is not None
    d_in, d_sae = (check_size(n, weights, f"w_enc.shape[{i}]") for i, n in enumerate(enc))
    model_name = raw.get("model_name")
    require(isinstance(model_name, str), source, f"key 'model_name' must be a string, got {model_name!r}")
    assert isinstance(model_name, str)
    if "google" not in model_name:
        model_name = "google/" + model_name
    model_name = model_name.replace("-v3", "-3")
    if "270m" in model_name:
        model_name = model_name.replace("-pt", "")
    architecture = "jumprelu"
    d_out = None
    if transcoder:
        affine = raw.get("affine_connection", False)
        # SAELens tests its truthiness: true/false and 0/1 read as there; anything else refused by name (the string
        # "false" is true there: a skip transcoder where the tensor is, a strict-load error where it is not)
        require(isinstance(affine, bool) or (type(affine) is int and affine in (0, 1)), source,
                f"key 'affine_connection' must be true or false (or 0 / 1), got {affine!r} (SAELens reads any truthy "
                "value as true, the string 'false' too: write the JSON boolean)")
        architecture = "jumprelu_skip_transcoder" if affine else "jumprelu_transcoder"
        # SAELens names the input hook_mlp_in (the residual before the norm) whatever the tensor; hf_hook_point_in says
        # which it was trained on: the MLP's input (pre_feedforward_layernorm.output) is what this package reads
        # (hook_sites.hook_record); another, or none, would be read off the wrong tensor
        want = f"model.layers.{layer}.pre_feedforward_layernorm.output"
        require(raw.get("hf_hook_point_in") == want, source,
                f"key 'hf_hook_point_in' is {raw.get('hf_hook_point_in')!r}; a GemmaScope-2 transcoder of layer "
                f"{layer} is read at {want!r} (the MLP's input); another tensor, or none named, cannot be placed")
        dec = shapes.get("w_dec")
        require(dec is not None and len(dec) >= 1, weights, "no tensor 'w_dec' (d_sae, d_out)")
        assert dec is not None
        d_out = dec[-1]
    cfg: dict[str, Any] = {
        "architecture": architecture, "d_in": d_in, "d_sae": d_sae, "dtype": "float32", "model_name": model_name,
        "hook_name": f"blocks.{layer}.{hook}", "hook_head_index": None, "finetuning_scaling_factor": False,
        "sae_lens_training_version": None, "prepend_bos": True, "dataset_path": "monology/pile-uncopyrighted",
        "context_size": 1024, "apply_b_dec_to_input": False, "normalize_activations": "none",
        "reshape_activations": "none", "hf_hook_name": raw.get("hf_hook_point_in"),
    }
    if transcoder:
        cfg["hook_name_out"] = f"blocks.{layer}.hook_mlp_out"
        cfg["hf_hook_name_out"] = raw.get("hf_hook_point_out")
    if d_out is not None:
        cfg["d_out"] = d_out
    cfg.update(config_overrides or {})
    return cfg, source


def parse_gemma_3_config(directory: Path, *, folder: str | None = None, repo_id: str | None = None,
                         norm_scaling_factor: float | None = None, d_model: int | None = None, adapter: Any = None,
                         config_overrides: dict[str, Any] | None = None) -> Parsed:
    """A GemmaScope-2 folder -> ``Parsed``: SAELens's config dict (:func:`gemma_3_cfg_dict`) through our SAELens
    reader (:func:`.saelens.parse_raw_config`: the same mapping, hook-site records and checks as a ``cfg.json``);
    ``cfg.extra["saelens"]`` also records ``model_name``, ``hf_hook_name`` (/ ``_out``), ``conversion_func`` and
    ``folder``.

    Raises:
        UnsupportedArchitectureError, CheckpointError: as :func:`gemma_3_cfg_dict` and
            :func:`.saelens.parse_raw_config`.
        ConfigMismatchError: ``d_model`` given and different from ``d_in``.

    Source: SAELens ``sae_lens/loading/pretrained_sae_loaders.py`` (``get_gemma_3_config_from_hf``),
    ``sae_lens/loading/pretrained_sae_loaders.py`` (``handle_config_defaulting``).
    """
    raw, source = gemma_3_cfg_dict(directory, folder=folder, repo_id=repo_id, config_overrides=config_overrides)
    parsed: Parsed = saelens.parse_raw_config(
        directory, saelens._pre6_config(raw), source, norm_scaling_factor=norm_scaling_factor, d_model=d_model,
        adapter=adapter, weights_file=GEMMA_3_WEIGHTS)
    parsed.config.extra["saelens"].update(
        conversion_func="gemma_3", folder=_gemma_3_folder(directory, folder), model_name=raw.get("model_name"),
        hf_hook_name=raw.get("hf_hook_name"), **({"hf_hook_name_out": raw.get("hf_hook_name_out")}
                                                 if "hook_name_out" in raw else {}))
    parsed.settings["source"] = (f"{GEMMA_3_WEIGHTS} + {source.name} (gemma_3 converter: architecture "
                                 f"{raw['architecture']!r}, d_in={raw['d_in']}, d_sae={raw['d_sae']}"
                                 + (f", d_out={raw['d_out']})" if "d_out" in raw else ")"))
    return parsed


def load_gemma_3_weights(directory: Path, parsed: Parsed) -> dict[str, torch.Tensor]:
    """``params.safetensors`` as SAELens ``gemma_3_sae_huggingface_loader`` renames it (``w_enc`` -> ``W_enc``, …,
    ``affine_skip_connection (d_in, d_out)`` -> ``W_skip`` its transpose), then our SAELens conversions
    (:func:`.saelens.convert_state`: ``threshold`` -> ``activation.threshold``, clamped at 0, exact).

    Raises:
        CheckpointError: the file missing or unreadable; a missing tensor; a tensor SAELens does not read (it would
            ignore it; refused here, as our other readers of these files do); a non-2-D ``affine_skip_connection``;
            non-floating or non-finite values.

    Source: SAELens ``sae_lens/loading/pretrained_sae_loaders.py`` (``gemma_3_sae_huggingface_loader``).
    """
    path = directory / GEMMA_3_WEIGHTS
    read_safetensors_header(path)
    raw = load_safetensors(path)
    check_file_tensors(path, raw)
    for key in GEMMA_3_TENSORS:
        require(key in raw, path, f"missing tensor {key!r} (GemmaScope-2 params: {sorted(GEMMA_3_TENSORS)}"
                                  f" [+ {GEMMA_3_SKIP!r}])")
    extra = sorted(set(raw) - set(GEMMA_3_TENSORS) - {GEMMA_3_SKIP})
    require(not extra, path, f"unexpected tensors {extra} (GemmaScope-2 params hold {sorted(GEMMA_3_TENSORS)} "
                             f"[+ {GEMMA_3_SKIP!r}])")
    state = {ours: raw[key] for key, ours in GEMMA_3_TENSORS.items()}
    if GEMMA_3_SKIP in raw:
        skip = raw[GEMMA_3_SKIP]
        require(skip.dim() == 2, path, f"tensor {GEMMA_3_SKIP!r} must be 2-D (d_in, d_out), got "
                                       f"{tuple(skip.shape)}")
        state["W_skip"] = skip.T.contiguous()
    return saelens.convert_state(state, path, parsed)


#: the reader of SAELens's ``gemma_3`` converter (format ``"saelens"``'s second reader, :mod:`.registry`)
GEMMA_3_READER = Reader("saelens_gemma_3", (GEMMA_3_CONFIG, GEMMA_3_WEIGHTS), parse_gemma_3_config,
                        load_gemma_3_weights, saelens.build, hub_weights=_gemma_3_hub_weights)
