"""Probe: our replacements under nnsight 0.8's own tracing features, against plain PyTorch.

docs/reliability.md, "nnsight features probe (2026-11-28)"; docs/nnsight.md, "nnsight's own features with
replacements". A Lorsa, a skip transcoder and an SAE (``error`` on and off, with and without a drawn edit of one
latent) under ``model.edit()`` (a copy and ``inplace=True``, replayed on traces, ``trace=False`` calls and
``generate``), ``tracer.cache()``, ``model.scan``, ``tracer.stop()`` and exceptions, ``tracer.barrier``,
``model.session``, empty invokes and ``.skip()``: every logit and read value is compared with the same replacement
spliced by hand in plain Hugging Face forward hooks (fp32, relative to max |value|), and after every kind of exit the
next plain trace must give the unmodified model's logits bit for bit with no hook or module left behind. Found and
fixed here: ``.skip()`` of a spliced Lorsa raised a bare ``KeyError('kv')``; a ``tracer.stop()`` before a replaced
site made nnsight warn about a ``tracer.iter`` loop nobody wrote; a replacement's envoy kept from an ended trace
(a ``model.session``'s next trace) failed with nnsight's misleading ``OutOfOrderError``, now ``TraceOrderError``.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from types import SimpleNamespace

import nnsight
import pytest
import torch
from helpers import (
    generated,
    make_lorsa,
    make_sae,
    make_transcoder,
    module_state,
    random_ids,
    relative,
    tiny_nnsight,
    unembed,
)
from hypothesis import strategies as st

from nnsight_lorsa import LorsaSet, ReplacementModel, SAESet, TranscoderSet, get_adapter
from nnsight_lorsa.attribution import attribute
from nnsight_lorsa.errors import ArgumentError, LorsaError, TraceOrderError

REL = 1e-5  # fp32: max |trace − hooks| <= REL · max |hooks|
LORSA_LAYER, TC_LAYER, SAE_LAYER = 1, 2, 0
KINDS = ("lorsa", "transcoder", "sae")
#: the latent hook each kind's drawn edit sets
LATENT = {"lorsa": "hook_z", "transcoder": "hook_sae_acts_post", "sae": "hook_sae_acts_post"}


@functools.cache
def world(family: str = "llama") -> SimpleNamespace:
    """A tiny model with a Lorsa on layer 1, a skip transcoder on layer 2's MLP and an SAE on layer 0's output."""
    model, hf = tiny_nnsight(family)
    adapter = get_adapter(model)
    lorsa, tc, sae = make_lorsa(hf, adapter, LORSA_LAYER), make_transcoder(skip=True, seed=3), make_sae(seed=5)
    sae_site = adapter.layer_path(SAE_LAYER)
    return SimpleNamespace(
        model=model, hf=hf, adapter=adapter, modules={"lorsa": lorsa, "transcoder": tc, "sae": sae},
        sets={"lorsa": LorsaSet(model, {LORSA_LAYER: lorsa}), "transcoder": TranscoderSet(model, {TC_LAYER: tc}),
              "sae": SAESet(model, {sae_site: sae})},
        keys={"lorsa": LORSA_LAYER, "transcoder": TC_LAYER, "sae": sae_site},
        paths={"lorsa": adapter.attention_path(LORSA_LAYER), "transcoder": adapter.mlp_path(TC_LAYER),
               "sae": sae_site},
        widths={"lorsa": lorsa.cfg.n_ov_heads, "transcoder": tc.cfg.d_sae, "sae": sae.cfg.d_sae})


def replace(w: SimpleNamespace, kind: str, error: bool):
    return w.sets[kind].replace(w.keys[kind], error=error)


def first(value):
    return value[0] if isinstance(value, tuple) else value


def set_unit(t: torch.Tensor, edit: tuple[int, float] | None) -> torch.Tensor:
    """``t`` with latent ``unit`` set to ``value`` at every position, on a copy (None: ``t``)."""
    if edit is None:
        return t
    t = t.clone()
    t[..., edit[0]] = edit[1]
    return t


@torch.no_grad()
def reference(w: SimpleNamespace, ids: torch.Tensor, kind: str, error: bool, edit: tuple[int, float] | None = None,
              capture: dict | None = None) -> torch.Tensor:
    """The plain HF model's logits with ``kind``'s replacement spliced by a forward hook and its latent ``edit``
    applied: the site returns the edited replacement's output, or with ``error`` ``true + (edited − clean)``.
    ``capture`` receives the site's returned output (``"site"``), the edited latent (``"latent"``) and the model's
    returned logits (``"final"``: after Gemma-2's soft-capping, which runs after the unembedding)."""
    a, m = w.adapter, w.modules[kind]
    cap = {} if capture is None else capture

    def hook(module, args, kwargs, output):
        if kind == "lorsa":
            x = a.attention_input(args, kwargs)
            z = m.activation(m.compute_z_pre(x, a.attention_positions(args, kwargs, x),
                                             a.attention_mask(args, kwargs)))[0]
            clean, latent = m.decode(z), set_unit(z, edit)
            out = m.decode(latent)
            true, put = a.attention_output(output), a.with_attention_output
        else:
            x = a.mlp_input(args, kwargs) if kind == "transcoder" else first(output)
            acts = m.encode(x)
            latent = set_unit(acts, edit)
            skip = m.skip(x)
            clean = m.decode(acts) + (0 if skip is None else skip)
            out = m.decode(latent) + (0 if skip is None else skip)
            true = first(output)

            def put(o, new):
                return (new, *o[1:]) if isinstance(o, tuple) else new
        site = true + (out - clean) if error else out
        cap["site"], cap["latent"] = site, latent
        return put(output, site)

    handle = w.hf.get_submodule(w.paths[kind]).register_forward_hook(hook, with_kwargs=True)
    try:
        seen = []
        head = w.hf.get_output_embeddings().register_forward_hook(lambda mod, args, out: seen.append(out))
        try:
            cap["final"] = w.hf(ids).logits
        finally:
            head.remove()
    finally:
        handle.remove()
    return seen[0]


@torch.no_grad()
def plain_logits(w: SimpleNamespace, ids: torch.Tensor) -> torch.Tensor:
    seen = []
    head = w.hf.get_output_embeddings().register_forward_hook(lambda mod, args, out: seen.append(out))
    try:
        w.hf(ids)
    finally:
        head.remove()
    return seen[0]


def assert_unmodified(w: SimpleNamespace, ids: torch.Tensor, state) -> None:
    """The next plain trace gives the unmodified model's logits bit for bit; no hook or module is left behind."""
    with torch.no_grad(), w.model.trace(ids):
        logits = nnsight.save(unembed(w.model).output)
    assert torch.equal(logits, plain_logits(w, ids))
    assert module_state(w.hf) == state


def edit_of(w: SimpleNamespace, kind: str, unit: int, value: float, edited: bool) -> tuple[int, float] | None:
    return (unit % w.widths[kind], value) if edited else None


#: the families the drawn tests run on (rotary and not, sliding windows, parallel residual)
FAMILIES = ("llama", "gpt2", "gemma2", "neox")
DRAWS = dict(family=st.sampled_from(FAMILIES), kind=st.sampled_from(KINDS), error=st.booleans(), edited=st.booleans(),
             unit=st.integers(0, 10_000), value=st.floats(-3.0, 3.0, allow_nan=False, width=32),
             seed=st.integers(0, 10_000), length=st.integers(2, 9))


# ------------------------------------------------------------------ model.edit()
@generated(4, 200, inplace=st.booleans(), **DRAWS)
def test_persistent_edit_matches_hooks(inplace, family, kind, error, edited, unit, value, seed, length):
    """A replacement (and a latent edit) stored with ``model.edit()`` is replayed on every trace of the edited model,
    on a ``trace=False`` call and on a trace body that calls ``replace`` again (same splice: its latent is served);
    the unedited model (``inplace=False``), or the model after ``clear_edits`` (``inplace=True``), is untouched."""
    w = world(family)
    model, state = w.model, module_state(w.hf)
    ids = random_ids(1, length, seed=seed)
    edit = edit_of(w, kind, unit, value, edited)
    cap: dict = {}
    ref = reference(w, ids, kind, error, edit, cap)

    if inplace:
        with model.edit(inplace=True):
            site = replace(w, kind, error)
            if edit is not None:
                getattr(site, LATENT[kind]).output[..., edit[0]] = edit[1]
        target = model
    else:
        with model.edit() as (_, target):
            site = replace(w, kind, error)
            if edit is not None:
                getattr(site, LATENT[kind]).output[..., edit[0]] = edit[1]
    try:
        if not inplace:
            assert_unmodified(w, ids, state)  # the original envoy is clean
        with torch.no_grad():
            for _ in range(2):  # replayed on every trace
                with target.trace(ids):
                    logits = nnsight.save(unembed(target).output)
                assert relative(logits, ref) <= REL
            with target.trace(ids):
                site = replace(w, kind, error)  # the edit's splice: the same envoy
                latent = nnsight.save(getattr(site, LATENT[kind]).output.clone())
                logits = nnsight.save(unembed(target).output)
            assert relative(latent, cap["latent"]) <= REL and relative(logits, ref) <= REL
            direct = target.trace(ids, trace=False)  # one-shot call: the stored edits apply
            assert relative(direct.logits, cap["final"]) <= REL
    finally:
        target.clear_edits()
    assert_unmodified(w, ids, state)


def test_persistent_edit_follows_generate():
    """A Lorsa stored by ``model.edit()`` replaces every generated token: the same tokens as ``replace`` in the
    generate body, and as a loop of plain hooked forwards."""
    w = world()
    ids = random_ids(1, 6, seed=3)
    gen = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=1)
    with w.model.edit() as (_, edited):
        replace(w, "lorsa", False)
    with torch.no_grad(), edited.generate(ids, **gen) as tracer:
        out = nnsight.save(tracer.result)
    seq = ids
    for _ in range(3):
        seq = torch.cat([seq, reference(w, seq, "lorsa", False)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)
    assert_unmodified(w, ids, module_state(w.hf))


# ------------------------------------------------------------------ tracer.cache()
@generated(4, 200, declared_first=st.booleans(), **DRAWS)
def test_cache_records_the_replaced_output(declared_first, family, kind, error, edited, unit, value, seed, length):
    """``tracer.cache()`` records values after every intervention: the replaced site's output (the replacement's, or
    with ``error=True`` the model's own moved by the edit), and a latent hook named by path (the edited latent).
    ``modules=None`` does not list a replacement's hooks (they are not the model's modules): name them."""
    w = world(family)
    ids = random_ids(1, length, seed=seed)
    edit = edit_of(w, kind, unit, value, edited)
    cap: dict = {}
    ref = reference(w, ids, kind, error, edit, cap)
    site_path = f"model.{w.paths[kind]}"
    name = {"lorsa": "lorsa", "transcoder": "transcoder", "sae": "sae"}[kind]
    latent_path = f"{site_path}.{name}.{LATENT[kind]}"
    with torch.no_grad(), w.model.trace(ids) as tracer:
        if declared_first:
            cache = tracer.cache(modules=[site_path, latent_path])
        site = replace(w, kind, error)
        if not declared_first:
            cache = tracer.cache(modules=[site_path, latent_path])
        if edit is not None:
            getattr(site, LATENT[kind]).output[..., edit[0]] = edit[1]
        logits = nnsight.save(unembed(w.model).output)
    assert relative(logits, ref) <= REL
    assert relative(first(cache[site_path].output), cap["site"]) <= REL
    assert relative(cache[latent_path].output, cap["latent"]) <= REL
    # one visit each: the clean pass an edit with error=True runs apart is stood down, unseen by the cache
    assert len(cache[site_path]) == 1 and len(cache[latent_path]) == 1


def test_cache_names_check():
    """The hook paths the cache tests use are where the envoys live."""
    w = world()
    with torch.no_grad(), w.model.trace(random_ids(1, 4)):
        paths = nnsight.save([replace(w, kind, False).path for kind in KINDS])
    assert paths == [f"model.{w.paths['lorsa']}.lorsa", f"model.{w.paths['transcoder']}.transcoder",
                     f"model.{w.paths['sae']}.sae"]


# ------------------------------------------------------------------ exits
EXITS = ("stop_before", "stop_after", "raise_in_body", "bad_edit", "out_of_order")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", EXITS)
def test_every_exit_leaves_the_model_unmodified(kind, how):
    """``tracer.stop()`` before the site and after its latent (the value read before it is the hooks'), an exception
    raised in the body, a bad edit that fails in the model, an out-of-order read: the next plain trace is the
    unmodified model's, bit for bit. A stop before the site warns nothing (nnsight warned about a ``tracer.iter`` loop
    that outran the run: the splice's wait on the site it never reached)."""
    w = world()
    ids = random_ids(1, 7, seed=11)
    state = module_state(w.hf)
    cap: dict = {}
    reference(w, ids, kind, False, None, cap)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            with torch.no_grad(), w.model.trace(ids) as tracer:
                site = replace(w, kind, False)
                if how == "stop_before":
                    nnsight.save(w.model.model.embed_tokens.output)  # before every site
                    tracer.stop()
                elif how == "stop_after":
                    latent = nnsight.save(getattr(site, LATENT[kind]).output)
                    tracer.stop()
                elif how == "raise_in_body":
                    nnsight.save(getattr(site, LATENT[kind]).output)
                    raise KeyError("raised in the body")
                elif how == "bad_edit":
                    getattr(site, LATENT[kind]).output[..., 10**6] = 0
                else:
                    nnsight.save(unembed(w.model).output)
                    nnsight.save(getattr(site, LATENT[kind]).output)
        except Exception as e:  # noqa: BLE001 - the kinds of exit
            assert how in ("raise_in_body", "bad_edit", "out_of_order"), repr(e)
        else:
            assert how in ("stop_before", "stop_after")
    if how == "stop_after":
        assert relative(latent, cap["latent"]) <= REL
    if how == "stop_before":
        assert not [s for s in seen if "never reached" in str(s.message)], [str(s.message) for s in seen]
    assert_unmodified(w, ids, state)



@pytest.mark.parametrize("how", ["stop", "raise"])
def test_a_generate_ended_mid_loop_leaves_the_model_unmodified(how):
    """A ``generate`` with a Lorsa (error term, a head ablated at every step) stopped or raising at step 1 of its
    ``tracer.iter`` loop: the next plain ``generate`` gives the plain tokens and the next trace the plain logits."""
    w = world()
    ids = random_ids(1, 5, seed=13)
    gen = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=1)
    state = module_state(w.hf)
    with torch.no_grad(), w.model.generate(ids, **gen) as tracer:
        plain = nnsight.save(tracer.result)
    with pytest.raises(KeyError) if how == "raise" else contextlib.nullcontext():  # noqa: SIM117  (as above)
        with torch.no_grad(), w.model.generate(ids, **gen) as tracer:
            site = replace(w, "lorsa", True)
            for step in tracer.iter[:4]:
                site.hook_z.output[..., 3] = 0
                if step == 1:
                    if how == "stop":
                        tracer.stop()
                    raise KeyError("raised at step 1")
    with torch.no_grad(), w.model.generate(ids, **gen) as tracer:
        again = nnsight.save(tracer.result)
    assert torch.equal(again, plain)
    assert_unmodified(w, ids, state)

