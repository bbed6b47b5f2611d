"""Mixed-precision training probe: bf16 / fp16 modules and activations against plain-torch references written here.

* A bf16 transcoder trained by :class:`~nnsight_lorsa.training.Trainer` with its fp32 master weights, next to the
  scheme docs/training.md states, written out here: an fp32 master copy of every parameter, the forward and backward
  in bf16 on the master's rounding, the gradient widened to fp32, ``clip_grad_norm_``'s rule, Adam (Kingma & Ba,
  fp32 moments) on the master, unit-norm decoder rows on the master, the module's weight the master rounded once.
* Scale factors ``√d / E‖·‖`` of fp16 / bf16 activations whose squares overflow fp16 (|x| > 256), against fp64.
* The logged metrics (loss, FVU, L0, dead fraction) of a bf16 step, and :func:`~nnsight_lorsa.training.metrics.fvu`
  of half-precision values, against fp64 of the same values.
* A non-finite half gradient stops the step with the state (weights, masters, Adam state) untouched.
* Checkpoint -> resume of a bf16 run (SAE, CLT, Lorsa) bit-equal to the uninterrupted run; masters and Adam
  moments fp32 in the files.

Bounds are relative, in the dtype's eps (bf16 ``2^-8``, fp16 ``2^-11``, fp32 ``2^-24``).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import generated
from hypothesis import strategies as st
from safetensors.torch import load_file
from test_probe_padded_source_eval import _hooked

from nnsight_lorsa.errors import NonFiniteError
from nnsight_lorsa.modules.clt import CLTConfig, CrossLayerTranscoder
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
from nnsight_lorsa.modules.transcoder import Transcoder, TranscoderConfig
from nnsight_lorsa.training import TrainConfig, Trainer
from nnsight_lorsa.training.activations import Batch
from nnsight_lorsa.training.metrics import FVUAccumulator, fvu

F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
EPS = {BF16: 2.0 ** -8, F16: 2.0 ** -11, F32: 2.0 ** -24}


def batches(seed: int, n: int, b: int, p: int, d_in: int, d_out: int, dtype: torch.dtype, scale: float = 1.0,
            layers: int = 0, sae: bool = False) -> list[Batch]:
    """``n`` batches of ``b × p`` in ``dtype`` (drawn in fp64, rounded once): BOS column and right padding out of
    ``loss_mask``; ``scale`` multiplies the activations (``> 256``: their squares overflow fp16)."""
    g = torch.Generator().manual_seed(seed)
    lead = (layers,) if layers else ()
    proj = torch.randn(d_in, d_out, generator=g, dtype=F64) / math.sqrt(d_in)
    out = []
    for _ in range(n):
        x = (torch.randn(*lead, b, p, d_in, generator=g, dtype=F64) * 1.5 + 0.3) * scale
        y = x if sae else (torch.tanh(x / scale @ proj) * 1.7 + 0.1 * torch.randn(*lead, b, p, d_out, generator=g,
                                                                              dtype=F64)) * scale
        lengths = torch.randint(2, p + 1, (b,), generator=g)
        mask = torch.arange(p)[None] < lengths[:, None]
        mask[:, 0] = False
        xs = x.clamp(-6e4, 6e4).to(dtype)  # finite in fp16 (largest 65504)
        out.append(Batch(xs, xs if sae else y.clamp(-6e4, 6e4).to(dtype), mask))
    return out


def ref_scale(bs: list[Batch], field: str, layer: int | None = None) -> float:
    """``√d / mean ‖v‖`` over the counted tokens, in fp64 of the stored values."""
    norms = []
    for b in bs:
        v = getattr(b, field).double()
        v = v if layer is None else v[layer]
        norms.append(v[b.loss_mask].norm(dim=-1))
    return math.sqrt(v.shape[-1]) / float(torch.cat(norms).mean())


# ------------------------------------------------------------------------------------ master weights vs reference
class RefMixedTranscoder:
    """The documented scheme, in plain torch: fp32 masters, bf16 forward/backward on their rounding, fp32 Adam."""

    def __init__(self, params: dict[str, torch.Tensor], cfg: TrainConfig, activation: str, k: int) -> None:
        self.m = {n: v.detach().float().clone() for n, v in params.items()}
        self.adam = {n: (torch.zeros_like(v), torch.zeros_like(v)) for n, v in self.m.items()}
        self.cfg, self.activation, self.k, self.t = cfg, activation, k, 0
        self.since = torch.zeros(params["W_enc"].shape[1], dtype=torch.long)  # tokens since each latent fired
        #: elements whose gradient was at rounding level (≤ 2 bf16 eps of the tensor's largest, not 0) at some step
        self.noisy: dict[str, torch.Tensor] = {}

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: v.to(BF16) for n, v in self.m.items()}

    def step(self, batch: Batch, s_in: float, s_out: float) -> dict[str, float]:
        w = {n: v.clone().requires_grad_(True) for n, v in self.weights().items()}
        mask = batch.loss_mask
        x = batch.x.to(BF16)[mask] * s_in
        y = batch.y.to(BF16)[mask] * s_out
        pre = torch.addmm(w["b_enc"], x, w["W_enc"])
        if self.activation == "relu":
            acts = pre.relu()
        else:
            vals, idx = pre.topk(self.k, dim=-1)
            acts = torch.zeros_like(pre).scatter(-1, idx, vals.relu())
        out = torch.addmm(w["b_dec"], acts, w["W_dec"])
        err = y.float() - out.float()
        mse = err.pow(2).sum(-1).mean()
        loss = mse
        self.since += x.shape[0]
        self.since[(acts != 0).any(0)] = 0
        dead = self.since >= self.cfg.dead_after_tokens
        if self.activation == "relu":
            loss = loss + self.cfg.l1_coef * (acts * w["W_dec"].norm(dim=-1)).float().sum(-1).mean()
        elif dead.any():  # AuxK (Gao et al. 2024 §A.2): the dead latents' top-k_aux reconstruct the error
            k_aux = min(2 * self.k, int(dead.sum()))
            vals, idx = pre.masked_fill(~dead, float("-inf")).topk(k_aux, dim=-1)
            z = torch.zeros_like(pre).scatter(-1, idx, vals.relu())
            e = err.detach()
            aux = ((z @ w["W_dec"]).float() - e).pow(2).sum(-1).mean() / e.pow(2).sum(-1).mean()
            loss = loss + self.cfg.aux_k_coef * aux
        loss.backward()
        grads = {n: w[n].grad.float() for n in w}
        for n, g in grads.items():  # rounding-level gradients: their sign (so Adam's ±lr step) is the kernels' choice
            noisy = (g != 0) & (g.abs() <= 2 * EPS[BF16] * g.abs().max())  # exact zeros: no step
            self.noisy[n] = noisy if n not in self.noisy else self.noisy[n] | noisy
        if self.cfg.grad_clip:
            total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
            coef = torch.clamp(self.cfg.grad_clip / (total + 1e-6), max=1.0)
            grads = {n: g * coef for n, g in grads.items()}
        self.t += 1
        b1, b2 = self.cfg.betas
        for n, g in grads.items():
            mom, var = self.adam[n]
            mom.mul_(b1).add_(g, alpha=1 - b1)
            var.mul_(b2).add_(g * g, alpha=1 - b2)
            mhat = mom / (1 - b1 ** self.t)
            vhat = var / (1 - b2 ** self.t)
            self.m[n] -= self.cfg.lr * mhat / (vhat.sqrt() + 1e-8)
        W = self.m["W_dec"]
        W /= W.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        y64, out64 = y.double(), out.detach().double()
        fvu64 = float((y64 - out64).pow(2).sum() / (y64 - y64.mean(0)).pow(2).sum())
        return {"loss": float(loss.detach()), "mse": float(mse.detach()), "fvu": fvu64,
                "l0": float((acts != 0).sum(-1).double().mean()), "dead_frac": float(dead.double().mean())}


@generated(6, 60, seed=st.integers(0, 2 ** 16), activation=st.sampled_from(["relu", "topk"]),
           steps=st.integers(1, 4), clip=st.sampled_from([0.0, 0.05, 100.0]),
           act_dtype=st.sampled_from([F32, BF16, F16]), lr=st.sampled_from([1e-4, 1e-3, 1e-2]),
           sparse=st.booleans(), dead_after=st.sampled_from([1, 10, 10 ** 6]))
def test_a_bf16_transcoder_trains_as_the_fp32_master_scheme(seed, activation, steps, clip, act_dtype, lr, sparse,
                                                            dead_after):
    """The bf16 weights are the masters rounded once after every step; masters and Adam moments are fp32; the
    masters stay within 2 % (of the reference's own update) of the plain-torch scheme's, plus 2 lr a step for each
    element whose gradient was at rounding level (Adam's step of it is ±lr, its sign the summation order's: seen
    in CI's draw seed=40, topk, sparse kernels, AuxK on); metrics within bf16 eps."""
    torch.manual_seed(seed)
    d_in, d_out, d_sae, k = 6, 5, 16, 3
    cfg_t = TranscoderConfig(d_in=d_in, d_out=d_out, d_sae=d_sae, activation=activation,
                             activation_params={"k": k} if activation == "topk" else {})
    module = Transcoder(cfg_t).to(BF16)
    bs = batches(seed, steps + 2, 3, 7, d_in, d_out, act_dtype)
    config = TrainConfig(total_steps=steps, lr=lr, warmup_frac=0.0, decay_frac=0.0, grad_clip=clip, norm_batches=2,
                         log_every=1, dead_after_tokens=dead_after, sparse_kernels=sparse, aux_k_coef=0.5)
    ref = RefMixedTranscoder(dict(module.named_parameters()), config, activation, k)
    start = {n: v.clone() for n, v in ref.m.items()}
    trainer = Trainer(module, lambda i: bs[i], config)
    s_in, s_out = trainer.estimate_norms()
    assert s_in == pytest.approx(ref_scale(bs[:2], "x"), rel=1e-6)
    assert s_out == pytest.approx(ref_scale(bs[:2], "y"), rel=1e-6)
    for i in range(steps):
        got = trainer.train_step()
        want = ref.step(bs[i], s_in, s_out)
        masters = trainer.masters.named(module)
        assert set(masters) == {n for n, _ in module.named_parameters()}
        for n, p in module.named_parameters():
            m = masters[n]
            assert p.dtype == BF16 and m.dtype == F32, n
            assert torch.equal(p.detach(), m.detach().to(BF16)), n  # the weight is the master rounded once
            for v in trainer.optimizer.state[m].values():
                assert v.dtype == F32 or v.dim() == 0, n
            update = (ref.m[n] - start[n]).double().norm()
            dist = (m.detach().double() - ref.m[n].double()).norm()
            # Adam steps a rounding-level gradient by ±lr whatever its size, its sign the summation order's (the
            # sparse kernels sum in another order than the reference): each such element may be 2 lr off a step
            # (and, through W_dec's row normalisation, its row with it)
            noise = 2 * lr * (i + 1) * float(ref.noisy[n].sum()) ** 0.5
            assert dist <= 0.02 * update + noise + 4 * EPS[F32] * ref.m[n].double().norm(), \
                (i, n, float(dist), float(update), noise)
        # metrics of the same bf16 values: fp32 sums of bf16 products
        for key in ("mse", "fvu", "loss"):
            assert got[key] == pytest.approx(want[key], rel=8 * EPS[BF16], abs=1e-6), key
        if i == 0:  # later steps' L0 may differ where a rounding flips a pre-activation's sign
            assert got["l0"] == pytest.approx(want["l0"], rel=1e-6)
            assert got["dead_frac"] == want["dead_frac"]


# ------------------------------------------------------------------------------------ scale factors
@generated(6, 60, seed=st.integers(0, 2 ** 16), dtype=st.sampled_from([F16, BF16]),
           scale=st.sampled_from([1.0, 300.0, 3000.0, 2.0e4]), kind=st.sampled_from(["sae", "transcoder", "clt"]))
def test_scale_factors_of_half_activations_match_fp64(seed, dtype, scale, kind):
    """``estimate_norms`` on fp16 / bf16 activations past 256 (whose squares overflow fp16's 65504) gives the fp64
    value of the same stored numbers to fp32 accuracy, for one site and per CLT layer."""
    d = 8
    layers = 2 if kind == "clt" else 0
    bs = batches(seed, 3, 2, 6, d, d, dtype, scale=scale, layers=layers, sae=kind == "sae")
    torch.manual_seed(seed)
    if kind == "sae":
        module: torch.nn.Module = SparseAutoencoder(SAEConfig(d_in=d, d_sae=16, activation="relu"))
    elif kind == "transcoder":
        module = Transcoder(TranscoderConfig(d_in=d, d_out=d, d_sae=16, activation="relu"))
    else:
        module = CrossLayerTranscoder(CLTConfig(n_layers=2, d_in=d, d_sae=8, activation="relu"))
    trainer = Trainer(module.to(BF16), lambda i: bs[i], TrainConfig(total_steps=1, norm_batches=3))
    trainer.estimate_norms()
    for b in bs:
        assert torch.isfinite(b.x).all()
    if kind == "clt":
        for layer in range(2):
            assert trainer.s_in_layers[layer] == pytest.approx(ref_scale(bs, "x", layer), rel=1e-6)
            assert trainer.s_out_layers[layer] == pytest.approx(ref_scale(bs, "y", layer), rel=1e-6)
    else:
        assert trainer.s_in == pytest.approx(ref_scale(bs, "x"), rel=1e-6)
        assert trainer.s_out == pytest.approx(ref_scale(bs, "x" if kind == "sae" else "y"), rel=1e-6)
    m = trainer.train_step()  # the normalised batch is O(1): the step is finite
    assert all(math.isfinite(v) for v in m.values())


# ------------------------------------------------------------------------------------ metrics in half precision
@generated(8, 100, seed=st.integers(0, 2 ** 16), dtype=st.sampled_from([F16, BF16]),
           scale=st.sampled_from([1e-3, 1.0, 300.0, 5000.0]), offset=st.sampled_from([0.0, 5.0]),
           n=st.integers(2, 300))
def test_fvu_of_half_values_matches_fp64(seed, dtype, scale, offset, n):
    """``fvu`` and ``FVUAccumulator`` of fp16 / bf16 ``y, ŷ`` (values past 256 included) equal the fp64 FVU of the same
    stored numbers to fp32 accuracy (relative to the conditioning ``Σ‖y‖² / Σ‖y − ȳ‖²``)."""
    g = torch.Generator().manual_seed(seed)
    y = ((torch.randn(n, 7, generator=g, dtype=F64) + offset) * scale).clamp(-6e4, 6e4).to(dtype)
    y_hat = (y.double() + 0.3 * scale * torch.randn(n, 7, generator=g, dtype=F64)).clamp(-6e4, 6e4).to(dtype)
    y64, h64 = y.double(), y_hat.double()
    total = (y64 - y64.mean(0)).pow(2).sum()
    want = float((y64 - h64).pow(2).sum() / total)
    cond = float(y64.pow(2).sum() / total)
    got = float(fvu(y, y_hat))
    assert math.isfinite(got)
    assert got == pytest.approx(want, rel=64 * EPS[F32] * cond)
    acc = FVUAccumulator()
    acc.update(y[: n // 2], y_hat[: n // 2])
    acc.update(y[n // 2:], y_hat[n // 2:])
    assert acc.value() == pytest.approx(want, rel=1e-9 * cond)


# ------------------------------------------------------------------------------------ non-finite half gradients
@pytest.mark.parametrize("master_weights", [True, False])
def test_a_non_finite_bf16_gradient_stops_the_step_with_the_state_kept(master_weights):
    """An inf in a bf16 parameter's gradient (a hook puts it there at step 2) raises ``NonFiniteError`` naming the
    parameter, with clipping on; the weights, masters and Adam state are those after step 1."""
    torch.manual_seed(0)
    module = Transcoder(TranscoderConfig(d_in=6, d_out=5, d_sae=16, activation="relu")).to(BF16)
    bs = batches(1, 4, 3, 7, 6, 5, BF16)
    trainer = Trainer(module, lambda i: bs[i], TrainConfig(total_steps=4, grad_clip=1.0, norm_batches=2,
                                                           master_weights=master_weights))
    trainer.train_step()
    before = {n: trainer.masters.held(p).detach().clone() for n, p in module.named_parameters()}
    weights = {n: p.detach().clone() for n, p in module.named_parameters()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in trainer.optimizer.state.items()}
    handle = module.W_enc.register_hook(lambda g: g * torch.tensor(float("inf"), dtype=g.dtype))
    with pytest.raises(NonFiniteError, match=r"step 1.*W_enc\.grad"):
        trainer.train_step()
    handle.remove()
    assert trainer.step == 1
    for n, p in module.named_parameters():
        assert torch.equal(p.detach(), weights[n]) and torch.equal(trainer.masters.held(p).detach(), before[n]), n
    for p, s in trainer.optimizer.state.items():
        for key, v in s.items():
            assert torch.equal(v, state[id(p)][key])
    trainer.train_step()  # goes on from the kept state
    assert trainer.step == 2


# ------------------------------------------------------------------------------------ checkpoints
def _module(kind: str) -> torch.nn.Module:
    torch.manual_seed(3)
    if kind == "sae":
        return SparseAutoencoder(SAEConfig(d_in=6, d_sae=16, activation="topk", activation_params={"k": 3}))
    return CrossLayerTranscoder(CLTConfig(n_layers=2, d_in=6, d_sae=8, activation="relu"))


def assert_resumed_bit_exactly(straight, again) -> None:
    """A resumed bf16 run equals the uninterrupted one: each bf16 parameter, its fp32 master and their Adam state,
    and the dead counters, bit for bit."""
    for (n, p), q in zip(straight.module.named_parameters(), again.module.parameters(), strict=True):
        assert q.dtype == BF16 and torch.equal(p, q), n
        ms, ma = straight.masters.held(p), again.masters.held(q)
        assert ma.dtype == F32 and torch.equal(ms, ma), n
        for key, v in straight.optimizer.state[ms].items():
            assert torch.equal(v, again.optimizer.state[ma][key]), (n, key)
    assert torch.equal(straight.tokens_since_fired, again.tokens_since_fired)


@pytest.mark.parametrize("kind", ["sae", "clt"])
def test_a_bf16_run_resumed_from_a_checkpoint_is_bit_equal_to_the_uninterrupted_run(kind, tmp_path):
    """3 steps, save, resume, 2 more vs 5 steps straight: bf16 weights, fp32 masters, fp32 Adam moments and dead
    counters identical; the files hold the masters and the moments in fp32."""
    layers = 2 if kind == "clt" else 0
    bs = batches(5, 6, 3, 7, 6, 6, BF16, layers=layers, sae=kind == "sae")
    config = dict(total_steps=5, lr=1e-3, warmup_frac=0.2, decay_frac=0.4, grad_clip=1.0, norm_batches=2,
                  dead_after_tokens=30)
    straight = Trainer(_module(kind).to(BF16), lambda i: bs[i], TrainConfig(**config))
    straight.train()
    first = Trainer(_module(kind).to(BF16), lambda i: bs[i], TrainConfig(**config))
    first.train(3)
    first.save_checkpoint(tmp_path / "ck")
    opt = load_file(str(tmp_path / "ck" / "optimizer.safetensors"))
    assert {v.dtype for k, v in opt.items() if not k.endswith(".step")} == {F32}
    assert {v.dtype for v in load_file(str(tmp_path / "ck" / "masters.safetensors")).values()} == {F32}
    again = Trainer.resume(tmp_path / "ck", lambda i: bs[i])
    again.train()
    assert_resumed_bit_exactly(straight, again)
    assert straight.s_in == again.s_in and straight.s_out == again.s_out


# ------------------------------------------------------------------------------------ caches from half models
@pytest.mark.parametrize("model_dtype", [BF16, F16], ids=str)
@pytest.mark.parametrize("store", [None, BF16, F32], ids=str)
def test_a_cache_of_a_half_model_holds_its_activations_in_the_documented_dtype(model_dtype, store, tmp_path):
    """A cache written from a bf16 / fp16 tiny Llama: by default stored as float32 (an exact widening, bit-equal to
    the model's values read by a plain forward hook), with ``dtype=`` as that dtype (the values rounded once);
    the cached transcoder stream (``ActivationSource.transcoder(cache, …)``) returns them in the stored dtype."""
    from helpers import random_ids, tiny_nnsight

    from nnsight_lorsa import get_adapter
    from nnsight_lorsa.envoy.read import Site
    from nnsight_lorsa.training import ActivationSource, TokenDataset
    from nnsight_lorsa.training.activation_cache import site_name, write_activation_cache

    model, hf = tiny_nnsight("llama", dtype=model_dtype)
    adapter = get_adapter(model)
    data = TokenDataset(random_ids(batch=6, seq=8, seed=2))
    seen: dict[str, torch.Tensor] = {}
    mlp = hf.model.layers[1].mlp
    handle = mlp.register_forward_hook(lambda m, args, out: seen.update(x=args[0].detach(), y=out.detach()))
    with torch.no_grad():
        hf(data.tokens)
    handle.remove()
    assert seen["y"].dtype == model_dtype
    site = Site.mlp_output(adapter, 1)
    cache = write_activation_cache(model, [site, Site.mlp_input(adapter, 1)], data, tmp_path / "c", batch_size=4,
                                   windows_per_shard=4, dtype=store)
    want = F32 if store is None else store
    got = cache.windows(site_name(site), torch.arange(6))
    assert got.dtype == want
    assert torch.equal(got, seen["y"].to(want))
    b = ActivationSource.transcoder(cache, 1, batch_size=6, seed=0, adapter=adapter)(0)  # the 6 windows, permuted
    assert b.x.dtype == want and b.y.dtype == want
    ref_x, ref_y = seen["x"].to(want), seen["y"].to(want)
    for row in range(6):
        w = [i for i in range(6) if torch.equal(b.y[row], ref_y[i])]
        assert len(w) >= 1 and torch.equal(b.x[row], ref_x[w[0]]), row


# ------------------------------------------------------------------------------------ evaluate on half models
@pytest.mark.parametrize("model_dtype", [BF16, F16], ids=str)
@pytest.mark.parametrize("tc_dtype", ["model", F32], ids=str)
def test_evaluate_on_a_half_model_matches_a_plain_reference(model_dtype, tc_dtype):
    """``evaluate`` of a transcoder (in the model's dtype, or fp32) spliced into a bf16 / fp16 tiny Llama: CE (orig,
    spliced, zero), KL, FVU, L0 and dead fraction equal the fp64 numbers of the same forward passes (plain forward
    hooks on the HF model, the same batches), within the model dtype's eps; every number finite."""
    from helpers import random_ids, tiny_nnsight

    from nnsight_lorsa import TranscoderSet, get_adapter
    from nnsight_lorsa.training import TokenDataset, evaluate

    model, hf = tiny_nnsight("llama", dtype=model_dtype)
    adapter = get_adapter(model)
    tokens = random_ids(batch=4, seq=8, seed=4)
    torch.manual_seed(7)
    dt = model_dtype if tc_dtype == "model" else tc_dtype
    tc = Transcoder(TranscoderConfig(d_in=adapter.d_model, d_sae=32, activation="relu")).to(dt).eval()
    with torch.no_grad():
        tc.b_enc.normal_(0, 0.3)
    ev = evaluate(TranscoderSet(model, {1: tc}), TokenDataset(tokens), at=1, batch_size=2)
    mlp = adapter.mlp_module(hf, 1)
    ce = {"orig": 0.0, "spliced": 0.0, "zero": 0.0}
    kl, ys, outs, acts = 0.0, [], [], []
    for i in range(0, 4, 2):
        ids = tokens[i:i + 2]
        lo, x, y = _hooked(hf, mlp, ids)
        with torch.no_grad():
            ls, _, _ = _hooked(hf, mlp, ids, lambda x_, out: tc(x_.to(dt)).to(model_dtype))
            lz, _, _ = _hooked(hf, mlp, ids, lambda x_, out: torch.zeros_like(out))
            ys.append(y[:, 1:].reshape(-1, y.shape[-1]).double())
            outs.append(tc(x[:, 1:].to(dt)).reshape(-1, y.shape[-1]).double())
            acts.append(tc.encode(x[:, 1:].to(dt)).reshape(-1, 32))
        tgt = ids[:, 1:].reshape(-1)
        for name, logits in (("orig", lo), ("spliced", ls), ("zero", lz)):
            ce[name] += float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(),
                                                                tgt, reduction="sum"))
        lp = lo[:, :-1].double().log_softmax(-1)
        lq = ls[:, :-1].double().log_softmax(-1)
        kl += float((lp.exp() * (lp - lq)).sum())
    n = 4 * 7
    y64, out64, a = torch.cat(ys), torch.cat(outs), torch.cat(acts)
    fired = a != 0
    want = {"ce_orig": ce["orig"] / n, "ce_spliced": ce["spliced"] / n, "ce_zero": ce["zero"] / n,
            "fvu": float((y64 - out64).pow(2).sum() / (y64 - y64.mean(0)).pow(2).sum()),
            "l0": float(fired.sum(-1).double().mean()), "dead_frac": float((~fired.any(0)).double().mean())}
    assert ev.n_tokens == n
    eps = EPS[model_dtype]
    for name, value in want.items():
        got = getattr(ev, name)
        assert math.isfinite(got) and got == pytest.approx(value, rel=4 * eps, abs=1e-6), (name, got, value)
    assert ev.kl == pytest.approx(kl / n, rel=0.05, abs=16 * eps)  # a difference of nearly equal logits


# ------------------------------------------------------------------------------------ BatchTopK's threshold estimate
def _drifting(dtype: torch.dtype, steps: int) -> list[Batch]:
    """SAE batches whose scale grows 2 % a step (the smallest kept activation drifts: the EMA has to follow)."""
    raw = batches(1, steps, 8, 9, 6, 6, F64, sae=True)
    out = []
    for i, b in enumerate(raw):
        x = (b.x * (1 + 0.02 * i)).to(dtype)
        out.append(Batch(x, x, b.loss_mask))
    return out


@pytest.mark.parametrize("sparse", [True, False])
def test_a_bf16_batchtopk_threshold_follows_the_fp64_ema(sparse):
    """A bf16 BatchTopK SAE's inference threshold after 60 steps: the EMA (rate ``threshold_lr``) of each step's
    smallest kept activation, computed here in fp64 from the step's bf16 pre-activations, within one bf16 rounding.
    It was updated in bf16, where a step ``0.01 · Δ`` below half a bf16 step of ``θ`` rounds away: 0.8 % off here
    (2 bf16 steps), stalled entirely where the batch minima stay within 20 % of ``θ``."""
    steps = 60
    torch.manual_seed(1)
    module = SparseAutoencoder(SAEConfig(d_in=6, d_sae=16, activation="batchtopk",
                                         activation_params={"k": 3})).to(BF16)
    bs = _drifting(BF16, steps)
    trainer = Trainer(module, lambda i: bs[i], TrainConfig(total_steps=steps, lr=1e-5, norm_batches=1,
                                                           sparse_kernels=sparse))
    s_in, _ = trainer.estimate_norms()
    theta = None
    for i in range(steps):
        w = {n: p.detach().clone() for n, p in module.named_parameters()}
        x = bs[i].x[bs[i].loss_mask] * s_in
        pre = torch.addmm(w["b_enc"], x, w["W_enc"])
        kept = pre.reshape(-1).relu().topk(3 * x.shape[0]).values
        smallest = float(kept[kept > 0].min())
        theta = smallest if theta is None else theta + 0.01 * (smallest - theta)
        trainer.train_step()
    got = module.activation.threshold
    assert got.dtype == BF16
    assert float(got) == pytest.approx(theta, rel=EPS[BF16])


def test_a_bf16_batchtopk_run_resumes_bit_exactly_with_its_threshold_master(tmp_path):
    """The threshold's fp32 master is saved with the parameters' (``masters.safetensors``) and resumed: 20 steps
    straight equal 12 + checkpoint + resume + 8, the threshold and its master included."""
    bs = _drifting(BF16, 20)
    config = dict(total_steps=20, lr=1e-3, norm_batches=1)

    def new():
        torch.manual_seed(2)
        sae = SparseAutoencoder(SAEConfig(d_in=6, d_sae=16, activation="batchtopk", activation_params={"k": 3}))
        return Trainer(sae.to(BF16), lambda i: bs[i], TrainConfig(**config))

    straight = new()
    straight.train(progress=False)
    first = new()
    first.train(12, progress=False)
    first.save_checkpoint(tmp_path / "ck")
    saved = load_file(str(tmp_path / "ck" / "masters.safetensors"))
    assert saved["activation.threshold"].dtype == F32
    again = Trainer.resume(tmp_path / "ck", lambda i: bs[i])
    again.train(progress=False)
    assert torch.equal(straight.module.activation.threshold, again.module.activation.threshold)
    assert torch.equal(straight.masters.named_buffers(straight.module)["activation.threshold"],
                       again.masters.named_buffers(again.module)["activation.threshold"])
    for (n, p), q in zip(straight.module.named_parameters(), again.module.parameters(), strict=True):
        assert torch.equal(p, q), n
    # resumed in fp32: the threshold is the master, not its bf16 rounding
    wide = Trainer.resume(tmp_path / "ck", lambda i: bs[i], dtype=F32)
    assert torch.equal(wide.module.activation.threshold, saved["activation.threshold"])
    # an edit between steps inside masters.editing reaches the master (the next forward does not undo it)
    with again.masters.editing(again.module):
        again.module.activation.set_threshold(0.3)
    assert float(again.masters.named_buffers(again.module)["activation.threshold"]) == pytest.approx(0.3, rel=1e-7)
    assert torch.equal(again.module.activation.threshold, torch.tensor(0.3, dtype=BF16))


@pytest.mark.parametrize("recipe", ["revive", "resample", "balance"])
def test_a_bf16_lorsa_run_resumes_bit_exactly(recipe, tmp_path):
    """A bf16 Lorsa (tiny Llama's layer 1, a bf16 model; the recipe's initialisation, dead-head remedy and k annealing
    active): 4 steps straight equal 2 + checkpoint + resume + 2 — weights, fp32 masters, fp32 Adam moments, dead
    counters and the head-balancing state."""
    from helpers import random_ids, tiny_nnsight

    from nnsight_lorsa import get_adapter
    from nnsight_lorsa.modules.lorsa import Lorsa, LorsaConfig
    from nnsight_lorsa.training import ActivationSource, LorsaObjective, LorsaRecipe, TokenDataset

    model, hf = tiny_nnsight("llama", dtype=BF16)
    adapter = get_adapter(model)
    source = ActivationSource.attention(model, 1, TokenDataset(random_ids(batch=12, seq=10, seed=3)), batch_size=4)
    rec = LorsaRecipe(ov_init="mhsa", dead_remedy=recipe, remedy_until=1.0, k_anneal_from=6, k_anneal_frac=0.5)
    config = dict(total_steps=4, lr=1e-3, norm_batches=1, dead_after_tokens=10, grad_clip=1.0)

    def new():
        torch.manual_seed(0)
        lorsa = Lorsa(LorsaConfig(d_model=adapter.d_model, n_qk_heads=4, d_qk_head=16, n_ov_heads=16, top_k=3,
                                  rotary=adapter.rotary_config(), layer=1)).to(BF16)
        return Trainer(LorsaObjective(lorsa, mhsa=adapter.mhsa_weights(hf, 1), recipe=rec), source,
                       TrainConfig(**config))

    straight = new()
    straight.train(progress=False)
    first = new()
    first.train(2, progress=False)
    first.save_checkpoint(tmp_path / "ck")
    again = Trainer.resume(tmp_path / "ck", source)
    again.objective.mhsa = None  # (the MHSA is used by the initialisation only)
    again.train(progress=False)
    assert_resumed_bit_exactly(straight, again)
    if recipe == "balance":
        assert straight.objective.balance.to_dict() == again.objective.balance.to_dict()


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_a_refused_step_leaves_the_batchtopk_threshold_as_it_was(dtype):
    """A step refused as non-finite (an ``inf`` gradient) leaves the trainer as after the step before: BatchTopK's
    threshold estimate and its update count too (and a bf16 one's fp32 master). The forward had already folded the
    refused batch into them."""
    torch.manual_seed(4)
    sae = SparseAutoencoder(SAEConfig(d_in=6, d_sae=16, activation="batchtopk", activation_params={"k": 3}))
    bs = _drifting(dtype, 6)
    trainer = Trainer(sae.to(dtype), lambda i: bs[i], TrainConfig(total_steps=6, lr=1e-3, norm_batches=1))
    trainer.train_step()
    trainer.train_step()
    act = trainer.module.activation
    before = (act.threshold.clone(), act.n_updates.clone(),
              {n: m.clone() for n, m in trainer.masters.named_buffers(trainer.module).items()})
    handle = trainer.module.W_enc.register_hook(lambda g: g * torch.tensor(float("inf"), dtype=g.dtype))
    with pytest.raises(NonFiniteError, match="W_enc"):
        trainer.train_step()
    handle.remove()
    assert torch.equal(act.threshold, before[0]) and torch.equal(act.n_updates, before[1])
    masters = trainer.masters.named_buffers(trainer.module)
    assert set(masters) == set(before[2]) == ({"activation.threshold"} if dtype == BF16 else set())
    for n, m in masters.items():
        assert torch.equal(m, before[2][n]), n


def _ddp_worker(rank: int, world: int, init_file: str, out_prefix: str) -> None:
    """One gloo rank: a bf16 BatchTopK SAE whose threshold master differs on rank 1, wrapped in ``DataParallel``
    (rank 0's broadcast), then 3 steps; writes the threshold and its master."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from nnsight_lorsa.training.distributed import DataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        bs = _drifting(BF16, 4)
        torch.manual_seed(2)
        sae = SparseAutoencoder(SAEConfig(d_in=6, d_sae=16, activation="batchtopk", activation_params={"k": 3}))
        trainer = Trainer(sae.to(BF16), lambda i: bs[i], TrainConfig(total_steps=3, lr=1e-3, norm_batches=1))
        if rank == 1:
            trainer.masters.buffer_masters()[0].fill_(5.0)
        DataParallel(trainer)
        master = trainer.masters.buffer_masters()[0]
        out = {"master_start": master.clone(), "buffer_start": sae.activation.threshold.clone()}
        trainer.train(progress=False)
        save_file({**out, "master": master.clone(), "buffer": sae.activation.threshold.clone()},
                  f"{out_prefix}.safetensors")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_broadcasts_the_batchtopk_threshold_master_from_rank_0(tmp_path):
    """Under ``DataParallel`` a bf16 BatchTopK's threshold master starts as rank 0's on every rank (rank 1's set
    elsewhere), its buffer the master's rounding; after training each buffer is still its master's rounding."""
    from helpers import run_ranks

    run_ranks(__file__, 2, tmp_path, timeout=120)
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    for r in ranks:
        assert float(r["master_start"]) == 0.0 and float(r["buffer_start"]) == 0.0
        assert r["master"].dtype == F32 and torch.equal(r["buffer"], r["master"].to(BF16))
        assert float(r["master"]) > 0


if __name__ == "__main__":
    import os
    import sys

    _ddp_worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
    sys.stdout.flush()
    os._exit(0)  # (gloo's threads can abort the interpreter's shutdown: as tests/training/test_distributed.py)
