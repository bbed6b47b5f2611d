"""Evaluate a trained module spliced into its model: FVU, L0, dead latents, next-token CE and KL.

:func:`evaluate` takes a replacement set — :class:`~..envoy.lorsa_set.LorsaSet`,
:class:`~..envoy.transcoder_set.TranscoderSet`, :class:`~..envoy.sae_set.SAESet` or
:class:`~..envoy.clt_set.CLTSet`, through their shared contract
(:class:`~..envoy.replacement_set.ReplacementSet`), or a
:class:`~..envoy.replacement_model.ReplacementModel` holding one — and runs three nnsight traces
per held-out batch: the unmodified model (``ce_orig``; the site's true value is read there), the
model with the site replaced by the module (``ce_spliced``, via the set's ``replace``) and with the
site zero-ablated (``ce_zero``).
``ce_recovered = (ce_zero − ce_spliced) / (ce_zero − ce_orig)`` is SAELens' "CE loss score"; ``kl``
is the mean KL(original ‖ spliced) of the next-token distributions. The metric names are the same
for every module kind (:class:`Evaluation`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import nnsight
import torch
from tqdm.auto import tqdm

from .._checks import check_flag, is_int
from .._placement import model_device
from .._progress import show_progress
from ..envoy.nnsight_internals import hf_module
from ..envoy.replacement_model import ReplacementModel
from ..envoy.replacement_set import ReplacementSet
from ..errors import ArgumentError, NonFiniteError, TooFewTokensError
from ..formats.hook_sites import mlp_site_io, writes_centred
from .dataset import TokenDataset, _loss_mask, check_dataset_ids
from .metrics import FVUAccumulator, ShrinkageAccumulator, next_token_ce


@dataclass
class Evaluation:
    """What :func:`evaluate` measures (CE and KL in nats per counted next-token prediction).

    Attributes:
        fvu: fraction of variance unexplained of the module's output against the site's true value
            (kept positions, no BOS) — a float, or for a CLT a list per layer (measured on the original
            model's activations: layer ``l`` reconstructed from the true MLP inputs of layers ``0 … l``).
        l0: mean number of active latents per token (float, or per layer for a CLT).
        dead_frac: fraction of latents that never fire on the set (float, or per layer for a CLT).
        ce_orig, ce_spliced, ce_zero: CE of the original model, with the module spliced in (every MLP
            for a CLT), and with the site(s) zero-ablated.
        kl: mean KL(original ‖ spliced). n_tokens: counted predictions.
        l2_norm_in, l2_norm_out, l2_ratio, relative_reconstruction_bias, feature_density: SAELens's
            shrinkage and density metrics of the module's output against the site's true value
            (the tokens FVU counts; :class:`~.metrics.ShrinkageAccumulator`); ``None`` for a CLT.

    Source: SAELens ``sae_lens/evals.py`` (CE loss score, KL, shrinkage metrics).
    """

    fvu: float | list[float]
    l0: float | list[float]
    dead_frac: float | list[float]
    ce_orig: float
    ce_spliced: float
    ce_zero: float
    kl: float
    n_tokens: int
    l2_norm_in: float | None = None
    l2_norm_out: float | None = None
    l2_ratio: float | None = None
    relative_reconstruction_bias: float | None = None
    feature_density: list[float] | None = None

    @property
    def ce_recovered(self) -> float:
        """``(ce_zero − ce_spliced) / (ce_zero − ce_orig)``: 1 = as good as the original, 0 = as zero-ablation;
        ``nan`` when zero-ablating the site leaves the CE unchanged (``ce_zero == ce_orig``: the score is
        undefined there; SAELens' tensor division gives ``nan`` or ``±inf``).

        Source: SAELens ``sae_lens/evals.py`` (CE loss score, KL, shrinkage metrics).
        """
        gap = self.ce_zero - self.ce_orig
        return (self.ce_zero - self.ce_spliced) / gap if gap != 0 else math.nan

    def to_dict(self) -> dict[str, Any]:
        """The fields plus ``ce_recovered``.

        Source: SAELens ``sae_lens/evals.py`` (CE loss score, KL, shrinkage metrics).
        """
        return {**asdict(self), "ce_recovered": self.ce_recovered}

    def summary(self) -> dict[str, Any]:
        """:meth:`to_dict` with floats rounded to 4 decimals (for printing / JSON), without the
        per-feature ``feature_density``.

        Source: SAELens ``sae_lens/evals.py`` (CE loss score, KL, shrinkage metrics).
        """
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in self.to_dict().items()
                if k != "feature_density"}


def _predicted(mask: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """``(batch, pos−1)`` bool: which next-token predictions count (targets ``ids[:, 1:]``)."""
    return torch.ones_like(ids[:, 1:], dtype=torch.bool) if mask is None else mask[:, 1:].to(ids.device)


def _finite(value: float, name: str, batch: int, logits: torch.Tensor) -> float:
    """``value`` (a metric's sum over batch ``batch``), refused where it is NaN or inf: the ``logits`` it was
    computed from (in fp32) hold non-finite values — an fp16 model's logits past 65504 are ``inf``.

    Raises:
        NonFiniteError: naming the metric, the batch and the logits' dtype (``step`` the batch, ``tensor`` the
            metric)."""
    if not math.isfinite(value):
        raise NonFiniteError(f"evaluate: {name} of batch {batch} is {value}: the logits ({logits.dtype}) it is "
                             "computed from hold NaN or inf values (an fp16 model's logits past 65504 are inf); "
                             "evaluate the model in a wider dtype (torch.bfloat16 or torch.float32)",
                             step=batch, tensor=name)
    return value


def _kl(logits_p: torch.Tensor, logits_q: torch.Tensor, keep: torch.Tensor) -> float:
    """Summed KL(p ‖ q) over the counted predicting positions (``keep`` over ``[:, :-1]``), in fp32."""
    keep = keep.to(logits_p.device)
    lp = logits_p[:, :-1][keep].float().log_softmax(-1)
    lq = logits_q[:, :-1][keep.to(logits_q.device)].float().log_softmax(-1).to(lp.device)
    return float((lp.exp() * (lp - lq)).sum())


def _fvu_target(target: torch.Tensor, centre: bool) -> torch.Tensor:
    """``target`` in fp32, minus its per-token mean where the module was trained on TransformerLens's centred
    residual (``hook_sites.writes_centred``)."""
    target = target.float()
    return target - target.mean(-1, keepdim=True) if centre else target


class _SiteProbe:
    """One replaced site (a Lorsa's attention, a transcoder's MLP, an SAE's module): FVU and L0 from
    the spliced trace's features and output against the true value read in the original trace (``centre``: minus
    its per-token mean, for a module trained on TransformerLens's centred residual: ``hook_sites.writes_centred``).
    (Values saved inside a trace are kept on the probe: nnsight hands back saved locals only.)"""

    def __init__(self, model: Any, path: str, value: Callable[[Any], Any], with_value: Callable[[Any, Any], Any],
                 n_latents: int, splice: Callable[[], tuple[Any, Any]], centre: bool = False) -> None:
        self.model, self.path, self.value, self.with_value = model, path, value, with_value
        self.centre = centre
        self.splice_fn = splice
        self.acc = FVUAccumulator()
        self.shrinkage = ShrinkageAccumulator(n_latents)
        self.l0_sum, self.l0_n = 0.0, 0
        self.fired = torch.zeros(n_latents, dtype=torch.bool, device="cpu")  # host-side

    def read(self) -> None:
        self.target = nnsight.save(self.value(self.model.get(self.path).output))

    def splice(self) -> None:
        z, out = self.splice_fn()
        self.z, self.out = nnsight.save(z), nnsight.save(out)

    def zero(self) -> None:
        env = self.model.get(self.path)
        original = env.output
        env.output = self.with_value(original, torch.zeros_like(self.value(original)))

    def measure(self, ids: torch.Tensor, mask: torch.Tensor | None) -> None:
        keep = _loss_mask(ids, mask)
        # the true value on the model's device, the module's output and features on the module's:
        # compared on the model's device in fp32 (the accumulators' own precision is fp64)
        target = _fvu_target(self.target[keep.to(self.target.device)], self.centre)
        out = self.out[keep.to(self.out.device)].to(target.device)
        z = self.z[keep.to(self.z.device)]
        self.acc.update(target, out.float())
        self.shrinkage.update(target, out, z)
        active = z != 0  # fired: non-zero (an AbsTopK feature fires negative too; as feature_density)
        self.l0_sum += float(active.sum())
        self.l0_n += active.shape[0]
        self.fired |= active.any(0).cpu()

    def result(self) -> tuple[Any, Any, Any]:
        return self.acc.value(), self.l0_sum / max(self.l0_n, 1), float((~self.fired).float().mean())

    def shrinkage_metrics(self) -> dict[str, Any]:
        return self.shrinkage.value()


class _CLTProbe:
    """A CLT replacing every MLP: per-layer FVU / L0 / dead from the CLT run on the original model's
    MLP inputs and outputs (the spliced trace changes later layers' inputs)."""

    def __init__(self, clt_set: Any) -> None:
        self.model, self.adapter, self.clt, self.clt_set = clt_set.model, clt_set.adapter, clt_set.clt, clt_set
        n = self.clt.n_layers
        # where each layer reads and writes: the MLP's call, or the tensors its circuit-tracer hooks name
        self.ios = [mlp_site_io(self.clt, self.adapter, hf_module(self.model), layer) for layer in range(n)]
        self.centre = writes_centred(self.clt, self.adapter, hf_module(self.model))
        self.paths = [io.output_path for io in self.ios]
        self.accs = [FVUAccumulator() for _ in range(n)]
        self.l0_sum = torch.zeros(n, dtype=torch.float64, device="cpu")  # host-side
        self.n_kept = 0
        self.fired = torch.zeros(n, self.clt.cfg.d_sae, dtype=torch.bool, device="cpu")

    def read(self) -> None:
        self.xs: list[Any] = []
        self.ys: list[Any] = []
        for path, io in zip(self.paths, self.ios, strict=True):
            args, kwargs = self.model.get(io.input_path).inputs
            self.xs.append(nnsight.save(io.read(self.adapter.mlp_input(args, kwargs))))
            self.ys.append(nnsight.save(self.adapter.mlp_output(self.model.get(path).output)))

    def splice(self) -> None:
        self.clt_set.replace()

    def zero(self) -> None:
        for path in self.paths:
            env = self.model.get(path)
            original = env.output
            env.output = self.adapter.with_mlp_output(original, torch.zeros_like(self.adapter.mlp_output(original)))

    def measure(self, ids: torch.Tensor, mask: torch.Tensor | None) -> None:
        xs, ys, clt = self.xs, self.ys, self.clt
        keep = _loss_mask(ids, mask)
        dev = clt.W_enc.device  # the CLT runs on its device in its dtype; FVU against y in fp32 there
        x = torch.stack([t[keep.to(t.device)].to(dev) for t in xs]).to(clt.W_enc.dtype)
        y = torch.stack([t[keep.to(t.device)].to(dev) for t in ys])
        acts = clt.encode(x)
        recon = clt.decode(acts, x)
        for layer, acc in enumerate(self.accs):
            acc.update(_fvu_target(y[layer], self.centre), recon[layer].float())
        active = acts != 0  # fired: non-zero (an AbsTopK feature fires negative too)
        self.l0_sum += active.sum((1, 2)).double().cpu()
        self.n_kept += x.shape[1]
        self.fired |= active.any(1).cpu()

    def result(self) -> tuple[Any, Any, Any]:
        return ([a.value() for a in self.accs], [float(v) / max(self.n_kept, 1) for v in self.l0_sum],
                [float(v) for v in (~self.fired).float().mean(1)])

    def shrinkage_metrics(self) -> dict[str, Any]:
        return {}  # SAELens's shrinkage metrics are per site: none for a CLT


def _one_set(replacements: Any) -> ReplacementSet:
    """The set to evaluate: ``replacements`` itself, or the one set a ReplacementModel holds."""
    if isinstance(replacements, ReplacementModel):
        held = replacements.sets()
        if len(held) != 1:
            raise ArgumentError(f"evaluate: the ReplacementModel holds {len(held)} sets ({[s for s, _ in held]}): "
                                "pass the one to evaluate (rm.lorsas, rm.transcoders or rm.saes)")
        return held[0][1]
    if not isinstance(replacements, ReplacementSet):
        raise ArgumentError("evaluate needs a LorsaSet, TranscoderSet, SAESet or CLTSet (or a ReplacementModel "
                            f"holding one), got {type(replacements).__name__}")
    return replacements


def _probe(replacements: ReplacementSet, at: Any) -> _SiteProbe | _CLTProbe:
    if replacements.spans_layers:
        if at is not None:
            raise ArgumentError(f"evaluate(at=...): a {type(replacements).__name__} replaces every MLP at once, it "
                                "takes no at=")
        return _CLTProbe(replacements)
    if at is None:
        keys = list(replacements)
        if len(keys) != 1:
            raise ArgumentError(f"evaluate: the set holds {len(keys)} modules ({keys}): pass at=")
        at = keys[0]
    chain = replacements.site(at)  # where the module's output goes, for every kind (the set contract)
    centre = writes_centred(replacements[at], replacements.adapter, hf_module(replacements.model))
    return _SiteProbe(replacements.model, chain.site_paths[0], chain.get_output, chain.set_output,
                      replacements.n_latents(at),
                      lambda: replacements.latents_and_output(replacements.replace(at)), centre)


@torch.no_grad()
def evaluate(replacements: ReplacementSet | ReplacementModel, dataset: TokenDataset, *, at: Any = None,
             batch_size: int = 8, max_batches: int | None = None, progress: bool | None = None) -> Evaluation:
    """Evaluate a module spliced into its model on the windows of ``dataset`` (or its first
    ``max_batches`` batches of ``batch_size``); use the folded module (:meth:`~.trainer.Trainer.folded`).

    Args:
        replacements: the module in its replacement set: a Lorsa (site: layer ``at``'s attention output),
            transcoder (layer ``at``'s MLP output), SAE (the output of module path ``at``), or a CLT
            (every MLP output at once; per-layer FVU / L0 / dead); or a ReplacementModel holding one set.
        dataset: held-out windows; its ``target_mask`` (default all) says what counts everywhere:
            CE and KL count the predictions of kept tokens, FVU / L0 / dead fraction the kept
            positions (padding counts nowhere); BOS (column 0) is excluded from FVU / L0 / dead.
        at: the layer (Lorsa, transcoder) or module path (SAE) to evaluate; default: the set's only one.
        progress: a tqdm bar over the batches; None (default): when stderr is a terminal.

    Devices and dtypes: the model may be on any device in any float dtype and the module on its own
    device and dtype (e.g. an fp32 module on a bf16 model); the token windows are moved to the
    model's device, and CE, KL and FVU are computed in fp32 (FVU and the shrinkage metrics accumulated in fp64);
    CE and KL from the model's logits (Gemma-2: its unembedding's output soft-capped,
    :meth:`~nnsight_lorsa.adapters.base.ArchitectureAdapter.final_logits`). The result holds Python floats.

    Raises:
        ArgumentError: ``at`` missing while the set holds several modules, or given for a CLT; not one
            of these sets, or a ReplacementModel holding none or several (a ``TypeError`` and a ``ValueError`` too);
            ``batch_size`` not an int >= 1, ``max_batches`` neither None nor an int >= 1, ``dataset`` not a
            :class:`~.dataset.TokenDataset`, ``progress`` neither None nor a bool; a window evaluated holding an id
            outside the model's vocabulary or longer than its learned positions (:func:`~.dataset.check_dataset_ids`).
        TooFewTokensError: the windows evaluated hold no counted prediction (their ``target_mask`` keeps no token
            after the first of a window): CE and KL would be 0 / 0. Raised before the model runs.
        PlacementError: the model is on the meta device (not dispatched).
        NonFiniteError: a CE or the KL of a batch is NaN / inf, from non-finite logits (an fp16 model's past
            65504), naming the metric, the batch and the logits' dtype.

    Source: SAELens ``sae_lens/evals.py`` (CE loss score, KL, shrinkage metrics).
    """
    if not is_int(batch_size) or batch_size < 1:
        raise ArgumentError(f"evaluate: batch_size must be an int >= 1, got {batch_size!r}")
    if max_batches is not None and (not is_int(max_batches) or max_batches < 1):
        raise ArgumentError(f"evaluate: max_batches must be None or an int >= 1, got {max_batches!r}")
    if not isinstance(dataset, TokenDataset):
        raise ArgumentError(f"evaluate: dataset must be a TokenDataset, got {type(dataset).__name__}")
    if progress is not None:
        check_flag(progress, "progress", "evaluate")
    batch_size = int(batch_size)
    n_batches = (len(dataset) + batch_size - 1) // batch_size
    if max_batches is not None:
        n_batches = min(n_batches, int(max_batches))
    kept = dataset.targets(0, n_batches * batch_size)
    if kept is not None and not bool(kept[:, 1:].any()):
        raise TooFewTokensError(
            f"evaluate: the {min(len(dataset), n_batches * batch_size)} windows evaluated hold no counted prediction: "
            "their target_mask keeps no token after the first of a window, so CE and KL are undefined (0 / 0). "
            "Evaluate on windows with real tokens (TokenDataset's target_mask marks what counts)")
    replacements = _one_set(replacements)
    probe = _probe(replacements, at)
    model = replacements.model
    check_dataset_ids(dataset, model, "evaluate", n_batches * batch_size)
    device = model_device(model)
    lm_head_path = replacements.adapter.lm_head_path
    sums = {"orig": 0.0, "spliced": 0.0, "zero": 0.0, "kl": 0.0}
    n_tok = 0
    for i in tqdm(range(n_batches), desc="evaluate", disable=not show_progress(progress), dynamic_ncols=True):
        ids = dataset.tokens[i * batch_size:(i + 1) * batch_size].to(device)
        lm_head = model.get(lm_head_path)
        with model.trace(ids, use_cache=False):
            probe.read()
            logits_orig = nnsight.save(lm_head.output)
        with model.trace(ids, use_cache=False):
            probe.splice()
            logits_spliced = nnsight.save(lm_head.output)
        with model.trace(ids, use_cache=False):
            probe.zero()
            logits_zero = nnsight.save(lm_head.output)
        mask = dataset.targets(i * batch_size, (i + 1) * batch_size)
        # the model's logits (Gemma-2: soft-capped after the unembedding, whose output the traces read)
        logits_orig, logits_spliced, logits_zero = (replacements.adapter.final_logits(t)
                                                    for t in (logits_orig, logits_spliced, logits_zero))
        for key, logits in (("orig", logits_orig), ("spliced", logits_spliced), ("zero", logits_zero)):
            ce, n = next_token_ce(logits, ids, mask)
            sums[key] += _finite(float(ce), f"ce_{key}", i, logits)
        sums["kl"] += _finite(_kl(logits_orig, logits_spliced, _predicted(mask, ids)), "kl", i, logits_spliced)
        n_tok += n
        probe.measure(ids, mask)
    fvu, l0, dead = probe.result()
    shrinkage = probe.shrinkage_metrics()
    return Evaluation(fvu=fvu, l0=l0, dead_frac=dead, ce_orig=sums["orig"] / n_tok,
                      ce_spliced=sums["spliced"] / n_tok, ce_zero=sums["zero"] / n_tok, kl=sums["kl"] / n_tok,
                      n_tokens=n_tok, **shrinkage)
