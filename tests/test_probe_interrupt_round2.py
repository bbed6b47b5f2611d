"""Probe, round 2: interruptions and failures part-way leave nothing half done.

docs/reliability.md, "Interruption and failure part-way probe, round 2 (2026-11-28)". The crash-injection helpers
of the first round (``tests/test_probe_interrupt.py``: ``fail_once``, ``failing_at``, ``snapshot``) raise a
``KeyboardInterrupt``, a fake CUDA ``torch.OutOfMemoryError``, a ``RuntimeError`` or (writers) an ``OSError`` of a
full disk at a drawn point of: the switch of ``ReplacementSet.offload`` (moving modules), the first training step of
a trainer (the scale factors and the objective's initialisation), CLT and transcoder training steps, the trainer's
checkpoint write, every writer's file boundaries (modules in every format, sets, graphs, exports, pictures, caches,
gates), ``attribute`` (offloaded, under ``max_memory``) and ``generate`` with replacements. After it: the exception
is the injected one or a named error of ours; the model, modules, flags and files are as before (or as after,
whole); a retry gives the uninterrupted result bit for bit (byte for byte).
"""

from __future__ import annotations

import contextlib
import errno
import functools
from pathlib import Path

import pytest
import torch
from helpers import generated, make_transcoders, random_ids, tiny_nnsight
from hypothesis import strategies as st
from test_probe_interrupt import FAILURES, fail_once, failing_fetch, same, same_state, snapshot, trainer_state

import nnsight_lorsa.envoy.replacement_set as replacement_set
from nnsight_lorsa import LorsaSet, TranscoderSet
from nnsight_lorsa._placement import offloaded

WRITE_FAILURES = {**FAILURES, "disk-full": lambda: OSError(errno.ENOSPC, "No space left on device (injected)")}


# ------------------------------------------------------------------ 1. the offload switch failing part-way
@functools.cache
def offload_world():
    from helpers import make_lorsa

    from nnsight_lorsa import get_adapter

    model, hf = tiny_nnsight("llama")
    adapter = get_adapter(hf)
    lorsas = LorsaSet(model, {layer: make_lorsa(hf, adapter, layer) for layer in range(adapter.n_layers)})
    tcs = TranscoderSet(model, make_transcoders(range(adapter.n_layers), skip_layer=1))
    return model, {"lorsas": lorsas, "transcoders": tcs}


@generated(4, 60, which=st.sampled_from(["lorsas", "transcoders"]), start=st.booleans(), k=st.integers(1, 3),
           failure=st.sampled_from(sorted(FAILURES)), split=st.booleans())
def test_a_failed_offload_switch_leaves_the_flag_and_every_module_as_before(which, start, k, failure, split):
    """``set.offload = not start`` whose k-th module move fails (a CUDA OOM copying it to the device, Ctrl-C; on
    this CPU machine the moves are stand-ins that record where each module is — ``split``: the failing move left
    that module half moved): the flag, every module's offload mark and where every module is are as before the
    switch; the switch then retried moves them all."""
    _, sets = offload_world()
    s = sets[which]
    s.offload = start
    where = {id(m): ("host" if start else "device") for m in s.values()}
    calls = [0]

    def move(to: str):
        def stand_in(module, *args, **kwargs):
            calls[0] += 1
            if calls[0] == k:
                if split:
                    where[id(module)] = "split"
                raise FAILURES[failure]()
            where[id(module)] = to
        return stand_in

    marks = [offloaded(m) for m in s.values()]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(replacement_set, "place", move("device"))
        mp.setattr(replacement_set, "store_on_host", move("host"))
        with pytest.raises(type(FAILURES[failure]())):
            s.offload = not start
        assert s.offload is start, f"failed at module {k}: the flag reads switched"
        assert [offloaded(m) for m in s.values()] == marks, "a module's mark stayed switched"
        assert all(where[id(m)] == ("host" if start else "device") for m in s.values()), f"left moved: {where}"
        s.offload = not start  # the retry (the stand-ins fail once)
        assert s.offload is (not start) and all(offloaded(m) is (not start) for m in s.values())
        assert all(where[id(m)] == ("device" if start else "host") for m in s.values())
    s.offload = False


