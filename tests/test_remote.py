"""Remote execution (NDIF): payload measurement and caps, and a loopback that plays the server.

The loopback (:class:`LoopbackServer`) is a separate Python process that does what an NDIF model
actor does with a request, using nnsight's own code for every step it can:

- it cannot import ``nnsight_lorsa``, ``jaxtyping`` or ``beartype`` (a ``sys.meta_path`` finder
  raises ``ImportError`` for them), so everything our objects need must travel by value;
- it builds its own model from the same seed (a tiny ``LlamaForCausalLM`` with Llama-3.1-8B's
  architecture: GQA, llama3 rope scaling), fresh, with nothing attached;
- per request, under NDIF's rules (pinned sources in ``nnsight_lorsa.ndif_rules`` and docs/remote.md, "NDIF's
  rules"): a request larger than the queue takes (``pickle.dumps`` of body + envelope above
  ``max_request_bytes``) is refused before it is unpickled; ``model._remoteable_set_env(env)``;
  ``RequestModel.deserialize(blob, model._remoteable_persistent_objects(), compress=...)`` with an unpickler whose
  ``find_class`` (and cloudpickle's ``subimport``/``dynamic_subimport``) refuse a module outside NDIF's unpickling
  whitelist by full dotted name; ``tracer.execute(tracer.info.code)`` in a trace scope with ``builtins.__import__``
  checking every import against the run-time whitelist (a refused module raises on first use, as NDIF's does) and
  the model's modules refusing ``setattr``, a mounted child and ``.to`` (NDIF's ``protect()``); it returns the saved
  values ``torch.save``-d, as the result blob is;
- it records which modules unpickling resolves, every import made while running (with its caller), each rule a
  request broke, and what is left attached to the model afterwards.

What it does not reproduce: the Ray/queue/websocket transport, the ``ProtectedModule`` attribute checks on imported
modules, the stripped builtins, the audit hook, the copies ``protect()`` hands out for tensor/list/dict attributes,
the CUDA placement and bf16 autocast.

The trace requests are serialized by nnsight itself: ``MeasuredRemoteBackend`` (a subclass of
nnsight's ``RemoteBackend``) calls ``RemoteBackend._serialize`` -- ``pull_env()`` then
``RequestModel.serialize(tracer, compress)`` -- and keeps the bytes instead of POSTing them.
"""

from __future__ import annotations

import ast
from typing import Any

import pytest
import torch
from helpers import random_ids, tiny_nnsight
from loopback import (
    DOC_SETUP,
    NDIF_DESERIALIZATION_MODULES,
    NDIF_RUNTIME_MODULES,
    REDIS_PROTO_MAX_BULK_LEN,
    doc_blocks,
    module_allowed,
    run_client,
)

