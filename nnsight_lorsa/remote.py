"""Preparing nnsight-lorsa objects for remote execution on NDIF (``model.trace(..., remote=True)``).

A remote trace ships its ``with``-block as source plus every object the block names, pickled by
nnsight's serializer (``nnsight.intervention.serialization``); the model itself is referenced by
name and never sent. A :class:`~nnsight_lorsa.LorsaSet` named in the block travels **by value**:
its Lorsa weights as tensors, and this package's classes and functions as source (the server
does not have ``nnsight_lorsa`` installed). This module makes that explicit and cheap:

- :func:`register` ships this package by value (``nnsight.register``) and makes ``remote=True``
  measure every request before sending it (:class:`MeasuredRemoteBackend`);
- :func:`for_remote` keeps only the layers a trace uses of a
  :class:`~nnsight_lorsa.ReplacementModel`, cast to the model's dtype;
- :func:`payload_report` / :func:`check_payload` count what an object adds to a request, tensor
  by tensor, and raise :class:`PayloadTooLargeError` (naming the largest tensors) above a cap;
- :func:`remote_backend` builds a measured backend by hand, also as a dry run that keeps the
  exact request bytes instead of sending them.

>>> import torch
>>> from nnsight_lorsa import Lorsa, LorsaConfig
>>> cfg = LorsaConfig(d_model=4096, n_qk_heads=32, d_qk_head=128, n_ov_heads=32768, top_k=128)
>>> payload_report(Lorsa(cfg, device="meta", dtype=torch.bfloat16)).total_tensor_bytes
604069888

See ``docs/remote.md`` for the NDIF walk-through (Llama-3.1-8B) and the two-phase mode.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from ._checks import check_flag, is_collection, is_int, is_real
from ._placement import HOST, check_dtype_arg, past_range
from .attribution.remote_handles import check_block_calls, mark_bundles, rebuild_results
from .envoy.nnsight_internals import (
    SerializingRemoteBackend,
    block_body,
    block_names,
    check_traceable,
    hf_module,
    install_remote_backend,
    remote_env,
    request_envelope,
    sent_by_reference,
    serialize,
)
from .envoy.replacement_model import ReplacementModel
from .envoy.replacement_set import ReplacementSet
from .errors import ArgumentError, LayerOutOfRangeError, LorsaError, PlacementError
from .ndif_rules import NotWhitelistedError, check_request
from .server_version import check_server_version

#: Environment variable holding the default payload cap (bytes, or with a unit: ``"1.5GB"``, ``"512MiB"``).
CAP_ENV = "NNSIGHT_LORSA_MAX_PAYLOAD"
#: The largest request NDIF's queue takes, in bytes: the API pushes ``pickle.dumps(backend_request)`` (the request
#: body plus its envelope) onto a Redis list (``ndif-team/ndif`` at ``b7ac71f4e4a96fa95b1f155d613eba6069441db1``,
#: ``src/services/api/src/app.py``), and Redis refuses a value above its ``proto-max-bulk-len``, 512mb by
#: default -- Redis units, 512 * 1024**2 = 536,870,912 bytes.
NDIF_QUEUE_LIMIT_BYTES = 512 * 1024 * 1024
#: Bytes the queue adds around the request body: the pickled envelope (request id, API key, model key, headers).
#: Measured at about 1 KB with nnsight 0.8.1; bounded generously here.
QUEUE_OVERHEAD_BYTES = 64 * 1024
#: Default payload cap when ``NNSIGHT_LORSA_MAX_PAYLOAD`` is unset: 500 MB (500,000,000 bytes), under
#: :data:`NDIF_QUEUE_LIMIT_BYTES` minus :data:`QUEUE_OVERHEAD_BYTES` (536,805,376 bytes): a larger request would be
#: refused by the queue, after the upload.
DEFAULT_CAP_BYTES = 500_000_000

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


class QueueLimitError(LorsaError, ValueError):
    """A remote request is larger than NDIF's request queue takes (:data:`NDIF_QUEUE_LIMIT_BYTES` with the
    queue's envelope), whatever the cap says: raised before anything is sent.

    Attributes:
        request_bytes: the serialized request (what would be POSTed).
        limit_bytes: the queue's limit it exceeds (with :data:`QUEUE_OVERHEAD_BYTES`).

    Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
    """

    def __init__(self, message: str, request_bytes: int, limit_bytes: int) -> None:
        super().__init__(message)
        self.request_bytes = request_bytes
        self.limit_bytes = limit_bytes


class PayloadTooLargeError(LorsaError, ValueError):
    """A remote request would exceed the payload cap; the message names the largest tensors.

    Attributes:
        report: the :class:`PayloadReport` that was measured.
        cap_bytes: the cap it exceeded.

    Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
    """

    def __init__(self, message: str, report: PayloadReport, cap_bytes: int) -> None:
        super().__init__(message)
        self.report = report
        self.cap_bytes = cap_bytes


# ------------------------------------------------------------------ registration
def register(*, guard: bool = True) -> None:
    """Prepare this process for remote traces that use nnsight-lorsa.

    1. ``nnsight.register(nnsight_lorsa)``: ship this package's classes and functions by value
       (as source). An editable install looks installed to nnsight, so it is not registered
       automatically, and the NDIF server does not have the package.
    2. With ``guard`` (default), make ``model.trace(..., remote=True)`` and
       ``model.session(remote=True)`` build a :class:`MeasuredRemoteBackend`: each request is
       measured before it is sent (printed with nnsight's remote logging; ``tracer.backend.report``
       afterwards) and refused above :func:`default_cap_bytes`. It replaces the ``RemoteBackend``
       name in ``nnsight.intervention.backends.remote`` by a subclass; :func:`unregister` undoes it.

    Call it before the trace (nnsight decides how to pickle at serialization time).

    Raises:
        ArgumentError: ``guard`` not a bool (before anything is registered).

    Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
    """
    import nnsight

    check_flag(guard, "guard", "register")
    nnsight.register(sys.modules[__package__])
    if guard:
        install_remote_backend(MeasuredRemoteBackend)


def unregister() -> None:
    """Undo :func:`register`: nnsight's own ``RemoteBackend`` again, and this package by reference.

    Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
    """
    from cloudpickle import unregister_pickle_by_value

    install_remote_backend(None)
    with contextlib.suppress(ValueError):  # not registered
        unregister_pickle_by_value(sys.modules[__package__])


# ------------------------------------------------------------------ measuring
@dataclass(frozen=True)
class TensorSize:
    """One tensor an object would add to a request.

    Attributes:
        name: where it sits, e.g. ``"lorsas[15].W_V"``.
        shape: its shape.
        dtype: its dtype, e.g. ``"torch.bfloat16"``.
        nbytes: bytes pickling ships for it: its whole storage (a view ships its base tensor's
            storage), 0 if an earlier tensor of the report already shipped that storage.
        layer: the Lorsa layer it belongs to, when it belongs to a :class:`LorsaSet`.

    Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    layer: int | None = None


