"""An intervened pass recorded on a server, sent back as plain data: ``attribute(rm, tracer=tracer)`` remotely.

Inside ``model.session(remote=True)`` (or ``model.trace(..., remote=True)``) the trace body runs on the server,
so the :class:`~.intervened.IntervenedAttribution` handle it saves is pickled there, into the result. The server
cannot pickle this package's classes (it does not have ``nnsight_lorsa``; they travelled by value), and NDIF's
rules leave no room for anything but plain data on the way back, so the handle pickles as a plain ``dict``
(:func:`to_record`, run on the server): the tensors the recorder kept — what ``cache_for_attribution(...,
remote=True)`` fetches for the same pass — the edits as plain fields, the options, and the key of the client's
:class:`~nnsight_lorsa.envoy.replacement_model.ReplacementModel`. On the client,
:class:`~nnsight_lorsa.remote.MeasuredRemoteBackend` (after :func:`nnsight_lorsa.remote.register`) marks each
bundle the request names with a key before sending (:func:`.remote_handles.mark_bundles`) and turns each record
of the result back into a handle on that bundle (:func:`.remote_handles.rebuild_results`); ``handle.graph`` is
then built on the client, from the fetched tensors, by the same code as a local trace's. Without the measured
backend the saved name holds the plain record: :func:`.remote_handles.from_record` makes the handle by hand.

This module is what runs on the server (:func:`to_record`, :func:`encode`): only ``dataclasses`` and builtins
(NDIF's whitelists). The client's side is :mod:`.remote_handles`. torch-free.
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