# ------------------------------------------------------------------ .skip()
@pytest.mark.parametrize("error", [False, True])
def test_skip_of_a_lorsa_is_its_output_replaced(error):
    """``site.skip(v)`` on a spliced Lorsa: the site returns ``v`` (with ``error=True``: ``MHSA + v − Lorsa``) — as
    if its output were assigned. Before: a bare ``KeyError('kv')`` from the splice's step."""
    w = world()
    ids = random_ids(1, 6, seed=2)
    v = torch.randn(1, 6, w.adapter.d_model, generator=torch.Generator().manual_seed(0))
    cap: dict = {}
    reference(w, ids, "lorsa", False, None, cap)
    with torch.no_grad(), w.model.trace(ids):
        site = replace(w, "lorsa", error)
        site.skip(v)
        logits = nnsight.save(unembed(w.model).output)
    with torch.no_grad(), w.model.trace(ids):
        out = w.model.get(w.paths["lorsa"]).output[0]
        out[:] = v if not error else out + (v - cap["site"])
        expected = nnsight.save(unembed(w.model).output)
    assert relative(logits, expected) <= REL
    assert_unmodified(w, ids, module_state(w.hf))


@pytest.mark.parametrize("kind", ["lorsa", "transcoder"])
@pytest.mark.parametrize("error", [False, True])
def test_skip_of_the_replaced_module(kind, error):
    """``.skip(v)`` of the replaced attention / MLP module itself: the site's output is ``v``, which the replacement
    (computing from the site's inputs) replaces by its own output (``error=False``: the hooks' logits) or leaves as it
    is without edits (``error=True``: the logits of the skip alone)."""
    w = world()
    ids = random_ids(1, 6, seed=5)
    v = torch.randn(1, 6, w.adapter.d_model, generator=torch.Generator().manual_seed(1))
    module = w.model.get(w.paths[kind])
    value = (v, None) if kind == "lorsa" else v
    with torch.no_grad(), w.model.trace(ids):
        replace(w, kind, error)
        module.skip(value)
        logits = nnsight.save(unembed(w.model).output)
    if error:
        with torch.no_grad(), w.model.trace(ids):
            module.skip(value)
            expected = nnsight.save(unembed(w.model).output)
    else:
        expected = reference(w, ids, kind, False)
    assert relative(logits, expected) <= REL
    assert_unmodified(w, ids, module_state(w.hf))


