"""The one validation layer every checkpoint format goes through.

Config fields (from ``config.json`` / ``cfg.json`` / ``config.yaml``):

* :func:`config_value` — a field of a given type; ``bool`` is not an ``int``, an ``int`` is a
  ``float``, floats must be finite; missing/``null`` fields take the default or raise.
* :func:`config_size` / :func:`check_size` — a size is an integral ``int`` (not bool, not ``2.0``)
  in ``[1, MAX_SIZE]``, checked before anything is allocated; :func:`scaled_size` for
  ``d_model · expansion_factor``.
* :func:`check_d_model` — the checkpoint's width against the model's.
* :func:`check_version` — a format's ``version`` (an ``int``; ``true`` is not ``1``);
  :func:`check_mapping` — a field that must be a JSON object (``extra``).
* :func:`check_member_file` — a file name a manifest lists: relative, no ``..``, inside the directory.
* :func:`layer_of_name` — the layer of a ``layer_<digits>`` name (ASCII digits only; ``layer_ 2``,
  ``layer_+2``, ``layer_٢`` are refused, not read as 2).

Tensors (from safetensors files), before a module is built:

* :func:`check_tensor_inventory` — missing / unexpected tensors and shapes against the config.
* :func:`check_tensors` — floating dtypes where the module holds floats, every value finite;
  :func:`check_file_tensors` — the same on a file's tensors under the file's own names (before a
  reader renames, transposes or folds them).
* :func:`check_scalar` — 0-d statistics (e.g. dataset norms) finite and positive.
* :func:`build_module` — all of the above against the module's own state dict, then the module is
  allocated (no random init) and loaded strictly.

Every failure is a :class:`~nnsight_lorsa.errors.CheckpointError` whose message starts with the
file and names the key (``"…/cfg.json: key 'd_sae' must be a positive int, got True"``);
:class:`~nnsight_lorsa.errors.ConfigMismatchError` for a width that is not the model's.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from ..errors import CheckpointError, ConfigMismatchError

#: the largest size (width, latent count, head count, k) a config may declare: 2**24
MAX_SIZE = 1 << 24

M = TypeVar("M", bound=nn.Module)
_REQUIRED: Any = ...

__all__ = ["LAYER_NAME", "MAX_SIZE", "adapter_families", "build_module", "check_d_model", "check_file_tensors",
           "check_mapping", "check_member_file", "check_scalar", "check_size", "check_tensor_inventory",
           "check_tensors", "check_version", "config_size", "config_value", "layer_of_name", "looks_like_layer_name",
           "scaled_size"]

#: the one spelling of a layer in a file or folder name: ``layer_`` then ASCII digits
LAYER_NAME = re.compile(r"layer_([0-9]+)", re.ASCII)


def _type_name(kind: type | tuple[type, ...]) -> str:
    return kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)


def config_value(raw: Mapping[str, Any], key: str, path: Path | str, kind: type | tuple[type, ...],
                 default: Any = _REQUIRED) -> Any:
    """``raw[key]`` checked to be a ``kind`` (``bool`` never passes as ``int``; an ``int`` passes as
    ``float`` and is converted; a float must be finite); ``default`` when absent or ``null``.

    Raises:
        CheckpointError: ``"{path}: key {key!r} …"`` — missing without a default, wrong type, non-finite.
    """
    value = raw.get(key)
    if value is None:  # absent, or JSON null (pydantic dumps unset optionals as null)
        if default is _REQUIRED:
            raise CheckpointError(f"{path}: required key {key!r} is missing or null")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool) and int not in kinds:
        value = float(value)
    if isinstance(value, bool) and bool not in kinds:
        raise CheckpointError(f"{path}: key {key!r} must be {_type_name(kind)}, got {value!r}")
    if not isinstance(value, kinds):
        raise CheckpointError(f"{path}: key {key!r} must be {_type_name(kind)}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise CheckpointError(f"{path}: key {key!r} must be a finite number, got {value!r}")
    return value


def check_size(value: Any, path: Path | str, key: str, *, maximum: int = MAX_SIZE) -> int:
    """``value`` as a size: an ``int`` (not bool, not a float) in ``[1, maximum]``.

    Raises:
        CheckpointError: ``"{path}: key {key!r} must be a positive int …"``.
    """
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise CheckpointError(f"{path}: key {key!r} must be a positive int, got {value!r}")
    if value > maximum:
        raise CheckpointError(f"{path}: key {key!r} is {value}, above the largest size accepted ({maximum}); "
                              "refusing to allocate")
    return value


def config_size(raw: Mapping[str, Any], key: str, path: Path | str, default: Any = _REQUIRED, *,
                maximum: int = MAX_SIZE) -> int:
    """``raw[key]`` as a size (:func:`check_size`); ``default`` when absent or ``null``.

    Raises:
        CheckpointError: missing without a default, not a positive int, above ``maximum``.
    """
    value = raw.get(key)
    if value is None:
        if default is _REQUIRED:
            raise CheckpointError(f"{path}: required key {key!r} is missing or null")
        return int(default)
    return check_size(value, path, key, maximum=maximum)


def scaled_size(base: int, factor: Any, path: Path | str, key: str) -> int:
    """``base · factor`` (e.g. ``d_model · expansion_factor``) as a size; it must be integral.

    Raises:
        CheckpointError: ``factor`` not a positive finite number, a non-integral product, or one
            above :data:`MAX_SIZE`.
    """
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not math.isfinite(factor) or factor <= 0:
        raise CheckpointError(f"{path}: key {key!r} must be a positive number, got {factor!r}")
    product = base * factor
    if abs(product - round(product)) > 1e-6:
        raise CheckpointError(f"{path}: key {key!r}: d_model * expansion_factor = {product} is not an integer")
    return check_size(int(round(product)), path, key)


def check_d_model(found: int, expected: int | None, path: Path | str, key: str) -> None:
    """Raise when the model's width ``expected`` is given and differs from the checkpoint's ``found``.

    Raises:
        ConfigMismatchError: ``"{path}: {key} = {found} but the model's d_model is {expected}"``.
    """
    if expected is not None and found != expected:
        raise ConfigMismatchError(f"{path}: {key} = {found} but the model's d_model is {expected}")


def check_version(raw: Mapping[str, Any], path: Path | str, expected: int, key: str = "version") -> int:
    """``raw[key]`` must be the int ``expected`` (``true`` equals ``1`` in Python but is not a version).

    Raises:
        CheckpointError: ``"{path}: key 'version' is …; this package reads version {expected}"``.
    """
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value != expected:
        raise CheckpointError(f"{path}: key {key!r} is {value!r}; this package reads version {expected}")
    return value


def check_mapping(raw: Mapping[str, Any], key: str, path: Path | str, *, required: bool = False) -> dict[str, Any]:
    """``raw[key]`` as a JSON object (``{}`` when absent or ``null`` unless ``required``).

    Raises:
        CheckpointError: ``"{path}: key {key!r} must be a JSON object (a mapping), got …"``.
    """
    value = raw.get(key)
    if value is None and not required:
        return {}
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: key {key!r} must be a JSON object (a mapping), got {value!r}")
    return value


def check_member_file(directory: Path, name: Any, path: Path | str, key: str,
                      error: type[CheckpointError] = CheckpointError) -> Path:
    """``directory / name`` for a file name a manifest (``path``) lists under ``key``: a non-empty
    relative POSIX name without ``.`` / ``..`` parts or backslashes, whose real path (symlinks
    followed) stays inside ``directory``.

    Raises:
        CheckpointError (or ``error``): ``"{directory / name}: key {key!r} …"`` / ``"{path}: key {key!r} …"``.
    """
    if not isinstance(name, str) or not name:
        raise error(f"{path}: key {key!r} must be a file name, got {name!r}")
    parts = name.split("/")
    if name.startswith("/") or os.path.isabs(name) or "\\" in name or "\0" in name or any(
            part in ("", ".", "..") for part in parts):
        raise error(f"{path}: key {key!r} is {name!r}, not a relative file name inside {directory}")
    target = directory / name
    try:
        real, root = target.resolve(), directory.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise error(f"{target}: key {key!r}: cannot resolve the path ({e})") from e
    if real != root and root not in real.parents:
        raise error(f"{target}: key {key!r} leads outside {directory} (to {real})")
    return target


def adapter_families() -> frozenset[str]:
    """The adapter family names a checkpoint's ``architecture`` may hold (``ArchitectureAdapter.family``)."""
    from ..adapters.registry import ADAPTERS  # local: the adapters import transformers

    return frozenset(a.family for a in ADAPTERS)


