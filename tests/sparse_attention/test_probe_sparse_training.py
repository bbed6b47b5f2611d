"""Independent probe of sparse-attention post-training against plain-torch references (Draye et al. 2025 §3).

Every reference here is written from the paper's formulas and the documented conventions, not from the
library's helpers: the GECO rule (§3.2, Eq. 5, with the EMA / clamp of :mod:`~nnsight_lorsa.sparse_attention.geco`'s
docstring), one ``train_step`` (CE + λ (CE − τ) + the expected open-edge fraction of Eq. 3, a hand-written
gradient clip and AdamW on a deep copy), ``evaluate_sparse`` (a forward of an *ungated* copy of the model with
the eval gate ``A = [q·k/√d + b > 0]`` of Eq. 1-2 applied by hand in an attention function of this file),
checkpoint resume, and gates fully open / saved and loaded. See docs/reliability.md, "Sparse-attention training
probe (2026-11-27)".
"""

from __future__ import annotations

import copy
import json
import math
import warnings

import pytest
import torch
from helpers import random_ids, tiny_hf_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnsight_lorsa.errors import GateConfigError, NonFiniteError
from nnsight_lorsa.sparse_attention import evaluate_sparse, install_gated_attention, load_gates
from nnsight_lorsa.sparse_attention.geco import GECO
from nnsight_lorsa.sparse_attention.install import expected_edge_fraction, get_gates
from nnsight_lorsa.sparse_attention.io import save_gates
from nnsight_lorsa.sparse_attention.train import SparseAttentionTrainer, SparseTrainConfig
from nnsight_lorsa.training import TokenDataset

FAST = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BOS = 1  # the tiny Llama's config.bos_token_id (EOS is 2: streams draw from 3 … 127)


# ---------------------------------------------------------------------------------------------------------------
# 1. GECO: c_ema ← α c_ema + (1 − α) c (first step c_ema = c);  λ ← clamp(λ · exp(lr · c_ema), λ_min, λ_max)
# ---------------------------------------------------------------------------------------------------------------
def _geco_reference(target, lr, ema, lam, lo, hi, losses):
    out, c_ema = [], None
    for loss in losses:
        c = loss - target
        c_ema = c if c_ema is None else ema * c_ema + (1 - ema) * c
        lam = min(hi, max(lo, lam * math.exp(min(lr * c_ema, 700.0))))  # exp overflow: clamped to hi anyway
        out.append(lam)
    return out


_geco_args = st.fixed_dictionaries({
    "target": st.floats(0.5, 6.0), "lr": st.floats(0.01, 5.0), "ema": st.sampled_from([0.0, 0.5, 0.9, 0.99]),
    "log_lo": st.floats(-6, 0), "log_span": st.floats(0, 8), "init_frac": st.floats(0, 1)})


def _geco_case(a):
    lo = 10 ** a["log_lo"]
    hi = lo * 10 ** a["log_span"]
    init = lo * (hi / lo) ** a["init_frac"]
    return a["target"], a["lr"], a["ema"], min(max(init, lo), hi), lo, hi


def _check_geco(a, losses, split):
    target, lr, ema, init, lo, hi = _geco_case(a)
    want = _geco_reference(target, lr, ema, init, lo, hi, losses)
    g = GECO(target, lr=lr, ema=ema, init_lambda=init, min_lambda=lo, max_lambda=hi)
    got = [g.update(x) for x in losses]
    for w, v in zip(want, got, strict=True):
        assert lo <= v <= hi
        assert v == pytest.approx(w, rel=1e-9), (want, got)
    # a state_dict round trip (through JSON, as checkpoints store it) mid-sequence continues bit for bit
    first = GECO(target, lr=lr, ema=ema, init_lambda=init, min_lambda=lo, max_lambda=hi)
    for x in losses[:split]:
        first.update(x)
    resumed = GECO(target + 1.0, lr=lr * 2, ema=0.0, init_lambda=hi, min_lambda=lo, max_lambda=hi)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert [resumed.update(x) for x in losses[split:]] == got[split:]
    assert resumed.state_dict() == g.state_dict()


@FAST
@given(_geco_args, st.lists(st.floats(0.0, 12.0), min_size=1, max_size=25), st.data())
def test_geco_follows_the_ema_and_clamped_multiplicative_rule(a, losses, data) -> None:
    _check_geco(a, losses, data.draw(st.integers(0, len(losses))))


