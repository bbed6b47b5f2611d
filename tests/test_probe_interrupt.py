"""Probe: an interruption or a failure in the middle of a long-running workflow leaves the model as it was.

docs/reliability.md, "Interruption probe (2026-11-28)". Crash injection: a forward pre-hook on a drawn module of
the model (or of a replacement module), or a drawn internal function, raises ``KeyboardInterrupt``, a fake CUDA
``torch.OutOfMemoryError`` or a ``RuntimeError`` at its N-th call (N drawn below the calls an uninterrupted run
makes). After it: the exception propagates as itself; the model and its replacement modules are unmodified (the
same parameter objects, values bit for bit, ``requires_grad``, train / eval mode, dtype and device, no hook, no
module or attribute left behind); a plain trace gives the original logits bit for bit; and the workflow re-run at
once gives the uninterrupted run's result exactly.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import nnsight
import pytest
import torch
from helpers import attribution_setup, generated, random_ids, rm, unembed
from hypothesis import strategies as st

from nnsight_lorsa.analysis import collect_top_activations, mhsa_correlation
from nnsight_lorsa.attribution import attribute, estimate_memory
from nnsight_lorsa.patching import (
    LorsaHead,
    MHSAHead,
    TaskBatch,
    ablation_effect,
    activation_patching,
    circuit_size,
    head_swap,
    mean_activations,
    path_patching,
    random_ablation_control,
)
from nnsight_lorsa.patching.circuit import component_scores
from nnsight_lorsa.remote import for_remote
from nnsight_lorsa.training import TokenDataset, evaluate

FAILURES: dict[str, Callable[[], BaseException]] = {
    "interrupt": KeyboardInterrupt,
    "oom": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)"),
    "runtime": lambda: RuntimeError("injected failure"),
}

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks",
               "_load_state_dict_pre_hooks")


def fail_once(failure: str) -> Callable[..., None]:
    """A hook / wrapper that raises ``FAILURES[failure]`` on its first call and does nothing after."""
    armed = [True]

    def fail(*args: object, **kwargs: object) -> None:
        if armed[0]:
            armed[0] = False
            raise FAILURES[failure]()

    return fail


def failing_fetch(n: int, failure: str) -> tuple[Callable[..., torch.Tensor], list[int]]:
    """A stand-in for ``_placement.fetch`` (an offloaded tensor's copy to its site's device) that clones, as a copy
    to a GPU would (on a CPU model the real copy is ``t`` itself), and raises ``FAILURES[failure]`` at the ``n``-th
    copy; with the list counting the copies asked for."""
    calls = [0]

    def fetch(t: torch.Tensor, device: torch.device) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == n:
            raise FAILURES[failure]()
        return t.detach().clone().requires_grad_(t.requires_grad)

    return fetch, calls


def snapshot(*roots: torch.nn.Module, ids: bool = True) -> list:
    """Everything an interrupted workflow could leave changed on ``roots`` (compared with ``==``): per module its
    name, type, identity, mode, hooks and instance attributes; per parameter / buffer its identity, dtype, device,
    ``requires_grad``, whether it holds a ``.grad``, and its bytes (``ids=False``: not the identities, to compare
    two copies)."""
    out: list = []
    for root in roots:
        for name, m in root.named_modules():
            out.append((name, type(m).__name__, id(m) if ids else None, m.training,
                        tuple(len(getattr(m, d, {})) for d in _HOOK_DICTS), tuple(sorted(vars(m)))))
        for name, t in [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]:
            out.append((name, id(t) if ids else None, t.dtype, t.device, t.requires_grad, t.grad is None,
                        t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()))
    return out


@contextlib.contextmanager
def failing_at(module: torch.nn.Module, n: int, failure: str) -> Iterator[list[int]]:
    """``module``'s ``n``-th forward call (1-based) raises ``FAILURES[failure]()``; yields the call counter. The
    hook is removed on leaving."""
    calls = [0]

    def hook(mod, args):
        calls[0] += 1
        if calls[0] == n:
            raise FAILURES[failure]()

    handle = module.register_forward_pre_hook(hook)
    try:
        yield calls
    finally:
        handle.remove()


@functools.cache
def world() -> SimpleNamespace:
    """The attribution tests' tiny Llama: a Lorsa on layer 1, transcoders on layers 0 and 2 (skip)."""
    model, hf, lorsas, tcs = attribution_setup("llama")
    return SimpleNamespace(model=model, hf=hf, lorsas=lorsas, tcs=tcs, rm=rm(model, lorsas, tcs),
                           replacements=[*lorsas.values(), *tcs.values()])


