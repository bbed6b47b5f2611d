"""The client's side of an intervened pass recorded on a server (:mod:`.intervened_record` is the server's):
check the ``attribute(...)`` calls of a remote block before it is sent, mark the bundles a request names, and turn
the records of its result back into :class:`~.intervened.IntervenedAttribution` handles whose ``.graph`` is built
here. Used by :class:`~nnsight_lorsa.remote.MeasuredRemoteBackend`; :func:`from_record` by hand for a result
another backend fetched. torch-free.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import types
from typing import Any

from ..envoy.edit_log import Edit
from ..envoy.replacement_model import ReplacementModel
from ..errors import ConfigMismatchError, LorsaError, TraceOrderError
from ..ndif_rules import NotWhitelistedError
from .attribute import attribute
from .engine import check_replacement
from .intervened import IntervenedAttribution, check_traced_call
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
    handle = IntervenedAttribution(replacement, decode(record["options"]))
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


def mark_bundles(names: dict[str, Any]) -> dict[int, Any]:
    """Give each :class:`~..envoy.replacement_model.ReplacementModel` among a request's names (and one level
    into their dicts, lists and tuples) its key (:data:`KEY_ATTR`: its ``id``); returns ``{key: bundle}``."""
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


# ------------------------------------------------------------------ the calls of a remote block, checked here
#: an argument :func:`check_block_calls` cannot know without running the block
_UNKNOWN = object()


def check_block_calls(body: list[Any], names: dict[str, Any]) -> None:
    """:func:`.attribute.attribute`'s call-time checks, here, for every ``attribute(...)`` call of a remote block
    (``body``: its statements; ``names``: the values of the names it reads from its scope, as nnsight ships them),
    before the request is sent: a remote block runs only on the server, so a bad option would otherwise surface
    there, or at ``.graph``. A call is found by what its function names (``attribute``, however imported); its
    arguments are read without running anything: literals, names of the enclosing scope that the block does not
    rebind, attributes of modules and classes, tuples, lists and dicts of those, and this package's dataclasses
    (``PruneConfig(...)``, ``LogitTargets(...)``) built of them. An argument spelled otherwise is checked when
    ``.graph`` is read (:meth:`.intervened.IntervenedAttribution.graph`).

    Raises:
        TypeError, ArgumentError, ConfigMismatchError: as :func:`.intervened.check_traced_call` and
            :func:`.engine.check_replacement` (``in_trace``) for a call with ``tracer=``; the message names the
            call and says nothing was sent.
        NotWhitelistedError: a call without ``tracer=`` (a prompt's graph runs the attribution engine, which
            does not travel: call ``attribute(rm, prompt, remote=True)`` outside the block).
    """
    bound = _bound_names(body)
    signature = inspect.signature(attribute)
    for call in (node for stmt in body for node in ast.walk(stmt) if isinstance(node, ast.Call)):
        if _value(call.func, names, bound) is not attribute or any(isinstance(a, ast.Starred) for a in call.args):
            continue
        where = f" (the remote block's call {ast.unparse(call)}, checked here before sending: nothing was sent)"
        try:
            kwargs: dict[str, Any] = {}
            for keyword in call.keywords:
                value = _value(keyword.value, names, bound)
                if keyword.arg is not None:
                    kwargs[keyword.arg] = value
                elif isinstance(value, dict):  # **settings the block spells as a known mapping
                    kwargs.update(value)
            arguments = signature.bind(*(_value(a, names, bound) for a in call.args), **kwargs).arguments
            if arguments.get("tracer") is None:
                raise NotWhitelistedError(
                    "attribute(rm, prompt) inside a remote trace or session would run the whole attribution engine "
                    "on the server, whose modules import gc, bisect, copy and pathlib — outside NDIF's unpickling "
                    "whitelist. For the graph of the traced pass call attribute(rm, tracer=tracer) at the top of the "
                    "trace body (its .graph built here after the block: docs/remote.md); a clean prompt's graph is "
                    "attribute(rm, prompt, remote=True), called outside any trace. Nothing was sent.", [])
            prompt = arguments.get("prompt")
            settings = {k: v for k, v in arguments.items()
                        if k not in ("replacement", "prompt", "tracer", "renamed") and v is not _UNKNOWN}
            check_traced_call(object() if prompt is _UNKNOWN else prompt,
                              {**settings, **arguments.get("renamed", {})})
            if arguments.get("replacement", _UNKNOWN) is not _UNKNOWN:
                check_replacement(arguments["replacement"], in_trace=True)
        except NotWhitelistedError:
            raise
        except (LorsaError, TypeError, ValueError) as error:
            raise _at(error, where) from None


def _at(error: Exception, where: str) -> Exception:
    """``error`` (same class) with ``where`` appended to its message; ``error`` itself if its class takes more."""
    try:
        return type(error)(f"{error}{where}")
    except TypeError:
        return error


def _bound_names(body: list[Any]) -> set[str]:
    """Names the block binds (assigns, imports, defines, loops over): their values at a call are unknown here."""
    names: set[str] = set()
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def _value(node: Any, names: dict[str, Any], bound: set[str]) -> Any:
    """The value of expression ``node`` when it can be known without running the block (:func:`check_block_calls`),
    else :data:`_UNKNOWN`."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return names[node.id] if node.id in names and node.id not in bound else _UNKNOWN
    if isinstance(node, ast.Attribute):
        base = _value(node.value, names, bound)
        return getattr(base, node.attr, _UNKNOWN) if isinstance(base, (types.ModuleType, type)) else _UNKNOWN
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _value(node.operand, names, bound)
        if isinstance(operand, (int, float)) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
        return _UNKNOWN
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_value(e, names, bound) for e in node.elts]
        if any(i is _UNKNOWN for i in items):
            return _UNKNOWN
        return tuple(items) if isinstance(node, ast.Tuple) else items
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            return _UNKNOWN
        keys = [_value(k, names, bound) for k in node.keys]
        values = [_value(v, names, bound) for v in node.values]
        if any(x is _UNKNOWN for x in (*keys, *values)):
            return _UNKNOWN
        return dict(zip(keys, values, strict=True))
    if isinstance(node, ast.Call):  # this package's dataclasses (PruneConfig, LogitTargets): plain values
        cls = _value(node.func, names, bound)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)
                and cls.__module__.split(".")[0] == __name__.split(".")[0]):
            return _UNKNOWN
        args = [_value(a, names, bound) for a in node.args]
        kwargs = {k.arg: _value(k.value, names, bound) for k in node.keywords if k.arg is not None}
        if (any(isinstance(a, ast.Starred) for a in node.args) or len(kwargs) < len(node.keywords)
                or any(x is _UNKNOWN for x in (*args, *kwargs.values()))):
            return _UNKNOWN
        return cls(*args, **kwargs)
    return _UNKNOWN
