"""NDIF's rules for a remote request, read from NDIF's public server code, and a check of a request against them.

Source, ``github.com/ndif-team/ndif`` (pinned; see docs/remote.md, "NDIF's rules"):

- the module lists: ``src/ndif/services/ray/nn/security/whitelist.yaml`` at :data:`NDIF_LIST_COMMIT`, with the
  entry semantics of ``WhitelistedModule.check`` / ``is_module_allowed`` in
  ``src/ndif/services/ray/nn/security/whitelist.py`` at ``c7c84aac13136bf313279311b31c340407f7618c`` (strict: that
  name only; not strict: the name and its submodules, minus ``blocked_submodules``; without that branch's "OPEN
  SANDBOX" allowance of the whole standard library, marked branch-only in its comments);
- the mechanisms at :data:`NDIF_MECHANISM_COMMIT`: requests are unpickled under
  ``Protector(WHITELISTED_MODULES_DESERIALIZATION)`` (``find_class``, ``cloudpickle.subimport`` and
  ``dynamic_subimport`` refuse a module outside the list) and run under ``Protector(WHITELISTED_MODULES)``
  (``__import__`` refuses one), the model's modules wrapped by ``protect()`` (no ``setattr``), and queued in Redis
  as ``pickle.dumps(backend_request)`` (``proto-max-bulk-len``: 512 MiB by default).

:func:`pickled_modules` reads which modules a pickle would resolve **without unpickling it** (``pickletools``
opcodes only), so a request can be checked before it is sent (:func:`check_request`).

>>> module_allowed("torch.nn.functional", NDIF_DESERIALIZATION_MODULES), module_allowed("pathlib", NDIF_RUNTIME_MODULES)
(True, False)
"""

from __future__ import annotations

import pickletools
from collections.abc import Iterable

from .errors import LorsaError

#: The NDIF repository the rules are read from.
NDIF_REPO = "ndif-team/ndif"
#: The commit of ``src/ndif/services/ray/nn/security/whitelist.yaml`` the module lists are read from.
NDIF_LIST_COMMIT = "b9e9fa65599443ed2ab6f1eb86d0da5325fe4bcf"
#: The commit the mechanisms (where each list applies, ``protect()``, the Redis queue) are read from.
NDIF_MECHANISM_COMMIT = "b7ac71f4e4a96fa95b1f155d613eba6069441db1"

#: One whitelist entry: ``(name, strict, blocked_submodules)``.
Entry = tuple[str, bool, tuple[str, ...]]

#: ``modules`` of whitelist.yaml: what code may import while a request runs.
NDIF_RUNTIME_MODULES: tuple[Entry, ...] = (
    ("PIL", False, ()), ("re", False, ()), ("dataclasses", False, ()), ("builtins", True, ()),
    ("torch", False, ("torch.multiprocessing", "torch.utils.cpp_extension", "torch.package", "torch.hub",
                      "torch.utils.model_zoo")),
    ("collections", False, ()), ("nnsight", True, ()), ("nnsight.intervention.envoy", False, ()),
    ("nnsight.intervention.tracing.globals", False, ()), ("time", False, ()),
    ("numpy", False, ("numpy.ctypeslib", "numpy.distutils")), ("sympy", False, ()), ("nnterp", False, ()),
    ("math", False, ()), ("einops", False, ()), ("urllib3", False, ()), ("typing", False, ()),
    ("_operator", True, ()), ("operator", True, ()), ("pandas", False, ()), ("enum", False, ()),
    ("__future__", False, ()), ("diffusers", False, ()), ("transformers.modeling_utils", False, ()),
    ("tqdm", False, ()), ("heapq", False, ()), ("json", False, ()), ("warnings", False, ()),
    ("functools", False, ()),
)
#: ``deserialization_modules`` of whitelist.yaml plus :data:`NDIF_RUNTIME_MODULES`: what unpickling may resolve.
NDIF_DESERIALIZATION_MODULES: tuple[Entry, ...] = NDIF_RUNTIME_MODULES + (
    ("pickle", False, ()), ("cloudpickle", False, ()), ("copyreg", False, ()), ("nnsight", False, ()),
    ("transformers", False, ()), ("transformers_modules", False, ()),
)


