"""circuit-tracer transcoder sets and cross-layer transcoders -> our modules.

Read from ``decoderesearch/circuit-tracer``:

``config.yaml`` (optional; read with ``yaml.safe_load``)
    ``model_kind`` (``"transcoder_set"`` | ``"cross_layer_transcoder"``), ``model_name``,
    ``feature_input_hook`` / ``feature_output_hook`` (TransformerLens names inside a block, e.g.
    ``mlp.hook_in`` / ``mlp.hook_out``, ``hook_resid_mid`` / ``hook_mlp_out``), ``scan``,
    ``transcoders`` (per-layer file list; entry ``i`` is layer ``i``, circuit-tracer's ``resolve_transcoder_paths``:
    an entry named ``layer_<j>.safetensors`` with ``j != i`` is refused), optional ``activation`` / ``k``.
Per-layer transcoders, ``layer_{i}.safetensors`` (``transcoder/single_layer_transcoder.py``)
    ``W_enc (d_sae, d_model)`` (``F.linear(x, W_enc, b_enc)``: the transpose of ours),
    ``W_dec (d_sae, d_model)``, ``b_enc (d_sae)``, ``b_dec (d_model)``, optional ``W_skip (d_model, d_model)``
    applied as ``x @ W_skip.T`` (our layout), optional ``activation_function.threshold (d_sae)`` (JumpReLU
    ``x·1[x > θ]``; the key ``SingleLayerTranscoder.to_safetensors`` writes and ``load_relu_transcoder``
    reads; a bare ``threshold``, which nnsight-lorsa wrote before 0.1.1, is read too). No key or config
    entry expresses TopK: ``load_relu_transcoder`` builds ReLU or JumpReLU only.
Cross-layer transcoders (``transcoder/cross_layer_transcoder.py``, ``to_safetensors`` / ``_load_state_dict``)
    ``W_enc_{i}.safetensors``: ``W_enc_{i} (d_sae, d_model)`` (ours ``W_enc[i]ᵀ``), ``b_enc_{i} (d_sae)``,
    ``b_dec_{i} (d_model)``, optional ``threshold_{i} (d_sae)`` and ``W_skip_{i} (d_model, d_model)``
    applied as ``x @ W_skip_{i}`` (ours ``W_skip[i] = W_skip_{i}ᵀ``; circuit-tracer 0.5.0 neither writes
    nor reads ``W_skip_{i}``, so :func:`save_circuit_tracer_clt` refuses skip CLTs); ``W_dec_{i}.safetensors``:
    ``W_dec_{i} (d_sae, n_layers − i, d_model)`` (our layout). ``n_layers`` = number of ``W_enc_*`` files.

GemmaScope-2 (Google's Gemma-3 dictionaries; circuit-tracer reads them when ``config.yaml``'s ``repo_id`` holds
``gemma-scope-2`` and it lists ``transcoders``: ``utils/hf_utils.py load_transcoders``). We detect them by their
tensor names (lower-case ``w_enc``), whatever the repo is called; one layout per set (a mix is refused):

Per-layer transcoders (``load_gemma_scope_2_transcoder``), the files ``transcoders`` lists (or ``layer_{i}``)
    ``w_enc (d_in, d_sae)`` (ours ``W_enc`` as it is; theirs ``w_enc.T``), ``w_dec (d_sae, d_out)``, ``b_enc (d_sae)``,
    ``b_dec (d_out)``, ``threshold (d_sae)`` (required: JumpReLU ``x·1[x > θ]``), optional
    ``affine_skip_connection (d_in, d_out)`` applied as ``x @ affine_skip_connection`` (ours
    ``W_skip = affine_skip_connectionᵀ``, ``(d_out, d_in)``).
Cross-layer transcoders (``load_gemma_scope_2_clt``), one file per layer as above except
    ``w_dec (d_sae, n_layers, d_model)``: layer ``i`` keeps ``w_dec[:, i:]`` (ours ``W_dec_{i}``; the entries for
    earlier layers are not read, as circuit-tracer slices them away); ``affine_skip_connection`` stacked, applied as
    ``x_l @ affine_skip_connection_l`` (ours ``W_skip[l]`` its transpose). Every listed layer is read: circuit-tracer
    0.5.0 stacks ``range(max(paths.keys()))`` layers, one fewer than it lists, and then refuses its own ``W_dec``
    shapes (``tests/fixtures/peers/circuit_tracer/gemma_scope_2/limits.json``; docs/formats.md, "GemmaScope-2").

Never reads their ``.npz`` (Gemma Scope) files or anything pickled.

Two readers (:class:`~.reader.Reader`), :data:`TRANSCODERS_READER` and :data:`CLT_READER`, each in
three steps (``parse_*_config`` from ``config.yaml`` and the safetensors headers, ``load_*_weights``,
``build_*``); :func:`choose_reader` picks one by ``model_kind`` (or, without one, by the files).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .._atomic import Staging, atomic_directory
from ..errors import ArgumentError, LorsaError, UnsupportedArchitectureError
from ..modules.clt import CLTConfig, CrossLayerTranscoder
from ..modules.transcoder import SkipTranscoder, Transcoder, TranscoderConfig
from .files import load_safetensors, read_safetensors_header, read_yaml_object
from .hook_sites import MLP_INPUT_HOOKS, MLP_OUTPUT_HOOKS
from .reader import Parsed, Reader, read
from .sparse_coder_format import kind_of
from .validate import (
    TensorSpec,
    build_module,
    check_d_model,
    check_declared_tensors,
    check_file_tensors,
    check_numbered,
    check_size,
    layer_of_name,
    looks_like_layer_name,
    require,
)

CONFIG_FILE = "config.yaml"
#: the JumpReLU threshold's key in a per-layer file (circuit-tracer's ``JumpReLU`` module is the
#: transcoder's ``activation_function``); :data:`LEGACY_THRESHOLD_KEY` is read too
THRESHOLD_KEY = "activation_function.threshold"
LEGACY_THRESHOLD_KEY = "threshold"
HUB_FILES = (CONFIG_FILE,)  # and the weights of hub_weight_files
KINDS = ("transcoder_set", "cross_layer_transcoder")
#: a per-layer file (their names and layout); ``W_skip`` and the threshold (either key) when present
LAYER_TENSORS = TensorSpec({"W_enc": ("d_sae", "d_in"), "W_dec": ("d_sae", "d_out"), "b_enc": ("d_sae",),
                            "b_dec": ("d_out",)},
                           {"W_skip": ("d_out", "d_in"), THRESHOLD_KEY: ("d_sae",), LEGACY_THRESHOLD_KEY: ("d_sae",)})
#: a CLT's ``W_enc_{i}.safetensors`` (threshold / skip when layer 0 has them) and ``W_dec_{i}.safetensors``
CLT_ENC_TENSORS = TensorSpec({"W_enc_{i}": ("d_sae", "d_model"), "b_enc_{i}": ("d_sae",), "b_dec_{i}": ("d_model",)},
                             {"threshold_{i}": ("d_sae",), "W_skip_{i}": ("d_model", "d_model")})
CLT_DEC_TENSORS = TensorSpec({"W_dec_{i}": ("d_sae", "n_later", "d_model")})
#: a GemmaScope-2 per-layer file (``load_gemma_scope_2_transcoder``'s keys; its ``threshold`` is required there)
GS2_ENC_KEY = "w_enc"
GS2_SKIP_KEY = "affine_skip_connection"
GS2_LAYER_TENSORS = TensorSpec({"w_enc": ("d_in", "d_sae"), "w_dec": ("d_sae", "d_out"), "b_enc": ("d_sae",),
                                "b_dec": ("d_out",), LEGACY_THRESHOLD_KEY: ("d_sae",)},
                               {GS2_SKIP_KEY: ("d_in", "d_out")})
#: a GemmaScope-2 CLT layer file (``load_gemma_scope_2_clt``): ``w_dec`` spans every layer
GS2_CLT_TENSORS = TensorSpec({"w_enc": ("d_model", "d_sae"), "w_dec": ("d_sae", "n_layers", "d_model"),
                              "b_enc": ("d_sae",), "b_dec": ("d_model",), LEGACY_THRESHOLD_KEY: ("d_sae",)},
                             {GS2_SKIP_KEY: ("d_model", "d_model")})

__all__ = ["CLT_READER", "TRANSCODERS_READER", "CircuitTracerTranscoders", "choose_reader", "load_circuit_tracer_clt",
           "load_circuit_tracer_transcoders", "save_circuit_tracer_clt", "save_circuit_tracer_transcoders"]


@dataclass
class CircuitTracerTranscoders:
    """A per-layer transcoder set: ``transcoders[layer]`` and the hooks/scan of ``config.yaml``."""

    transcoders: dict[int, Transcoder]
    feature_input_hook: str | None = None
    feature_output_hook: str | None = None
    scan: Any = None
    config: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, layer: int) -> Transcoder:
        return self.transcoders[layer]

    def __len__(self) -> int:
        return len(self.transcoders)


def _numbered(path: Path, pattern: str) -> dict[int, Path]:
    rx = re.compile(pattern)
    if pattern.startswith("layer_"):
        odd = sorted(p.name for p in path.iterdir() if looks_like_layer_name(p.name, ".safetensors")
                     and p.name.endswith(".safetensors") and not rx.fullmatch(p.name))
        require(not odd, path, f"files {odd} are not named layer_<digits>.safetensors (ASCII digits only); "
                               "rename or remove them")
    found = {int(m.group(1)): p for p in path.iterdir() if (m := rx.fullmatch(p.name))}
    check_numbered(found, path, f"files {pattern!r} must be numbered")
    return found


def _hooks(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: cfg.get(k) for k in ("model_kind", "model_name", "feature_input_hook", "feature_output_hook", "scan")}


def _model_kind(directory: Path, expected: str) -> dict[str, Any]:
    config_path = directory / CONFIG_FILE
    cfg = read_yaml_object(config_path)
    kind = cfg.get("model_kind", expected)
    require(kind == expected, config_path, f"key 'model_kind' is {kind!r}, expected {expected!r}",
            error=UnsupportedArchitectureError)
    return cfg


def choose_reader(directory: Path) -> Reader:
    """:data:`CLT_READER` or :data:`TRANSCODERS_READER`, by ``model_kind`` in ``config.yaml`` (or,
    without one, by whether ``W_enc_0.safetensors`` exists).

    Raises:
        CheckpointError: unreadable ``config.yaml``.
        UnsupportedArchitectureError: another ``model_kind`` (naming ``config.yaml``).
    """
    kind = read_yaml_object(directory / CONFIG_FILE).get("model_kind")
    if kind is None:
        kind = "cross_layer_transcoder" if (directory / "W_enc_0.safetensors").is_file() else "transcoder_set"
    require(isinstance(kind, str) and kind in KINDS, directory / CONFIG_FILE,
            f"key 'model_kind' is {kind!r}; supported: 'transcoder_set', 'cross_layer_transcoder'",
            error=UnsupportedArchitectureError)
    return CLT_READER if kind == "cross_layer_transcoder" else TRANSCODERS_READER


def hub_weight_files(directory: Path) -> list[str]:
    """What a hub load fetches once ``config.yaml`` (if any) is in ``directory``: the files its ``transcoders`` list
    names (where the reader looks for them, inside ``directory``), and every ``layer_<i>`` / ``W_enc_<i>`` /
    ``W_dec_<i>`` ``.safetensors`` with 1 to 6 ASCII digits, spelled digit by digit (``fnmatch``'s ``*`` spans
    ``/``: ``layer_*.safetensors`` would also fetch a set's ``layer_1/model.safetensors`` and any deeper file so
    named). A YAML that does not parse names nothing: the reader then refuses it by name."""
    import glob

    names = [f"{stem}_{'[0-9]' * n}.safetensors" for stem in ("layer", "W_enc", "W_dec") for n in range(1, 7)]
    try:
        listed = read_yaml_object(directory / CONFIG_FILE).get("transcoders")
    except LorsaError:
        listed = None
    for i, entry in enumerate(listed if isinstance(listed, list) else []):
        ref = entry.get("filepath") if isinstance(entry, dict) else entry
        if not isinstance(ref, str):
            continue
        try:  # where the reader will look (_listed_path); a file outside this folder is not fetched (then refused)
            where = _listed_path(directory, ref, directory / CONFIG_FILE, i)
            names.append(glob.escape(where.relative_to(directory).as_posix()))
        except (LorsaError, ValueError):
            continue
    return names


# --------------------------------------------------------------------------- per-layer transcoders
def _snapshot_of(directory: Path) -> tuple[Path, str] | None:
    """``(root, "owner/name")`` of the ``huggingface_hub`` cache snapshot ``directory`` is in
    (``models--owner--name/snapshots/<commit>[/…]``), or None."""
    for root in (directory, *directory.parents):
        parent = root.parent
        if parent.name == "snapshots" and parent.parent.name.startswith("models--"):
            return root, parent.parent.name[len("models--"):].replace("--", "/", 1)
    return None


def _listed_path(directory: Path, ref: str, config_path: Path, i: int) -> Path:
    """Where entry ``i`` of ``config.yaml``'s ``transcoders`` list is: an ``hf://owner/name/<path>`` URI at
    ``<path>`` in that repo — the snapshot's root when ``directory`` is in one of that repo (another repo's is
    refused: circuit-tracer downloads it from there), else ``directory`` (a local copy keeps the repo's layout); a
    relative path under ``directory``; an absolute one as it is (circuit-tracer ``resolve_transcoder_paths`` opens
    local paths as given). (Only the file's name was kept until 2026-11-29: a ``sub/layer_0.safetensors`` entry
    read ``layer_0.safetensors`` beside the config.)

    Raises:
        CheckpointError: an ``hf://`` URI without a path in the repo, or of another repo than the snapshot's.
    """
    target = ref.split("?")[0]
    if target.startswith("hf://"):
        parts = target[len("hf://"):].split("/", 2)
        require(len(parts) == 3 and all(parts), config_path,
                f"key 'transcoders'[{i}] is {ref!r}; an hf:// entry is hf://<owner>/<name>/<path in the repo>")
        repo, inner = f"{parts[0]}/{parts[1]}", parts[2]
        snapshot = _snapshot_of(directory)
        if snapshot is None:
            return directory / inner
        root, here = snapshot
        require(here.lower() == repo.lower(), config_path,
                f"key 'transcoders'[{i}] is {ref!r}, a file of the repo {repo!r}, not of {here!r} being loaded "
                "(circuit-tracer downloads it from there): load that repo")
        return root / inner
    return Path(target) if Path(target).is_absolute() else directory / target


def _layer_files(path: Path, cfg: dict[str, Any], config_path: Path) -> dict[int, Path]:
    listed = cfg.get("transcoders")
    require(listed is None or isinstance(listed, list), config_path,
            f"key 'transcoders' must be a list of files, got {listed!r}")
    if isinstance(listed, list) and listed:
        files: dict[int, Path] = {}
        for i, entry in enumerate(listed):
            if isinstance(entry, dict):
                layer, ref = entry.get("layer"), entry.get("filepath")
            else:
                layer, ref = None, entry
            require(isinstance(ref, str), config_path, f"key 'transcoders'[{i}] has no file path")
            name = str(ref).split("?")[0].rsplit("/", 1)[-1]
            listed_path = _listed_path(path, str(ref), config_path, i)
            if layer is None:
                require(not looks_like_layer_name(name, ".safetensors") or layer_of_name(name, ".safetensors")
                        is not None, config_path, f"key 'transcoders'[{i}] is {ref!r}; a layer file is named "
                                                  "layer_<digits>.safetensors (ASCII digits only)")
                found = layer_of_name(name, ".safetensors")
                # circuit-tracer (resolve_transcoder_paths) gives entry i layer i whatever the file is named
                require(found is None or found == i, config_path,
                        f"key 'transcoders'[{i}] is {ref!r}: circuit-tracer loads entry {i} as layer {i}, but the "
                        f"file is named for layer {found}; list the files in layer order (or give "
                        "{'layer': L, 'filepath': ...} entries)")
                layer = i
            require(name.endswith(".safetensors"), config_path,
                    f"key 'transcoders'[{i}] is {ref!r}; only .safetensors files are read")
            require(isinstance(layer, int) and not isinstance(layer, bool) and layer >= 0, config_path,
                    f"key 'transcoders'[{i}] has layer {layer!r}; expected an int >= 0")
            require(layer not in files, config_path, f"key 'transcoders' lists layer {layer} twice")
            files[layer] = listed_path
        return files
    files = _numbered(path, r"layer_([0-9]+)\.safetensors")
    require(files, path, f"no layer_<i>.safetensors files (and no 'transcoders' in {CONFIG_FILE})")
    return files


def _layer_config(file: Path, layer: int, act_name: str, cfg: dict[str, Any],
                  d_model: int | None) -> tuple[TranscoderConfig, dict[str, tuple[int, ...]], str]:
    """One layer file's :class:`TranscoderConfig`, expected shapes and source note, from its header (circuit-tracer's
    keys, or GemmaScope-2's: :func:`_gs2_layer_config`)."""
    shapes, _ = read_safetensors_header(file)
    if _is_gs2(file, shapes):
        return _gs2_layer_config(file, shapes, layer, cfg, d_model)
    require(len(shapes.get("W_enc", ())) == 2, file, f"missing tensor 'W_enc' (d_sae, d_model), found {sorted(shapes)}")
    d_sae, d_in = (check_size(n, file, f"W_enc.shape[{i}]") for i, n in enumerate(shapes["W_enc"]))
    check_d_model(d_in, d_model, file, "W_enc.shape[1]")
    d_out = shapes["b_dec"][0] if len(shapes.get("b_dec", ())) == 1 else d_in
    threshold_keys = [k for k in (THRESHOLD_KEY, LEGACY_THRESHOLD_KEY) if k in shapes]
    require(len(threshold_keys) <= 1, file, f"both {THRESHOLD_KEY!r} and {LEGACY_THRESHOLD_KEY!r}; a JumpReLU "
                                            "transcoder has one threshold tensor")
    activation = "jumprelu" if threshold_keys else act_name
    require(activation != "jumprelu" or threshold_keys, file,
            f"{CONFIG_FILE} says 'jump_relu' but the file has no {THRESHOLD_KEY!r} tensor")
    src = f"W_enc of {file.name} (d_sae={d_sae}, d_model={d_in})"
    expected = check_declared_tensors(file, shapes, LAYER_TENSORS, {"d_sae": d_sae, "d_in": d_in, "d_out": d_out},
                                      src, with_=[k for k in ("W_skip", *threshold_keys) if k in shapes])
    tcfg = TranscoderConfig(d_in=d_in, d_sae=d_sae, d_out=d_out, activation=activation,
                            activation_params={},
                            layer=layer, extra={"circuit_tracer": {**_hooks(cfg), "file": file.name}})
    return tcfg, expected, src


def _is_gs2(file: Path, shapes: dict[str, tuple[int, ...]]) -> bool:
    """Whether a layer file holds GemmaScope-2's keys (lower-case ``w_enc``; circuit-tracer's are ``W_enc``).

    Raises:
        CheckpointError: a file with both (one layout per file).
    """
    ours = sorted(k for k in ("W_enc", "W_dec", "W_skip", THRESHOLD_KEY) if k in shapes)
    theirs = sorted(k for k in (GS2_ENC_KEY, "w_dec", GS2_SKIP_KEY) if k in shapes)
    require(not (ours and theirs), file, f"mixes circuit-tracer's keys {ours} and GemmaScope-2's {theirs}; a layer "
                                         "file holds one layout (W_enc … or w_enc …)")
    return bool(theirs)


def _gs2_layer_config(file: Path, shapes: dict[str, tuple[int, ...]], layer: int, cfg: dict[str, Any],
                      d_model: int | None) -> tuple[TranscoderConfig, dict[str, tuple[int, ...]], str]:
    """A GemmaScope-2 layer file's :class:`TranscoderConfig` (always JumpReLU: circuit-tracer's
    ``load_gemma_scope_2_transcoder`` reads ``threshold`` unconditionally), expected shapes and source note.

    Raises:
        CheckpointError: no 2-D ``w_enc``; a 3-D ``w_dec`` (a CLT's layer file, in a ``transcoder_set``); a missing
            or unexpected tensor or a wrong shape (naming file and key).
    """
    require(len(shapes.get(GS2_ENC_KEY, ())) == 2, file,
            f"missing tensor 'w_enc' (d_in, d_sae), found {sorted(shapes)}")
    d_in, d_sae = (check_size(n, file, f"w_enc.shape[{i}]") for i, n in enumerate(shapes[GS2_ENC_KEY]))
    check_d_model(d_in, d_model, file, "w_enc.shape[0]")
    dec = shapes.get("w_dec", ())
    require(len(dec) != 3, file, f"w_dec has shape {dec} (d_sae, n_layers, d_out): a GemmaScope-2 cross-layer "
                                 f"transcoder's layer file; its {CONFIG_FILE} needs model_kind: cross_layer_transcoder")
    # circuit-tracer sizes the output from b_dec (load_gemma_scope_2_transcoder: d_model = b_dec.shape[0])
    d_out = check_size(shapes["b_dec"][0], file, "b_dec.shape[0]") if len(shapes.get("b_dec", ())) == 1 else d_in
    src = f"w_enc / b_dec of {file.name} (d_in={d_in}, d_sae={d_sae}, d_out={d_out}; GemmaScope-2 layout)"
    expected = check_declared_tensors(file, shapes, GS2_LAYER_TENSORS, {"d_sae": d_sae, "d_in": d_in, "d_out": d_out},
                                      src, with_=[GS2_SKIP_KEY] if GS2_SKIP_KEY in shapes else [])
    tcfg = TranscoderConfig(d_in=d_in, d_sae=d_sae, d_out=d_out, activation="jumprelu", activation_params={},
                            layer=layer, extra={"circuit_tracer": {**_hooks(cfg), "file": file.name,
                                                                   "layout": "gemma_scope_2"}})
    return tcfg, expected, src


def parse_transcoders_config(directory: Path, *, d_model: int | None = None) -> Parsed:
    """``config.yaml`` and every layer file's header -> ``Parsed(directory, {layer: TranscoderConfig}, …)``
    (circuit-tracer's keys or GemmaScope-2's, one layout for every layer).

    Raises:
        CheckpointError: bad YAML, a missing file or tensor, a wrong shape (naming file and key),
            layers that do not cover 0..n-1, layers of both layouts.
        UnsupportedArchitectureError: another ``model_kind``; an ``activation`` other than relu / jump_relu
            (``topk`` included: circuit-tracer reads no such key and runs the file as ReLU).
        ConfigMismatchError: ``d_model`` given and different from the files'.
    """
    config_path = directory / CONFIG_FILE
    cfg = _model_kind(directory, "transcoder_set")
    act_name = cfg.get("activation") or "relu"
    act_name = {"jump_relu": "jumprelu"}.get(act_name, act_name) if isinstance(act_name, str) else act_name
    # circuit-tracer 0.5.0 reads no 'activation' key: it runs ReLU, JumpReLU where a layer file holds a threshold
    # (utils/hf_utils.py, transcoder/single_layer_transcoder.py load_relu_transcoder). A TopK there ran as TopK
    # here and as ReLU there until 2026-11-29 (L0 2 against 12-18)
    require(act_name != "topk", config_path,
            "key 'activation' is 'topk', which circuit-tracer (0.5.0) does not read: it runs these files as ReLU "
            "(JumpReLU with a threshold tensor), so the file means two things; a TopK transcoder travels in this "
            "package's format (save(..., format='nnsight_lorsa')) or SAELens's", error=UnsupportedArchitectureError)
    require(act_name in ("relu", "jumprelu"), config_path,
            f"key 'activation' is {act_name!r}; supported: relu, jump_relu", error=UnsupportedArchitectureError)
    layers: dict[int, Any] = {}
    for layer, file in sorted(_layer_files(directory, cfg, config_path).items()):
        layers[layer] = (file, *_layer_config(file, layer, act_name, cfg, d_model))
    check_numbered(layers, directory, "transcoders must cover layers")
    gs2 = sorted(layer for layer, entry in layers.items() if GS2_ENC_KEY in entry[2])
    require(not gs2 or len(gs2) == len(layers), directory,
            f"layers {gs2} are GemmaScope-2 files (w_enc …) and layers "
            f"{sorted(set(layers) - set(gs2))} circuit-tracer's (W_enc …); circuit-tracer reads a set with one loader")
    widths = {layer: (entry[1].d_in, entry[1].d_out) for layer, entry in layers.items()}
    require(len(set(widths.values())) <= 1, directory, "the layer files disagree on (d_model, d_out) (from W_enc / "
            "b_dec): " + ", ".join(f"{layers[k][0].name} {v}" for k, v in sorted(widths.items())))
    return Parsed(directory, {layer: entry[1] for layer, entry in layers.items()},
                  {"layers": layers, "yaml": cfg})


def load_transcoders_weights(directory: Path, parsed: Parsed) -> dict[int, dict[str, torch.Tensor]]:
    """Every ``layer_{i}.safetensors`` in our layout (``W_enc`` transposed; ``threshold`` ->
    ``activation.threshold``), by layer; a GemmaScope-2 file (``w_enc``) as :func:`_gs2_layer_state` maps it.

    Raises:
        CheckpointError: an unreadable file.
    """
    out: dict[int, dict[str, torch.Tensor]] = {}
    for layer, (file, tcfg, _, _) in parsed.settings["layers"].items():
        state = load_safetensors(file)
        check_file_tensors(file, state)
        if GS2_ENC_KEY in state:
            out[layer] = _gs2_layer_state(state)
            continue
        ours = {"W_enc": state["W_enc"].T, "b_enc": state["b_enc"], "W_dec": state["W_dec"],
                "b_dec": state["b_dec"]}
        if "W_skip" in state:
            ours["W_skip"] = state["W_skip"]
        if tcfg.activation == "jumprelu":
            ours["activation.threshold"] = state[THRESHOLD_KEY if THRESHOLD_KEY in state else LEGACY_THRESHOLD_KEY]
        out[layer] = ours
    return out


def _gs2_layer_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A GemmaScope-2 layer file in our layout, as circuit-tracer's ``load_gemma_scope_2_transcoder`` computes it:
    its ``W_enc = w_enc.T`` used as ``F.linear(x, W_enc)`` is ``x @ w_enc`` (ours ``W_enc = w_enc``); its
    ``W_skip = affine_skip_connection.T`` used as ``x @ W_skip.T`` is ``x @ affine_skip_connection`` (ours
    ``W_skip (d_out, d_in) = affine_skip_connectionᵀ``, used as ``x W_skipᵀ``)."""
    ours = {"W_enc": state[GS2_ENC_KEY], "W_dec": state["w_dec"], "b_enc": state["b_enc"], "b_dec": state["b_dec"],
            "activation.threshold": state[LEGACY_THRESHOLD_KEY]}
    if GS2_SKIP_KEY in state:
        ours["W_skip"] = state[GS2_SKIP_KEY].T
    return ours


def build_transcoders(parsed: Parsed, states: dict[int, dict[str, torch.Tensor]], *,
                      device: torch.device | str | None = None,
                      dtype: torch.dtype | None = None) -> CircuitTracerTranscoders:
    """One :class:`Transcoder` / :class:`SkipTranscoder` per layer, in a :class:`CircuitTracerTranscoders`.

    Raises:
        CheckpointError: non-floating or non-finite tensor (naming the layer file and key).
    """
    transcoders: dict[int, Transcoder] = {}
    for layer, (file, tcfg, _, src) in parsed.settings["layers"].items():
        ours = states[layer]
        cls: type[Transcoder] = SkipTranscoder if "W_skip" in ours else Transcoder
        transcoders[layer] = build_module(partial(cls, tcfg), ours, file, src, device=device,
                                          dtype=dtype)
    cfg = parsed.settings["yaml"]
    return CircuitTracerTranscoders(transcoders, cfg.get("feature_input_hook"), cfg.get("feature_output_hook"),
                                    cfg.get("scan"), cfg)


TRANSCODERS_READER = Reader("circuit_tracer_transcoders", HUB_FILES, parse_transcoders_config,
                            load_transcoders_weights, build_transcoders, hub_weight_files)


def load_circuit_tracer_transcoders(directory: str | os.PathLike[str], **kwargs: Any) -> CircuitTracerTranscoders:
    """Load a circuit-tracer per-layer transcoder set (``config.yaml`` + ``layer_{i}.safetensors``), or a
    GemmaScope-2 set (lower-case ``w_enc`` files ``config.yaml`` lists; detected by the tensor names).

    Source: circuit-tracer ``transcoder/single_layer_transcoder.py`` (``load_relu_transcoder``,
    ``load_gemma_scope_2_transcoder``; module docstring).
    ``kwargs``: ``d_model``, ``device``, ``dtype``, ``subfolder``, ``local_files_only``, ``revision``.

    Returns:
        ``transcoders[layer]``: ``W_enc (d_model, d_sae)`` (theirs transposed), ``W_dec (d_sae, d_out)``.

    Raises:
        CheckpointError: a missing file or tensor, a wrong shape (naming file and key), bad YAML.
        UnsupportedArchitectureError: an ``activation`` in ``config.yaml`` we cannot build.
        ConfigMismatchError: ``d_model`` given and different from the files'.
    """
    return read(TRANSCODERS_READER, directory, **kwargs)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- cross-layer transcoders
def parse_clt_config(directory: Path, *, d_model: int | None = None) -> Parsed:
    """``config.yaml`` and ``W_enc_0.safetensors``'s header -> ``Parsed(directory, CLTConfig, …)``; without
    ``W_enc_<i>`` files, the GemmaScope-2 layer files ``transcoders`` lists (or ``layer_<i>.safetensors``):
    :func:`_parse_gs2_clt`.

    Raises:
        CheckpointError: bad YAML, no ``W_enc_<i>`` files (or not numbered 0..n-1) nor GemmaScope-2 layer files, both
            kinds, no ``W_enc_0`` tensor.
        UnsupportedArchitectureError: another ``model_kind``.
        ConfigMismatchError: ``d_model`` given and different from the files'.
    """
    cfg = _model_kind(directory, "cross_layer_transcoder")
    enc_files = _numbered(directory, r"W_enc_([0-9]+)\.safetensors")
    listed = cfg.get("transcoders")
    if (isinstance(listed, list) and listed) or (not enc_files and (directory / "layer_0.safetensors").is_file()):
        require(not enc_files, directory / CONFIG_FILE,
                f"lists per-layer files under 'transcoders' (GemmaScope-2's CLT layout) and the folder holds "
                f"{sorted(p.name for p in enc_files.values())} (circuit-tracer's): one CLT layout per folder")
        return _parse_gs2_clt(directory, cfg, d_model)
    require(enc_files, directory, "no W_enc_<i>.safetensors files")
    n = len(enc_files)
    shapes0, _ = read_safetensors_header(enc_files[0])
    require(len(shapes0.get("W_enc_0", ())) == 2, enc_files[0],
            f"missing tensor 'W_enc_0' (d_sae, d_model), found {sorted(shapes0)}")
    d_sae, d = (check_size(k, enc_files[0], f"W_enc_0.shape[{i}]") for i, k in enumerate(shapes0["W_enc_0"]))
    check_d_model(d, d_model, enc_files[0], "W_enc_0.shape[1]")
    has_threshold, has_skip = "threshold_0" in shapes0, "W_skip_0" in shapes0
    ccfg = CLTConfig(d_in=d, d_sae=d_sae, n_layers=n, skip=has_skip,
                     activation="jumprelu" if has_threshold else "relu",
                     extra={"circuit_tracer": _hooks(cfg)})
    return Parsed(directory, ccfg, {
        "enc_files": enc_files, "source": f"W_enc_0 of {enc_files[0].name} (d_sae={d_sae}, d_model={d}, n_layers={n})"})


def _parse_gs2_clt(directory: Path, cfg: dict[str, Any], d_model: int | None) -> Parsed:
    """A GemmaScope-2 CLT (``load_gemma_scope_2_clt``): one layer file per entry of ``transcoders`` (entry ``i`` is
    layer ``i``, as :func:`_layer_files` reads a set), sizes from layer 0's header; always JumpReLU.

    Raises:
        CheckpointError: layers not 0..n-1, no 2-D ``w_enc`` in layer 0 (circuit-tracer's own keys there instead).
        ConfigMismatchError: ``d_model`` given and different from the files'.
    """
    config_path = directory / CONFIG_FILE
    files = _layer_files(directory, cfg, config_path)
    check_numbered(files, directory, "a GemmaScope-2 CLT's layer files must cover layers")
    shapes0, _ = read_safetensors_header(files[0])
    _is_gs2(files[0], shapes0)  # refuses a file mixing both layouts
    require(len(shapes0.get(GS2_ENC_KEY, ())) == 2, files[0],
            f"missing tensor 'w_enc' (d_model, d_sae) of a GemmaScope-2 CLT layer file, found {sorted(shapes0)} "
            f"(a circuit-tracer CLT is W_enc_<i>.safetensors + W_dec_<i>.safetensors)")
    d, d_sae = (check_size(k, files[0], f"w_enc.shape[{i}]") for i, k in enumerate(shapes0[GS2_ENC_KEY]))
    check_d_model(d, d_model, files[0], "w_enc.shape[0]")
    n = len(files)
    ccfg = CLTConfig(d_in=d, d_sae=d_sae, n_layers=n, skip=GS2_SKIP_KEY in shapes0, activation="jumprelu",
                     extra={"circuit_tracer": {**_hooks(cfg), "layout": "gemma_scope_2"}})
    return Parsed(directory, ccfg, {
        "gs2_files": files,
        "source": f"w_enc of {files[0].name} (d_model={d}, d_sae={d_sae}, n_layers={n}; GemmaScope-2 layout)"})


def _load_gs2_clt(parsed: Parsed) -> dict[str, torch.Tensor]:
    """The GemmaScope-2 layer files in our layout, as circuit-tracer's ``load_gemma_scope_2_clt`` computes them (all
    ``n`` layers: see the module docstring): ``W_enc[i] = w_enc_i`` (theirs ``w_enc_iᵀ`` in ``einsum("lbd,lfd")``),
    ``W_dec_{i} = w_dec_i[:, i:]``, ``activation.{i}.threshold = threshold_i``, ``W_skip[i] =
    affine_skip_connection_iᵀ`` (theirs used as ``x_i @ affine_skip_connection_i``; ours as ``x_i W_skip[i]ᵀ``).

    Raises:
        CheckpointError: a missing or unexpected tensor (a skip path in some layers only included), a wrong shape
            (naming file and key), a non-floating or non-finite tensor.
    """
    ccfg, src = parsed.config, parsed.settings["source"]
    n, d, d_sae = ccfg.n_layers, ccfg.d_in, ccfg.d_sae
    ours: dict[str, torch.Tensor] = {}
    W_enc, b_enc, b_dec, W_skip = [], [], [], []
    for i in range(n):
        file = parsed.settings["gs2_files"][i]
        shapes, _ = read_safetensors_header(file)
        check_declared_tensors(file, shapes, GS2_CLT_TENSORS, {"d_sae": d_sae, "d_model": d, "n_layers": n}, src,
                               with_=(GS2_SKIP_KEY,) * ccfg.skip)
        state = load_safetensors(file)
        check_file_tensors(file, state)
        W_enc.append(state[GS2_ENC_KEY])
        b_enc.append(state["b_enc"])
        b_dec.append(state["b_dec"])
        ours[f"activation.{i}.threshold"] = state[LEGACY_THRESHOLD_KEY]
        ours[f"W_dec_{i}"] = state["w_dec"][:, i:].contiguous()
        if ccfg.skip:
            W_skip.append(state[GS2_SKIP_KEY].T)
    ours["W_enc"] = torch.stack(W_enc)
    ours["b_enc"] = torch.stack(b_enc)
    ours["b_dec"] = torch.stack(b_dec)
    if ccfg.skip:
        ours["W_skip"] = torch.stack(W_skip)
    return ours


def load_clt_weights(directory: Path, parsed: Parsed) -> dict[str, torch.Tensor]:
    """Every ``W_enc_{i}`` / ``W_dec_{i}`` file, checked against ``W_enc_0``'s sizes and stacked in our layout (a
    GemmaScope-2 CLT: :func:`_load_gs2_clt`).

    Raises:
        CheckpointError: a missing file or tensor, a wrong shape (naming file and key).
    """
    if "gs2_files" in parsed.settings:
        return _load_gs2_clt(parsed)
    ccfg, src = parsed.config, parsed.settings["source"]
    n, d, d_sae = ccfg.n_layers, ccfg.d_in, ccfg.d_sae
    has_threshold, has_skip = ccfg.activation == "jumprelu", ccfg.skip
    ours: dict[str, torch.Tensor] = {}
    W_enc, b_enc, b_dec, W_skip = [], [], [], []
    for i in range(n):
        file = parsed.settings["enc_files"][i]
        dims = {"i": i, "d_sae": d_sae, "d_model": d, "n_later": n - i}
        shapes, _ = read_safetensors_header(file)
        check_declared_tensors(file, shapes, CLT_ENC_TENSORS, dims, src,
                               with_=("threshold_{i}",) * has_threshold + ("W_skip_{i}",) * has_skip)
        state = load_safetensors(file)
        check_file_tensors(file, state)
        W_enc.append(state[f"W_enc_{i}"].T)
        b_enc.append(state[f"b_enc_{i}"])
        b_dec.append(state[f"b_dec_{i}"])
        if has_threshold:
            ours[f"activation.{i}.threshold"] = state[f"threshold_{i}"]
        if has_skip:
            W_skip.append(state[f"W_skip_{i}"].T)
        dec_file = directory / f"W_dec_{i}.safetensors"
        dec_shapes, _ = read_safetensors_header(dec_file)
        check_declared_tensors(dec_file, dec_shapes, CLT_DEC_TENSORS, dims, src)
        dec = load_safetensors(dec_file)
        check_file_tensors(dec_file, dec)
        ours[f"W_dec_{i}"] = dec[f"W_dec_{i}"]
    ours["W_enc"] = torch.stack(W_enc)
    ours["b_enc"] = torch.stack(b_enc)
    ours["b_dec"] = torch.stack(b_dec)
    if has_skip:
        ours["W_skip"] = torch.stack(W_skip)
    return ours


def build_clt(parsed: Parsed, state: dict[str, torch.Tensor], *, device: torch.device | str | None = None,
              dtype: torch.dtype | None = None) -> CrossLayerTranscoder:
    """Our :class:`CrossLayerTranscoder` with the stacked ``state``.

    Raises:
        CheckpointError: non-floating or non-finite tensor.
    """
    return parsed.build_module(CrossLayerTranscoder, state, "", device=device, dtype=dtype)


CLT_READER = Reader("circuit_tracer_clt", HUB_FILES, parse_clt_config, load_clt_weights, build_clt, hub_weight_files)


def load_circuit_tracer_clt(directory: str | os.PathLike[str], **kwargs: Any) -> CrossLayerTranscoder:
    """Load a circuit-tracer CLT (``W_enc_{i}.safetensors`` + ``W_dec_{i}.safetensors``) as ours, or a GemmaScope-2
    CLT (one lower-case ``w_enc`` file per layer, listed under ``transcoders``; every listed layer read).

    Source: circuit-tracer ``transcoder/cross_layer_transcoder.py`` (``load_clt``, ``load_gemma_scope_2_clt``; module
    docstring).
    ``kwargs``: ``d_model``, ``device``, ``dtype``, ``subfolder``, ``local_files_only``, ``revision``.

    Returns:
        ``W_enc (n_layers, d_model, d_sae)``, ``W_dec(i) (d_sae, n_layers − i, d_model)``.

    Raises:
        CheckpointError: a missing file or tensor, a wrong shape (naming file and key), layers
            that disagree on JumpReLU thresholds or skip weights.
        ConfigMismatchError: ``d_model`` given and different from the files'.
    """
    return read(CLT_READER, directory, **kwargs)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- writers
def _write_yaml(stage: Staging, cfg: dict[str, Any]) -> None:
    import yaml

    stage.write_text(CONFIG_FILE, yaml.safe_dump(cfg, sort_keys=False))


def _check_written_hooks(feature_input_hook: str, feature_output_hook: str) -> None:
    """Refuse hooks that do not name our transcoders' site (the MLP module's input and output) in every family:
    circuit-tracer would attach the file there and compute something it was not trained on."""
    for key, hook, ours in (("feature_input_hook", feature_input_hook, MLP_INPUT_HOOKS),
                            ("feature_output_hook", feature_output_hook, MLP_OUTPUT_HOOKS)):
        if hook not in ours:
            raise UnsupportedArchitectureError(
                f"{key}={hook!r}: our transcoders and CLTs read the MLP module's input and write its output; "
                f"the hooks that name that site in every family are {ours} (circuit-tracer: mlp.hook_in = the "
                "pre-MLP norm's output, gain included; mlp.hook_out = the MLP's output). hook_resid_mid is the "
                "residual before the norm, ln2.hook_normalized the norm before its gain, hook_mlp_out the output "
                "after Gemma-2/3's post-norm")


def save_circuit_tracer_clt(clt: CrossLayerTranscoder, directory: str | os.PathLike[str], *,
                            feature_input_hook: str = "mlp.hook_in",
                            feature_output_hook: str = "mlp.hook_out") -> Path:
    """Write ``clt`` as circuit-tracer's ``CrossLayerTranscoder.to_safetensors`` does (+ ``config.yaml``):
    what its ``load_clt`` reads back (checked by ``scripts/peer_fixtures/circuit_tracer.py``).

    ``config.yaml`` records the site a :class:`~nnsight_lorsa.envoy.clt_set.CLTSet` reads and writes: the MLP
    module's input (``mlp.hook_in``: circuit-tracer's ``ReplacementMLP.hook_in`` / the pre-MLP norm's output, its
    gain included) and output (``mlp.hook_out``); see :data:`~.hook_sites.MLP_INPUT_HOOKS`. Earlier versions' default
    was ``hook_resid_mid`` (the residual before the norm), which misdeclared our CLTs' input.

    Raises:
        UnsupportedArchitectureError: an activation other than relu / jumprelu; a CLT with a skip path
            (circuit-tracer 0.5.0's ``load_clt`` does not read ``W_skip_{i}``: it would drop the skip
            silently — save it with ``format="nnsight_lorsa"``); a hook outside
            :data:`~.hook_sites.MLP_INPUT_HOOKS` / :data:`~.hook_sites.MLP_OUTPUT_HOOKS` (``hook_resid_mid``,
            ``ln2.hook_normalized``, ``hook_mlp_out``, …), naming it.
    """
    _check_written_hooks(feature_input_hook, feature_output_hook)
    if clt.cfg.activation not in ("relu", "jumprelu"):
        raise UnsupportedArchitectureError(f"circuit-tracer CLTs are relu or jump_relu, not {clt.cfg.activation!r}")
    if clt.W_skip is not None:
        raise UnsupportedArchitectureError("a CLT with a skip path cannot be saved for circuit-tracer: its load_clt "
                                           "(0.5.0) does not read W_skip_{i} and would drop the skip silently; "
                                           "save it with format='nnsight_lorsa'")
    with atomic_directory(directory) as stage:
        for i in range(clt.n_layers):
            enc = {f"W_enc_{i}": clt.W_enc[i].T, f"b_enc_{i}": clt.b_enc[i], f"b_dec_{i}": clt.b_dec[i]}
            if clt.W_skip is not None:
                enc[f"W_skip_{i}"] = clt.W_skip[i].T
            if clt.cfg.activation == "jumprelu":
                enc[f"threshold_{i}"] = getattr(clt.activation[i], "threshold")  # noqa: B009
            stage.save_tensors(f"W_enc_{i}.safetensors", {k: v.detach().cpu().contiguous() for k, v in enc.items()})
            stage.save_tensors(f"W_dec_{i}.safetensors", {f"W_dec_{i}": clt.W_dec(i).detach().cpu().contiguous()})
        _write_yaml(stage, {"model_kind": "cross_layer_transcoder", "feature_input_hook": feature_input_hook,
                            "feature_output_hook": feature_output_hook})
    return Path(directory)


def save_circuit_tracer_transcoders(transcoders: dict[int, Transcoder], directory: str | os.PathLike[str], *,
                                    feature_input_hook: str = "mlp.hook_in",
                                    feature_output_hook: str = "mlp.hook_out",
                                    model_name: str | None = None) -> Path:
    """Write per-layer transcoders as ``layer_{i}.safetensors`` + ``config.yaml`` (circuit-tracer layout):
    the keys ``SingleLayerTranscoder.to_safetensors`` writes (JumpReLU threshold as
    :data:`THRESHOLD_KEY`), what its ``load_transcoder_set`` reads back (checked by
    ``scripts/peer_fixtures/circuit_tracer.py``). The hooks name the MLP module's input and output, the site a
    :class:`~nnsight_lorsa.envoy.transcoder_set.TranscoderSet` reads and writes (as :func:`save_circuit_tracer_clt`).

    Raises:
        UnsupportedArchitectureError: an activation other than relu / jumprelu. TopK in particular:
            circuit-tracer 0.5.0's files have no key or config entry for ``k`` (``load_relu_transcoder``
            builds ReLU or JumpReLU only), so a TopK transcoder would load there as ReLU. A hook outside
            :data:`~.hook_sites.MLP_INPUT_HOOKS` / :data:`~.hook_sites.MLP_OUTPUT_HOOKS`, naming it. A layer
            circuit-tracer computes otherwise (:func:`_check_circuit_tracer_layer`: an SAE centring or normalising
            its input, ``d_out != d_in``), layers of different widths or skip paths.
        ArgumentError: the layers are not ``0..n-1`` (circuit-tracer reads ``layer_0`` … ``layer_{n-1}``: its
            ``resolve_transcoder_paths`` without a list), before anything is written.
    """
    _check_written_hooks(feature_input_hook, feature_output_hook)
    if sorted(transcoders) != list(range(len(transcoders))):
        raise ArgumentError(f"circuit-tracer transcoder sets cover layers 0..n-1 (it reads layer_0 .. layer_<n-1>), "
                            f"got layers {sorted(transcoders)}: save every layer from 0, or use "
                            "format='nnsight_lorsa'")
    for layer, tc in sorted(transcoders.items()):  # every input checked before anything is written
        if tc.cfg.activation not in ("relu", "jumprelu"):
            raise UnsupportedArchitectureError(
                f"layer {layer}: activation {tc.cfg.activation!r} cannot be saved for circuit-tracer: its "
                "transcoder files (0.5.0) express relu or jump_relu only (load_relu_transcoder reads no k), so it "
                "would load there as ReLU; save it with format='nnsight_lorsa' or 'saelens'")
        _check_circuit_tracer_layer(layer, tc)
    shapes = {(tc.cfg.d_sae, kind_of(tc) == "skip_transcoder") for tc in transcoders.values()}
    if len(shapes) > 1:
        raise UnsupportedArchitectureError(
            f"the layers differ in width or skip path ({sorted(shapes)} as (d_sae, skip)): circuit-tracer's "
            "TranscoderSet asserts one d_sae and takes the skip flag of layer 0 for every layer (a later layer's skip "
            "path left out of its attribution, or refused); save them with format='nnsight_lorsa'")
    with atomic_directory(directory) as stage:
        for layer, tc in sorted(transcoders.items()):
            state: dict[str, Any] = {"W_enc": tc.W_enc.T, "W_dec": tc.W_dec, "b_enc": tc.b_enc, "b_dec": tc.b_dec}
            if kind_of(tc) == "skip_transcoder":
                state["W_skip"] = tc.W_skip
            if tc.cfg.activation == "jumprelu":
                state[THRESHOLD_KEY] = getattr(tc.activation, "threshold")  # noqa: B009
            stage.save_tensors(f"layer_{layer}.safetensors",
                               {k: v.detach().cpu().contiguous() for k, v in state.items()})
        # no 'transcoders' list: circuit-tracer opens a listed path as given (resolve_transcoder_paths), so a bare
        # name resolves against the process's working directory; without the list a hub load finds the repo's
        # layer_<i>.safetensors itself, and so does our reader
        _write_yaml(stage, {"model_kind": "transcoder_set", "model_name": model_name,
                            "feature_input_hook": feature_input_hook, "feature_output_hook": feature_output_hook})
    return Path(directory)


def _check_circuit_tracer_layer(layer: int, tc: Any) -> None:
    """A layer circuit-tracer's ``SingleLayerTranscoder`` computes as we do: ``relu(x W_enc + b_enc)`` read from
    ``x`` itself (no ``b_dec`` subtracted, no normalisation: an SAE of ours that centres or normalises its input is
    another function there) and ``d_out = d_in`` (``load_relu_transcoder`` sizes ``W_enc`` and ``W_skip`` from
    ``b_dec``).

    Raises:
        UnsupportedArchitectureError: naming the layer and the setting.
    """
    cfg = tc.cfg
    norm = getattr(cfg, "normalize_activations", "none")
    what = [w for w, present in (("subtracts b_dec from its input (apply_b_dec_to_input)",
                                  getattr(cfg, "apply_b_dec_to_input", False)),
                                 (f"normalises its input (normalize_activations={norm!r})", norm != "none")) if present]
    if what:
        raise UnsupportedArchitectureError(
            f"layer {layer}: the SAE {' and '.join(what)}; circuit-tracer's transcoders compute "
            "relu(x W_enc + b_enc) from x itself (single_layer_transcoder.py): it would compute another function "
            "there; save it with format='saelens' or 'nnsight_lorsa'")
    if tc.d_out != cfg.d_in:
        raise UnsupportedArchitectureError(
            f"layer {layer}: d_out={tc.d_out} != d_in={cfg.d_in}; circuit-tracer sizes W_enc and W_skip from b_dec "
            "(load_relu_transcoder: d_model = b_dec.shape[0]) and refuses such a file; save it with "
            "format='saelens' or 'nnsight_lorsa'")
