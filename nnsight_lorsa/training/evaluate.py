"""Evaluate a Lorsa spliced into its model: FVU, L0, dead heads and next-token CE.

For each held-out batch, three nnsight traces: the unmodified model (``CE_orig``), the model
with the layer's MHSA output replaced by the Lorsa (``CE_lorsa``, via ``LorsaSet.replace``), and
with that attention output zeroed (``CE_zero``). The fraction of CE recovered,
``(CE_zero − CE_lorsa) / (CE_zero − CE_orig)``, is SAELens' "CE loss score" for attention.
FVU and L0 are measured on the same trace as ``CE_lorsa`` (MHSA output read before the
Lorsa's internals, then the Lorsa's ``hook_z``/``hook_out``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import nnsight
import torch
import torch.nn.functional as F

from ..envoy.lorsa_set import LorsaSet
from ..envoy.mount import resolve_envoy
from .activations import TokenDataset
from .metrics import FVUAccumulator


@dataclass
class LorsaEvaluation:
    """Evaluation numbers (CE in nats per predicted token)."""

    fvu: float
    l0: float
    dead_frac: float
    ce_orig: float
    ce_lorsa: float
    ce_zero: float
    n_tokens: int

    @property
    def ce_recovered(self) -> float:
        """``(CE_zero − CE_lorsa) / (CE_zero − CE_orig)``: 1 = as good as the MHSA, 0 = as zero-ablation."""
        return (self.ce_zero - self.ce_lorsa) / (self.ce_zero - self.ce_orig)

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "ce_recovered": self.ce_recovered}


def _ce(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, int]:
    """Summed next-token CE over all positions (targets ``ids[:, 1:]``) and the token count."""
    lp = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")
    return float(lp), ids[:, 1:].numel()


@torch.no_grad()
def evaluate_lorsa(lorsas: LorsaSet, layer: int, dataset: TokenDataset, *, batch_size: int = 8,
                   max_batches: int | None = None) -> LorsaEvaluation:
    """Evaluate the Lorsa of ``layer`` on every window of ``dataset`` (or ``max_batches`` batches).

    BOS positions (column 0) are excluded from FVU/L0; a head is dead if it never fires on the set.
    """
    model, adapter = lorsas.model, lorsas.adapter
    attn_path = adapter.attention_path(layer)
    lm_head_path = adapter.lm_head_path
    acc = FVUAccumulator()
    sums = {"orig": 0.0, "lorsa": 0.0, "zero": 0.0}
    n_tok = 0
    l0_sum, l0_n = 0.0, 0
    fired = torch.zeros(lorsas[layer].cfg.n_ov_heads, dtype=torch.bool)
    n_batches = (len(dataset) + batch_size - 1) // batch_size
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for i in range(n_batches):
        ids = dataset.tokens[i * batch_size:(i + 1) * batch_size]
        attn = resolve_envoy(model, attn_path)
        lm_head = resolve_envoy(model, lm_head_path)
        with model.trace(ids, use_cache=False):
            logits_orig = nnsight.save(lm_head.output)
        with model.trace(ids, use_cache=False):
            site = lorsas.replace(layer)  # before any read at the layer; then the MHSA output is
            mhsa = nnsight.save(adapter.attention_output(attn.output))  # served before the Lorsa runs
            z = nnsight.save(site.hook_z.output)
            out = nnsight.save(site.hook_out.output)
            logits_lorsa = nnsight.save(lm_head.output)
        with model.trace(ids, use_cache=False):
            original = attn.output
            attn.output = adapter.with_attention_output(original, torch.zeros_like(adapter.attention_output(original)))
            logits_zero = nnsight.save(lm_head.output)
        for key, logits in (("orig", logits_orig), ("lorsa", logits_lorsa), ("zero", logits_zero)):
            ce, n = _ce(logits, ids)
            sums[key] += ce
        n_tok += n
        keep = torch.ones_like(ids, dtype=torch.bool)
        keep[:, 0] = False
        acc.update(mhsa[keep].float(), out[keep].float())
        active = z[keep] > 0
        l0_sum += float(active.sum())
        l0_n += active.shape[0]
        fired |= active.any(0)
    return LorsaEvaluation(
        fvu=acc.value(), l0=l0_sum / max(l0_n, 1), dead_frac=float((~fired).float().mean()),
        ce_orig=sums["orig"] / n_tok, ce_lorsa=sums["lorsa"] / n_tok, ce_zero=sums["zero"] / n_tok,
        n_tokens=n_tok,
    )


def summarize(ev: LorsaEvaluation) -> dict[str, Any]:
    """Rounded numbers for printing/JSON."""
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in ev.to_dict().items()}