def test_skip_of_a_lorsa_in_generate_is_refused():
    """In ``generate`` a skipped Lorsa computed no keys and values for the later tokens to attend to: the first
    cached step raises ``LorsaError`` naming the skip (before: ``KeyError('kv')``)."""
    w = world()
    ids = random_ids(1, 5, seed=2)
    with pytest.raises(LorsaError, match="skipped"):  # noqa: SIM117  (nnsight captures the trace's own with block)
        with torch.no_grad(), w.model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False,
                                              pad_token_id=1):
            site = replace(w, "lorsa", False)
            site.skip(torch.zeros(1, 5, w.adapter.d_model))
    assert_unmodified(w, ids, module_state(w.hf))


# ------------------------------------------------------------------ barrier, session, invokes, scan
@generated(3, 100, family=st.sampled_from(FAMILIES), kind=st.sampled_from(KINDS), error=st.booleans(),
           seed=st.integers(0, 10_000), length=st.integers(2, 8))
def test_barrier_moves_a_latent_between_invokes(family, kind, error, seed, length):
    """Two invokes each replace; a barrier lets the second set its latents to the first's: the second row's logits
    are those of the hooks with row 1's latents set to row 0's."""
    w = world(family)
    ids = random_ids(2, length, seed=seed)
    with torch.no_grad(), w.model.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(ids[:1]):
            site = replace(w, kind, error)
            latent = getattr(site, LATENT[kind]).output.clone()
            barrier()
            a = nnsight.save(unembed(w.model).output)
        with tracer.invoke(ids[1:]):
            site = replace(w, kind, error)
            barrier()
            getattr(site, LATENT[kind]).output[:] = latent
            b = nnsight.save(unembed(w.model).output)
    ref = transplanted(w, ids, kind, error)
    assert relative(a, ref[:1]) <= REL and relative(b, ref[1:]) <= REL


