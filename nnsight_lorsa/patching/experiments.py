"""Experiments that run the traces and return the metric (docs/patching.md; Lorsa paper (He et al. 2025) App. D.4).

* :func:`activation_patching`: patch each target (or group) from the clean run into the corrupt run.
* :func:`ablation_effect`: ablate targets together; baseline, ablated and relative effect (§10.4).
* :func:`random_ablation_control`: ablate ``k`` random targets of a pool, several times (§10.4).
* :func:`head_swap`: set a Lorsa head's z to 0 and give its value to another head (App. D.4).

A metric maps logits ``(batch, pos, vocab)`` to ``(batch,)``; by default
:func:`~.metrics.logit_difference` with ``correct_ids``/``incorrect_ids``. Metric values (and every
result built from them) are fp32 tensors on the CPU, whatever the model's device and dtype. Path patching:
:mod:`.path_patching`; circuit size: :mod:`.circuit`; task builders: :mod:`.tasks`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import nnsight
import torch

from .._checks import check_flag, is_int
from .._placement import HOST, host_f32
from ..envoy.padding import check_not_padding, check_same_padding, padding_mask
from ..envoy.replacement_model import ReplacementModel, check_replacement_model
from ..envoy.targets import Bound, Feature, LorsaHead, MHSAHead, Positions, Target, positions_index
from ..errors import ArgumentError, ConfigMismatchError, NonFiniteError, ShapeError
from .interventions import (
    ablate,
    check_means_mode,
    check_positions,
    check_prompts,
    check_target_list,
    patch,
    read,
    refuse_inside_trace,
    refuse_repeats,
)
from .metrics import logit_difference, metric_rounding, normalized_effect, relative_effect

Metric = Callable[[torch.Tensor], torch.Tensor]


def saved_logits(replacement: ReplacementModel) -> Any:
    """Inside a trace: the model's logits ``(batch, pos, vocab)``, saved — the LM head's output through
    :meth:`~nnsight_lorsa.adapters.base.ArchitectureAdapter.final_logits` (Gemma-2 soft-caps it; the others
    return it as it is). What every experiment's metric reads."""
    head = replacement.model.get(replacement.adapter.lm_head_path)
    return nnsight.save(replacement.adapter.final_logits(head.output))


def make_metric(metric: Metric | None, correct_ids: Any, incorrect_ids: Any, position: int = -1) -> Metric:
    """The metric of an experiment: ``metric``, or the logit difference of ``correct_ids`` vs
    ``incorrect_ids`` at ``position``; its values are returned in fp32 on the CPU (the logits it reads
    stay where the model put them).

    Raises:
        ConfigMismatchError: neither ``metric`` nor both ids. ArgumentError: ``metric`` not callable, or (when
            it runs) returning anything but a real tensor ``(batch,)``. NonFiniteError: (when it runs) NaN / inf
            values (from non-finite logits: an fp16 model's past 65504), checked on the host copy (no extra read).
    """
    if metric is not None:
        if not callable(metric):
            raise ArgumentError(f"metric must be a callable logits -> (batch,), got {metric!r}")
        user = metric

        def checked(logits: torch.Tensor) -> torch.Tensor:
            value = user(logits)
            if not isinstance(value, torch.Tensor) or value.dtype == torch.bool or value.dtype.is_complex \
                    or tuple(value.shape) != (logits.shape[0],):
                got = f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor) else repr(value)[:80]
                raise ArgumentError(f"metric must map logits (batch, pos, vocab) to a real tensor "
                                    f"(batch={logits.shape[0]},), got {got}")
            return _finite(host_f32(value), logits)
        return checked
    if correct_ids is None or incorrect_ids is None:
        raise ConfigMismatchError("give metric= or both correct_ids= and incorrect_ids=")
    return lambda logits: _finite(host_f32(logit_difference(logits, correct_ids, incorrect_ids, position)), logits)


