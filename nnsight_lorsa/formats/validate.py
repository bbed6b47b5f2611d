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
  ``layer_+2``, ``layer_٢`` are refused, not read as 2); :func:`check_numbered` — layers 0..n-1.

Declared specs: a reader states its config fields as :class:`Field` s (type, default, size /
positive / choices / an exact tag) read by :func:`read_fields`, and its tensors as a
:class:`TensorSpec` (name -> shape in config-field names) checked by :func:`check_declared_tensors`.
One-off conditions a spec cannot state go through :func:`require`; files through
:func:`require_file` and :func:`file_errors` (OS / parser errors translated, naming the file); a
config object our module classes refuse through :func:`config_errors`.

Tensors (from safetensors files), before a module is built:

* :func:`check_tensor_inventory` — missing / unexpected tensors and shapes against the config.
* :func:`check_tensors` — floating dtypes where the module holds floats, every value finite;
  :func:`check_file_tensors` — the same on a file's tensors under the file's own names (before a
  reader renames, transposes or folds them).
* :func:`check_scalar` — 0-d statistics (e.g. dataset norms) finite and positive.
* :func:`build_module` — all of the above against the module's own state dict, then the module is
  allocated (no random init) and loaded strictly.

This module is the only place in :mod:`nnsight_lorsa.formats` that raises a file error. Every
failure is a :class:`~nnsight_lorsa.errors.CheckpointError` whose message starts with the
file and names the key (``"…/cfg.json: key 'd_sae' must be a positive int, got True"``);
:class:`~nnsight_lorsa.errors.ConfigMismatchError` for a width that is not the model's.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
from torch import nn

from ..errors import CheckpointError, ConfigMismatchError, UnsupportedArchitectureError

#: the largest size (width, latent count, head count, k) a config may declare: 2**24
MAX_SIZE = 1 << 24

M = TypeVar("M", bound=nn.Module)
_REQUIRED: Any = ...

__all__ = ["LAYER_NAME", "MAX_SIZE", "Field", "TensorSpec", "adapter_families", "build_module", "check_d_model",
           "check_declared_tensors", "check_file_tensors", "check_mapping", "check_member_file", "check_numbered",
           "check_scalar", "check_size", "check_tensor_inventory", "check_tensors", "check_version", "config_errors",
           "config_size", "config_value", "file_errors", "layer_of_name", "looks_like_layer_name", "read_fields",
           "refuse", "require", "require_file", "scaled_size"]

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


def scaled_size(base: int, factor: Any, path: Path | str, key: str, *, floor: bool = False) -> int:
    """``base · factor`` (e.g. ``d_model · expansion_factor``) as a size; it must be integral (within 1e-6, then
    rounded). ``floor``: the format's own rule is ``int(base * factor)`` in floating point (Llamascopium's
    ``d_sae`` property, ``models/sparse_dictionary.py``): that, whatever the product's fraction — a file written
    with ``expansion_factor = d_sae / d_model`` whose product rounds to just below ``d_sae`` has ``d_sae − 1``
    latents there, and so here.

    Raises:
        CheckpointError: ``factor`` not a positive finite number, a non-integral product (unless ``floor``), or a
            size outside ``[1, MAX_SIZE]``.
    """
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not math.isfinite(factor) or factor <= 0:
        raise CheckpointError(f"{path}: key {key!r} must be a positive number, got {factor!r}")
    product = base * factor
    if not math.isfinite(product):
        raise CheckpointError(f"{path}: key {key!r}: d_model * expansion_factor = {product} is no size")
    if floor:
        return check_size(int(product), path, key)
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


def refuse(path: os.PathLike[str] | str | None, detail: str, *, error: type[Exception] = CheckpointError) -> NoReturn:
    """Refuse a file (or, ``path`` None, a source) for a reason no declared spec states.

    Raises:
        CheckpointError (or ``error``): ``"{path}: {detail}"`` (``detail`` alone when ``path`` is None).
    """
    raise error(detail if path is None else f"{path}: {detail}")