@pytest.mark.slow
@SLOW
@given(_geco_args, st.lists(st.floats(0.0, 12.0), min_size=1, max_size=60), st.data())
def test_geco_rule_sweep(a, losses, data) -> None:
    _check_geco(a, losses, data.draw(st.integers(0, len(losses))))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_geco_refuses_a_non_finite_loss_and_keeps_its_state(bad) -> None:
    """Found by this probe: ``update(nan)`` set λ to ``min_lambda`` and the EMA to NaN for good (every later λ
    ``min_lambda`` whatever the loss), ``update(inf)`` pinned λ at ``max_lambda`` for good — with no error."""
    g = GECO(3.0, lr=1.0, ema=0.9)
    g.update(3.5)
    before = g.state_dict()
    with pytest.raises(NonFiniteError, match="loss"):
        g.update(bad)
    assert g.state_dict() == before
    assert g.update(4.0) > before["lam"]  # still follows the constraint


@pytest.mark.parametrize("kw", [{"target": math.nan}, {"target": math.inf}, {"lr": math.inf}, {"lr": math.nan},
                                {"max_lambda": math.inf}, {"ema": math.nan}])
def test_geco_refuses_non_finite_settings(kw) -> None:
    """Found by this probe: ``target=nan`` (or ``lr=inf``) drove λ silently to ``min_lambda``; ``max_lambda=inf``
    raised a bare ``OverflowError`` from ``math.exp`` at the first update above τ."""
    args = {"target": 3.0, **kw}
    with pytest.raises(GateConfigError):
        GECO(**args)
    state = GECO(3.0).state_dict()
    key = next(iter(kw))
    with pytest.raises(GateConfigError):
        GECO(3.0).load_state_dict({**state, key: kw[key]})