@torch.no_grad()
def plain_logits(w: SimpleNamespace, ids: torch.Tensor) -> torch.Tensor:
    with w.model.trace(ids):
        logits = nnsight.save(unembed(w.model).output)
    return logits


def injection_sites(w: SimpleNamespace) -> dict[str, torch.nn.Module]:
    hf = w.hf
    sites = {f"layer{i}.{part}": getattr(hf.model.layers[i], part) for i in range(len(hf.model.layers))
             for part in ("self_attn", "mlp")}
    sites.update({f"layer{i}.input_layernorm": hf.model.layers[i].input_layernorm for i in range(len(hf.model.layers))})
    sites["lm_head"] = hf.lm_head
    sites.update({f"lorsa{k}": m for k, m in w.lorsas.items()})
    sites.update({f"transcoder{k}": m for k, m in w.tcs.items()})
    return sites


def same(a, b) -> bool:
    """Results compared exactly (tensors bit for bit, NaN equal to NaN), through dataclasses, dicts and sequences."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and bool(
            torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                  and torch.equal(a.nan_to_num(), b.nan_to_num())))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "__dict__") and not isinstance(a, torch.nn.Module):
        return type(a) is type(b) and same(vars(a), vars(b))
    return a == b


def check_interrupted(w: SimpleNamespace, run: Callable[[], object], site: str, n: int, failure: str,
                      expected: object = None) -> None:
    """Run ``run`` with ``site``'s call ``n`` failing (``n`` beyond the calls made: no failure, the result must be
    ``expected``), then check the model, a plain trace and a re-run."""
    ids = random_ids(batch=1, seq=7, seed=11)
    before, logits = snapshot(w.hf, *w.replacements), plain_logits(w, ids)
    with failing_at(injection_sites(w)[site], n, failure) as calls:
        try:
            result = run()
        except BaseException as e:  # noqa: BLE001 — we inspect what came out
            raised: BaseException | None = e
        else:
            raised = None
    if calls[0] >= n:
        assert raised is not None, f"{site} call {n} failed ({failure}) but the workflow returned"
        chain, c = [], raised
        while c is not None:
            chain.append(c)
            c = c.__cause__ or c.__context__
        assert any(type(c) is type(FAILURES[failure]()) for c in chain), f"{site}#{n}: {raised!r}"
    else:
        assert raised is None, f"no failure injected, yet {raised!r}"
        assert same(result, expected)
    assert snapshot(w.hf, *w.replacements) == before, f"{site}#{n} {failure}: the model or a module changed"
    assert torch.equal(plain_logits(w, ids), logits)
    if expected is not None:
        assert same(run(), expected), "the re-run after the interruption differs from an uninterrupted run"


# ------------------------------------------------------------------ workflows
IDS = random_ids(batch=2, seq=8, seed=4)


TASK = TaskBatch("probe", IDS, IDS.flip(1), torch.tensor([3, 4]), torch.tensor([5, 6]))
TARGETS = [LorsaHead(1, 3), MHSAHead(0, 1), (LorsaHead(1, 0), MHSAHead(2, 1))]
METRIC = dict(correct_ids=5, incorrect_ids=6)


def wf_attribute(w, memory: str = "auto", offload: bool = False, qk_heads: int = 0, prune: bool = False):
    kw: dict = {"batch_size": 16, "memory": memory, "qk_heads": qk_heads}
    if prune:
        kw["prune"] = (0.8, 0.98)
    if not offload:
        return attribute(w.rm, IDS[0], **kw)
    w.rm.lorsas.offload = w.rm.transcoders.offload = True
    try:
        return attribute(w.rm, IDS[0], **kw)
    finally:
        w.rm.lorsas.offload = w.rm.transcoders.offload = False


WORKFLOWS: dict[str, Callable] = {
    "attribute-auto": lambda w: wf_attribute(w),
    "attribute-fast": lambda w: wf_attribute(w, "fast"),
    "attribute-lean": lambda w: wf_attribute(w, "lean"),
    "attribute-qk": lambda w: wf_attribute(w, qk_heads=2),
    "attribute-prune": lambda w: wf_attribute(w, prune=True),
    "attribute-offload": lambda w: wf_attribute(w, "lean", offload=True),
    "estimate_memory": lambda w: estimate_memory(w.rm, IDS[0], batch_size=16),
    "for_remote": lambda w: [(name, [(k, m.state_dict()) for k, m in held.items()])
                             for name, held in for_remote(w.rm, dtype=torch.float64).sets()],
    "activation_patching": lambda w: activation_patching(w.rm, IDS, IDS.flip(1), TARGETS, groups_per_trace=2,
                                                         **METRIC),
    "ablation_effect": lambda w: ablation_effect(w.rm, IDS, TARGETS[:2], **METRIC),
    "random_ablation_control": lambda w: random_ablation_control(
        w.rm, IDS, [LorsaHead(1, h) for h in range(6)], 2, n_samples=3, **METRIC),
    "path_patching": lambda w: path_patching(w.rm, IDS, TARGETS[:2], corrupt=IDS.flip(1), groups_per_trace=1,
                                             **METRIC),
    "head_swap": lambda w: head_swap(w.rm, 1, 3, 4, IDS),
    "mean_activations": lambda w: mean_activations(w.rm, TARGETS[:2], IDS),
    "component_scores": lambda w: component_scores(w.rm, TASK, TARGETS[:2], per_trace=1),
    "circuit_size": lambda w: circuit_size(w.rm, TASK, TARGETS[:2], ks=[1, 2]),
    "evaluate": lambda w: evaluate(w.rm.lorsas, TokenDataset(random_ids(batch=6, seq=8, seed=2)), batch_size=2),
    "mhsa_correlation": lambda w: mhsa_correlation(w.rm, 1, random_ids(batch=4, seq=8, seed=2), batch_size=2),
    "collect_top_activations": lambda w: collect_top_activations(w.rm, 1, random_ids(batch=4, seq=8, seed=2),
                                                                 batch_size=2),
}


@functools.cache
def uninterrupted(name: str) -> object:
    return WORKFLOWS[name](world())


@generated(6, 200, name=st.sampled_from(sorted(WORKFLOWS)), site=st.sampled_from(sorted(injection_sites(world()))),
           n=st.integers(1, 9), failure=st.sampled_from(sorted(FAILURES)))
def test_an_interrupted_workflow_leaves_the_model_as_it_was(name, site, n, failure):
    w = world()
    check_interrupted(w, lambda: WORKFLOWS[name](w), site, n, failure, uninterrupted(name))


# ------------------------------------------------------------------ offload: a copy to the device that fails
OFFLOADED = {
    "attribute": lambda w: attribute(w.rm, IDS[0], batch_size=16, memory="lean"),
    "ablation_effect": lambda w: ablation_effect(w.rm, IDS, TARGETS[:2], **METRIC),
    "evaluate": lambda w: evaluate(w.rm.lorsas, TokenDataset(random_ids(batch=6, seq=8, seed=2)), batch_size=2),
}


@contextlib.contextmanager
def offloaded(w: SimpleNamespace) -> Iterator[None]:
    w.rm.lorsas.offload = w.rm.transcoders.offload = True
    try:
        yield
    finally:
        w.rm.lorsas.offload = w.rm.transcoders.offload = False


@generated(3, 60, name=st.sampled_from(sorted(OFFLOADED)), n=st.integers(1, 40),
           failure=st.sampled_from(sorted(FAILURES)))
def test_a_failed_copy_of_an_offloaded_module_puts_every_tensor_back(name, n, failure):
    """An offloaded module's tensors are copied to the site's device one by one (``_placement.fetch``; on a CPU
    model the copy is ``t`` itself, so the stand-in clones, as a copy to a GPU would): the N-th copy fails (a CUDA
    OOM while copying the weights in) and every parameter and buffer must still be the host tensor it was."""
    from nnsight_lorsa import _placement

    w = world()
    fetch, calls = failing_fetch(n, failure)
    with offloaded(w):
        expected = OFFLOADED[name](w)
        before = snapshot(w.hf, *w.replacements)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_placement, "fetch", fetch)
            with contextlib.suppress(type(FAILURES[failure]())):
                OFFLOADED[name](w)
        assert snapshot(w.hf, *w.replacements) == before, f"copy {n} of {calls[0]} failed: a module kept copies"
        assert same(OFFLOADED[name](w), expected)


# ------------------------------------------------------------------ sparse attention: evaluation
@functools.cache
def gated_world() -> SimpleNamespace:
    from helpers import tiny_hf_model

    from nnsight_lorsa.sparse_attention import install_gated_attention
    from nnsight_lorsa.sparse_attention.train import SparseAttentionTrainer, SparseTrainConfig

    hf = tiny_hf_model("llama")
    install_gated_attention(hf, init_bias=1.0)
    stream = torch.randint(3, 128, (400,), generator=torch.Generator().manual_seed(0))  # no EOS (2): one text
    cfg = SparseTrainConfig(total_steps=4, batch_size=4, seq_len=16, init_bias=1.0, target_batches=2)
    return SimpleNamespace(hf=hf, stream=stream, trainer=SparseAttentionTrainer(hf, stream, cfg))


SPARSE_EVALS = {
    "evaluate_sparse": lambda g: __import__("nnsight_lorsa.sparse_attention.train", fromlist=["x"]).evaluate_sparse(
        g.hf, g.stream, seq_len=16, batch_size=4, max_windows=12),
    "measure_train_ce": lambda g: g.trainer.measure_train_ce(3),
}


@generated(3, 60, name=st.sampled_from(sorted(SPARSE_EVALS)), layer=st.integers(0, 2), n=st.integers(1, 3),
           failure=st.sampled_from(sorted(FAILURES)), training=st.booleans())
def test_an_interrupted_sparse_evaluation_keeps_the_mode(name, layer, n, failure, training):
    """``evaluate_sparse`` and ``SparseAttentionTrainer.measure_train_ce`` switch the model to eval mode for the
    deterministic gates: a failure in the N-th forward of a drawn layer must leave the model in the mode (and the
    gates as) it was, and a re-run give the same numbers."""
    g = gated_world()
    g.hf.train(training)
    expected = SPARSE_EVALS[name](g)
    before = snapshot(g.hf)
    layers = g.hf.model.layers
    with failing_at(layers[layer % len(layers)], n, failure) as calls, contextlib.suppress(type(FAILURES[failure]())):
        SPARSE_EVALS[name](g)
    assert calls[0] >= n
    assert snapshot(g.hf) == before, f"{name}: the model's mode (or a gate) changed after a failure"
    assert SPARSE_EVALS[name](g) == expected


# ------------------------------------------------------------------ training: a step that fails part-way
TRAIN_POINTS = ("source", "forward", "backward", "clip")


def make_trainer(kind: str, batches: list):
    """A fp64 BatchTopK SAE (threshold estimated in the forward) or a Lorsa (AuxK, k annealed from 4), with AuxK
    against latents dead after 6 tokens."""
    from nnsight_lorsa.modules.lorsa import Lorsa
    from nnsight_lorsa.modules.lorsa_config import LorsaConfig
    from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
    from nnsight_lorsa.training import LorsaObjective, LorsaRecipe, TrainConfig, Trainer

    torch.manual_seed(0)
    cfg = TrainConfig(total_steps=6, lr=1e-2, norm_batches=1, aux_k=4, aux_k_coef=0.5, dead_after_tokens=6,
                      log_every=1, warmup_frac=0.0, sparse_kernels=False)
    if kind == "sae":
        sae = SparseAutoencoder(SAEConfig(d_in=8, d_sae=24, activation="batchtopk", activation_params={"k": 3}))
        return Trainer(sae.double(), batches.__getitem__, cfg), sae.activation
    lorsa = Lorsa(LorsaConfig(d_model=8, n_qk_heads=2, d_qk_head=2, n_ov_heads=8, top_k=2)).double()
    recipe = LorsaRecipe(ov_init="random", center_b_v=False, scale_init=False, b_d_init=False, k_anneal_from=4)
    return Trainer(LorsaObjective(lorsa, recipe=recipe), batches.__getitem__, cfg), lorsa.hook_v


def trainer_state(trainer) -> list:
    # a ``.grad`` is not state: the next step sets it anew (``zero_grad(set_to_none=True)`` first)
    module = [e[:5] + e[6:] if len(e) == 7 else e for e in snapshot(trainer.module, ids=False)]
    return [trainer.step, module, trainer.tokens_since_fired.clone().tolist(),
            [(k, [(n, v.clone() if isinstance(v, torch.Tensor) else v) for n, v in sorted(s.items())])
             for k, s in sorted(trainer.optimizer.state_dict()["state"].items())]]


def same_state(a: list, b: list) -> bool:
    return a[:3] == b[:3] and same(a[3], b[3])


@generated(3, 60, kind=st.sampled_from(["sae", "lorsa"]), step=st.integers(0, 5),
           point=st.sampled_from(TRAIN_POINTS), failure=st.sampled_from(sorted(FAILURES)))
def test_a_failed_training_step_is_as_if_it_never_ran(kind, step, point, failure):
    """A ``Trainer`` step of a BatchTopK SAE (its threshold estimated in the forward, AuxK against dead latents) or
    of a Lorsa (AuxK, k annealed) fails at a drawn point (getting its batch, in the forward — after the SAE's
    threshold update —, in the backward, clipping the gradients before the optimizer's update): the trainer is left
    as after the step before, and running on gives the uninterrupted run's weights, Adam state and dead counters bit
    for bit."""
    from nnsight_lorsa.training.activations import Batch

    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 5, 8, generator=g, dtype=torch.float64) for _ in range(6)]
    real = torch.ones(2, 5, dtype=torch.bool)
    if kind == "sae":
        batches = [Batch(x, x, real) for x in xs]
    else:
        batches = [Batch(x, x.flip(-1).tanh(), real, torch.arange(5), real.long()) for x in xs]
    straight = make_trainer(kind, batches)[0]
    for _ in range(6):
        straight.train_step()
    expected = trainer_state(straight)

    trainer, forward_module = make_trainer(kind, batches)
    for _ in range(step):
        trainer.train_step()
    before = trainer_state(trainer)
    fail = fail_once(failure)

    handles = []
    if point == "source":
        source = trainer.source
        trainer.source = lambda i: (fail(), source(i))[1]
    elif point == "forward":
        handles.append(forward_module.register_forward_hook(lambda *a: fail()))
    elif point == "backward":
        first = next(trainer.module.parameters())
        handles.append(first.register_post_accumulate_grad_hook(lambda p: fail()))
    patches = pytest.MonkeyPatch()
    if point == "clip":
        clip = torch.nn.utils.clip_grads_with_norm_
        patches.setattr(torch.nn.utils, "clip_grads_with_norm_", lambda *a, **k: (fail(), clip(*a, **k))[1])
    try:
        with pytest.raises(type(FAILURES[failure]())):
            trainer.train_step()
    finally:
        patches.undo()
    for h in handles:
        h.remove()
    if point == "source":
        trainer.source = source
    after = trainer_state(trainer)
    assert same_state(after, before), f"step {step} failed at {point}: the trainer is not as after step {step - 1}"
    while trainer.step < 6:
        trainer.train_step()
    assert same_state(trainer_state(trainer), expected), "the run went on from a failed step with another state"


# ------------------------------------------------------------------ activation caches
@generated(2, 40, site=st.sampled_from(["layer0.mlp", "layer1.self_attn", "layer2.mlp"]),
           n=st.integers(1, 4), failure=st.sampled_from(sorted(FAILURES)))
def test_an_interrupted_activation_cache_leaves_no_directory(site, n, failure, tmp_path_factory):
    """``write_activation_cache`` failing in the N-th batch's forward: no cache directory (nor a temporary beside
    it), the model as it was, and the re-run writes the uninterrupted run's shards byte for byte."""
    from nnsight_lorsa import get_adapter
    from nnsight_lorsa.training.activation_cache import write_activation_cache
    from nnsight_lorsa.training.activations import Site

    w = world()
    adapter = get_adapter(w.model)
    sites = [Site.mlp_input(adapter, 1), Site.mlp_output(adapter, 2)]
    data = TokenDataset(random_ids(batch=8, seq=6, seed=9))
    root = tmp_path_factory.mktemp("cache")

    def run(name: str):
        return write_activation_cache(w.model, sites, data, root / name, batch_size=2, windows_per_shard=3)

    reference = run("straight")
    before, ids = snapshot(w.hf, *w.replacements), random_ids(batch=1, seq=7, seed=11)
    logits = plain_logits(w, ids)
    with failing_at(injection_sites(w)[site], n, failure) as calls, pytest.raises(type(FAILURES[failure]())):
        run("cut")
    assert calls[0] >= n
    assert sorted(p.name for p in root.iterdir()) == ["straight"], "an interrupted cache left files"
    assert snapshot(w.hf, *w.replacements) == before
    assert torch.equal(plain_logits(w, ids), logits)
    run("cut")
    for f in sorted((root / "straight").iterdir()):
        if f.suffix == ".safetensors":
            assert f.read_bytes() == (root / "cut" / f.name).read_bytes(), f.name
    assert reference.n_windows == len(data)


