"""BatchTopK threshold probe: the inference threshold's running estimate against a plain-torch fp64 EMA.

A bf16 / fp16 :class:`~nnsight_lorsa.modules.activations.BatchTopK` driven by hand (no ``Trainer``, so none of its
fp32 masters), through the dense forward and the sparse fast path (``select`` + ``activate_selected``): after each
training batch the threshold must be the EMA (rate ``threshold_lr``) of the batches' smallest kept activation —
the smallest positive among the ``k · n`` largest ReLU'd entries, computed here in fp64 from the batch's values —
rounded once to the module's dtype (bound: half a step of the dtype, plus fp32's accumulated rounding). Until
2026-11-27 the estimate was updated in the module's dtype and stalled (an EMA step below half a bf16 step rounds
away). Under data parallelism (``global_batch``) the update takes the combined statistic the reducer returns.
"""

from __future__ import annotations

import pytest
import torch
from helpers import generated
from hypothesis import strategies as st

from nnsight_lorsa.modules.activations import BatchTopK

F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
#: half a step of each dtype, relative (at most): one rounding of the fp32 estimate
HALF_STEP = {BF16: 2.0 ** -8, F16: 2.0 ** -11}


def _batches(seed: int, n: int, rows: int, d_sae: int, drift: float, dtype: torch.dtype) -> list[torch.Tensor]:
    """``n`` batches ``(rows, d_sae)`` in ``dtype`` whose scale grows by ``drift`` a batch (the minima move)."""
    g = torch.Generator().manual_seed(seed)
    return [((torch.randn(rows, d_sae, generator=g, dtype=F64) + 0.2) * (1 + drift * i)).to(dtype) for i in range(n)]


def _reference(batches: list[torch.Tensor], k: int, lr: float) -> list[float | None]:
    """The fp64 EMA after each batch (None before the first batch with a positive kept activation)."""
    theta, out = None, []
    for x in batches:
        flat = x.to(F64).reshape(-1).relu()
        kept = flat.topk(min(k * x.shape[0], flat.numel())).values
        kept = kept[kept > 0]
        if kept.numel():
            smallest = float(kept.min())
            theta = smallest if theta is None else theta + lr * (smallest - theta)
        out.append(theta)
    return out


def _feed(act: BatchTopK, x: torch.Tensor, sparse: bool) -> None:
    if sparse:
        rows, cols, _ = act.select(x)
        act.activate_selected(x[rows, cols])
    else:
        act(x)


@generated(examples=12, sweep=200, seed=st.integers(0, 2 ** 16), dtype=st.sampled_from([BF16, F16]),
           n=st.integers(30, 60), rows=st.integers(1, 9), d_sae=st.integers(4, 24), k=st.integers(1, 4),
           lr=st.sampled_from([0.01, 0.003]), drift=st.floats(0.01, 0.03), sparse=st.booleans())
def test_a_half_batchtopk_threshold_is_the_fp32_ema_rounded_once(seed, dtype, n, rows, d_sae, k, lr, drift, sparse):
    k = min(k, d_sae)
    act = BatchTopK(k, d_sae, threshold_lr=lr).to(dtype).train()
    batches = _batches(seed, n, rows, d_sae, drift, dtype)
    want = _reference(batches, k, lr)
    for i, (x, theta) in enumerate(zip(batches, want, strict=True)):
        _feed(act, x, sparse)
        if theta is None:
            assert int(act.n_updates) == 0
            continue
        got = float(act.threshold)
        assert act.threshold.dtype == dtype
        assert abs(got - theta) <= (HALF_STEP[dtype] + 64 * 2.0 ** -24) * abs(theta), (i, got, theta)


