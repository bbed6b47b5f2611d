"""The Lorsa's training objective (Lorsa paper (He et al. 2025) §3.2): MSE of the Lorsa output against the
MHSA output in the normalised space, AuxK against dead heads, unit-norm ``w_o``; the recipe
(:mod:`.lorsa_recipe`) initialises it. The trainer picks it through :mod:`.objectives`."""

from __future__ import annotations

from typing import Any

import torch

from .._placement import f32
from ..errors import CheckpointError, ConfigMismatchError, TooFewTokensError
from ..modules.lorsa import Lorsa
from ..modules.lorsa_config import LorsaConfig
from .activations import Batch
from .lorsa_recipe import (
    HeadBalance,
    LorsaRecipe,
    check_k_anneal,
    ghost_loss,
    init_lorsa,
    k_schedule,
    resample_dead,
    revive_dead,
)
from .metrics import fvu
from .objective_base import (
    Metrics,
    TrainingState,
    _check_module,
    _Objective,
    _require_norms,
    fold_rows,
    row_norms,
)


# --------------------------------------------------------------------------- Lorsa
class LorsaObjective(_Objective):
    """A Lorsa's objective; the Lorsa-specific recipe (initialisation, k annealing, ranking, dead-head
    remedy) is a :class:`~.lorsa_recipe.LorsaRecipe` (:mod:`.lorsa_recipe`).

    Give it to the trainer in the module's place to set what only a Lorsa has
    (``Trainer(LorsaObjective(lorsa, mhsa=..., recipe=...), source, config)``; a bare Lorsa gets the defaults).

    Args:
        module: the :class:`~..modules.lorsa.Lorsa` to train.
        mhsa: the MHSA weights (``adapter.mhsa_weights(hf, layer)``) to initialise QK and OV from (App. B.3)
            once the norms are known; may live where the model does. None: the recipe's data-driven init only.
        recipe: its initialisation, k annealing, ranking and dead-head remedy (default: the measured
            recipe). Saved in checkpoints (a resumed trainer takes the saved one).

    Raises:
        TypeError: ``module`` is not a Lorsa.
        ConfigMismatchError: the recipe's ``k_anneal_from`` is below the Lorsa's ``top_k`` or above its
            ``n_ov_heads``; a JumpReLU Lorsa (``cfg.activation == "jumprelu"``, read from Llamascopium's files:
            its thresholds would need their straight-through estimator, which this trainer does not have).

    Source: Lorsa paper (He et al. 2025) §3.2; Llamascopium ``src/llamascopium/models/lorsa.py``.
    """

    desc = "Lorsa"
    weights_file = "lorsa.safetensors"
    config_key = "lorsa_config"
    module_type = Lorsa

    def __init__(self, module: Any, mhsa: Any = None, recipe: LorsaRecipe | None = None) -> None:
        # ``module: Any``: a module of another type reaches the named check (ArgumentError), not a type hook
        _check_module(type(self), module)
        if module.cfg.activation != "topk":
            raise ConfigMismatchError(
                f"LorsaObjective: the Lorsa's activation is {module.cfg.activation!r}; this trainer trains top-k "
                "Lorsas (the paper's), not learned JumpReLU thresholds (Llamascopium's straight-through estimator). "
                "Train a top-k Lorsa, or train this one with Llamascopium")
        super().__init__(module)
        self.mhsa = mhsa
        self.recipe = recipe or LorsaRecipe()
        check_k_anneal(self.recipe, int(module.cfg.top_k), int(module.cfg.n_ov_heads))
        self.init_info: dict[str, float] = {}
        self._last: tuple[torch.Tensor, torch.Tensor, int, torch.Tensor] | None = None
        #: (x, err, loss_mask, dead, positions, attn_mask) of the batch the ``resample`` remedy draws from
        self._resample: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
                              torch.Tensor | None] | None = None
        self.balance: HeadBalance | None = None        # dead_remedy="balance"
        self._fired: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def n_latents(self) -> int:
        return int(self.module.cfg.n_ov_heads)

    def check_source(self, source: Any) -> None:
        # a cached source has no positions: the Lorsa's default arange(pos) (windows start at position 0)
        no_positions = getattr(source, "positions_site", True) is None and getattr(source, "cache", None) is None
        if getattr(source, "stacked", False) or no_positions:
            raise ConfigMismatchError("a Lorsa trains on one layer's attention input/output with positions: "
                                      "use ActivationSource.attention(model, layer, …) or an activation cache")

    def top_k(self, t: TrainingState) -> int:
        """The top-k in force at the trainer's step (k annealing).

        Source: Lorsa paper (He et al. 2025) §3.2; Llamascopium ``src/llamascopium/models/lorsa.py``.
        """
        return k_schedule(t.step, t.config.total_steps, self.module.cfg.top_k, self.recipe)

    def check_init_batch(self, t: TrainingState) -> None:
        """The recipe's initialisation fits on the counted tokens of batch 0 (its first ``init_windows``):
        at least ``d_qk_head`` for the SVD OV initialisations (one basis vector per token), else at least one.

        Source: Lorsa paper (He et al. 2025) §3.2; Llamascopium ``src/llamascopium/models/lorsa.py``.
        """
        b = t.source(0)
        n_win = self.recipe.init_windows
        mask = b.loss_mask if n_win is None else b.loss_mask[:n_win]
        have = int(mask.sum())
        svd = self.mhsa is not None and self.recipe.ov_init in ("value_svd", "output_svd")
        need = int(self.module.cfg.d_qk_head) if svd else 1
        if have < need:
            why = (f"the Lorsa recipe's OV initialisation (ov_init={self.recipe.ov_init!r}) needs at least "
                   f"d_qk_head={need} counted tokens" if svd
                   else "the Lorsa recipe's initialisation needs a counted token")
            windows = f"{mask.shape[0]} window{'s' if mask.shape[0] != 1 else ''} of {mask.shape[1]} positions"
            raise TooFewTokensError(f"{why} in the first batch; it has {have} ({windows}; BOS and padding are not "
                                    "counted): use more or longer windows per batch (the demo: raise --batch-size or "
                                    "--seq-len)" + (", or LorsaRecipe(ov_init='mhsa')" if svd else ""))

    def discard_step(self, t: TrainingState) -> None:
        self._last = self._resample = self._fired = None

    def after_norms(self, t: TrainingState) -> None:
        lorsa = self.module
        b = t.source(0).to(lorsa.W_O.device, lorsa.W_O.dtype)
        self.init_info = init_lorsa(self.module, b.x, b.y, b.loss_mask, s_in=self.s_in, s_out=self.s_out,
                                    mhsa=self.mhsa, recipe=self.recipe, top_k=self.top_k(t),
                                    positions=b.positions, attn_mask=b.attn_mask)

    def post_step(self, t: TrainingState) -> None:
        lorsa = self.module
        moved = None
        if self._last is not None:
            z_pre, dead, k, err = self._last
            norms = lorsa.W_O.detach().norm(dim=1) if self.recipe.rank_by_decoder_norm else None
            moved = revive_dead(lorsa, z_pre, dead, k, self.recipe.revive_margin, norms,
                                err if self.recipe.revive_aim else None)
        if self._fired is not None:
            counts, z_max, n = self._fired
            if self.balance is None:
                self.balance = HeadBalance(lorsa.cfg.n_ov_heads, lorsa.cfg.top_k)
            self.balance.update(lorsa, self.recipe, counts, z_max, n, t.step, t.config.total_steps)
            self._fired = None
        if self._resample is not None:
            x, err, mask, dead, positions, attn_mask = self._resample
            moved = resample_dead(lorsa, x, err, mask, dead, torch.Generator(device="cpu").manual_seed(t.step),
                                  positions=positions, attn_mask=attn_mask)
        self._last = self._resample = None
        if moved is not None and t.dist is not None:  # each rank edited from its shard: all take rank 0's edit
            moved = t.dist.broadcast_edit((lorsa.W_V, lorsa.b_V, lorsa.W_O), moved, lorsa.cfg.n_ov_heads)
        if moved is not None and moved.numel():
            t.reset_latents((lorsa.W_V, lorsa.b_V, lorsa.W_O), moved)
        if not self.recipe.rank_by_decoder_norm:
            lorsa.normalize_decoder_()

    def module_config(self) -> dict[str, Any]:
        """The Lorsa's config as a dict, saved in checkpoints.

        Source: Lorsa paper (He et al. 2025) §3.2; Llamascopium ``src/llamascopium/models/lorsa.py``.
        """
        return self.module.cfg.to_dict()

    @classmethod
    def build_module(cls, meta: dict[str, Any]) -> torch.nn.Module:
        """A fresh :class:`~nnsight_lorsa.modules.lorsa.Lorsa` from a checkpoint's metadata. Raises
        :class:`~nnsight_lorsa.errors.CheckpointError` on unknown config keys.

        Source: Lorsa paper (He et al. 2025) §3.2; Llamascopium ``src/llamascopium/models/lorsa.py``.
        """
        return Lorsa(LorsaConfig.from_dict(meta[cls.config_key]))

    def save_meta(self, t: TrainingState) -> dict[str, Any]:
        meta: dict[str, Any] = {"lorsa_recipe": self.recipe.to_dict()}
        if self.balance is not None:
            meta["head_balance"] = self.balance.to_dict()
        return meta

    def restore_meta(self, t: TrainingState, meta: dict[str, Any], path: Any) -> None:
        recipe, balance = self.recipe, self.balance
        if "lorsa_recipe" in meta:
            try:  # until 2026-11-28 a malformed recipe raised ConfigMismatchError / AttributeError with nothing of path
                recipe = LorsaRecipe.from_dict(meta["lorsa_recipe"])
            except (ConfigMismatchError, AttributeError, TypeError) as e:
                raise CheckpointError(f"{path}: key 'lorsa_recipe' is malformed ({e})") from e
        if "head_balance" in meta:
            cfg = self.module.cfg
            balance = HeadBalance.from_dict(meta["head_balance"], cfg.n_ov_heads, cfg.top_k, str(path))
        self.recipe, self.balance = recipe, balance

    def loss(self, t: TrainingState, batch: Batch) -> tuple[torch.Tensor, Metrics]:
        lorsa, recipe = self.module, self.recipe
        batch = batch.to(lorsa.W_O.device, lorsa.W_O.dtype)
        x = batch.x * self.s_in
        y = batch.y * self.s_out
        k = self.top_k(t)
        z_pre = lorsa.compute_z_pre(x, batch.positions, batch.attn_mask)
        z = self.select(z_pre, k)
        out = lorsa.decode(z)
        mask = batch.loss_mask
        err = (f32(y) - f32(out))[mask]                                   # the loss in fp32
        mse = err.pow(2).sum(-1).mean()
        loss = mse
        active = z[mask] > 0
        dead = t.count_fired(active.any(0), int(mask.sum()))
        aux = torch.zeros((), dtype=mse.dtype, device=mse.device)
        remedy = recipe.dead_remedy if t.step < recipe.remedy_until * t.config.total_steps else "none"
        if remedy == "auxk":
            aux = t.aux_k_loss(z_pre[mask], dead, err, lorsa.W_O, 2 * lorsa.cfg.top_k)
            if t.config.aux_k_coef > 0 and dead.any():
                loss = loss + t.config.aux_k_coef * aux
        elif remedy == "ghost" and dead.any() and recipe.ghost_coef > 0:
            aux = ghost_loss(z_pre[mask], dead, err, lorsa.W_O, t.batch_mean)
            if t.dist is None:  # rescaled to the MSE's size
                ratio = mse.detach() / aux.detach().clamp_min(1e-12)
            else:  # the global batch's MSE and ghost loss (each rank's own ratio weighted the ranks' gradients
                n = int(mask.sum())  # unevenly until 2026-11-28: the ranks' sum was not one process's gradient)
                ratio = t.batch_mean(err.detach().pow(2).sum(-1)) / \
                    t.batch_mean(aux.detach().expand(n)).clamp_min(1e-12)
            loss = loss + recipe.ghost_coef * aux * ratio
        elif remedy == "revive" and dead.any():
            self._last = (z_pre[mask].detach(), dead.clone(), k, err.detach())
        elif remedy == "resample" and dead.any():
            self._resample = (x.detach(), (y - out).detach(), mask, dead.clone(), batch.positions, batch.attn_mask)
        if recipe.dead_remedy == "balance":
            zp = z_pre.detach()[mask]
            z_max = zp.amax(0) if zp.shape[0] else torch.full_like(z_pre[0, 0], -torch.inf)
            stats = (active.sum(0), z_max, int(mask.sum()))
            self._fired = stats if t.dist is None else t.dist.combine_counts(*stats)
        return loss, {"loss": float(loss.detach()), "fvu": float(fvu(y[mask], out[mask].detach())),
                      "l0": float(active.sum(-1).float().mean()), "dead_frac": float(dead.float().mean()),
                      "aux": float(aux.detach()), "k": float(k)}

    def select(self, z_pre: torch.Tensor, k: int) -> torch.Tensor:
        """The training-time activation: per token the ``k`` heads of largest ``z_pre · g`` (``g`` =
        :meth:`selection_gain`; plain ``z_pre`` when None), their ``relu(z_pre)``, zeros elsewhere.
        ``z_pre (…, n_ov)`` on the Lorsa's device and dtype; returns the same shape.

        Source: Lorsa paper (He et al. 2025) §3.2; Llamascopium ``src/llamascopium/models/lorsa.py``.
        """
        gain = self.selection_gain()
        if gain is None:
            return self.module.activation(z_pre, k)[0]
        idx = (z_pre.detach() * gain).topk(k, dim=-1).indices  # rank by z·g (‖w_o‖ and/or balance; folded exactly)
        return torch.zeros_like(z_pre).scatter(-1, idx, z_pre.gather(-1, idx).relu())

    @torch.no_grad()
    def training_output(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                        attn_mask: torch.Tensor | None = None, k: int | None = None) -> torch.Tensor:
        """The function the loss trains, in the normalised space: ``decode(select(z_pre(x), k))`` for
        ``x (batch, pos, d_model)`` already scaled by ``s_in`` (``k`` default ``cfg.top_k``; no k
        annealing); :meth:`fold` makes the raw-space Lorsa compute ``training_output(x · s_in) / s_out``.
        The unfolded module's own forward ranks by plain ``z`` and differs from it whenever heads are
        ranked by ``z · ‖w_o‖`` (``rank_by_decoder_norm``) or balancing gains are on.

        Source: Lorsa paper (He et al. 2025) §3.2; Llamascopium ``src/llamascopium/models/lorsa.py``.
        """
        lorsa = self.module
        z_pre = lorsa.compute_z_pre(x, positions, attn_mask)
        return lorsa.decode(self.select(z_pre, lorsa.cfg.top_k if k is None else k))

    def selection_gain(self) -> torch.Tensor | None:
        """The per-head factor the top-k ranks ``z_pre`` by during training, or None (plain ``z_pre``).

        Source: Lorsa paper (He et al. 2025) §3.2; Llamascopium ``src/llamascopium/models/lorsa.py``.
        """
        g = self.module.W_O.detach().norm(dim=1) if self.recipe.rank_by_decoder_norm else None
        if self.balance is not None:
            e = self.balance.gain().to(self.module.W_O.device)
            g = e if g is None else g * e
        return g

    @torch.no_grad()
    def fold(self, t: TrainingState) -> Lorsa:
        """``f_raw(x) = f(x · s_in) / s_out``: ``W_Q, W_K, W_V *= s_in``; ``W_O, b_D /= s_out``;
        then ``w_o`` is renormalised (its norm moves into ``w_v, b_v``); balancing gains still on
        (``dead_remedy="balance"``) move in too: ``w_v, b_v ·= g``, ``w_o /= g``.

        Source: Lorsa paper (He et al. 2025) §3.2; Llamascopium ``src/llamascopium/models/lorsa.py``.
        """
        _require_norms(self)
        src = self.module  # inside the trainer's ``editing``: a bf16 module's parameters are its fp32 masters
        out = t.fold_copy(src)  # written row chunk by row chunk below, each rounded once into its dtype
        s_in, s_out = self.s_in, self.s_out
        for name in ("W_Q", "W_K"):
            fold_rows(getattr(out, name), getattr(src, name), lambda w, r: w.mul_(s_in))
        norm = row_norms(src.W_O, lambda w: w.div_(s_out), dim=1).clamp_min(1e-12)  # normalize_decoder_
        g = None
        if self.balance is not None and bool((self.balance.log_gain != 0).any()):
            g = self.balance.gain().to(src.W_V)
        fold_rows(out.W_V, src.W_V, lambda w, r: _times(w.mul_(s_in).mul_(norm[r, None]), g, r))
        fold_rows(out.b_V, src.b_V, lambda w, r: _times(w.mul_(norm[r]), g, r))
        fold_rows(out.W_O, src.W_O,
                  lambda w, r: w.div_(s_out).div_(norm[r, None]) if g is None
                  else w.div_(s_out).div_(norm[r, None]).div_(g[r, None]))
        if out.b_D is not None:
            fold_rows(out.b_D, src.b_D, lambda w, r: w.div_(s_out))
        return out


def _times(w: torch.Tensor, g: torch.Tensor | None, r: slice) -> torch.Tensor:
    """``w ·= g[r]`` per row (broadcast over ``w``'s trailing axes); ``w`` as it is for ``g`` None."""
    if g is None:
        return w
    return w.mul_(g[r].reshape(-1, *([1] * (w.dim() - 1))))