# ------------------------------------------------------------------ 2. training: the first step, CLTs, transcoders
STEP_POINTS = ("source", "forward", "backward", "clip")


def round2_trainer(kind: str, batches: list):
    """A fp64 trainer of a CLT (2 layers, BatchTopK thresholds estimated in the forward, skip), a skip transcoder
    (JumpReLU: trained thresholds), or a Lorsa (initialised from the scale factors on the first step: random OV,
    ``b_D`` from the targets' mean; k annealed), with AuxK against latents dead after 6 tokens; and the module whose
    forward the step runs."""
    from nnsight_lorsa.modules import CLTConfig, CrossLayerTranscoder, SkipTranscoder, TranscoderConfig
    from nnsight_lorsa.modules.lorsa import Lorsa
    from nnsight_lorsa.modules.lorsa_config import LorsaConfig
    from nnsight_lorsa.training import LorsaObjective, LorsaRecipe, TrainConfig, Trainer

    torch.manual_seed(0)
    cfg = TrainConfig(total_steps=5, lr=1e-2, norm_batches=2, aux_k=4, aux_k_coef=0.5, dead_after_tokens=6,
                      log_every=1, warmup_frac=0.0, sparse_kernels=False)
    if kind == "clt":
        clt = CrossLayerTranscoder(CLTConfig(d_in=8, d_sae=12, n_layers=2, activation="batchtopk",
                                             activation_params={"k": 3}, skip=True)).double()
        return Trainer(clt, batches.__getitem__, cfg), clt.activation[1]
    if kind == "transcoder":
        tc = SkipTranscoder(TranscoderConfig(d_in=8, d_sae=24, activation="jumprelu",
                                             activation_params={"threshold": 0.05})).double()
        return Trainer(tc, batches.__getitem__, cfg), tc.activation
    lorsa = Lorsa(LorsaConfig(d_model=8, n_qk_heads=2, d_qk_head=2, n_ov_heads=8, top_k=2)).double()
    recipe = LorsaRecipe(ov_init="random", center_b_v=False, scale_init=False, b_d_init=True, k_anneal_from=4)
    return Trainer(LorsaObjective(lorsa, recipe=recipe), batches.__getitem__, cfg), lorsa.hook_v


def round2_batches(kind: str) -> list:
    from nnsight_lorsa.training.activations import Batch

    g = torch.Generator().manual_seed(3)
    real = torch.ones(2, 5, dtype=torch.bool)
    shape = (2, 2, 5, 8) if kind == "clt" else (2, 5, 8)
    xs = [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(5)]
    if kind == "lorsa":
        return [Batch(x, x.flip(-1).tanh(), real, torch.arange(5), real.long()) for x in xs]
    return [Batch(x, x.flip(-1).tanh() + 0.5, real) for x in xs]


def full_state(trainer) -> list:
    return [*trainer_state(trainer), trainer.s_in, trainer.s_out, trainer.s_in_layers, trainer.s_out_layers]


@functools.cache
def straight_run(kind: str) -> list:
    trainer = round2_trainer(kind, round2_batches(kind))[0]
    while trainer.step < 5:
        trainer.train_step()
    return full_state(trainer)


@functools.cache
def first_step_source_calls(kind: str) -> int:
    """How many times an uninterrupted first step calls its batch source (a CLT's first step makes fewer calls than
    a Lorsa's, whose initialisation reads batch 0 again)."""
    trainer = round2_trainer(kind, round2_batches(kind))[0]
    source, calls = trainer.source, [0]

    def counting(i: int):
        calls[0] += 1
        return source(i)

    trainer.source = counting
    trainer.train_step()
    return calls[0]


