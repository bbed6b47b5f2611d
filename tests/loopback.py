"""A loopback that plays the NDIF server for tests/test_remote.py: a separate Python process that cannot
import ``nnsight_lorsa``, ``jaxtyping`` or ``beartype`` and unpickles requests under NDIF's module whitelist
(details in that test module's docstring); ``run_client`` runs a client script in a fresh interpreter."""

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

TESTS = Path(__file__).resolve().parent


DOC = TESTS.parent / "docs" / "remote.md"


NDIF_DESERIALIZATION_WHITELIST = {
    "PIL", "re", "dataclasses", "builtins", "torch", "collections", "nnsight", "time", "numpy", "sympy", "nnterp",
    "math", "einops", "urllib3", "typing", "_operator", "operator", "pandas", "enum", "__future__", "diffusers",
    "transformers", "tqdm", "heapq", "json", "warnings", "functools", "_functools", "jinja2", "encodings", "peft",
    "pydantic", "argparse", "datasets", "tokenizers", "huggingface_hub", "httpcore", "fsspec", "scipy", "regex",
    "concurrent", "io", "_frozen_importlib_external", "_frozen_importlib", "pickle", "cloudpickle", "copyreg",
    "transformers_modules",
}


SERVER_RUNTIME_IMPORTS = {"torch", "numpy", "einops", "transformers", "nnsight"}


def build_model(seed: int = 0, dtype: str = "float32") -> tuple[Any, Any]:
    """The tiny Llama-3.1-architecture model (GQA, llama3 rope scaling) wrapped by nnsight; nothing attached.

    Client and loopback server both build it with this function (the server gets its source).
    """
    import warnings

    import torch
    from helpers import tiny_hf_model, tiny_tokenizer
    from nnsight import TransformersModel

    hf = tiny_hf_model("llama", seed).to(getattr(torch, dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TransformersModel(hf, task="text-generation", tokenizer=tiny_tokenizer()), hf


SERVER_SCRIPT = r'''
from __future__ import annotations

import builtins, importlib.abc, io, json, os, struct, sys, traceback

BLOCKED = ("nnsight_lorsa", "jaxtyping", "beartype")


class _NotOnServer(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name!r} is not installed on the server")
        return None


sys.meta_path.insert(0, _NotOnServer())
TESTS, SEED, DTYPE = sys.argv[1], int(sys.argv[2]), sys.argv[3]
sys.path = [p for p in sys.path if p not in ("", os.getcwd())] + [TESTS]  # TESTS: for tiny.py only

import cloudpickle.cloudpickle as cp
import torch
from nnsight.intervention.serialization import CustomCloudUnpickler
from nnsight.schema.request import RequestModel
from nnsight.tracing import tracer as tracing

BUILD_MODEL

model, _ = build_model(SEED, DTYPE)
baseline_modules = {n for n, _ in model._module.named_modules()}
resolved = set()
runtime_imports = []


class RecordingUnpickler(CustomCloudUnpickler):
    def find_class(self, module, name):
        resolved.add(module)
        return super().find_class(module, name)


def recording(fn):
    def inner(name, *args):
        resolved.add(name)
        return fn(name, *args)
    return inner


cp.subimport = recording(cp.subimport)
cp.dynamic_subimport = recording(cp.dynamic_subimport)
real_import = builtins.__import__


def audited_import(name, globals=None, locals=None, fromlist=(), level=0):
    caller = sys._getframe(1).f_code.co_filename
    if "nnsight_lorsa" in caller:  # code shipped by value keeps its origin in the filename
        runtime_imports.append([name, level, caller])
    return real_import(name, globals, locals, fromlist, level)


def hooks():
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model._module.modules())


def serve(envelope, blob):
    resolved.clear()
    runtime_imports.clear()
    out = {"saves": None, "error": None, "traceback": None}
    try:
        model._remoteable_set_env(envelope.get("env") or {})
        tracer = RequestModel.deserialize(blob, model._remoteable_persistent_objects(),
                                          compress=envelope["compress"], unpickler=RecordingUnpickler)
        tracing.inc()
        builtins.__import__ = audited_import
        try:
            tracer.execute(tracer.info.code)
            out["saves"] = {k: v for k, v in tracer.info.frame.f_locals.items() if id(v) in tracing._saves()}
        finally:
            builtins.__import__ = real_import
            tracing.dec()
    except BaseException as e:
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()
    out["resolved_modules"] = sorted(resolved)
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
    """A separate Python process that executes serialized requests as an NDIF model actor would.

    ``run(blob, envelope)`` sends one request (the bytes nnsight's ``RequestModel.serialize``
    produced and the ``RequestModel`` envelope as a dict) and returns the server's response:
    ``saves`` (or ``error`` and ``traceback``), ``resolved_modules``, ``runtime_imports``,
    ``extra_modules``/``hooks`` left on the model, ``blocked_loaded``.
    """

    def __init__(self, *, seed: int = 0, dtype: str = "float32") -> None:
        script = SERVER_SCRIPT.replace("BUILD_MODEL", textwrap.dedent(inspect.getsource(build_model)))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - the server's stderr, for its lifetime
        self.proc = subprocess.Popen([sys.executable, "-c", script, str(TESTS), str(seed), dtype],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     cwd=tempfile.gettempdir(), env=env)

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-3000:]

    def _send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(struct.pack("<Q", len(data)))
        self.proc.stdin.write(data)

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


def loopback(server: LoopbackServer) -> None:
    """Route nnsight's ``RemoteBackend`` (so ``remote=True``) to ``server`` instead of NDIF.

    ``RemoteBackend.request`` is the one method that talks to the network; the replacement
    serializes with ``self._serialize`` (nnsight's path, plus our measurement when the backend is
    a ``MeasuredRemoteBackend``), lets the server run it and returns its saves, which
    ``RemoteBackend.__call__`` pushes into the caller's frame as for a real result. Also gives the
    tiny model a model key (it has no Hub id).
    """
    from nnsight.intervention.backends.remote import RemoteBackend, RemoteError
    from nnsight.modeling.transformers import TransformersModel

    def request(self: Any, request: Any, tracer: Any) -> Any:
        response = server.run(self._serialize(tracer), request.model_dump())
        if response["error"]:
            raise RemoteError(f"{response['error']}\n{response['traceback']}")
        bad = [i for i in response["runtime_imports"] if i[0].split(".")[0] not in SERVER_RUNTIME_IMPORTS]
        assert not bad and not response["blocked_loaded"], (bad, response["blocked_loaded"])
        assert not response["extra_modules"] and response["hooks"] == 0, response
        return response["saves"]

    RemoteBackend.request = request
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