class NotWhitelistedError(LorsaError, ValueError):
    """A remote request would resolve modules NDIF's unpickling whitelist does not allow; raised before sending.

    Attributes:
        modules: the refused modules (full dotted names), sorted.
    """

    def __init__(self, message: str, modules: list[str]) -> None:
        super().__init__(message)
        self.modules = modules


def module_allowed(name: str, entries: Iterable[Entry]) -> bool:
    """NDIF's ``is_module_allowed``: some entry allows ``name`` (a full dotted module name) and none blocks it."""
    entries = tuple(entries)

    def under(prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    if any(under(b) for _, _, blocked in entries for b in blocked):
        return False
    return any(name == n if strict else under(n) for n, strict, _ in entries)


_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}
_GETS = {"GET", "BINGET", "LONG_BINGET"}
_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_SUBIMPORTS = {("cloudpickle.cloudpickle", "subimport"), ("cloudpickle.cloudpickle", "dynamic_subimport"),
               ("cloudpickle.cloudpickle_fast", "subimport"), ("cloudpickle", "subimport")}
_SUBIMPORT = object()  # what a pushed cloudpickle subimport function is tracked as


def pickled_modules(data: bytes) -> set[str]:
    """The modules unpickling ``data`` would resolve: every ``GLOBAL``/``STACK_GLOBAL`` module and every module
    cloudpickle re-imports (``subimport``/``dynamic_subimport`` arguments). Read from the opcodes with
    ``pickletools``; ``data`` is never unpickled.

    Args:
        data: an uncompressed pickle (protocol 2 or later), e.g. nnsight's request body before zstd.

    Raises:
        ValueError: ``data`` is not a well-formed pickle.
    """
    modules: set[str] = set()
    pushed: list[object] = []  # values pushed, strings kept (the arguments of STACK_GLOBAL are the last two)
    memo: dict[int, object] = {}
    subimport = False  # the next string pushed is a module cloudpickle re-imports
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        value: object = None
        if name in _STRINGS:
            value = arg.decode("latin-1") if isinstance(arg, bytes) else arg
        elif name in _GETS:
            value = memo.get(arg)  # type: ignore[arg-type]  # a memoized string, or the subimport function again
        elif name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
            continue
        elif name in _PUTS:
            memo[arg] = pushed[-1] if pushed else None  # type: ignore[index]
            continue
        elif name in ("GLOBAL", "STACK_GLOBAL"):
            if name == "GLOBAL":
                module, _, attr = str(arg).partition(" ")
            else:
                module, attr = (pushed[-2], pushed[-1]) if len(pushed) >= 2 else (None, None)  # type: ignore[assignment]
            if isinstance(module, str):
                modules.add(module)
            value = _SUBIMPORT if (module, attr) in _SUBIMPORTS else None
        elif not op.stack_after:
            continue
        if value is _SUBIMPORT:
            subimport = True
        elif subimport and isinstance(value, str):
            modules.add(value)
            subimport = False
        pushed.append(value)
    return modules


def check_request(data: bytes, entries: Iterable[Entry] = NDIF_DESERIALIZATION_MODULES) -> set[str]:
    """Raise :class:`NotWhitelistedError` if unpickling ``data`` (an uncompressed request body) would resolve a
    module outside ``entries`` (default NDIF's unpickling whitelist); else return the modules it resolves."""
    modules = pickled_modules(data)
    refused = sorted(m for m in modules if not module_allowed(m, entries))
    if refused:
        ours = any(m.split(".")[0] == __package__ for m in refused)
        hint = (f"{__package__} is not installed on NDIF: call {__package__}.remote.register() before the trace "
                "(it ships this package's code with the request). " if ours else "")
        raise NotWhitelistedError(
            f"NDIF would refuse this request when unpickling it: it names objects of {', '.join(refused)}, which "
            f"NDIF's unpickling whitelist ({NDIF_REPO}@{NDIF_LIST_COMMIT[:12]}, whitelist.yaml) does not allow. "
            f"Nothing was sent. {hint}Turn such values into whitelisted types before the trace (tensors, numbers, "
            "str, lists, dicts) or compute them inside the block with torch; check_rules=False for a server that "
            "allows them.", refused)
    return modules


__all__ = [
    "NDIF_DESERIALIZATION_MODULES", "NDIF_LIST_COMMIT", "NDIF_MECHANISM_COMMIT", "NDIF_REPO", "NDIF_RUNTIME_MODULES",
    "NotWhitelistedError", "check_request", "module_allowed", "pickled_modules",
]