@torch.no_grad()
def transplanted(w: SimpleNamespace, ids: torch.Tensor, kind: str, error: bool) -> torch.Tensor:
    """The hooks' logits with row 1's latents set to row 0's (the latents are per row: a batch of two)."""
    cap: dict = {}
    reference(w, ids, kind, error, None, cap)
    rows = cap["latent"]
    m, a = w.modules[kind], w.adapter

    def hook(module, args, kwargs, output):
        latent = rows.clone()
        latent[1] = rows[0]
        if kind == "lorsa":
            x = a.attention_input(args, kwargs)
            z = m.activation(m.compute_z_pre(x, a.attention_positions(args, kwargs, x),
                                             a.attention_mask(args, kwargs)))[0]
            clean, out, true = m.decode(z), m.decode(latent), a.attention_output(output)
            site = true + (out - clean) if error else out
            return a.with_attention_output(output, site)
        x = a.mlp_input(args, kwargs) if kind == "transcoder" else first(output)
        skip = m.skip(x)
        skip = 0 if skip is None else skip
        clean, out = m.decode(m.encode(x)) + skip, m.decode(latent) + skip
        site = first(output) + (out - clean) if error else out
        return (site, *output[1:]) if isinstance(output, tuple) else site

    handle = w.hf.get_submodule(w.paths[kind]).register_forward_hook(hook, with_kwargs=True)
    try:
        return plain_logits(w, ids)
    finally:
        handle.remove()