@generated(4, 90, kind=st.sampled_from(["clt", "transcoder", "lorsa"]), step=st.integers(0, 4),
           point=st.sampled_from(STEP_POINTS), n=st.integers(1, 4), failure=st.sampled_from(sorted(FAILURES)))
def test_a_failed_step_of_every_objective_is_as_if_it_never_ran(kind, step, point, n, failure):
    """A ``Trainer`` step of a CLT, a skip transcoder or a Lorsa fails at a drawn point before the optimizer's
    update: at the n-th call of its batch source (the first step calls it for the scale factors — ``norm_batches=2``
    —, for the objective's initialisation check and initialisation, then for its batch), in the forward, in the
    backward, clipping. The trainer is left as after the step before (weights, Adam state, dead counters, BatchTopK
    thresholds, scale factors) — at the first step, or as after a complete estimate of the scale factors and the
    initialisation —, and running on gives the uninterrupted run's state bit for bit."""
    batches = round2_batches(kind)
    trainer, forward_module = round2_trainer(kind, batches)
    while trainer.step < step:
        trainer.train_step()
    before = full_state(trainer)
    fail = fail_once(failure)
    calls = [0]
    handles = []
    source = trainer.source
    if point == "source":
        n = min(n, first_step_source_calls(kind)) if step == 0 else 1

        def failing_source(i: int):
            calls[0] += 1
            if calls[0] == n:
                fail()
            return source(i)

        trainer.source = failing_source
    elif point == "forward":
        handles.append(forward_module.register_forward_hook(lambda *a: fail()))
    elif point == "backward":
        first = next(trainer.module.parameters())
        handles.append(first.register_post_accumulate_grad_hook(lambda p: fail()))
    with pytest.MonkeyPatch.context() as mp:
        if point == "clip":
            clip = torch.nn.utils.clip_grads_with_norm_
            mp.setattr(torch.nn.utils, "clip_grads_with_norm_", lambda *a, **k: (fail(), clip(*a, **k))[1])
        try:
            with pytest.raises(type(FAILURES[failure]())):
                trainer.train_step()
        finally:
            for h in handles:
                h.remove()
            trainer.source = source
    after = full_state(trainer)
    allowed = [before]
    if step == 0:  # or as after the (deterministic) scale factors and initialisation, complete
        estimated = round2_trainer(kind, batches)[0]
        estimated.estimate_norms()
        allowed.append(full_state(estimated))
    assert any(same_state(after, ok) and after[4:] == ok[4:] for ok in allowed), \
        f"{kind} step {step} failed at {point} #{n}: the trainer is not as before the step"
    while trainer.step < 5:
        trainer.train_step()
    assert same_state(full_state(trainer), straight_run(kind)), "the run went on from a failed step with another state"
    assert full_state(trainer)[4:] == straight_run(kind)[4:]


@pytest.mark.parametrize(("point", "n"), [("source", 3), ("source", 4), ("forward", 1)])
def test_an_interrupted_first_step_initialises_again(point, n):
    """The first step of a Lorsa trainer estimates the scale factors, then initialises the Lorsa from them (a
    forward at ``hook_v`` included): interrupted in the initialisation check (source call 3), in the
    initialisation (source call 4, the forward), the scale factors are unset again and the weights as before, so the
    retried step initialises as an uninterrupted run (until 2026-11-28 the scale factors stayed set: the retry
    skipped the initialisation and trained the half-initialised Lorsa)."""
    test_a_failed_step_of_every_objective_is_as_if_it_never_ran.hypothesis.inner_test(
        kind="lorsa", step=0, point=point, n=n, failure="interrupt")


# ------------------------------------------------------------------ 3. writers failing at every boundary
def _set_sig(d: Path) -> tuple:
    from test_atomic_writes import _module_sig

    from nnsight_lorsa.formats import load

    return tuple((sub.name, _module_sig(load(sub))) for sub in sorted(d.iterdir()) if sub.is_dir())


