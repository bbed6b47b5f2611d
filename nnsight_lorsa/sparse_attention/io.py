"""Save a gated model as a normal Hugging Face directory plus the gates, and load it back.

Layout of a directory written by :func:`save_sparse_model`:

- the Hugging Face files (``config.json``, ``model.safetensors``, tokenizer files if given): the
  fine-tuned weights *without* the gates, loadable by ``AutoModelForCausalLM`` or
  ``nnsight.LanguageModel`` (which then run ordinary dense attention);
- the gate files of the format registry's ``"sparse_attention"`` format
  (:mod:`nnsight_lorsa.formats.gate_format`): ``sparse_attention.json`` (the
  :class:`~nnsight_lorsa.formats.gate_format.GateConfig`) and ``sparse_attention.safetensors`` (one
  tensor ``layers.<L>.bias`` of shape ``(n_heads,)`` per layer);
- ``checksums.json``: every file's size and sha256.

Both savers are atomic (:func:`nnsight_lorsa._atomic.atomic_directory`: staged in a sibling, swapped
in), so a crash leaves the old directory or the new one; :func:`save_gates` into an existing directory
replaces the gate files only (the model's files beside them are kept, with their checksums). The
loaders check ``checksums.json`` when present.

:func:`load_gates` puts the gates on such a model (HF or nnsight), :func:`load_sparse_model` does
both steps for a plain transformers model.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .._atomic import atomic_directory, check, manifest_of, resolve
from ..adapters.registry import get_adapter
from ..adapters.transformers_internals import children_removed, saved_attn_implementation
from ..envoy.nnsight_internals import hf_module
from ..errors import ArgumentError, CheckpointError, GateConfigError
from ..formats.gate_format import GateConfig, GateSet, write_gate_files
from ..formats.registry import load, save
from .attention import GATE_NAME
from .install import _DENSE_ATTR, get_gates, install_gated_attention

__all__ = ["load_gates", "load_sparse_model", "save_gates", "save_sparse_model"]


def _gate_set(model: Any, training: dict[str, Any] | None) -> GateSet:
    """The :class:`GateSet` of ``model``'s gates (the gate modules themselves, not copies)."""
    hf = hf_module(model)
    gates = get_gates(model)
    first = gates[0]
    for layer, gate in gates.items():  # one setting for all (the file holds one): a layer's own was dropped silently
        if (gate.temperature, gate.mode, gate.top_k) != (first.temperature, first.mode, first.top_k):
            raise GateConfigError(f"layer {layer}'s gate has temperature={gate.temperature}, mode={gate.mode!r}, "
                                  f"top_k={gate.top_k}, layer 0's {first.temperature}, {first.mode!r}, {first.top_k}: "
                                  "the gate files hold one setting for every layer (set_gate_mode sets them all)")
    cfg = GateConfig(model_type=str(hf.config.model_type), n_layers=len(gates), n_heads=first.n_heads,
                     temperature=first.temperature, mode=first.mode, top_k=first.top_k, training=training)
    return GateSet(cfg, gates)


def save_gates(model: Any, directory: str | Path, training: dict[str, Any] | None = None) -> Path:
    """Write ``sparse_attention.json`` and ``sparse_attention.safetensors`` for ``model``'s gates
    (the registry's ``save(..., format="sparse_attention")``).

    Atomic: the other files of ``directory`` (a model saved there) are kept.

    Raises:
        GateNotInstalledError: the model has no gates.
        GateConfigError: the gates' temperature, mode or top_k differ between layers (nothing is written).
        CheckpointError: ``training`` is not JSON-serialisable (nothing is written).
    """
    return save(_gate_set(model, training), directory, format="sparse_attention")


