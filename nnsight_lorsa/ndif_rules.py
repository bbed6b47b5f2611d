"""NDIF's rules for a remote request, read from NDIF's public server code, and a check of a request against them.

Source, ``github.com/ndif-team/ndif`` (pinned; see docs/remote.md, "NDIF's rules"):

- the module lists: ``src/ndif/services/ray/nn/security/whitelist.yaml`` at :data:`NDIF_LIST_COMMIT`, with the
  entry semantics of ``WhitelistedModule.check`` / ``is_module_allowed`` in
  ``src/ndif/services/ray/nn/security/whitelist.py`` at ``c7c84aac13136bf313279311b31c340407f7618c`` (strict: that
  name only; not strict: the name and its submodules, minus ``blocked_submodules``; without that branch's "OPEN
  SANDBOX" allowance of the whole standard library, marked branch-only in its comments);
- the mechanisms at :data:`NDIF_MECHANISM_COMMIT`: requests are unpickled under
  ``Protector(WHITELISTED_MODULES_DESERIALIZATION)`` and run under ``Protector(WHITELISTED_MODULES)``
  (``__import__`` refuses a module outside the list), the model's modules wrapped by ``protect()`` (no
  ``setattr``), and queued in Redis as ``pickle.dumps(backend_request)`` (``proto-max-bulk-len``: 512 MiB by
  default);
- the unpickling hooks at :data:`NDIF_UNPICKLING_COMMIT` (``src/ndif/services/ray/nn/security/protector.py``): the
  ``Protector`` also makes ``CustomCloudUnpickler.find_class``, ``cloudpickle.subimport`` and ``dynamic_subimport``
  refuse a module outside the list (``is_module_allowed``). At :data:`NDIF_MECHANISM_COMMIT` the ``Protector``
  patches ``__import__`` only, which ``find_class`` and ``subimport`` bypass for a module already imported.

:func:`pickled_modules` reads which modules a pickle would resolve **without unpickling it** (``pickletools``
opcodes only), so a request can be checked before it is sent (:func:`check_request`).

>>> module_allowed("torch.nn.functional", NDIF_DESERIALIZATION_MODULES), module_allowed("pathlib", NDIF_RUNTIME_MODULES)
(True, False)
"""

from __future__ import annotations

import pickletools
from collections.abc import Iterable

from .errors import ArgumentError, LorsaError

