"""Sparse-attention gate files: ``sparse_attention.json`` + ``sparse_attention.safetensors`` -> the gates.

Layout (written by :func:`save_gate_set`, also beside a Hugging Face model by
:func:`~nnsight_lorsa.sparse_attention.io.save_sparse_model`)::

    sparse_attention.json         GateConfig: format "nnsight_lorsa.sparse_attention", format_version 1,
                                  model_type, n_layers, n_heads, temperature, mode, top_k, training
    sparse_attention.safetensors  layers.<L>.bias, float32 (n_heads,), one per layer L in [0, n_layers)
    checksums.json                every file's size and sha256 (nnsight_lorsa._atomic)

Read through the registry (``formats.load(dir, format="sparse_attention")``) as a :class:`GateSet`:
the :class:`GateConfig` and one :class:`~nnsight_lorsa.modules.attention_gate.AttentionGate` per layer,
on CPU (or ``device``), its bias as saved. Putting the gates on a model is the sparse-attention
package's job (:func:`~nnsight_lorsa.sparse_attention.io.load_gates`).

Reader steps (:class:`~.reader.Reader`): :func:`parse_config`, :func:`load_weights`, :func:`build`.
Every failure is a :class:`~nnsight_lorsa.errors.CheckpointError` naming the file and the key.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from .._atomic import Staging, atomic_directory
from ..errors import ArgumentError
from ..modules.attention_gate import GATE_MODES, AttentionGate
from .files import load_safetensors, read_json_object
from .reader import Parsed, Reader
from .validate import (
    Field,
    TensorSpec,
    check_declared_tensors,
    check_file_tensors,
    file_errors,
    read_fields,
    require,
    require_file,
)

__all__ = ["CONFIG_FILE", "FIELDS", "FORMAT", "FORMAT_VERSION", "READER", "WEIGHTS_FILE", "GateConfig",
           "GateSet", "save_gate_set", "write_gate_files"]

CONFIG_FILE = "sparse_attention.json"
WEIGHTS_FILE = "sparse_attention.safetensors"
FORMAT = "nnsight_lorsa.sparse_attention"
FORMAT_VERSION = 1
#: ``sparse_attention.json``'s fields after ``format`` (the keys of :class:`GateConfig`; no others);
#: ``sparse_attention.safetensors``: ``layers.<L>.bias`` ``(n_heads,)`` for ``L`` in ``[0, n_layers)``
FIELDS = (Field("format_version", int, FORMAT_VERSION, choices=(FORMAT_VERSION,)), Field("model_type", str),
          Field("n_layers", size=True), Field("n_heads", size=True), Field("temperature", float, 1.0, positive=True),
          Field("mode", str, "gated", choices=tuple(GATE_MODES)), Field("top_k", size=True, default=1),
          Field("training", dict, None))


@dataclass
class GateConfig:
    """What a gated model needs besides the biases (stored as ``sparse_attention.json``)."""

    model_type: str
    n_layers: int
    n_heads: int
    temperature: float = 1.0
    mode: str = "gated"
    top_k: int = 1
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    training: dict[str, Any] | None = None  # free-form record of how the gates were trained


@dataclass
class GateSet:
    """The gates of one model: ``gates[layer]`` (an :class:`AttentionGate` per layer, ``0 … n_layers-1``)
    and their :class:`GateConfig` (``config.model_type``: the ``config.model_type`` of the model they fit)."""

    config: GateConfig
    gates: dict[int, AttentionGate]

    def __getitem__(self, layer: int) -> AttentionGate:
        return self.gates[layer]

    def __len__(self) -> int:
        return len(self.gates)

    def files(self) -> tuple[dict[str, torch.Tensor], str]:
        """``(tensors, config text)``: the contents of the two gate files (CPU fp32 biases).

        Raises:
            CheckpointError: the config is not JSON-serialisable (check ``training``)."""
        with file_errors(CONFIG_FILE, {(TypeError, ValueError): "the gate config is not JSON-serialisable (check "
                                                                 "training=): {e}"}):
            text = json.dumps(asdict(self.config), indent=2) + "\n"
        tensors = {f"layers.{layer}.bias": g.bias.detach().float().cpu().contiguous()
                   for layer, g in self.gates.items()}
        return tensors, text


def parse_config(path: Path, *, model_type: str | None = None, n_layers: int | None = None,
                 n_heads: int | None = None) -> Parsed:
    """Parse ``sparse_attention.json`` (every field type- and range-checked, through :mod:`.validate`).

    ``model_type``, ``n_layers``, ``n_heads`` (all three, or none): the model the gates are for; gates
    saved for another model are refused here, before the tensors are read.

    Raises:
        CheckpointError: missing or unreadable file, wrong format, unknown keys, a field of the wrong
            type or out of range (naming the file and the key); gates that do not fit the model given.
    """
    file = Path(path) / CONFIG_FILE
    require_file(file, " (not a directory written by save_sparse_model/save_gates)")
    raw = read_json_object(file)
    unknown = set(raw) - {f.name for f in fields(GateConfig)}
    require(not unknown and raw.get("format") == FORMAT, file,
            f"key 'format' is {raw.get('format')!r} (expected {FORMAT!r}), unknown keys {sorted(unknown)}")
    values = read_fields(raw, file, FIELDS)
    values.pop("format_version")
    cfg = GateConfig(**values)
    require(model_type is None or (cfg.model_type, cfg.n_layers, cfg.n_heads) == (model_type, n_layers, n_heads),
            file, f"gates for a {cfg.model_type} model with {cfg.n_layers} layers x {cfg.n_heads} heads do not fit "
                  f"a {model_type} model with {n_layers} layers x {n_heads} heads")
    return Parsed(Path(path), cfg)


def load_weights(path: Path, parsed: Parsed) -> dict[str, torch.Tensor]:
    """The biases ``layers.<L>.bias`` ``(n_heads,)`` of ``sparse_attention.safetensors`` (names, shapes,
    float dtype and finiteness checked).

    Raises:
        CheckpointError: missing/unreadable file, tensors other than the config's, a wrong shape, a
            non-float or non-finite bias (naming the file and the tensor).
    """
    cfg: GateConfig = parsed.config
    wpath = Path(path) / WEIGHTS_FILE
    tensors = load_safetensors(wpath)
    spec = TensorSpec({f"layers.{layer}.bias": ("n_heads",) for layer in range(cfg.n_layers)})
    check_declared_tensors(wpath, tensors, spec, {"n_heads": cfg.n_heads},
                           f"{CONFIG_FILE} (n_layers={cfg.n_layers}, n_heads={cfg.n_heads})")
    check_file_tensors(wpath, tensors)
    return tensors


def build(parsed: Parsed, state: dict[str, torch.Tensor], *, device: torch.device | str | None = None,
          dtype: torch.dtype | None = None) -> GateSet:
    """The :class:`GateSet`: one :class:`AttentionGate` per layer with the saved bias, fp32 (the gate
    computes in fp32 whatever the model's dtype), on ``device`` (default CPU).

    Raises:
        ArgumentError: ``dtype`` other than None or ``torch.float32`` (not silently ignored)."""
    if dtype not in (None, torch.float32):
        raise ArgumentError(f"{parsed.directory}: sparse-attention gates are stored and computed in fp32; "
                            f"dtype={dtype!r} does not apply (pass None or torch.float32)")
    cfg: GateConfig = parsed.config
    gates = {}
    for layer in range(cfg.n_layers):
        # on the device first: ``device="meta"`` reads headers only (meta tensors), which a CPU bias cannot copy
        gate = AttentionGate(cfg.n_heads, 0.0, cfg.temperature, cfg.mode, cfg.top_k).to("cpu" if device is None
                                                                                        else device)
        with torch.no_grad():
            gate.bias.copy_(state[f"layers.{layer}.bias"])
        gates[layer] = gate.eval()
    return GateSet(cfg, gates)


READER = Reader("sparse_attention", (CONFIG_FILE, WEIGHTS_FILE), parse_config, load_weights, build)


def write_gate_files(stage: Staging, files: tuple[dict[str, torch.Tensor], str]) -> None:
    """Write :meth:`GateSet.files` into an :func:`~nnsight_lorsa._atomic.atomic_directory` save (beside the
    other files of that save, e.g. a Hugging Face model's)."""
    tensors, text = files
    stage.save_tensors(WEIGHTS_FILE, tensors)
    stage.write_text(CONFIG_FILE, text)


def save_gate_set(gate_set: GateSet, directory: str | os.PathLike[str]) -> Path:
    """Write ``sparse_attention.json`` and ``sparse_attention.safetensors`` of ``gate_set`` into
    ``directory`` atomically (the registry's ``save(gate_set, directory, format="sparse_attention")``);
    the directory's other files (a model saved there) are kept, with their checksums.

    Raises:
        CheckpointError: the config is not JSON-serialisable (nothing is written).
    """
    files = gate_set.files()  # checked before the directory is touched
    with atomic_directory(directory, replace=False) as stage:
        write_gate_files(stage, files)
    return Path(directory)
