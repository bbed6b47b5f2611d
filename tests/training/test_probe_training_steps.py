"""Training-step probe: the numbers a ``Trainer`` step produces against a plain-torch reference written here.

For drawn sizes, seeds and ``TrainConfig`` settings, each sparse-coder kind the trainer trains (SAE, transcoder,
skip transcoder, CLT) and each activation (ReLU, TopK, BatchTopK, JumpReLU, AbsTopK, GroupMax) is trained for a few
steps on synthetic padded batches (BOS column and right padding out of ``loss_mask``), in fp64, next to a
reference built from the formulas of the sources the code cites, none of the package's training code used:

* scale factors ``s = √d / E‖·‖`` over the counted tokens of the first ``norm_batches`` batches (one factor for an
  SAE, per layer for a CLT; docs/training.md);
* the loss: ``mean_t ‖y − ŷ‖²`` in the normalised space plus the activation's term — decoder-norm-weighted L1
  (Bricken et al. 2023 / Anthropic's April 2024 update, ``l1_coef``), ``l0_coef`` · L0 through the
  straight-through estimator (Rajamanoharan et al. 2024 eqs. 11–12, SAELens), AuxK against dead latents
  (Gao et al. 2024 §A.2, sparsify: ``aux_k_coef`` · ``‖ê − e‖² / ‖e‖²`` with the dead latents' top-``aux_k``,
  ``aux_k`` default ``2k``; SAELens ``abstopk``: dead latents selected by ``|pre|``, signed);
* dead counters (tokens since a latent last fired, ``≥ dead_after_tokens`` = dead; a latent fires where its
  activation is non-zero), Adam (Kingma & Ba, bias-corrected, ``eps = 1e-8``), the warmup–stable–decay LR,
  gradient clipping (``torch.nn.utils.clip_grad_norm_``'s rule), unit-norm decoder rows after each step (except
  JumpReLU; a CLT feature's row over all layers it writes), BatchTopK's threshold estimate;
* the logged metrics: loss and each term, FVU ``Σ‖y − ŷ‖² / Σ‖y − ȳ‖²``, L0, dead fraction, LR.

Compared after every step: each parameter (relative to its norm), both Adam moments, the dead counters
(exactly), every metric. Bounds: 1e-9 relative in fp64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from nnsight_lorsa.modules.clt import CLTConfig, CrossLayerTranscoder
from nnsight_lorsa.modules.sae import SAEConfig, SparseAutoencoder
from nnsight_lorsa.modules.transcoder import SkipTranscoder, Transcoder, TranscoderConfig
from nnsight_lorsa.training import TrainConfig, Trainer
from nnsight_lorsa.training.activations import Batch

DT = torch.float64
TOL = 1e-9
#: logged metrics: L0 and the dead fraction are averaged in fp32 (docs/training.md: metrics in fp32)
METRIC_TOL = 1e-6
#: weights: a gradient that is 0 in exact arithmetic (b_K) is rounding noise g, moved by Adam by up to lr·g/ε ≈ 1e-10
PARAM_TOL = 1e-8
ACTIVATIONS = ("relu", "topk", "batchtopk", "jumprelu", "abstopk", "groupmax")
KINDS = ("sae", "transcoder", "skip")


# ----------------------------------------------------------------------------------------------- data
def padded_batches(seed: int, n: int, b: int, p: int, d_in: int, d_out: int, *, layers: int = 0,
                   sae: bool = False) -> list[Batch]:
    """``n`` batches of ``b`` windows × ``p`` positions: column 0 is BOS, each row right-padded after a drawn
    length (never all padding). ``layers > 0``: stacked ``(layers, b, p, d)`` (a CLT's source)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    lead = (layers,) if layers else ()
    proj = torch.randn(d_in, d_out, generator=g, dtype=DT) / math.sqrt(d_in)
    for _ in range(n):
        x = torch.randn(*lead, b, p, d_in, generator=g, dtype=DT) * 2.5 + 0.3
        y = x if sae else torch.tanh(x @ proj) * 1.7 + 0.2 * torch.randn(*lead, b, p, d_out, generator=g, dtype=DT)
        lengths = torch.randint(2, p + 1, (b,), generator=g)
        mask = torch.arange(p)[None] < lengths[:, None]
        mask[:, 0] = False
        out.append(Batch(x, y, mask))
    return out


# ------------------------------------------------------------------------------------- reference parts
class RefJumpReLU(torch.autograd.Function):
    """``x · H(x − θ)``; ∂x = H(x − θ), ∂θ = −(θ/ε) K((x − θ)/ε) with the rectangle kernel (eq. 11)."""

    @staticmethod
    def forward(ctx, x, theta, eps):
        ctx.save_for_backward(x, theta)
        ctx.eps = eps
        return torch.where(x > theta, x, torch.zeros_like(x))

    @staticmethod
    def backward(ctx, g):
        x, theta = ctx.saved_tensors
        u = (x - theta) / ctx.eps
        kern = ((u > -0.5) & (u < 0.5)).to(x.dtype)
        return g * (x > theta).to(x.dtype), (-(theta / ctx.eps) * kern * g).reshape(-1, x.shape[-1]).sum(0), None


class RefStep(torch.autograd.Function):
    """``H(x − θ)``; ∂x = 0, ∂θ = −(1/ε) K((x − θ)/ε) (eq. 12)."""

    @staticmethod
    def forward(ctx, x, theta, eps):
        ctx.save_for_backward(x, theta)
        ctx.eps = eps
        return (x > theta).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, theta = ctx.saved_tensors
        u = (x - theta) / ctx.eps
        kern = ((u > -0.5) & (u < 0.5)).to(x.dtype)
        return None, (-(1.0 / ctx.eps) * kern * g).reshape(-1, x.shape[-1]).sum(0), None


def ref_activation(name: str, pre: torch.Tensor, k: int | None, theta: torch.Tensor | None, eps: float
                   ) -> torch.Tensor:
    """The activation of ``pre (n, f)`` in training mode, written from each peer's definition."""
    n, f = pre.shape
    if name == "relu":
        return torch.clamp(pre, min=0)
    if name == "jumprelu":
        return RefJumpReLU.apply(pre, theta, eps)
    keep = torch.zeros_like(pre, dtype=torch.bool)
    if name == "topk":  # the k largest per row, ReLU'd (Gao et al.)
        keep.scatter_(1, torch.argsort(pre, dim=1, descending=True)[:, :k], True)
        return torch.where(keep, torch.clamp(pre, min=0), torch.zeros_like(pre))
    if name == "abstopk":  # the k largest |pre| per row, signed (SAELens abstopk)
        keep.scatter_(1, torch.argsort(pre.abs(), dim=1, descending=True)[:, :k], True)
        return torch.where(keep, pre, torch.zeros_like(pre))
    if name == "groupmax":  # the max of each of k contiguous groups, ReLU'd (sparsify)
        r = torch.clamp(pre, min=0)
        grp = r.reshape(n, k, f // k)
        hit = grp == grp.max(-1, keepdim=True).values
        first = hit & (hit.cumsum(-1) == 1)
        return torch.where(first.reshape(n, f), r, torch.zeros_like(r))
    if name == "batchtopk":  # the k·n largest ReLU'd entries of the whole batch (Bussmann et al.)
        r = torch.clamp(pre, min=0)
        flat = torch.zeros(n * f, dtype=torch.bool)
        flat[torch.argsort(r.reshape(-1), descending=True)[: k * n]] = True
        return torch.where(flat.reshape(n, f), r, torch.zeros_like(r))
    raise AssertionError(name)


def ref_auxk(name: str, pre: torch.Tensor, dead: torch.Tensor, err: torch.Tensor, W_dec: torch.Tensor,
             k_aux: int) -> torch.Tensor:
    """Gao et al. §A.2 as docs/training.md states it: the dead latents' top-``k_aux`` (by value, ReLU'd; by
    magnitude, signed, for AbsTopK as SAELens) reconstruct the error ``e`` (no bias), ``mean‖ê − e‖² /
    mean‖e‖²``."""
    k_aux = min(k_aux, int(dead.sum()))
    score = pre.abs() if name == "abstopk" else pre
    score = torch.where(dead[None], score, torch.full_like(score, -math.inf))
    idx = torch.argsort(score.detach(), dim=1, descending=True)[:, :k_aux]
    keep = torch.zeros_like(pre, dtype=torch.bool).scatter_(1, idx, True)
    vals = pre if name == "abstopk" else torch.clamp(pre, min=0)
    z = torch.where(keep, vals, torch.zeros_like(vals))
    e = err.detach()
    return ((z @ W_dec) - e).pow(2).sum(-1).mean() / e.pow(2).sum(-1).mean()


def wsd(step: int, total: int, warmup_frac: float, decay_frac: float, decay_to: float) -> float:
    """docs/training.md: linear warmup over ``max(1, ⌊T·warmup_frac⌋)`` steps (step 0 at 1/W), constant, then a
    linear decay over the last ``⌊T·decay_frac⌋`` steps ending at ``decay_to`` on the last step."""
    w, d = max(1, int(total * warmup_frac)), int(total * decay_frac)
    if step < w:
        return (step + 1) / w
    if d and step >= total - d:
        return 1.0 - (1.0 - decay_to) * (step - (total - d) + 1) / d
    return 1.0


class RefAdam:
    """Kingma & Ba: ``m ← β1 m + (1−β1) g``, ``v ← β2 v + (1−β2) g²``, ``p ← p − lr m̂ / (√v̂ + ε)``."""

    def __init__(self, params: dict[str, torch.Tensor], betas: tuple[float, float]) -> None:
        self.m = {k: torch.zeros_like(v) for k, v in params.items()}
        self.v = {k: torch.zeros_like(v) for k, v in params.items()}
        self.b1, self.b2 = betas
        self.t = 0

    def step(self, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], lr: float) -> None:
        self.t += 1
        for k, g in grads.items():
            self.m[k] = self.b1 * self.m[k] + (1 - self.b1) * g
            self.v[k] = self.b2 * self.v[k] + (1 - self.b2) * g * g
            m_hat = self.m[k] / (1 - self.b1 ** self.t)
            v_hat = self.v[k] / (1 - self.b2 ** self.t)
            params[k] = params[k] - lr * m_hat / (v_hat.sqrt() + 1e-8)

    def update(self, loss: torch.Tensor, leaves: dict[str, torch.Tensor], params: dict[str, torch.Tensor],
               cfg: TrainConfig, step: int) -> float:
        """One reference optimizer step: ``loss``'s gradients of ``leaves``, clipped to ``cfg.grad_clip``, applied to
        ``params`` at the WSD schedule's learning rate of ``step``; returns that rate (what the step logs)."""
        loss.backward()
        grads = {k: v.grad.clone() for k, v in leaves.items()}
        clip(grads, cfg.grad_clip)
        lr = cfg.lr * wsd(step, cfg.total_steps, cfg.warmup_frac, cfg.decay_frac, cfg.decay_to)
        self.step(params, grads, lr)
        return lr


def clip(grads: dict[str, torch.Tensor], max_norm: float) -> None:
    """``clip_grad_norm_``: scale all gradients by ``min(1, max_norm / (‖g‖ + 1e-6))``."""
    if not max_norm:
        return
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
    c = min(1.0, max_norm / (norm + 1e-6))
    if c < 1:
        event("gradient clipped")
    for k in grads:
        grads[k] = grads[k] * c


def close(got: torch.Tensor | float, want: torch.Tensor | float, what: str, tol: float = TOL,
          floor: float | None = None) -> None:
    """``‖got − want‖ ≤ tol · max(‖want‖, floor)`` (``floor``: the scale of a quantity that is 0 in exact
    arithmetic, e.g. the Adam moments of ``b_K``, whose gradient is 0 up to rounding: softmax is shift-invariant)."""
    got_t, want_t = torch.as_tensor(got, dtype=DT), torch.as_tensor(want, dtype=DT)
    scale = max(float(want_t.norm()), floor if floor is not None else 1e-12 if want_t.numel() > 1 else 1.0)
    err = float((got_t - want_t).norm()) / scale
    assert err <= tol, f"{what}: relative error {err:.3g} (got {got}, want {want})" if want_t.numel() == 1 \
        else f"{what}: relative error {err:.3g}"

def check_state(trainer, want: dict, where: str, param_tol: dict[str, float] | None = None) -> None:
    """Every parameter, both Adam moments and the dead counters of ``trainer`` against the reference's ``want``
    (``param_tol``: a parameter's own tolerance where it is not :data:`PARAM_TOL`)."""
    params = dict(trainer.module.named_parameters())
    for name, value in want["params"].items():
        tol = (param_tol or {}).get(name, PARAM_TOL)
        close(params[name].detach(), value, f"{where}: parameter {name}", tol, floor=0.1)
        state = trainer.optimizer.state[params[name]]
        close(state["exp_avg"], want["m"][name], f"{where}: Adam m of {name}", PARAM_TOL, floor=1e-6)
        close(state["exp_avg_sq"], want["v"][name], f"{where}: Adam v of {name}", PARAM_TOL, floor=1e-12)
    assert torch.equal(trainer.tokens_since_fired.cpu(), want["counters"]), f"{where}: dead counters"



# ------------------------------------------------------------------------------------- sparse coders
@dataclass
class Case:
    kind: str            # "sae", "transcoder", "skip"
    act: str
    d_in: int
    d_out: int
    d_sae: int
    k: int
    seed: int
    steps: int
    config: dict  # TrainConfig keyword arguments; a TrainConfig once the test runs (:func:`configured`)
    resume_at: int = 0  # > 0: save a checkpoint before this step and go on from Trainer.resume


def configured(case):
    """``case`` with its ``config`` made a :class:`TrainConfig` (in the test body)."""
    if isinstance(case.config, dict):
        case.config = TrainConfig(**case.config)
    return case


def build_coder(case: Case) -> torch.nn.Module:
    params: dict = {}
    if case.act in ("topk", "abstopk", "groupmax", "batchtopk"):
        params = {"k": case.k}
    if case.act == "jumprelu":
        params = {"threshold": 0.1, "bandwidth": 0.5}  # a wide kernel: the θ gradient is non-zero
    torch.manual_seed(case.seed)
    if case.kind == "sae":
        coder = SparseAutoencoder(SAEConfig(d_in=case.d_in, d_sae=case.d_sae, activation=case.act,
                                            activation_params=params))
    else:
        cls = SkipTranscoder if case.kind == "skip" else Transcoder
        coder = cls(TranscoderConfig(d_in=case.d_in, d_out=case.d_out, d_sae=case.d_sae, activation=case.act,
                                     activation_params=params))
    coder = coder.to(DT)
    with torch.no_grad():  # non-zero biases and skip: every term of the forward is exercised
        g = torch.Generator().manual_seed(case.seed + 1)
        coder.b_enc.copy_(0.1 * torch.randn(coder.b_enc.shape, generator=g, dtype=DT))
        coder.b_dec.copy_(0.1 * torch.randn(coder.b_dec.shape, generator=g, dtype=DT))
        if case.kind == "skip":
            coder.W_skip.copy_(0.05 * torch.randn(coder.W_skip.shape, generator=g, dtype=DT))
    return coder


def reference_run(case: Case, coder: torch.nn.Module, batches: list[Batch]) -> list[dict]:
    """The reference trajectory: per step its metrics, parameters, Adam moments, counters (and θ of BatchTopK)."""
    cfg = case.config
    P = {k: v.detach().clone() for k, v in coder.named_parameters()}
    adam = RefAdam(P, cfg.betas)
    eps = float(coder.activation.bandwidth) if case.act == "jumprelu" else 0.0
    counters = torch.zeros(case.d_sae, dtype=torch.long)
    bt_theta, bt_updates = 0.0, 0
    nx = torch.cat([b.x[b.loss_mask].norm(dim=-1) for b in batches[:cfg.norm_batches]])
    s_in = math.sqrt(case.d_in) / float(nx.mean())
    ny = torch.cat([b.y[b.loss_mask].norm(dim=-1) for b in batches[:cfg.norm_batches]])
    s_out = s_in if case.kind == "sae" else math.sqrt(case.d_out) / float(ny.mean())
    normalize = cfg.normalize_decoder if cfg.normalize_decoder is not None else case.act != "jumprelu"
    out = []
    for step in range(case.steps):
        b = batches[step]
        x = b.x[b.loss_mask] * s_in
        y = b.y[b.loss_mask] * s_out
        Q = {k: v.clone().requires_grad_(True) for k, v in P.items()}
        xin = x - Q["b_dec"] if case.kind == "sae" else x
        pre = xin @ Q["W_enc"] + Q["b_enc"]
        theta = Q.get("activation.threshold")
        acts = ref_activation(case.act, pre, case.k, theta, eps)
        yhat = acts @ Q["W_dec"] + Q["b_dec"]
        if case.kind == "skip":
            yhat = yhat + x @ Q["W_skip"].T
        err = y - yhat
        mse = err.pow(2).sum(-1).mean()
        fired = (acts != 0).any(0)
        counters = counters + x.shape[0]
        counters[fired] = 0
        dead = counters >= cfg.dead_after_tokens
        aux = torch.zeros((), dtype=DT)
        sparsity = torch.zeros((), dtype=DT)
        loss = mse
        if case.act in ("topk", "batchtopk", "abstopk", "groupmax"):
            if dead.any() and cfg.aux_k_coef > 0:
                aux = ref_auxk(case.act, pre, dead, err, Q["W_dec"], cfg.aux_k or 2 * case.k)
                loss = loss + cfg.aux_k_coef * aux
                event(f"AuxK active ({case.act})")
        elif case.act == "jumprelu":
            sparsity = RefStep.apply(pre, theta, eps).sum(-1).mean()
            loss = loss + cfg.l0_coef * sparsity
        else:
            sparsity = (acts * Q["W_dec"].norm(dim=-1)).sum(-1).mean()
            loss = loss + cfg.l1_coef * sparsity
        lr = adam.update(loss, Q, P, cfg, step)
        if normalize:
            P["W_dec"] = P["W_dec"] / P["W_dec"].norm(dim=-1, keepdim=True)
        if case.act == "batchtopk":
            kept = acts.detach()[acts.detach() > 0]
            if kept.numel():
                m = float(kept.min())
                bt_theta = m if bt_updates == 0 else bt_theta + coder.activation.threshold_lr * (m - bt_theta)
                bt_updates += 1
        ref_fvu = float(err.detach().pow(2).sum() / (y - y.mean(0)).pow(2).sum())
        out.append({"metrics": {"loss": float(loss.detach()), "mse": float(mse.detach()), "fvu": ref_fvu,
                                "l0": float((acts != 0).sum(-1).to(DT).mean()),
                                "dead_frac": float(dead.to(DT).mean()), "aux": float(aux.detach()),
                                "sparsity": float(sparsity.detach()), "lr": lr},
                    "params": {k: v.clone() for k, v in P.items()},
                    "m": {k: v.clone() for k, v in adam.m.items()}, "v": {k: v.clone() for k, v in adam.v.items()},
                    "counters": counters.clone(), "s": (s_in, s_out), "bt_theta": bt_theta})
    return out


def maybe_resumed(trainer: Trainer, step: int, resume_at: int) -> Trainer:
    """At ``step == resume_at > 0``: a checkpoint round trip (``Trainer.resume``), to go on against the same
    reference; else ``trainer``."""
    if not step or step != resume_at:
        return trainer
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        trainer.save_checkpoint(d)
        event("resumed from a checkpoint")
        return Trainer.resume(d, trainer.source)


def take_step(trainer: Trainer, step: int, want: dict, resume_at: int | None, where: str,
              scales: tuple[str, str] = ("s_in", "s_out")) -> tuple[Trainer, dict]:
    """One step of ``trainer`` (resumed from a checkpoint first at ``resume_at``): ``(trainer, its metrics)``, its
    scale factors (the attributes ``scales``) checked against the reference's at the first step."""
    trainer = maybe_resumed(trainer, step, resume_at)
    got = trainer.train_step()
    if step == 0:
        for attr, value in zip(scales, want["s"], strict=True):
            close(torch.as_tensor(getattr(trainer, attr)), torch.as_tensor(value), f"{where}: {attr}")
    return trainer, got


def compare_trainer(case: Case, reference: list[dict], trainer: Trainer) -> None:
    for step, want in enumerate(reference):
        where = f"{case.kind}/{case.act} step {step}"
        trainer, got = take_step(trainer, step, want, case.resume_at, where)
        for name, value in want["metrics"].items():
            if name == "sparsity" and case.act in ("topk", "batchtopk") and case.config.sparse_kernels:
                continue  # the sparse path logs no sparsity term (there is none for TopK / BatchTopK)
            close(got[name], value, f"{where}: metric {name}", METRIC_TOL)
        check_state(trainer, want, where)
        if case.act == "batchtopk":
            close(float(trainer.module.activation.threshold), want["bt_theta"], f"{where}: BatchTopK threshold")


@st.composite
def coder_cases(draw, acts=ACTIVATIONS, kinds=KINDS, min_width: int = 2, **fixed) -> Case:
    """A drawn case; ``fixed``: TrainConfig fields set, not drawn; ``min_width``: ``d_sae ≥ min_width · k``."""
    act = draw(st.sampled_from(acts))
    kind = draw(st.sampled_from(kinds))
    d_in = draw(st.integers(3, 8))
    d_out = d_in if kind == "sae" else draw(st.integers(3, 8))
    k = draw(st.integers(1, 4))
    d_sae = k * draw(st.integers(min_width, 8))  # a multiple of k (GroupMax); > 3k: AuxK may keep fewer than the dead
    steps = draw(st.integers(1, 4))
    total = draw(st.integers(steps, 12))
    warmup = draw(st.sampled_from([0.0, 0.1, 0.3]))
    decay = draw(st.sampled_from([0.0, 0.2, 0.5]))
    config = dict(  # a TrainConfig is built in the test (its type checks draw from `random`: not in a strategy)
        total_steps=total, lr=draw(st.sampled_from([1e-3, 1e-2, 5e-2])),
        betas=(draw(st.sampled_from([0.0, 0.5, 0.9])), draw(st.sampled_from([0.9, 0.999]))),
        grad_clip=draw(st.sampled_from([0.0, 0.05, 1.0, 100.0])), warmup_frac=warmup, decay_frac=decay,
        decay_to=draw(st.sampled_from([0.0, 0.25])), norm_batches=draw(st.integers(1, 3)),
        aux_k=draw(st.sampled_from([None, 1, 3])), aux_k_coef=draw(st.sampled_from([0.0, 1 / 32, 0.5])),
        dead_after_tokens=draw(st.sampled_from([1, 5, 30, 10_000])), l1_coef=draw(st.sampled_from([0.0, 1e-3, 0.3])),
        l0_coef=draw(st.sampled_from([0.0, 1e-3, 0.3])), normalize_decoder=draw(st.sampled_from([None, True, False])),
        sparse_kernels=draw(st.booleans()), log_every=1)
    config.update(fixed)
    return Case(kind=kind, act=act, d_in=d_in, d_out=d_out, d_sae=d_sae, k=k, seed=draw(st.integers(0, 10_000)),
                steps=steps, config=config, resume_at=draw(st.integers(0, steps - 1)))


def run_case(case: Case) -> None:
    case = configured(case)
    event(f"{case.kind}/{case.act}, sparse kernels {case.config.sparse_kernels}")
    coder = build_coder(case)
    batches = padded_batches(case.seed, max(case.steps, case.config.norm_batches), 3, 5, case.d_in, case.d_out,
                             sae=case.kind == "sae")
    import copy
    reference = reference_run(case, copy.deepcopy(coder), batches)
    trainer = Trainer(coder, batches.__getitem__, case.config)
    compare_trainer(case, reference, trainer)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("act", ACTIVATIONS)
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_a_sparse_coder_step_matches_the_reference(act, kind, data):
    run_case(data.draw(coder_cases(acts=(act,), kinds=(kind,))))


@pytest.mark.parametrize("sparse_kernels", [True, False])
@pytest.mark.parametrize("act", ["topk", "batchtopk", "abstopk", "groupmax"])
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_auxk_takes_the_default_2k_of_many_dead_latents(act, sparse_kernels, data):
    """Many dead latents (every silent one, ``dead_after_tokens=1``; ``d_sae ≥ 6k``), AuxK on with its default
    ``aux_k = 2k``: the case where ``k_aux`` is not simply the dead count."""
    run_case(data.draw(coder_cases(acts=(act,), min_width=6, aux_k=None, aux_k_coef=0.5, dead_after_tokens=1,
                                   sparse_kernels=sparse_kernels)))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("act", ACTIVATIONS)
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_a_sparse_coder_step_matches_the_reference_wide(act, kind, data):
    run_case(data.draw(coder_cases(acts=(act,), kinds=(kind,))))


# ----------------------------------------------------------------------------------------------- CLT
def reference_clt_run(case: Case, n_layers: int, skip: bool, clt: CrossLayerTranscoder,
                      batches: list[Batch]) -> list[dict]:
    """A CLT (docs/training.md "Cross-layer transcoders"): per-layer factors, ``Σ_l`` of the per-layer MSE, per
    source layer the activation's term with its decoder over every layer it writes to (flattened) and the error
    over those layers; unit-norm feature rows over all targets (except JumpReLU)."""
    cfg, d, f = case.config, case.d_in, case.d_sae
    P = {k: v.detach().clone() for k, v in clt.named_parameters()}
    adam = RefAdam(P, cfg.betas)
    eps = float(clt.activation[0].bandwidth) if case.act == "jumprelu" else 0.0
    counters = torch.zeros(n_layers * f, dtype=torch.long)
    thetas, n_up = [0.0] * n_layers, [0] * n_layers
    used = batches[:cfg.norm_batches]
    s_in = [math.sqrt(d) / float(torch.cat([b.x[layer][b.loss_mask].norm(dim=-1) for b in used]).mean())
            for layer in range(n_layers)]
    s_out = [math.sqrt(d) / float(torch.cat([b.y[layer][b.loss_mask].norm(dim=-1) for b in used]).mean())
             for layer in range(n_layers)]
    normalize = cfg.normalize_decoder if cfg.normalize_decoder is not None else case.act != "jumprelu"
    out = []
    for step in range(case.steps):
        b = batches[step]
        xs = [b.x[layer][b.loss_mask] * s_in[layer] for layer in range(n_layers)]
        ys = [b.y[layer][b.loss_mask] * s_out[layer] for layer in range(n_layers)]
        n = xs[0].shape[0]
        Q = {k: v.clone().requires_grad_(True) for k, v in P.items()}
        pres = [xs[layer] @ Q["W_enc"][layer] + Q["b_enc"][layer] for layer in range(n_layers)]
        acts = [ref_activation(case.act, pres[layer], case.k, Q.get(f"activation.{layer}.threshold"), eps)
                for layer in range(n_layers)]
        errs, fvus, l0s, mse = [], [], [], torch.zeros((), dtype=DT)
        for tgt in range(n_layers):
            yhat = Q["b_dec"][tgt] + sum(acts[src] @ Q[f"W_dec_{src}"][:, tgt - src] for src in range(tgt + 1))
            if skip:
                yhat = yhat + xs[tgt] @ Q["W_skip"][tgt].T
            e = ys[tgt] - yhat
            errs.append(e)
            mse = mse + e.pow(2).sum(-1).mean()
            fvus.append(float(e.detach().pow(2).sum() / (ys[tgt] - ys[tgt].mean(0)).pow(2).sum()))
            l0s.append(float((acts[tgt] != 0).sum(-1).to(DT).mean()))
        fired = torch.cat([(a != 0).any(0) for a in acts])
        counters = counters + n
        counters[fired] = 0
        dead = (counters >= cfg.dead_after_tokens).view(n_layers, f)
        loss, aux, sparsity = mse, torch.zeros((), dtype=DT), torch.zeros((), dtype=DT)
        for src in range(n_layers):
            W = Q[f"W_dec_{src}"].reshape(f, -1)
            e_src = torch.cat(errs[src:], dim=-1)  # the error over the layers it writes to, in layer order
            if case.act in ("topk", "batchtopk", "abstopk", "groupmax"):
                if dead[src].any() and cfg.aux_k_coef > 0:
                    event(f"CLT AuxK active ({case.act})")
                    a = ref_auxk(case.act, pres[src], dead[src], e_src, W, cfg.aux_k or 2 * case.k)
                    loss, aux = loss + cfg.aux_k_coef * a, aux + a.detach()
            elif case.act == "jumprelu":
                s = RefStep.apply(pres[src], Q[f"activation.{src}.threshold"], eps).sum(-1).mean()
                loss, sparsity = loss + cfg.l0_coef * s, sparsity + s.detach()
            else:
                s = (acts[src] * W.norm(dim=-1)).sum(-1).mean()
                loss, sparsity = loss + cfg.l1_coef * s, sparsity + s.detach()
        lr = adam.update(loss, Q, P, cfg, step)
        if normalize:
            for src in range(n_layers):
                W = P[f"W_dec_{src}"]
                P[f"W_dec_{src}"] = W / W.reshape(f, -1).norm(dim=-1)[:, None, None]
        if case.act == "batchtopk":
            for layer in range(n_layers):
                kept = acts[layer].detach()[acts[layer].detach() > 0]
                if kept.numel():
                    m = float(kept.min())
                    thetas[layer] = m if n_up[layer] == 0 else \
                        thetas[layer] + clt.activation[layer].threshold_lr * (m - thetas[layer])
                    n_up[layer] += 1
        metrics = {"loss": float(loss.detach()), "mse": float(mse.detach()), "fvu": sum(fvus) / n_layers,
                   "l0": sum(l0s) / n_layers, "dead_frac": float(dead.to(DT).mean()), "aux": float(aux),
                   "sparsity": float(sparsity), "lr": lr}
        metrics.update({f"fvu_{i}": v for i, v in enumerate(fvus)})
        metrics.update({f"l0_{i}": v for i, v in enumerate(l0s)})
        out.append({"metrics": metrics, "params": {k: v.clone() for k, v in P.items()},
                    "m": {k: v.clone() for k, v in adam.m.items()}, "v": {k: v.clone() for k, v in adam.v.items()},
                    "counters": counters.clone(), "s": (s_in, s_out), "bt_theta": list(thetas)})
    return out


@st.composite
def clt_cases(draw, acts=ACTIVATIONS) -> tuple[Case, int, bool]:
    case = draw(coder_cases(acts=acts, kinds=("transcoder",)))
    case.d_out = case.d_in
    return case, draw(st.integers(1, 3)), draw(st.booleans())


def run_clt_case(drawn: tuple[Case, int, bool]) -> None:
    case, n_layers, skip = drawn
    case = configured(case)
    params: dict = {"k": case.k} if case.act in ("topk", "abstopk", "groupmax", "batchtopk") else {}
    if case.act == "jumprelu":
        params = {"threshold": 0.1, "bandwidth": 0.5}
    torch.manual_seed(case.seed)
    clt = CrossLayerTranscoder(CLTConfig(d_in=case.d_in, d_sae=case.d_sae, n_layers=n_layers, skip=skip,
                                         activation=case.act, activation_params=params)).to(DT)
    with torch.no_grad():
        g = torch.Generator().manual_seed(case.seed + 1)
        for p in (clt.b_enc, clt.b_dec) + ((clt.W_skip,) if skip else ()):
            p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=DT))
    batches = padded_batches(case.seed, max(case.steps, case.config.norm_batches), 3, 5, case.d_in, case.d_in,
                             layers=n_layers)
    import copy
    reference = reference_clt_run(case, n_layers, skip, copy.deepcopy(clt), batches)
    trainer = Trainer(clt, batches.__getitem__, case.config)
    for step, want in enumerate(reference):
        where = f"CLT/{case.act}/{n_layers} layers step {step}"
        trainer, got = take_step(trainer, step, want, case.resume_at, where, ("s_in_layers", "s_out_layers"))
        assert set(got) >= set(want["metrics"]), f"{where}: metrics {sorted(got)}"
        for name, value in want["metrics"].items():
            close(got[name], value, f"{where}: metric {name}", METRIC_TOL)
        check_state(trainer, want, where)
        if case.act == "batchtopk":
            close(torch.tensor([float(a.threshold) for a in trainer.module.activation]),
                  torch.tensor(want["bt_theta"]), f"{where}: BatchTopK thresholds")


