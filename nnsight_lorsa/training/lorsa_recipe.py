"""How a Lorsa is trained beyond the shared loop: data-driven initialisation, k annealing, ranking,
and a dead-head remedy that works through ReLU and top-k.

:class:`LorsaRecipe` holds the settings (the defaults are the recipe measured best in
``benchmarks/lorsa_recipe.py``; each mechanism can be switched off for ablations);
:func:`init_lorsa` is the one initialisation a :class:`~.trainer.Trainer` runs for a Lorsa once the
scale factors are known, in the normalised space ``x · s_in -> y · s_out``:

1. QK copied from the MHSA (Lorsa paper App. B.3; :meth:`~..modules.lorsa.Lorsa.init_from_mhsa`).
2. OV (``ov_init``): ``"value_svd"`` — the Lorsa authors' ``init_W_V_with_active_subspace_per_head``
   (Llamascopium ``models/lorsa.py``): each OV head's ``w_v`` a random combination of the top
   ``d_head`` principal directions (SVD, demeaned) of its MHSA head's values ``x W_V^m W_V^mᵀ`` on one
   batch, and ``w_o = w_v W_V^m W_O^m`` (the OV circuit's image of ``w_v``); ``"output_svd"`` — the
   converse: ``w_o`` a random combination of the principal directions of the MHSA head's *outputs*
   ``A^m x W_V^m W_O^m`` and ``w_v = w_o (W_V^m W_O^m)ᵀ``; ``"mhsa"`` — random rank-1 slices
   ``w_v = W_V^m u``, ``w_o = u W_O^m`` (the former default); ``"random"`` — the module's random init.
3. ``b_V`` centring (``center_b_v``, the authors' ``init_encoder_bias_with_mean_hidden_pre``).
4. Output scale and ``b_D`` (``scale_init``, ``b_d_init``): ReLU and top-k are positively
   homogeneous in the values, so scaling ``w_v, b_v`` by ``c > 0`` scales every head's output by ``c``
   and keeps the selection: ``out(c) = c D + b_D``. The MSE-optimal ``c`` and ``b_D = ȳ − c D̄`` on the
   batch have a closed form — the exact optimum of the authors' grid search over the initial decoder
   norm (``initializer.py::initialization_search``), from one forward pass.

Training (in the Lorsa objective): k annealing from ``k_anneal_from`` down to ``top_k`` over the
first ``k_anneal_frac`` of the steps (the authors' ``_training_step``, linear schedule); ranking by
``z · ‖w_o‖`` without decoder renormalisation (the authors' ``sparsity_include_decoder_norm``; with
it the output scale sits in ``‖w_o‖``: "Where the output scale lives" below);
and a dead-head remedy (``dead_remedy``, applied during the first ``remedy_until`` of the steps; a
head counts as dead after ``TrainConfig.dead_after_tokens`` tokens without firing):

* ``"auxk"`` (the former default) — AuxK on post-ReLU activations (the trainer's ``aux_k_coef``, Gao et al.
  2024); it cannot revive a head whose pre-activation is negative everywhere.
* ``"ghost"`` — ghost grads (Jermyn & Templeton 2024, Anthropic circuits update): dead heads
  reconstruct the residual error with ``exp(z_pre)`` (positive, with a gradient at any
  pre-activation), rescaled to half the error's norm; weighted by ``ghost_coef`` relative to the MSE.
* ``"revive"`` — after a step, a dead head's ``w_v, b_v`` are capped at the median live head's
  ``‖w_v‖`` and ``b_v`` (which shifts ``z_pre`` at every token, attention rows summing to 1) is raised
  by the head's gap to the top-k threshold on its best token of the batch (plus ``revive_margin`` times the
  mean active selected score, or the selected scores' mean ``|score|`` when the whole Lorsa is silent there);
  with ``revive_aim`` its ``w_o`` is pointed at that token's error. Its Adam moments and dead counter
  are reset (at most one move per dead window).
* ``"resample"`` — dead heads are re-initialised toward high-error tokens (Bricken et al. 2023's
  resampling, adapted to attention): token ``i`` drawn with probability ``∝ ‖err_i‖²``, ``w_o`` the
  error's direction there, ``w_v`` the direction of the head's QK group's attention-weighted input
  at ``i`` (centred over the batch) with a typical live head's norm, ``b_v`` such that the head fires
  where that projection exceeds half of token ``i``'s; Adam moments and dead counter reset (a head whose
  token gives no direction — one counted token — is left, still dead, for the next batch).
* ``"balance"`` (default, weak and kept on to the end: ``balance_max = 0.5``, ``remedy_until = 1``) —
  frequency-based load balancing (the bias-only balancing of DeepSeek-V3's MoE
  router, made multiplicative so that it folds): the top-k ranks heads by ``z_pre · g_h`` (the output
  still uses ``z``), and each head's log-gain ``log g_h ∈ [0, balance_max]`` rises by
  ``balance_rate`` per step while its firing rate (an EMA, ``balance_ema``) is below
  ``balance_floor · k / n_ov`` and falls by ``balance_rate`` otherwise; a head under the floor at the
  largest gain whose ``z_pre`` is negative on every token of the batch gets ``b_V`` raised to fire
  there. After ``remedy_until`` the gains decay linearly to 1 by the last step; if they are still on
  (``remedy_until = 1``) folding moves them into the weights exactly (``w_v, b_v ·= g``,
  ``w_o /= g``), so the folded Lorsa's ``‖w_o^h‖ = 1/g_h`` and its ``z^h`` is the output norm times
  ``g_h``; with ``balance_hold`` the gains stop at ``remedy_until`` and are folded the same way.
* ``"none"``.

Where the output scale lives (``scale_into``; measured in ``benchmarks/results/lorsa_frontier.json``).
The closed-form scale ``c`` (about 0.4 on the embedded model's layer 2) can sit in ``w_v, b_v``
(``‖w_o‖ = 1``, renormalised after every step) or in ``‖w_o‖`` (``w_v`` of unit norm, ``w_o`` free and
heads ranked by ``z·‖w_o‖``: the split the authors' trainer ends its initialisation with — their grid
search sets ``‖w_o‖ = 0.5``, ``‖w_v‖ = 1``). The function is the same, but Adam moves every coordinate
by about ``lr`` whatever its weight's size, so with ``c`` in ``w_v`` each step changes ``w_v`` and
``b_v`` ``1/c ≈ 2.5`` times more relative to ``z``; ``b_v`` drifting negative is what leaves most dead
heads negative on every token. That is why the ``"w_v"`` split, at the same lr, ends with 8–15 points
more dead heads than ``"w_o"`` on every layer measured (embedded Llama layers 0–3, GPT-2 and NeoX;
layer 2, 600 steps, lr 4e-3: 89.3% vs 80.1% at FVU 0.0143 vs 0.0150). The default since issue 26
(``rank_by_decoder_norm=True``), together with the weak ``"balance"`` remedy.

Measured (``benchmarks/lorsa_recipe.py``, docs/training.md): the initialisation is what matters
(the closed-form scale above all). Of the remedies, a weak balance keeps many more heads alive at
about the same FVU. Its gains decaying to 1 after the remedy lets the heads they kept firing die again
on short runs (200 steps: the gains of the heads under the floor are what keeps them selected), so the
default keeps them on to the end and folds them, with the cap halved (log-gains ≤ 0.5, gains ≤ 1.65)
to hold the FVU: it dominates the Lorsa authors' trainer on all 12 layers of the head-to-head (seed 0;
at a second seed it loses on FVU on GPT-2 layer 1, where both trainers' FVU moves between seeds by more
than the gap), where the former default (cap 1, decayed from 50%) did on 4 (``remedy_until=0.5,
balance_max=1.0``; a cap of 1 kept on ends 6% above their FVU on the embedded Llama's layer 3).
Stronger balance costs fidelity (``benchmarks/results/lorsa_recipe_mechanisms.json``, docs/training.md
"Why ours killed more heads: one mechanism at a time").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import torch

from .._checks import check_instance, is_int, is_real
from .._placement import f32
from ..errors import CheckpointError, ConfigMismatchError
from ..modules.lorsa import Lorsa, _normal_

if TYPE_CHECKING:
    from ..adapters.base import MHSAWeights

__all__ = ["HeadBalance", "LorsaRecipe", "init_lorsa", "k_schedule"]

_OV_INITS = ("value_svd", "output_svd", "mhsa", "random")
_REMEDIES = ("balance", "revive", "resample", "ghost", "auxk", "none")


@dataclass
class LorsaRecipe:
    """Lorsa-specific training settings (saved in checkpoints with the trainer state).

    Attributes:
        ov_init: ``"value_svd"`` | ``"output_svd"`` | ``"mhsa"`` | ``"random"`` (module docstring);
            with no MHSA given the module's random OV init is kept.
        center_b_v: subtract each head's mean pre-activation on the init batch from ``b_V``.
        scale_init: set the output scale to its MSE optimum on the init batch (closed form).
        scale_into: where that scale ``c`` goes: ``"w_v"`` (``w_v, b_v ·= c``, ``‖w_o‖ = 1``) or
            ``"w_o"`` (``w_o ·= c``, ``‖w_v‖`` kept; the authors' split after their decoder-norm grid
            search; needs ``rank_by_decoder_norm``, else the per-step renormalisation moves it back);
            None (default): ``"w_o"`` with ``rank_by_decoder_norm``, else ``"w_v"``.
            The output and the selection are the same; Adam's steps, of about ``lr`` per coordinate
            whatever the weight's size, are not: relative to ``w_v`` they are ``1/c`` times larger with
            ``"w_v"`` (module docstring, "Where the output scale lives").
        b_d_init: set ``b_D`` to the data mean (minus the heads' mean output at the chosen scale).
        init_windows: windows of batch 0 used by the initialisation (None: all).
        k_anneal_from: initial top-k (None, or the Lorsa's ``top_k``: no annealing); annealed linearly down to
            ``top_k``. Below ``top_k`` it is refused (``ConfigMismatchError`` when the Lorsa objective is built).
        k_anneal_frac: fraction of ``total_steps`` over which k reaches ``top_k``.
        rank_by_decoder_norm: top-k ranks heads by ``z · ‖w_o‖`` and ``w_o`` is not renormalised
            during training (folding renormalises exactly); with ``scale_into=None`` the closed-form
            scale then sits in ``‖w_o‖`` (the authors' parametrisation: 8–15 points fewer dead heads at
            the same lr for 0–16% more FVU than ``False``, docs/training.md). Default True (issue 26).
        dead_remedy: ``"balance"`` (default) | ``"revive"`` | ``"resample"`` | ``"ghost"`` | ``"auxk"``
            | ``"none"``.
        remedy_until: fraction of ``total_steps`` after which the remedy stops (the heads settle);
            default 1 (``"balance"``: on to the end, the gains folded into the weights; below 1 they
            decay to 1 by the last step unless ``balance_hold``). The default before: 0.5.
        balance_floor, balance_rate, balance_ema, balance_max: the ``"balance"`` remedy's firing-rate
            floor (a fraction of ``k / n_ov``), log-gain step per step, EMA weight and log-gain cap
            (default 0.5: gains of at most ``e^0.5 ≈ 1.65``; before, 1; module docstring).
        balance_hold: after ``remedy_until`` the ``"balance"`` gains stay where the remedy left them (and
            :meth:`~.lorsa_objective.LorsaObjective.fold` moves them into the weights exactly) instead of
            decaying linearly to 1 by the last step (False: the decay).
        ghost_coef: weight of the ghost-grads loss. revive_margin: how far past the threshold a
            revived head is pushed, as a fraction of the mean active selected score (of the mean ``|score|`` of
            the selected ones when none is active: the whole Lorsa silent on the batch; :func:`revive_dead`).
            revive_aim: a revived head's ``w_o`` is also pointed at the error of its best token.

    Source: Lorsa paper (He et al. 2025) App. B; Llamascopium ``src/llamascopium/models/lorsa.py``
    (``init_W_V_with_active_subspace_per_head``).
    """

    ov_init: str = "value_svd"
    center_b_v: bool = False
    scale_init: bool = True
    scale_into: str | None = None
    b_d_init: bool = True
    init_windows: int | None = None
    k_anneal_from: int | None = None
    k_anneal_frac: float = 0.3
    rank_by_decoder_norm: bool = True
    dead_remedy: str = "balance"
    remedy_until: float = 1.0
    ghost_coef: float = 1.0
    revive_margin: float = 0.05
    revive_aim: bool = False
    balance_floor: float = 0.1
    balance_rate: float = 0.05
    balance_ema: float = 0.1
    balance_max: float = 0.5
    balance_hold: bool = False

    def __post_init__(self) -> None:
        if self.ov_init not in _OV_INITS:
            raise ConfigMismatchError(f"LorsaRecipe.ov_init must be one of {_OV_INITS}, got {self.ov_init!r}")
        if self.dead_remedy not in _REMEDIES:
            raise ConfigMismatchError(f"LorsaRecipe.dead_remedy must be one of {_REMEDIES}, got {self.dead_remedy!r}")
        for name, lo, hi in (("balance_floor", 0.0, 1.0), ("balance_ema", 0.0, 1.0), ("balance_rate", 0.0, math.inf),
                             ("balance_max", 0.0, math.inf)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo < v <= hi:
                raise ConfigMismatchError(f"LorsaRecipe.{name} must be a number in ({lo}, {hi}], got {v!r}")
        if self.scale_into not in (None, "w_v", "w_o"):
            raise ConfigMismatchError(f"LorsaRecipe.scale_into must be None, 'w_v' or 'w_o', got {self.scale_into!r}")
        if self.scale_into == "w_o" and not self.rank_by_decoder_norm:
            raise ConfigMismatchError("LorsaRecipe.scale_into='w_o' needs rank_by_decoder_norm=True (without it "
                                      "w_o is renormalised after every step, which moves the scale back into w_v)")
        # counts: a positive int or None (init_windows=-1 took all windows but the last, k_anneal_from=True was k=1)
        for name in ("k_anneal_from", "init_windows"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 1):
                raise ConfigMismatchError(f"LorsaRecipe.{name} must be None or an int >= 1, got {v!r}")
        # fractions and weights: a negative ghost_coef switched ghost grads off, a negative revive_margin pushed revived
        # heads short of the threshold, a NaN remedy_until never ran the remedy — all without a word
        for name, lo, hi in (("k_anneal_frac", 0.0, 1.0), ("remedy_until", 0.0, 1.0), ("ghost_coef", 0.0, math.inf),
                             ("revive_margin", 0.0, math.inf)):
            v = getattr(self, name)
            if not is_real(v) or not math.isfinite(v) or not lo <= v <= hi:
                raise ConfigMismatchError(f"LorsaRecipe.{name} must be a finite number in [{lo}, {hi}], got {v!r}")

    @property
    def scale_target(self) -> str:
        """Where the closed-form scale goes: ``scale_into``, or by ``rank_by_decoder_norm`` when None.

        Source: Lorsa paper (He et al. 2025) App. B; Llamascopium ``src/llamascopium/models/lorsa.py``
        (``init_W_V_with_active_subspace_per_head``).
        """
        if self.scale_into is not None:
            return self.scale_into
        return "w_o" if self.rank_by_decoder_norm else "w_v"

    def to_dict(self) -> dict[str, Any]:
        """The settings as a JSON-able dict (saved with the trainer state).

        Source: Lorsa paper (He et al. 2025) App. B; Llamascopium ``src/llamascopium/models/lorsa.py``
        (``init_W_V_with_active_subspace_per_head``).
        """
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LorsaRecipe:
        """The settings from :meth:`to_dict`'s dict; unknown keys are ignored.

        Source: Lorsa paper (He et al. 2025) App. B; Llamascopium ``src/llamascopium/models/lorsa.py``
        (``init_W_V_with_active_subspace_per_head``).
        """
        check_instance(d, Mapping, f"{cls.__name__}.from_dict", "d", " (to_dict()'s dict)")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def check_k_anneal(recipe: LorsaRecipe, top_k: int, n_ov_heads: int | None = None) -> None:
    """``k_anneal_from`` anneals *down* to ``top_k``: None or equal to ``top_k`` is no annealing; below it is refused
    (it meant no annealing without a word), and so is more than the Lorsa's ``n_ov_heads`` (given): the first
    training step's top-k would fail deep in the forward (before: ``ArgumentError`` from ``Lorsa.activation``
    after the recipe's initialisation had run).

    Raises:
        ConfigMismatchError: ``k_anneal_from < top_k`` or ``k_anneal_from > n_ov_heads``.
    """
    k0 = recipe.k_anneal_from
    if k0 is not None and k0 < top_k:
        raise ConfigMismatchError(f"LorsaRecipe.k_anneal_from={k0} is below the Lorsa's top_k={top_k}: k anneals down "
                                  f"from k_anneal_from to top_k; use k_anneal_from > {top_k} to anneal, or None "
                                  f"(or {top_k}) for none")
    if k0 is not None and n_ov_heads is not None and k0 > n_ov_heads:
        raise ConfigMismatchError(f"LorsaRecipe.k_anneal_from={k0} is above the Lorsa's n_ov_heads={n_ov_heads}: "
                                  f"the top-k keeps at most every OV head; use k_anneal_from in "
                                  f"[{top_k}, {n_ov_heads}]")


def k_schedule(step: int, total_steps: int, top_k: int, recipe: LorsaRecipe) -> int:
    """The top-k at ``step``: ``k_anneal_from`` at step 0, linearly down to ``top_k`` at
    ``k_anneal_frac · total_steps`` (each k rounded up), ``top_k`` after; ``top_k`` without annealing
    (``k_anneal_from`` None or equal to ``top_k``).

    Raises:
        ConfigMismatchError: ``k_anneal_from < top_k`` (:func:`check_k_anneal`).

    Computed in exact rationals, ``k_anneal_frac`` taken as the decimal it is written as (``0.2`` is 1/5): in
    floats ``64 − 48 · 1/1.2`` (step 1 of 6, ``k_anneal_frac=0.2``) is 24.000000000000007, rounded up to 25."""
    check_k_anneal(recipe, top_k)
    k0 = recipe.k_anneal_from
    if k0 is None or k0 == top_k:
        return top_k
    span = Fraction(repr(float(recipe.k_anneal_frac))) * total_steps
    if span <= 0 or step >= span:
        return top_k
    return max(top_k, math.ceil(k0 + (top_k - k0) * Fraction(step) / span))


class HeadBalance:
    """State of the ``"balance"`` remedy (module docstring): per-head log-gains and firing-rate EMA.

    ``log_gain, freq``: ``(n_ov,)`` float32, host-side on the CPU whatever the Lorsa's device (moved
    to it where used); ``at_stop``: the log-gains when the remedy stopped (the decay starts from them),
    or None. Saved in checkpoints as lists (:meth:`to_dict`).
    """

    def __init__(self, n_ov: int, top_k: int) -> None:
        self.log_gain = torch.zeros(n_ov, device="cpu")
        self.freq = torch.full((n_ov,), top_k / n_ov, device="cpu")
        self.at_stop: torch.Tensor | None = None

    def gain(self) -> torch.Tensor:
        """``g = exp(log_gain)``, ``(n_ov,)``."""
        return self.log_gain.exp()

    @torch.no_grad()
    def update(self, lorsa: Lorsa, recipe: LorsaRecipe, counts: torch.Tensor, z_max: torch.Tensor, n_tokens: int,
               step: int, total_steps: int) -> None:
        """One step: ``counts (n_ov,)`` firings and ``z_max (n_ov,)`` largest ``z_pre`` over the batch's
        ``n_tokens`` counted tokens; ``step`` the step just taken (0-based)."""
        self.freq.mul_(1 - recipe.balance_ema).add_(recipe.balance_ema * counts.float().cpu() / max(n_tokens, 1))
        stop = recipe.remedy_until * total_steps
        if step < stop:
            floor = recipe.balance_floor * lorsa.cfg.top_k / lorsa.cfg.n_ov_heads
            under = self.freq < floor
            self.log_gain.add_(torch.where(under, recipe.balance_rate, -recipe.balance_rate))
            self.log_gain.clamp_(0.0, recipe.balance_max)
            z_max = z_max.float().cpu()
            stuck = under & (z_max <= 0) & (self.log_gain >= recipe.balance_max)
            if bool(stuck.any()):  # no gain helps a head that is negative everywhere: raise its b_V
                lift = -z_max[stuck] + 1e-3 * float(z_max.clamp_min(0).max())
                lorsa.b_V[stuck.to(lorsa.b_V.device)] += lift.to(lorsa.b_V)
        else:
            if self.at_stop is None:
                self.at_stop = self.log_gain.clone()
            if recipe.balance_hold:  # the gains stay; the fold moves them into the weights
                return
            self.log_gain.copy_(self.at_stop * max(0.0, (total_steps - step - 1) / max(total_steps - stop, 1.0)))

    def to_dict(self) -> dict[str, Any]:
        return {"log_gain": self.log_gain.tolist(), "freq": self.freq.tolist(),
                "at_stop": None if self.at_stop is None else self.at_stop.tolist()}

    @classmethod
    def from_dict(cls, d: dict[str, Any], n_ov: int, top_k: int, where: str) -> HeadBalance:
        """Rebuild from :meth:`to_dict`; raises CheckpointError naming ``where`` if it does not fit."""
        out = cls(n_ov, top_k)
        try:
            out.log_gain = torch.tensor(d["log_gain"], dtype=torch.float32, device="cpu")
            out.freq = torch.tensor(d["freq"], dtype=torch.float32, device="cpu")
            out.at_stop = None if d.get("at_stop") is None else torch.tensor(d["at_stop"], dtype=torch.float32,
                                                                                device="cpu")
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: head_balance is malformed ({e})") from None
        for t in (out.log_gain, out.freq, out.at_stop):
            if t is not None and (t.shape != (n_ov,) or not bool(torch.isfinite(t).all())):
                raise CheckpointError(f"{where}: head_balance must hold {n_ov} finite values per entry")
        return out


def _principal_directions(coeffs: torch.Tensor, basis: torch.Tensor, n: int) -> torch.Tensor:
    """The top ``n`` right singular vectors ``(min(n, tokens, e, d), d)`` of the demeaned rows of
    ``values = coeffs @ basis`` (``coeffs (tokens, e)``, ``basis (e, d)``: one MHSA head's values or outputs, of
    rank ``≤ e = d_head``; fewer than ``n`` rows where there are fewer tokens, or ``d < e``), each signed so
    that its largest-magnitude entry is positive: an SVD's signs are arbitrary and differ between LAPACK (CPU)
    and cuSOLVER (CUDA), and the init mixes these rows with random coefficients, so without a fixed sign the
    same data and draws would give a different Lorsa on each device.

    Computed in float64 without forming ``values``: with ``basisᵀ = Q R`` (thin QR, ``Q (d, e)`` orthonormal),
    ``values = (coeffs Rᵀ) Qᵀ``, so its right singular vectors are ``Q`` times those of the ``(tokens, e)``
    matrix ``coeffs Rᵀ`` — an SVD ``d / e`` times smaller than of ``(tokens, d)`` (32× at d_model 4096, head 128;
    the full one also ran LAPACK's divide-and-conquer with nested OpenMP teams, once 1009 threads on a CPU)."""
    c = coeffs.double()
    c = c - c.mean(0, keepdim=True)
    q, r = torch.linalg.qr(basis.double().T)              # basisᵀ = q r: (d, e), (e, e)
    _, _, vh = torch.linalg.svd(c @ r.T, full_matrices=False)
    vh = vh[:n] @ q.T                                      # (n, d): orthonormal rows in the span of basis's rows
    sign = vh.gather(1, vh.abs().argmax(1, keepdim=True)).sign()
    return (vh * torch.where(sign == 0, torch.ones_like(sign), sign)).float()


@torch.no_grad()
def _init_ov(lorsa: Lorsa, mhsa: MHSAWeights, x: torch.Tensor, loss_mask: torch.Tensor, s_in: float, s_out: float,
             mode: str, generator: torch.Generator | None, positions: torch.Tensor | None = None,
             attn_mask: torch.Tensor | None = None) -> None:
    """OV by ``mode`` (``"value_svd"`` / ``"output_svd"``) in the normalised space, from the ``loss_mask``
    tokens of ``x (b, s, d)`` (on the Lorsa's device). Computed in fp32 on ``x``'s device one MHSA
    head at a time (the MHSA weights of that head moved there), each head's ``w_v, w_o`` written into
    the Lorsa's rows directly; ``c`` drawn on ``generator``'s device (the CPU without one)."""
    cfg = lorsa.cfg
    n_heads = mhsa.n_heads
    rep = cfg.n_qk_heads // n_heads
    per_head = cfg.n_ov_heads // n_heads
    kv_rep = n_heads // mhsa.W_K.shape[0]
    where = x.device
    gen_device = generator.device if generator is not None else torch.device("cpu")
    xf = x[loss_mask].float()                                            # the counted tokens only
    for m in range(n_heads):
        W_V = mhsa.W_V[m // kv_rep].to(where, torch.float32) / s_in      # acts on x·s_in
        W_O = mhsa.W_O[m].to(where, torch.float32) * s_out               # writes y·s_out
        ov = W_V @ W_O                                                   # (d_model, d_model)
        c = torch.randn(per_head, cfg.d_qk_head, generator=generator, device=gen_device).to(where)
        # the basis has min(d_head, counted tokens, d_model) rows: a first batch with fewer counted tokens than
        # d_head, or d_head > d_model, has fewer principal directions (c @ basis was a bare shape RuntimeError):
        # combine those (c's first columns: the same draws, the data's whole span)
        if mode == "value_svd":
            basis = _principal_directions(xf @ W_V, W_V.T, cfg.d_qk_head)    # of x W_V W_Vᵀ
            w_v = c[:, :basis.shape[0]] @ basis
            w_o = w_v @ ov
        else:  # output_svd: the head's outputs A^m (x W_V^m) W_O^m, A^m from the copied QK head
            pattern = lorsa.attention_pattern(x, [m * rep], positions, attn_mask)[:, 0].float()   # (b, s, s)
            heads = pattern @ (x.float() @ W_V)                 # (b, s, d_head): the head's output is heads @ W_O
            basis = _principal_directions(heads[loss_mask], W_O, cfg.d_qk_head)
            w_o = c[:, :basis.shape[0]] @ basis
            w_v = w_o @ ov.T
        rows = slice(m * per_head, (m + 1) * per_head)
        lorsa.W_V[rows].copy_(w_v / w_v.norm(dim=1, keepdim=True).clamp_min(1e-12))
        lorsa.W_O[rows].copy_(w_o / w_o.norm(dim=1, keepdim=True).clamp_min(1e-12))
    lorsa.b_V.zero_()


@torch.no_grad()
def init_lorsa(lorsa: Lorsa, x: torch.Tensor, y: torch.Tensor, loss_mask: torch.Tensor, *, s_in: float,
               s_out: float, mhsa: MHSAWeights | None = None, recipe: LorsaRecipe | None = None,
               top_k: int | None = None, generator: torch.Generator | None = None,
               positions: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None) -> dict[str, float]:
    """Initialise ``lorsa`` (training-space weights) from the MHSA and one batch; see the module docstring.

    Args:
        lorsa: the Lorsa to initialise in place (it acts on ``x · s_in`` and writes ``y · s_out``).
        x, y: ``(batch, pos, d_model)`` raw attention input / output of one batch (any device and float
            dtype: moved to the Lorsa's device and cast to its dtype; the fits are computed in fp32 / fp64).
        loss_mask: ``(batch, pos)`` bool, the tokens that count (BOS and padding excluded).
        s_in, s_out: the trainer's dataset-norm factors. mhsa: the layer's MHSA (None: QK and OV
            keep their random init). recipe: the settings (default :class:`LorsaRecipe`).
        top_k: the k in force at step 0 (k annealing), default ``cfg.top_k``.
        positions, attn_mask: the batch's RoPE positions and key-padding mask (as for the Lorsa forward).
        generator: the random draws' generator (its device; default the CPU's): the same init on every device.

    Returns:
        ``{"scale": c, "fvu_init": FVU on the batch after the initialisation}``.

    Raises:
        ShapeError: an MHSA that does not fit the Lorsa (:meth:`~..modules.lorsa.Lorsa.init_from_mhsa`).
    """
    recipe = recipe or LorsaRecipe()
    if recipe.init_windows is not None:
        n = recipe.init_windows
        x, y, loss_mask = x[:n], y[:n], loss_mask[:n]
        if positions is not None and positions.dim() == 2:
            positions = positions[:n]
        if attn_mask is not None:
            attn_mask = attn_mask[:n]
    dev, dt = lorsa.W_O.device, lorsa.W_O.dtype
    loss_mask = loss_mask.to(dev)
    positions = None if positions is None else positions.to(dev)
    attn_mask = None if attn_mask is None else attn_mask.to(dev)
    xn = x.to(dev, dt) * s_in
    yn = y.to(dev, dt) * s_out
    if mhsa is not None:
        lorsa.init_from_mhsa(mhsa, generator=generator)
        for w in (lorsa.W_Q, lorsa.W_K, lorsa.W_V):
            w.div_(s_in)
        if recipe.ov_init in ("value_svd", "output_svd"):
            _init_ov(lorsa, mhsa, xn, loss_mask, s_in, s_out, recipe.ov_init, generator, positions, attn_mask)
        elif recipe.ov_init == "random":
            _normal_(lorsa.W_V, lorsa.cfg.n_ov_heads ** -0.5, generator)
            _normal_(lorsa.W_O, lorsa.cfg.d_model ** -0.5, generator)
            lorsa.b_V.zero_()
        lorsa.normalize_decoder_()
    if recipe.center_b_v:
        z_pre = lorsa.compute_z_pre(xn, positions, attn_mask)[loss_mask]
        lorsa.b_V.sub_(z_pre.mean(0))
    scale = 1.0
    if recipe.scale_init or recipe.b_d_init:
        if lorsa.b_D is not None:
            lorsa.b_D.zero_()
        z, _ = lorsa.activation(lorsa.compute_z_pre(xn, positions, attn_mask), top_k)
        D = (z @ lorsa.W_O)[loss_mask].double()
        t = yn[loss_mask].double()
        fit_bias = recipe.b_d_init and lorsa.b_D is not None
        Dc = D - D.mean(0) if fit_bias else D
        tc = t - t.mean(0) if fit_bias else t
        if recipe.scale_init:
            denom = float(Dc.pow(2).sum())
            scale = float((Dc * tc).sum()) / denom if denom > 0 else 1.0
            if not scale > 0:  # no positive scale helps: keep the heads as they are
                scale = 1.0
            if recipe.scale_target == "w_o":  # the same output and selection (all ‖w_o‖ scaled alike)
                lorsa.W_O.mul_(scale)
            else:
                lorsa.W_V.mul_(scale)
                lorsa.b_V.mul_(scale)
        if fit_bias:
            assert lorsa.b_D is not None
            lorsa.b_D.copy_((t.mean(0) - scale * D.mean(0)).to(lorsa.b_D))
    out = f32(lorsa(xn, positions, attn_mask, top_k=top_k))
    yf = f32(yn)
    err = (yf - out)[loss_mask]
    fvu0 = float(err.pow(2).sum() / (yf[loss_mask] - yf[loss_mask].mean(0)).pow(2).sum().clamp_min(1e-30))
    return {"scale": scale, "fvu_init": fvu0}


def ghost_loss(z_pre: torch.Tensor, dead: torch.Tensor, err: torch.Tensor, W_O: torch.Tensor,
               mean: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Ghost-grads loss: dead heads' ``exp(z_pre)`` decode the error ``err (n, d)`` (detached), rescaled
    to half its norm per token; normalised by ``‖err‖²``. ``z_pre (n, n_ov)``, ``dead (n_ov,)`` bool.
    No head dead: the ghost is the empty sum, 0, and the loss 1 (no gradient). ``mean``: the normaliser's mean of
    the per-token ``‖err‖² (n,)`` (default: this batch's; the trainer passes
    :meth:`~.trainer.Trainer.batch_mean`, the global batch's under data parallelism)."""
    e = err.detach()
    zd = z_pre[:, dead]
    # exp(z − max_h z) per token: the rescaling to half the error's norm cancels any per-token factor (value and
    # gradient), and the largest term is 1, so no pre-activation, however negative, underflows the ghost to nothing
    # (the shift was max(z, 0): below about −28 the ghost's norm fell under the 1e-12 clamp, below −87 in fp32 exp
    # underflowed — no gradient where ghost grads are for); the −inf column keeps it defined when no head is dead
    shift = torch.cat([zd.detach(), zd.new_full((zd.shape[0], 1), -torch.inf)], -1).amax(-1, keepdim=True)
    ghost = torch.exp(zd - shift) @ W_O[dead]
    scale = (e.norm(dim=-1, keepdim=True) / (2 * ghost.detach().norm(dim=-1, keepdim=True).clamp_min(1e-12)))
    sq = e.pow(2).sum(-1)
    return (ghost * scale - e).pow(2).sum(-1).mean() / (sq.mean() if mean is None else mean(sq)).clamp_min(1e-12)


@torch.no_grad()
def revive_dead(lorsa: Lorsa, z_pre: torch.Tensor, dead: torch.Tensor, k: int, margin: float,
                norms: torch.Tensor | None = None, err: torch.Tensor | None = None) -> torch.Tensor:
    """Move the ``dead (n_ov,)`` heads back into the top-``k`` on their best token of one batch.

    ``z_pre (n, n_ov)``: the training-space pre-activations of the batch's tokens; ``norms (n_ov,)``:
    the decoder norms when heads are ranked by ``z · ‖w_o‖`` (else None). A dead head's ``w_v, b_v``
    are first scaled down to at most the median live head's ``‖w_v‖`` (so that repeated revivals
    cannot grow them), then ``b_v`` is raised by the gap to the top-``k`` threshold at its best token
    plus ``margin`` times the mean selected score (ReLU'd: the mean active score). When no selected score of
    the batch is above 0 (the whole Lorsa silent there) that mean is 0 and would leave the head at exactly 0,
    not firing: the margin is then a fraction of the mean ``|score|`` of the selected ones (1 if those are all
    0), so that with ``margin > 0`` the head always ends above the threshold and above 0 at its best token
    (``margin = 0``: exactly at the threshold). Returns the indices of the moved heads (the caller
    resets their dead counters and optimiser state, so each head is moved at most once per dead window).
    With ``err (n, d)`` (the batch's errors), ``w_o`` is set to the error direction at that token.
    """
    idx = dead.nonzero().flatten()
    if idx.numel() == 0:
        return idx
    scores = z_pre if norms is None else z_pre * norms
    top = scores.topk(k, dim=-1).values
    threshold = top[:, -1].clamp_min(0)                                  # must beat the k-th and be > 0
    w_norm = lorsa.W_V.norm(dim=1)
    alive = ~dead
    cap = w_norm[alive].median() if bool(alive.any()) else w_norm.median()
    f = (cap / w_norm[idx].clamp_min(1e-12)).clamp(max=1.0)
    z_dead = f * z_pre[:, idx]                                           # after scaling w_v and b_v by f
    unit = torch.ones_like(f) if norms is None else norms[idx].clamp_min(1e-12)
    gap, best = (threshold[:, None] / unit - z_dead).min(0)
    ref = top.clamp_min(0).mean()                                        # the mean active selected score
    if not bool(ref > 0):  # the whole Lorsa silent on the batch: the selected scores' size (was 0: no firing)
        ref = top.abs().mean()
        if not bool(ref > 0):
            ref = torch.ones_like(ref)
    push = gap.clamp_min(0) + margin * ref / unit
    lorsa.W_V[idx] *= f[:, None].to(lorsa.W_V.dtype)
    lorsa.b_V[idx] = (f * lorsa.b_V[idx] + push).to(lorsa.b_V.dtype)
    if err is not None:
        e = err[best].float()
        lorsa.W_O[idx] = (e / e.norm(dim=-1, keepdim=True).clamp_min(1e-12) * lorsa.W_O[idx].norm(dim=-1,
                          keepdim=True)).to(lorsa.W_O)
    return idx


@torch.no_grad()
def resample_dead(lorsa: Lorsa, x: torch.Tensor, err: torch.Tensor, loss_mask: torch.Tensor, dead: torch.Tensor,
                  generator: torch.Generator | None = None, positions: torch.Tensor | None = None,
                  attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Re-initialise the ``dead (n_ov,)`` heads toward high-error tokens of one batch (module docstring).

    ``x (b, s, d)`` the training-space input, ``err (b, s, d)`` the error ``y − ŷ`` (training space),
    ``loss_mask (b, s)`` (all on the Lorsa's device); ``positions`` and ``attn_mask`` the batch's RoPE positions
    and key-padding mask, as for the Lorsa forward (:meth:`~..modules.lorsa.Lorsa.attention_pattern`): only the
    counted tokens are drawn and averaged, and they attend to real tokens only, so the values at padded positions
    never count (until 2026-11-27 the pattern was computed without them: left-padded tokens attended to the
    padding before them). The tokens are drawn on ``generator``'s device
    (the CPU without one), so the draw does not depend on the Lorsa's. Returns the indices of the
    re-initialised heads. A head whose drawn token gives no direction — its attended input equal to the
    mean over the counted tokens, as when the batch counts a single token — is left as it was and not
    returned (it was given ``w_v = 0``, ``b_v = 0``: never firing, and reported re-initialised, so its dead
    counter was reset); the caller keeps counting it dead and the next batch tries again.
    """
    idx = dead.nonzero().flatten()
    if idx.numel() == 0:
        return idx
    x = x.to(lorsa.W_Q.dtype)  # the weights' dtype (fp32 masters of a bf16 Lorsa inside the trainer's edits)
    pos = loss_mask.nonzero()                                            # (n, 2) token coordinates
    e = err[loss_mask].float()
    weights = e.pow(2).sum(-1)
    if not bool(torch.isfinite(weights).all()) or float(weights.sum()) <= 0:
        return idx[:0]
    gen_device = generator.device if generator is not None else torch.device("cpu")
    pick = torch.multinomial((weights / weights.sum()).to(gen_device), idx.numel(), replacement=True,
                             generator=generator).to(weights.device)
    groups = idx // lorsa.cfg.group_size
    pattern = lorsa.attention_pattern(x, None, positions, attn_mask)     # (b, n_qk, s, s)
    xbar = pattern.float() @ x[:, None].float()                                  # (b, n_qk, s, d): attended input
    mu = (xbar * loss_mask[:, None, :, None]).sum((0, 2)) / loss_mask.sum()   # (n_qk, d): mean over tokens
    b_i, s_i = pos[pick, 0], pos[pick, 1]
    at = xbar[b_i, groups, s_i]
    dirs = at - mu[groups]                                               # (n_dead, d)
    # no direction (one counted token: x̄_i is the mean; or several with the same attended input): leave the head
    # (the difference of two equal fp32 sums is rounding, a few ulps of their size: not a direction)
    tiny = 64 * torch.finfo(torch.float32).eps * torch.maximum(at.norm(dim=-1), mu[groups].norm(dim=-1))
    real = dirs.norm(dim=-1) > tiny
    idx, groups, pick, dirs = idx[real], groups[real], pick[real], dirs[real]
    if idx.numel() == 0:
        return idx
    alive = ~dead
    norm = lorsa.W_V[alive].norm(dim=-1).median() if bool(alive.any()) else lorsa.W_V.norm(dim=-1).median()
    w_v = dirs / dirs.norm(dim=-1, keepdim=True).clamp_min(1e-12) * norm.float()   # a typical live head's norm
    e_pick = e[pick]
    # z_t = (x̄_t − μ)·w_v + b_v: the head fires where the projection exceeds half of token i's
    proj = (dirs * w_v).sum(-1)
    lorsa.W_V[idx] = w_v.to(lorsa.W_V)
    lorsa.b_V[idx] = (-(mu[groups] * w_v).sum(-1) - 0.5 * proj).to(lorsa.b_V)
    lorsa.W_O[idx] = (e_pick / e_pick.norm(dim=-1, keepdim=True).clamp_min(1e-12)).to(lorsa.W_O)
    return idx
