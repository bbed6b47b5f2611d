"""GECO Lagrange multiplier for ``min E|A|  s.t.  CE <= τ`` (Draye et al. 2025 §3.2, Eq. 4-5).

The Lagrangian is ``E|A| + λ (CE − τ)`` (Eq. 5): the model minimises it, λ maximises it. Following
GECO (Rezende & Viola 2018, as used by SPARTAN) λ is not a learned parameter but is updated from a
moving average of the constraint ``c = CE − τ``:

    c_ema ← α c_ema + (1 − α) c          (α = ``ema``; the first step sets c_ema = c)
    λ     ← clamp(λ · exp(lr · c_ema), λ_min, λ_max)

so λ grows while the loss is above the target and shrinks (more weight on sparsity) below it.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import GateConfigError, NonFiniteError


def _check(target: float, lr: float, ema: float, lam: float, min_lambda: float, max_lambda: float) -> None:
    """Raise :class:`GateConfigError` on a setting :class:`GECO` cannot follow (see its Raises)."""
    if not all(math.isfinite(v) for v in (target, lr, ema, lam, min_lambda, max_lambda)):
        # a NaN τ or an infinite lr sent λ silently to min_lambda for good; max_lambda = inf overflowed math.exp
        raise GateConfigError(f"GECO settings must be finite, got target={target}, lr={lr}, ema={ema}, "
                              f"lambda={lam}, min_lambda={min_lambda}, max_lambda={max_lambda}")
    if not 0.0 <= ema < 1.0:
        raise GateConfigError(f"ema must be in [0, 1), got {ema}")
    if not 0.0 < min_lambda <= lam <= max_lambda:
        raise GateConfigError(f"need 0 < min_lambda <= init_lambda <= max_lambda, got "
                              f"{min_lambda}, {lam}, {max_lambda}")
    if not lr > 0:
        raise GateConfigError(f"lr must be > 0, got {lr}")


class GECO:
    """Multiplicative GECO update of the Lagrange multiplier λ (Draye et al. 2025 §3.2, Eq. 5).

    Args:
        target: τ, the constraint level of the loss (nats/token).
        lr: step size of ``log λ`` per unit of constraint (1/nats).
        ema: α of the constraint's moving average, in ``[0, 1)``.
        init_lambda: starting λ (> 0).
        min_lambda, max_lambda: clamp of λ (``0 < min <= max``).

    Raises:
        GateConfigError: on an invalid setting (a non-finite one included).
    """

    def __init__(self, target: float, lr: float = 1.0, ema: float = 0.9, init_lambda: float = 1.0,
                 min_lambda: float = 1e-3, max_lambda: float = 1e4) -> None:
        _check(float(target), float(lr), float(ema), float(init_lambda), float(min_lambda), float(max_lambda))
        self.target = float(target)
        self.lr = float(lr)
        self.ema = float(ema)
        self.min_lambda = float(min_lambda)
        self.max_lambda = float(max_lambda)
        self.lam = float(init_lambda)
        self.constraint_ema: float | None = None

    def update(self, loss: float) -> float:
        """Take one GECO step with the current batch's loss (nats/token); return the new λ.

        Raises:
            NonFiniteError: ``loss`` is NaN or ±inf (``tensor="loss"``); λ and the moving average are unchanged
                (a NaN would have set λ to ``min_lambda`` and the average to NaN for good, an inf pinned λ).
        """
        if not math.isfinite(float(loss)):
            raise NonFiniteError(f"GECO: the loss is {float(loss)}; λ ({self.lam:.4g}) and the constraint's moving "
                                 "average are unchanged", tensor="loss")
        c = float(loss) - self.target
        self.constraint_ema = c if self.constraint_ema is None else self.ema * self.constraint_ema + (1 - self.ema) * c
        log_lam = math.log(self.lam) + self.lr * self.constraint_ema  # in log space: no overflow
        self.lam = min(self.max_lambda, max(self.min_lambda, math.exp(min(log_lam, math.log(self.max_lambda)))))
        return self.lam

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (floats round-trip exactly through ``json``)."""
        return {"target": self.target, "lr": self.lr, "ema": self.ema, "min_lambda": self.min_lambda,
                "max_lambda": self.max_lambda, "lam": self.lam, "constraint_ema": self.constraint_ema}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            GateConfigError: a setting :meth:`__init__` refuses, or a non-finite moving average (nothing restored).
        """
        target, lr, ema = float(state["target"]), float(state["lr"]), float(state["ema"])
        lo, hi, lam = float(state["min_lambda"]), float(state["max_lambda"]), float(state["lam"])
        _check(target, lr, ema, lam, lo, hi)
        ce = state["constraint_ema"]
        if ce is not None and not math.isfinite(float(ce)):
            raise GateConfigError(f"GECO state: the constraint's moving average is {ce}")
        self.target, self.lr, self.ema, self.min_lambda, self.max_lambda, self.lam = target, lr, ema, lo, hi, lam
        self.constraint_ema = None if ce is None else float(ce)