def require(ok: Any, path: os.PathLike[str] | str | None, detail: str, *,
            error: type[Exception] = CheckpointError) -> None:
    """A condition a reader states that no :class:`Field` / :class:`TensorSpec` expresses (two
    fields that must agree, a list entry, a file that must not be there).

    Raises:
        CheckpointError (or ``error``): ``"{path}: {detail}"`` (``detail`` alone when ``path`` is None)
            when ``ok`` is false.
    """
    if not ok:
        refuse(path, detail, error=error)


def require_file(path: Path, hint: str = "") -> Path:
    """``path`` must be a file.

    Raises:
        CheckpointError: ``"{path}: file not found{hint}"``.
    """
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found{hint}")
    return path


@contextmanager
def file_errors(path: Path | str, translate: Mapping[type[BaseException] | tuple[type[BaseException], ...], str]
                ) -> Iterator[None]:
    """Reading ``path``: an exception of a type in ``translate`` becomes a :class:`CheckpointError`
    ``"{path}: {message}"`` (``message`` formatted with ``e`` and ``type``, the exception and its
    type name); our own errors pass through.

    Raises:
        CheckpointError: a translated parser / OS error, naming the file.
    """
    try:
        yield
    except CheckpointError:
        raise
    except Exception as e:
        for kinds, message in translate.items():
            if isinstance(e, kinds):
                raise CheckpointError(f"{path}: {message.format(e=e, type=type(e).__name__)}") from e
        raise


@contextmanager
def config_errors(path: Path | str, key: str, refuses: tuple[type[BaseException], ...] = (CheckpointError,), *,
                  unsupported: str | None = None) -> Iterator[None]:
    """Building our config object from a file's ``key``: an error of ``refuses`` (the config class's
    own checks) becomes a :class:`CheckpointError` ``"{path}: {key}: {e}"``; an
    :class:`~nnsight_lorsa.errors.UnsupportedArchitectureError` is re-raised naming ``path`` and
    ``unsupported`` (default ``key``).

    Raises:
        CheckpointError: the config class refused the values.
        UnsupportedArchitectureError: a setting our modules cannot reproduce.
    """
    try:
        yield
    except UnsupportedArchitectureError as e:
        label = key if unsupported is None else unsupported
        raise UnsupportedArchitectureError(f"{path}: {label}: {e}" if label else f"{path}: {e}") from e
    except refuses as e:
        raise CheckpointError(f"{path}: {key}: {e}" if key else f"{path}: {e}") from e


_ANY: Any = object()


@dataclass(frozen=True)
class Field:
    """One config field a reader declares (read by :func:`read_fields`).

    Attributes:
        key: the key in the config mapping.
        kind: the type(s) accepted (:func:`config_value`'s rules; ``object``: any).
        default: the value when absent or ``null`` (required when not given).
        size: a size (:func:`check_size`: an int in ``[1, MAX_SIZE]``; ``kind`` unused).
        positive: a number that must be > 0.
        choices: the values accepted; another raises ``error`` listing them.
        equals: the one value accepted (a format tag): ``"key 'format' is …, expected …"``.
        error: the error for a value outside ``choices`` (e.g. ``UnsupportedArchitectureError``
            for a setting our modules cannot reproduce).
    """

    key: str
    kind: type | tuple[type, ...] = object
    default: Any = _REQUIRED
    size: bool = False
    positive: bool = False
    choices: Collection[Any] | None = None
    equals: Any = _ANY
    error: type[Exception] = CheckpointError

    def read(self, raw: Mapping[str, Any], path: Path | str, label: str | None = None) -> Any:
        """The field's value from ``raw`` (a config mapping read from ``path``), checked.

        Raises:
            CheckpointError (or ``error`` for ``choices``): naming ``path`` and ``label`` (default: the key).
        """
        label = label or self.key
        if self.equals is not _ANY:
            value = raw.get(self.key)
            if value != self.equals or type(value) is not type(self.equals):
                raise CheckpointError(f"{path}: key {label!r} is {value!r}, expected {self.equals!r}")
            return value
        if self.size:
            value = raw.get(self.key)
            if value is None:
                if self.default is _REQUIRED:
                    raise CheckpointError(f"{path}: required key {label!r} is missing or null")
                return self.default
            return check_size(value, path, label)
        if self.kind is dict:
            value = raw.get(self.key)
            if value is None and self.default is not _REQUIRED:
                return self.default
            if not isinstance(value, dict):
                raise CheckpointError(f"{path}: key {label!r} must be a JSON object (a mapping), got {value!r}")
            return value
        value = config_value({label: raw.get(self.key)}, label, path, self.kind, self.default)
        if value is None:
            return value
        if self.positive and not value > 0:
            raise CheckpointError(f"{path}: key {label!r} must be a positive number, got {value!r}")
        if self.choices is not None and (not isinstance(value, Hashable) or value not in self.choices):
            raise self.error(f"{path}: key {label!r} is {value!r}; supported: {sorted(self.choices, key=str)}")
        return value