# ---------------------------------------------------------------------------------------------------------------
# 2. one train_step against a hand-written Lagrangian, gradient clip and AdamW on a deep copy
# ---------------------------------------------------------------------------------------------------------------
def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def _ce(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """Σ −log p(ids[:, j+1] | ids[:, :j+1]) over the predicted tokens the mask keeps; and their count."""
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    keep = torch.ones_like(nll, dtype=torch.bool) if mask is None else mask[:, 1:].bool()
    return nll[keep].sum(), int(keep.sum())


class _Capture:
    """Forward hooks on a model: its input ids, its logits and each gate's (scores, output)."""

    def __init__(self, hf: torch.nn.Module) -> None:
        self.ids: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.scores: dict[int, torch.Tensor] = {}
        self.gates: dict[int, torch.Tensor] = {}
        self.handles = [hf.register_forward_hook(self._model, with_kwargs=True)]
        for layer, gate in get_gates(hf).items():
            self.handles.append(gate.register_forward_hook(self._gate(layer)))

    def _gate(self, layer: int):
        def hook(m, args, out) -> None:  # returns None: the output is left as it is
            self.scores[layer], self.gates[layer] = args[0], out
        return hook

    def _model(self, m, args, kwargs, out):
        self.ids.append(kwargs["input_ids"])
        self.logits.append(out.logits)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _unpadded(mask: torch.Tensor | None, n: int, batch: int) -> torch.Tensor:
    """``(batch, n)`` bool: each window's positions up to its last counted one (every position without a mask):
    the documented real tokens, whose query rows alone count edges (right padding after them does not)."""
    if mask is None:
        return torch.ones(batch, n, dtype=torch.bool)
    return torch.tensor([[j <= max([i for i in range(n) if row[i]], default=-1) for j in range(n)]
                         for row in mask.tolist()], dtype=torch.bool)


def _density(cap: _Capture, hf: torch.nn.Module, n: int, batch: int,
             mask: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """(Σ_l Σ_heads Σ_allowed σ(score + b) / #allowed — Eq. 3 over every layer, normalised;  active fraction),
    the allowed edges those of the real tokens' query rows (:func:`_unpadded`)."""
    allowed = _causal(n)[None, None] & _unpadded(mask, n, batch)[:, None, :, None]
    num, act, den = 0.0, 0.0, 0.0
    for layer, gate in get_gates(hf).items():
        logit = cap.scores[layer].float() + gate.bias.float()[None, :, None, None]
        num = num + torch.sigmoid(logit).masked_fill(~allowed, 0.0).sum()
        act += float(((cap.gates[layer] != 0) & allowed).sum())
        den += float(allowed.sum()) * gate.bias.numel()
    return num / den, act / den


def _adamw(params, grads, state, lr, betas, wd, eps=1e-8):
    """torch.optim.AdamW's documented rule, by hand (decoupled weight decay, bias-corrected moments)."""
    b1, b2 = betas
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            if g is None:
                continue
            s = state.setdefault(id(p), {"t": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)})
            s["t"] += 1
            p.mul_(1 - lr * wd)
            s["m"] = b1 * s["m"] + (1 - b1) * g
            s["v"] = b2 * s["v"] + (1 - b2) * g * g
            mhat = s["m"] / (1 - b1 ** s["t"])
            vhat = s["v"] / (1 - b2 ** s["t"])
            p.sub_(lr * mhat / (vhat.sqrt() + eps))


_train_args = st.fixed_dictionaries({
    "data": st.sampled_from(["stream", "documents"]), "lora": st.booleans(), "steps": st.integers(1, 4),
    "init_bias": st.sampled_from([-0.5, 0.5, 2.0]), "lr": st.sampled_from([1e-4, 1e-3, 1e-2]),
    "gate_lr": st.sampled_from([1e-2, 5e-2]), "grad_clip": st.sampled_from([0.0, 0.05, 1.0]),
    "weight_decay": st.sampled_from([0.0, 0.1]), "init_lambda": st.sampled_from([0.5, 1.0, 8.0]),
    "target_ce": st.sampled_from([None, 4.0, 6.0]), "target_margin": st.sampled_from([0.0, 0.2]),
    "decay_frac": st.sampled_from([0.0, 0.75]), "recover_fraction": st.sampled_from([0.0, 0.4]),
    "geco_ema": st.sampled_from([0.0, 0.9]), "seed": st.integers(0, 3)})


def _documents(seed: int, n: int = 6, seq: int = 12) -> TokenDataset:
    """Windows ``[BOS] + doc`` right-padded (pad id 0) with their ``target_mask``, lengths 3 … seq."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 128, (n, seq), generator=g)
    tokens[:, 0] = BOS
    lengths = torch.randint(3, seq + 1, (n,), generator=g)
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    return TokenDataset(tokens.masked_fill(~mask, 0), mask)


def _make_trainer(a, total: int):
    hf = tiny_hf_model("llama")
    data = (torch.randint(3, 128, (300,), generator=torch.Generator().manual_seed(a["seed"])) if a["data"] == "stream"
            else _documents(a["seed"]))
    cfg = SparseTrainConfig(
        total_steps=total, batch_size=3, seq_len=12, target_batches=1, lora_rank=2 if a["lora"] else None,
        allow_slack_constraint=True, **{k: a[k] for k in (
            "init_bias", "lr", "gate_lr", "grad_clip", "weight_decay", "init_lambda", "target_ce", "target_margin",
            "decay_frac", "recover_fraction", "geco_ema", "seed")})
    cap = _Capture.__new__(_Capture)  # the constructor's τ measurement (eval mode), before gates exist
    cap.ids, cap.logits = [], []
    handle = hf.register_forward_hook(cap._model, with_kwargs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = SparseAttentionTrainer(hf, data, cfg)
    handle.remove()
    return tr, data, cap


def _mask_of(x: torch.Tensor, data) -> torch.Tensor | None:
    """The target mask of the windows ``x`` (each checked to be a window of the data: BOS + stream slice, or a
    dataset row)."""
    assert bool((x[:, 0] == BOS).all())
    if isinstance(data, TokenDataset):
        rows = [int(((data.tokens == r).all(1)).nonzero()[0]) for r in x]
        return data.target_mask[rows]
    s = data.tolist()
    for r in x[:, 1:].tolist():
        assert any(s[i:i + len(r)] == r for i in range(len(s) - len(r) + 1))
    return None


def _check_train_steps(a) -> None:
    if a["lora"]:
        pytest.importorskip("peft")
    total = 4
    tr, data, cap0 = _make_trainer(a, total)
    cfg = tr.config
    # τ: the given target, or the base CE on the first training batch (eval mode), minus the margin
    base = [_ce(lg, x, _mask_of(x, data)) for lg, x in zip(cap0.logits, cap0.ids, strict=True)]
    base_ce = float(sum(s for s, _ in base) / sum(k for _, k in base))
    assert tr.base_ce == pytest.approx(base_ce, rel=1e-5)
    tau = (base_ce if a["target_ce"] is None else a["target_ce"]) - a["target_margin"]
    assert tr.geco.target == pytest.approx(tau, rel=1e-5)
    tau = tr.geco.target

    ref = copy.deepcopy(tr.hf)
    names = [n for n, p in ref.named_parameters() if p.requires_grad]
    assert names == tr.param_names
    trainable = {n: p for n, p in ref.named_parameters() if p.requires_grad}
    frozen0 = {n: p.detach().clone() for n, p in tr.hf.named_parameters() if not p.requires_grad}
    if a["lora"]:
        assert frozen0 and all("lora_" not in n for n in frozen0)
        assert all("lora_" in n or n.endswith("gate.bias") for n in names)
    adam: dict = {}
    seen: list[list[torch.Tensor | None]] = []  # the gradients each optimizer.step of the trainer used
    by_id = {id(p): n for n, p in tr.hf.named_parameters()}
    step_fn = tr.optimizer.step

    def recording_step(*args, **kwargs):
        grads = {by_id[id(p)]: (None if p.grad is None else p.grad.detach().clone())
                 for group in tr.optimizer.param_groups for p in group["params"]}
        seen.append([grads[n] for n in names])
        return step_fn(*args, **kwargs)

    tr.optimizer.step = recording_step
    lam, c_ema = a["init_lambda"], None
    for step in range(a["steps"]):
        # the last int(total · decay_frac) steps decay linearly to 10% (on the last step); until 2026-11-29 one
        # step late, the decay's first step at 100% and its last at 1 − 0.9·(n−1)/n
        n_decay = int(total * a["decay_frac"])
        start = total - n_decay
        factor = 1.0 if n_decay == 0 or step < start else 1 - 0.9 * (step - start + 1) / n_decay
        recovering = a["recover_fraction"] > 0 and step >= total * (1 - a["recover_fraction"])
        rng = torch.get_rng_state()
        gates0 = {n: p.detach().clone() for n, p in tr.hf.named_parameters() if n.endswith("gate.bias")}
        live = _Capture(tr.hf)
        rec = tr.train_step()
        live.remove()
        x = live.ids[0]
        mask = _mask_of(x, data)
        # the reference: the same forward (same RNG state: the same gate noise) on the deep copy
        torch.set_rng_state(rng)
        ref.train()
        if recovering:  # the documented recovery phase: deterministic gates, the CE alone
            for g in get_gates(ref).values():
                g.eval()
        rcap = _Capture(ref)
        logits = ref(input_ids=x).logits
        rcap.remove()
        ce_sum, count = _ce(logits, x, mask)
        ce = ce_sum / count
        density, active = _density(rcap, ref, x.shape[1], x.shape[0], mask)
        loss = ce if recovering else density + lam * (ce - tau)
        grads = torch.autograd.grad(loss, list(trainable.values()), allow_unused=True)
        grads = [None if g is None else g.float() for g in grads]
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads if g is not None))
        if cfg.grad_clip > 0 and norm + 1e-6 > cfg.grad_clip:
            grads = [None if g is None else g * (cfg.grad_clip / (norm + 1e-6)) for g in grads]
        # the gradients the trainer stepped with (after its clip) are the reference's, up to rounding: the same
        # forward, our loss formula (a near-zero entry is a sum of cancelling terms: an absolute bound)
        scale = max([float(g.abs().max()) for g in grads if g is not None] + [1e-30])
        for n, g, h in zip(names, grads, seen[-1], strict=True):
            assert (g is None) == (h is None), (step, n)
            if g is not None:
                assert float((g - h).abs().max()) <= 1e-4 * scale + 1e-9, (step, n, float((g - h).abs().max()), scale)
        # AdamW by hand with those gradients moves the copy as the trainer moved its model
        for group_gate in (False, True):
            sel = [i for i, n in enumerate(names) if n.endswith("gate.bias") == group_gate]
            _adamw([trainable[names[i]] for i in sel], [seen[-1][i] for i in sel], adam,
                   (cfg.gate_lr if group_gate else cfg.lr) * factor, cfg.betas, 0.0 if group_gate else cfg.weight_decay)
        c = float(ce.detach()) - tau
        c_ema = c if c_ema is None else a["geco_ema"] * c_ema + (1 - a["geco_ema"]) * c
        lam = min(cfg.max_lambda, max(cfg.min_lambda, lam * math.exp(cfg.geco_lr * c_ema)))
        # the logged numbers
        assert rec.step == step + 1
        assert rec.ce == pytest.approx(float(ce.detach()), rel=1e-5)
        assert rec.expected_fraction == pytest.approx(float(density.detach()), rel=1e-5)
        assert rec.active_fraction == pytest.approx(active, rel=1e-6)  # an fp32 ratio
        assert rec.lam == pytest.approx(lam, rel=1e-5)
        lam = rec.lam  # carry the trainer's λ (its CE differs from ours by rounding only)
        # the step: every trainable parameter as the reference moved it; the frozen ones bit for bit
        got = dict(tr.hf.named_parameters())
        for n in names:
            tol = (cfg.gate_lr if n.endswith("gate.bias") else cfg.lr) * factor * 1e-4 + 1e-7
            diff = float((got[n].detach() - trainable[n].detach()).abs().max())
            assert diff <= tol, (step, n, diff, tol)
        for n, p in frozen0.items():
            assert torch.equal(got[n], p), n
        if recovering:  # no gradient reaches the gates: their biases stay bit for bit
            for n, p in gates0.items():
                assert torch.equal(got[n], p), n


@FAST
@given(_train_args)
def test_train_step_matches_a_hand_written_lagrangian_and_adamw(a) -> None:
    _check_train_steps(a)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_train_args)
def test_a_model_deep_copies_after_training_steps(a) -> None:
    """``copy.deepcopy`` of the model after gated training steps (failed before the fix: each gate kept its last
    forward's non-leaf ``expected_edges_grad``, which ``deepcopy`` refuses). The copy computes what the model does —
    eval and training forwards (the same RNG state: the same gate noise), the sparsity term and its gradient — and
    its gradients reach its own gates only; the model trains on afterwards."""
    if a["lora"]:
        pytest.importorskip("peft")
    tr, _, _ = _make_trainer(a, 4)
    for _ in range(min(a["steps"], 2)):
        tr.train_step()
    assert any(g.expected_edges_grad is not None for g in get_gates(tr.hf).values())   # what made deepcopy fail
    twin = copy.deepcopy(tr.hf)
    for n, p in twin.named_parameters():
        assert torch.equal(p, dict(tr.hf.named_parameters())[n]), n
    x = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(a["seed"]))
    x[:, 0] = BOS
    for m in (tr.hf, twin):
        m.eval()
    with torch.no_grad():
        assert torch.equal(twin(input_ids=x).logits, tr.hf(input_ids=x).logits)
    fractions, grads = [], []
    for m in (tr.hf, twin):
        m.train()
        m.zero_grad(set_to_none=True)
        torch.manual_seed(a["seed"])
        logits = m(input_ids=x).logits
        frac = expected_edge_fraction(m)
        (frac + logits.float().pow(2).mean()).backward()
        fractions.append((logits.detach(), frac.detach()))
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if n.endswith("gate.bias")})
    assert torch.equal(fractions[0][0], fractions[1][0]) and torch.equal(fractions[0][1], fractions[1][1])
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n
    tr.hf.zero_grad(set_to_none=True)
    rec = tr.train_step()
    assert math.isfinite(rec.ce)


@pytest.mark.slow
@SLOW
@given(_train_args)
def test_train_step_sweep(a) -> None:
    _check_train_steps(a)


# ---------------------------------------------------------------------------------------------------------------
# 3. evaluate_sparse against an ungated copy with the eval gate A = [q·k/√d + b > 0] applied by hand
# ---------------------------------------------------------------------------------------------------------------
REF_IMPL = "nnsight_lorsa_probe_reference_gate"
_REF: dict = {}  # layer -> bias, and the running edge counts of the reference forward


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eq. 2 in eval mode for a causal model without padding masks: ``([s + b > 0] ⊙ softmax(s)) V``,
    ``s = q·kᵀ·scaling``, with the per-head bias ``b`` of this layer (or the top-k / dense gate); counts Eq. 3's
    Σσ(s + b)."""
    n_rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
    s = torch.matmul(query, key.transpose(2, 3)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    allowed = _causal(s.shape[-1])[-s.shape[-2]:]
    probs = torch.softmax(s.masked_fill(~allowed, -math.inf), dim=-1)
    real = _REF.get("real")  # the windows' real query rows: the edges counted (right padding's are not)
    counted = allowed[None, None] if real is None else allowed[None, None] & real[:, None, -s.shape[-2]:, None]
    logit = s + _REF["bias"][module.layer_idx][None, :, None, None]
    if _REF["mode"] == "gated":
        gate = ((logit > 0) & allowed).to(s.dtype)
    elif _REF["mode"] == "dense":
        gate = allowed.expand_as(s).to(s.dtype)
    else:  # top-k baseline (paper Fig. 2a): the k largest weights of each query row (all of a shorter row)
        vals = s.masked_fill(~allowed, -math.inf)
        k = min(_REF["top_k"], s.shape[-1])
        kth = vals.sort(dim=-1, descending=True).values[..., k - 1: k]
        gate = ((vals >= kth) & allowed).to(s.dtype)
    counted = counted.expand_as(s)
    _REF["expected"] += float(torch.sigmoid(logit).masked_fill(~counted, 0).sum())
    _REF["active"] += float((gate.bool() & counted).sum())
    _REF["possible"] += float(counted.sum())
    w = gate * probs
    return torch.matmul(w, value).transpose(1, 2).contiguous(), w


def _reference_model(biases: dict[int, torch.Tensor], mode: str = "gated", top_k: int = 1) -> torch.nn.Module:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(REF_IMPL, _reference_attention)
    AttentionMaskInterface.register(REF_IMPL, eager_mask)
    model = tiny_hf_model("llama")
    model.set_attn_implementation(REF_IMPL)
    _REF["bias"] = biases
    _REF["mode"], _REF["top_k"] = mode, top_k
    return model


_bias = st.one_of(st.floats(-0.05, 0.05), st.sampled_from([-3.0, 3.0]))
_eval_args = st.fixed_dictionaries({
    "biases": st.lists(_bias, min_size=12, max_size=12), "seq_len": st.integers(3, 14),
    "batch_size": st.integers(1, 5), "data": st.sampled_from(["stream", "documents"]),
    "length": st.integers(2, 90), "max_windows": st.one_of(st.none(), st.integers(1, 6)),
    "bos": st.sampled_from([None, "config", "given"]), "seed": st.integers(0, 100),
    "mode": st.sampled_from(["gated", "gated", "topk", "dense"]), "top_k": st.integers(1, 4)})


def _check_evaluate(a) -> None:
    biases = {layer: torch.tensor(a["biases"][4 * layer: 4 * layer + 4]) for layer in range(3)}
    model = tiny_hf_model("llama")
    install_gated_attention(model, init_bias=0.0, mode=a["mode"], top_k=a["top_k"])
    with torch.no_grad():
        for layer, gate in get_gates(model).items():
            gate.bias.copy_(biases[layer])
    seq, g = a["seq_len"], torch.Generator().manual_seed(a["seed"])
    kwargs: dict = {"seq_len": seq, "batch_size": a["batch_size"], "max_windows": a["max_windows"]}
    bos = BOS
    if a["bos"] == "config":
        bos = model.config.bos_token_id = 7
    elif a["bos"] == "given":
        bos = kwargs["bos_id"] = 9
    if a["data"] == "stream":
        stream = torch.randint(10, 128, (a["length"],), generator=g)
        body = seq - 1
        n = a["length"] // body
        if n == 0 or (a["max_windows"] is not None and a["max_windows"] < 1):
            with pytest.raises(GateConfigError):
                evaluate_sparse(model, stream, **kwargs)
            return
        windows = torch.cat([torch.full((n, 1), bos), stream[: n * body].view(n, body)], dim=1)
        mask = None
        got = evaluate_sparse(model, stream, **kwargs)
    else:
        ds = _documents(a["seed"], n=1 + a["length"] % 7, seq=seq)
        windows, mask = ds.tokens, ds.target_mask
        got = evaluate_sparse(model, ds, **kwargs)
    n = len(windows) if a["max_windows"] is None else min(len(windows), a["max_windows"])
    windows = windows[:n]
    mask = None if mask is None else mask[:n]
    ref = _reference_model(biases, a["mode"], a["top_k"])
    _REF.update(expected=0.0, active=0.0, possible=0.0, real=None if mask is None else _unpadded(mask, seq, n))
    with torch.no_grad():
        ce_sum, count = _ce(ref(input_ids=windows).logits, windows, mask)
    assert got["windows"] == n and got["tokens"] == count
    assert got["ce"] == pytest.approx(float(ce_sum) / count, rel=1e-5)
    assert got["active_fraction"] == pytest.approx(_REF["active"] / _REF["possible"], rel=1e-6)  # an fp32 ratio
    assert got["expected_fraction"] == pytest.approx(_REF["expected"] / _REF["possible"], rel=1e-5)
    per_head = torch.tensor(got["active_fraction_per_head"])
    assert per_head.shape == (3, 4) and bool(((per_head >= 0) & (per_head <= 1)).all())


@FAST
@given(_eval_args)
def test_evaluate_sparse_matches_a_hand_gated_forward(a) -> None:
    _check_evaluate(a)


@pytest.mark.slow
@SLOW
@given(_eval_args)
def test_evaluate_sparse_sweep(a) -> None:
    _check_evaluate(a)


def test_evaluate_sparse_takes_the_tokenizers_bos_before_the_configs() -> None:
    """resolve_bos_id: ``bos_id`` given, else the (nnsight) model's tokenizer's, else its config's."""
    from helpers import tiny_nnsight

    from nnsight_lorsa.sparse_attention.train import resolve_bos_id

    model, hf = tiny_nnsight("llama")
    assert hf.config.bos_token_id == 1 and model.tokenizer.bos_token_id == 0
    install_gated_attention(hf, init_bias=0.02)
    assert resolve_bos_id(model) == 0 and resolve_bos_id(hf) == 1 and resolve_bos_id(model, 5) == 5
    stream = torch.randint(10, 128, (40,), generator=torch.Generator().manual_seed(0))
    got = evaluate_sparse(model, stream, seq_len=8, batch_size=2)
    assert got == evaluate_sparse(hf, stream, seq_len=8, batch_size=2, bos_id=0)
    assert got != evaluate_sparse(hf, stream, seq_len=8, batch_size=2)


# ---------------------------------------------------------------------------------------------------------------
# 4. checkpoint resume: k steps + save + load + m steps == k + m steps, bit for bit
# ---------------------------------------------------------------------------------------------------------------
_resume_args = st.fixed_dictionaries({
    "data": st.sampled_from(["stream", "documents"]), "lora": st.booleans(), "k": st.integers(1, 3),
    "m": st.integers(1, 2), "decay_frac": st.sampled_from([0.0, 0.5]), "recover_fraction": st.sampled_from([0.0, 0.3]),
    "seed": st.integers(0, 3)})


def _check_resume(a, tmp_path) -> None:
    if a["lora"]:
        pytest.importorskip("peft")
    base = {"init_bias": 1.0, "lr": 1e-3, "gate_lr": 5e-2, "grad_clip": 1.0, "weight_decay": 0.0, "init_lambda": 1.0,
            "target_ce": 5.0, "target_margin": 0.0, "geco_ema": 0.9, **a}
    total = a["k"] + a["m"]
    straight, _, _ = _make_trainer(base, total)
    straight.train(total, progress=False)
    first, _, _ = _make_trainer(base, total)
    first.train(a["k"], progress=False)
    first.save_checkpoint(tmp_path)
    del first
    torch.manual_seed(12345)  # whatever the global RNG holds meanwhile
    resumed, _, _ = _make_trainer(base, total)
    resumed.load_checkpoint(tmp_path)
    resumed.train(a["m"], progress=False)
    for (n, p), (_, q) in zip(straight.hf.named_parameters(), resumed.hf.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert straight.history == resumed.history
    assert straight.geco.state_dict() == resumed.geco.state_dict()
    sa, sb = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for key in sa[i]:
            assert torch.equal(torch.as_tensor(sa[i][key]), torch.as_tensor(sb[i][key])), (i, key)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(a=_resume_args)
def test_checkpoint_resume_is_bit_exact_for_generated_configs(a, tmp_path_factory) -> None:
    _check_resume(a, tmp_path_factory.mktemp("ckpt"))


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(a=_resume_args)
def test_checkpoint_resume_sweep(a, tmp_path_factory) -> None:
    _check_resume(a, tmp_path_factory.mktemp("ckpt"))


# ---------------------------------------------------------------------------------------------------------------
# 5. gates fully open == the unmodified model; gate files round trip
# ---------------------------------------------------------------------------------------------------------------
@FAST
@given(st.sampled_from(["llama", "gpt2", "neox", "qwen3", "gemma2", "olmo2", "phi3", "gemma"]), st.integers(1, 3),
       st.integers(2, 12),
       st.integers(0, 11), st.booleans(), st.integers(0, 50))
def test_open_gates_equal_the_unmodified_model(family, batch, seq, pad, training, seed) -> None:
    pad = min(pad, seq - 1)
    model = tiny_hf_model(family)
    for m in model.modules():  # GPT-2's dropouts (0.1) would differ in training mode: not the gates' doing
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    ids = random_ids(batch=batch, seq=seq, seed=seed)
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0  # left padding on the first row
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    install_gated_attention(model, init_bias=30.0)  # σ(30 + s) = 1 − 1e-13: a sample closes no edge
    model.train(training)
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
    model.eval()
    real = mask.bool()
    rel = float((got - want)[real].abs().max() / want[real].abs().max())
    assert rel < 1e-5, rel


@FAST
@given(biases=st.lists(st.floats(-20, 20, width=32), min_size=12, max_size=12), temperature=st.floats(0.1, 4.0),
       mode=st.sampled_from(["gated", "topk", "dense"]), top_k=st.integers(1, 5))
def test_gate_files_round_trip(biases, temperature, mode, top_k, tmp_path_factory) -> None:
    model = tiny_hf_model("llama")
    install_gated_attention(model, init_bias=0.0, temperature=temperature, mode=mode, top_k=top_k)
    with torch.no_grad():
        for layer, gate in get_gates(model).items():
            gate.bias.copy_(torch.tensor(biases[4 * layer: 4 * layer + 4]))
    d = save_gates(model, tmp_path_factory.mktemp("gates"))
    other = tiny_hf_model("llama", seed=1)
    loaded = load_gates(other, d)
    for layer, gate in get_gates(model).items():
        assert torch.equal(loaded[layer].bias, gate.bias)
        assert (loaded[layer].mode, loaded[layer].top_k, loaded[layer].temperature) == (mode, top_k, temperature)


@pytest.mark.parametrize("init_bias", [0.0, 2.0])
def test_tau_is_the_base_models_ce_with_every_edge_open(init_bias):
    """``target_ce=None``: τ = ``base_ce`` is the CE of the model before sparsification on the τ windows. It was
    measured through the gates as installed, whose eval rule closes the edges with ``logit ≤ 0`` (at ``init_bias=0``
    about half the tiny model's edges): τ came out above the base model's CE. Reference: a copy of the model taken
    before the gates were installed, on the same windows (drawn as the trainer draws them)."""
    from nnsight_lorsa.training.metrics import next_token_ce

    hf = tiny_hf_model("llama")
    dense = copy.deepcopy(hf).eval()
    cfg = SparseTrainConfig(total_steps=2, batch_size=3, seq_len=12, target_batches=2, init_bias=init_bias,
                            allow_slack_constraint=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = SparseAttentionTrainer(hf, torch.randint(3, 128, (300,), generator=torch.Generator().manual_seed(4)),
                                    cfg)
    gen = torch.Generator(device="cpu").manual_seed(cfg.seed + 1)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(cfg.target_batches):
            x, mask = tr._batch(i, gen)
            ce, n = next_token_ce(dense(input_ids=x).logits, x, mask)
            total, count = total + float(ce), count + n
    assert tr.base_ce == pytest.approx(total / count, rel=1e-6)
    assert tr.geco.target == pytest.approx(total / count, rel=1e-6)
    assert all(g.mode == "gated" for g in get_gates(tr.hf).values())  # the gates' mode is back
    if init_bias == 0.0:  # the gated eval CE differs here: the test tells the two apart
        assert abs(tr.measure_train_ce(cfg.target_batches) - tr.base_ce) > 1e-4
