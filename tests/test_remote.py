"""Remote execution (NDIF): payload measurement and caps, and a loopback that plays the server.

The loopback (:class:`LoopbackServer`) is a separate Python process that does what an NDIF model
actor does with a request, using nnsight's own code for every step it can:

- it cannot import ``nnsight_lorsa``, ``jaxtyping`` or ``beartype`` (a ``sys.meta_path`` finder
  raises ``ImportError`` for them), so everything our objects need must travel by value;
- it builds its own model from the same seed (a tiny ``LlamaForCausalLM`` with Llama-3.1-8B's
  architecture: GQA, llama3 rope scaling), fresh, with nothing attached;
- per request: ``model._remoteable_set_env(env)``, ``RequestModel.deserialize(blob,
  model._remoteable_persistent_objects(), compress=...)``, ``tracer.execute(tracer.info.code)`` in a
  trace scope, and it returns the saved values ``torch.save``-d, as the result blob is;
- it records which modules unpickling resolves (to compare with NDIF's deserialization
  whitelist), which imports our shipped code makes while running, and what is left attached to
  the model afterwards.

What it does not reproduce (NDIF's source, ``ndif-team/ndif``): the Ray/queue/websocket transport,
the ``Protector`` sandbox (import hook, stripped builtins, attribute guards, audit hook), the
``ProtectedObject`` wrapping of the model's modules, the CUDA placement and bf16 autocast.

The trace requests are serialized by nnsight itself: ``MeasuredRemoteBackend`` (a subclass of
nnsight's ``RemoteBackend``) calls ``RemoteBackend._serialize`` -- ``pull_env()`` then
``RequestModel.serialize(tracer, compress)`` -- and keeps the bytes instead of POSTing them.
"""

from __future__ import annotations

import ast
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

import pytest
import torch
from tiny import random_ids, tiny_nnsight

TESTS = Path(__file__).resolve().parent
DOC = TESTS.parent / "docs" / "remote.md"

#: Roots of ``deserialization_modules`` + ``modules`` in NDIF's sandbox whitelist
#: (``ndif-team/ndif``, ``src/ndif/services/ray/nn/security/whitelist.yaml``, as stored); unpickling
#: a request there may resolve only these.
NDIF_DESERIALIZATION_WHITELIST = {
    "PIL", "re", "dataclasses", "builtins", "torch", "collections", "nnsight", "time", "numpy", "sympy", "nnterp",
    "math", "einops", "urllib3", "typing", "_operator", "operator", "pandas", "enum", "__future__", "diffusers",
    "transformers", "tqdm", "heapq", "json", "warnings", "functools", "_functools", "jinja2", "encodings", "peft",
    "pydantic", "argparse", "datasets", "tokenizers", "huggingface_hub", "httpcore", "fsspec", "scipy", "regex",
    "concurrent", "io", "_frozen_importlib_external", "_frozen_importlib", "pickle", "cloudpickle", "copyreg",
    "transformers_modules",
}
#: Imports our shipped code may make while running on the server.
SERVER_RUNTIME_IMPORTS = {"torch", "numpy", "einops", "transformers", "nnsight"}


def build_model(seed: int = 0, dtype: str = "float32") -> tuple[Any, Any]:
    """The tiny Llama-3.1-architecture model (GQA, llama3 rope scaling) wrapped by nnsight; nothing attached.

    Client and loopback server both build it with this function (the server gets its source).
    """
    import warnings

    import torch
    from nnsight import TransformersModel
    from tiny import tiny_hf_model, tiny_tokenizer

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


