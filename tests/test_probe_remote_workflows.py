"""Remote execution probe (2026-11-27): the workflows docs/remote.md runs remotely give through the loopback (a
server process that cannot import nnsight_lorsa and applies NDIF's rules, ``tests/loopback.py``) the same numbers
as the local run, bit for bit (fp32, CPU on both sides), on drawn prompts, batches, layers, heads, edits and
positions: ``replace`` with and without the error term, the patching interventions (``ablate`` / ``scale`` /
``steer`` on a Lorsa head at drawn positions), reading the model's internals before and after the splice, a
session of traces (one request), ``generate`` with an edit, and ``attribute(rm, prompt, remote=True)`` (the
adjacency, against the graph of a local clean pass's cache: the remote one is built from its cache). Every request
goes through ``register()``'s ``MeasuredRemoteBackend`` (size caps, the opcode check of ``ndif_rules``) and the
loopback asserts that no rule was broken and nothing stayed attached.

One client (and one server) per drawn list of cases: the default run draws one list; the sweep (``slow``) more.
"""

from __future__ import annotations

import json

import pytest
from helpers import FAMILIES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loopback import run_client

CLIENT = r'''
import json, torch, nnsight
from loopback import LoopbackServer, build_model, loopback
from helpers import make_lorsa, random_ids
from nnsight_lorsa import LorsaSet, ReplacementModel, attribute, get_adapter
from nnsight_lorsa.attribution import cache_for_attribution
from nnsight_lorsa.patching import LorsaHead, ablate, read, scale, steer
from nnsight_lorsa.remote import for_remote, register

CASES = json.loads(CASES_JSON)
POSITIONS = {"all": None, "last": -1, "first": 0, "ends": [0, -1], "tail": slice(1, None)}
server = LoopbackServer(family=FAMILY)
loopback(server)                    # remote=True goes to the loopback, through register()'s MeasuredRemoteBackend
model, hf = build_model(family=FAMILY)
adapter = get_adapter(model)
lorsas = LorsaSet(model, {L: make_lorsa(hf, adapter, layer=L, seed=L) for L in (1, 2)})
register()
paths = {"attn0": adapter.attention_path(0), "layer": {L: adapter.layer_path(L) for L in (1, 2)},
         "mlp": {L: adapter.mlp_path(L) for L in (1, 2)}}   # the family's module paths
bundles = {e: for_remote(ReplacementModel(model, lorsas=lorsas, error=e)) for e in (False, True)}


def edit(target, kind, alpha, pos):
    """Apply the drawn edit (``ablate`` / ``scale`` / ``steer``, or none) to ``target`` in a trace."""
    if kind == "ablate":
        ablate(target, positions=pos)
    elif kind == "scale":
        scale(target, alpha, positions=pos)
    elif kind == "steer":
        steer(target, alpha, positions=pos)


def edited_head(target, kind, alpha, pos):
    """:func:`edit`, then the target's read value."""
    edit(target, kind, alpha, pos)
    return read(target)


def one(r, ids, layer, head, kind, alpha, pos, remote):
    with model.trace(ids, remote=remote):
        r.prepare([LorsaHead(layer, head)])
        before = nnsight.save(model.get(paths["attn0"]).output[0])             # an internal before the splice
        x = nnsight.save(model.get(paths["layer"][layer]).input)               # the spliced layer's input
        z = edited_head(r(LorsaHead(layer, head)), kind, alpha, pos)
        after = nnsight.save(model.get(paths["mlp"][layer]).output)            # an internal after it
        logits = nnsight.save(model.lm_head.output)
    return {"before": before, "x": x, "z": z, "after": after, "logits": logits}


def two(r, ids, layer, head, kind, alpha, pos, remote):   # a session: two traces, one request
    with model.session(remote=remote):
        with model.trace(ids):
            clean = nnsight.save(model.lm_head.output)
        with model.trace(ids):
            r.prepare([LorsaHead(layer, head)])
            z = edited_head(r(LorsaHead(layer, head)), kind, alpha, pos)
            edited = nnsight.save(model.lm_head.output)
    return {"clean": clean, "z": z, "edited": edited}


def gen(r, ids, layer, head, kind, alpha, pos, remote, steps=2):   # the body's edit as nnsight's generate applies it
    with model.generate(ids, max_new_tokens=steps, do_sample=False, remote=remote) as tracer:
        r.prepare([LorsaHead(layer, head)])
        edit(r(LorsaHead(layer, head)), kind, alpha, pos)
        tokens = nnsight.save(tracer.result)
    return {"tokens": tokens}


def graph(r, ids, remote):   # attribute(rm, prompt, remote=True): the clean pass on the server, the graph built here
    if not remote:           # the same, from a clean pass run here (the traced engine agrees to rounding only)
        return {"adjacency": attribute(r, cache_for_attribution(r, ids)).densify()}
    return {"adjacency": attribute(r, ids, remote=remote).densify()}


out = []
for c in CASES:
    ids = random_ids(c["batch"], c["seq"], c["seed"])
    r = bundles[c["error"]]
    head = int(c["head"] * r.lorsas[c["layer"]].cfg.n_ov_heads)
    run = {"trace": one, "session": two, "generate": gen}[c["flow"]]
    args = (r, ids, c["layer"], head, c["kind"], c["alpha"], POSITIONS[c["pos"]])
    local, remote = run(*args, remote=False), run(*args, remote=True)
    out.append({k: {"equal": torch.equal(local[k], remote[k]), "same_dtype": local[k].dtype == remote[k].dtype,
                    "device": str(remote[k].device), "shape": list(remote[k].shape),
                    "max_abs": float((local[k].float() - remote[k].float()).abs().max())} for k in local})
ids = random_ids(1, CASES[0]["seq"], CASES[0]["seed"])
a, b = graph(bundles[False], ids, False)["adjacency"], graph(bundles[False], ids, True)["adjacency"]
out.append({"adjacency": {"equal": torch.equal(a, b), "same_dtype": a.dtype == b.dtype, "device": str(b.device),
                          "shape": list(b.shape), "max_abs": float((a - b).abs().max())}})
server.close()
print(json.dumps(out))
'''