@pytest.mark.parametrize("kind", KINDS)
def test_session_passes_values_between_traces(kind):
    """``model.session()``: the site's own output read in a trace without ``replace`` and a latent read in a trace
    with it (neither saved) flow into a third trace, which writes the latent back with ``error=True``: the
    replacement's output plus its error term is the first trace's output, and the logits are the model's own."""
    w = world()
    ids = random_ids(1, 6, seed=7)
    with torch.no_grad(), w.model.session():
        with w.model.trace(ids):
            own = first(w.model.get(w.paths[kind]).output).clone()
        with w.model.trace(ids):
            latent = getattr(replace(w, kind, False), LATENT[kind]).output.clone()
        with w.model.trace(ids):
            site = replace(w, kind, True)
            getattr(site, LATENT[kind]).output[:] = latent
            out = nnsight.save(site.output.clone())
            err = nnsight.save(site.hook_error.output.clone())
            logits = nnsight.save(unembed(w.model).output)
            own = nnsight.save(own)
    # relative to the summands: a transcoder's MLP output is ~1e-3 of its output and error term, which cancel
    scale = max(float(out.abs().max()), float(err.abs().max()), float(own.abs().max()))
    assert float((out.double() + err.double() - own.double()).abs().max()) <= REL * scale
    assert relative(logits, plain_logits(w, ids)) <= REL


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("session", [False, True])
def test_an_envoy_from_an_ended_trace_is_refused(kind, session):
    """A replacement's envoy kept from one trace (saved, or a name in a ``model.session()``) and read or edited in the
    next one raises ``TraceOrderError`` naming it (before: nnsight's ``OutOfOrderError``, "the model already ran past
    it", for a module that trace never ran); outside a trace it still prints and has its path; a fresh ``replace``
    works."""
    w = world()
    ids = random_ids(1, 5, seed=4)
    state = module_state(w.hf)
    hook = LATENT[kind]
    if session:
        with pytest.raises(TraceOrderError, match="trace that has ended"):  # noqa: SIM117  (as above)
            with torch.no_grad(), w.model.session():
                with w.model.trace(ids):
                    site = replace(w, kind, False)
                with w.model.trace(ids):
                    getattr(site, hook).output[:] = 0
    else:
        with torch.no_grad(), w.model.trace(ids):
            site = nnsight.save(replace(w, kind, False))
        assert getattr(site, hook).path.endswith(hook) and repr(site)
        with pytest.raises(TraceOrderError, match="trace that has ended"):  # noqa: SIM117  (as above)
            with torch.no_grad(), w.model.trace(ids):
                nnsight.save(getattr(site, hook).output)
    cap: dict = {}
    ref = reference(w, ids, kind, False, None, cap)
    with torch.no_grad(), w.model.trace(ids):
        latent = nnsight.save(getattr(replace(w, kind, False), hook).output)
        logits = nnsight.save(unembed(w.model).output)
    assert relative(latent, cap["latent"]) <= REL and relative(logits, ref) <= REL
    assert_unmodified(w, ids, state)


