"""circuit-tracer transcoder sets and cross-layer transcoders -> our modules.

Read from ``decoderesearch/circuit-tracer``:

``config.yaml`` (optional; read with ``yaml.safe_load``)
    ``model_kind`` (``"transcoder_set"`` | ``"cross_layer_transcoder"``), ``model_name``,
    ``feature_input_hook`` / ``feature_output_hook`` (TransformerLens names inside a block, e.g.
    ``mlp.hook_in`` / ``mlp.hook_out``, ``hook_resid_mid`` / ``hook_mlp_out``), ``scan``,
    ``transcoders`` (per-layer file list), optional ``activation`` / ``k``.
Per-layer transcoders, ``layer_{i}.safetensors`` (``transcoder/single_layer_transcoder.py``)
    ``W_enc (d_sae, d_model)`` (``F.linear(x, W_enc, b_enc)``: the transpose of ours),
    ``W_dec (d_sae, d_model)``, ``b_enc (d_sae)``, ``b_dec (d_model)``, optional ``W_skip (d_model, d_model)``
    applied as ``x @ W_skip.T`` (our layout), optional ``threshold (d_sae)`` (JumpReLU ``x·1[x > θ]``).
Cross-layer transcoders (``transcoder/cross_layer_transcoder.py``, ``to_safetensors`` / ``_load_state_dict``)
    ``W_enc_{i}.safetensors``: ``W_enc_{i} (d_sae, d_model)`` (ours ``W_enc[i]ᵀ``), ``b_enc_{i} (d_sae)``,
    ``b_dec_{i} (d_model)``, optional ``threshold_{i} (d_sae)`` and ``W_skip_{i} (d_model, d_model)``
    applied as ``x @ W_skip_{i}`` (ours ``W_skip[i] = W_skip_{i}ᵀ``); ``W_dec_{i}.safetensors``:
    ``W_dec_{i} (d_sae, n_layers − i, d_model)`` (our layout). ``n_layers`` = number of ``W_enc_*`` files.

Never reads their ``.npz`` (Gemma Scope) files or anything pickled.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, UnsupportedArchitectureError
from ..modules.clt import CLTConfig, CrossLayerTranscoder
from ..modules.transcoder import SkipTranscoder, Transcoder, TranscoderConfig
from .lorsa_format import check_tensor_inventory, load_safetensors, read_safetensors_header, resolve_checkpoint_dir
from .sparse_coder_format import build_module, check_d_model

CONFIG_FILE = "config.yaml"

__all__ = ["CircuitTracerTranscoders", "load_circuit_tracer", "load_circuit_tracer_clt",
           "load_circuit_tracer_transcoders", "read_circuit_tracer_config", "save_circuit_tracer_clt",
           "save_circuit_tracer_transcoders"]


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


def read_circuit_tracer_config(path: Path) -> dict[str, Any]:
    """``config.yaml`` as a dict (``{}`` when absent); CheckpointError naming the file otherwise."""
    if not path.is_file():
        return {}
    try:
        import yaml
    except ImportError as e:  # pragma: no cover - pyyaml is a dependency
        raise CheckpointError(f"{path}: reading it needs PyYAML (pip install pyyaml)") from e
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not readable YAML ({e})") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a mapping, got {type(data).__name__}")
    return data


def _resolve(directory: str | os.PathLike[str], local_files_only: bool, revision: str | None) -> Path:
    return resolve_checkpoint_dir(directory, allow_patterns=[CONFIG_FILE, "*.safetensors"],
                                  local_files_only=local_files_only, revision=revision)


def _numbered(path: Path, pattern: str) -> dict[int, Path]:
    rx = re.compile(pattern)
    found = {int(m.group(1)): p for p in path.iterdir() if (m := rx.fullmatch(p.name))}
    if found and sorted(found) != list(range(len(found))):
        raise CheckpointError(f"{path}: files {pattern!r} must be numbered 0..n-1, found layers {sorted(found)}")
    return found


def _hooks(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: cfg.get(k) for k in ("model_kind", "model_name", "feature_input_hook", "feature_output_hook", "scan")}


# --------------------------------------------------------------------------- per-layer transcoders
def _layer_files(path: Path, cfg: dict[str, Any], config_path: Path) -> dict[int, Path]:
    listed = cfg.get("transcoders")
    if isinstance(listed, list) and listed:
        files: dict[int, Path] = {}
        for i, entry in enumerate(listed):
            if isinstance(entry, dict):
                layer, ref = entry.get("layer"), entry.get("filepath")
            else:
                layer, ref = None, entry
            if not isinstance(ref, str):
                raise CheckpointError(f"{config_path}: key 'transcoders'[{i}] has no file path")
            name = ref.split("?")[0].rsplit("/", 1)[-1]
            if layer is None:
                m = re.fullmatch(r"layer_(\d+)\.safetensors", name)
                layer = int(m.group(1)) if m else i
            if not name.endswith(".safetensors"):
                raise CheckpointError(f"{config_path}: key 'transcoders'[{i}] is {ref!r}; only .safetensors "
                                      "files are read")
            files[int(layer)] = path / name
        return files
    files = _numbered(path, r"layer_(\d+)\.safetensors")
    if not files:
        raise CheckpointError(f"{path}: no layer_<i>.safetensors files (and no 'transcoders' in {CONFIG_FILE})")
    return files


def load_circuit_tracer_transcoders(
    directory: str | os.PathLike[str],
    *,
    d_model: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    local_files_only: bool = False,
    revision: str | None = None,
) -> CircuitTracerTranscoders:
    """Load a circuit-tracer per-layer transcoder set (``config.yaml`` + ``layer_{i}.safetensors``).

    Raises:
        CheckpointError: a missing file or tensor, a wrong shape (naming file and key), bad YAML.
        UnsupportedArchitectureError: an ``activation`` in ``config.yaml`` we cannot build.
        ConfigMismatchError: ``d_model`` given and different from the files'.
    """
    path = _resolve(directory, local_files_only, revision)
    config_path = path / CONFIG_FILE
    cfg = read_circuit_tracer_config(config_path)
    kind = cfg.get("model_kind", "transcoder_set")
    if kind != "transcoder_set":
        raise UnsupportedArchitectureError(f"{config_path}: key 'model_kind' is {kind!r}, expected 'transcoder_set'")
    act_name = cfg.get("activation") or "relu"
    act_name = {"jump_relu": "jumprelu"}.get(act_name, act_name)
    if act_name not in ("relu", "topk", "jumprelu"):
        raise UnsupportedArchitectureError(f"{config_path}: key 'activation' is {act_name!r}; "
                                           "supported: relu, topk, jump_relu")
    transcoders: dict[int, Transcoder] = {}
    for layer, file in sorted(_layer_files(path, cfg, config_path).items()):
        shapes, _ = read_safetensors_header(file)
        if "W_enc" not in shapes or len(shapes["W_enc"]) != 2:
            raise CheckpointError(f"{file}: missing tensor 'W_enc' (d_sae, d_model), found {sorted(shapes)}")
        d_sae, d_in = shapes["W_enc"]
        check_d_model(d_in, d_model, file, "W_enc.shape[1]")
        d_out = shapes["b_dec"][0] if len(shapes.get("b_dec", ())) == 1 else d_in
        activation = "jumprelu" if "threshold" in shapes else act_name
        expected = {"W_enc": (d_sae, d_in), "W_dec": (d_sae, d_out), "b_enc": (d_sae,), "b_dec": (d_out,)}
        if "W_skip" in shapes:
            expected["W_skip"] = (d_out, d_in)
        if activation == "jumprelu":
            expected["threshold"] = (d_sae,)
        src = f"W_enc of {file.name} (d_sae={d_sae}, d_model={d_in})"
        check_tensor_inventory(file, shapes, expected, src)
        state = load_safetensors(file)
        ours = {"W_enc": state["W_enc"].T.contiguous(), "b_enc": state["b_enc"], "W_dec": state["W_dec"],
                "b_dec": state["b_dec"]}
        if "W_skip" in state:
            ours["W_skip"] = state["W_skip"]
        if activation == "jumprelu":
            ours["activation.threshold"] = state["threshold"]
        params: dict[str, Any] = {}
        if activation == "topk":
            k = cfg.get("k")
            if not isinstance(k, int) or k <= 0:
                raise CheckpointError(f"{config_path}: key 'k' must be a positive int for activation 'topk'")
            params["k"] = k
        tcfg = TranscoderConfig(d_in=d_in, d_sae=d_sae, d_out=d_out, activation=activation, activation_params=params,
                                layer=layer, extra={"circuit_tracer": {**_hooks(cfg), "file": file.name}})
        cls: type[Transcoder] = SkipTranscoder if "W_skip" in ours else Transcoder
        transcoders[layer] = _build_transcoder(cls, tcfg, ours, file, src, device, dtype or ours["W_enc"].dtype)
    if sorted(transcoders) != list(range(len(transcoders))):
        raise CheckpointError(f"{path}: transcoders must cover layers 0..n-1, found {sorted(transcoders)}")
    return CircuitTracerTranscoders(transcoders, cfg.get("feature_input_hook"), cfg.get("feature_output_hook"),
                                    cfg.get("scan"), cfg)


def _build_transcoder(cls: type[Transcoder], tcfg: TranscoderConfig, state: dict[str, torch.Tensor], file: Path,
                      src: str, device: torch.device | str | None, dtype: torch.dtype) -> Transcoder:
    return build_module(lambda: cls(tcfg), state, file, src, device=device, dtype=dtype)


# --------------------------------------------------------------------------- cross-layer transcoders
def load_circuit_tracer_clt(
    directory: str | os.PathLike[str],
    *,
    d_model: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    local_files_only: bool = False,
    revision: str | None = None,
) -> CrossLayerTranscoder:
    """Load a circuit-tracer CLT (``W_enc_{i}.safetensors`` + ``W_dec_{i}.safetensors``) as ours.

    Raises:
        CheckpointError: a missing file or tensor, a wrong shape (naming file and key), layers
            that disagree on JumpReLU thresholds or skip weights.
        ConfigMismatchError: ``d_model`` given and different from the files'.
    """
    path = _resolve(directory, local_files_only, revision)
    config_path = path / CONFIG_FILE
    cfg = read_circuit_tracer_config(config_path)
    kind = cfg.get("model_kind", "cross_layer_transcoder")
    if kind != "cross_layer_transcoder":
        raise UnsupportedArchitectureError(
            f"{config_path}: key 'model_kind' is {kind!r}, expected 'cross_layer_transcoder'")
    enc_files = _numbered(path, r"W_enc_(\d+)\.safetensors")
    if not enc_files:
        raise CheckpointError(f"{path}: no W_enc_<i>.safetensors files")
    n = len(enc_files)
    shapes0, _ = read_safetensors_header(enc_files[0])
    if len(shapes0.get("W_enc_0", ())) != 2:
        raise CheckpointError(f"{enc_files[0]}: missing tensor 'W_enc_0' (d_sae, d_model), found {sorted(shapes0)}")
    d_sae, d = shapes0["W_enc_0"]
    check_d_model(d, d_model, enc_files[0], "W_enc_0.shape[1]")
    has_threshold, has_skip = "threshold_0" in shapes0, "W_skip_0" in shapes0
    src = f"W_enc_0 of {enc_files[0].name} (d_sae={d_sae}, d_model={d}, n_layers={n})"
    ours: dict[str, torch.Tensor] = {}
    W_enc, b_enc, b_dec, W_skip = [], [], [], []
    for i in range(n):
        file = enc_files[i]
        expected = {f"W_enc_{i}": (d_sae, d), f"b_enc_{i}": (d_sae,), f"b_dec_{i}": (d,)}
        if has_threshold:
            expected[f"threshold_{i}"] = (d_sae,)
        if has_skip:
            expected[f"W_skip_{i}"] = (d, d)
        shapes, _ = read_safetensors_header(file)
        check_tensor_inventory(file, shapes, expected, src)
        state = load_safetensors(file)
        W_enc.append(state[f"W_enc_{i}"].T)
        b_enc.append(state[f"b_enc_{i}"])
        b_dec.append(state[f"b_dec_{i}"])
        if has_threshold:
            ours[f"activation.{i}.threshold"] = state[f"threshold_{i}"]
        if has_skip:
            W_skip.append(state[f"W_skip_{i}"].T)
        dec_file = path / f"W_dec_{i}.safetensors"
        dec_shapes, _ = read_safetensors_header(dec_file)
        check_tensor_inventory(dec_file, dec_shapes, {f"W_dec_{i}": (d_sae, n - i, d)}, src)
        ours[f"W_dec_{i}"] = load_safetensors(dec_file)[f"W_dec_{i}"]
    ours["W_enc"] = torch.stack(W_enc)
    ours["b_enc"] = torch.stack(b_enc)
    ours["b_dec"] = torch.stack(b_dec)
    if has_skip:
        ours["W_skip"] = torch.stack(W_skip)
    ccfg = CLTConfig(d_in=d, d_sae=d_sae, n_layers=n, skip=has_skip,
                     activation="jumprelu" if has_threshold else "relu",
                     extra={"circuit_tracer": _hooks(cfg)})
    return build_module(lambda: CrossLayerTranscoder(ccfg), ours, path, src, device=device,
                        dtype=dtype or ours["W_enc"].dtype)


def load_circuit_tracer(
    directory: str | os.PathLike[str], **kwargs: Any
) -> CircuitTracerTranscoders | CrossLayerTranscoder:
    """:func:`load_circuit_tracer_clt` or :func:`load_circuit_tracer_transcoders`, by ``model_kind`` in
    ``config.yaml`` (or, without one, by which files exist)."""
    path = _resolve(directory, kwargs.pop("local_files_only", False), kwargs.pop("revision", None))
    kind = read_circuit_tracer_config(path / CONFIG_FILE).get("model_kind")
    if kind is None:
        kind = "cross_layer_transcoder" if (path / "W_enc_0.safetensors").is_file() else "transcoder_set"
    if kind == "cross_layer_transcoder":
        return load_circuit_tracer_clt(path, **kwargs)
    if kind == "transcoder_set":
        return load_circuit_tracer_transcoders(path, **kwargs)
    raise UnsupportedArchitectureError(f"{path / CONFIG_FILE}: key 'model_kind' is {kind!r}; supported: "
                                       "'transcoder_set', 'cross_layer_transcoder'")


# --------------------------------------------------------------------------- writers
def _write_yaml(path: Path, cfg: dict[str, Any]) -> None:
    import yaml

    (path / CONFIG_FILE).write_text(yaml.safe_dump(cfg, sort_keys=False), encoding="utf-8")


def save_circuit_tracer_clt(clt: CrossLayerTranscoder, directory: str | os.PathLike[str], *,
                            feature_input_hook: str = "hook_resid_mid",
                            feature_output_hook: str = "hook_mlp_out") -> Path:
    """Write ``clt`` as circuit-tracer's ``CrossLayerTranscoder.to_safetensors`` does (+ ``config.yaml``).

    Raises:
        UnsupportedArchitectureError: an activation other than relu / jumprelu.
    """
    from safetensors.torch import save_file

    if clt.cfg.activation not in ("relu", "jumprelu"):
        raise UnsupportedArchitectureError(f"circuit-tracer CLTs are relu or jump_relu, not {clt.cfg.activation!r}")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    for i in range(clt.n_layers):
        enc = {f"W_enc_{i}": clt.W_enc[i].T, f"b_enc_{i}": clt.b_enc[i], f"b_dec_{i}": clt.b_dec[i]}
        if clt.W_skip is not None:
            enc[f"W_skip_{i}"] = clt.W_skip[i].T
        if clt.cfg.activation == "jumprelu":
            enc[f"threshold_{i}"] = getattr(clt.activation[i], "threshold")  # noqa: B009
        save_file({k: v.detach().cpu().contiguous() for k, v in enc.items()}, str(path / f"W_enc_{i}.safetensors"))
        save_file({f"W_dec_{i}": clt.W_dec(i).detach().cpu().contiguous()}, str(path / f"W_dec_{i}.safetensors"))
    _write_yaml(path, {"model_kind": "cross_layer_transcoder", "feature_input_hook": feature_input_hook,
                       "feature_output_hook": feature_output_hook})
    return path


def save_circuit_tracer_transcoders(transcoders: dict[int, Transcoder], directory: str | os.PathLike[str], *,
                                    feature_input_hook: str = "mlp.hook_in",
                                    feature_output_hook: str = "mlp.hook_out",
                                    model_name: str | None = None) -> Path:
    """Write per-layer transcoders as ``layer_{i}.safetensors`` + ``config.yaml`` (circuit-tracer layout).

    Raises:
        UnsupportedArchitectureError: an activation other than relu / jumprelu.
    """
    from safetensors.torch import save_file

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    for layer, tc in sorted(transcoders.items()):
        if tc.cfg.activation not in ("relu", "jumprelu"):
            raise UnsupportedArchitectureError(f"layer {layer}: activation {tc.cfg.activation!r} not exportable")
        state = {"W_enc": tc.W_enc.T, "W_dec": tc.W_dec, "b_enc": tc.b_enc, "b_dec": tc.b_dec}
        if isinstance(tc, SkipTranscoder):
            state["W_skip"] = tc.W_skip
        if tc.cfg.activation == "jumprelu":
            state["threshold"] = getattr(tc.activation, "threshold")  # noqa: B009
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()},
                  str(path / f"layer_{layer}.safetensors"))
    _write_yaml(path, {"model_kind": "transcoder_set", "model_name": model_name,
                       "feature_input_hook": feature_input_hook, "feature_output_hook": feature_output_hook,
                       "transcoders": [f"layer_{layer}.safetensors" for layer in sorted(transcoders)]})
    return path
