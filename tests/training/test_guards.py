"""Training's guards (issue 23): every ``TrainConfig`` field is validated at construction; a non-finite loss,
gradient, learning rate or scale factor stops training with :class:`NonFiniteError` naming the step and the
tensor, the trainer left bit-equal to the state after the last good step; too few counted tokens stop it
before the first step with :class:`TooFewTokensError`; ``TokenDataset`` refuses ids that are not token ids.

The config properties use hypothesis. They build configs through the dataclass's own ``__init__`` unwrapped
from the test-time type-checking hook (``tests/conftest.py``), so that wrongly typed values reach our checks
as they do for a user, not beartype's.
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnsight_lorsa.errors import ArgumentError, NonFiniteError, TooFewTokensError
from nnsight_lorsa.modules.clt import CLTConfig, CrossLayerTranscoder
from nnsight_lorsa.modules.lorsa import Lorsa
from nnsight_lorsa.modules.lorsa_config import LorsaConfig
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
from nnsight_lorsa.training import LorsaObjective, LorsaRecipe, TokenDataset, TrainConfig, Trainer
from nnsight_lorsa.training.activations import Batch

NAN, INF = float("nan"), float("inf")


def construct(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``cls(*args, **kwargs)`` through its own ``__init__`` (without the test-time type-checking wrapper)."""
    obj = cls.__new__(cls)
    inspect.unwrap(cls.__init__)(obj, *args, **kwargs)
    return obj


# --------------------------------------------------------------------------- TrainConfig: property tests
INT_FIELDS = ("total_steps", "norm_batches", "log_every", "dead_after_tokens")
NONNEG_FIELDS = ("grad_clip", "aux_k_coef", "l1_coef", "l0_coef")
finite = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
small_int = st.integers(min_value=1, max_value=10**9)
# the independent oracle: per field, values that must be accepted and values that must be refused
BAD_INT = st.sampled_from([0, -1, -5, 2.5, 3.0, True, False, None, "3", NAN, 10**9 + 0.5]) | st.integers(max_value=0)
BAD_REAL = st.sampled_from([NAN, INF, -INF, True, False, None, "0.1", [0.1]])
VALID = {
    **{name: small_int for name in INT_FIELDS},
    "aux_k": st.none() | small_int,
    "lr": st.floats(min_value=1e-12, max_value=1e6) | st.integers(min_value=1, max_value=100),
    "betas": st.tuples(st.floats(0.0, 0.999999), st.floats(0.0, 0.999999)),
    **{name: finite | st.integers(min_value=0, max_value=1000) for name in NONNEG_FIELDS},
    "decay_to": st.floats(0.0, 1.0) | st.sampled_from([0, 1]),
    "normalize_decoder": st.sampled_from([None, True, False]),
    "sparse_kernels": st.booleans(),
    "master_weights": st.booleans(),
    **{name: st.none() | st.text(min_size=1).filter(str.strip) for name in ("wandb_project", "wandb_run_name")},
}
INVALID = {
    **{name: BAD_INT for name in INT_FIELDS},
    "aux_k": BAD_INT.filter(lambda v: v is not None),
    "lr": BAD_REAL | st.floats(max_value=0.0, allow_nan=False),
    "betas": st.sampled_from([(1.0, 0.9), (0.9, 1.0), (-0.1, 0.9), (0.9, NAN), (0.9,), (0.9, 0.99, 0.5), "ab",
                              (True, 0.9), None, 0.9]),
    **{name: BAD_REAL | st.floats(max_value=-1e-9, allow_nan=False) for name in NONNEG_FIELDS},
    "warmup_frac": BAD_REAL | st.floats(min_value=1.0 + 1e-9, allow_nan=False) | st.floats(max_value=-1e-9),
    "decay_frac": BAD_REAL | st.floats(min_value=1.0 + 1e-9, allow_nan=False) | st.floats(max_value=-1e-9),
    "decay_to": BAD_REAL | st.floats(min_value=1.0 + 1e-9, allow_nan=False) | st.floats(max_value=-1e-9),
    "normalize_decoder": st.sampled_from([1, 0, "yes", 1.0]),
    "sparse_kernels": st.sampled_from([1, 0, None, "no"]),
    "master_weights": st.sampled_from([1, 0, None, "no", 1.0]),
    **{name: st.sampled_from(["", " \n", 3, b"p", True, ["p"]]) for name in ("wandb_project", "wandb_run_name")},
}