def _finite(value: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``value`` (a metric's host copy), refused where it holds NaN / inf.

    Raises:
        NonFiniteError: naming the rows and the logits' dtype (``tensor="metric"``)."""
    bad = ~torch.isfinite(value)
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        why = "" if bool(torch.isfinite(logits).all()) else \
            ": the logits hold NaN / inf (an fp16 model's logits past 65504 are inf)"  # a read on the error path only
        raise NonFiniteError(f"the metric is NaN or inf at rows {rows} (logits in {logits.dtype}){why}; every effect "
                             "computed from it would be NaN: run the model in a wider dtype (torch.bfloat16 or "
                             "torch.float32) or check the metric", tensor="metric")
    return value


def _groups(replacement: ReplacementModel, targets: Any) -> list[tuple[Target, ...]]:  # checked here
    if isinstance(targets, (MHSAHead, LorsaHead, Feature, str)) or not isinstance(targets, Sequence):
        raise ConfigMismatchError(f"targets must be a list (or tuple) of targets or groups of them, got {targets!r}")
    groups: list[tuple[Target, ...]] = []
    for g in targets:
        group: tuple[Target, ...] = tuple(replacement.sort(g)) if isinstance(g, (list, tuple)) else (g,)  # type: ignore[arg-type,assignment]
        for t in group:
            replacement.check(t)
        groups.append(group)
    return groups


@dataclass
class PatchingResult:
    """Metric per group of targets: ``patched[i]`` is ``(batch,)`` with group ``i`` patched clean→corrupt.

    ``rounding``: the eps of the logits' dtype the metrics were computed from (``torch.finfo(dtype).eps``; set by
    :func:`activation_patching`), which decides where :attr:`normalized` is undefined."""

    groups: list[tuple[Target, ...]]
    clean: torch.Tensor
    corrupt: torch.Tensor
    patched: torch.Tensor
    rounding: float = torch.finfo(torch.float32).eps

    @property
    def normalized(self) -> torch.Tensor:
        """``(n_groups, batch)``: ``(patched − corrupt) / (clean − corrupt)``: 1 = the group restores the clean
        behaviour.

        Raises:
            UndefinedNormalizationError: rows whose clean and corrupt metrics are equal within the logits' rounding
                (:func:`~.metrics.normalized_effect`; the ratio was ±inf / NaN there).
        """
        return normalized_effect(self.patched - self.corrupt, self.clean, self.corrupt, self.rounding,
                                 "PatchingResult.normalized")

    def top(self, k: int) -> list[tuple[Target, ...]]:
        """The ``k`` groups with the largest batch-mean normalized effect (all of them where ``k`` is larger).

        Raises:
            ArgumentError: ``k`` not an int ``>= 0`` (a negative ``k`` dropped the last groups).
            UndefinedNormalizationError: as :attr:`normalized`.
        """
        return top_groups(self.groups, self.normalized, k)


def top_groups(groups: Sequence[tuple[Target, ...]], scores: torch.Tensor, k: Any) -> list[tuple[Target, ...]]:
    """The ``k`` of ``groups`` with the largest batch mean of ``scores (n_groups, batch)`` (all where ``k`` is
    larger); what :meth:`PatchingResult.top` and :meth:`~.path_patching.PathPatchingResult.top` return.

    Raises:
        ArgumentError: ``k`` not an int ``>= 0`` (a negative ``k`` dropped the last groups).
    """
    if not is_int(k) or k < 0:
        raise ArgumentError(f"top: k must be an int >= 0, got {k!r}")
    order = scores.mean(-1).argsort(descending=True)
    return [groups[int(i)] for i in order[:k]]


def activation_patching(replacement: ReplacementModel, clean: Any, corrupt: Any,
                        targets: Sequence[Target | Sequence[Target]], *, metric: Metric | None = None,
                        correct_ids: Any = None, incorrect_ids: Any = None,
                        positions: Positions = None, groups_per_trace: int = 8) -> PatchingResult:
    """Patch each target (or group of targets) from the ``clean`` run into the ``corrupt`` run.

    One trace reads every target on ``clean``; then each group is patched into ``corrupt`` in its
    own ``tracer.invoke`` (``groups_per_trace`` invokes batched per trace).

    Args:
        replacement: the model and its sets (:class:`~.targets.ReplacementModel`).
        clean, corrupt: token ids ``(batch, pos)`` of the same shape (or prompts of equal length row by row:
            prompts of different lengths are padded, and clean and corrupt must be padded alike).
        targets: targets, or tuples of targets patched together.
        positions: positions patched (None: all).

    Returns:
        :class:`PatchingResult`: ``clean`` and ``corrupt`` metrics ``(batch,)``, ``patched`` ``(n_groups, batch)``
        (the metric's dtype and device), ``groups`` in the order scored.

    Source: activation patching as in Heimersheim & Nanda 2024, "How to use and interpret activation
    patching"; the targets and where each lives: docs/patching.md.

    Raises:
        ArgumentError: ``replacement`` is not a :class:`~nnsight_lorsa.ReplacementModel` (a set, a bare
            model or a module: wrap it, ``ReplacementModel(model, lorsas=...)``).
        ShapeError: ``clean`` and ``corrupt`` differ in shape. Target errors before anything runs.
        ArgumentError: ``groups_per_trace`` not an int ``>= 1``; a ``metric`` that does not return ``(batch,)``;
            ``clean`` and ``corrupt`` padded differently, ``positions`` (or, for the default metric, the last
            position) that are padding in some row (:mod:`..envoy.padding`; before the patched runs).
        ConfigMismatchError: no targets.
        ArgumentError: ``clean`` / ``corrupt`` nnsight cannot batch, or holding an id outside the model's vocabulary
            or more tokens than its learned positions (:func:`~.interventions.check_prompts`).
    """
    refuse_inside_trace("activation_patching")
    check_replacement_model(replacement, "activation_patching")
    check_prompts(clean, "activation_patching", "clean", replacement.model)
    check_prompts(corrupt, "activation_patching", "corrupt", replacement.model)
    if not is_int(groups_per_trace) \
            or groups_per_trace < 1:
        raise ArgumentError(f"activation_patching: groups_per_trace must be an int >= 1, got {groups_per_trace!r}")
    groups = _groups(replacement, targets)
    if not groups:
        raise ConfigMismatchError("activation_patching needs at least one target (or group of targets)")
    score = make_metric(metric, correct_ids, incorrect_ids)
    if isinstance(clean, torch.Tensor) and isinstance(corrupt, torch.Tensor) and clean.shape != corrupt.shape:
        raise ShapeError(f"clean {tuple(clean.shape)} and corrupt {tuple(corrupt.shape)} token ids differ in shape")
    every = replacement.sort({t for g in groups for t in g})
    with torch.no_grad():
        values, clean_logits, clean_mask = _read_all(replacement, clean, every, positions, metric is None)
        corrupt_logits, corrupt_mask = _run(replacement, corrupt, every)
        check_same_padding(clean_mask, corrupt_mask, "activation_patching")
        patched = []
        for start in range(0, len(groups), groups_per_trace):
            outs = _patched_runs(replacement, corrupt, groups[start:start + groups_per_trace], values, positions,
                                 every)
            patched += [score(o) for o in outs]
    return PatchingResult(groups, score(clean_logits), score(corrupt_logits), torch.stack(patched),
                          metric_rounding(clean_logits))


def _read_all(replacement: ReplacementModel, prompts: Any, targets: list[Target], positions: Positions,
              default_metric: bool) -> tuple[dict[Target, torch.Tensor], torch.Tensor, torch.Tensor | None]:
    """The targets' values at ``positions``, the logits and the padding mask (:func:`~..envoy.padding.padding_mask`)
    of ``prompts``; refuses positions, and the default metric's last position, that are padding in a row."""
    values = {}
    with replacement.model.trace(prompts):
        mask = nnsight.save(check_padded_positions(replacement, positions, default_metric))
        replacement.prepare(targets)
        for t in targets:
            values[t] = read(Bound(t, replacement), positions)
        logits = saved_logits(replacement)
    return values, logits, mask


def check_padded_positions(replacement: ReplacementModel, positions: Positions,
                           default_metric: bool) -> torch.Tensor | None:
    """First thing in a trace body (or invoke) of an experiment: the batch's padding mask
    (:func:`~..envoy.padding.padding_mask`), after refusing edited ``positions`` out of the batch's range (also
    for unpadded prompts given as lists or texts) or — and, for the default metric (``default_metric``), the last
    position it reads — that are padding in some row.

    Raises:
        ArgumentError: ``positions`` out of range (:func:`~.interventions.check_positions`) or padding in a row.
    """
    mask = padding_mask(replacement.model)
    ids = replacement.model.inputs[1].get("input_ids")  # unpadded prompts given as lists or texts: their length
    if mask is not None or isinstance(ids, torch.Tensor) and ids.dim() == 2:
        check_positions(positions, int(mask.shape[1] if mask is not None else ids.shape[1]))
    if mask is not None:
        check_not_padding(mask, positions, "positions")
        if default_metric:
            check_not_padding(mask, -1, "the metric (the logit difference at the last position)")
    return mask


def _run(replacement: ReplacementModel, prompts: Any,
         targets: list[Target]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The logits and padding mask of ``prompts`` through the replacements ``targets`` need (as the clean and the
    patched runs: with ``error=False`` the replacement is not the model, so a baseline left on the model would not
    be the patched runs' "nothing patched")."""
    with replacement.model.trace(prompts):
        mask = nnsight.save(padding_mask(replacement.model))
        replacement.prepare(targets)
        logits = saved_logits(replacement)
    return logits, mask


def _patched_runs(replacement: ReplacementModel, prompts: Any, groups: list[tuple[Target, ...]],
                  values: dict[Target, torch.Tensor], positions: Positions, every: list[Target]) -> list[torch.Tensor]:
    """The logits of ``prompts`` with each group patched, one invoke each, every invoke through the replacements
    ``every`` (all the call's targets) need — those of the baselines, whichever chunk of groups this trace runs
    (until 2026-11-27 the chunk's only: with ``error=False`` a later chunk's runs measured their missing splices)."""
    outs = []
    with replacement.model.trace() as tracer:
        for group in groups:
            with tracer.invoke(prompts):
                replacement.prepare(every)  # every invoke: a splice replaces its callers' rows
                for t in group:
                    patch(Bound(t, replacement), values[t], positions)
                outs.append(saved_logits(replacement))
    return outs


@dataclass
class AblationResult:
    """Metric ``(batch,)`` without and with the ablation, and the relative effect (§10.4).

    ``rounding``: the eps of the logits' dtype the metrics were computed from (set by :func:`ablation_effect`),
    which decides where :attr:`relative` is undefined."""

    baseline: torch.Tensor
    ablated: torch.Tensor
    rounding: float = torch.finfo(torch.float32).eps

    @property
    def relative(self) -> torch.Tensor:
        """``(batch,)`` ``(baseline − ablated) / baseline`` (:func:`~.metrics.relative_effect`: a zero or
        rounding-sized baseline raises ``UndefinedNormalizationError`` naming the rows)."""
        return relative_effect(self.baseline, self.ablated, rounding=self.rounding)


def ablation_effect(replacement: ReplacementModel, prompts: Any, targets: Sequence[Target], *,
                    metric: Metric | None = None, correct_ids: Any = None, incorrect_ids: Any = None,
                    mode: Literal["zero", "mean"] = "zero",
                    means: Any = None, positions: Positions = None) -> AblationResult:
    """Ablate ``targets`` together on ``prompts``; the metric before and after.

    Raises:
        ArgumentError: ``replacement`` is not a :class:`~nnsight_lorsa.ReplacementModel` (a set, a bare
            model or a module: wrap it, ``ReplacementModel(model, lorsas=...)``).
        ArgumentError: ``positions`` (or, for the default metric, the last position) that are padding in some
            row of padded ``prompts`` (:mod:`..envoy.padding`, in the trace before any edit); see :func:`make_metric`.
            ``prompts`` nnsight cannot batch, or holding an id outside the model's vocabulary or more tokens than its
            learned positions (:func:`~.interventions.check_prompts`).
        ConfigMismatchError: ``targets`` not a non-empty list of targets; ``means`` with ``mode="zero"``.

    Source: *From Tokenization to Attribution Graphs* §10.4 (control experiments).
    """
    refuse_inside_trace("ablation_effect")
    check_replacement_model(replacement, "ablation_effect")
    check_prompts(prompts, "ablation_effect", model=replacement.model)
    check_target_list(targets, "ablation_effect")
    check_means_mode(mode, means, "ablation_effect")
    return _ablation(replacement, prompts, targets, targets, metric, correct_ids, incorrect_ids, mode, means,
                     positions)


def _ablation(replacement: ReplacementModel, prompts: Any, targets: Sequence[Target], splice: Sequence[Target],
              metric: Metric | None, correct_ids: Any, incorrect_ids: Any, mode: Literal["zero", "mean"], means: Any,
              positions: Positions) -> AblationResult:
    """:func:`ablation_effect` with both runs through the replacements ``splice`` needs (a superset of the
    targets': :func:`random_ablation_control` measures every draw through its whole pool's)."""
    score = make_metric(metric, correct_ids, incorrect_ids)
    ordered = replacement.sort(targets)
    for t in ordered:
        replacement.check(t)
    spliced = replacement.sort(set(splice) | set(ordered))
    model = replacement.model
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(prompts):
            check_padded_positions(replacement, positions, metric is None)
            replacement.prepare(spliced)  # the baseline runs through the same replacements, unedited
            base = saved_logits(replacement)
        with tracer.invoke(prompts):
            replacement.prepare(spliced)
            for t in ordered:
                ablate(Bound(t, replacement), mode, means, positions)
            edited = saved_logits(replacement)
    return AblationResult(score(base), score(edited), metric_rounding(base))


@dataclass
class RandomControl:
    """``samples[i]``: metric ``(batch,)`` with the i-th random draw of ``k`` targets ablated; ``rounding``: the eps
    of the logits' dtype the metrics were computed from (set by :func:`random_ablation_control`)."""

    baseline: torch.Tensor
    samples: torch.Tensor
    draws: list[tuple[Target, ...]]
    rounding: float = torch.finfo(torch.float32).eps

    @property
    def relative(self) -> torch.Tensor:
        """Relative effect per draw (batch-mean metric): ``(n_samples,)`` (:func:`~.metrics.relative_effect`: a zero or
        rounding-sized batch-mean baseline raises ``UndefinedNormalizationError``)."""
        return relative_effect(self.baseline.mean(), self.samples.mean(-1), rounding=self.rounding)


def random_ablation_control(replacement: ReplacementModel, prompts: Any, pool: Sequence[Target], k: int, *,
                            n_samples: int = 10, seed: int = 0, metric: Metric | None = None,
                            correct_ids: Any = None, incorrect_ids: Any = None,
                            mode: Literal["zero", "mean"] = "zero", means: Any = None,
                            positions: Positions = None) -> RandomControl:
    """Ablate ``k`` targets drawn at random from ``pool`` (e.g. all heads of the layer but the
    attributed ones), ``n_samples`` times: the control an attributed set's effect is compared to. Every run (the
    baseline and each draw) goes through the replacements the whole pool needs, so the draws share one baseline.

    Raises:
        ArgumentError: ``replacement`` is not a :class:`~nnsight_lorsa.ReplacementModel` (a set, a bare
            model or a module: wrap it, ``ReplacementModel(model, lorsas=...)``).
        ConfigMismatchError: ``pool`` not a non-empty list of targets; ``k`` not an int in ``[1, len(pool)]``; a
            target listed twice in ``pool`` (a draw of
            ``k`` could hold fewer than ``k``).
        ArgumentError: ``n_samples`` not a positive int, ``seed`` not an int in ``[-2**63, 2**64)``.
        ArgumentError: ``prompts`` nnsight cannot batch, or holding an id outside the model's vocabulary or more tokens
            than its learned positions (:func:`~.interventions.check_prompts`).

    Source: *From Tokenization to Attribution Graphs* §10.4 (control experiments).
    """
    refuse_inside_trace("random_ablation_control")
    check_replacement_model(replacement, "random_ablation_control")
    check_prompts(prompts, "random_ablation_control", model=replacement.model)
    check_target_list(pool, "random_ablation_control", "pool")
    check_means_mode(mode, means, "random_ablation_control")
    if not is_int(k) or not 0 < k <= len(pool):
        raise ConfigMismatchError(f"k={k!r} must be an int in [1, {len(pool)}] (the pool's size)")
    if not is_int(n_samples) or n_samples < 1:
        raise ArgumentError(f"random_ablation_control: n_samples must be a positive int, got {n_samples!r}")
    if not is_int(seed) or not -2**63 <= seed < 2**64:
        raise ArgumentError(f"random_ablation_control: seed must be an int in [-2**63, 2**64), got {seed!r}")
    for t in pool:
        replacement.check(t)
    refuse_repeats(pool, "random_ablation_control: the pool's targets")
    gen = torch.Generator(device=HOST).manual_seed(seed)  # draws on the CPU: the same on every device
    draws = [tuple(pool[int(i)] for i in torch.randperm(len(pool), generator=gen, device=HOST)[:k])
             for _ in range(n_samples)]
    samples, baseline, rounding = [], None, torch.finfo(torch.float32).eps
    for draw in draws:  # every draw through the pool's replacements: one baseline for all (until 2026-11-27 the
        # draw's own: with error=False draws splicing different sets were compared with the last draw's baseline)
        res = _ablation(replacement, prompts, draw, pool, metric, correct_ids, incorrect_ids, mode, means, positions)
        baseline, rounding = res.baseline, res.rounding
        samples.append(res.ablated)
    assert baseline is not None
    return RandomControl(baseline, torch.stack(samples), draws, rounding)


def head_swap(replacement: ReplacementModel, layer: int, from_head: int, to_head: int, prompts: Any, *,
              positions: Positions = -1, swap: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Lorsa App. D.4: set ``from_head``'s z to 0 at ``positions`` and give its value to ``to_head``.

    With ``swap=True`` the two heads exchange their z (the same as swapping their ``w_o``).
    Needs a replacement with a LorsaSet; the error term follows ``replacement.error``.

    Returns:
        ``(baseline_logits, swapped_logits)``, both ``(batch, pos, vocab)``.

    Raises:
        ArgumentError: ``replacement`` is not a :class:`~nnsight_lorsa.ReplacementModel` (a set, a bare
            model or a module: wrap it, ``ReplacementModel(model, lorsas=...)``).
        LayerOutOfRangeError, TargetIndexError: no Lorsa at ``layer``, a head outside ``[0, n_ov_heads)``
            (before the model runs). ArgumentError: ``positions`` that select no position of the prompts
            (:func:`~.interventions.check_positions`), or that are padding in some row of padded prompts.
        ArgumentError: ``prompts`` nnsight cannot batch, or holding an id outside the model's vocabulary or more tokens
            than its learned positions (:func:`~.interventions.check_prompts`).

    Source: Lorsa paper (He et al. 2025) App. D.4 (perturbation results).
    """
    refuse_inside_trace("head_swap")
    check_replacement_model(replacement, "head_swap")
    check_prompts(prompts, "head_swap", model=replacement.model)
    check_flag(swap, "swap", "head_swap")
    src, dst = replacement(LorsaHead(layer, from_head)), replacement(LorsaHead(layer, to_head))
    model = replacement.model
    pos = positions_index(positions)
    with torch.no_grad(), model.trace() as tracer:
        with tracer.invoke(prompts):
            replacement.prepare([src.target])  # the baseline runs through the same Lorsa, unedited
            base = saved_logits(replacement)
        with tracer.invoke(prompts):
            check_padded_positions(replacement, positions, False)
            z, _ = src.location()
            check_positions(positions, int(z.shape[1]))
            z_from = z[:, pos, from_head].clone()
            z_to = z[:, pos, to_head].clone()
            z[:, pos, from_head] = z_to if swap else 0
            z[:, pos, to_head] = z_from
            edited = saved_logits(replacement)
    del dst
    return base, edited