def test_an_outside_write_restarts_the_estimate_and_moves_keep_it():
    """``set_threshold`` / ``load_state_dict`` / an in-place write: the next update starts from the written value
    (the fp32 estimate is made again from the buffer); ``.to(device)`` and a bf16 -> fp16 cast keep the estimate."""
    act = BatchTopK(2, 8, threshold_lr=0.01).to(BF16).train()
    batches = _batches(3, 30, 4, 8, 0.02, BF16)
    for x in batches[:10]:
        act(x)
    act.set_threshold(0.3)
    want = _reference([torch.full((1, 8), 0.3, dtype=F64)] + batches[10:20], 2, 0.01)[-1]
    for x in batches[10:20]:
        act(x)
    assert float(act.threshold) == pytest.approx(want, rel=HALF_STEP[BF16] + 1e-6)
    state = {k: v.clone() for k, v in act.state_dict().items()}
    state["threshold"].fill_(0.5)
    act.load_state_dict(state)
    act.to("cpu").to(F16)  # (a move, then a cast to the other half dtype: the estimate goes along)
    want = _reference([torch.full((1, 8), 0.5, dtype=F64)] + batches[20:30], 2, 0.01)[-1]
    for x in batches[20:30]:
        act(x.to(F16))
    assert float(act.threshold) == pytest.approx(want, rel=HALF_STEP[F16] + 1e-6)


@pytest.mark.parametrize("sparse", [False, True])
def test_inside_global_batch_the_update_takes_the_combined_statistic(sparse):
    """The reducer sees this rank's smallest kept activation and its kept entries (``k`` per row), and the estimate
    follows what it returns (None: no update at all, as a batch without a positive activation)."""
    from nnsight_lorsa.training.distributed import global_batch

    act = BatchTopK(3, 8, threshold_lr=0.1).train()
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)) + 0.5
    calls = []

    def reduce(smallest, kept):
        calls.append((float(smallest), kept))
        if kept == 0:  # (no rank had one)
            return None
        return torch.tensor(2.0) if len(calls) == 1 else (None if len(calls) == 2 else torch.tensor(4.0))

    with global_batch(reduce):
        _feed(act, x, sparse)
        assert float(act.threshold) == 2.0 and int(act.n_updates) == 1
        _feed(act, x, sparse)
        assert float(act.threshold) == 2.0 and int(act.n_updates) == 1
        _feed(act, x, sparse)
        assert float(act.threshold) == pytest.approx(2.0 + 0.1 * (4.0 - 2.0))
        _feed(act, torch.full((2, 8), -1.0), sparse)  # no positive kept: reported with kept = 0
    flat = x.reshape(-1).relu()
    want = float(flat.topk(15).values.min())
    assert calls[0] == (pytest.approx(want), 15)
    assert calls[-1][1] == 0
    _feed(act, x, sparse)  # outside: the local statistic
    assert float(act.threshold) == pytest.approx(2.2 + 0.1 * (want - 2.2), rel=1e-6)


@generated(examples=6, sweep=100, seed=st.integers(0, 2 ** 16), dtype=st.sampled_from([BF16, F16]),
           at=st.integers(1, 20), sparse=st.booleans(), nested=st.booleans(),
           how=st.sampled_from(["deepcopy", "pickle"]))
def test_a_deep_copy_keeps_the_fp32_estimate(seed, dtype, at, sparse, nested, how):
    """``copy.deepcopy`` (or a pickle round trip: the module's own process, no file) mid-run, alone or inside a
    module: the copy then tracks the original bit for bit (seen failing: the copy's stamps named the original's
    buffers, so it restarted from the rounded buffer and drifted from the original within a few updates)."""
    import copy
    import pickle

    act = BatchTopK(2, 8, threshold_lr=0.01).to(dtype).train()
    batches = _batches(seed, 40, 4, 8, 0.0, dtype)
    for x in batches[:at]:
        _feed(act, x, sparse)
    dup = copy.deepcopy if how == "deepcopy" else (lambda m: pickle.loads(pickle.dumps(m)))  # noqa: S301
    twin = dup(torch.nn.Sequential(act))[0] if nested else dup(act)
    for i, x in enumerate(batches[at:]):
        _feed(act, x, sparse)
        _feed(twin, x, sparse)
        assert torch.equal(act.threshold, twin.threshold) and int(act.n_updates) == int(twin.n_updates), i
        assert act._running().dtype == twin._running().dtype == torch.float32
        assert torch.equal(act._running(), twin._running()), i
    twin.threshold.fill_(0.25)  # the copy's own buffers: a write to it leaves the original as it is
    assert not torch.equal(act.threshold, twin.threshold)