def _checkpoint_sig(d: Path) -> tuple:
    from test_atomic_writes import _tensors_sig

    from nnsight_lorsa.training import Trainer

    meta, _, module = Trainer.load_checkpoint(d)
    return meta["step"], _tensors_sig(module.state_dict())


def _file_sig(p: Path) -> bytes:
    """A file's bytes, but the creation time the Neuronpedia JSON holds."""
    import re

    return re.sub(rb'"create_time_ms": ?[0-9]+', b"", p.read_bytes())


def _trainers() -> tuple:
    batches = round2_batches("transcoder")
    old = round2_trainer("transcoder", batches)[0]
    old.train_step()
    new = round2_trainer("transcoder", batches)[0]
    for _ in range(2):
        new.train_step()
    return old, new


@pytest.fixture(scope="module")
def all_writers(tmp_path_factory) -> dict:
    return writers(tmp_path_factory.mktemp("writers"))


def writers(root: Path) -> dict:
    from helpers import attribution_setup
    from test_atomic_writes import Writer, _writers

    from nnsight_lorsa.attribution import save_neuronpedia
    from nnsight_lorsa.viz import render_html

    out = dict(_writers(root))
    model, hf, lorsas, _ = attribution_setup("llama")
    from helpers import make_lorsa

    from nnsight_lorsa import get_adapter

    adapter = get_adapter(hf)
    old_set = {layer: make_lorsa(hf, adapter, layer, seed=layer) for layer in range(3)}
    new_set = {layer: make_lorsa(hf, adapter, layer, seed=10 + layer) for layer in range(3)}
    out["LorsaSet.save"] = Writer("LorsaSet.save", old_set, new_set,
                                  lambda o, d: LorsaSet(model, o).save(d), _set_sig)
    old_t, new_t = _trainers()
    out["Trainer.save_checkpoint"] = Writer("Trainer.save_checkpoint", old_t, new_t,
                                            lambda t, d: t.save_checkpoint(d), _checkpoint_sig)
    g_old, g_new = out["Graph.save"].old, out["Graph.save"].new
    out["save_neuronpedia"] = Writer("save_neuronpedia", g_old, g_new, lambda g, p: save_neuronpedia(g, p),
                                     _file_sig)
    out["render_html"] = Writer("render_html", g_old, g_new, lambda g, p: render_html(g, path=p), _file_sig)
    return out


class Injected:
    """Every boundary of a save (``_atomic._boundary``, a checkpoint's ``checkpoint_io._boundary``) counted; the
    ``k``-th raises ``WRITE_FAILURES[failure]()`` (``k`` 0: none)."""

    def __init__(self, k: int, failure: str) -> None:
        self.k, self.failure, self.events = k, failure, []

    def __call__(self, event: str) -> None:
        self.events.append(event)
        if len(self.events) == self.k:
            raise WRITE_FAILURES[self.failure]()

    @contextlib.contextmanager
    def armed(self):
        from nnsight_lorsa import _atomic
        from nnsight_lorsa.training import checkpoint_io

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_atomic, "_boundary", self)
            mp.setattr(checkpoint_io, "_boundary", self)
            yield self


WRITER_NAMES = ["nnsight_lorsa:Lorsa", "nnsight_lorsa:Transcoder", "saelens:SAE", "sparsify:SAE", "llamascopium:Lorsa",
                "circuit_tracer:CLT", "circuit_tracer:transcoders", "Graph.save", "save_gates",
                "write_activation_cache", "LorsaSet.save", "Trainer.save_checkpoint", "save_neuronpedia",
                "render_html"]


def writer_events(w, root: Path, name: str) -> tuple[list[str], str]:
    """The boundary events of ``w`` writing its new content over its old one, and the path's leaf name (once per
    writer)."""
    if name in _EVENTS:
        return _EVENTS[name]
    leaf = "out.json" if name in ("save_neuronpedia", "render_html") else "dir"
    counting = Injected(0, "runtime")
    if not w.absent_old:
        w.write(w.old, root / f"count_{name}" / leaf)
    with counting.armed():
        w.write(w.new, root / f"count_{name}" / leaf)
    assert len(counting.events) >= 2, counting.events
    _EVENTS[name] = counting.events, leaf
    return _EVENTS[name]