@pytest.mark.parametrize("act", ACTIVATIONS)
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_a_clt_step_matches_the_reference(act, data):
    run_clt_case(data.draw(clt_cases(acts=(act,))))


@pytest.mark.slow
@pytest.mark.parametrize("act", ACTIVATIONS)
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_a_clt_step_matches_the_reference_wide(act, data):
    run_clt_case(data.draw(clt_cases(acts=(act,))))


# ----------------------------------------------------------------------------------------------- Lorsa
@dataclass
class LorsaCase:
    d: int
    n_qk: int
    d_qk: int
    group: int
    top_k: int
    k0: int | None
    rank_by_norm: bool
    remedy: str
    remedy_until: float
    seed: int
    steps: int
    config: dict
    resume_at: int = 0


@st.composite
def lorsa_cases(draw, remedy: str = "auxk", rank_by_norm: bool = True) -> LorsaCase:
    base = draw(coder_cases(acts=("topk",), kinds=("transcoder",)))
    n_qk, group = draw(st.integers(1, 2)), draw(st.integers(2, 4))
    top_k = draw(st.integers(1, max(1, n_qk * group // 2)))  # few heads fire: some die (AuxK)
    k0 = draw(st.one_of(st.none(), st.integers(top_k, n_qk * group)))
    return LorsaCase(d=draw(st.integers(3, 6)), n_qk=n_qk, d_qk=draw(st.integers(1, 3)), group=group, top_k=top_k,
                     k0=k0, rank_by_norm=rank_by_norm, remedy=remedy,
                     remedy_until=draw(st.sampled_from([0.0, 0.5, 1.0, 1.0])), seed=base.seed, steps=base.steps,
                     config=base.config, resume_at=base.resume_at)


def lorsa_batches(seed: int, n: int, b: int, p: int, d: int) -> list[Batch]:
    """Padded windows with the key-padding ``attn_mask`` a padded source gives (1 = real token)."""
    out = []
    for raw in padded_batches(seed, n, b, p, d, d):
        real = raw.loss_mask.clone()
        real[:, 0] = True
        out.append(Batch(raw.x, raw.y, raw.loss_mask, torch.arange(p), real.long()))
    return out


def ref_z_pre(Q: dict[str, torch.Tensor], x: torch.Tensor, attn_mask: torch.Tensor, group: int) -> torch.Tensor:
    """Lorsa paper §3: ``z^h_i = Σ_j A^{g(h)}_ij (x_j · w_v^h + b_v^h)``, ``A`` the causal softmax of ``q·k /
    √d_qk`` of QK head ``g(h) = h // group`` (no RoPE here), keys restricted to real tokens."""
    b, p, _ = x.shape
    q = torch.einsum("bpd,hde->bhpe", x, Q["W_Q"]) + Q["b_Q"][None, :, None]
    k = torch.einsum("bpd,hde->bhpe", x, Q["W_K"]) + Q["b_K"][None, :, None]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = torch.ones(p, p, dtype=torch.bool).tril()[None, None] & attn_mask.bool()[:, None, None, :]
    A = scores.masked_fill(~allowed, -math.inf).softmax(-1)                       # (b, n_qk, p, p)
    v = x @ Q["W_V"].T + Q["b_V"]                                                   # (b, p, n_ov)
    A_ov = A.repeat_interleave(group, dim=1)                                        # (b, n_ov, p, p)
    return torch.einsum("bhij,bjh->bih", A_ov, v)


def reference_lorsa_run(case: LorsaCase, lorsa: torch.nn.Module, batches: list[Batch]) -> list[dict]:
    cfg = case.config
    n_ov = case.n_qk * case.group
    P = {k: v.detach().clone() for k, v in lorsa.named_parameters()}
    adam = RefAdam(P, cfg.betas)
    counters = torch.zeros(n_ov, dtype=torch.long)
    used = batches[:cfg.norm_batches]
    s_in = math.sqrt(case.d) / float(torch.cat([b.x[b.loss_mask].norm(dim=-1) for b in used]).mean())
    s_out = math.sqrt(case.d) / float(torch.cat([b.y[b.loss_mask].norm(dim=-1) for b in used]).mean())
    out = []
    for step in range(case.steps):
        b = batches[step]
        k = case.top_k
        # LorsaRecipe.k_anneal_frac: k0 at step 0, linearly down to top_k at 30%, in exact rationals (0.3 is 3/10)
        span = Fraction(3, 10) * cfg.total_steps
        if case.k0 is not None and step < span:
            k = max(case.top_k, math.ceil(case.k0 + (case.top_k - case.k0) * Fraction(step) / span))
        Q = {kk: v.clone().requires_grad_(True) for kk, v in P.items()}
        x, y = b.x * s_in, b.y * s_out
        z_pre = ref_z_pre(Q, x, b.attn_mask, case.group)
        score = z_pre.detach() * (Q["W_O"].detach().norm(dim=1) if case.rank_by_norm else 1.0)
        keep = torch.zeros_like(z_pre, dtype=torch.bool).scatter_(-1, torch.argsort(score, -1, True)[..., :k], True)
        z = torch.where(keep, torch.clamp(z_pre, min=0), torch.zeros_like(z_pre))
        yhat = z @ Q["W_O"] + Q["b_D"]
        err = (y - yhat)[b.loss_mask]
        mse = err.pow(2).sum(-1).mean()
        active = z[b.loss_mask] != 0
        counters = counters + int(b.loss_mask.sum())
        counters[active.any(0)] = 0
        dead = counters >= cfg.dead_after_tokens
        loss, aux = mse, torch.zeros((), dtype=DT)
        if case.remedy == "auxk" and step < case.remedy_until * cfg.total_steps and dead.any() and cfg.aux_k_coef > 0:
            event("Lorsa AuxK active")
            aux = ref_auxk("topk", z_pre[b.loss_mask], dead, err, Q["W_O"], cfg.aux_k or 2 * case.top_k)
            loss = loss + cfg.aux_k_coef * aux
        lr = adam.update(loss, Q, P, cfg, step)
        if not case.rank_by_norm:  # unit-norm w_o, its norm moved into w_v, b_v (footnote 1)
            norm = P["W_O"].norm(dim=1)
            P["W_O"], P["W_V"], P["b_V"] = P["W_O"] / norm[:, None], P["W_V"] * norm[:, None], P["b_V"] * norm
        yr, yh = y[b.loss_mask], yhat.detach()[b.loss_mask]
        out.append({"metrics": {"loss": float(loss.detach()), "fvu": float((yr - yh).pow(2).sum()
                                                                           / (yr - yr.mean(0)).pow(2).sum()),
                                "l0": float(active.sum(-1).to(DT).mean()), "dead_frac": float(dead.to(DT).mean()),
                                "aux": float(aux.detach()), "k": float(k), "lr": lr},
                    "params": {kk: v.clone() for kk, v in P.items()},
                    "m": {kk: v.clone() for kk, v in adam.m.items()}, "v": {kk: v.clone() for kk, v in adam.v.items()},
                    "counters": counters.clone(), "s": (s_in, s_out)})
    return out


def run_lorsa_case(case: LorsaCase) -> None:
    import copy

    from nnsight_lorsa.modules.lorsa import Lorsa
    from nnsight_lorsa.modules.lorsa_config import LorsaConfig
    from nnsight_lorsa.training import LorsaObjective, LorsaRecipe

    case = configured(case)
    torch.manual_seed(case.seed)
    lorsa = Lorsa(LorsaConfig(d_model=case.d, n_qk_heads=case.n_qk, d_qk_head=case.d_qk,
                              n_ov_heads=case.n_qk * case.group, top_k=case.top_k)).to(DT)
    with torch.no_grad():
        g = torch.Generator().manual_seed(case.seed + 1)
        for p in (lorsa.b_Q, lorsa.b_K, lorsa.b_V, lorsa.b_D):
            p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=DT))
    batches = lorsa_batches(case.seed, max(case.steps, case.config.norm_batches), 3, 5, case.d)
    reference = reference_lorsa_run(case, copy.deepcopy(lorsa), batches)
    recipe = LorsaRecipe(ov_init="random", center_b_v=False, scale_init=False, b_d_init=False, k_anneal_from=case.k0,
                         rank_by_decoder_norm=case.rank_by_norm, dead_remedy=case.remedy,
                         remedy_until=case.remedy_until)
    trainer = Trainer(LorsaObjective(lorsa, recipe=recipe), batches.__getitem__, case.config)
    for step, want in enumerate(reference):
        where = f"Lorsa step {step}"
        trainer, got = take_step(trainer, step, want, case.resume_at, where)
        for name, value in want["metrics"].items():
            close(got[name], value, f"{where}: metric {name}", METRIC_TOL)
        # b_K's exact gradient is 0 (softmax is shift-invariant): Adam moves it by lr·g/ε with g rounding noise
        check_state(trainer, want, where, param_tol={"b_K": 1e-6})


@pytest.mark.parametrize("remedy", ["auxk", "none"])
@pytest.mark.parametrize("rank_by_norm", [True, False])
@settings(max_examples=5, deadline=None)
@given(data=st.data())
def test_a_lorsa_step_matches_the_reference(remedy, rank_by_norm, data):
    run_lorsa_case(data.draw(lorsa_cases(remedy=remedy, rank_by_norm=rank_by_norm)))


@pytest.mark.slow
@pytest.mark.parametrize("remedy", ["auxk", "none"])
@pytest.mark.parametrize("rank_by_norm", [True, False])
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_a_lorsa_step_matches_the_reference_wide(remedy, rank_by_norm, data):
    run_lorsa_case(data.draw(lorsa_cases(remedy=remedy, rank_by_norm=rank_by_norm)))


# ------------------------------------------------------------------ found by this probe (2026-11-27)
def test_an_abstopk_coder_has_no_signed_l1_and_its_negative_features_fire():
    """AbsTopK and GroupMax fell to the ReLU branch of the sparsity term: ``l1_coef · Σ acts_i ‖W_dec_i‖`` on
    AbsTopK's *signed* activations — a penalty that rewards negative activations (it was negative here) — and a
    feature counted as firing only where positive (L0, dead counters). Now they train as the k-sparse coders
    they are (AuxK against dead latents, no L1; SAELens ``abstopk``, sparsify ``groupmax``), firing = non-zero."""
    case = configured(Case(kind="transcoder", act="abstopk", d_in=6, d_out=6, d_sae=12, k=3, seed=2, steps=1,
                           config={"total_steps": 1, "l1_coef": 0.3, "aux_k_coef": 0.0, "norm_batches": 1}))
    coder = build_coder(case)
    batches = padded_batches(2, 1, 4, 6, 6, 6)
    m = Trainer(coder, batches.__getitem__, case.config).train_step()
    assert m["sparsity"] == 0.0 and m["loss"] == m["mse"]  # was: "L1" −1.71, loss = mse − 0.51
    assert m["l0"] == 3.0  # every token keeps k = 3 non-zero features; was 1.0 (the positive ones)