def layer_of_name(name: str, suffix: str = "") -> int | None:
    """The layer of ``layer_<digits><suffix>`` (e.g. ``layer_2``, ``layer_02.safetensors``); None for
    another name. Only ASCII digits count: ``int()`` would read ``layer_ 2``, ``layer_+2``,
    ``layer_2_``, ``layer_٢`` as 2; those are None here (callers refuse or ignore them)."""
    m = LAYER_NAME.fullmatch(name[:len(name) - len(suffix)] if suffix and name.endswith(suffix) else
                             name if not suffix else "")
    return int(m.group(1)) if m else None


def looks_like_layer_name(name: str, suffix: str = "") -> bool:
    """Whether ``name`` starts ``layer_`` and has a digit after it (``layer_ 2``, ``layer_+2``): a name
    meant as a layer that :func:`layer_of_name` does not read."""
    stem = name[:len(name) - len(suffix)] if suffix and name.endswith(suffix) else name
    return stem.startswith("layer_") and any(c.isdigit() or c.isnumeric() for c in stem[len("layer_"):])


def check_scalar(value: torch.Tensor | None, path: Path | str, key: str, why: str = "") -> float:
    """A one-element tensor holding a finite positive number (e.g. a dataset norm), as a float.

    Raises:
        CheckpointError: ``"{path}: tensor {key!r} must be one positive finite norm{why}, got …"``.
    """
    if value is None or value.numel() != 1 or not math.isfinite(float(value)) or float(value) <= 0:
        raise CheckpointError(f"{path}: tensor {key!r} must be one positive finite norm{why}, got "
                              f"{None if value is None else value.tolist()}")
    return float(value)