def read_fields(raw: Mapping[str, Any], path: Path | str, fields: Sequence[Field], *, prefix: str = ""
                ) -> dict[str, Any]:
    """``{field.key: value}`` for each declared :class:`Field` of ``raw`` (read from ``path``), in
    order; ``prefix`` is put before each key in messages (``"config."`` for a nested object).

    Raises:
        CheckpointError: the first field that fails (naming ``path`` and ``prefix + key``).
    """
    return {f.key: f.read(raw, path, prefix + f.key) for f in fields}


@dataclass(frozen=True)
class TensorSpec:
    """The tensors a file holds, declared by its reader: name -> shape, each dimension a config field
    name or an int; names may hold ``{i}`` (a layer index), formatted from the dimensions.

    Attributes:
        required: tensors the file must hold.
        optional: tensors it holds when the config says so (named in ``with_`` of :meth:`shapes`).
    """

    required: Mapping[str, tuple[str | int, ...]]
    optional: Mapping[str, tuple[str | int, ...]] = field(default_factory=dict)

    def shapes(self, dims: Mapping[str, int], with_: Iterable[str] = ()) -> dict[str, tuple[int, ...]]:
        """``{name: shape}`` in numbers: the required tensors and the optional ones in ``with_``."""
        chosen = {**self.required, **{k: self.optional[k] for k in with_}}
        return {name.format(**dims): tuple(d if isinstance(d, int) else dims[d] for d in shape)
                for name, shape in chosen.items()}


def check_declared_tensors(path: Path | str, found: Mapping[str, Any], spec: TensorSpec, dims: Mapping[str, int],
                           source: str, *, with_: Iterable[str] = ()) -> dict[str, tuple[int, ...]]:
    """The tensors of a file (``found``: name -> tensor or shape) against ``spec`` at ``dims``
    (:func:`check_tensor_inventory`); returns the expected shapes.

    Raises:
        CheckpointError: a missing or unexpected tensor, or a shape ``source`` does not imply.
    """
    expected = spec.shapes(dims, with_)
    shapes = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(v) for k, v in found.items()}
    check_tensor_inventory(path, shapes, expected, source)
    return expected


def check_numbered(found: Iterable[int], path: Path | str, what: str) -> None:
    """Layer numbers must be 0..n-1.

    Raises:
        CheckpointError: ``"{path}: {what} 0..n-1, found layers [...]"``.
    """
    layers = sorted(found)
    if layers != list(range(len(layers))):
        raise CheckpointError(f"{path}: {what} 0..n-1, found layers {layers}")


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


#: elements per slice that :func:`count_non_finite` examines at once (its temporaries: ~6 bytes an element)
FINITE_CHUNK = 1 << 20