def check_writer_failing_at(w, root: Path, name: str, k: int, failure: str) -> None:
    """``w`` writing its new content over its old one, failing with ``failure`` at boundary ``k``: the injected
    exception (or our ``SaveError`` of an ``OSError``), the path as before (past the last rename: as after), nothing
    beside it, and the retried write gives the new content."""
    from nnsight_lorsa.errors import SaveError

    events, leaf = writer_events(w, root, name)
    swapped_at = len(events) - events[::-1].index("rename:new")  # the last rename: the new content in
    refs = _REFS.setdefault(name, {})
    for label in ("old", "new"):
        if not (label == "old" and w.absent_old) and label not in refs:
            w.write(getattr(w, label), root / f"ref_{name}_{label}" / leaf)
            refs[label] = w.read(root / f"ref_{name}_{label}" / leaf)
    d = root / f"{name}_{k}_{failure}" / leaf
    if not w.absent_old:
        w.write(w.old, d)
    inject = Injected(k, failure)
    with inject.armed(), pytest.raises(BaseException) as info:
        w.write(w.new, d)
    expected = type(WRITE_FAILURES[failure]())
    event = inject.events[-1]
    assert isinstance(info.value, expected) or (failure == "disk-full" and isinstance(info.value, SaveError)
                                               and isinstance(info.value.__cause__, OSError)), \
        f"{name}: boundary {k} ({event}) {failure}: {info.value!r}"
    renamed = k >= swapped_at
    if d.exists() or not w.absent_old:
        assert w.read(d) == refs["new" if renamed else "old"], f"{name}: boundary {k} ({event}) {failure}: a mix"
    listing = sorted(p.name for p in d.parent.iterdir())
    assert listing in ([leaf], []), f"{name}: boundary {k} ({event}) {failure}: left {listing}"
    if not (w.absent_old and renamed):  # (a cache is never written over)
        w.write(w.new, d)  # the retry
    assert w.read(d) == refs["new"], f"{name}: the retry after boundary {k} ({event}) {failure}"
    assert sorted(p.name for p in d.parent.iterdir()) == [leaf]


_EVENTS: dict[str, tuple[list[str], str]] = {}
_REFS: dict[str, dict] = {}

#: (writer, the boundary event, which of its occurrences, failure): the default cases — between two folders of a
#: set, between the two renames, a checkpoint's file
WRITER_CASES = [("LorsaSet.save", "removed:old", 1, "interrupt"), ("nnsight_lorsa:Lorsa", "rename:old", 1, "disk-full"),
                ("Trainer.save_checkpoint", "file:optimizer.safetensors", 1, "oom")]


@pytest.mark.parametrize(("name", "at", "nth", "failure"), WRITER_CASES)
def test_a_writer_failing_at_a_boundary_leaves_old_or_new(name, at, nth, failure, all_writers, tmp_path_factory):
    """Writers over an existing file or directory, failing in this process at a boundary (half a file written, a
    file written, the manifest, each rename): the injected exception (an ``OSError`` inside the staging as our
    ``SaveError``), the path reads exactly as before (or, past the last rename, exactly as after), nothing beside it
    (no temporary, no ``.old``), and the retried write gives the new content. The sweep: every writer (modules in
    every format, a set, a graph, the Neuronpedia JSON, the graph viewer's page, gates, an activation cache, a
    training checkpoint), every boundary, every failure kind."""
    root = tmp_path_factory.mktemp("w")
    w = all_writers[name]
    events, _ = writer_events(w, root, name)
    k = [i + 1 for i, e in enumerate(events) if e == at][nth - 1]
    check_writer_failing_at(w, root, name, k, failure)


