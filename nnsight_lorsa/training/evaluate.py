"""Evaluate a dictionary spliced into its model: FVU, L0, dead latents, next-token CE and KL.

For each held-out batch, three nnsight traces: the unmodified model (``CE_orig``; the site's true
value is read there), the model with the site replaced by the dictionary (``CE_spliced``, via
``LorsaSet.replace`` / ``TranscoderSet.replace`` / ``SAESet.replace``; its features and output
are read there) and with the site zero-ablated (``CE_zero``). The fraction of CE recovered,
``(CE_zero − CE_spliced) / (CE_zero − CE_orig)``, is SAELens' "CE loss score"; ``kl`` is the mean
KL(original ‖ spliced) of the next-token distributions. :func:`evaluate_spliced` is the loop,
:func:`evaluate_lorsa`, :func:`evaluate_transcoder` and :func:`evaluate_sae` say what the site is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import nnsight
import torch
import torch.nn.functional as F

from ..envoy.lorsa_set import LorsaSet
from ..envoy.sae_set import SAESet, site_output, with_site_output
from ..envoy.transcoder_set import TranscoderSet
from .activations import TokenDataset
from .metrics import FVUAccumulator


def _predicted(mask: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """``(batch, pos−1)`` bool: which next-token predictions count (targets ``ids[:, 1:]``)."""
    return torch.ones_like(ids[:, 1:], dtype=torch.bool) if mask is None else mask[:, 1:].to(ids.device)


def _ce(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[float, int]:
    """Summed next-token CE over the counted predictions (targets ``ids[:, 1:]`` where ``mask``) and
    their count."""
    keep = _predicted(mask, ids)
    lp = F.cross_entropy(logits[:, :-1][keep].float(), ids[:, 1:][keep], reduction="sum")
    return float(lp), int(keep.sum())


class CERecovered:
    """``ce_recovered`` and ``to_dict`` for evaluation dataclasses with ``ce_orig``/``ce_spliced``/``ce_zero``."""

    ce_orig: float
    ce_spliced: float
    ce_zero: float

    @property
    def ce_recovered(self) -> float:
        """``(CE_zero − CE_spliced) / (CE_zero − CE_orig)``."""
        return (self.ce_zero - self.ce_spliced) / (self.ce_zero - self.ce_orig)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ce_recovered": self.ce_recovered}  # type: ignore[call-overload]


@dataclass
class LorsaEvaluation(CERecovered):
    """Evaluation numbers (CE in nats per predicted token); ``ce_recovered``: 1 = as good as the
    MHSA, 0 = as zero-ablation."""

    fvu: float
    l0: float
    dead_frac: float
    ce_orig: float
    ce_lorsa: float
    ce_zero: float
    n_tokens: int

    @property
    def ce_spliced(self) -> float:  # type: ignore[override]
        """The Lorsa-spliced CE (``ce_lorsa``), as :class:`CERecovered` reads it."""
        return self.ce_lorsa


@dataclass
class SplicedEvaluation(CERecovered):
    """Evaluation numbers of any spliced dictionary (CE and KL in nats per predicted token)."""

    fvu: float
    l0: float
    dead_frac: float
    ce_orig: float
    ce_spliced: float
    ce_zero: float
    kl: float
    n_tokens: int


def accumulate_ce(sums: dict[str, float], ids: torch.Tensor, logits_orig: torch.Tensor,
                  logits_spliced: torch.Tensor, logits_zero: torch.Tensor, mask: torch.Tensor | None = None) -> int:
    """Add one batch's summed CE (``orig``/``spliced``/``zero``) and KL(orig ‖ spliced) to ``sums``,
    over the predictions ``mask`` counts (:attr:`TokenDataset.target_mask`; default all); returns
    their number."""
    n = 0
    for key, logits in (("orig", logits_orig), ("spliced", logits_spliced), ("zero", logits_zero)):
        ce, n = _ce(logits, ids, mask)
        sums[key] += ce
    sums["kl"] += _kl(logits_orig, logits_spliced, _predicted(mask, ids))
    return n


def _kl(logits_p: torch.Tensor, logits_q: torch.Tensor, keep: torch.Tensor) -> float:
    """Summed KL(p ‖ q) over the counted predicting positions (``keep`` over ``[:, :-1]``)."""
    lp = logits_p[:, :-1][keep].float().log_softmax(-1)
    lq = logits_q[:, :-1][keep].float().log_softmax(-1)
    return float((lp.exp() * (lp - lq)).sum())


@torch.no_grad()
def evaluate_spliced(model: Any, lm_head_path: str, dataset: TokenDataset, n_latents: int, *,
                     read_target: Callable[[], Any], splice: Callable[[], tuple[Any, Any]],
                     zero_ablate: Callable[[], None], batch_size: int = 8,
                     max_batches: int | None = None) -> SplicedEvaluation:
    """The evaluation loop. Inside the respective traces, ``read_target()`` returns the site's
    true value, ``splice()`` splices the dictionary and returns ``(features, output)`` proxies, and
    ``zero_ablate()`` zeroes the site. BOS positions (column 0) are excluded from FVU/L0; a latent
    is dead if it never fires on the set."""
    acc = FVUAccumulator()
    sums = {"orig": 0.0, "spliced": 0.0, "zero": 0.0, "kl": 0.0}
    n_tok = 0
    l0_sum, l0_n = 0.0, 0
    fired = torch.zeros(n_latents, dtype=torch.bool)
    n_batches = (len(dataset) + batch_size - 1) // batch_size
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for i in range(n_batches):
        ids = dataset.tokens[i * batch_size:(i + 1) * batch_size]
        lm_head = model.get(lm_head_path)
        with model.trace(ids, use_cache=False):
            target = nnsight.save(read_target())
            logits_orig = nnsight.save(lm_head.output)
        with model.trace(ids, use_cache=False):
            acts_proxy, out_proxy = splice()
            z = nnsight.save(acts_proxy)
            out = nnsight.save(out_proxy)
            logits_spliced = nnsight.save(lm_head.output)
        with model.trace(ids, use_cache=False):
            zero_ablate()
            logits_zero = nnsight.save(lm_head.output)
        n_tok += accumulate_ce(sums, ids, logits_orig, logits_spliced, logits_zero,
                               dataset.targets(i * batch_size, (i + 1) * batch_size))
        keep = torch.ones_like(ids, dtype=torch.bool)
        keep[:, 0] = False
        acc.update(target[keep].float(), out[keep].float())
        active = z[keep] > 0
        l0_sum += float(active.sum())
        l0_n += active.shape[0]
        fired |= active.any(0)
    return SplicedEvaluation(
        fvu=acc.value(), l0=l0_sum / max(l0_n, 1), dead_frac=float((~fired).float().mean()),
        ce_orig=sums["orig"] / n_tok, ce_spliced=sums["spliced"] / n_tok, ce_zero=sums["zero"] / n_tok,
        kl=sums["kl"] / n_tok, n_tokens=n_tok,
    )


@torch.no_grad()
def evaluate_lorsa(lorsas: LorsaSet, layer: int, dataset: TokenDataset, *, batch_size: int = 8,
                   max_batches: int | None = None) -> LorsaEvaluation:
    """Evaluate the Lorsa of ``layer`` on every window of ``dataset`` (or ``max_batches`` batches).

    BOS positions (column 0) are excluded from FVU/L0; a head is dead if it never fires on the set.
    """
    model, adapter = lorsas.model, lorsas.adapter
    attn_path = adapter.attention_path(layer)

    def splice() -> tuple[Any, Any]:
        site = lorsas.replace(layer)
        return site.hook_z.output, site.hook_out.output

    def zero_ablate() -> None:
        attn = model.get(attn_path)
        original = attn.output
        attn.output = adapter.with_attention_output(original, torch.zeros_like(adapter.attention_output(original)))

    ev = evaluate_spliced(
        model, adapter.lm_head_path, dataset, lorsas[layer].cfg.n_ov_heads,
        read_target=lambda: adapter.attention_output(model.get(attn_path).output),
        splice=splice, zero_ablate=zero_ablate, batch_size=batch_size, max_batches=max_batches)
    return LorsaEvaluation(fvu=ev.fvu, l0=ev.l0, dead_frac=ev.dead_frac, ce_orig=ev.ce_orig,
                           ce_lorsa=ev.ce_spliced, ce_zero=ev.ce_zero, n_tokens=ev.n_tokens)


def _dictionary_splice(site: Any) -> tuple[Any, Any]:
    return site.hook_sae_acts_post.output, site.hook_sae_recons.output


@torch.no_grad()
def evaluate_transcoder(transcoders: TranscoderSet, layer: int, dataset: TokenDataset, *, batch_size: int = 8,
                        max_batches: int | None = None) -> SplicedEvaluation:
    """Evaluate the transcoder of ``layer`` (MLP output replaced; zero-ablation = MLP output zeroed)."""
    model, adapter = transcoders.model, transcoders.adapter
    mlp_path = adapter.mlp_path(layer)

    def zero_ablate() -> None:
        mlp = model.get(mlp_path)
        original = mlp.output
        mlp.output = adapter.with_mlp_output(original, torch.zeros_like(adapter.mlp_output(original)))

    return evaluate_spliced(
        model, adapter.lm_head_path, dataset, transcoders[layer].cfg.d_sae,
        read_target=lambda: adapter.mlp_output(model.get(mlp_path).output),
        splice=lambda: _dictionary_splice(transcoders.replace(layer)), zero_ablate=zero_ablate,
        batch_size=batch_size, max_batches=max_batches)


@torch.no_grad()
def evaluate_sae(saes: SAESet, site: str, dataset: TokenDataset, *, batch_size: int = 8,
                 max_batches: int | None = None) -> SplicedEvaluation:
    """Evaluate the SAE at ``site`` (its output replaced; zero-ablation = the output zeroed)."""
    model = saes.model

    def zero_ablate() -> None:
        env = model.get(site)
        original = env.output
        env.output = with_site_output(original, torch.zeros_like(site_output(original)))

    return evaluate_spliced(
        model, saes.adapter.lm_head_path, dataset, saes[site].cfg.d_sae,
        read_target=lambda: site_output(model.get(site).output),
        splice=lambda: _dictionary_splice(saes.replace(site)), zero_ablate=zero_ablate,
        batch_size=batch_size, max_batches=max_batches)


def summarize(ev: LorsaEvaluation | SplicedEvaluation) -> dict[str, Any]:
    """Rounded numbers for printing/JSON."""
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in ev.to_dict().items()}