def check_tensor_inventory(
    path: Path | str, found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], source: str
) -> None:
    """Compare the tensors a file holds (``found``: name -> shape) with what ``source`` implies.

    Raises:
        CheckpointError: ``"{path}: missing tensors [...]; unexpected tensors [...]; tensor 'k' has
            shape (…) but {source} implies (…) (expected from {source})"`` (every problem in one message).
    """
    problems = []
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        problems.append(f"missing tensors {missing}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    for key in sorted(set(found) & set(expected)):
        if tuple(found[key]) != tuple(expected[key]):
            problems.append(
                f"tensor {key!r} has shape {tuple(found[key])} but {source} implies {tuple(expected[key])}"
            )
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems) + f" (expected from {source})")


def check_tensors(path: Path | str, state: Mapping[str, torch.Tensor],
                  floating: Mapping[str, bool] | None = None) -> None:
    """Every tensor of ``state`` floating (where ``floating[key]`` says so; all when None) and finite.

    Raises:
        CheckpointError: ``"{path}: tensor {key!r} has non-floating dtype …"`` or
            ``"{path}: tensor {key!r} has N non-finite values (NaN/inf)"``.
    """
    for key, tensor in state.items():
        wants_float = True if floating is None else floating.get(key, tensor.is_floating_point())
        if wants_float and not tensor.is_floating_point():
            raise CheckpointError(f"{path}: tensor {key!r} has non-floating dtype {tensor.dtype}")
        if tensor.is_floating_point():
            bad = int((~torch.isfinite(tensor)).sum())
            if bad:
                raise CheckpointError(f"{path}: tensor {key!r} has {bad} non-finite values (NaN/inf)")


def check_file_tensors(path: Path | str, state: Mapping[str, torch.Tensor], exempt: tuple[str, ...] = ()) -> None:
    """Every tensor of a file (``state``, the file's own names) floating and finite, except the keys
    starting with one of ``exempt`` (buffers such as a causal mask or an unset norm placeholder).

    Raises:
        CheckpointError: ``"{path}: tensor {key!r} has non-floating dtype …"`` / ``"… non-finite values"``.
    """
    check_tensors(path, {k: v for k, v in state.items() if not k.startswith(exempt)})


def build_module(
    factory: Callable[[], M],
    state: Mapping[str, torch.Tensor],
    path: Path | str,
    source: str,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> M:
    """``factory()`` built on the meta device, ``state`` (read from ``path``) checked against its
    state dict (:func:`check_tensor_inventory`, :func:`check_tensors`), then allocated on
    ``device`` (default CPU) as ``dtype`` without random init and loaded strictly; in eval mode.

    Raises:
        CheckpointError: a missing or unexpected tensor, one whose shape differs from what ``source``
            (the config, named in the message) implies, a non-floating or non-finite tensor —
            naming ``path`` and the key.
    """
    try:
        with torch.device("meta"):
            module = factory()
    except CheckpointError as e:  # a config the module refuses (e.g. activation parameters): name the source
        raise CheckpointError(f"{path}: {source} does not describe a valid module: {e}") from e
    reference = module.state_dict()
    check_tensor_inventory(path, {k: tuple(v.shape) for k, v in state.items()},
                           {k: tuple(v.shape) for k, v in reference.items()}, source)
    check_tensors(path, state, {k: v.is_floating_point() for k, v in reference.items()})
    if dtype is not None:
        module = module.to(dtype)
    module.to_empty(device=torch.device("cpu") if device is None else device)
    with torch.no_grad():
        module.load_state_dict(dict(state), strict=True)
    return module.eval()