@pytest.mark.slow
@pytest.mark.parametrize("name", WRITER_NAMES)
def test_sweep_a_writer_failing_at_any_boundary_leaves_old_or_new(name, all_writers, tmp_path_factory):
    root = tmp_path_factory.mktemp("w")
    w = all_writers[name]
    events, _ = writer_events(w, root, name)
    for k in range(1, len(events) + 1):
        for failure in sorted(WRITE_FAILURES):
            check_writer_failing_at(w, root, name, k, failure)


@generated(2, 30, kind=st.sampled_from(["clt", "transcoder", "lorsa"]), k=st.integers(1, 20),
           failure=st.sampled_from(sorted(WRITE_FAILURES)))
def test_a_checkpoint_write_that_fails_keeps_the_last_one_and_resumes_bit_exactly(kind, k, failure, tmp_path_factory):
    """``Trainer.train(checkpoint_every=1)`` whose checkpoint write after step 3 fails at a drawn boundary: the
    checkpoint left at the path is step 2's (or, past the last rename, step 3's), whole, and a trainer resumed from it
    trains to the uninterrupted run's state bit for bit."""
    from nnsight_lorsa.training import Trainer

    d = tmp_path_factory.mktemp("ckpt") / "run"
    batches = round2_batches(kind)
    trainer = round2_trainer(kind, batches)[0]
    trainer.train(2, progress=False, checkpoint_dir=d, checkpoint_every=1)
    trainer.train_step()
    events = Injected(0, "runtime")
    with events.armed():
        trainer.save_checkpoint(d.with_name("count"))
    k = 1 + (k - 1) % len(events.events)
    from nnsight_lorsa.errors import SaveError

    with Injected(k, failure).armed(), pytest.raises((type(WRITE_FAILURES[failure]()), SaveError)):
        trainer.save_checkpoint(d)
    assert sorted(p.name for p in d.parent.iterdir()) == ["count", "run"]
    resumed = Trainer.resume(d, batches.__getitem__)
    assert resumed.step in (2, 3)
    while resumed.step < 5:
        resumed.train_step()
    straight = straight_run(kind)
    assert same_state(full_state(resumed), straight) and full_state(resumed)[4:] == straight[4:]


# ------------------------------------------------------------------ 4. attribute: offloaded, under max_memory
def wf_attribute_offloaded(w, max_memory: int | None, **kw):
    from test_probe_interrupt import IDS

    from nnsight_lorsa.attribution import attribute

    w.rm.lorsas.offload = w.rm.transcoders.offload = True
    try:
        return attribute(w.rm, IDS[0], batch_size=16, max_memory=max_memory, **kw)
    finally:
        w.rm.lorsas.offload = w.rm.transcoders.offload = False


#: a budget that fits a batch of fewer than 16 rows on the tiny Llama (``estimate_memory``: 10.5 MB at 16, 9.9 MB at 4)
BUDGET = 9_900_000
ATTRIBUTIONS = {
    "offload-budget": lambda w: wf_attribute_offloaded(w, BUDGET),
    "offload-budget-lean-prune": lambda w: wf_attribute_offloaded(w, 11_600_000, memory="lean", prune=(0.8, 0.98)),
    "offload-qk-fast": lambda w: wf_attribute_offloaded(w, None, memory="fast", qk_heads=2),
}


@functools.cache
def uninterrupted_attribution(name: str):
    from test_probe_interrupt import world

    return ATTRIBUTIONS[name](world())


@pytest.mark.slow
def test_the_budget_makes_a_smaller_batch():
    assert uninterrupted_attribution("offload-budget").meta["batch_size"] < 16


@generated(1, 80, name=st.sampled_from(sorted(ATTRIBUTIONS)), n=st.integers(1, 9),
           failure=st.sampled_from(sorted(FAILURES)), site=st.sampled_from(["layer0.mlp", "layer1.self_attn",
                                                                             "layer2.input_layernorm", "lm_head",
                                                                             "lorsa1", "transcoder0", "transcoder2"]))