# ---------------------------------------------------------------- (a) strict loopback: replace
REPLACE_CLIENT = r'''
import json, torch, nnsight
from test_remote import LoopbackServer, build_model
from test_replace import make_lorsa
from tiny import random_ids
from nnsight_lorsa import LorsaSet, get_adapter
from nnsight_lorsa.remote import register, remote_backend

server = LoopbackServer()
model, hf = build_model()
lorsas = LorsaSet(model, {1: make_lorsa(hf, get_adapter(model))})
register()
ids = random_ids()

with model.trace(ids):                        # local reference run
    site = lorsas.replace(layer=1)
    site.hook_z.output[:, :, 2] = 0
    z = nnsight.save(site.hook_z.output)
    logits = nnsight.save(model.lm_head.output)
local = {"z": z, "logits": logits}
with model.trace(ids):
    clean = nnsight.save(model.lm_head.output)

backend = remote_backend(model, dry_run=True)    # the same trace, serialized by nnsight, not sent
with model.trace(ids, backend=backend):
    site = lorsas.replace(layer=1)
    site.hook_z.output[:, :, 2] = 0
    z = nnsight.save(site.hook_z.output)
    logits = nnsight.save(model.lm_head.output)
first = server.run(backend.blob, backend.envelope.model_dump())

backend_err = remote_backend(model, dry_run=True)
with model.trace(ids, backend=backend_err):
    lorsas.replace(layer=1, error=True)
    logits_err = nnsight.save(model.lm_head.output)
second = server.run(backend_err.blob, backend_err.envelope.model_dump())
server.close()

def diff(saves, name, ref):
    if not saves or name not in saves:
        return None
    return float((saves[name].float() - ref.float()).abs().max())

out = {"payload_bytes": len(backend.blob), "tensor_bytes": backend.report.total_tensor_bytes,
       "compressed": backend.envelope.compress, "attached_locally": sorted(
           n for n, _ in hf.named_modules() if "lorsa" in n)}
for key, resp in (("replace", first), ("error_term", second)):
    out[key] = {k: resp[k] for k in ("error", "traceback", "resolved_modules", "runtime_imports", "extra_modules",
                                     "hooks", "blocked_loaded")}
out["replace"]["diff_z"] = diff(first["saves"], "z", local["z"])
out["replace"]["diff_logits"] = diff(first["saves"], "logits", local["logits"])
out["replace"]["equal"] = bool(first["saves"]) and all(torch.equal(first["saves"][k], local[k]) for k in local)
out["error_term"]["diff_logits_vs_clean"] = diff(second["saves"], "logits_err", clean)
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def replace_loopback() -> dict:
    return run_client(REPLACE_CLIENT)


def _non_whitelisted(modules: list[str]) -> set[str]:
    return {m.split(".")[0] for m in modules} - NDIF_DESERIALIZATION_WHITELIST


def test_replace_runs_on_a_server_without_nnsight_lorsa(replace_loopback: dict) -> None:
    """The strict loopback: nnsight's serializer → a separate server process → the same saves."""
    out = replace_loopback
    for key in ("replace", "error_term"):
        resp = out[key]
        # nothing of ours, jaxtyping or beartype was imported server-side, and nothing stayed attached
        assert resp["blocked_loaded"] == [], resp["blocked_loaded"]
        assert resp["extra_modules"] == [] and resp["hooks"] == 0, resp
        assert _non_whitelisted(resp["resolved_modules"]) == set(), resp["resolved_modules"]
        assert resp["error"] is None, resp["traceback"]
        bad = [i for i in resp["runtime_imports"] if i[0].split(".")[0] not in SERVER_RUNTIME_IMPORTS]
        assert not bad, bad
    assert out["replace"]["equal"], (out["replace"]["diff_z"], out["replace"]["diff_logits"])
    assert out["error_term"]["diff_logits_vs_clean"] < 1e-5
    assert out["attached_locally"] == []
    assert out["compressed"] and 0 < out["payload_bytes"] < 200_000


def test_request_resolves_only_ndif_whitelisted_modules(replace_loopback: dict) -> None:
    """NDIF unpickles requests under a module whitelist: our shipped objects resolve nothing outside it."""
    assert _non_whitelisted(replace_loopback["replace"]["resolved_modules"]) == set()


# ---------------------------------------------------------------- (c) the NDIF doc blocks, against the loopback
DOC_SETUP = r'''
import torch
import nnsight
from test_remote import build_model
from test_replace import make_lorsa
from nnsight_lorsa import LorsaSet, get_adapter

model, hf = build_model(dtype="bfloat16")       # the tiny Llama-3.1-architecture model, in bf16 as on NDIF
lorsas = LorsaSet(model, {L: make_lorsa(hf, get_adapter(model), layer=L) for L in (1, 2)})
prompt = "w5 w17 w3 w99 w5 w17 w3 w42"
layer, head = 1, 3
'''

DOC_CLIENT = r'''
import json, linecache, sys
from test_remote import DOC_SETUP, LoopbackServer, doc_blocks, loopback

server = LoopbackServer(dtype="bfloat16")
loopback(server)
namespace = {"__name__": "doc_remote"}
for i, (kind, block) in enumerate(doc_blocks()):
    if kind == "ndif-setup":
        block = DOC_SETUP
    filename = f"<doc remote.md ndif block {i}>"
    linecache.cache[filename] = (len(block), None, block.splitlines(keepends=True), filename)
    try:
        exec(compile(block, filename, "exec"), namespace)
    except BaseException as e:
        server.close()
        raise AssertionError(f"remote.md ndif block {i} failed: {e!r}\n{block}") from e