@dataclass(frozen=True)
class PayloadReport:
    """What an object (or a request) sends: its tensors, largest first, and optionally the exact size.

    Attributes:
        tensors: the tensors found, largest first.
        serialized_bytes: the exact payload length from nnsight's serializer, when measured
            (``payload_report(..., serialize=True)``, or a request sent through
            :class:`MeasuredRemoteBackend`), else None.
        compressed: whether ``serialized_bytes`` is after nnsight's zstd compression.

    Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
    """

    tensors: tuple[TensorSize, ...]
    serialized_bytes: int | None = None
    compressed: bool | None = None

    @property
    def total_tensor_bytes(self) -> int:
        """Bytes of tensor data (each storage counted once).

        Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
        """
        return sum(t.nbytes for t in self.tensors)

    @property
    def total_bytes(self) -> int:
        """The serialized size when measured, else the tensor bytes (what the cap is checked against).

        Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
        """
        return self.serialized_bytes if self.serialized_bytes is not None else self.total_tensor_bytes

    @property
    def by_layer(self) -> dict[int | None, int]:
        """Tensor bytes per Lorsa layer (key None: tensors outside a LorsaSet).

        Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
        """
        out: dict[int | None, int] = {}
        for t in self.tensors:
            out[t.layer] = out.get(t.layer, 0) + t.nbytes
        return out

    def largest(self, n: int = 5) -> list[TensorSize]:
        """The ``n`` largest tensors.

        Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
        """
        return list(self.tensors[:n])

    def format(self, n: int = 5) -> str:
        """A short human-readable summary: totals, bytes per layer, the ``n`` largest tensors.

        Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
        """
        lines = [f"tensors: {format_bytes(self.total_tensor_bytes)} in {len(self.tensors)} tensors"]
        if self.serialized_bytes is not None:
            how = "zstd-compressed" if self.compressed else "uncompressed"
            lines.append(f"serialized request: {format_bytes(self.serialized_bytes)} ({how}, nnsight's serializer)")
        layers = {k: v for k, v in self.by_layer.items() if k is not None}
        if layers:
            lines.append("per layer: " + ", ".join(f"{k}: {format_bytes(v)}" for k, v in sorted(layers.items())))
        for t in self.largest(n):
            lines.append(f"  {t.name:<32} {format_bytes(t.nbytes):>10}  {'x'.join(map(str, t.shape))} {t.dtype}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def format_bytes(n: int) -> str:
    """``604069888`` -> ``"604.1 MB"`` (decimal units).

    Raises:
        ArgumentError: ``n`` not a finite number ``>= 0``.

    Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
    """
    if not is_real(n) or not math.isfinite(n) or n < 0:
        raise ArgumentError(f"format_bytes: n must be a byte count (a finite number >= 0), got {n!r}")
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def parse_bytes(value: Any) -> int:
    """``"1.5GB"`` / ``"512MiB"`` / ``"1000000"`` / ``1000000`` -> bytes (a positive count).

    Raises:
        ArgumentError: (a ``ValueError`` and a ``TypeError``) an unknown unit, a malformed or non-positive
            number, a bool, a float or any other type.

    Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ArgumentError(f"a byte count is an int or a string such as '1.5GB', got {value!r} "
                            f"({type(value).__name__})")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if m is None or m.group(2).upper() not in _UNITS:
            raise ArgumentError(f"cannot read {value!r} as a byte count (e.g. 1000000, 1.5GB, 512MiB)")
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n < 1:
        raise ArgumentError(f"a byte count must be positive, got {value!r}")
    return n


def default_cap_bytes() -> int:
    """The payload cap: ``$NNSIGHT_LORSA_MAX_PAYLOAD`` if set, else :data:`DEFAULT_CAP_BYTES` (500 MB).

    Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
    """
    value = os.environ.get(CAP_ENV)
    return DEFAULT_CAP_BYTES if not value else parse_bytes(value)


def _storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    if t.device.type == "meta":
        return None  # no data: each tensor counted on its own
    return (str(t.device), t.untyped_storage().data_ptr())


def _storage_bytes(t: torch.Tensor) -> int:
    if t.device.type == "meta":
        return t.numel() * t.element_size()
    return t.untyped_storage().nbytes()


def _is_reference(obj: Any) -> bool:
    """Objects nnsight sends by reference (persistent id: the model's modules) or not at all (envoys)."""
    if isinstance(obj, nn.Module) and sent_by_reference(obj):
        return True
    return type(obj).__module__.startswith("nnsight.")


def _named_tensors(obj: Any, name: str, depth: int = 0) -> Iterator[tuple[str, torch.Tensor, int | None]]:
    """``(name, tensor, layer)`` for the tensors pickling ``obj`` would ship (model weights excluded)."""
    if depth > 6 or _is_reference(obj):
        return
    if isinstance(obj, torch.Tensor):
        yield name, obj, None
    elif isinstance(obj, ReplacementModel):
        for slot, s in obj.sets():
            yield from _named_tensors(s, slot, depth + 1)
    elif isinstance(obj, ReplacementSet):  # every replacement kind, through the set contract
        for key, module in obj.items():
            for sub, t, _ in _named_tensors(module, f"{name}{obj.label(key)}", depth + 1):
                yield sub, t, obj.layer_of(key)
    elif isinstance(obj, nn.Module):
        for sub, t in (*obj.named_parameters(), *obj.named_buffers()):
            yield f"{name}.{sub}", t, None
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _named_tensors(value, f"{name}[{key!r}]", depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _named_tensors(value, f"{name}[{i}]", depth + 1)


def _report_from(items: Iterable[tuple[str, torch.Tensor, int | None]]) -> PayloadReport:
    seen: set[tuple[str, int]] = set()
    sizes = []
    for name, t, layer in items:
        key = _storage_key(t)
        nbytes = 0 if key is not None and key in seen else _storage_bytes(t)
        if key is not None:
            seen.add(key)
        sizes.append(TensorSize(name, tuple(t.shape), str(t.dtype), nbytes, layer))
    sizes.sort(key=lambda s: -s.nbytes)
    return PayloadReport(tuple(sizes))


def serialized_size(obj: Any, *, compress: bool | None = None) -> int:
    """Bytes of ``obj`` pickled by nnsight's serializer (``nnsight.intervention.serialization.dumps``).

    ``compress`` (default: ``nnsight.CONFIG.API.COMPRESS``) applies the same zstd level-6
    compression as ``RequestModel.serialize``. Call :func:`register` first so that this package's
    code is counted by value, as a remote request ships it. Needs ``obj`` to be picklable by
    cloudpickle (not, e.g., under the test suite's beartype import hook).

    Raises:
        ArgumentError: ``compress`` not None or a bool.

    Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
    """
    from nnsight import CONFIG

    if compress is not None:
        check_flag(compress, "compress", "serialized_size")
    data = serialize(obj)
    if CONFIG.API.COMPRESS if compress is None else compress:
        import zstandard

        data = zstandard.ZstdCompressor(level=6).compress(data)
    return len(data)


def payload_report(obj: Any, layers: int | Iterable[int] | None = None, *, serialize: bool = False,
                   name: str | None = None) -> PayloadReport:
    """What sending ``obj`` with a remote request costs, tensor by tensor.

    Args:
        obj: a :class:`~nnsight_lorsa.ReplacementModel`, a replacement set, a module (a
            :class:`Lorsa`), a tensor, or a dict/list/tuple of those. Model weights (modules nnsight
            sends by reference) and envoys count 0.
        layers: with a ReplacementModel or a replacement set, only these layers (what :func:`for_remote`
            would keep).
        serialize: also measure the exact size with nnsight's serializer
            (:func:`serialized_size`; includes this package's source when :func:`register` was called).
        name: how to name ``obj`` in the report (default: a set's ``ReplacementModel`` attribute,
            ``"lorsas"`` for a LorsaSet, ``"transcoders"``, ``"saes"``; else ``"obj"``).

    Raises:
        LayerOutOfRangeError: a layer the set does not have.
        ArgumentError: ``layers`` given for something other than a ReplacementModel or a replacement set, or not a
            layer or a non-empty list of them; ``serialize`` not a bool, ``name`` not None or a str.

    Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
    """
    if layers is not None:
        if isinstance(obj, ReplacementModel):
            obj = _select(obj, layers)
        elif isinstance(obj, ReplacementSet):
            sets: dict[str, Any] = {obj.slot: obj}
            bundle = ReplacementModel(obj.model, **sets, adapter=obj.adapter)
            obj = getattr(_select(bundle, layers), obj.slot)
        else:
            raise ArgumentError(f"payload_report(layers=...) applies to a ReplacementModel or a replacement set, not "
                                f"to a {type(obj).__name__}")
    check_flag(serialize, "serialize", "payload_report")
    if name is not None and not isinstance(name, str):
        raise ArgumentError(f"payload_report(name=...) must be None or a str, got {name!r}")
    label = name or getattr(obj, "slot", "") or "obj"  # a set's ReplacementModel attribute (the set contract)
    report = _report_from(_named_tensors(obj, label))
    if serialize:
        from nnsight import CONFIG

        report = replace(report, serialized_bytes=serialized_size(obj), compressed=bool(CONFIG.API.COMPRESS))
    return report


def _too_large(report: PayloadReport, cap_bytes: int, what: str) -> PayloadTooLargeError:
    largest = "; ".join(
        f"{t.name} {format_bytes(t.nbytes)} ({'x'.join(map(str, t.shape))} {t.dtype})" for t in report.largest(5)
    )
    layers = {k: v for k, v in report.by_layer.items() if k is not None}
    per_layer = (" Per layer: " + ", ".join(f"{k}: {format_bytes(v)}" for k, v in sorted(layers.items())) + "."
                 if layers else "")
    return PayloadTooLargeError(
        f"{what} is {format_bytes(report.total_bytes)} ({report.total_bytes} bytes), above the cap of "
        f"{format_bytes(cap_bytes)} ({cap_bytes} bytes). Largest tensors: {largest or 'none'}.{per_layer} "
        "Send only the layers the trace uses, in the model's dtype (nnsight_lorsa.remote.for_remote(replacement, "
        "layers=[...], dtype=torch.bfloat16)), use the two-phase mode (docs/remote.md), or raise the cap "
        f"(cap_bytes=..., or ${CAP_ENV}).",
        report,
        cap_bytes,
    )


def check_payload(obj: Any, cap_bytes: Any = None, layers: int | Iterable[int] | None = None, *,
                  serialize: bool = False) -> PayloadReport:
    """:func:`payload_report`, raising if it exceeds ``cap_bytes``; returns the report otherwise.

    Args:
        cap_bytes: the cap (int bytes or ``"1.5GB"``); default :func:`default_cap_bytes`.

    Raises:
        PayloadTooLargeError: above the cap; the message names the five largest tensors and the
            bytes per layer.

    Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
    """
    cap = default_cap_bytes() if cap_bytes is None else parse_bytes(cap_bytes)
    report = payload_report(obj, layers, serialize=serialize)
    if report.total_bytes > cap:
        raise _too_large(report, cap, "the payload")
    return report


# ------------------------------------------------------------------ what to send
def _layers_held(replacement: ReplacementModel) -> set[int]:
    """The layers some module of ``replacement`` belongs to: a Lorsa's or transcoder's key, an SAE's site inside a
    layer's block (a CLT spans every MLP and an SAE outside every layer names none)."""
    return {layer for _, rset in replacement.sets() for key in rset if (layer := rset.layer_of(key)) is not None}


def _layer_list(replacement: ReplacementModel, layers: int | Iterable[int] | None) -> list[int]:
    have = sorted(_layers_held(replacement))
    if layers is not None and not is_int(layers) and not (
            is_collection(layers) and len(layers) and all(is_int(v) for v in layers)):  # type: ignore[arg-type,union-attr]
        raise ArgumentError(f"layers must be None (every layer), a layer or a non-empty list of layers, got "
                            f"{layers!r}"[:200])
    chosen = have if layers is None else [int(layers)] if is_int(layers) else [int(v) for v in layers]  # type: ignore[arg-type,union-attr]
    for layer in chosen:
        if layer not in have:
            raise LayerOutOfRangeError(f"no Lorsa, transcoder or SAE at layer {layer}; this ReplacementModel has "
                                       f"layers {have}")
    return chosen


def _select(replacement: ReplacementModel, layers: int | Iterable[int] | None,
            copy: Any = None) -> ReplacementModel:
    """``replacement`` with its sets cut to ``layers`` (:meth:`~.envoy.replacement_set.ReplacementSet.subset`;
    None: every module), each module passed through ``copy``."""
    chosen = None if layers is None else _layer_list(replacement, layers)
    return replacement.with_sets(lambda s: s.subset(chosen, copy))


def model_dtype(replacement: ReplacementModel, layer: int | None = None) -> torch.dtype:
    """The floating dtype of the model's attention at ``layer`` (default: the first replaced layer, else 0).

    Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
    """
    from .envoy.replacement_model import check_replacement_model

    check_replacement_model(replacement, "model_dtype")
    if layer is None:
        replaced = _layer_list(replacement, None)
        layer = replaced[0] if replaced else 0
    attention = hf_module(replacement.model.get(replacement.adapter.attention_path(layer)))
    for p in attention.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def _cast_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A fresh module (no nnsight state, no persistent id) with ``module``'s weights in ``dtype``, on the host (the
    server's splice moves it to its layer's device on first use; a client's ``cuda:N`` / ``mps`` would travel in the
    pickle and name a device the server may not have)."""
    state = {k: v.detach().to(device=HOST, dtype=dtype if v.is_floating_point() else v.dtype)
             for k, v in module.state_dict().items()}
    copy = type(module)(module.cfg, device="meta")  # type: ignore[call-arg]
    copy.load_state_dict(state, assign=True)
    leftover = [k for k, t in (*copy.named_parameters(), *copy.named_buffers()) if t.device.type == "meta"]
    if leftover:
        raise LorsaError(f"cannot copy {type(module).__name__}: {leftover} are not in its state_dict")
    return copy.train(module.training)


def for_remote(replacement: ReplacementModel, layers: int | Iterable[int] | None = None,
               dtype: torch.dtype | None = None) -> ReplacementModel:
    """A ReplacementModel with only the Lorsas / transcoders / SAEs of ``layers``, every module cast to
    ``dtype``, ready to name in a remote trace.

    The copies are fresh modules (no nnsight instrumentation, nothing nnsight would send by
    reference), on the host whatever the client's device (a ``cuda:N`` or ``mps`` weight would
    travel with its device name; the server's splice moves each module to its layer's device on
    first use); when ``dtype`` equals a host weight's dtype the copy shares its storage (no memory).
    An SAE travels when its site is inside one of ``layers``' blocks (``model.layers.3``,
    ``model.layers.3.mlp``: layer 3) or outside every layer (the embedding, the final norm: no layer names it); a
    cross-layer transcoder always (it spans every MLP). (Until 2026-11-29 every SAE travelled whatever ``layers``.)

    Args:
        replacement: the model and its replacements.
        layers: the layers the trace replaces (default: every module).
        dtype: default the model's dtype (:func:`model_dtype`). NDIF runs models in bfloat16; a
            client model built on the meta device without ``dtype=torch.bfloat16`` reports float32,
            so pass ``torch.bfloat16`` explicitly there.

    Raises:
        LayerOutOfRangeError: a layer with no Lorsa, transcoder or SAE.
        ArgumentError: ``dtype`` not None nor one of fp16 / bf16 / fp32 / fp64; ``layers`` not None, a layer or a
            non-empty list of them (an empty list sent no module).
        PlacementError: a module's weight is on the ``meta`` device (never loaded: the server would get
            no values), naming the module and the tensor; or a module's weight holds finite values past
            ``dtype``'s range (an fp32 weight above 65504 cast to fp16 would be ``inf``), naming the module,
            the tensor and its largest value.

    Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
    """
    from .envoy.replacement_model import check_replacement_model

    check_replacement_model(replacement, "for_remote")
    check_dtype_arg(dtype, "for_remote")
    chosen = _layer_list(replacement, layers)
    target = dtype if dtype is not None else model_dtype(replacement, chosen[0] if chosen else None)
    keys = None if layers is None else chosen
    for slot, rset in _select(replacement, keys).sets():  # the modules that travel, before any copy
        for key in rset:
            for name, t in rset[key].state_dict().items():
                if t.device.type == "meta":
                    raise PlacementError(
                        f"for_remote: {slot}[{key!r}].{name} is on the meta device (its values were never loaded): "
                        "load the module's weights (e.g. from_pretrained) before sending it")
                big = past_range(t, target) if t.is_floating_point() else None
                if big is not None:
                    raise PlacementError(
                        f"for_remote: {slot}[{key!r}].{name} holds values beyond {target}'s range (max |v| = "
                        f"{big:.4g} > {torch.finfo(target).max:.4g}, stored in {t.dtype}): the cast would turn them "
                        "into inf and the remote trace compute NaN; pass dtype=torch.bfloat16 (fp32's range)")
    return _select(replacement, keys, copy=lambda m: _cast_copy(m, target))


# ------------------------------------------------------------------ requests
def request_report(tracer: Any) -> PayloadReport:
    """The tensors a captured trace (or session) would ship: those reachable from the names its block reads.

    Uses nnsight's own reduction of the block (``reduce_block``: the globals and locals the
    block's source references), so it sees what ``RequestModel.serialize`` will pickle.

    Raises:
        ArgumentError: ``tracer`` not a captured nnsight trace or session (no ``info``).

    Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
    """
    names = block_names(tracer, "request_report")
    return _report_from(item for key in sorted(names) for item in _named_tensors(names[key], key))


class MeasuredRemoteBackend(SerializingRemoteBackend):
    """nnsight's ``RemoteBackend`` that measures each request before sending it, and caps it.

    Before serializing: the tensors the block references are counted (:func:`request_report`)
    and the request is refused if they alone exceed the cap. After serializing with nnsight's
    own ``RequestModel.serialize``: the exact payload length is recorded (``self.report``,
    ``self.payload_bytes``), printed when nnsight's remote logging is on (or ``verbose``), and
    checked against the cap again. With ``dry_run`` nothing is sent: the exact bytes stay in
    ``self.blob`` and the envelope (``RequestModel``) in ``self.envelope``.

    Args:
        model_key: the NDIF model key (``model.to_model_key()``).
        cap_bytes: the cap (int or ``"1.5GB"``), default :func:`default_cap_bytes`.
        dry_run: serialize and keep the bytes; send nothing (the trace's saves stay unset).
        queue_limit_bytes: the largest request the server's queue takes (:data:`NDIF_QUEUE_LIMIT_BYTES`, NDIF's);
            a request above it less :data:`QUEUE_OVERHEAD_BYTES` is refused whatever the cap. None: no queue limit
            (a server of your own configured otherwise).
        check_rules: read the serialized request's opcodes (never unpickling it) and refuse it when unpickling
            would resolve a module outside NDIF's whitelist (:func:`~nnsight_lorsa.ndif_rules.check_request`).
        check_version: before sending, compare the server's nnsight (``GET {host}/env``, once per host) with this
            client's (:func:`~nnsight_lorsa.server_version.check_server_version`).
        **kwargs: ``host``, ``api_key``, ``env``, ``blocking``, ``job_id``, ``verbose`` as for
            ``RemoteBackend``.

    Raises (when the trace exits, before anything is sent):
        PayloadTooLargeError: the request exceeds the cap.
        QueueLimitError: the request exceeds the queue's limit (a cap set above it).
        NotWhitelistedError: the request names objects of modules NDIF does not unpickle; the block calls
            ``attribute(rm, prompt)`` (the engine does not travel).
        TypeError, ArgumentError, ConfigMismatchError: an ``attribute(rm, tracer=tracer, ...)`` call of the block
            fails its call-time checks (:func:`~nnsight_lorsa.attribution.remote_handles.check_block_calls`).
        ServerVersionError: the server runs another nnsight version (not for a dry run).
    Raises (when built): ArgumentError: ``model_key`` not a str; ``cap_bytes`` / ``queue_limit_bytes`` not byte counts
    (:func:`parse_bytes`); ``dry_run`` / ``check_rules`` / ``check_version`` not bools.

    The handles of ``attribute(rm, tracer=tracer)`` saved in a remote trace or session come back as handles on the
    bundle the request named (:mod:`~nnsight_lorsa.attribution.remote_handles`).

    Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
    """

    def __init__(self, model_key: str, *args: Any, cap_bytes: int | str | None = None, dry_run: bool = False,
                 queue_limit_bytes: int | str | None = NDIF_QUEUE_LIMIT_BYTES, check_rules: bool = True,
                 check_version: bool = True, **kwargs: Any) -> None:
        if not isinstance(model_key, str):
            raise ArgumentError(f"MeasuredRemoteBackend: model_key must be a str (model.to_model_key()), got "
                                f"{model_key!r}")
        for name, flag in (("dry_run", dry_run), ("check_rules", check_rules), ("check_version", check_version)):
            check_flag(flag, name, "MeasuredRemoteBackend")
        super().__init__(model_key, *args, **kwargs)
        self.check_rules = check_rules
        self.cap_bytes = default_cap_bytes() if cap_bytes is None else parse_bytes(cap_bytes)
        self.queue_limit_bytes = None if queue_limit_bytes is None else parse_bytes(queue_limit_bytes)
        self.dry_run = dry_run
        self.report: PayloadReport | None = None
        self.payload_bytes: int | None = None
        self.blob: bytes | None = None
        self.envelope: Any = None
        self.check_version = check_version
        self._bundles: dict[int, Any] = {}

    def serialize_request(self, tracer: Any) -> bytes:
        """The request's bytes as nnsight serializes them, measured and checked before anything is sent (class
        docstring).

        Raises:
            PayloadTooLargeError: the request exceeds the cap.
            QueueLimitError: the request exceeds the queue's limit (``queue_limit_bytes``).
            NotWhitelistedError: ``check_rules`` and the request names objects of modules NDIF does not unpickle.

        Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
        """
        names = block_names(tracer)
        check_block_calls(block_body(tracer), names)  # attribute(...)'s call-time checks: the block runs remotely
        self._bundles = mark_bundles(names)  # the attribute(rm, tracer=tracer) handles come back on these
        report = request_report(tracer)
        self.report = report
        if report.total_tensor_bytes > self.cap_bytes:
            raise _too_large(report, self.cap_bytes, "this remote request (tensor data, before serializing)")
        blob = super().serialize_request(tracer)
        report = replace(report, serialized_bytes=len(blob), compressed=bool(self.compress))
        self.report, self.payload_bytes = report, len(blob)
        if self.display.enabled or self.verbose:
            top = report.largest(1)
            print(f"[nnsight-lorsa] request payload {format_bytes(len(blob))} ({'zstd' if self.compress else 'raw'}); "
                  f"tensor data {format_bytes(report.total_tensor_bytes)}"
                  + (f", largest {top[0].name} {format_bytes(top[0].nbytes)}" if top else ""))
        if len(blob) > self.cap_bytes:
            raise _too_large(report, self.cap_bytes, "this remote request")
        if self.queue_limit_bytes is not None and len(blob) + QUEUE_OVERHEAD_BYTES > self.queue_limit_bytes:
            limit = self.queue_limit_bytes - QUEUE_OVERHEAD_BYTES
            raise QueueLimitError(
                f"this remote request is {format_bytes(len(blob))} ({len(blob)} bytes) serialized: NDIF's request "
                f"queue (Redis, proto-max-bulk-len {self.queue_limit_bytes} bytes) takes at most {limit} bytes of "
                "request with its envelope, so the server would refuse it after the upload (the cap of "
                f"{format_bytes(self.cap_bytes)} is above that). Split the job: fewer layers per request "
                "(for_remote(replacement, layers=[...]) in one trace or session each), the model's dtype "
                "(dtype=torch.bfloat16), or the two-phase mode (docs/remote.md); queue_limit_bytes=None for a server "
                "with a larger queue.", len(blob), limit)
        if self.check_rules:
            data = blob
            if self.compress:
                import zstandard

                data = zstandard.ZstdDecompressor().decompress(blob)
            check_request(data)
        return blob

    def request(self, request: Any, tracer: Any) -> Any:
        """Measure and send the request (after the server-version check); with ``dry_run`` keep its bytes in ``blob``
        and send nothing.

        Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
        """
        if self.dry_run:
            self.blob, self.envelope = self.serialize_request(tracer), request
            return None
        check_server_version(self.host, self.check_version)
        return rebuild_results(super().request(request, tracer), self._bundles)

    def finalize(self, content: bytes) -> Any:
        """nnsight's result, with the ``attribute(rm, tracer=tracer)`` handles rebuilt.

        Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
        """
        return rebuild_results(super().finalize(content), self._bundles)

    def submit(self, tracer: Any) -> None:
        """Measure and submit the request (after the server-version check); with ``dry_run`` keep its bytes and
        envelope and send nothing.

        Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
        """
        if self.dry_run:
            self.blob = self.serialize_request(tracer)
            self.envelope = request_envelope(self.model_key, self.compress, self.env)
            return None
        check_server_version(self.host, self.check_version)
        return super().submit(tracer)


def remote_backend(model: Any, *, cap_bytes: int | str | None = None, dry_run: bool = False,
                   model_key: str | None = None, queue_limit_bytes: int | str | None = NDIF_QUEUE_LIMIT_BYTES,
                   check_rules: bool = True, check_version: bool = True, **kwargs: Any) -> MeasuredRemoteBackend:
    """A :class:`MeasuredRemoteBackend` for ``model``: ``model.trace(prompt, backend=remote_backend(model))``.

    Args:
        model: the nnsight model (its key and per-request env are read from it).
        cap_bytes: payload cap; default :func:`default_cap_bytes`.
        dry_run: keep the exact request bytes in ``backend.blob`` instead of sending them.
        model_key: override ``model.to_model_key()`` (a dry run of a model that has none,
            e.g. one built from an in-memory module, gets ``"local:unknown"``).
        queue_limit_bytes: the server queue's limit (default NDIF's, :data:`NDIF_QUEUE_LIMIT_BYTES`; None: none).
        check_rules: refuse a request NDIF would not unpickle, before sending it (:class:`MeasuredRemoteBackend`).
        check_version: refuse a request to a server of another nnsight version (:class:`MeasuredRemoteBackend`).
        **kwargs: ``host``, ``api_key``, ``blocking``, ``verbose`` as for nnsight's ``RemoteBackend``.

    Raises:
        ArgumentError: ``model`` not an nnsight model (``check_traceable``).

    Source: ours (sizing and shipping requests to NDIF; nnsight ``RemoteBackend``).
    """
    check_traceable(model, "remote_backend")
    if model_key is None:
        try:
            model_key = model.to_model_key()
        except Exception:
            if not dry_run:
                raise
            model_key = "local:unknown"
    return MeasuredRemoteBackend(model_key, env=remote_env(model), cap_bytes=cap_bytes, dry_run=dry_run,
                                 queue_limit_bytes=queue_limit_bytes, check_rules=check_rules,
                                 check_version=check_version, **kwargs)


__all__ = [
    "CAP_ENV", "DEFAULT_CAP_BYTES", "NDIF_QUEUE_LIMIT_BYTES", "QUEUE_OVERHEAD_BYTES", "MeasuredRemoteBackend",
    "NotWhitelistedError", "PayloadReport", "PayloadTooLargeError", "QueueLimitError", "TensorSize",
    "check_payload", "default_cap_bytes", "for_remote", "format_bytes", "model_dtype", "parse_bytes",
    "payload_report", "register", "remote_backend", "request_report", "serialized_size", "unregister",
]