# ------------------------------------------------------------------ sparse attention: a training step that fails
def sparse_trainer():
    from helpers import tiny_hf_model

    from nnsight_lorsa.sparse_attention.train import SparseAttentionTrainer, SparseTrainConfig

    stream = torch.randint(3, 128, (400,), generator=torch.Generator().manual_seed(0))  # no EOS (2): one text
    torch.manual_seed(0)  # the gates' noise
    cfg = SparseTrainConfig(total_steps=4, batch_size=4, seq_len=16, init_bias=1.0, target_batches=1)
    return SparseAttentionTrainer(tiny_hf_model("llama"), stream, cfg)


@functools.cache
def sparse_straight() -> tuple:
    trainer = sparse_trainer()
    trainer.train(4, progress=False)
    return [r.ce for r in trainer.history], [p.detach().clone() for p in trainer.hf.parameters()]


@generated(2, 30, step=st.integers(0, 3), point=st.sampled_from(["batch", "forward", "backward"]),
           layer=st.integers(0, 2), failure=st.sampled_from(sorted(FAILURES)))
def test_a_failed_sparse_training_step_is_as_if_it_never_ran(step, point, layer, failure):
    """``SparseAttentionTrainer.train_step`` failing at a drawn point before the update (drawing its windows, in a
    drawn layer's forward, in the backward): running on gives the uninterrupted run's CEs and weights bit for bit
    (the stream windows and the gates' noise are drawn again as the failed step drew them)."""
    trainer = sparse_trainer()
    trainer.train(step, progress=False)
    fail = fail_once(failure)

    handles = []
    if point == "batch":
        draw = trainer._batch
        trainer._batch = lambda *a: (fail(), draw(*a))[1]
    elif point == "forward":
        handles.append(trainer.hf.model.layers[layer].register_forward_pre_hook(fail))
    else:
        handles.append(trainer.hf.model.layers[layer].self_attn.q_proj.weight.register_post_accumulate_grad_hook(fail))
    with pytest.raises(type(FAILURES[failure]())):
        trainer.train_step()
    for h in handles:
        h.remove()
    if point == "batch":
        del trainer._batch
    assert trainer.step == step
    trainer.train(4 - step, progress=False)
    ces, params = sparse_straight()
    assert [r.ce for r in trainer.history] == ces
    assert all(torch.equal(p, q) for p, q in zip(trainer.hf.parameters(), params, strict=True))