# ---------------------------------------------------------------- (a) strict loopback: replace
REPLACE_CLIENT = r'''
import fractions, json, torch, nnsight
from loopback import LoopbackServer, build_model
from helpers import make_lorsa
from helpers import random_ids
from nnsight_lorsa import LorsaSet, get_adapter
from nnsight_lorsa.remote import NotWhitelistedError, register, remote_backend

LIMIT = 300_000  # the queue's limit (Redis proto-max-bulk-len), small: a replace request is ~0.1 MB
server = LoopbackServer(max_request_bytes=LIMIT)
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

# ---- the loopback's strictness itself (the same server: its queue takes LIMIT bytes)
strict = {}

def send(name, sb):
    resp = server.run(sb.blob, sb.envelope.model_dump())
    strict[name] = {k: resp[k] for k in ("error", "refused", "queued_bytes", "extra_modules", "resolved_modules")}
    strict[name]["saved"] = sorted(resp["saves"] or ())

sb = remote_backend(model, dry_run=True)                  # control: a plain request passes
with model.trace(ids, backend=sb):
    logits = nnsight.save(model.lm_head.output)
send("plain", sb)

sb = remote_backend(model, dry_run=True)                  # an import the run-time whitelist lacks
with model.trace(ids, backend=sb):
    import pathlib
    where = nnsight.save(str(pathlib.PurePosixPath("a") / "b"))
send("runtime_import", sb)

third = fractions.Fraction(1, 3)                               # unpickling resolves a module outside the list
try:                                                           # the client refuses it before sending ...
    with model.trace(ids, backend=remote_backend(model, dry_run=True)):
        scaled = nnsight.save(model.lm_head.output * float(third))
except NotWhitelistedError as e:
    strict["client_refused"] = e.modules
sb = remote_backend(model, dry_run=True, check_rules=False)   # ... and the server when it is sent anyway
with model.trace(ids, backend=sb):
    scaled = nnsight.save(model.lm_head.output * float(third))
send("unpickle", sb)

sb = remote_backend(model, dry_run=True)                  # a child module mounted on a module of the model
with model.trace(ids, backend=sb):
    model.model.layers[0].extra = torch.nn.Linear(2, 2)
    mounted = nnsight.save(model.lm_head.output)
send("mount", sb)

big = torch.randn(100_000, generator=torch.Generator().manual_seed(0))  # 400 KB, incompressible: above LIMIT
sb = remote_backend(model, dry_run=True)
with model.trace(ids, backend=sb):
    shifted = nnsight.save(model.lm_head.output + big[0])
send("oversized", sb)
strict["oversized"]["blob"] = len(sb.blob)
server.close()

def diff(saves, name, ref):
    if not saves or name not in saves:
        return None
    return float((saves[name].float() - ref.float()).abs().max())

import zstandard
from nnsight_lorsa.ndif_rules import pickled_modules

scanned = {k: sorted(pickled_modules(zstandard.ZstdDecompressor().decompress(b.blob)))
           for k, b in (("replace", backend), ("error_term", backend_err))}
out = {"scanned": scanned, "payload_bytes": len(backend.blob), "tensor_bytes": backend.report.total_tensor_bytes,
       "compressed": backend.envelope.compress, "attached_locally": sorted(
           n for n, _ in hf.named_modules() if "lorsa" in n)}
for key, resp in (("replace", first), ("error_term", second)):
    out[key] = {k: resp[k] for k in ("error", "traceback", "resolved_modules", "runtime_imports", "extra_modules",
                                     "hooks", "blocked_loaded", "refused", "queued_bytes")}
out["replace"]["diff_z"] = diff(first["saves"], "z", local["z"])
out["replace"]["diff_logits"] = diff(first["saves"], "logits", local["logits"])
out["replace"]["equal"] = bool(first["saves"]) and all(torch.equal(first["saves"][k], local[k]) for k in local)
out["error_term"]["diff_logits_vs_clean"] = diff(second["saves"], "logits_err", clean)
out["error_term"]["max_abs_logit"] = float(clean.float().abs().max())
out["strict"] = strict
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def replace_loopback() -> dict:
    """One client and one loopback server (each a fresh interpreter) for the replace flow and the strictness checks."""
    return run_client(REPLACE_CLIENT)


@pytest.fixture(scope="module")
def strict_loopback(replace_loopback: dict) -> dict:
    return replace_loopback["strict"]


def _non_whitelisted(modules: list[str]) -> set[str]:
    """The modules (full dotted names) NDIF's unpickling whitelist does not allow."""
    return {m for m in modules if not module_allowed(m, NDIF_DESERIALIZATION_MODULES)}


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
        assert resp["refused"] == [], resp["refused"]  # no NDIF rule broken (whitelists, setattr, size)
        bad = [i for i in resp["runtime_imports"] if not module_allowed(i[0], NDIF_RUNTIME_MODULES)]
        assert not bad, bad
    # the queue's envelope around the body stays within what MeasuredRemoteBackend reserves for it
    from nnsight_lorsa.remote import QUEUE_OVERHEAD_BYTES

    assert 0 < out["replace"]["queued_bytes"] - out["payload_bytes"] < QUEUE_OVERHEAD_BYTES, out["replace"]
    assert out["replace"]["equal"], (out["replace"]["diff_z"], out["replace"]["diff_logits"])
    # the stated bound (docs/nnsight.md): max |Δlogit| <= 1e-5 · max |logit| in fp32
    err = out["error_term"]
    assert err["diff_logits_vs_clean"] <= 1e-5 * err["max_abs_logit"], err
    assert out["attached_locally"] == []
    assert out["compressed"] and 0 < out["payload_bytes"] < 200_000


def test_request_resolves_only_ndif_whitelisted_modules(replace_loopback: dict) -> None:
    """NDIF unpickles requests under a module whitelist: our shipped objects resolve nothing outside it; and the
    client-side reading of the request's opcodes (``ndif_rules.pickled_modules``, what ``MeasuredRemoteBackend``
    checks before sending) finds exactly the modules the server's unpickler resolved."""
    for key in ("replace", "error_term"):
        resolved = replace_loopback[key]["resolved_modules"]
        assert _non_whitelisted(resolved) == set()
        assert replace_loopback["scanned"][key] == resolved


# ---------------------------------------------------------------- the loopback's strictness itself
def test_loopback_runs_a_plain_request(strict_loopback: dict) -> None:
    """The control for the refusals below: a plain nnsight request passes every rule."""
    plain = strict_loopback["plain"]
    assert plain["error"] is None and plain["refused"] == [] and plain["saved"] == ["logits"], plain


def test_loopback_refuses_an_import_outside_the_runtime_whitelist(strict_loopback: dict) -> None:
    resp = strict_loopback["runtime_import"]
    assert resp["error"] == "ImportError: Module pathlib is not whitelisted", resp
    assert [r[:2] for r in resp["refused"]] == [["run-time import whitelist", "pathlib"]] and resp["saved"] == []


def test_loopback_refuses_to_unpickle_a_module_outside_the_whitelist(strict_loopback: dict) -> None:
    resp = strict_loopback["unpickle"]
    assert resp["error"] == "ImportError: Module fractions is not whitelisted", resp
    assert [r[:2] for r in resp["refused"]] == [["unpickling whitelist", "fractions"]] and resp["saved"] == []
    assert strict_loopback["client_refused"] == ["fractions"]  # MeasuredRemoteBackend refused it before sending


def test_loopback_refuses_a_module_mounted_on_the_model(strict_loopback: dict) -> None:
    resp = strict_loopback["mount"]
    assert resp["error"] == "AttributeError: Attribute 'extra' cannot be set after initialization", resp
    assert resp["refused"][0][:2] == ["no setattr on the model's modules", "extra"] and resp["saved"] == []
    assert resp["extra_modules"] == []


def test_loopback_refuses_a_request_above_the_queue_limit(strict_loopback: dict) -> None:
    resp = strict_loopback["oversized"]
    assert resp["queued_bytes"] > 300_000 > strict_loopback["plain"]["queued_bytes"], resp
    assert resp["error"].startswith("RuntimeError: ERR Protocol error: invalid bulk length"), resp
    assert [r[0] for r in resp["refused"]] == ["request size limit"] and resp["saved"] == []
    assert resp["resolved_modules"] == []  # refused before it was unpickled


def test_ndif_rules_are_read_from_the_pinned_source() -> None:
    """The lists' entry semantics (NDIF's ``WhitelistedModule.check`` + ``is_module_allowed``), and the limit."""
    assert module_allowed("torch.nn.functional", NDIF_RUNTIME_MODULES)
    assert not module_allowed("torch.hub", NDIF_RUNTIME_MODULES)  # a blocked submodule
    assert module_allowed("nnsight", NDIF_RUNTIME_MODULES) and not module_allowed("nnsight.intervention",
                                                                                     NDIF_RUNTIME_MODULES)
    assert module_allowed("nnsight.intervention.source", NDIF_DESERIALIZATION_MODULES)
    assert not module_allowed("abc", NDIF_DESERIALIZATION_MODULES) and not module_allowed("_thread",
                                                                                           NDIF_DESERIALIZATION_MODULES)
    assert not module_allowed("operator.x", NDIF_RUNTIME_MODULES) and not module_allowed("torchvision",
                                                                                          NDIF_RUNTIME_MODULES)
    from nnsight_lorsa.remote import DEFAULT_CAP_BYTES, NDIF_QUEUE_LIMIT_BYTES, QUEUE_OVERHEAD_BYTES

    assert NDIF_QUEUE_LIMIT_BYTES == REDIS_PROTO_MAX_BULK_LEN == 536_870_912
    assert DEFAULT_CAP_BYTES + QUEUE_OVERHEAD_BYTES < NDIF_QUEUE_LIMIT_BYTES


def test_a_request_above_the_queue_limit_is_refused_before_sending() -> None:
    """A cap set above NDIF's queue limit does not let a request through that the queue would refuse."""
    import nnsight

    from nnsight_lorsa.remote import QUEUE_OVERHEAD_BYTES, NotWhitelistedError, QueueLimitError, remote_backend

    model, lorsas = _tiny_set()
    limit = QUEUE_OVERHEAD_BYTES + 50_000  # a queue that takes 50 KB of request: the Lorsa is 99.8 KB
    backend = remote_backend(model, dry_run=True, cap_bytes="1GB", queue_limit_bytes=limit)
    with pytest.raises(QueueLimitError, match="proto-max-bulk-len") as info, model.trace(random_ids(),
                                                                                          backend=backend):
        lorsas.replace(layer=1)
        nnsight.save(model.lm_head.output)
    assert info.value.limit_bytes == 50_000 < info.value.request_bytes and backend.blob is None
    assert "for_remote(replacement, layers=[...])" in str(info.value)
    roomy = remote_backend(model, dry_run=True, cap_bytes="1GB", queue_limit_bytes=None)
    # without register() the request names this package's modules, which NDIF does not have: refused before sending
    with pytest.raises(NotWhitelistedError, match=r"call nnsight_lorsa\.remote\.register\(\)") as refused, \
            model.trace(random_ids(), backend=roomy):
        lorsas.replace(layer=1)
        nnsight.save(model.lm_head.output)
    assert "nnsight_lorsa.modules.lorsa" in refused.value.modules and roomy.blob is None
    unchecked = remote_backend(model, dry_run=True, cap_bytes="1GB", queue_limit_bytes=None, check_rules=False)
    with model.trace(random_ids(), backend=unchecked):
        lorsas.replace(layer=1)
        nnsight.save(model.lm_head.output)
    assert unchecked.blob is not None and len(unchecked.blob) > 50_000


# ---------------------------------------------------------------- (c) the NDIF doc blocks, against the loopback

DOC_CLIENT = r'''
import json, linecache, sys
from loopback import DOC_SETUP, LoopbackServer, doc_blocks, loopback

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
    from helpers import make_lorsa

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
    from helpers import make_sae, make_transcoder

    from nnsight_lorsa import ReplacementModel
    from nnsight_lorsa.errors import LayerOutOfRangeError
    from nnsight_lorsa.remote import for_remote, payload_report

    model, lorsas = _tiny_set()
    saes = {"model.layers.2": make_sae(), "model.layers.1.mlp": make_sae(seed=1),
            "model.embed_tokens": make_sae(seed=2)}
    rm = ReplacementModel(model, lorsas=lorsas, transcoders={0: make_transcoder(), 1: make_transcoder(seed=1)},
                          saes=saes)
    sent = for_remote(rm, layers=[1], dtype=torch.bfloat16)
    # the SAEs inside layer 1's block and outside every layer travel; layer 2's does not (until 2026-11-29: all)
    assert sent.lorsas.layers == [1] and list(sent.transcoders) == [1]
    assert sorted(sent.saes) == ["model.embed_tokens", "model.layers.1.mlp"]
    for module in (sent.lorsas[1], sent.transcoders[1], *sent.saes.values()):
        assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    assert torch.equal(sent.transcoders[1].W_enc, rm.transcoders[1].W_enc.to(torch.bfloat16))
    names = {t.name for t in payload_report(sent).tensors}
    assert {"lorsas[1].W_V", "transcoders[1].W_enc", "saes['model.layers.1.mlp'].W_enc"} <= names
    assert not any("model.layers.2" in n for n in names)
    report = payload_report(rm, layers=[1])
    assert report.by_layer.keys() == {1, None}  # None: the embedding's SAE
    sae_bytes = sum(t.numel() * t.element_size() for t in saes["model.layers.1.mlp"].state_dict().values())
    assert report.by_layer[None] == sae_bytes  # the embedding's SAE: same shapes as layer 1's
    assert payload_report(rm).by_layer[2] == payload_report(rm.lorsas).by_layer[2] + sae_bytes
    assert sorted(for_remote(rm, layers=[2]).saes) == ["model.embed_tokens", "model.layers.2"]
    assert sorted(for_remote(rm).saes) == sorted(saes)  # no layers: every module
    sae_only = ReplacementModel(model, saes=saes)
    assert sorted(for_remote(sae_only, layers=2).saes) == ["model.embed_tokens", "model.layers.2"]
    with pytest.raises(LayerOutOfRangeError, match="no Lorsa, transcoder or SAE at layer 0"):
        for_remote(sae_only, layers=[0])