@st.composite
def valid_configs(draw: Any) -> dict[str, Any]:
    cfg = {name: draw(s) for name, s in VALID.items()}
    warmup = draw(st.floats(0.0, 1.0))
    cfg["warmup_frac"], cfg["decay_frac"] = warmup, draw(st.floats(0.0, 1.0 - warmup))
    return cfg


@settings(max_examples=300, deadline=None)
@given(valid_configs())
def test_every_valid_config_constructs(cfg):
    got = construct(TrainConfig, **cfg)
    for name, value in cfg.items():
        assert getattr(got, name) == value
    Trainer(SparseAutoencoder(SAEConfig(d_in=4, d_sae=8, activation="relu")), lambda i: None, got)  # accepted again


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_configs(), st.data())
def test_every_invalid_field_raises_naming_field_and_value(cfg, data):
    name = data.draw(st.sampled_from(sorted(INVALID)))
    bad = data.draw(INVALID[name])
    cfg[name] = bad
    if name in ("warmup_frac", "decay_frac"):  # keep the other one at 0: only this field is wrong
        cfg["decay_frac" if name == "warmup_frac" else "warmup_frac"] = 0.0
    with pytest.raises(ArgumentError) as info:
        construct(TrainConfig, **cfg)
    msg = str(info.value)
    assert f"TrainConfig.{name}" in msg, msg
    shown = [bad] if name != "betas" or not isinstance(bad, tuple) or len(bad) != 2 else list(bad)
    assert any(repr(v) in msg for v in shown), msg


