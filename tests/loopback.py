"""A loopback that plays the NDIF server for tests/test_remote.py: a separate Python process that cannot
import ``nnsight_lorsa``, ``jaxtyping`` or ``beartype`` and enforces NDIF's rules -- module whitelists at unpickling
and at run time, no setattr on the model's modules, the queue's size limit (:class:`LoopbackServer`; details in
that test module's docstring and docs/remote.md); ``run_client`` runs a client script in a fresh interpreter."""

from __future__ import annotations

import inspect
import io
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import torch
from helpers import random_ids, tiny_nnsight  # noqa: F401

from nnsight_lorsa.ndif_rules import (  # noqa: F401 - the lists and pins, for the tests
    NDIF_DESERIALIZATION_MODULES,
    NDIF_LIST_COMMIT,
    NDIF_MECHANISM_COMMIT,
    NDIF_RUNTIME_MODULES,
    module_allowed,
)

TESTS = Path(__file__).resolve().parent


DOC = TESTS.parent / "docs" / "remote.md"


#: NDIF's rules, read from its public server code at pinned commits (``nnsight_lorsa.ndif_rules`` has the module
#: lists, their entry semantics and the sources; docs/remote.md "NDIF's rules"): unpickling under
#: ``Protector(WHITELISTED_MODULES_DESERIALIZATION)`` -- ``find_class``, ``cloudpickle.subimport`` and
#: ``dynamic_subimport`` refuse a module outside the list; execution under ``Protector(WHITELISTED_MODULES)``, whose
#: ``__import__`` hands back a module that raises ``ImportError: Module <name> is not whitelisted`` on use; every
#: module of the model wrapped by ``protect()``: setting an attribute raises ``AttributeError: Attribute '<name>'
#: cannot be set after initialization`` and ``.to`` raises ``ValueError``; the API queues
#: ``pickle.dumps(backend_request)`` -- body plus envelope -- on a Redis list, whose default ``proto-max-bulk-len``
#: is 512 MB (Redis units: 512 * 1024**2 bytes).
#: Run-time imports nnsight 0.8.1 itself makes in a *plain* request, as ``(caller file suffix, module)``: outside
#: the pinned list, yet a server that runs nnsight must let them through (a string prompt is tokenized on the
#: server: ``nnsight.modeling.processing.sanitize`` imports ``inspect``, ``transformers`` and
#: ``transformers.pipelines.base``), so the loopback exempts exactly these -- measured on plain ``trace`` (token
#: ids, string) and ``generate`` requests; any other import, by any code (ours, the block's, nnsight's or a
#: library's), must be on the list.
NNSIGHT_OWN_RUNTIME_IMPORTS: tuple[tuple[str, str], ...] = (
    ("nnsight/modeling/processing.py", "inspect"),
    ("nnsight/modeling/processing.py", "transformers"),
    ("nnsight/modeling/processing.py", "transformers.pipelines.base"),
)
#: Redis' default ``proto-max-bulk-len`` ("512mb", Redis units: 512 * 1024 * 1024 bytes): the largest value the
#: queue takes; the loopback refuses a request whose queued form (``pickle.dumps`` of body + envelope) is larger.
REDIS_PROTO_MAX_BULK_LEN = 512 * 1024 * 1024