def count_non_finite(tensor: torch.Tensor) -> int:
    """The number of NaN / inf entries of the floating ``tensor``, examined in slices along its first dim of at
    most :data:`FINITE_CHUNK` elements (a row more where one row is larger), so that the check's temporaries
    (``isfinite`` computes ``|x|`` in the tensor's dtype, then two bool masks: ~1.5x the slice) stay a few MB
    instead of 1.5x the largest tensor of a checkpoint (issue 21: 0.75x a Lorsa's size on load)."""
    if tensor.dim() == 0 or tensor.numel() == 0:
        return int((~torch.isfinite(tensor)).sum())
    rows = max(1, FINITE_CHUNK // max(1, tensor[0].numel()))
    total = torch.zeros((), dtype=torch.int64, device=tensor.device)
    for part in tensor.split(rows):  # summed where the tensor is: one value read at the end (one sync on a GPU)
        total += (~torch.isfinite(part)).sum()
    return int(total)


def check_tensors(path: Path | str, state: Mapping[str, torch.Tensor],
                  floating: Mapping[str, bool] | None = None) -> None:
    """Every tensor of ``state`` floating (where ``floating[key]`` says so; all when None) and finite.

    Raises:
        CheckpointError: ``"{path}: tensor {key!r} has non-floating dtype …"`` or
            ``"{path}: tensors [...] have non-finite values (NaN/inf): tensor {key!r} has N, …"``
            (every non-finite tensor named).
    """
    counts: dict[str, int] = {}
    for key, tensor in state.items():
        wants_float = True if floating is None else floating.get(key, tensor.is_floating_point())
        if wants_float and not tensor.is_floating_point():
            raise CheckpointError(f"{path}: tensor {key!r} has non-floating dtype {tensor.dtype}")
        if tensor.is_floating_point() and tensor.device.type != "meta":  # meta: a header-only load, no values
            bad = count_non_finite(tensor)
            if bad:
                counts[key] = bad
    if counts:
        each = ", ".join(f"tensor {key!r} has {n}" for key, n in counts.items())
        raise CheckpointError(f"{path}: tensors {list(counts)} have non-finite values (NaN/inf): {each}")


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

    ``dtype`` None is the stored dtype (:func:`stored_dtype`: the widest, where the floating tensors are stored
    in several, so that every stored value loads exactly); a ``dtype`` given casts every tensor to it, each
    rounded once, and a value the cast would turn into ``inf`` is refused (:func:`check_cast`).

    Raises:
        CheckpointError: a missing or unexpected tensor, one whose shape differs from what ``source``
            (the config, named in the message) implies, a non-floating or non-finite tensor, a value that the
            cast to ``dtype`` overflows (:func:`check_cast`) — naming ``path`` and the key.
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
    if dtype is None:
        dtype = stored_dtype(state)
    if dtype is not None:
        module = module.to(dtype)
    module.to_empty(device=torch.device("cpu") if device is None else device)
    with torch.no_grad():
        module.load_state_dict(dict(state), strict=True)
    if dtype is not None:
        check_cast(path, state, module)
    return module.eval()


def stored_dtype(state: Mapping[str, torch.Tensor]) -> torch.dtype | None:
    """The dtype a checkpoint loads in by default: that of its floating tensors, the widest of them where they
    are stored in several (``torch.promote_types``: bf16 with fp16 is fp32, anything with fp64 is fp64), which
    holds every stored value exactly; None where ``state`` has no floating tensor."""
    out: torch.dtype | None = None
    for t in state.values():
        if t.is_floating_point():
            out = t.dtype if out is None else torch.promote_types(out, t.dtype)
    return out


def check_cast(path: Path | str, state: Mapping[str, torch.Tensor], module: nn.Module) -> None:
    """Refuse a load whose ``dtype=`` cast turned a stored (finite) value into ``inf``: a value past the
    dtype's range (fp16: ``|v| > 65504``) would otherwise load as an ``inf`` weight and the module compute NaN.

    Raises:
        CheckpointError: naming ``path``, the tensor, its largest stored value and the dtype."""
    for key, t in module.state_dict().items():
        stored = state.get(key)
        if (stored is None or not t.is_floating_point() or t.device.type == "meta" or t.dtype == stored.dtype
                or not count_non_finite(t)):
            continue
        big = float(stored.detach().abs().max())
        raise CheckpointError(f"{path}: {key} holds values beyond {t.dtype}'s range (max |v| = {big:.4g}, stored "
                              f"as {stored.dtype}), which the cast to {t.dtype} would turn into inf: load it with "
                              "a wider dtype (dtype=torch.float32 or torch.bfloat16)")
