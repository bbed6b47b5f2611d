"""Train a Lorsa on attention activations (Lorsa paper §3.2; GUIDE §2).

Objective: MSE between the Lorsa output and the MHSA output on non-BOS, non-pad tokens, with
dataset-wise activation-norm scaling (inputs scaled by ``s_in = sqrt(d_model) / E‖x‖``, targets
by ``s_out = sqrt(d_model) / E‖y‖``, estimated on the first ``norm_batches`` batches and folded
into the weights by :meth:`LorsaTrainer.folded_lorsa`), Adam with a warmup–stable–decay LR,
unit-norm ``w_o`` kept after every step (footnote 1), and AuxK against dead heads (Gao et al.
2024): heads silent for ``dead_after_tokens`` tokens reconstruct the residual error with their
own top-``aux_k``, weighted by ``aux_k_coef``.

Checkpoints (:meth:`save_checkpoint` / :meth:`LorsaTrainer.resume`) hold the training-space
weights, Adam state, dead-head counters and step as safetensors + JSON, and resume bit-exactly
because batch ``i`` of an :class:`~.activations.ActivationSource` depends only on ``i``.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..errors import CheckpointError
from ..modules.lorsa import Lorsa
from ..modules.lorsa_config import LorsaConfig
from .activations import ActivationSource, AttentionBatch
from .metrics import fvu
from .schedule import wsd_lr_factor


@dataclass
class TrainConfig:
    """Optimisation settings. ``total_steps`` batches are drawn from the source, one per step."""

    total_steps: int
    lr: float = 2e-3
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_frac: float = 0.05
    decay_frac: float = 0.2
    grad_clip: float = 1.0
    norm_batches: int = 4
    aux_k: int | None = None  # default: 2 * top_k
    aux_k_coef: float = 1.0 / 32
    dead_after_tokens: int = 20_000
    log_every: int = 10
    history: list[dict[str, float]] = field(default_factory=list, repr=False)


class LorsaTrainer:
    """Trains ``lorsa`` on batches from ``source``.

    Args:
        lorsa: the module to train (modified in place; training-space weights).
        source: batch index -> :class:`AttentionBatch`.
        config: :class:`TrainConfig`.
        mhsa: optional MHSA weights to initialise QK (App. B.3) once the norms are known.
    """

    def __init__(self, lorsa: Lorsa, source: ActivationSource, config: TrainConfig, mhsa: Any = None) -> None:
        self.lorsa = lorsa
        self.source = source
        self.config = config
        self.step = 0
        self.s_in: float | None = None
        self.s_out: float | None = None
        self.tokens_since_fired = torch.zeros(lorsa.cfg.n_ov_heads, dtype=torch.long)
        self.optimizer = torch.optim.Adam(lorsa.parameters(), lr=config.lr, betas=config.betas)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: wsd_lr_factor(s, config.total_steps, config.warmup_frac, config.decay_frac),
        )
        self._mhsa = mhsa

    # ------------------------------------------------------------- setup
    @torch.no_grad()
    def estimate_norms(self) -> tuple[float, float]:
        """Dataset-wise scale factors ``(s_in, s_out)`` from the first ``norm_batches`` batches."""
        norms_x, norms_y = [], []
        for i in range(self.config.norm_batches):
            b = self.source(i)
            norms_x.append(b.x[b.loss_mask].norm(dim=-1))
            norms_y.append(b.y[b.loss_mask].norm(dim=-1))
        d = self.lorsa.cfg.d_model
        self.s_in = math.sqrt(d) / float(torch.cat(norms_x).mean())
        self.s_out = math.sqrt(d) / float(torch.cat(norms_y).mean())
        if self._mhsa is not None:
            self.lorsa.init_from_mhsa(self._mhsa)
            for w in (self.lorsa.W_Q, self.lorsa.W_K, self.lorsa.W_V):
                w.div_(self.s_in)
            self.lorsa.normalize_decoder_()
        return self.s_in, self.s_out

    # -------------------------------------------------------------- step
    def loss(self, batch: AttentionBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss on one batch (normalised space) and its metrics (FVU, L0, aux loss)."""
        assert self.s_in is not None and self.s_out is not None
        lorsa = self.lorsa
        x = batch.x.to(lorsa.W_O.dtype) * self.s_in
        y = batch.y.to(lorsa.W_O.dtype) * self.s_out
        out, cache = lorsa(x, batch.positions, batch.attn_mask, return_cache=True)
        mask = batch.loss_mask
        err = (y - out)[mask]
        mse = err.pow(2).sum(-1).mean()
        loss = mse
        active = cache.z[mask] > 0
        fired = active.any(0)
        n_tokens = int(mask.sum())
        self.tokens_since_fired += n_tokens
        self.tokens_since_fired[fired] = 0
        dead = self.tokens_since_fired >= self.config.dead_after_tokens
        aux = torch.zeros((), dtype=loss.dtype)
        if dead.any() and self.config.aux_k_coef > 0:
            k_aux = min(self.config.aux_k or 2 * lorsa.cfg.top_k, int(dead.sum()))
            z_pre = cache.z_pre[mask].masked_fill(~dead, float("-inf"))
            vals, idx = z_pre.topk(k_aux, dim=-1)
            z_aux = torch.zeros_like(cache.z_pre[mask]).scatter(-1, idx, vals.relu())
            e_hat = z_aux @ lorsa.W_O
            e = err.detach()
            aux = (e_hat - e).pow(2).sum(-1).mean() / e.pow(2).sum(-1).mean().clamp_min(1e-12)
            loss = loss + self.config.aux_k_coef * aux
        metrics = {
            "loss": float(loss.detach()),
            "fvu": float(fvu(y[mask], out[mask].detach())),
            "l0": float(active.sum(-1).float().mean()),
            "dead_frac": float(dead.float().mean()),
            "aux": float(aux.detach()),
        }
        return loss, metrics

    def train_step(self) -> dict[str, float]:
        if self.s_in is None:
            self.estimate_norms()
        batch = self.source(self.step)
        loss, metrics = self.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.lorsa.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.lorsa.normalize_decoder_()
        self.step += 1
        metrics["lr"] = float(self.scheduler.get_last_lr()[0])
        return metrics

    def train(self, steps: int | None = None, *, progress: bool = True,
              checkpoint_dir: str | Path | None = None, checkpoint_every: int = 0) -> list[dict[str, float]]:
        """Run until ``steps`` more steps (default: to ``total_steps``); return the logged metrics."""
        end = self.config.total_steps if steps is None else min(self.config.total_steps, self.step + steps)
        bar = tqdm(total=end - self.step, disable=not progress, desc="Lorsa", dynamic_ncols=True)
        while self.step < end:
            m = self.train_step()
            bar.update(1)
            if self.step % self.config.log_every == 0 or self.step == end:
                m["step"] = self.step
                self.config.history.append(m)
                bar.set_postfix(loss=f"{m['loss']:.4f}", fvu=f"{m['fvu']:.3f}", l0=f"{m['l0']:.1f}",
                                dead=f"{m['dead_frac']:.2f}")
            if checkpoint_dir is not None and checkpoint_every and self.step % checkpoint_every == 0:
                self.save_checkpoint(checkpoint_dir)
        bar.close()
        return self.config.history

    # ----------------------------------------------------------- results
    @torch.no_grad()
    def folded_lorsa(self) -> Lorsa:
        """A copy of the Lorsa acting on raw activations: norm scaling folded into the weights.

        ``f_raw(x) = f(x · s_in) / s_out``: ``W_Q, W_K, W_V *= s_in``; ``W_O, b_D /= s_out``;
        then ``w_o`` is renormalised (its norm moves into ``w_v, b_v``).
        """
        if self.s_in is None or self.s_out is None:
            raise RuntimeError("norms are not estimated yet: train first")
        out = copy.deepcopy(self.lorsa)
        for w in (out.W_Q, out.W_K, out.W_V):
            w.mul_(self.s_in)
        out.W_O.div_(self.s_out)
        if out.b_D is not None:
            out.b_D.div_(self.s_out)
        out.normalize_decoder_()
        return out

    # -------------------------------------------------------- checkpoints
    def save_checkpoint(self, directory: str | Path) -> None:
        """Write ``trainer.json`` + ``lorsa.safetensors`` + ``optimizer.safetensors`` + ``state.safetensors``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        weights = {k: v.detach().contiguous() for k, v in self.lorsa.state_dict().items()}
        save_file(weights, str(d / "lorsa.safetensors"))
        names = {id(p): n for n, p in self.lorsa.named_parameters()}
        opt_tensors: dict[str, torch.Tensor] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for key, value in self.optimizer.state.get(p, {}).items():
                    opt_tensors[f"{names[id(p)]}.{key}"] = value.detach().clone().contiguous()
        save_file(opt_tensors, str(d / "optimizer.safetensors"))
        save_file({"tokens_since_fired": self.tokens_since_fired}, str(d / "state.safetensors"))
        cfg = {k: v for k, v in asdict(self.config).items() if k != "history"}
        meta = {"step": self.step, "s_in": self.s_in, "s_out": self.s_out, "train_config": cfg,
                "lorsa_config": self.lorsa.cfg.to_dict(), "history": self.config.history}
        (d / "trainer.json").write_text(json.dumps(meta, indent=1))

    @classmethod
    def resume(cls, directory: str | Path, source: ActivationSource) -> LorsaTrainer:
        """Rebuild a trainer from :meth:`save_checkpoint` output; continues bit-exactly.

        Raises:
            CheckpointError: a file is missing or does not match the recorded configuration.
        """
        d = Path(directory)
        for name in ("trainer.json", "lorsa.safetensors", "optimizer.safetensors", "state.safetensors"):
            if not (d / name).is_file():
                raise CheckpointError(f"{d / name}: missing trainer checkpoint file")
        try:
            meta = json.loads((d / "trainer.json").read_text())
            tc = meta["train_config"]
            tc["betas"] = tuple(tc["betas"])
            config = TrainConfig(**tc, history=list(meta.get("history", [])))
            lorsa = Lorsa(LorsaConfig.from_dict(meta["lorsa_config"]))
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{d / 'trainer.json'}: malformed ({e})") from e
        try:
            lorsa.load_state_dict(load_file(str(d / "lorsa.safetensors")))
        except RuntimeError as e:
            raise CheckpointError(f"{d / 'lorsa.safetensors'}: does not match the config ({e})") from e
        trainer = cls(lorsa, source, config)
        trainer.step, trainer.s_in, trainer.s_out = meta["step"], meta["s_in"], meta["s_out"]
        params = dict(lorsa.named_parameters())
        for key, value in load_file(str(d / "optimizer.safetensors")).items():
            name, _, slot = key.rpartition(".")
            if name not in params:
                raise CheckpointError(f"{d / 'optimizer.safetensors'}: unknown parameter {name!r}")
            trainer.optimizer.state[params[name]][slot] = value
        trainer.tokens_since_fired = load_file(str(d / "state.safetensors"))["tokens_since_fired"]
        # LambdaLR has no state beyond its step count: set it and the LR it implies
        trainer.scheduler.last_epoch = trainer.step
        for group, base, fn in zip(trainer.optimizer.param_groups, trainer.scheduler.base_lrs,
                                   trainer.scheduler.lr_lambdas, strict=True):
            group["lr"] = base * fn(trainer.step)
        return trainer
