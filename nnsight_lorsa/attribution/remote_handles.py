"""The client's side of an intervened pass recorded on a server (:mod:`.intervened_record` is the server's):
mark the bundles a request names, and turn the records of its result back into
:class:`~.intervened.IntervenedAttribution` handles whose ``.graph`` is built here. Used by
:class:`~nnsight_lorsa.remote.MeasuredRemoteBackend`; :func:`from_record` by hand for a result another backend
fetched. torch-free.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..envoy.edit_log import Edit
from ..envoy.replacement_model import ReplacementModel
from ..errors import ConfigMismatchError, LorsaError, TraceOrderError
from ..ndif_rules import NotWhitelistedError
from .attribute import attribute
from .intervened import IntervenedAttribution
from .intervened_record import KEY_ATTR, RECORD_TAG, RECORD_VERSION


def is_record(value: Any) -> bool:
    return isinstance(value, dict) and value.get("tag") == RECORD_TAG


def decode(value: Any) -> Any:
    """Inverse of :func:`.intervened_record.encode` (on the client, where this package's classes are importable).

    Raises:
        ConfigMismatchError: a dataclass of a module outside this package.
    """
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
    if not is_record(record) or record.get("version") != RECORD_VERSION:
        raise ConfigMismatchError(f"not an intervened-pass record of version {RECORD_VERSION} "
                                  f"(tag {record.get('tag') if isinstance(record, dict) else None!r})")
    handle = IntervenedAttribution(replacement, decode(record["options"]), None)
    handle._log.edits = [Edit(decode(t), decode(p)) for t, p in record["edits"]]
    handle._saved = record["saved"]
    if record["problem"] is not None:
        name, message = record["problem"]
        kinds: list[type[LorsaError]] = [LorsaError]
        error: type[LorsaError] = TraceOrderError  # the server's error class, by name, among this package's
        while kinds:
            kind = kinds.pop()
            error = kind if kind.__name__ == name else error
            kinds += kind.__subclasses__()
        try:
            handle._problem = error(message)
        except TypeError:  # an error class with more arguments than a message
            handle._problem = TraceOrderError(f"{name}: {message}")
    return handle


def mark_bundles(names: dict[str, Any], refuse_engine: bool = True) -> dict[int, Any]:
    """Give each :class:`~..envoy.replacement_model.ReplacementModel` among a request's names (and one level
    into their dicts, lists and tuples) its key (:data:`KEY_ATTR`: its ``id``); returns ``{key: bundle}``.

    Raises:
        NotWhitelistedError: (``refuse_engine``) the block names :func:`.attribute.attribute`, which would ship the
            whole attribution engine; the message names :func:`.intervened.attribute_pass` instead.
    """
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
