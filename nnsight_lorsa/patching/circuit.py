"""Circuit size: how many components recover 90% of the clean metric (Draye et al. 2025, §4.2, Fig. 3).

Components (MHSA heads, Lorsa heads) are ranked by a per-prompt score — the effect of ablating
each one alone (``method="ablation"``: ``clean − ablated``) or of patching its clean value into
the corrupt run (``method="patching"``: ``patched − corrupt``, the activation patching of seed
003) — and the model is run keeping only the top-``k`` of them, the others ablated (zero or mean;
Draye et al. 2025 freeze dense heads to their mean, sparse ones to zero). The recovered fraction is

    f(k) = (m_k − m_0) / (m_all − m_0)

with ``m_0`` every component ablated and ``m_all`` none. The circuit size is the smallest ``k``
with ``f(k) ≥ threshold`` — per prompt (each prompt with its own ranking) and globally (one
ranking by the batch-mean score, ``f`` on the batch-mean metric).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .._checks import check_instance, is_collection, is_int, is_real
from .._placement import HOST, host_f32
from .._repr import FieldsRepr
from ..envoy.replacement_model import ReplacementModel, check_replacement_model
from ..envoy.targets import Bound, LorsaHead, MHSAHead
from ..errors import ArgumentError, ConfigMismatchError
from .experiments import activation_patching, make_metric, saved_logits
from .interventions import check_means_mode, check_prompts, mean_fill, refuse_inside_trace, refuse_repeats
from .metrics import check_gap, metric_rounding
from .tasks import TaskBatch

Metric = Callable[[torch.Tensor], torch.Tensor]
Component = MHSAHead | LorsaHead


@dataclass(repr=False)
class CircuitSize(FieldsRepr):
    """Result of :func:`circuit_size`.

    Attributes:
        components: the candidate components, ``n`` of them.
        scores: ``(batch, n)`` per-prompt scores the rankings come from.
        ks: ``(K,)`` the circuit sizes evaluated (0 … n).
        per_prompt_curve: ``(K, batch)`` recovered fraction keeping each prompt's top-k.
        global_curve: ``(K,)`` recovered fraction (batch-mean metric) keeping the global top-k.
        per_prompt_k: ``(batch,)`` smallest evaluated k with ``f ≥ threshold`` (n if none).
        global_k: the same for the global ranking.
        threshold: the fraction to recover (0.9).
        metric_all, metric_none: ``(batch,)`` metric with no component / every component ablated
            (``m_all``, ``m_0``; a small ``m_all − m_0`` makes the fractions noisy, one within rounding is refused).

    Source: Draye et al. 2025, *Sparse Attention Post-Training for Mechanistic Interpretability* §4.2, Fig. 3.
    """

    components: list[Component]
    scores: torch.Tensor
    ks: torch.Tensor
    per_prompt_curve: torch.Tensor
    global_curve: torch.Tensor
    per_prompt_k: torch.Tensor
    global_k: int
    threshold: float
    metric_all: torch.Tensor
    metric_none: torch.Tensor

    def global_circuit(self) -> list[Component]:
        """The ``global_k`` components of the global ranking.

        Source: Draye et al. 2025, *Sparse Attention Post-Training for Mechanistic Interpretability* §4.2, Fig. 3.
        """
        order = self.scores.mean(0).argsort(descending=True)
        return [self.components[int(i)] for i in order[:self.global_k]]


def _check_components(replacement: ReplacementModel, components: Sequence[Component]) -> None:
    if not isinstance(components, (list, tuple)) or not components:
        raise ConfigMismatchError(f"circuit_size needs a non-empty list of components, got {components!r}"[:200])
    for c in components:
        if not isinstance(c, (MHSAHead, LorsaHead)):
            raise ConfigMismatchError(f"circuit components are MHSAHead / LorsaHead, got {c!r}")
        replacement.check(c)
    refuse_repeats(components, "circuit components")


def _fill(replacement: ReplacementModel, c: Component, mode: str, means: Any, site: torch.Tensor) -> Any:
    """What ``c`` is ablated to in ``site`` (its values in the trace, ``(batch, pos[, head_dim])``): 0, or its mean
    checked as :func:`~.interventions.ablate` checks it (a per-position mean at every position)."""
    if mode == "zero":
        return 0.0
    return mean_fill(Bound(c, replacement), means, site, int(site.shape[1]))


def _check_means(replacement: ReplacementModel, components: Sequence[Component], mode: str, means: Any,
                 seq: int) -> None:
    """Before anything runs: each component's mean checked against a stand-in of its values on ``seq`` positions
    (until 2026-11-29 a per-position Lorsa mean, or an MHSA mean of another length or width, was torch's
    ``RuntimeError`` inside the trace, where :func:`~.interventions.ablate` names it)."""
    if mode != "mean":
        return
    for c in components:
        width = replacement.width(c)
        _fill(replacement, c, mode, means, torch.zeros((1, seq) if width is None else (1, seq, width), device=HOST))


def _keep_only(replacement: ReplacementModel, components: Sequence[Component], keep: torch.Tensor, mode: str,
               means: Any) -> None:
    """In a trace body: ablate, per row, the components with ``keep[row, i] == False``.

    ``keep`` and the means may be on any device: each site's mask and fill are moved to that site's
    tensor (device and dtype)."""
    a = replacement.adapter
    d = a.head_dim
    by_site: dict[tuple[str, int], list[int]] = {}
    for i, c in enumerate(components):
        by_site.setdefault(("mhsa" if isinstance(c, MHSAHead) else "lorsa", c.layer), []).append(i)
    for (kind, layer), idx in sorted(by_site.items(), key=lambda kv: (kv[0][1], kv[0][0] == "lorsa")):
        k = keep[:, idx]  # (batch, m) bool
        if kind == "mhsa":
            tensor = replacement.model.get(replacement.output_projection_path(layer)).input
            for j, i in enumerate(idx):
                c = components[i]
                # edited here, not through interventions.ablate: refused as there where the Lorsa spliced on this
                # layer without an error term would discard it (its score would be 0.0, without a word) — when some
                # row ablates it (a run keeping it everywhere edits nothing)
                if not bool(k[:, j].all()):
                    replacement.check_editable(c)
                cols = slice(c.head * d, (c.head + 1) * d)
                kj = k[:, j, None, None].to(device=tensor.device, dtype=tensor.dtype)
                fill = _fill(replacement, c, mode, means, tensor[:, :, cols])
                tensor[:, :, cols] = tensor[:, :, cols] * kj + (1 - kj) * fill
        else:
            z = replacement.lorsas.replace(layer, error=replacement.error).hook_z.output
            heads = [components[i].head for i in idx]
            # each head's fill (b, pos): a number, its mean, or its per-position mean
            fill = 0.0 if mode == "zero" else torch.stack(
                [torch.as_tensor(_fill(replacement, components[i], mode, means, z[:, :, h])).to(z).expand(z.shape[:2])
                 for i, h in zip(idx, heads, strict=True)], -1)
            kk = k[:, None, :].to(device=z.device, dtype=z.dtype)
            z[:, :, heads] = z[:, :, heads] * kk + (1 - kk) * fill


def _keep_runs(replacement: ReplacementModel, prompts: torch.Tensor, components: Sequence[Component],
               keeps: list[torch.Tensor], mode: str, means: Any, per_trace: int = 8) -> list[torch.Tensor]:
    """Logits of ``prompts`` for each keep mask ``(batch, n)`` (one invoke each)."""
    outs: list[torch.Tensor] = []
    lorsa_layers = sorted({c.layer for c in components if isinstance(c, LorsaHead)})
    for start in range(0, len(keeps), per_trace):
        chunk = keeps[start:start + per_trace]
        saved: list[torch.Tensor] = []
        with torch.no_grad(), replacement.model.trace() as tracer:
            for keep in chunk:
                with tracer.invoke(prompts):
                    for layer in lorsa_layers:  # every invoke: a splice replaces its callers' rows
                        replacement.lorsas.replace(layer, error=replacement.error)
                    _keep_only(replacement, components, keep, mode, means)
                    saved.append(saved_logits(replacement))
        outs += saved
    return outs


def check_task(replacement: Any, task: Any, where: str) -> None:
    """``replacement`` a :class:`ReplacementModel` and ``task`` a :class:`~.tasks.TaskBatch` whose clean and corrupt
    prompts the model can run (:func:`~.interventions.check_prompts`: a task built with another model's tokenizer
    holds ids past this one's vocabulary — torch's ``IndexError`` inside the first trace before), before anything
    runs.

    Raises:
        ArgumentError: naming ``where``.

    Source: ours.
    """
    check_replacement_model(replacement, where)
    check_instance(task, TaskBatch, where, "task", " (a task builder's output, e.g. ioi_task(...))")
    check_prompts(task.clean, where, "task.clean", replacement.model)
    check_prompts(task.corrupt, where, "task.corrupt", replacement.model)


def component_scores(replacement: ReplacementModel, task: TaskBatch, components: Sequence[Component], *,
                     method: Literal["ablation", "patching"] = "ablation", mode: Literal["zero", "mean"] = "zero",
                     means: Any = None, metric: Metric | None = None, per_trace: int = 16) -> torch.Tensor:
    """Per-prompt importance ``(batch, n)`` of each component (larger = more important).

    ``"ablation"``: ``m_clean − m_ablated`` with the component alone ablated on the clean prompts
    (a Lorsa head with ``z = 0`` on every token of the batch is skipped: its zero-ablation is exact
    identity, score 0). ``"patching"``: activation patching clean → corrupt, ``m_patched − m_corrupt``.

    Raises:
        ArgumentError: ``replacement`` not a :class:`~nnsight_lorsa.ReplacementModel`, ``task`` not a
            :class:`~.tasks.TaskBatch` or holding ids the model cannot run (:func:`check_task`), before anything runs.
        ConfigMismatchError, TargetIndexError, LayerOutOfRangeError: as :func:`circuit_size`.

    Source: Draye et al. 2025, *Sparse Attention Post-Training for Mechanistic Interpretability* §4.2.
    """
    refuse_inside_trace("component_scores")
    check_task(replacement, task, "component_scores")
    _check_components(replacement, components)
    check_means_mode(mode, means, "component_scores")
    if method == "ablation":
        _check_means(replacement, components, mode, means, int(task.clean.shape[1]))
    score = make_metric(metric, task.correct_ids, task.incorrect_ids)
    if method == "patching":
        res = activation_patching(replacement, task.clean, task.corrupt, list(components), metric=score,
                                  groups_per_trace=per_trace)
        return (res.patched - res.corrupt[None]).T
    if method != "ablation":
        raise ConfigMismatchError(f"method must be 'ablation' or 'patching', got {method!r}")
    n, b = len(components), len(task)
    run = list(range(n))
    if mode == "zero" and any(isinstance(c, LorsaHead) for c in components):
        lorsa_layers = sorted({c.layer for c in components if isinstance(c, LorsaHead)})
        active = _lorsa_active(replacement, task.clean, lorsa_layers)
        run = [i for i, c in enumerate(components) if not isinstance(c, LorsaHead) or bool(active[c.layer][c.head])]
    keeps = []  # host-side masks: _keep_only moves each to the site it edits
    for i in run:
        keep = torch.ones(b, n, dtype=torch.bool, device=HOST)
        keep[:, i] = False
        keeps.append(keep)
    full = torch.ones(b, n, dtype=torch.bool, device=HOST)
    logits = _keep_runs(replacement, task.clean, components, [full, *keeps], mode, means, per_trace)
    base = score(logits[0])
    out = torch.zeros(b, n, dtype=torch.float32, device=HOST)
    for i, lg in zip(run, logits[1:], strict=True):
        out[:, i] = base - score(lg)
    return out


def _lorsa_active(replacement: ReplacementModel, prompts: torch.Tensor, layers: list[int]) -> dict[int, torch.Tensor]:
    saved = {}
    with torch.no_grad(), replacement.model.trace(prompts):
        for layer in layers:
            z = replacement.lorsas.replace(layer, error=replacement.error).hook_z.output
            saved[layer] = (z > 0).any(1).any(0).save()
    return {layer: active.to(HOST) for layer, active in saved.items()}


def default_ks(n: int) -> list[int]:
    """0…min(n, 32) then roughly geometric steps to n."""
    ks = list(range(min(n, 32) + 1))
    k = 32
    while k < n:
        k = min(n, int(k * 1.5))
        ks.append(k)
    return ks


def circuit_size(replacement: ReplacementModel, task: TaskBatch, components: Sequence[Component], *,
                 scores: torch.Tensor | None = None, method: Literal["ablation", "patching"] = "ablation",
                 threshold: float = 0.9, mode: Literal["zero", "mean"] = "zero", means: Any = None,
                 ks: Sequence[int] | None = None, metric: Metric | None = None) -> CircuitSize:
    """Number of ``components`` needed to recover ``threshold`` of the clean metric, per prompt and globally.

    Draye et al. 2025 §4.2 / Fig. 3: rank by ``scores`` ``(batch, n)`` (default :func:`component_scores`
    with ``method``), keep only the top-``k`` (others ablated with ``mode``) on the clean prompts,
    and report the recovered fraction ``f(k)`` (module docstring) for each ``k`` of ``ks``
    (default :func:`default_ks`). Components outside the list are left alone. Scores, curves and
