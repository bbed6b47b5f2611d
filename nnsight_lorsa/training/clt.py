"""Train a cross-layer transcoder (CLT) on the MLP inputs and outputs of all layers at once.

Seed ``004_…`` §7.1 (Ameisen et al. 2025): layer ``l``'s features read MLP input ``x_l`` and
write to every MLP output ``l' ≥ l``. Data: :class:`CLTActivationSource` reads the MLP input and
output of layers ``0 … n_layers−1`` in one ``model.trace`` per batch (through
:func:`~.activation_cache.read_sites`, the activation cache's reader) and stacks them as
:class:`CLTBatch` ``(n_layers, batch, pos, d_model)``; :meth:`CLTActivationSource.cached` gives the
same stream from an :class:`~.activation_cache.ActivationCache` holding those sites.

Objective (:class:`CLTTrainer`, normalised space, one scale factor per layer):
``Σ_l mean_tokens ‖y_l · s_out[l] − ŷ_l‖²`` — each layer's term is the per-layer transcoder loss of
:class:`~.sparse_coders.SparseCoderTrainer` — plus, per source layer, the sparsity term of the
activation (:func:`~.sparse_coders.sparsity_terms`: AuxK for TopK / BatchTopK, the L0 penalty for
JumpReLU, decoder-norm-weighted L1 for ReLU), where a feature's decoder is its row over all the
layers it writes to (flattened ``W_dec_l (d_sae, (n_layers − l) · d_model)``, as Ameisen et al.
weight the sparsity by the concatenated decoder norm). Dataset-norm factors
``s_in[l] = sqrt(d_model) / E‖x_l‖`` and ``s_out[l] = sqrt(d_model) / E‖y_l‖`` are estimated on the
first ``norm_batches`` batches; the same Adam + WSD loop, dead counters and exact checkpoint
resume as every trainer (:class:`~.trainer.TrainerCore`). Decoder rows (over all targets) are kept
at unit norm except for JumpReLU (``normalize_decoder`` overrides). :meth:`CLTTrainer.folded` gives
the CLT acting on raw activations. :func:`evaluate_clt` splices it into every MLP and reports
per-layer FVU / L0 / dead fraction and next-token CE against the original and zero-ablated model.

Not done: the sparse TopK kernels (the CLT trains through the dense path) and data parallelism.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nnsight
import torch

from .._typing import Bool, Float
from ..adapters.registry import get_adapter
from ..envoy.clt_set import CLTSet
from ..errors import CheckpointError, ConfigMismatchError, ShapeError
from ..modules.clt import CLTConfig, CrossLayerTranscoder
from ..modules.sparse_coder import affine
from .activation_cache import ActivationCache, CachedSiteSource, read_sites
from .activations import Site, TokenDataset, loss_mask_for
from .evaluate import CERecovered, accumulate_ce
from .metrics import FVUAccumulator, fvu
from .sparse_coders import DictionaryTrainer, SparseCoderTrainConfig, sparsity_terms


@dataclass
class CLTBatch:
    """One batch of every layer's MLP input and output.

    Attributes:
        x: ``(n_layers, batch, pos, d_model)`` MLP inputs (after the pre-MLP norm), layer-major.
        y: ``(n_layers, batch, pos, d_model)`` MLP outputs.
        loss_mask: ``(batch, pos)`` bool, False at BOS and padding.
    """

    x: Float[torch.Tensor, "n_layers batch pos d_model"]
    y: Float[torch.Tensor, "n_layers batch pos d_model"]
    loss_mask: Bool[torch.Tensor, "batch pos"]


def _mlp_sites(adapter: Any, n_layers: int) -> dict[str, Site]:
    sites: dict[str, Site] = {}
    for layer in range(n_layers):
        sites[f"x{layer}"] = Site.mlp_input(adapter, layer)
        sites[f"y{layer}"] = Site.mlp_output(adapter, layer)
    return sites


class CLTActivationSource:
    """Batch ``i`` = the MLP inputs and outputs of layers ``0 … n_layers−1`` on token batch ``i``.

    One ``model.trace`` per batch (:func:`~.activation_cache.read_sites`; the trace stops after the
    last MLP), on the windows :meth:`~.activations.TokenDataset.batch` picks — the same windows as
    ``SiteActivationSource.transcoder(model, l, dataset, batch_size, seed)`` for every ``l``.

    Args:
        model: nnsight-wrapped model. dataset: :class:`~.activations.TokenDataset`.
        batch_size: windows per batch. seed: shuffling seed.
        n_layers: layers spanned (default: all of the model's).

    Attributes:
        n_layers, d_model: the stacked shape (checked by :class:`CLTTrainer`).

    Raises:
        LayerOutOfRangeError: ``n_layers`` exceeds the model's layer count (or is < 1).
    """

    def __init__(self, model: Any, dataset: TokenDataset, batch_size: int, seed: int = 0,
                 n_layers: int | None = None) -> None:
        self.model = model
        self.adapter = get_adapter(model)
        self.n_layers = self.adapter.n_layers if n_layers is None else self.adapter.check_layer(n_layers - 1) + 1
        self.d_model = int(self.adapter.d_model)
        self.sites = _mlp_sites(self.adapter, self.n_layers)
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed

    @staticmethod
    def cached(cache: ActivationCache, adapter: Any, batch_size: int, seed: int = 0,
               n_layers: int | None = None) -> CachedCLTSource:
        """The same stream read from ``cache``, which must hold every layer's MLP input and output
        (``Site.mlp_input`` / ``Site.mlp_output`` of layers ``0 … n_layers−1``; any names).

        Raises:
            ActivationCacheError: one of those sites is not cached.
        """
        n = adapter.n_layers if n_layers is None else adapter.check_layer(n_layers - 1) + 1
        sources = [cache.source(Site.mlp_input(adapter, layer), Site.mlp_output(adapter, layer), batch_size, seed)
                   for layer in range(n)]
        return CachedCLTSource(sources, int(adapter.d_model))

    def __call__(self, index: int) -> CLTBatch:
        ids = self.dataset.batch(index, self.batch_size, self.seed)
        values = read_sites(self.model, self.sites, ids)
        n = self.n_layers
        return CLTBatch(x=torch.stack([values[f"x{layer}"] for layer in range(n)]),
                        y=torch.stack([values[f"y{layer}"] for layer in range(n)]),
                        loss_mask=loss_mask_for(ids, None))


class CachedCLTSource:
    """Batch ``i`` of a cached CLT stream: the per-layer cached (MLP input, MLP output) sources
    (:class:`~.activation_cache.CachedSiteSource`, same windows) stacked; see :meth:`CLTActivationSource.cached`."""

    def __init__(self, sources: list[CachedSiteSource], d_model: int) -> None:
        self.sources = sources
        self.n_layers = len(sources)
        self.d_model = d_model

    def __call__(self, index: int) -> CLTBatch:
        batches = [source(index) for source in self.sources]
        return CLTBatch(x=torch.stack([b.x for b in batches]), y=torch.stack([b.y for b in batches]),
                        loss_mask=batches[0].loss_mask)


class CLTTrainer(DictionaryTrainer):
    """Trains a :class:`~..modules.clt.CrossLayerTranscoder` on :class:`CLTBatch` es; see the module docstring.

    Args:
        clt: the module (modified in place; training-space weights). Its activation — TopK,
            BatchTopK, JumpReLU or ReLU — picks the sparsity term, as for
            :class:`~.sparse_coders.SparseCoderTrainer`.
        source: batch index -> :class:`CLTBatch` (:class:`CLTActivationSource`, :class:`CachedCLTSource`).
        config: :class:`~.sparse_coders.SparseCoderTrainConfig` (``sparse_kernels`` is ignored).

    Attributes:
        s_in_layers, s_out_layers: the per-layer scale factors (lists of ``n_layers`` floats;
            None before the first step). ``s_in`` / ``s_out`` hold their means (for display).

    Raises:
        ConfigMismatchError: the source's ``n_layers`` / ``d_model`` (where it has them) differ
            from the CLT's.
        ShapeError: (from :meth:`loss`) a batch whose layer count or width differs from the CLT's.
    """

    desc = "CLT"
    weights_file = "clt.safetensors"
    config_key = "clt_config"

    def __init__(self, clt: CrossLayerTranscoder, source: Callable[[int], CLTBatch] | Any,
                 config: SparseCoderTrainConfig) -> None:
        n_src, d_src = getattr(source, "n_layers", None), getattr(source, "d_model", None)
        if n_src is not None and n_src != clt.n_layers:
            raise ConfigMismatchError(f"the CLT spans {clt.n_layers} layers, the activation source {n_src}")
        if d_src is not None and d_src != clt.cfg.d_in:
            raise ConfigMismatchError(f"the CLT has d_model={clt.cfg.d_in}, the activation source {d_src}")
        super(CLTTrainer, self).__init__(clt, source, config)
        self.clt = clt
        self.config: SparseCoderTrainConfig = config
        self.s_in_layers: list[float] | None = None
        self.s_out_layers: list[float] | None = None
        clt.train()

    @staticmethod
    def n_latents(module: Any) -> int:
        return int(module.cfg.n_layers * module.cfg.d_sae)

    @property
    def activation_fn(self) -> Any:
        return self.clt.activation[0]

    def module_config(self) -> dict[str, Any]:
        return self.clt.cfg.to_dict()

    @classmethod
    def build_module(cls, meta: dict[str, Any]) -> torch.nn.Module:
        return CrossLayerTranscoder(CLTConfig.from_dict(dict(meta[cls.config_key])))

    # -------------------------------------------------------------- norms
    def check_batch(self, batch: CLTBatch) -> None:
        """Raise :class:`~..errors.ShapeError` unless ``batch.x`` / ``batch.y`` are
        ``(n_layers, batch, pos, d_model)`` of this CLT and ``loss_mask`` is ``(batch, pos)``."""
        c = self.clt.cfg
        for name, t in (("x", batch.x), ("y", batch.y)):
            if t.dim() != 4 or t.shape[0] != c.n_layers or t.shape[-1] != c.d_in:
                raise ShapeError(f"CLT training batch: {name} must be (n_layers={c.n_layers}, batch, pos, "
                                 f"d_model={c.d_in}), got {tuple(t.shape)}")
        if batch.x.shape != batch.y.shape or tuple(batch.loss_mask.shape) != tuple(batch.x.shape[1:3]):
            raise ShapeError(f"CLT training batch: x {tuple(batch.x.shape)}, y {tuple(batch.y.shape)} and "
                             f"loss_mask {tuple(batch.loss_mask.shape)} disagree")

    @torch.no_grad()
    def estimate_norms(self) -> tuple[float, float]:
        """Per-layer factors ``s[l] = sqrt(d_model) / E‖·_l‖`` over the loss-masked tokens of the first
        ``norm_batches`` batches (into :attr:`s_in_layers` / :attr:`s_out_layers`); returns their means."""
        norms_x, norms_y = [], []
        for i in range(self.config.norm_batches):
            b = self.source(i)
            self.check_batch(b)
            norms_x.append(b.x[:, b.loss_mask].norm(dim=-1))
            norms_y.append(b.y[:, b.loss_mask].norm(dim=-1))
        root_d = math.sqrt(self.clt.cfg.d_in)
        self.s_in_layers = [root_d / float(v) for v in torch.cat(norms_x, 1).mean(1)]
        self.s_out_layers = [root_d / float(v) for v in torch.cat(norms_y, 1).mean(1)]
        self.s_in = sum(self.s_in_layers) / len(self.s_in_layers)
        self.s_out = sum(self.s_out_layers) / len(self.s_out_layers)
        self.after_norms()
        return self.s_in, self.s_out

    def _scales(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.s_in_layers is None or self.s_out_layers is None:
            raise RuntimeError("norms are not estimated yet: train first")
        return (torch.tensor(self.s_in_layers, dtype=dtype)[:, None, None],
                torch.tensor(self.s_out_layers, dtype=dtype)[:, None, None])

    # -------------------------------------------------------------- step
    def loss(self, batch: CLTBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss on one batch (normalised space) and its metrics: ``loss``, ``mse`` (summed over
        layers), ``fvu`` / ``l0`` (means over layers; per layer as ``fvu_{l}`` / ``l0_{l}``),
        ``dead_frac`` (over all ``n_layers · d_sae`` features), ``aux``, ``sparsity`` (summed over layers).

        Raises:
            ShapeError: the batch does not fit the CLT (:meth:`check_batch`).
        """
        self.check_batch(batch)
        clt = self.clt
        dtype = clt.W_enc.dtype
        s_in, s_out = self._scales(dtype)
        mask = batch.loss_mask
        x = batch.x[:, mask].to(dtype) * s_in                        # (n_layers, n, d_model)
        y = batch.y[:, mask].to(dtype) * s_out
        n_layers, n_tok = x.shape[0], x.shape[1]
        pres = [affine(x[layer], clt.W_enc[layer], clt.b_enc[layer]) for layer in range(n_layers)]
        acts = torch.stack([clt.activation[layer](pres[layer]) for layer in range(n_layers)])
        out = clt.decode(acts, x)
        err = y - out
        mse = err.pow(2).sum(-1).mean(-1).sum()
        loss = mse
        active = acts > 0
        dead = self.count_fired(active.any(1).reshape(-1), n_tok).view(n_layers, -1)
        aux = torch.zeros((), dtype=mse.dtype)
        sparsity = torch.zeros((), dtype=mse.dtype)
        for layer in range(n_layers):
            # a source layer's features write to layers layer..n_layers-1: decoder and error over all of them
            err_l = err[layer:].transpose(0, 1).reshape(n_tok, -1)
            W_l = clt.W_dec(layer).reshape(clt.cfg.d_sae, -1)
            penalty, aux_l, sparsity_l = sparsity_terms(self, clt.activation[layer], pres[layer], acts[layer],
                                                        dead[layer], err_l, W_l)
            if penalty is not None:
                loss = loss + penalty
            aux = aux + aux_l.detach()
            sparsity = sparsity + sparsity_l.detach()
        out_d = out.detach()
        fvus = [float(fvu(y[layer], out_d[layer])) for layer in range(n_layers)]
        l0s = [float(v) for v in active.sum(-1).float().mean(-1)]
        metrics = {"loss": float(loss.detach()), "mse": float(mse.detach()), "fvu": sum(fvus) / n_layers,
                   "l0": sum(l0s) / n_layers, "dead_frac": float(dead.float().mean()), "aux": float(aux),
                   "sparsity": float(sparsity)}
        metrics.update({f"fvu_{layer}": v for layer, v in enumerate(fvus)})
        metrics.update({f"l0_{layer}": v for layer, v in enumerate(l0s)})
        return loss, metrics

    @torch.no_grad()
    def post_step(self) -> None:
        if self.normalize_decoder:
            for layer in range(self.clt.n_layers):
                W = self.clt.W_dec(layer)
                W.div_(W.flatten(1).norm(dim=-1)[:, None, None].clamp_min(1e-12))

    # -------------------------------------------------------- checkpoints
    def save_checkpoint(self, directory: str | Path) -> None:
        """:meth:`~.trainer.TrainerCore.save_checkpoint` plus the per-layer scale factors in ``trainer.json``."""
        super(CLTTrainer, self).save_checkpoint(directory)
        path = Path(directory) / "trainer.json"
        meta = json.loads(path.read_text())
        meta["s_in_layers"], meta["s_out_layers"] = self.s_in_layers, self.s_out_layers
        path.write_text(json.dumps(meta, indent=1))

    def restore_state(self, directory: str | Path, meta: dict[str, Any]) -> None:
        """:meth:`~.trainer.TrainerCore.restore_state` plus the per-layer scale factors.

        Raises:
            CheckpointError: ``trainer.json`` lacks them or has the wrong number.
        """
        super(CLTTrainer, self).restore_state(directory, meta)
        s_in, s_out = meta.get("s_in_layers"), meta.get("s_out_layers")
        n = self.clt.n_layers
        complete = isinstance(s_in, list) and isinstance(s_out, list) and len(s_in) == len(s_out) == n
        if (s_in is not None or s_out is not None or self.step > 0) and not complete:
            raise CheckpointError(f"{Path(directory) / 'trainer.json'}: needs s_in_layers and s_out_layers "
                                  f"with {n} entries each")
        self.s_in_layers, self.s_out_layers = s_in, s_out

    # ----------------------------------------------------------- results
    @torch.no_grad()
    def folded(self) -> CrossLayerTranscoder:
        """A copy acting on raw activations (eval mode): ``ŷ_raw_l' = ŷ_l'(x · s_in) / s_out[l']``.

        ``W_enc[l] *= s_in[l]`` (pre-activations unchanged: the same features fire with the same
        values, so JumpReLU / BatchTopK thresholds stay valid), ``W_dec_l[:, l' − l] /= s_out[l']``,
        ``b_dec[l] /= s_out[l]``, ``W_skip[l] *= s_in[l] / s_out[l]``. Decoder rows are not renormalised.

        Raises:
            RuntimeError: the norms are not estimated yet (no training step taken).
        """
        s_in, s_out = self._scales(self.clt.W_enc.dtype)
        out = copy.deepcopy(self.clt).eval()
        out.W_enc.mul_(s_in)
        for layer in range(out.n_layers):
            out.W_dec(layer).div_(s_out[layer:, 0, 0][None, :, None])
        out.b_dec.div_(s_out[:, 0])
        if out.W_skip is not None:
            out.W_skip.mul_(s_in / s_out)
        return out


# --------------------------------------------------------------------------- evaluation
@dataclass
class CLTEvaluation(CERecovered):
    """Evaluation of a CLT (per-layer lists indexed by layer; CE and KL in nats per predicted token).

    ``fvu[l]``, ``l0[l]`` and ``dead_frac[l]`` are measured on the original model's activations
    (layer ``l``'s reconstruction from the true MLP inputs of layers ``0 … l``, non-BOS tokens);
    ``ce_spliced`` / ``kl`` with every MLP ``0 … n_layers−1`` replaced by the CLT at once
    (:meth:`~..envoy.clt_set.CLTSet.replace`), ``ce_zero`` with all of them zero-ablated.
    """

    fvu: list[float]
    l0: list[float]
    dead_frac: list[float]
    ce_orig: float
    ce_spliced: float
    ce_zero: float
    kl: float
    n_tokens: int


@torch.no_grad()
def evaluate_clt(clt_set: CLTSet, heldout: TokenDataset, *, batch_size: int = 8,
                 max_batches: int | None = None) -> CLTEvaluation:
    """Evaluate ``clt_set.clt`` on the windows of ``heldout`` (or its first ``max_batches`` batches).

    Three traces per batch: the original model (MLP inputs/outputs of layers ``0 … n_layers−1`` and
    the logits; the per-layer FVU, L0 and dead fraction come from the CLT run on those), the model
    with every MLP replaced by the CLT (``clt_set.replace()``), and with those MLP outputs zeroed.
    A feature is dead if it never fires on the set. Use the folded CLT (:meth:`CLTTrainer.folded`).
    """
    model, adapter, clt = clt_set.model, clt_set.adapter, clt_set.clt
    n = clt.n_layers
    mlps = [adapter.mlp_path(layer) for layer in range(n)]
    accs = [FVUAccumulator() for _ in range(n)]
    l0_sum = torch.zeros(n, dtype=torch.float64)
    fired = torch.zeros(n, clt.cfg.d_sae, dtype=torch.bool)
    sums = {"orig": 0.0, "spliced": 0.0, "zero": 0.0, "kl": 0.0}
    n_tok, n_kept = 0, 0
    n_batches = (len(heldout) + batch_size - 1) // batch_size
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for i in range(n_batches):
        ids = heldout.tokens[i * batch_size:(i + 1) * batch_size]
        lm_head = model.get(adapter.lm_head_path)
        xs: list[Any] = []
        ys: list[Any] = []
        with model.trace(ids, use_cache=False):
            for path in mlps:
                env = model.get(path)
                args, kwargs = env.inputs
                xs.append(nnsight.save(adapter.mlp_input(args, kwargs)))
                ys.append(nnsight.save(adapter.mlp_output(env.output)))
            logits_orig = nnsight.save(lm_head.output)
        with model.trace(ids, use_cache=False):
            clt_set.replace()
            logits_spliced = nnsight.save(lm_head.output)
        with model.trace(ids, use_cache=False):
            for path in mlps:
                env = model.get(path)
                original = env.output
                env.output = adapter.with_mlp_output(original, torch.zeros_like(adapter.mlp_output(original)))
            logits_zero = nnsight.save(lm_head.output)
        n_tok += accumulate_ce(sums, ids, logits_orig, logits_spliced, logits_zero,
                               heldout.targets(i * batch_size, (i + 1) * batch_size))
        keep = loss_mask_for(ids, None)
        dtype = clt.W_enc.dtype
        x = torch.stack([t[keep] for t in xs]).to(dtype)
        y = torch.stack([t[keep] for t in ys]).to(dtype)
        acts = clt.encode(x)
        recon = clt.decode(acts, x)
        for layer in range(n):
            accs[layer].update(y[layer].float(), recon[layer].float())
        active = acts > 0
        l0_sum += active.sum((1, 2)).double()
        n_kept += x.shape[1]
        fired |= active.any(1)
    return CLTEvaluation(
        fvu=[a.value() for a in accs], l0=[float(v) / max(n_kept, 1) for v in l0_sum],
        dead_frac=[float(v) for v in (~fired).float().mean(1)],
        ce_orig=sums["orig"] / n_tok, ce_spliced=sums["spliced"] / n_tok, ce_zero=sums["zero"] / n_tok,
        kl=sums["kl"] / n_tok, n_tokens=n_tok,
    )