@settings(max_examples=200, deadline=None)
@given(valid_configs(), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_warmup_and_decay_may_not_exceed_the_run(cfg, warmup, decay):
    cfg["warmup_frac"], cfg["decay_frac"] = warmup, decay
    if warmup + decay <= 1:
        construct(TrainConfig, **cfg)
        return
    with pytest.raises(ArgumentError, match=r"warmup_frac \+ decay_frac.*warmup_frac=.*decay_frac="):
        construct(TrainConfig, **cfg)


@pytest.mark.parametrize(("field", "value"), [
    ("total_steps", 0), ("total_steps", -5), ("total_steps", 2.5), ("total_steps", True), ("warmup_frac", 2),
    ("grad_clip", -1), ("aux_k", 0), ("dead_after_tokens", -1), ("norm_batches", 0), ("log_every", 0),
    ("lr", INF), ("lr", NAN), ("lr", 0),
])
def test_the_reported_configs_are_refused(field, value):
    """The values issue 23's probe found accepted (or crashing later with UnboundLocalError / ZeroDivisionError)."""
    kwargs = {"total_steps": 10, field: value}
    with pytest.raises(ArgumentError, match=rf"TrainConfig\.{field}\b.*{re.escape(repr(value))}"):
        construct(TrainConfig, **kwargs)


_UP, _DOWN = math.nextafter(1.0, 2.0), math.nextafter(1.0, 0.0)
_TINY = math.nextafter(0.0, 1.0)
#: each range's edges, one ulp either side (the drawn values above reach them only by chance)
EDGES = [
    ("lr", _TINY, True), ("lr", 0.0, False), ("lr", -_TINY, False), ("lr", 1e308, True),
    ("betas", (0.0, 0.0), True), ("betas", (_DOWN, _DOWN), True), ("betas", (1.0, 0.5), False),
    ("betas", (0.5, 1.0), False), ("betas", (-_TINY, 0.5), False),
    ("grad_clip", 0.0, True), ("grad_clip", -_TINY, False), ("aux_k_coef", 0, True), ("l1_coef", -_TINY, False),
    ("decay_to", 0.0, True), ("decay_to", 1.0, True), ("decay_to", _UP, False), ("decay_to", -_TINY, False),
    ("warmup_frac", 1.0, True), ("warmup_frac", _UP, False), ("warmup_frac", -_TINY, False),
    ("decay_frac", 1.0, True), ("decay_frac", _UP, False),
    (("warmup_frac", "decay_frac"), (0.25, 0.75), True), (("warmup_frac", "decay_frac"), (0.5, 0.5), True),
    (("warmup_frac", "decay_frac"), (0.5, _UP - 0.5), False),  # the sum is 1 + 1 ulp
    # the rule is on the floating sum: these round to exactly 1 (and the step counts, floors of the products, fit)
    (("warmup_frac", "decay_frac"), (0.5, math.nextafter(0.5, 1.0)), True),
    (("warmup_frac", "decay_frac"), (_TINY, 1.0), True),
    ("total_steps", 1, True), ("norm_batches", 1, True), ("dead_after_tokens", 1, True), ("log_every", 1, True),
    ("aux_k", 1, True), ("aux_k", 0, False),
]


@pytest.mark.parametrize(("field", "value", "ok"), EDGES, ids=[f"{f}={v!r}" for f, v, _ in EDGES])
def test_each_range_edge_is_accepted_or_refused_as_documented(field, value, ok):
    """The documented ranges (``TrainConfig.validate``) at their edges: ``lr > 0``, ``betas`` in ``[0, 1)``, the
    non-negative coefficients, ``decay_to`` / ``warmup_frac`` / ``decay_frac`` in ``[0, 1]`` with
    ``warmup_frac + decay_frac <= 1``, the counts ``>= 1``."""
    kwargs: dict[str, Any] = {"total_steps": 10, "warmup_frac": 0.0, "decay_frac": 0.0}
    kwargs.update(dict(zip(field, value, strict=True)) if isinstance(field, tuple) else {field: value})
    if ok:
        got = construct(TrainConfig, **kwargs)
        for name, v in kwargs.items():
            assert getattr(got, name) == v
    else:
        with pytest.raises(ArgumentError, match=r"TrainConfig\."):
            construct(TrainConfig, **kwargs)


def test_a_field_set_after_construction_is_refused_by_the_trainer():
    cfg = TrainConfig(total_steps=4)
    cfg.lr = INF
    with pytest.raises(ArgumentError, match="TrainConfig.lr"):
        Trainer(SparseAutoencoder(SAEConfig(d_in=4, d_sae=8, activation="relu")), lambda i: None, cfg)


# --------------------------------------------------------------------------- injected non-finite values
D, N_LAT = 16, 64


def make_source(bad_step: int | None = None, value: float = NAN, all_masked: bool = False, stacked: int = 0):
    """Batch ``i``: 4 windows x 8 positions of seeded activations; batch ``bad_step`` holds ``value`` at one
    entry (or counts no token with ``all_masked``). ``stacked``: a CLT's ``(n_layers, …)`` batches."""
    def source(i: int) -> Batch:
        g = torch.Generator().manual_seed(100 + i)
        shape = (stacked, 4, 8, D) if stacked else (4, 8, D)
        x = torch.randn(*shape, generator=g)
        y = torch.tanh(x) + 0.1 * torch.randn(*shape, generator=g)
        mask = torch.ones(4, 8, dtype=torch.bool)
        mask[:, 0] = False
        if i == bad_step:
            if all_masked:
                mask[:] = False
            else:
                x[(0, 1, 2, 3) if stacked else (1, 2, 3)] = value
        return Batch(x=x, y=y, loss_mask=mask)
    return source


def make_module(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "sae":
        return SparseAutoencoder(SAEConfig(d_in=D, d_sae=N_LAT, activation="topk", activation_params={"k": 4}))
    if kind == "clt":
        return CrossLayerTranscoder(CLTConfig(n_layers=2, d_in=D, d_sae=32, activation="relu"))
    return Lorsa(LorsaConfig(d_model=D, n_qk_heads=2, d_qk_head=4, n_ov_heads=N_LAT, top_k=4))


KINDS = ("sae", "lorsa", "lorsa-balance", "clt")


def make_trainer(kind: str, source: Any, **config: Any) -> Trainer:
    cfg = {"total_steps": 8, "lr": 1e-2, "norm_batches": 2, "dead_after_tokens": 40, "log_every": 1, **config}
    recipe = LorsaRecipe(dead_remedy="balance") if kind == "lorsa-balance" else None
    module = make_module(kind.split("-")[0])
    return Trainer(module if recipe is None else LorsaObjective(module, recipe=recipe), source, TrainConfig(**cfg))


def stacked(kind: str) -> int:
    return 2 if kind == "clt" else 0


def snapshot(t: Trainer) -> dict[str, Any]:
    """Everything a step changes: weights, Adam state, dead counters, step, LR, history, balancing gains."""
    out: dict[str, Any] = {f"w.{k}": v.detach().clone() for k, v in t.module.state_dict().items()}
    names = {id(p): n for n, p in t.module.named_parameters()}
    for p, st_ in t.optimizer.state.items():
        for key, value in st_.items():
            out[f"adam.{names[id(p)]}.{key}"] = value.clone() if isinstance(value, torch.Tensor) else value
    out["tokens_since_fired"] = t.tokens_since_fired.clone()
    out["step"], out["lr"] = t.step, [g["lr"] for g in t.optimizer.param_groups]
    out["history"] = [dict(h) for h in t.history]
    out["s"] = (t.s_in, t.s_out, t.s_in_layers, t.s_out_layers)
    balance = getattr(t.objective, "balance", None)
    if balance is not None:
        out["balance"] = balance.log_gain.clone()
    return out


def assert_bit_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys(), set(got) ^ set(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def reference(kind: str, steps: int, **config: Any) -> Trainer:
    """A clean run of ``steps`` steps: the state a failure at step ``steps`` must leave."""
    t = make_trainer(kind, make_source(stacked=stacked(kind)), **config)
    t.train(steps, progress=False)
    return t


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
def test_a_non_finite_batch_stops_at_its_step_with_the_last_good_state(kind, value):
    k = 3
    t = make_trainer(kind, make_source(k, value, stacked=stacked(kind)))
    with pytest.raises(NonFiniteError) as info:
        t.train(progress=False)
    e = info.value
    assert e.step == k and e.tensor == "batch.x", str(e)
    assert f"step {k}:" in str(e) and f"batch {k}'s x holds 1 non-finite values" in str(e)
    assert "\n" not in str(e)
    want = reference(kind, k)
    assert_bit_equal(snapshot(t), snapshot(want))
    # nothing is lost: with the data fixed the run goes on exactly as one that never failed
    t.source = make_source(stacked=stacked(kind))
    want.train(progress=False)
    t.train(progress=False)
    assert_bit_equal(snapshot(t), snapshot(want))


@pytest.mark.parametrize("kind", KINDS)
def test_an_infinite_learning_rate_stops_before_the_step(kind):
    k = 2
    t = make_trainer(kind, make_source(stacked=stacked(kind)))
    t.train(k, progress=False)
    t.optimizer.param_groups[0]["lr"] = INF  # lr=inf reaching the optimizer (TrainConfig refuses it)
    with pytest.raises(NonFiniteError, match=rf"step {k}: the learning rate is inf") as info:
        t.train(progress=False)
    assert info.value.step == k and info.value.tensor == "lr"
    got = snapshot(t)
    got["lr"] = None
    want = snapshot(reference(kind, k))
    want["lr"] = None
    assert_bit_equal(got, want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("grad_clip", [1.0, 0.0], ids=["clipped", "unclipped"])
def test_a_nan_gradient_stops_before_the_step(kind, grad_clip):
    k = 4
    t = make_trainer(kind, make_source(stacked=stacked(kind)), grad_clip=grad_clip)
    t.train(k, progress=False)
    name, param = next(iter(t.module.named_parameters()))
    hook = param.register_hook(lambda g: g * NAN)
    with pytest.raises(NonFiniteError, match=rf"step {k}: the gradient norm is nan \({name}\.grad holds") as info:
        t.train(progress=False)
    assert info.value.step == k and info.value.tensor == f"{name}.grad"
    assert all(p.grad is None for p in t.module.parameters())
    want = reference(kind, k, grad_clip=grad_clip)
    assert_bit_equal(snapshot(t), snapshot(want))
    hook.remove()
    want.train(progress=False)
    t.train(progress=False)
    assert_bit_equal(snapshot(t), snapshot(want))


def test_a_huge_lr_stops_at_the_first_non_finite_loss_and_names_the_weights():
    """lr=1e30 is finite (accepted); its first update overflows the weights, and the next loss names them."""
    t = make_trainer("sae", make_source(), lr=1e30, warmup_frac=0.0)
    with pytest.raises(NonFiniteError, match=r"step \d+: the (loss|gradient norm) is") as info:
        t.train(progress=False)
    assert info.value.step is not None and info.value.step <= 2


def test_a_checkpoint_directory_keeps_the_last_good_checkpoint(tmp_path):
    d = tmp_path / "ckpt"
    t = make_trainer("sae", make_source(5))
    with pytest.raises(NonFiniteError):
        t.train(progress=False, checkpoint_dir=d, checkpoint_every=2)
    resumed = Trainer.resume(d, make_source())
    assert resumed.step == 4
    want = reference("sae", 4)
    assert_bit_equal(snapshot(resumed), snapshot(want))
    # the in-memory state (after step 4, the failure at 5) saves as well: nothing is lost
    t.save_checkpoint(d)
    assert Trainer.resume(d, make_source()).step == 5


def test_save_checkpoint_refuses_non_finite_weights_and_keeps_the_old_checkpoint(tmp_path):
    d = tmp_path / "ckpt"
    t = make_trainer("sae", make_source())
    t.train(2, progress=False)
    t.save_checkpoint(d)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    with torch.no_grad():
        t.module.W_dec[0, 0] = NAN
    with pytest.raises(NonFiniteError, match="W_dec hold non-finite values: not saved") as info:
        t.save_checkpoint(d)
    assert info.value.tensor == "W_dec"
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before


# --------------------------------------------------------------------------- scale factors, minimum tokens
@pytest.mark.parametrize("kind", KINDS)
def test_non_finite_or_zero_activations_give_a_named_scale_factor(kind):
    clean = make_source(stacked=stacked(kind))

    def zeros(i: int) -> Batch:
        b = clean(i)
        return Batch(x=b.x * 0, y=b.y, loss_mask=b.loss_mask)

    for bad in (make_source(1, NAN, stacked=stacked(kind)), zeros):  # a NaN in a norm batch; all-zero inputs
        t = make_trainer(kind, bad)
        before = snapshot(t)
        with pytest.raises(NonFiniteError, match=r"step 0: the scale factor s_in(\[0\])? = (nan|inf)") as info:
            t.train(progress=False)
        assert info.value.step == 0 and info.value.tensor.startswith("s_in")
        assert_bit_equal(snapshot(t), before)  # nothing initialised, no scale factor set


@pytest.mark.parametrize("kind", KINDS)
def test_norm_batches_without_a_counted_token_are_refused_before_the_first_step(kind):
    clean = make_source(stacked=stacked(kind))

    def empty(i: int) -> Batch:
        b = clean(i)
        return Batch(x=b.x, y=b.y, loss_mask=torch.zeros_like(b.loss_mask))

    t = make_trainer(kind, empty)
    before = snapshot(t)
    with pytest.raises(TooFewTokensError, match="count no token: every loss_mask entry is False"):
        t.train(progress=False)
    assert_bit_equal(snapshot(t), before)


@pytest.mark.parametrize("kind", KINDS)
def test_a_later_batch_without_a_counted_token_is_named(kind):
    k = 3
    t = make_trainer(kind, make_source(k, all_masked=True, stacked=stacked(kind)))
    with pytest.raises(NonFiniteError, match=rf"batch {k} has no counted token") as info:
        t.train(progress=False)
    assert info.value.step == k
    assert_bit_equal(snapshot(t), snapshot(reference(kind, k)))


def test_the_lorsa_recipe_needs_d_qk_head_counted_tokens_in_its_first_batch():
    from helpers import tiny_hf_model

    from nnsight_lorsa import get_adapter

    hf = tiny_hf_model("llama")
    mhsa = get_adapter(hf).mhsa_weights(hf, 1)
    cfg = LorsaConfig.from_mhsa(mhsa, n_ov_heads=64, top_k=4, layer=1)
    d, need = cfg.d_model, cfg.d_qk_head

    def source(i: int, windows: int = 1, seq: int = need) -> Batch:  # seq - 1 counted tokens per window
        g = torch.Generator().manual_seed(i)
        mask = torch.ones(windows, seq, dtype=torch.bool)
        mask[:, 0] = False
        return Batch(x=torch.randn(windows, seq, d, generator=g), y=torch.randn(windows, seq, d, generator=g),
                     loss_mask=mask, positions=torch.arange(seq))

    t = Trainer(LorsaObjective(Lorsa(cfg), mhsa=mhsa), source, TrainConfig(total_steps=2))
    before = snapshot(t)
    with pytest.raises(TooFewTokensError, match=rf"d_qk_head={need} counted tokens in the first batch; it has "
                                                rf"{need - 1} .*raise --batch-size or --seq-len"):
        t.train(progress=False)
    assert_bit_equal(snapshot(t), before)
    ok = Trainer(LorsaObjective(Lorsa(cfg), mhsa=mhsa), lambda i: source(i, windows=2), TrainConfig(total_steps=2))
    ok.train(progress=False)  # 2 (need - 1) tokens: enough
    assert ok.step == 2


# --------------------------------------------------------------------------- TokenDataset
@pytest.mark.parametrize(("tokens", "needle"), [
    (torch.ones(2, 4), "integer tensor"), (torch.ones(2, 4, dtype=torch.float64), "integer tensor"),
    (torch.ones(2, 4, dtype=torch.bool), "integer tensor"), ([[1, 2]], "integer tensor"),
    (torch.tensor([[0, 1, -1, 2]]), "negative token id"),
])
def test_token_dataset_refuses_what_is_not_token_ids(tokens, needle):
    with pytest.raises(ArgumentError, match=needle):
        construct(TokenDataset, tokens)


def test_token_dataset_refuses_ids_outside_a_known_vocabulary():
    ids = torch.tensor([[0, 5, 9], [0, 1, 2]])
    assert construct(TokenDataset, ids, vocab_size=10).vocab_size == 10
    with pytest.raises(ArgumentError, match="token id 9, outside the vocabulary of 9 ids"):
        construct(TokenDataset, ids, vocab_size=9)
    train, held = TokenDataset(ids, vocab_size=10).split(0.5)
    assert train.vocab_size == held.vocab_size == 10
    from helpers import tiny_tokenizer

    class Config:
        bos_token_id, vocab_size = 0, 5

    with pytest.raises(ArgumentError, match="outside the vocabulary of 5 ids"):
        TokenDataset.from_text(tiny_tokenizer(), "w2 w3 w7 w2 w3 w4", 3, config=Config())
    assert TokenDataset.from_text(tiny_tokenizer(), "w2 w3 w4 w2", 3, config=Config()).vocab_size == 5


def test_integer_ids_of_any_width_still_work():
    for dtype in (torch.int32, torch.int64, torch.uint8):
        assert len(construct(TokenDataset, torch.ones(3, 4, dtype=dtype))) == 3