def load_gates(model: Any, directory: str | Path) -> dict[int, Any]:
    """Install gated attention on ``model`` (HF or nnsight) with the gates saved in ``directory``
    (read through the registry: ``load(directory, format="sparse_attention")``).

    Returns:
        ``{layer: gate}`` (the gates installed on the model, each on its attention module's device).

    Raises:
        CheckpointError: missing/malformed files (a non-finite or non-float bias included), or the
            gates do not fit the model (model type, layer or head count, tensor names or shapes).
        ArgumentError: ``directory`` not a str / ``os.PathLike``.

    Source: ours (a Hugging Face directory plus this package's gate files).
    """
    from ..formats.files import check_path

    check_path(directory, "load_gates", "a directory")
    hf = hf_module(model)
    adapter = get_adapter(hf)
    # `<directory>.old` when a save was killed between its two renames; verified against checksums.json
    saved: GateSet = load(resolve(directory), format="sparse_attention", model_type=hf.config.model_type,
                          n_layers=adapter.n_layers, n_heads=adapter.n_heads)
    cfg = saved.config
    gates = install_gated_attention(model, temperature=cfg.temperature, mode=cfg.mode, top_k=cfg.top_k)
    with torch.no_grad():
        for layer, gate in gates.items():
            gate.bias.copy_(saved[layer].bias)
    return gates


def save_sparse_model(model: Any, directory: str | Path, tokenizer: Any = None,
                      training: dict[str, Any] | None = None) -> Path:
    """Save ``model`` as a Hugging Face directory (weights without gates) plus its gates.

    The model's ``config.json`` records its original (dense) attention implementation, so plain
    transformers loads the directory as the fine-tuned dense model; :func:`load_gates` adds the gates.

    Atomic: the Hugging Face files, the tokenizer's and the gates are staged together and swapped in.

    Raises:
        GateNotInstalledError: the model has no gates.
        GateConfigError: the gates' temperature, mode or top_k differ between layers (nothing is written).
        CheckpointError: ``training`` is not JSON-serialisable (nothing is written).
        ArgumentError: ``directory`` not a str / ``os.PathLike``, ``tokenizer`` not None or an object with
            ``save_pretrained``, ``training`` not None or a mapping (nothing is written).

    Source: ours (a Hugging Face directory plus this package's gate files).
    """
    from ..formats.files import check_path

    check_path(directory, "save_sparse_model", "a directory")
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise ArgumentError(f"save_sparse_model: tokenizer must be None or a tokenizer (with save_pretrained), got a "
                            f"{type(tokenizer).__name__}")
    if training is not None and not isinstance(training, Mapping):
        raise ArgumentError(f"save_sparse_model: training must be None or a mapping of what the run was, got a "
                            f"{type(training).__name__}")
    hf = hf_module(model)
    gate_set = _gate_set(model, training)
    gate_files = gate_set.files()  # checked before anything is written
    adapter = get_adapter(hf)
    attns = [adapter.attention_module(hf, layer) for layer in gate_set.gates]
    with atomic_directory(directory) as stage:
        # the gates off the module tree, the dense implementation in the config, while transformers serialises it
        with children_removed(attns, GATE_NAME), saved_attn_implementation(hf, getattr(hf, _DENSE_ATTR)):
            hf.save_pretrained(stage.path, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(stage.path)
        stage.record_all()
        write_gate_files(stage, gate_files)
    return Path(directory)


def load_sparse_model(directory: str | Path, **from_pretrained_kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained(directory)`` with the saved gates installed (eval mode).

    The model comes back in the dtype it was saved in (``dtype="auto"``: the dtype its ``config.json``
    records, so a bf16 model keeps its logits bit for bit; the gates compute in fp32 as always), unless
    ``from_pretrained_kwargs`` give ``dtype=``.

    Raises:
        CheckpointError: see :func:`load_gates`; also no ``config.json`` in ``directory``, or a file failing
            ``checksums.json`` (checked before transformers reads any).
    """
    from transformers import AutoModelForCausalLM

    directory = resolve(directory)
    if not (directory / "config.json").is_file():  # transformers took a missing directory for a Hub id
        raise CheckpointError(f"{directory / 'config.json'}: missing (not a directory written by save_sparse_model)")
    entries = manifest_of(directory)
    if entries is not None:  # the model's files too, as saved: before transformers reads them (until 2026-11-28
        check(directory, entries)  # after: a truncated model.safetensors raised safetensors' own error)
    kwargs = {"dtype": "auto", **from_pretrained_kwargs}  # the saved dtype (transformers 4's default was fp32)
    model = AutoModelForCausalLM.from_pretrained(str(directory), **kwargs).eval()
    load_gates(model, directory)
    return model