server.close()
print(json.dumps({"blocks": i + 1}))
'''


def doc_blocks() -> list[tuple[str, str]]:
    """The ```python ndif / ```python ndif-setup blocks of docs/remote.md, in order."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```python (ndif(?:-setup)?)\n(.*?)```", DOC.read_text(),
                                                          re.DOTALL)]


def _assigned_names(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def test_ndif_doc_blocks_run_against_the_loopback() -> None:
    """Every ```python ndif block of docs/remote.md runs with ``remote=True`` served by the loopback.

    The setup block (API key, the 8B model from the Hub, the trained checkpoint) is replaced by
    the tiny model in bf16 with two Lorsas; it must define the same names the other blocks use.
    """
    blocks = doc_blocks()
    setups = [b for kind, b in blocks if kind == "ndif-setup"]
    assert len(setups) == 1 and len(blocks) >= 4
    assert {"model", "lorsas", "prompt", "layer", "head"} <= _assigned_names(setups[0]) & _assigned_names(DOC_SETUP)
    out = run_client(DOC_CLIENT)
    assert out["blocks"] == len(blocks)


# ---------------------------------------------------------------- (b) payload reports and caps (in-process)
def _tiny_set() -> tuple[Any, Any]:
    from test_replace import make_lorsa

    from nnsight_lorsa import LorsaSet, get_adapter

    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(model)
    return model, LorsaSet(model, {L: make_lorsa(hf, adapter, layer=L) for L in (1, 2)})


def test_payload_of_a_llama31_8b_layer_is_counted_exactly() -> None:
    from nnsight_lorsa import Lorsa, LorsaConfig
    from nnsight_lorsa.remote import payload_report

    cfg = LorsaConfig(d_model=4096, n_qk_heads=32, d_qk_head=128, n_ov_heads=32768, top_k=128)
    report = payload_report(Lorsa(cfg, device="meta", dtype=torch.bfloat16), name="lorsa")
    sizes = {t.name: t.nbytes for t in report.tensors}
    assert sizes["lorsa.W_V"] == sizes["lorsa.W_O"] == 32768 * 4096 * 2
    assert sizes["lorsa.W_Q"] == sizes["lorsa.W_K"] == 32 * 4096 * 128 * 2
    assert report.total_tensor_bytes == 2 * (302_034_944) == 604_069_888
    assert [t.name for t in report.largest(2)] == ["lorsa.W_V", "lorsa.W_O"]


def test_for_remote_keeps_the_layers_asked_for_in_the_dtype_asked_for() -> None:
    from nnsight_lorsa.errors import LayerOutOfRangeError
    from nnsight_lorsa.remote import for_remote, model_dtype, payload_report

    model, lorsas = _tiny_set()
    from nnsight_lorsa import ReplacementModel

    rm = ReplacementModel(model, lorsas=lorsas)
    sub = for_remote(rm, layers=[1], dtype=torch.bfloat16).lorsas
    assert sub.layers == [1] and sub.model is model
    assert sub[1] is not lorsas[1] and all(p.dtype == torch.bfloat16 for p in sub[1].parameters())
    assert torch.equal(sub[1].W_V, lorsas[1].W_V.to(torch.bfloat16))
    assert lorsas[1].W_V.dtype == torch.float32  # the original is untouched
    full, half = payload_report(lorsas), payload_report(sub)
    assert full.by_layer == {1: half.total_tensor_bytes * 2, 2: half.total_tensor_bytes * 2}
    assert payload_report(lorsas, layers=2).by_layer.keys() == {2}
    same = for_remote(rm, 2).lorsas  # default: the model's dtype (float32 here): no copy of the data
    assert model_dtype(rm) == torch.float32
    assert same[2].W_V.data_ptr() == lorsas[2].W_V.data_ptr() and same[2] is not lorsas[2]
    with pytest.raises(LayerOutOfRangeError, match="layer 0"):
        for_remote(rm, [0])


def test_for_remote_casts_every_replacement_of_the_bundle() -> None:
    from test_sae_transcoder import make_sae, make_transcoder

    from nnsight_lorsa import ReplacementModel
    from nnsight_lorsa.remote import for_remote, payload_report

    model, lorsas = _tiny_set()
    rm = ReplacementModel(model, lorsas=lorsas, transcoders={0: make_transcoder(), 1: make_transcoder(seed=1)},
                          saes={"model.layers.2": make_sae()})
    sent = for_remote(rm, layers=[1], dtype=torch.bfloat16)
    assert sent.lorsas.layers == [1] and list(sent.transcoders) == [1] and list(sent.saes) == ["model.layers.2"]
    for module in (sent.lorsas[1], sent.transcoders[1], sent.saes["model.layers.2"]):
        assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    assert torch.equal(sent.transcoders[1].W_enc, rm.transcoders[1].W_enc.to(torch.bfloat16))
    names = {t.name for t in payload_report(sent).tensors}
    assert {"lorsas[1].W_V", "transcoders[1].W_enc", "saes['model.layers.2'].W_enc"} <= names
    assert payload_report(rm, layers=[1]).by_layer.keys() == {1, None}  # None: the SAE, kept whole


def test_check_payload_names_the_largest_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    from nnsight_lorsa import LorsaError
    from nnsight_lorsa.remote import CAP_ENV, PayloadTooLargeError, check_payload, default_cap_bytes, parse_bytes

    _, lorsas = _tiny_set()
    total = check_payload(lorsas).total_tensor_bytes  # default cap: 1 GiB
    with pytest.raises(PayloadTooLargeError) as info:
        check_payload(lorsas, cap_bytes="100KB")
    message = str(info.value)
    assert isinstance(info.value, LorsaError) and info.value.report.total_bytes == total == 199_680
    assert "above the cap of 100.0 KB" in message and "lorsas[1].W_Q" in message and "for_remote" in message
    assert "Per layer: 1: 99.8 KB, 2: 99.8 KB" in message
    assert check_payload(lorsas, cap_bytes="100KB", layers=[1]).by_layer == {1: 99_840}
    monkeypatch.setenv(CAP_ENV, "0.5MiB")
    assert default_cap_bytes() == 524_288
    monkeypatch.setenv(CAP_ENV, "150000")
    with pytest.raises(PayloadTooLargeError, match=r"\$NNSIGHT_LORSA_MAX_PAYLOAD"):
        check_payload(lorsas)
    assert parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes(7) == 7
    with pytest.raises(ValueError, match="byte count"):
        parse_bytes("3 parsecs")


def test_measured_backend_refuses_an_oversized_request_before_serializing() -> None:
    import nnsight

    from nnsight_lorsa.remote import PayloadTooLargeError, remote_backend

    model, lorsas = _tiny_set()
    backend = remote_backend(model, dry_run=True, cap_bytes=150_000)
    with pytest.raises(PayloadTooLargeError, match=r"lorsas\[1\]\.W_Q") as info, model.trace(
            random_ids(), backend=backend):
        lorsas.replace(layer=1)
        nnsight.save(model.lm_head.output)
    assert info.value.report.by_layer == {1: 99_840, 2: 99_840}
    assert backend.blob is None  # refused before anything was serialized


# ---------------------------------------------------------------- register / serialized size (subprocess)
REGISTER_CLIENT = r'''
import json, torch, nnsight
from nnsight.intervention.backends import remote as rb
from test_remote import build_model
from test_replace import make_lorsa
from nnsight_lorsa import LorsaSet, ReplacementModel, get_adapter
from nnsight_lorsa.remote import MeasuredRemoteBackend, for_remote, payload_report, register, unregister
model, hf = build_model()
lorsas = LorsaSet(model, {1: make_lorsa(hf, get_adapter(model))})
sub = for_remote(ReplacementModel(model, lorsas=lorsas), 1, torch.bfloat16).lorsas
by_reference = payload_report(sub, serialize=True).serialized_bytes
register()
patched = rb.RemoteBackend is MeasuredRemoteBackend
by_value = payload_report(sub, serialize=True)
unregister()
print(json.dumps({"by_reference": by_reference, "by_value": by_value.serialized_bytes,
                  "tensor_bytes": by_value.total_tensor_bytes, "patched": patched,
                  "restored": rb.RemoteBackend is not MeasuredRemoteBackend}))
'''


def test_register_ships_code_by_value_and_guards_remote_true() -> None:
    out = run_client(REGISTER_CLIENT)
    assert out["patched"] and out["restored"]
    assert out["tensor_bytes"] == 49_920
    # by value the package's source travels too: tens of KB more than the by-reference pickle
    assert out["by_value"] > out["by_reference"] + 10_000