def build_model(seed: int = 0, dtype: str = "float32", family: str = "llama") -> tuple[Any, Any]:
    """The tiny Llama-3.1-architecture model (GQA, llama3 rope scaling) wrapped by nnsight; nothing attached.
    ``family``: another of ``helpers.FAMILIES`` instead (the remote probe runs every family through the loopback).

    Client and loopback server both build it with this function (the server gets its source).
    """
    import warnings

    import torch
    from helpers import tiny_hf_model, tiny_tokenizer
    from nnsight import TransformersModel

    hf = tiny_hf_model(family, seed).to(getattr(torch, dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformersModel(hf, task="text-generation", tokenizer=tiny_tokenizer(), device="cpu"), hf



SERVER_SCRIPT = r'''
from __future__ import annotations

import builtins, importlib.abc, io, json, os, pickle, struct, sys, traceback

BLOCKED = ("nnsight_lorsa", "jaxtyping", "beartype")


class _NotOnServer(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name!r} is not installed on the server")
        return None


sys.meta_path.insert(0, _NotOnServer())
TESTS, SEED, DTYPE, RULES = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
FAMILY = sys.argv[5]
sys.path = [p for p in sys.path if p not in ("", os.getcwd())] + [TESTS]  # TESTS: for helpers.py only

import cloudpickle.cloudpickle as cp
import torch
from nnsight.intervention.serialization import CustomCloudUnpickler
from nnsight.schema.request import RequestModel
from nnsight.tracing import tracer as tracing

BUILD_MODEL

MODULE_ALLOWED

RUNTIME = tuple((n, s, tuple(b)) for n, s, b in RULES["runtime"])
DESERIALIZATION = tuple((n, s, tuple(b)) for n, s, b in RULES["deserialization"])
MAX_REQUEST = RULES["max_request_bytes"]
EXEMPT = tuple(tuple(e) for e in RULES["exempt"])
model, _ = build_model(SEED, DTYPE, FAMILY)
baseline_modules = {n for n, _ in model._module.named_modules()}
resolved = set()          # every module unpickling resolved (find_class, subimport, dynamic_subimport)
refused = []              # [rule, what, detail]: what the server refused
runtime_imports = []      # [name, level, caller] of every import made while the request ran
PROTECTED = [False]       # whether the model's modules are protect()ed now (deserialization + execution)


# ---- (a) module whitelist at unpickling: NDIF's Protector(WHITELISTED_MODULES_DESERIALIZATION) patches
#      CustomCloudUnpickler.find_class, cloudpickle.subimport and cloudpickle.dynamic_subimport
def refuse_unpickle(module):
    resolved.add(module)
    if not module_allowed(module, DESERIALIZATION):
        refused.append(["unpickling whitelist", module, ""])
        raise ImportError(f"Module {module} is not whitelisted")


class WhitelistUnpickler(CustomCloudUnpickler):
    def find_class(self, module, name):
        refuse_unpickle(module)
        return super().find_class(module, name)


def checked(fn):
    def inner(name, *args):
        refuse_unpickle(name)
        return fn(name, *args)
    return inner


cp.subimport = checked(cp.subimport)
cp.dynamic_subimport = checked(cp.dynamic_subimport)


# ---- (a) module whitelist at run time: NDIF's Importer replaces builtins.__import__ while the request runs; a
#      module outside the list comes back as an object that raises on first use (a speculative import may pass)
real_import = builtins.__import__


class UnauthorizedModule:
    def __init__(self, name):
        object.__setattr__(self, "_module_name", name)

    def _raise(self, *args, **kwargs):
        raise ImportError(f"Module {object.__getattribute__(self, '_module_name')} is not whitelisted")

    def __getattribute__(self, name):
        object.__getattribute__(self, "_raise")()

    __setattr__ = __delattr__ = __call__ = __iter__ = __getitem__ = __contains__ = __bool__ = _raise


def whitelisted_import(name, globals=None, locals=None, fromlist=(), level=0):
    caller = sys._getframe(1).f_code.co_filename
    if level > 0:
        result = real_import(name, globals, locals, fromlist, level)
        full = result.__name__
    else:
        full, result = name, None
    runtime_imports.append([full, level, caller])
    exempt = any(caller.endswith(suffix) and full == module for suffix, module in EXEMPT)
    if name in ("builtins", "__builtins__") or exempt or module_allowed(full, RUNTIME):
        return result if result is not None else real_import(name, globals, locals, fromlist, level)
    refused.append(["run-time import whitelist", full, caller])
    return UnauthorizedModule(full)


# ---- (b) no setattr on the model's modules: NDIF's protect() wraps each of them; the loopback makes the modules
#      themselves refuse (also a child mounted through add_module / _modules, which protect() meant to forbid)
def protected_class(cls):
    def __setattr__(self, name, value):
        if PROTECTED[0]:
            refused.append(["no setattr on the model's modules", name, type(self).__name__])
            raise AttributeError(f"Attribute '{name}' cannot be set after initialization")
        return cls.__setattr__(self, name, value)

    def __delattr__(self, name):
        if PROTECTED[0]:
            refused.append(["no setattr on the model's modules", name, type(self).__name__])
            raise AttributeError(f"Attribute '{name}' cannot be set after initialization")
        return cls.__delattr__(self, name)

    def to(self, *args, **kwargs):  # protect() refuses the attribute itself; a method is cheaper to override
        if PROTECTED[0]:
            refused.append(["no .to on the model's modules", "to", type(self).__name__])
            raise ValueError("Attribute `to` cannot be accessed")
        return cls.to(self, *args, **kwargs)

    return type(cls.__name__, (cls,), {"__setattr__": __setattr__, "__delattr__": __delattr__, "to": to,
                                       "__module__": cls.__module__, "__qualname__": cls.__qualname__})


class ProtectedChildren(dict):
    def __setitem__(self, key, value):
        if PROTECTED[0]:
            refused.append(["no setattr on the model's modules", key, "a child module"])
            raise AttributeError(f"Attribute '{key}' cannot be set after initialization")
        return dict.__setitem__(self, key, value)

    def __delitem__(self, key):
        if PROTECTED[0]:
            refused.append(["no setattr on the model's modules", key, "a child module"])
            raise AttributeError(f"Attribute '{key}' cannot be set after initialization")
        return dict.__delitem__(self, key)


_classes = {}
for module in list(model._module.modules()):
    cls = type(module)
    if cls not in _classes:
        _classes[cls] = protected_class(cls)
    object.__setattr__(module, "_modules", ProtectedChildren(module._modules))
    module.__class__ = _classes[cls]


def hooks():
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model._module.modules())


def queued_size(envelope, blob):
    # what the API pushes onto the Redis list: pickle.dumps(BackendRequestModel) -- the body and its envelope
    return len(pickle.dumps({"request": blob, "id": "0" * 36, "api_key": "0" * 40, "session_id": None,
                             "callback": "", "python_version": sys.version, "nnsight_version": "0.8.1",
                             "content_length": len(blob), "ip_address": "127.0.0.1", "user_agent": "nnsight",
                             **envelope}))


def serve(envelope, blob):
    resolved.clear()
    refused.clear()
    runtime_imports.clear()
    out = {"saves": None, "error": None, "traceback": None, "queued_bytes": queued_size(envelope, blob)}
    try:
        if out["queued_bytes"] > MAX_REQUEST:  # (c) the request size limit: refused before anything runs
            refused.append(["request size limit", str(out["queued_bytes"]), str(MAX_REQUEST)])
            raise RuntimeError(f"ERR Protocol error: invalid bulk length ({out['queued_bytes']} bytes queued, "
                               f"proto-max-bulk-len {MAX_REQUEST})")
        model._remoteable_set_env(envelope.get("env") or {})
        PROTECTED[0] = True
        try:
            tracer = RequestModel.deserialize(blob, model._remoteable_persistent_objects(),
                                              compress=envelope["compress"], unpickler=WhitelistUnpickler)
            tracing.inc()
            builtins.__import__ = whitelisted_import
            try:
                tracer.execute(tracer.info.code)
                out["saves"] = {k: v for k, v in tracer.info.frame.f_locals.items() if id(v) in tracing._saves()}
            finally:
                builtins.__import__ = real_import
                tracing.dec()
        finally:
            PROTECTED[0] = False
    except BaseException as e:
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
    out["resolved_modules"] = sorted(resolved)
    out["refused"] = [list(r) for r in refused]
    out["runtime_imports"] = list(runtime_imports)
    out["extra_modules"] = sorted({n for n, _ in model._module.named_modules()} - baseline_modules)
    out["hooks"] = hooks()
    out["blocked_loaded"] = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    return out


inp, reply = sys.stdin.buffer, sys.stdout.buffer
sys.stdout = sys.stderr  # prints of the traced block go to the log, not into the protocol
base_hooks = hooks()
while True:
    size = struct.unpack("<Q", inp.read(8))[0]
    if size == 0:
        break
    envelope = json.loads(inp.read(size))
    blob = inp.read(struct.unpack("<Q", inp.read(8))[0])
    if envelope.get("__env__"):  # NDIF's GET /env: the server's python and packages, by import name
        from importlib.metadata import version
        response = {"python_version": RULES.get("python_version") or sys.version,
                    "packages": {"torch": torch.__version__, "nnsight": RULES["nnsight_version"] or version("nnsight")}}
    else:
        response = serve(envelope, blob)
        response["hooks"] -= base_hooks
    buffer = io.BytesIO()
    torch.save(response, buffer)
    data = buffer.getvalue()
    reply.write(struct.pack("<Q", len(data)))
    reply.write(data)
    reply.flush()
'''


class LoopbackServer:
    """A separate Python process that executes serialized requests as an NDIF model actor would, under NDIF's rules.

    ``run(blob, envelope)`` sends one request (the bytes nnsight's ``RequestModel.serialize``
    produced and the ``RequestModel`` envelope as a dict) and returns the server's response:
    ``saves`` (or ``error`` and ``traceback``), ``resolved_modules`` (every module unpickling resolved),
    ``runtime_imports`` (``[name, level, caller file]`` of every import made while the request ran), ``refused``
    (``[rule, what, detail]`` for each rule the request broke), ``queued_bytes`` (the size of the request as the
    queue holds it), ``extra_modules``/``hooks`` left on the model, ``blocked_loaded``.

    The rules (``nnsight_lorsa.ndif_rules``, sent to the server as JSON): unpickling resolves only modules of
    ``deserialization`` by full dotted name (``find_class``, ``cloudpickle.subimport``/``dynamic_subimport``);
    imports while the request runs, by any code, get only modules of ``runtime`` (others come back as an object
    that raises ``ImportError: Module <name> is not whitelisted`` on first use), but for the few nnsight itself
    makes in a plain request (:data:`NNSIGHT_OWN_RUNTIME_IMPORTS`); the model's modules refuse
    ``setattr``/``delattr``, a child module mounted or removed (``add_module``, ``_modules``) and ``.to`` during
    unpickling and execution; a request larger than ``max_request_bytes`` once queued is refused before it is
    unpickled.

    ``env()`` answers as NDIF's ``GET /env`` does (``{"python_version", "packages": {import name: version}}``, the
    server's nnsight among them); :func:`loopback` serves it over HTTP.

    Args:
        seed, dtype, family: the server's model (:func:`build_model`).
        max_request_bytes: the queue's limit, default Redis' ``proto-max-bulk-len`` (512 MiB); small in tests.
        runtime, deserialization: the module whitelists, default NDIF's (:data:`NDIF_RUNTIME_MODULES`,
            :data:`NDIF_DESERIALIZATION_MODULES`).
        nnsight_version: the nnsight version ``env()`` reports; None: the one the server process has installed.
        python_version: the ``python_version`` ``env()`` reports; None: the server process's ``sys.version``.
    """

    def __init__(self, *, seed: int = 0, dtype: str = "float32", max_request_bytes: int = REDIS_PROTO_MAX_BULK_LEN,
                 runtime: tuple = NDIF_RUNTIME_MODULES, deserialization: tuple = NDIF_DESERIALIZATION_MODULES,
                 nnsight_version: str | None = None, family: str = "llama", python_version: str | None = None) -> None:
        script = (SERVER_SCRIPT.replace("BUILD_MODEL", textwrap.dedent(inspect.getsource(build_model)))
                  .replace("MODULE_ALLOWED", textwrap.dedent(inspect.getsource(module_allowed))))
        rules = json.dumps({"runtime": runtime, "deserialization": deserialization,
                            "max_request_bytes": max_request_bytes, "exempt": NNSIGHT_OWN_RUNTIME_IMPORTS,
                            "nnsight_version": nnsight_version, "python_version": python_version})
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - the server's stderr, for its lifetime
        self.proc = subprocess.Popen([sys.executable, "-c", script, str(TESTS), str(seed), dtype, rules, family],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     cwd=tempfile.gettempdir(), env=env)

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-3000:]

    def _send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(struct.pack("<Q", len(data)))
        self.proc.stdin.write(data)

    def env(self) -> dict:
        """The server's environment, as NDIF's ``GET /env`` returns it."""
        return self.run(b"", {"__env__": True})

    def run(self, blob: bytes, envelope: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self._send(json.dumps(envelope).encode())
            self._send(blob)
            self.proc.stdin.flush()
        except BrokenPipeError as e:
            raise RuntimeError(f"loopback server died:\n{self.log()}") from e
        head = self.proc.stdout.read(8)
        if len(head) < 8:
            raise RuntimeError(f"loopback server died:\n{self.log()}")
        data = self.proc.stdout.read(struct.unpack("<Q", head)[0])
        return torch.load(io.BytesIO(data), weights_only=False)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(struct.pack("<Q", 0))
            self.proc.stdin.close()
            self.proc.wait(30)
        self._log.close()


def serve_env(server: LoopbackServer, path: str = "/env") -> str:
    """Serve ``server.env()`` at ``GET {path}`` (NDIF's ``/env``) over HTTP on 127.0.0.1 (a daemon thread), 404
    elsewhere; returns the host URL."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Env(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = json.dumps(server.env()).encode() if self.path == path else b"{}"
            self.send_response(200 if self.path == path else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Env)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{httpd.server_address[1]}"


def loopback(server: LoopbackServer) -> None:
    """Route nnsight's ``RemoteBackend`` (so ``remote=True``) to ``server`` instead of NDIF.

    ``RemoteBackend.request`` is the one method that talks to the network; the replacement
    serializes with ``self._serialize`` (nnsight's path, plus our measurement when the backend is
    a ``MeasuredRemoteBackend``), lets the server run it and returns its saves, which
    ``RemoteBackend.__call__`` pushes into the caller's frame as for a real result. Also gives the
    tiny model a model key (it has no Hub id). The server's ``GET /env`` is served over HTTP (:func:`serve_env`)
    and nnsight's ``CONFIG.API.HOST`` points there, so the client's version check reads the loopback's version.
    """
    from nnsight import CONFIG
    from nnsight.intervention.backends.remote import RemoteError
    from nnsight.modeling.transformers import TransformersModel

    from nnsight_lorsa.envoy.nnsight_internals import RemoteBackend  # nnsight's class, even after register()

    def request(self: Any, request: Any, tracer: Any) -> Any:
        response = server.run(self._serialize(tracer), request.model_dump())
        if response["error"]:
            raise RemoteError(f"{response['error']}\n{response['traceback']}")
        assert not response["refused"] and not response["blocked_loaded"], (response["refused"],
                                                                             response["blocked_loaded"])
        assert not response["extra_modules"] and response["hooks"] == 0, response
        return response["saves"]

    RemoteBackend.request = request
    CONFIG.API.HOST = serve_env(server)
    TransformersModel._remoteable_model_key = lambda self: "tiny-llama-3.1-architecture"


def run_client(script: str, timeout: int = 240) -> dict:
    """Run ``script`` in a fresh interpreter (no type-checking hook); it prints one JSON line last. The
    checkout under test comes first on its path (an editable install may point at another worktree)."""
    path = [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=tempfile.gettempdir())
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


DOC_SETUP = r'''
import torch
import nnsight
from loopback import build_model
from helpers import make_lorsa
from nnsight_lorsa import LorsaSet, get_adapter

model, hf = build_model(dtype="bfloat16")       # the tiny Llama-3.1-architecture model, in bf16 as on NDIF
lorsas = LorsaSet(model, {L: make_lorsa(hf, get_adapter(model), layer=L) for L in (1, 2)})
prompt = "w5 w17 w3 w99 w5 w17 w3 w42"
layer, head = 1, 3
'''


def doc_blocks() -> list[tuple[str, str]]:
    """The ```python ndif / ```python ndif-setup blocks of docs/remote.md, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```python (ndif(?:-setup)?)\n(.*?)```", DOC.read_text(),
                                                          re.DOTALL)]