@pytest.mark.parametrize("kind", KINDS)
def test_empty_invoke_replaces_every_row(kind):
    """``replace`` in an empty ``tracer.invoke()`` (declared before or after the prompts' invokes) replaces every
    row: each invoke's logits are the hooks'."""
    w = world()
    ids = random_ids(2, 6, seed=8)
    ref = reference(w, ids, kind, False)
    for before in (True, False):
        with torch.no_grad(), w.model.trace() as tracer:
            if before:
                with tracer.invoke():
                    replace(w, kind, False)
            with tracer.invoke(ids[:1]):
                a = nnsight.save(unembed(w.model).output)
            with tracer.invoke(ids[1:]):
                b = nnsight.save(unembed(w.model).output)
            if not before:
                with tracer.invoke():
                    replace(w, kind, False)
        assert relative(a, ref[:1]) <= REL and relative(b, ref[1:]) <= REL


def test_scan_with_replacements_and_edits():
    """``model.scan`` (shapes only) and ``trace(..., scan=True)`` run the splice, error terms and edits included,
    and leave the model as it was."""
    w = world()
    ids = random_ids(1, 6, seed=9)
    state = module_state(w.hf)
    with torch.no_grad(), w.model.scan(ids):
        sites = [replace(w, kind, error) for kind, error in zip(KINDS, (True, False, True), strict=True)]
        sites[0].hook_z.output[..., 3] = 0
        shape = nnsight.save(sites[0].hook_z.output.shape)
        logits = nnsight.save(unembed(w.model).output.shape)
    assert tuple(shape) == (1, 6, w.widths["lorsa"]) and tuple(logits) == (1, 6, 128)
    with torch.no_grad(), w.model.trace(ids, scan=True):
        replace(w, "lorsa", False)
        scanned = nnsight.save(unembed(w.model).output)
    assert relative(scanned, reference(w, ids, "lorsa", False)) <= REL
    assert_unmodified(w, ids, state)