_case = st.fixed_dictionaries({
    "batch": st.integers(1, 3), "seq": st.integers(3, 10), "seed": st.integers(0, 2**16),
    "layer": st.sampled_from([1, 2]),
    "head": st.floats(0, 1, exclude_max=True), "kind": st.sampled_from(["none", "ablate", "scale", "steer"]),
    "alpha": st.floats(-3, 3, allow_nan=False).map(lambda a: round(a, 3)), "error": st.booleans(),
    "flow": st.sampled_from(["trace", "session", "generate"]),
    "pos": st.sampled_from(["all", "last", "first", "ends", "tail"]),
})


def _check(cases: list[dict], family: str = "llama") -> None:
    out = run_client(CLIENT.replace("CASES_JSON", repr(json.dumps(cases))).replace("FAMILY", repr(family)),
                     timeout=400)
    assert len(out) == len(cases) + 1  # the cases, then the attribution graph of the first case's first prompt
    for case, result in zip([*cases, "attribute"], out, strict=True):
        for name, r in result.items():
            assert r["equal"] and r["same_dtype"] and r["device"] == "cpu", (case, name, r)


@settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(family=st.sampled_from(FAMILIES), cases=st.lists(_case, min_size=4, max_size=4))
def test_remote_workflows_equal_the_local_run(family: str, cases: list[dict]) -> None:
    """A drawn family (Llama, Qwen2/3, GPT-NeoX, GPT-2, Gemma 1/2/3, OLMo-2, Phi-3) and four drawn cases."""
    _check(cases, family)


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(cases=st.lists(_case, min_size=8, max_size=8))
def test_remote_workflows_equal_the_local_run_sweep(cases: list[dict]) -> None:
    _check(cases)


_OTHER_FAMILIES = [f for f in FAMILIES if f != "llama"]


@pytest.mark.slow
@pytest.mark.parametrize("family", _OTHER_FAMILIES)
@settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(cases=st.lists(_case, min_size=6, max_size=6))
def test_remote_workflows_of_every_family_equal_the_local_run_sweep(family: str, cases: list[dict]) -> None:
    _check(cases, family)
