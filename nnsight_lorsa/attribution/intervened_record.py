"""An intervened pass recorded on a server, sent back as plain data: ``attribute(rm, tracer=tracer)`` remotely.

Inside ``model.session(remote=True)`` (or ``model.trace(..., remote=True)``) the trace body runs on the server,
so the :class:`~.intervened.IntervenedAttribution` handle it saves is pickled there, into the result. The server
cannot pickle this package's classes (it does not have ``nnsight_lorsa``; they travelled by value), and NDIF's
rules leave no room for anything but plain data on the way back, so the handle pickles as a plain ``dict``
(:func:`to_record`, run on the server): the tensors the recorder kept — what ``cache_for_attribution(...,
remote=True)`` fetches for the same pass — the edits as plain fields, the options, and the key of the client's
:class:`~nnsight_lorsa.envoy.replacement_model.ReplacementModel`. On the client,
:class:`~nnsight_lorsa.remote.MeasuredRemoteBackend` (after :func:`nnsight_lorsa.remote.register`) marks each
bundle the request names with a key before sending (:func:`mark_bundles`) and turns each record of the result
back into a handle on that bundle (:func:`rebuild_results`); ``handle.graph`` is then built here, from the
fetched tensors, by the same code as a local trace's. Without the measured backend the saved name holds the
plain record: :func:`from_record` makes the handle by hand.

What runs on the server (:func:`to_record`, :func:`encode`) uses only ``dataclasses`` and builtins (NDIF's
whitelists); the rest runs on the client. torch-free.
"""

from __future__ import annotations

import dataclasses
from typing import Any

#: The key a record carries under :data:`RECORD_TAG`'s name: the record's format.
RECORD_TAG = "nnsight_lorsa.intervened_attribution"
RECORD_VERSION = 1
#: The attribute :func:`mark_bundles` sets on a client's bundle (its ``id``), read back from the server's copy.
KEY_ATTR = "_nnsight_lorsa_remote_key"