#: The NDIF repository the rules are read from.
NDIF_REPO = "ndif-team/ndif"
#: The commit of ``src/ndif/services/ray/nn/security/whitelist.yaml`` the module lists are read from.
NDIF_LIST_COMMIT = "b9e9fa65599443ed2ab6f1eb86d0da5325fe4bcf"
#: The commit the mechanisms (where each list applies, ``protect()``, the Redis queue) are read from.
NDIF_MECHANISM_COMMIT = "b7ac71f4e4a96fa95b1f155d613eba6069441db1"
#: The commit of ``src/ndif/services/ray/nn/security/protector.py`` the unpickling hooks (``find_class``,
#: ``subimport``, ``dynamic_subimport``) are read from.
NDIF_UNPICKLING_COMMIT = "b8950c97358acaa0c9c97b2350b80ce5f97dde63"

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

    Source: NDIF ``src/ndif/services/ray/nn/security/whitelist.yaml`` (module docstring).
    """

    def __init__(self, message: str, modules: list[str]) -> None:
        super().__init__(message)
        self.modules = modules


def module_allowed(name: str, entries: Iterable[Entry]) -> bool:
    """NDIF's ``is_module_allowed``: some entry allows ``name`` (a full dotted module name) and none blocks it.

    Raises:
        ArgumentError: ``name`` not a str, ``entries`` not ``(name, strict, blocked)`` triples (a ``TypeError``
            too).
    """
    if not isinstance(name, str):
        raise ArgumentError(f"module_allowed: name must be a dotted module name (str), got {name!r}")
    # builtins only on the valid path: a simulated server (tests/loopback.py) runs this function's source alone
    try:
        entries = () if isinstance(entries, (str, bytes)) else tuple(entries)
    except TypeError:  # not iterable
        entries = ()
    if not entries or not all(isinstance(e, tuple) and len(e) == 3 for e in entries):
        raise ArgumentError(f"module_allowed: entries must be (name, strict, blocked) triples, got {entries!r}"[:200])

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
_SUBIMPORT = object()  # what cloudpickle's subimport / dynamic_subimport function is tracked as on the stack
#: What :func:`pickled_modules` reports for a module name computed while unpickling (no whitelist allows it).
COMPUTED = "<computed module name>"


def pickled_modules(data: bytes) -> set[str]:
    """The modules unpickling ``data`` would resolve: every ``GLOBAL``/``STACK_GLOBAL``/``INST`` module and every
    module cloudpickle re-imports (``subimport``/``dynamic_subimport`` arguments). Read from the opcodes with
    ``pickletools``; ``data`` is never unpickled.

    What the opcodes cannot name is reported as a pseudo-module no whitelist allows, so :func:`check_request`
    refuses it: ``"<computed module name>"`` (a ``STACK_GLOBAL`` or ``subimport`` whose name is computed while
    unpickling, not a string of the pickle) and ``"<copyreg extension code N>"`` (an ``EXT`` opcode: the server
    resolves ``N`` in its own ``copyreg`` registry, not the client's).

    Args:
        data: an uncompressed pickle (any protocol), e.g. nnsight's request body before zstd.

    Raises:
        ValueError: ``data`` is not a well-formed pickle.
        ArgumentError: ``data`` not bytes (a ``TypeError`` too).
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ArgumentError(f"pickled_modules: data must be the bytes of a pickle, got a {type(data).__name__}")
    modules: set[str] = set()
    stack: list[object] = []  # the unpickler's stack, symbolically: strings, tuples of them, _SUBIMPORT, else None
    marks: list[int] = []  # the stack's length at each open MARK
    memo: dict[int, object] = {}

    def pop_mark() -> list[object]:
        at = marks.pop() if marks else 0
        items = stack[at:]
        del stack[at:]
        return items

    def called(fn: object, args: object) -> None:  # fn(*args) runs while unpickling: subimport names a module
        if fn is _SUBIMPORT:
            first = args[0] if isinstance(args, tuple) and args else None
            modules.add(first if isinstance(first, str) else COMPUTED)

    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name == "MARK":
            marks.append(len(stack))
        elif name in _STRINGS:
            stack.append(arg.decode("latin-1") if isinstance(arg, bytes) else arg)
        elif name in _GETS:
            stack.append(memo.get(arg))  # type: ignore[arg-type]
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1] if stack else None
        elif name in _PUTS:
            memo[arg] = stack[-1] if stack else None  # type: ignore[index]
        elif name == "DUP":
            stack.append(stack[-1] if stack else None)
        elif name in ("GLOBAL", "STACK_GLOBAL", "INST"):
            if name == "STACK_GLOBAL":
                attr = stack.pop() if stack else None
                module = stack.pop() if stack else None
            else:  # GLOBAL and INST: "module name"
                module, _, attr = str(arg).partition(" ")
            modules.add(module if isinstance(module, str) else COMPUTED)
            fn = _SUBIMPORT if (module, attr) in _SUBIMPORTS else None
            if name == "INST":  # the class called on the MARKed arguments
                called(fn, tuple(pop_mark()))
                fn = None
            stack.append(fn)
        elif name in ("EXT1", "EXT2", "EXT4"):
            modules.add(f"<copyreg extension code {arg}>")
            stack.append(None)
        elif name in ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "EMPTY_TUPLE"):
            n = {"EMPTY_TUPLE": 0, "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}.get(name)
            items = pop_mark() if n is None else stack[len(stack) - n:] if n else []
            if n:
                del stack[len(stack) - n:]
            stack.append(tuple(items))
        elif name == "REDUCE":
            args = stack.pop() if stack else None
            fn = stack.pop() if stack else None
            called(fn, args)
            stack.append(None)
        elif name == "OBJ":  # MARK cls *args OBJ: cls(*args)
            items = pop_mark()
            if items:
                called(items[0], tuple(items[1:]))
            stack.append(None)
        elif name == "POP" and len(stack) == (marks[-1] if marks else 0) and marks:
            marks.pop()  # the unpickler's POP on an empty frame drops the mark
        else:  # the generic effect: pop what the opcode takes (down to its MARK), push what it leaves
            before = [s.name for s in op.stack_before]
            if "mark" in before:
                pop_mark()
                before = before[:before.index("mark")]
            del stack[max(0, len(stack) - len(before)):]
            stack.extend([None] * len(op.stack_after))
    return modules


def check_request(data: bytes, entries: Iterable[Entry] = NDIF_DESERIALIZATION_MODULES) -> set[str]:
    """Raise :class:`NotWhitelistedError` if unpickling ``data`` (an uncompressed request body) would resolve a
    module outside ``entries`` (default NDIF's unpickling whitelist); else return the modules it resolves.

    Raises:
        NotWhitelistedError: a module outside ``entries``. ArgumentError: ``data`` not bytes, ``entries`` not
            ``(name, strict, blocked)`` triples."""
    entries = tuple(entries) if isinstance(entries, Iterable) and not isinstance(entries, (str, bytes)) else ()
    module_allowed("builtins", entries)  # its check of the entries, whether or not the pickle names a module
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
    "COMPUTED", "NDIF_DESERIALIZATION_MODULES", "NDIF_LIST_COMMIT", "NDIF_MECHANISM_COMMIT", "NDIF_REPO",
    "NDIF_RUNTIME_MODULES", "NDIF_UNPICKLING_COMMIT",
    "NotWhitelistedError", "check_request", "module_allowed", "pickled_modules",
]