def test_an_interrupted_offloaded_attribution_under_a_budget_reruns_bit_exactly(name, n, failure, site):
    """``attribute`` with offloaded sets (under ``max_memory``: a smaller batch; pruned; QK heads), the N-th forward
    of a drawn module failing (the clean pass, the frozen pass, a batch's pass, the ranking's passes): the injected
    exception, the model and modules as before (``test_probe_interrupt.snapshot``: no hook, no device copy, no
    attribute left), and the re-run gives the uninterrupted graph bit for bit."""
    from test_probe_interrupt import check_interrupted, world

    w = world()
    check_interrupted(w, lambda: ATTRIBUTIONS[name](w), site, n, failure, uninterrupted_attribution(name))


@generated(1, 40, name=st.sampled_from(sorted(ATTRIBUTIONS)), n=st.integers(1, 60),
           failure=st.sampled_from(sorted(FAILURES)))
def test_a_failed_copy_in_an_offloaded_attribution_under_a_budget_reruns_bit_exactly(name, n, failure):
    """The N-th copy of an offloaded module's tensor to the device (``_placement.fetch``, a cloning stand-in on the
    CPU) fails during ``attribute`` under a budget: every tensor is the host tensor it was, the flag as it was, and
    the re-run gives the uninterrupted graph."""
    from test_probe_interrupt import world

    from nnsight_lorsa import _placement

    w = world()
    expected = uninterrupted_attribution(name)
    before = snapshot(w.hf, *w.replacements)
    fetch, calls = failing_fetch(n, failure)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_placement, "fetch", fetch)
        with contextlib.suppress(type(FAILURES[failure]())):
            ATTRIBUTIONS[name](w)
    assert snapshot(w.hf, *w.replacements) == before, f"copy {n} of {calls[0]} failed: a module kept copies"
    assert not w.rm.lorsas.offload and not w.rm.transcoders.offload
    assert same(ATTRIBUTIONS[name](w), expected)


# ------------------------------------------------------------------ 5. generate with replacements
def generate_with(w, ids: torch.Tensor, offload: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ``model.generate`` of 4 tokens with the Lorsa and the transcoders spliced in; the tokens and each
    step's last logits."""
    import nnsight
    from test_probe_interrupt import unembed

    w.rm.lorsas.offload = w.rm.transcoders.offload = offload
    try:
        with torch.no_grad(), w.model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                                               pad_token_id=1) as tracer:
            w.rm.replace()
            steps = nnsight.save([])
            for _ in tracer.iter[:4]:
                steps.append(unembed(w.model).output[:, -1].clone())
            out = nnsight.save(tracer.result)
    finally:
        w.rm.lorsas.offload = w.rm.transcoders.offload = False
    return out, torch.stack(list(steps))


@functools.cache
def uninterrupted_generation(offload: bool):
    from test_probe_interrupt import world

    return generate_with(world(), random_ids(batch=2, seq=6, seed=8), offload)


@generated(2, 80, n=st.integers(1, 4), offload=st.booleans(), failure=st.sampled_from(sorted(FAILURES)),
           site=st.sampled_from(["layer0.mlp", "layer1.self_attn", "layer2.mlp", "lm_head", "lorsa1", "transcoder2"]))
def test_an_interrupted_generation_generates_the_same_tokens_again(n, offload, failure, site):
    """``model.generate`` with the Lorsa (its own keys and values of the earlier tokens) and the transcoders spliced
    in, a drawn module failing at generation step N (its N-th forward: the prompt, then one per token): the
    injected exception, the model and modules as before, a plain trace as before, and generating again gives the
    uninterrupted run's tokens and logits bit for bit."""
    from test_probe_interrupt import check_interrupted, world

    w = world()
    ids = random_ids(batch=2, seq=6, seed=8)
    check_interrupted(w, lambda: generate_with(w, ids, offload), site, n, failure, uninterrupted_generation(offload))