@pytest.mark.parametrize("kind", ["lorsas", "transcoders", "saes"])
def test_for_remote_refuses_a_cast_that_turns_a_weight_into_inf(kind) -> None:
    """Issue 21: ``for_remote(rm, dtype=torch.float16)`` (or the default, an fp16 model's dtype) cast an fp32 weight
    past 65504 to ``inf`` with no word, and the remote trace computed NaN. It is a PlacementError naming the module,
    the tensor, its largest value and the dtype; bf16 (fp32's range) casts it; a dtype a module cannot compute in is
    an ArgumentError."""
    from helpers import make_sae, make_transcoder

    from nnsight_lorsa import ReplacementModel
    from nnsight_lorsa.errors import ArgumentError, PlacementError
    from nnsight_lorsa.remote import for_remote

    model, lorsas = _tiny_set()
    rm = ReplacementModel(model, lorsas=lorsas, transcoders={1: make_transcoder()}, saes={"model.layers.1": make_sae()})
    key = {"lorsas": 1, "transcoders": 1, "saes": "model.layers.1"}[kind]
    module = getattr(rm, kind)[key]
    name = "b_D" if kind == "lorsas" else "b_dec"
    with torch.no_grad():
        getattr(module, name)[3] = 1e5
    with pytest.raises(PlacementError, match=rf"{kind}.*{name}.*1e\+05.*float16"):
        for_remote(rm, layers=[1], dtype=torch.float16)
    sent = for_remote(rm, layers=[1], dtype=torch.bfloat16)
    assert float(getattr(getattr(sent, kind)[key], name)[3]) == float(torch.tensor(1e5, dtype=torch.bfloat16))
    for bad in (torch.int8, torch.complex64, torch.bool):
        with pytest.raises(ArgumentError, match="dtype"):
            for_remote(rm, layers=[1], dtype=bad)


def test_check_payload_names_the_largest_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    from nnsight_lorsa import LorsaError
    from nnsight_lorsa.remote import CAP_ENV, PayloadTooLargeError, check_payload, default_cap_bytes, parse_bytes

    _, lorsas = _tiny_set()
    total = check_payload(lorsas).total_tensor_bytes  # default cap: 500 MB
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