@pytest.mark.parametrize("model_dtype", [torch.float16, torch.float32])
def test_scan_with_fp16_replacements(model_dtype):
    """``model.scan`` with fp16 replacement modules (an fp16 module's output is checked for inf / NaN, a cast into
    fp16 for values past its range: reads a fake tensor has no values for) gives the shapes; before, torch's
    ``GuardOnDataDependentSymNode`` from the check. ``trace(..., scan=True)`` then runs the checks on real values."""
    model, hf = tiny_nnsight("llama", dtype=model_dtype)
    adapter = get_adapter(model)
    lorsa = make_lorsa(hf.float(), adapter, LORSA_LAYER).half()
    hf.to(model_dtype)
    saes = SAESet(model, {adapter.layer_path(SAE_LAYER): make_sae(seed=5).half()})
    lorsas = LorsaSet(model, {LORSA_LAYER: lorsa})
    ids = random_ids(1, 6, seed=9)
    with torch.no_grad(), model.scan(ids):
        site = saes.replace(adapter.layer_path(SAE_LAYER), error=True)
        site.hook_sae_acts_post.output[..., 3] = 0
        lorsas.replace(LORSA_LAYER)
        shape = nnsight.save(unembed(model).output.shape)
    assert tuple(shape) == (1, 6, 128)
    with torch.no_grad(), model.trace(ids, scan=True):
        lorsas.replace(LORSA_LAYER)
        scanned = nnsight.save(unembed(model).output)
    with torch.no_grad(), model.trace(ids):
        lorsas.replace(LORSA_LAYER)
        traced = nnsight.save(unembed(model).output)
    assert torch.equal(scanned, traced)

# ------------------------------------------------------------------ attribution of an edited model
def test_attribute_of_a_model_with_stored_edits():
    """``attribute(rm, prompt)`` of a model carrying ``model.edit(inplace=True)`` edits raises ``ArgumentError``
    (before: a graph with the unedited model's nodes and edges of neither model); ``attribute(rm, tracer=tracer)``
    inside a trace of it gives the graph of the same edit made in the trace body, exactly."""
    w = world()
    rm = ReplacementModel(w.model, lorsas=w.sets["lorsa"])
    ids = random_ids(1, 6, seed=12)[0]
    cap: dict = {}
    reference(w, ids[None], "lorsa", False, None, cap)
    head = int(cap["latent"][0].sum(0).argmax())  # an active head: its ablation moves the graph
    with w.model.trace(ids) as tracer:
        site = replace(w, "lorsa", True)
        handle = attribute(rm, tracer=tracer, batch_size=32)
        site.hook_z.output[..., head] = 0
    in_body = handle.graph
    with w.model.edit(inplace=True):
        site = replace(w, "lorsa", True)
        site.hook_z.output[..., head] = 0
    try:
        with pytest.raises(ArgumentError, match="model.edit"):
            attribute(rm, ids, batch_size=32)
        with w.model.trace(ids) as tracer:
            handle = attribute(rm, tracer=tracer, batch_size=32)
        stored = handle.graph
    finally:
        w.model.clear_edits()
    assert stored.n_nodes == in_body.n_nodes
    assert torch.equal(stored.densify(), in_body.densify())