metrics are fp32 on the CPU (given ``scores`` are moved there); the runs use the model's device.

    Returns:
        :class:`CircuitSize`; ``per_prompt_k: (batch,)``, ``global_k``, the curves ``(K, batch)``, ``(K,)``.

    Raises:
        ArgumentError: ``replacement`` is not a :class:`~nnsight_lorsa.ReplacementModel` (a set, a bare
            model or a module: wrap it, ``ReplacementModel(model, lorsas=...)``).
        UndefinedNormalizationError: prompts (or the batch mean) whose metric with every component kept and with none
            are equal within the logits' rounding (:func:`~.metrics.check_gap`, the rule of ``normalized``): their
            ``f(k)`` would be 0/0 or rounding noise (until 2026-11-27 a warning and NaN for an exact tie only, noise
            fractions otherwise); drop those prompts (``task.select``).
        ConfigMismatchError: no/unknown components, a component listed twice, mean mode without means, ``means``
            with ``mode="zero"`` (they would be ignored), ``ks`` outside ``[0, n]``.
        ArgumentError: ``task`` not a :class:`~.tasks.TaskBatch` or holding ids the model cannot run
            (:func:`check_task`), ``threshold`` not a finite number, ``ks`` not a
            list / tuple / range of ints, ``scores`` not a tensor or non-finite, a metric
            that does not return ``(batch,)``; an :class:`~.targets.MHSAHead` of a layer whose Lorsa (a component's)
            is spliced without an error term (``replacement.error`` False): its ablation would be discarded
            (:meth:`.ReplacementModel.check_editable`).
        TargetIndexError, LayerOutOfRangeError: bad components (before anything runs).

    Source: Draye et al. 2025, *Sparse Attention Post-Training for Mechanistic Interpretability* §4.2, Fig. 3.
    """
    refuse_inside_trace("circuit_size")
    check_task(replacement, task, "circuit_size")
    _check_components(replacement, components)
    check_means_mode(mode, means, "circuit_size")
    _check_means(replacement, components, mode, means, int(task.clean.shape[1]))
    if scores is not None and not isinstance(scores, torch.Tensor):
        raise ArgumentError(f"circuit_size: scores must be None or a (batch, n) tensor, got a {type(scores).__name__}")
    if not is_real(threshold) or not math.isfinite(threshold):
        raise ArgumentError(f"circuit_size: threshold must be a finite number (a fraction, e.g. 0.9), "
                            f"got {threshold!r}")
    if ks is not None and (not is_collection(ks) or not all(is_int(k) for k in ks)):
        raise ArgumentError(f"circuit_size: ks must be a sequence of ints, got {ks!r}")
    n, b = len(components), len(task)
    score = make_metric(metric, task.correct_ids, task.incorrect_ids)
    if scores is None:
        scores = component_scores(replacement, task, components, method=method, mode=mode, means=means, metric=score)
    if tuple(scores.shape) != (b, n):
        raise ConfigMismatchError(f"scores must be (batch={b}, n={n}), got {tuple(scores.shape)}")
    scores = host_f32(scores)  # the rankings and curves are host-side tables
    if not bool(torch.isfinite(scores).all()):
        raise ArgumentError("circuit_size: scores hold NaN or inf (no ranking can be made from them)")
    kk = sorted(set(default_ks(n) if ks is None else ks) | {0, n})
    if kk[0] < 0 or kk[-1] > n:
        raise ConfigMismatchError(f"ks must lie in [0, {n}]")
    rank_p = scores.argsort(1, descending=True)  # (b, n)
    rank_g = scores.mean(0).argsort(descending=True)
    keeps = []
    for k in kk:
        kp = torch.zeros(b, n, dtype=torch.bool, device=HOST)
        kp.scatter_(1, rank_p[:, :k], True)
        kg = torch.zeros(b, n, dtype=torch.bool, device=HOST)
        kg[:, rank_g[:k]] = True
        keeps += [kp, kg]
    logits = _keep_runs(replacement, task.clean, components, keeps, mode, means)
    m = torch.stack([score(x) for x in logits]).view(len(kk), 2, b)
    mp, mg = m[:, 0], m[:, 1]
    i0, i_all = 0, len(kk) - 1
    rounding = metric_rounding(logits[0])
    # a prompt the components do not move beyond rounding has no fraction to recover: refused as normalized refuses
    advice = ("the components do not move the metric there (e.g. correct_ids equal to incorrect_ids, or components "
              "that do not reach it): drop those prompts (task.select)")
    per = (mp - mp[i0]) / check_gap(mp[i_all], mp[i0], rounding, "circuit_size",
                                    ("m_all (every component kept)", "m_0 (none)"), advice=advice)
    glob = (mg.mean(1) - mg[i0].mean()) / check_gap(mg[i_all].mean(), mg[i0].mean(), rounding,
                                                    "circuit_size (the batch-mean metric)",
                                                    ("m_all (every component kept)", "m_0 (none)"), advice=advice)
    kt = torch.tensor(kk, device=HOST)
    reached = per >= threshold  # (K, b)
    first = torch.where(reached.any(0), reached.float().argmax(0), torch.full((b,), len(kk) - 1, device=HOST))
    greached = (glob >= threshold).nonzero()
    gk = int(kt[int(greached[0])]) if len(greached) else n
    return CircuitSize(list(components), scores, kt, per, glob, kt[first], gk, threshold, mp[i_all], mp[i0])