@pytest.mark.parametrize("bad", [-5, 0, True, False, 1.5, "0", "0.0GB", "-5", None, b"1GB", [1]])
def test_a_cap_that_is_not_a_positive_byte_count_is_refused(bad, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap (``cap_bytes=`` or ``$NNSIGHT_LORSA_MAX_PAYLOAD``) is a positive byte count: -5, True and 0 were
    accepted (every payload then refused, or none), 1.5 raised a raw TypeError."""
    from nnsight_lorsa.errors import ArgumentError
    from nnsight_lorsa.remote import CAP_ENV, DEFAULT_CAP_BYTES, check_payload, default_cap_bytes, parse_bytes

    with pytest.raises(ArgumentError, match="byte count"):
        parse_bytes(bad)
    _, lorsas = _tiny_set()
    if bad is not None:  # None: the default cap
        with pytest.raises(ArgumentError, match="byte count"):
            check_payload(lorsas, cap_bytes=bad)
    if isinstance(bad, str):
        monkeypatch.setenv(CAP_ENV, bad)
        with pytest.raises(ArgumentError, match="byte count"):
            default_cap_bytes()
    assert DEFAULT_CAP_BYTES < 512 * 10**6  # under the Redis request limit of NDIF's queue


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
from loopback import build_model
from helpers import make_lorsa
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


def test_pickled_modules_reads_a_pickles_globals_without_unpickling_it() -> None:
    """``GLOBAL`` (protocol 2), ``STACK_GLOBAL`` (protocol 5) and memoized repeats; a refused module is named."""
    import collections
    import fractions
    import pickle

    from nnsight_lorsa.ndif_rules import NotWhitelistedError, check_request, pickled_modules

    for protocol in (2, 5):
        data = pickle.dumps([fractions.Fraction(1, 3), collections.OrderedDict(), fractions.Fraction(2, 3)],
                            protocol=protocol)
        assert {"fractions", "collections"} <= pickled_modules(data) <= {"fractions", "collections", "builtins",
                                                                          "copyreg", "__builtin__"}
    with pytest.raises(NotWhitelistedError, match="fractions") as info:
        check_request(pickle.dumps(fractions.Fraction(1, 3)))
    assert info.value.modules == ["fractions"] and "Nothing was sent" in str(info.value)
    assert check_request(pickle.dumps(collections.OrderedDict())) == {"collections"}


def test_the_attribute_calls_of_a_remote_block_are_read_before_sending() -> None:
    """``MeasuredRemoteBackend`` runs each ``attribute(rm, tracer=tracer, ...)`` call's checks on the client, reading
    the block without running it (``remote_handles.check_block_calls``): a bad option held by a name of the enclosing
    scope is refused, naming the call, and nothing is serialized; a value the block computes or rebinds is not read
    here (``.graph`` checks it), and the request goes."""
    from helpers import attribution_setup, rm

    from nnsight_lorsa.attribution import attribute
    from nnsight_lorsa.errors import ConfigMismatchError
    from nnsight_lorsa.remote import remote_backend

    model, _, lorsas, tcs = attribution_setup("llama")
    bundle, ids = rm(model, lorsas, tcs), random_ids(1, 6, seed=1)[0]
    size, kinds = 0, {"memory": "fastest"}

    def dry() -> Any:
        return remote_backend(model, dry_run=True, check_rules=False, queue_limit_bytes=None, cap_bytes="1GB")

    refused = dry()
    with pytest.raises(ConfigMismatchError, match=">= 1, got 0") as info, model.trace(ids, backend=refused) as t:
        bundle.replace()
        attribute(bundle, tracer=t, batch_size=size)
    assert "attribute(bundle, tracer=t, batch_size=size)" in str(info.value) and "nothing was sent" in str(info.value)
    assert refused.blob is None
    with pytest.raises(ConfigMismatchError, match="got 'fastest'"), model.trace(ids, backend=dry()) as t:
        bundle.replace()
        attribute(bundle, tracer=t, **kinds)
    sent = dry()
    with model.trace(ids, backend=sent) as t:  # computed or rebound in the block: left to .graph
        bundle.replace()
        size = 1 - 1
        attribute(bundle, tracer=t, batch_size=size, memory=str(kinds["memory"]))
    assert sent.blob is not None and len(sent.blob) > 0


def test_replace_leaves_the_models_modules_alone() -> None:
    """NDIF refuses ``setattr`` on the model's modules: the Lorsa is an envoy of the trace, never a child module,
    and its internals read as before."""
    import nnsight

    from nnsight_lorsa.envoy.nnsight_internals import hf_module

    model, lorsas = _tiny_set()
    attention = hf_module(model).model.layers[1].self_attn
    before = dict(attention._modules)
    children = []
    with model.trace(random_ids()):
        site = lorsas.replace(layer=1)
        children.append(sorted(attention._modules))
        children.append(site.path)
        z = nnsight.save(site.hook_z.output)
    assert children == [sorted(before), "model.model.layers.1.self_attn.lorsa"] and "lorsa" not in before
    assert attention._modules == before and z.shape[-1] == lorsas[1].cfg.n_ov_heads
    assert "lorsa" not in model.model.layers[1].self_attn.__dict__  # the site's envoy forgot it after the trace


# ---------------------------------------------------------------- (d) the intervened pass's graph, remotely
INTERVENED_CLIENT = r'''
import contextlib, json, pickle, warnings, torch, nnsight
from loopback import LoopbackServer, build_model, loopback, serve_env
from helpers import make_clt, make_lorsa, make_transcoder, make_transcoders, random_ids
from nnsight_lorsa import CLTSet, LorsaSet, ReplacementModel, TranscoderSet, get_adapter
from nnsight_lorsa.attribution import IntervenedAttribution, PruneConfig, attribute
from nnsight_lorsa.attribution.graph import TRANSCODER
from nnsight_lorsa.errors import (ArgumentError, ConfigMismatchError, ServerVersionError, ServerVersionWarning,
                                  ShapeError, TraceOrderError)
from nnsight_lorsa.patching import Feature, LorsaHead, ablate
from nnsight_lorsa.remote import NotWhitelistedError, register, remote_backend
from nnsight_lorsa import server_version

server = LoopbackServer()                        # fp32, NDIF's rules, its nnsight = this one
sent = []
_run = server.run
server.run = lambda blob, envelope: (envelope.get("__env__") or sent.append(envelope), _run(blob, envelope))[1]
loopback(server)                                 # remote=True -> the loopback; GET /env served over HTTP
register()
model, hf = build_model()
bundle = ReplacementModel(model, lorsas=LorsaSet(model, {1: make_lorsa(hf, get_adapter(model), layer=1)}),
                          transcoders=TranscoderSet(model, make_transcoders((0, 2), skip_layer=2)))
ids = random_ids(1, 8, seed=2)[0]
with model.trace(ids) as tracer_top:             # the Lorsa head most active at the last position: ablated below
    top = nnsight.save(bundle.replace()["lorsas"][1].hook_z.output[0, -1].abs().argmax())
head = int(top)

with model.trace(ids) as tracer:                 # the local intervened graph (the reference)
    bundle.replace()
    handle = attribute(bundle, tracer=tracer, batch_size=40)
    ablate(bundle(LorsaHead(1, head)), positions=-1)
    logits = nnsight.save(model.lm_head.output)
local = handle.graph
with model.trace(ids) as tracer_clean:
    clean = nnsight.save(model.lm_head.output)

with model.session(remote=True):                 # the one-context flow in a remote session
    with model.trace(ids) as rt:
        bundle.replace()
        remote_handle = attribute(bundle, tracer=rt, batch_size=40)
        ablate(bundle(LorsaHead(1, head)), positions=-1)
        remote_logits = nnsight.save(model.lm_head.output)
in_session = remote_handle.graph
with model.trace(ids, remote=True) as rt2:       # and in a remote trace
    bundle.replace()
    trace_handle = attribute(bundle, tracer=rt2, batch_size=40)
    ablate(bundle(LorsaHead(1, head)), positions=-1)
    trace_logits = nnsight.save(model.lm_head.output)
in_trace = trace_handle.graph
requests = len(sent)
with model.trace(ids) as tracer_again:           # locally again, the bundle now marked for remote requests
    bundle.replace()
    handle_again = attribute(bundle, tracer=tracer_again, batch_size=40)
    ablate(bundle(LorsaHead(1, head)), positions=-1)
local_again = handle_again.graph

# a bad option of attribute(rm, tracer=tracer) in a remote block: the call's own error, before anything is sent
bad_memory, unknown_name = "fastest", {"batch_sizes": 4}
before_bad, bad_calls = len(sent), {}


@contextlib.contextmanager
def bad_call(name):
    try:
        yield
        bad_calls[name] = None
    except (ArgumentError, ConfigMismatchError, TypeError) as e:
        bad_calls[name] = [type(e).__name__, str(e)]


with bad_call("batch_size"):
    with model.session(remote=True):
        with model.trace(ids) as rt5:
            bundle.replace()
            attribute(bundle, tracer=rt5, batch_size=0)
            nnsight.save(model.lm_head.output)
with bad_call("memory_name"):
    with model.trace(ids, remote=True) as rt5:
        bundle.replace()
        attribute(bundle, tracer=rt5, memory=bad_memory)   # a name of the enclosing scope
with bad_call("qk_heads"):
    with model.trace(ids, remote=True) as rt5:
        bundle.replace()
        attribute(bundle, tracer=rt5, qk_heads=2)
with bad_call("remote"):
    with model.trace(ids, remote=True) as rt5:
        bundle.replace()
        attribute(bundle, tracer=rt5, remote=True)
with bad_call("unknown"):
    with model.trace(ids, remote=True) as rt5:
        bundle.replace()
        attribute(bundle, tracer=rt5, batch_sizes=4)
with bad_call("prune"):
    with model.session(remote=True):
        with model.trace(ids) as rt5:
            bundle.replace()
            attribute(bundle, tracer=rt5, prune=PruneConfig(0.8, 0.98, keep_mass=-1.0))
with bad_call("mapping"):
    with model.trace(ids, remote=True) as rt5:
        bundle.replace()
        attribute(bundle, tracer=rt5, **unknown_name)
bad_sent = len(sent) - before_bad
with model.trace(ids, remote=True) as rt6:      # spelled so that it cannot be read before sending: at .graph
    bundle.replace()
    late = attribute(bundle, tracer=rt6, batch_size=int("0"))
late_sent = len(sent) - before_bad
try:
    late.graph
    late_problem = None
except ConfigMismatchError as e:
    late_problem = str(e)

with model.trace(random_ids(2, 8, seed=2), remote=True) as rt4:   # two prompts: the server's error, raised here
    bundle.replace()
    two = attribute(bundle, tracer=rt4)
try:
    two.graph
    batch_problem = None
except ShapeError as e:
    batch_problem = str(e)

refused = None                                   # a prompt's graph (the engine) in a remote block: refused, named
before_refused = len(sent)
try:
    with model.session(remote=True):
        with model.trace(ids) as rt3:
            bundle.replace()
            wrong = attribute(bundle, ids)
except NotWhitelistedError as e:
    refused = str(e)
refused_sent = len(sent) - before_refused
try:
    pickle.dumps(handle)                         # a local handle still refuses pickling
    local_pickle = None
except TraceOrderError as e:
    local_pickle = str(e)

def off_call_cases():
    """Transcoders read off the MLP's call (circuit-tracer hooks hook_resid_mid, ln2.hook_normalized) and a CLT: the
    graph of an edited pass, locally and recorded on the server."""
    last = int(ids.numel()) - 1

    def hooked(module, hook_in):
        module.cfg.extra["circuit_tracer"] = {"feature_input_hook": hook_in, "feature_output_hook": "mlp.hook_out"}
        return module

    def top_feature(graph):                          # the layer-0 feature most active at the last position
        n = graph.nodes
        here = ((n.kind == TRANSCODER) & (n.layer == 0) & (n.pos == last)).nonzero().flatten()
        top = int(here[n.activation[here].abs().argmax()])
        return int(n.index[top]), float(n.activation[top])

    def rel_(a, b):
        return float((a.detach().double() - b.detach().double()).abs().max() / b.detach().double().abs().max())

    def compare(graph, local, saved, local_logits):    # the remote graph against the local one
        ids_ = graph.logit_ids
        top = saved.detach()[0, -1].double()
        return {"adjacency": rel_(graph.densify(), local.densify()),
                "adjacency_equal": bool(torch.equal(graph.densify(), local.densify())),
                "same_nodes": all(torch.equal(getattr(graph.nodes, f), getattr(local.nodes, f))
                                  for f in ("kind", "layer", "pos", "index", "intervened")),
                "activation": rel_(graph.nodes.activation, local.nodes.activation),
                "marked": int(graph.nodes.intervened.sum()), "local_marked": int(local.nodes.intervened.sum()),
                "meta": graph.meta["intervened"], "local_meta": local.meta["intervened"],
                "logit_gap": rel_(graph.values[ids_], top[graph.nodes.index[ids_]] - top.mean()),
                "saved_vs_local": rel_(saved, local_logits), "saved_vs_clean": rel_(saved, clean_logits),
                "edge_sum": float(graph.edge_sum_error("mass").max())}

    with model.trace(ids):
        clean_logits = nnsight.save(model.lm_head.output)
    out, before_sent = {}, len(sent)
    for hook_in in ("hook_resid_mid", "ln2.hook_normalized"):      # per-layer transcoders read off the MLP's call
        bundle = ReplacementModel(model, transcoders=TranscoderSet(model, {
            0: hooked(make_transcoder(skip=False, seed=3), hook_in),
            2: hooked(make_transcoder(skip=True, seed=4), hook_in)}))
        feature, before = top_feature(attribute(bundle, ids, batch_size=40))
        with model.trace(ids) as tracer:             # the local intervened graph (the reference)
            bundle.replace()
            handle = attribute(bundle, tracer=tracer, batch_size=40)
            ablate(bundle(Feature(0, feature, kind="transcoder")), positions=last)
            logits = nnsight.save(model.lm_head.output)
        local = handle.graph
        with model.trace(ids, remote=True) as rt:    # the same pass, recorded on the server
            bundle.replace()
            remote_handle = attribute(bundle, tracer=rt, batch_size=40)
            ablate(bundle(Feature(0, feature, kind="transcoder")), positions=last)
            remote_logits = nnsight.save(model.lm_head.output)
        out[hook_in] = compare(remote_handle.graph, local, remote_logits, logits)
    clt = make_clt(n_layers=3, seed=1)
    clt.cfg.extra["circuit_tracer"] = {"feature_input_hook": "hook_resid_mid", "feature_output_hook": "mlp.hook_out"}
    bundle = ReplacementModel(model, transcoders=CLTSet(model, clt))
    feature, before = top_feature(attribute(bundle, ids, batch_size=40))
    with model.trace(ids) as tracer:                 # a CLT feature steered on the CLT's envoy, locally
        spliced = bundle.replace()
        handle = attribute(bundle, tracer=tracer, batch_size=40)
        spliced["transcoders"].hook_sae_acts_post[0].output[0, last, feature] += 2.0
        logits = nnsight.save(model.lm_head.output)
    local = handle.graph
    with model.trace(ids, remote=True) as rt:        # and remotely
        spliced = bundle.replace()
        remote_handle = attribute(bundle, tracer=rt, batch_size=40)
        spliced["transcoders"].hook_sae_acts_post[0].output[0, last, feature] += 2.0
        remote_logits = nnsight.save(model.lm_head.output)
    out["clt"] = compare(remote_handle.graph, local, remote_logits, logits)
    n = local.nodes
    steered = (n.kind == TRANSCODER) & (n.layer == 0) & (n.pos == last) & (n.index == feature)
    out["clt"]["steered"] = [float(a) for a in remote_handle.graph.nodes.activation[steered]]
    out["clt"]["before"] = before
    out["requests"] = len(sent) - before_sent
    return out


off_call = off_call_cases()

# the server's nnsight version: read once per host (GET /env), compared before sending
env_calls = []
_env = server.env
server.env = lambda: (env_calls.append(1), _env())[1]
server_version._VERSIONS.clear()
for _ in range(2):
    with model.trace(ids, remote=True):
        again = nnsight.save(model.lm_head.output)
def version_refusal(host):
    """The ServerVersionError a trace against ``host`` raises (as a dict; None if the trace ran)."""
    try:
        with model.trace(ids, backend=remote_backend(model, host=host)):
            nnsight.save(model.lm_head.output)
    except ServerVersionError as e:
        return {"message": str(e), "client": e.client_version, "server": e.server_version, "host": e.host}
    return None


old = LoopbackServer(nnsight_version="0.7.0")    # a server on NDIF's June-2026 nnsight
old_host = serve_env(old)
before = len(sent)
mismatch = version_refusal(old_host)
with model.trace(ids, backend=remote_backend(model, host=old_host, check_version=False)):
    unchecked = nnsight.save(model.lm_head.output)
other_python = LoopbackServer(python_version="3.99.0 (main) [a Python of another bytecode]")
before_python = len(sent)
python_mismatch = version_refusal(serve_env(other_python))
python_mismatch_sent = len(sent) - before_python
other_python.close()
silent_host = serve_env(old, path="/nothing")    # a server without GET /env: a warning, the request goes
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with model.trace(ids, backend=remote_backend(model, host=silent_host)):
        unreported = nnsight.save(model.lm_head.output)
old.close()
server.close()


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def logit_gap(graph, saved):
    ids_ = graph.logit_ids
    last = saved.detach()[0, -1].double()
    return rel(graph.values[ids_].double().detach(), last[graph.nodes.index[ids_]] - last.mean())


out = {"requests": requests, "batch_problem": batch_problem, "refused": refused, "local_pickle": local_pickle,
       "kind": type(remote_handle).__name__,
       "env_calls": len(env_calls), "mismatch": mismatch, "mismatch_sent": len(sent) - before,
       "python_mismatch": python_mismatch, "python_mismatch_sent": python_mismatch_sent,
       "unchecked_equal": bool(torch.equal(unchecked, clean)), "unreported_equal": bool(torch.equal(unreported, clean)),
       "warned": [str(w.message) for w in caught if issubclass(w.category, ServerVersionWarning)],
       "local_pass_adjacency": rel(local_again.densify(), local.densify()),
       "bad_calls": bad_calls, "bad_sent": bad_sent, "late_sent": late_sent, "late_problem": late_problem,
       "refused_sent": refused_sent}
for name, graph, saved in (("session", in_session, remote_logits), ("trace", in_trace, trace_logits)):
    out[name] = {
        "adjacency": rel(graph.densify(), local.densify()),
        "adjacency_equal": bool(torch.equal(graph.densify(), local.densify())),
        "same_nodes": all(torch.equal(getattr(graph.nodes, f), getattr(local.nodes, f))
                          for f in ("kind", "layer", "pos", "index", "intervened")),
        "marked": int(graph.nodes.intervened.sum()), "meta": graph.meta["intervened"],
        "logit_gap": logit_gap(graph, saved), "saved_vs_local": rel(saved, logits),
        "saved_vs_clean": rel(saved, clean),
        "edge_sum": float(graph.edge_sum_error("mass").max()),
    }
out["local_meta"] = local.meta["intervened"]
out["head"] = head
out["off_call"] = off_call
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def intervened_loopback() -> dict:
    return run_client(INTERVENED_CLIENT, timeout=480)


def test_the_intervened_pass_is_attributed_in_a_remote_session_and_trace(intervened_loopback: dict) -> None:
    """``attribute(rm, tracer=tracer)`` in ``model.session(remote=True)`` and ``model.trace(..., remote=True)``: the
    server (NDIF's rules, no nnsight_lorsa) records the ablated pass, the handle comes back and its graph, built here,
    is the local intervened graph (bit-equal adjacency), with the logits the same remote trace saved."""
    out = intervened_loopback
    assert out["requests"] == 2 and out["kind"] == "IntervenedAttribution"
    assert out["local_pass_adjacency"] == 0.0  # locally again, with the bundle marked by the remote requests
    for name in ("session", "trace"):
        got = out[name]
        assert got["adjacency_equal"], (name, got)  # the one spelling: the same graph, local or remote
        assert got["same_nodes"] and got["marked"] == 1, name
        assert got["meta"] == out["local_meta"] == [f"LorsaHead(layer=1, head={out['head']}) at positions -1"], name
        assert got["adjacency"] <= 1e-4, (name, got)
        assert got["logit_gap"] <= 1e-4, (name, got)  # the graph's logits are the remote trace's saved logits
        assert got["saved_vs_local"] <= 1e-5 < got["saved_vs_clean"], (name, got)  # the ablation changed them
        assert got["edge_sum"] < 1e-4, (name, got)


@pytest.mark.parametrize("case", ["hook_resid_mid", "ln2.hook_normalized", "clt"])
def test_the_intervened_pass_of_transcoders_read_off_the_mlp_call_is_the_local_one_remotely(
        intervened_loopback: dict, case: str) -> None:
    """``attribute(rm, tracer=tracer)`` in ``model.trace(..., remote=True)`` (the loopback: NDIF's rules, no
    nnsight_lorsa on the server) for transcoders whose circuit-tracer hooks read ``hook_resid_mid`` (the pre-MLP
    norm's input) or ``ln2.hook_normalized`` (``x / rms(x)``, before the norm's gain; GemmaScope's hook on an RMSNorm),
    a layer-0 feature ablated at the last position with :mod:`nnsight_lorsa.patching`, and for a CLT reading
    ``hook_resid_mid`` with a layer-0 feature steered by +2 on ``model.clt.hook_sae_acts_post[0]``: the graph built
    from the server's recording is the local intervened graph (same nodes, marks and activations, bit-equal
    adjacency), its logits are the remote trace's, which the edit moved; the steered CLT node holds its steered
    value, marked as a direct edit (unmarked until 2026-11-26; ``off_call_cases`` in the client)."""
    out = intervened_loopback["off_call"]
    assert out["requests"] == 3
    got = out[case]
    assert got["adjacency_equal"] and got["adjacency"] <= 1e-4, got
    assert got["same_nodes"] and got["activation"] == 0.0, got
    assert got["marked"] == got["local_marked"] == 1, got  # the CLT's envoy edit: marked as a direct edit
    assert got["meta"] == got["local_meta"], got
    assert got["logit_gap"] <= 1e-5 and got["saved_vs_local"] <= 1e-5 < got["saved_vs_clean"], got
    assert got["edge_sum"] < 1e-5, got
    if case == "clt":
        assert got["steered"] == [pytest.approx(got["before"] + 2.0, rel=1e-5)], got


def test_attribute_in_a_remote_block_and_a_local_handle_are_refused(intervened_loopback: dict) -> None:
    out = intervened_loopback
    # a prompt's graph (the engine, which does not travel) in a remote block: refused, naming the traced call
    assert out["refused"] and "attribute(rm, tracer=tracer)" in out["refused"] and "Nothing was sent" in out["refused"]
    assert out["refused_sent"] == 0
    assert out["local_pickle"] and "cannot be pickled or sent" in out["local_pickle"]
    # an error of the recording on the server (two prompts) comes back and is raised at .graph, as locally
    assert out["batch_problem"] and "attributes one prompt" in out["batch_problem"]


def test_a_bad_option_of_the_traced_call_in_a_remote_block_raises_before_sending(intervened_loopback: dict) -> None:
    """``attribute(rm, tracer=tracer, **options)`` in a remote block: its options are checked on the client before
    the request is sent, with the same named errors as at a local call (tests/attribution/test_intervened.py); an
    option the block spells so that it cannot be read without running it is checked when ``.graph`` is read."""
    out = intervened_loopback
    calls = out["bad_calls"]
    assert out["bad_sent"] == 0 and set(calls) == {"batch_size", "memory_name", "qk_heads", "remote", "unknown",
                                                    "prune", "mapping"}
    for name, got in calls.items():
        assert got is not None and "nothing was sent" in got[1], (name, got)
    assert calls["batch_size"][0] == "ConfigMismatchError" and "attribute(batch_size=...) must be >= 1" in calls[
        "batch_size"][1]
    assert calls["memory_name"][0] == "ConfigMismatchError" and "fastest" in calls["memory_name"][1]
    for name in ("qk_heads", "remote"):
        assert calls[name][0] == "ConfigMismatchError" and "no remote=, no qk_heads=" in calls[name][1], name
    for name in ("unknown", "mapping"):
        # ArgumentError: our TypeError (Python's own for an unknown keyword was the bare class before)
        assert calls[name][0] == "ArgumentError" and "unexpected keyword" in calls[name][1], name
        assert "batch_sizes" in calls[name][1], name
    assert calls["prune"][0] == "ConfigMismatchError" and "keep_mass" in calls["prune"][1]
    # batch_size=int("0") cannot be read before sending: the request goes, .graph raises the same error here
    assert out["late_sent"] == 1
    assert out["late_problem"] and "attribute(batch_size=...) must be >= 1" in out["late_problem"]


def test_the_servers_nnsight_version_is_checked_once_per_host_before_sending(intervened_loopback: dict) -> None:
    """The loopback serves NDIF's ``GET /env``: the same version passes (read once for its host), another is refused
    before anything is sent, naming both; ``check_version=False`` skips; a server without ``/env`` warns."""
    import nnsight

    out = intervened_loopback
    assert out["env_calls"] == 1
    mismatch = out["mismatch"]
    assert mismatch is not None and out["mismatch_sent"] == 0 + 2  # the refused one sent nothing; the next two did
    assert mismatch["server"] == "0.7.0" and mismatch["client"] == nnsight.__version__
    assert "nnsight 0.7.0" in mismatch["message"] and f"nnsight {nnsight.__version__}" in mismatch["message"]
    assert "pip install nnsight==0.7.0" in mismatch["message"] and mismatch["host"].startswith("http://127.0.0.1:")
    assert out["unchecked_equal"] and out["unreported_equal"]
    assert len(out["warned"]) == 1 and "does not report its nnsight version" in out["warned"][0]


def test_same_version_compares_releases() -> None:
    from nnsight_lorsa.server_version import same_version

    assert same_version("0.8.1", "0.8.1") and same_version("0.8.1+cu121", "0.8.1")
    assert not same_version("0.8.1", "0.7.0") and not same_version("0.8.1", "0.8.2")
    assert not same_version("0.8.1", "0.8.1.dev3")


@pytest.mark.parametrize("kind", ["lorsas", "transcoders", "saes"])
def test_for_remote_refuses_a_module_never_loaded(kind) -> None:
    """An NDIF client's model is on the ``meta`` device, so its sets keep a replacement that is on ``meta`` too (built,
    never loaded); ``for_remote`` sent it as a meta copy and the server got a module with no values. It is a
    PlacementError naming the module and the tensor; loaded replacements on a meta model still travel."""
    from helpers import make_lorsa, make_sae, make_transcoder

    from nnsight_lorsa import LorsaSet, ReplacementModel, get_adapter
    from nnsight_lorsa.errors import PlacementError
    from nnsight_lorsa.remote import for_remote

    model, hf = tiny_nnsight("llama", device="meta")
    real = tiny_nnsight("llama")[1]
    lorsas = LorsaSet(model, {L: make_lorsa(real, get_adapter(model), layer=L) for L in (1, 2)})
    rm = ReplacementModel(model, lorsas=lorsas, transcoders={1: make_transcoder()}, saes={"model.layers.1": make_sae()})
    key = {"lorsas": 1, "transcoders": 1, "saes": "model.layers.1"}[kind]
    sent = for_remote(rm, layers=[1], dtype=torch.bfloat16)
    assert all(p.device.type == "cpu" for p in getattr(sent, kind)[key].parameters())
    getattr(rm, kind)[key].to("meta")
    with pytest.raises(PlacementError, match=rf"{kind}\[{key!r}\]\.\w+ is on the meta device"):
        for_remote(rm, layers=[1], dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_for_remote_sends_host_copies_of_modules_on_a_gpu() -> None:
    """A client holding its replacements on ``cuda:N`` sent that device name in the pickle (the server may have no
    such device); the copies are on the host, equal to the cast weights, and the originals stay where they were."""
    from helpers import make_sae, make_transcoder

    from nnsight_lorsa import ReplacementModel
    from nnsight_lorsa.remote import for_remote

    model, lorsas = _tiny_set()
    rm = ReplacementModel(model, lorsas=lorsas, transcoders={1: make_transcoder()}, saes={"model.layers.2": make_sae()})
    for kind, key in (("lorsas", 1), ("transcoders", 1), ("saes", "model.layers.2")):
        getattr(rm, kind)[key].to("cuda")
    for dtype in (torch.bfloat16, torch.float32):
        sent = for_remote(rm, layers=[1], dtype=dtype)
        for kind, key in (("lorsas", 1), ("transcoders", 1), ("saes", "model.layers.2")):
            original, copy = getattr(rm, kind)[key], getattr(sent, kind)[key]
            for (name, t), (_, c) in zip(original.state_dict().items(), copy.state_dict().items(), strict=True):
                assert c.device.type == "cpu" and t.device.type == "cuda", (kind, name)
                assert torch.equal(c, t.to(device="cpu", dtype=dtype if t.is_floating_point() else t.dtype))


SHIP_ACTIVATION = """
import sys, torch
from nnsight.intervention.serialization import dumps, loads
from nnsight_lorsa.modules.activations import make_activation
from nnsight_lorsa.ndif_rules import check_request
from nnsight_lorsa.remote import register, unregister
name = sys.argv[1]
params = {"topk": {"k": 4}, "batchtopk": {"k": 4}, "abstopk": {"k": 4}, "groupmax": {"k": 4},
          "jumprelu": {"threshold": 0.1}}.get(name, {})
act = make_activation(name, 16, params)  # in training mode, as a fresh module (and for_remote keeps the mode)
x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
register(guard=False)  # nnsight's own serializer ships the package by value, as a request does
try:
    blob = dumps(act)
finally:
    unregister()
assert not any(m.split(".")[0] == "nnsight_lorsa" for m in check_request(blob))  # by value, whitelisted
copy = loads(blob)
for training in (True, False, True):
    assert torch.equal(copy.train(training)(x), act.train(training)(x)), training
print("shipped")
"""


@pytest.mark.parametrize("name", ["relu", "topk", "batchtopk", "jumprelu", "abstopk", "groupmax"])
def test_every_activation_kind_ships_to_ndif(name) -> None:
    """A sparse coder's activation travels to NDIF by value (``remote.register``, nnsight's serializer): the pickle
    names only modules NDIF's unpickling whitelist allows, and the copy computes what the original does, in training
    and eval mode. In a fresh process (this one's jaxtyping hook rewrites the package's functions). Seen failing: a
    BatchTopK in training mode read the data-parallel reducer from a module global, which nnsight's serializer does
    not ship (``NameError: name '_GLOBAL_BATCH' is not defined`` on the server); it is now a class attribute
    (``BatchTopK.global_batch``), its context manager in ``training.distributed``."""
    import os
    import subprocess
    import sys

    from helpers import ROOT

    from nnsight_lorsa.modules.activations import ACTIVATIONS

    assert name in ACTIVATIONS
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, "-c", SHIP_ACTIVATION, name], capture_output=True, text=True, env=env,
                         timeout=120, cwd=ROOT)
    assert run.returncode == 0 and "shipped" in run.stdout, run.stderr[-2000:]


# ---------------------------------------------------------------- (e) attribute(rm, prompt, remote=True): where it runs
PROMPT_REMOTE_CLIENT = r'''
import json, torch
from loopback import LoopbackServer, build_model, loopback
from helpers import make_lorsa, random_ids
from nnsight_lorsa import LorsaSet, ReplacementModel, attribute, get_adapter
from nnsight_lorsa.attribution import cache_for_attribution
from nnsight_lorsa.remote import register

server = LoopbackServer(seed=0)                  # holds build_model(seed=0): the true weights
loopback(server)
register()
ids = random_ids(1, 8, seed=3)[0]

def bundle(model, hf):
    return ReplacementModel(model, lorsas=LorsaSet(model, {1: make_lorsa(hf, get_adapter(model), layer=1)}))

true_model, true_hf = build_model(seed=0)
client_model, client_hf = build_model(seed=0)    # the client's copy, its layer-0 MLP perturbed: what runs HERE
with torch.no_grad():
    client_hf.model.layers[0].mlp.down_proj.weight.mul_(1.5)
sent = []
_run = server.run
server.run = lambda blob, envelope: (envelope.get("__env__") or sent.append(1), _run(blob, envelope))[1]
client = bundle(client_model, client_hf)         # one bundle: the same Lorsa in every call below
remote = attribute(client, ids, batch_size=16, remote=True)
# the clean pass on the server's weights, the graph built here with the client's bundle
true_lorsas = LorsaSet(true_model, {1: client.lorsas[1]})
expected = attribute(client, cache_for_attribution(ReplacementModel(true_model, lorsas=true_lorsas), ids),
                     batch_size=16)
everything_here = attribute(client, ids, batch_size=16)
d = lambda a, b: float((a.densify() - b.densify()).abs().max())
print(json.dumps({"requests": len(sent), "vs_expected": d(remote, expected),
                  "vs_everything_here": d(remote, everything_here), "engine": remote.meta["engine"],
                  "scale": float(expected.densify().abs().max())}))
server.close()
'''


def test_attribute_remote_runs_the_clean_pass_on_the_server_and_builds_the_graph_here() -> None:
    """``attribute(rm, prompt, remote=True)``: one request, the clean pass on the server's weights (a client copy with
    its layer-0 MLP scaled gives another graph run all here), the graph built here from that pass's cache — equal,
    bit for bit, to ``attribute(rm, cache_for_attribution(<the server's model>, prompt))``. (Until 2026-11-29 the
    frozen pass ran as a second, local trace of the client's model: the docs said both ran on the server.)"""
    out = run_client(PROMPT_REMOTE_CLIENT, timeout=300)
    assert out["requests"] == 1 and out["engine"] == "cache", out
    assert out["vs_expected"] == 0.0, out
    assert out["vs_everything_here"] > 1e-3 * out["scale"], out


def test_attribute_remote_on_a_meta_model_is_refused_before_sending(monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph of a remote prompt is built here: a meta-device client model (the docs' set-up block) is refused by
    name (``PlacementError`` naming a weight), and no request is sent."""
    from helpers import make_lorsa
    from loopback import build_model

    from nnsight_lorsa import LorsaSet, ReplacementModel, attribute, get_adapter
    from nnsight_lorsa.envoy.nnsight_internals import RemoteBackend
    from nnsight_lorsa.errors import PlacementError

    model, hf = build_model(seed=0)
    lorsa = make_lorsa(hf, get_adapter(model), layer=1)
    hf.to("meta")
    sent: list = []
    monkeypatch.setattr(RemoteBackend, "request", lambda self, *a, **k: sent.append(1))
    with pytest.raises(PlacementError, match="meta"):
        attribute(ReplacementModel(model, lorsas=LorsaSet(model, {1: lorsa})), random_ids(1, 6)[0], remote=True)
    assert sent == []


def test_a_server_on_another_python_is_refused_before_sending(intervened_loopback: dict) -> None:
    """``GET /env``'s ``python_version`` another ``major.minor`` than the client's: the bytecode a request carries
    (dataclass-generated methods) would not run there (3.11 → 3.12 segfaulted the unpickling process in a probe):
    ``ServerVersionError`` naming both Pythons, nothing sent."""
    import sys

    got = intervened_loopback["python_mismatch"]
    assert got is not None and intervened_loopback["python_mismatch_sent"] == 0
    here = "{}.{}".format(*sys.version_info[:2])
    assert got["server"] == "Python 3.99" and got["client"] == f"Python {here}"
    assert "runs Python 3.99" in got["message"] and "bytecode" in got["message"]
