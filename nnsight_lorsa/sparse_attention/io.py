"""Save a gated model as a normal Hugging Face directory plus the gates, and load it back.

Layout of a directory written by :func:`save_sparse_model`:

- the Hugging Face files (``config.json``, ``model.safetensors``, tokenizer files if given): the
  fine-tuned weights *without* the gates, loadable by ``AutoModelForCausalLM`` or
  ``nnsight.LanguageModel`` (which then run ordinary dense attention);
- ``sparse_attention.json``: the :class:`GateConfig`;
- ``sparse_attention.safetensors``: one tensor ``layers.<L>.bias`` of shape ``(n_heads,)`` per layer;
- ``checksums.json``: every file's size and sha256.

Both savers are atomic (:func:`nnsight_lorsa._atomic.atomic_directory`: staged in a sibling, swapped
in), so a crash leaves the old directory or the new one; :func:`save_gates` into an existing directory
replaces the gate files only (the model's files beside them are kept, with their checksums). The
loaders check ``checksums.json`` when present.

:func:`load_gates` puts the gates on such a model (HF or nnsight), :func:`load_sparse_model` does
both steps for a plain transformers model.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from .._atomic import Staging, atomic_directory, check, manifest_of, resolve
from ..adapters.registry import get_adapter
from .attention import GATE_NAME
from .errors import CheckpointError
from .gate import GATE_MODES
from .install import get_gates, hf_model, install_gated_attention

CONFIG_FILE = "sparse_attention.json"
WEIGHTS_FILE = "sparse_attention.safetensors"
FORMAT = "nnsight_lorsa.sparse_attention"
FORMAT_VERSION = 1


@dataclass
class GateConfig:
    """What :func:`load_gates` needs besides the biases (stored as ``sparse_attention.json``)."""

    model_type: str
    n_layers: int
    n_heads: int
    temperature: float = 1.0
    mode: str = "gated"
    top_k: int = 1
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    training: dict[str, Any] | None = None  # free-form record of how the gates were trained


def save_gates(model: Any, directory: str | Path, training: dict[str, Any] | None = None) -> Path:
    """Write ``sparse_attention.json`` and ``sparse_attention.safetensors`` for ``model``'s gates.

    Atomic: the other files of ``directory`` (a model saved there) are kept.

    Raises:
        GateNotInstalledError: the model has no gates.
        CheckpointError: ``training`` is not JSON-serialisable (nothing is written).
    """
    stage_files = _gate_files(model, training)
    with atomic_directory(directory, replace=False) as stage:
        _write_gates(stage, stage_files)
    return Path(directory)


def _gate_files(model: Any, training: dict[str, Any] | None) -> tuple[dict[str, torch.Tensor], str]:
    """``(tensors, config text)`` of the gates (everything checked before anything is written)."""
    hf = hf_model(model)
    gates = get_gates(model)
    first = gates[0]
    cfg = GateConfig(model_type=str(hf.config.model_type), n_layers=len(gates), n_heads=first.n_heads,
                     temperature=first.temperature, mode=first.mode, top_k=first.top_k, training=training)
    try:
        text = json.dumps(asdict(cfg), indent=2) + "\n"
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"gate config is not JSON-serialisable (check training=): {e}") from e
    return {f"layers.{layer}.bias": g.bias.detach().float().cpu().contiguous() for layer, g in gates.items()}, text


def _write_gates(stage: Staging, files: tuple[dict[str, torch.Tensor], str]) -> None:
    stage.save_tensors(WEIGHTS_FILE, files[0])
    stage.write_text(CONFIG_FILE, files[1])


def read_gate_config(directory: str | Path) -> GateConfig:
    """Parse ``sparse_attention.json`` (every field type- and range-checked, through the formats'
    validation layer).

    Raises:
        CheckpointError: missing or unreadable file, wrong format, unknown keys, a field of the wrong
            type or out of range (naming the file and the key).
    """
    from ..formats.files import read_json_object
    from ..formats.validate import config_size, config_value

    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} not found (not a directory written by save_sparse_model/save_gates)")
    raw = read_json_object(path)
    known = {f.name for f in fields(GateConfig)}
    unknown = set(raw) - known
    if unknown or raw.get("format") != FORMAT:
        raise CheckpointError(f"{path}: key 'format' is {raw.get('format')!r} (expected {FORMAT!r}), "
                              f"unknown keys {sorted(unknown)}")
    if config_value(raw, "format_version", path, int, FORMAT_VERSION) != FORMAT_VERSION:
        raise CheckpointError(f"{path}: key 'format_version' is {raw['format_version']!r}; this package reads "
                              f"{FORMAT_VERSION}")
    temperature = config_value(raw, "temperature", path, float, 1.0)
    if temperature <= 0:
        raise CheckpointError(f"{path}: key 'temperature' must be positive, got {temperature!r}")
    mode = config_value(raw, "mode", path, str, "gated")
    if mode not in GATE_MODES:
        raise CheckpointError(f"{path}: key 'mode' is {mode!r}; expected one of {GATE_MODES}")
    training = config_value(raw, "training", path, dict, None)
    return GateConfig(model_type=config_value(raw, "model_type", path, str),
                      n_layers=config_size(raw, "n_layers", path), n_heads=config_size(raw, "n_heads", path),
                      temperature=temperature, mode=mode, top_k=config_size(raw, "top_k", path, 1),
                      training=training)


def load_gates(model: Any, directory: str | Path) -> dict[int, Any]:
    """Install gated attention on ``model`` (HF or nnsight) with the gates saved in ``directory``.

    Returns:
        ``{layer: gate}``.

    Raises:
        CheckpointError: missing/malformed files (a non-finite or non-float bias included), or the
            gates do not fit the model (model type, layer or head count, tensor names or shapes).
    """
    from ..formats.files import load_safetensors
    from ..formats.validate import check_file_tensors

    directory = resolve(directory)  # `<directory>.old` when a save was killed between its two renames
    entries = {k: v for k, v in (manifest_of(directory) or {}).items() if k in (CONFIG_FILE, WEIGHTS_FILE)}
    cfg = read_gate_config(directory)
    hf = hf_model(model)
    adapter = get_adapter(hf)
    if cfg.model_type != hf.config.model_type or cfg.n_layers != adapter.n_layers or cfg.n_heads != adapter.n_heads:
        raise CheckpointError(
            f"{Path(directory) / CONFIG_FILE}: gates for a {cfg.model_type} model with {cfg.n_layers} layers x "
            f"{cfg.n_heads} heads do not fit a {hf.config.model_type} model with {adapter.n_layers} layers x "
            f"{adapter.n_heads} heads"
        )
    wpath = Path(directory) / WEIGHTS_FILE
    tensors = load_safetensors(wpath)
    expected = {f"layers.{layer}.bias" for layer in range(cfg.n_layers)}
    if set(tensors) != expected or any(t.shape != (cfg.n_heads,) for t in tensors.values()):
        raise CheckpointError(f"{wpath}: expected tensors {sorted(expected)} of shape ({cfg.n_heads},), got "
                              f"{ {k: tuple(v.shape) for k, v in tensors.items()} }")
    check_file_tensors(wpath, tensors)
    check(directory, entries)  # the gate files as saved (checksums.json), before the model is touched
    gates = install_gated_attention(model, temperature=cfg.temperature, mode=cfg.mode, top_k=cfg.top_k)
    with torch.no_grad():
        for layer, gate in gates.items():
            gate.bias.copy_(tensors[f"layers.{layer}.bias"])
    return gates


def save_sparse_model(model: Any, directory: str | Path, tokenizer: Any = None,
                      training: dict[str, Any] | None = None) -> Path:
    """Save ``model`` as a Hugging Face directory (weights without gates) plus its gates.

    The model's ``config.json`` records its original (dense) attention implementation, so plain
    transformers loads the directory as the fine-tuned dense model; :func:`load_gates` adds the gates.

    Atomic: the Hugging Face files, the tokenizer's and the gates are staged together and swapped in.

    Raises:
        GateNotInstalledError: the model has no gates.
        CheckpointError: ``training`` is not JSON-serialisable (nothing is written).
    """
    from .install import _DENSE_ATTR

    hf = hf_model(model)
    gates = get_gates(model)
    gate_files = _gate_files(model, training)
    adapter = get_adapter(hf)
    attns = [adapter.attention_module(hf, layer) for layer in gates]
    impl = hf.config._attn_implementation
    with atomic_directory(directory) as stage:
        try:  # take the gates off the module tree while transformers serialises it
            for attn in attns:
                del attn._modules[GATE_NAME]
            hf.config._attn_implementation_internal = getattr(hf, _DENSE_ATTR)
            hf.save_pretrained(stage.path, safe_serialization=True)
        finally:
            hf.config._attn_implementation_internal = impl
            for attn, gate in zip(attns, gates.values(), strict=True):
                attn._modules[GATE_NAME] = gate
        if tokenizer is not None:
            tokenizer.save_pretrained(stage.path)
        stage.record_all()
        _write_gates(stage, gate_files)
    return Path(directory)


def load_sparse_model(directory: str | Path, **from_pretrained_kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained(directory)`` with the saved gates installed (eval mode).

    Raises:
        CheckpointError: see :func:`load_gates`.
    """
    from transformers import AutoModelForCausalLM

    directory = resolve(directory)
    entries = manifest_of(directory)
    kwargs = {"dtype": torch.float32, **from_pretrained_kwargs}
    model = AutoModelForCausalLM.from_pretrained(str(directory), **kwargs).eval()
    load_gates(model, directory)
    if entries is not None:
        check(directory, entries)  # the model's files too, as saved
    return model