# ------------------------------------------------------------------ server side (shipped by value)
def encode(value: Any) -> Any:
    """``value`` with every dataclass instance of this package as ``{"__dataclass__": [module, qualname],
    "fields": {...}}`` (recursively through lists, tuples and dicts); anything else as is."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        # not dataclasses.fields(): a class rebuilt by value holds copies of dataclasses' field-kind sentinels,
        # which fields() does not recognise (it would return none); the kinds are compared by name here
        fields = {name: encode(getattr(value, name)) for name, f in cls.__dataclass_fields__.items()
                  if f.init and getattr(getattr(f, "_field_type", None), "name", "_FIELD") == "_FIELD"}
        return {"__dataclass__": [cls.__module__, cls.__qualname__], "fields": fields}
    if isinstance(value, (list, tuple)):
        return type(value)(encode(v) for v in value)
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    return value


def to_record(key: int, saved: Any, edits: list, options: Any, problem: BaseException | None) -> dict:
    """The plain ``dict`` an intervened-pass handle pickles as on the server (module docstring).

    Args:
        key: the client bundle's key (:data:`KEY_ATTR` of the server's copy).
        saved: the recorder's tensors (``{name: tensor | {layer: tensor}}``), or None when it kept nothing.
        edits: the :class:`~..envoy.edit_log.Edit` list.
        options: the :class:`~.options.AttributionOptions`.
        problem: the error the recording ended with (sent as its class name and message), or None.
    """
    return {
        "tag": RECORD_TAG, "version": RECORD_VERSION, "key": key, "saved": saved,
        "edits": [[encode(e.target), encode(e.positions)] for e in edits], "options": encode(options),
        "problem": None if problem is None else [type(problem).__name__, str(problem)],
    }


# ------------------------------------------------------------------ client side
def is_record(value: Any) -> bool:
    return isinstance(value, dict) and value.get("tag") == RECORD_TAG


def decode(value: Any) -> Any:
    """Inverse of :func:`encode` (on the client, where this package's classes are importable).

    Raises:
        ConfigMismatchError: a dataclass of a module outside this package.
    """
    import importlib

    from ..errors import ConfigMismatchError

    if isinstance(value, dict) and "__dataclass__" in value:
        module, qualname = value["__dataclass__"]
        if module.split(".")[0] != __name__.split(".")[0]:
            raise ConfigMismatchError(f"an intervened-pass record names {module}.{qualname}, not a class of this "
                                      "package: refused")
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        return cls(**{k: decode(v) for k, v in value["fields"].items()})
    if isinstance(value, (list, tuple)):
        return type(value)(decode(v) for v in value)
    if isinstance(value, dict):
        return {k: decode(v) for k, v in value.items()}
    return value


def from_record(record: dict, replacement: Any) -> Any:
    """The :class:`~.intervened.IntervenedAttribution` a server's record stands for, on ``replacement`` (the
    client's bundle the request sent: same weights); its ``.graph`` is built here on the first read.

    Raises:
        ConfigMismatchError: not a record of this format, or one of another version.
    """
    from .. import errors
    from ..envoy.edit_log import Edit
    from ..errors import ConfigMismatchError
    from .attribute import build_graph
    from .intervened import IntervenedAttribution

    if not is_record(record) or record.get("version") != RECORD_VERSION:
        raise ConfigMismatchError(f"not an intervened-pass record of version {RECORD_VERSION} "
                                  f"(tag {record.get('tag') if isinstance(record, dict) else None!r})")
    handle = IntervenedAttribution(replacement, decode(record["options"]), build_graph)
    handle._log.edits = [Edit(decode(t), decode(p)) for t, p in record["edits"]]
    handle._saved = record["saved"]
    if record["problem"] is not None:
        name, message = record["problem"]
        cls = getattr(errors, name, None)
        handle._problem = (cls if isinstance(cls, type) and issubclass(cls, errors.LorsaError)
                           else errors.TraceOrderError)(message)
    return handle


def mark_bundles(names: dict[str, Any], refuse_engine: bool = True) -> dict[int, Any]:
    """Give each :class:`~..envoy.replacement_model.ReplacementModel` among a request's names (and one level
    into their dicts, lists and tuples) its key (:data:`KEY_ATTR`: its ``id``); returns ``{key: bundle}``.

    Raises:
        NotWhitelistedError: (``refuse_engine``) the block names :func:`.attribute.attribute`, which would ship the
            whole attribution engine; the message names :func:`.intervened.attribute_pass` instead.
    """
    from ..envoy.replacement_model import ReplacementModel
    from ..ndif_rules import NotWhitelistedError
    from .attribute import attribute

    if refuse_engine and any(value is attribute for value in names.values()):
        raise NotWhitelistedError(
            "attribute(...) inside a remote trace or session would ship the whole attribution engine, whose modules "
            "import gc, bisect, copy and pathlib — outside NDIF's unpickling whitelist. In the block use "
            "attribute_pass(rm, tracer, **options) (nnsight_lorsa.attribution; the same options and handle, its "
            ".graph built here after the block: docs/remote.md); a clean prompt's graph is "
            "attribute(rm, prompt, remote=True), called outside any trace. Nothing was sent.", [])

    found: dict[int, Any] = {}
    for value in names.values():
        inner = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
        for candidate in (value, *inner):
            if isinstance(candidate, ReplacementModel):
                setattr(candidate, KEY_ATTR, id(candidate))
                found[id(candidate)] = candidate
    return found


def rebuild_results(result: Any, bundles: dict[int, Any]) -> Any:
    """A remote result (``{name: saved value}``) with each record turned into its handle on the client's bundle
    (:func:`from_record`); a record whose bundle this request did not mark stays a record."""
    if not isinstance(result, dict) or not bundles:
        return result
    return {name: from_record(v, bundles[v["key"]]) if is_record(v) and v.get("key") in bundles else v
            for name, v in result.items()}
