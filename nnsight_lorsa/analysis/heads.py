"""Lorsa head analysis: correlation to MHSA heads, OV logit lens, SAE-feature cosines, frequency.

* :func:`oblique_coefficients` / :func:`mhsa_correlation` — Lorsa paper App. E.1: project each
  MHSA head's output obliquely onto the (non-orthogonal) basis of the active Lorsa heads' outputs
  at the same token; the coefficient of Lorsa head ``h`` is MHSA head ``m``'s contribution to it.
* :meth:`MHSACorrelation.heads_spanned` — App. E.2 / Fig. 13: the fewest MHSA heads whose
  cumulative contribution to a Lorsa head exceeds 90%.
* :func:`ov_logit_lens` — §5.1 / Fig. 4 "Logits via OV": ``W_U · norm_gain ⊙ w_o^h``.
* :func:`ov_feature_cosines` — App. F.2: cosine of ``w_v^h`` with the decoder rows of an SAE on the
  Lorsa input, and of ``w_o^h`` with the encoder rows of an SAE on its output.
* :func:`collect_top_activations` — top activations and activation frequency over a corpus.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import nnsight
import torch

from .._checks import is_int
from .._placement import HOST, host_f32, placement, to_module
from .._repr import FieldsRepr
from .._typing import Float
from ..adapters.base import MHSAWeights, mhsa_forward, norm_gain
from ..adapters.registry import get_adapter
from ..envoy.nnsight_internals import hf_module
from ..envoy.read import attention_activations
from ..errors import ArgumentError, ShapeError
from ..modules.lorsa import head_indices
from .top_activations import TopActivations


def _check_tokens(tokens: Any) -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 1 \
            or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        got = f"{tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ShapeError(f"tokens must be a non-empty integer tensor (n_windows, pos), got {got}")


def _check_count(value: Any, name: str, low: int = 1) -> None:
    if not is_int(value) or value < low:
        raise ArgumentError(f"{name} must be an int >= {low}, got {value!r}")


def oblique_coefficients(
    basis: Float[torch.Tensor, "n k d"], targets: Float[torch.Tensor, "n m d"]
) -> Float[torch.Tensor, "n k m"]:
    """Least-squares coefficients ``c`` with ``targets[n, j] ≈ Σ_i c[n, i, j] basis[n, i]`` (App. E.1).

    The oblique projection of each target vector onto the span of the ``k`` (generally
    non-orthogonal) basis vectors of the same row ``n``; zero or dependent basis vectors get the
    minimum-norm solution (``gelsd``). Solved in float64 on the CPU (CUDA's ``lstsq`` has only
    ``gels``, which assumes full rank: inactive heads among the top-k are zero basis vectors); the
    coefficients are returned in fp32 on ``basis``'s device.
    """
    a = basis.transpose(1, 2).to(device=HOST, dtype=torch.float64)  # (n, d, k)
    b = targets.transpose(1, 2).to(device=HOST, dtype=torch.float64)  # (n, d, m)
    return torch.linalg.lstsq(a, b, driver="gelsd").solution.to(device=basis.device, dtype=torch.float32)


@dataclass(repr=False)
class MHSACorrelation(FieldsRepr):
    """App. E.1 attribution of Lorsa heads to MHSA heads, averaged over the tokens each head is active on.

    Attributes:
        contrib: ``(n_ov_heads, n_heads)`` mean oblique coefficient of MHSA head ``m``'s output on
            Lorsa head ``h``'s output (over the tokens where ``h`` is active); rows of heads
            that explain their token's attention output sum to about 1.
        count: ``(n_ov_heads,)`` int64 tokens each Lorsa head was active on.
        n_tokens: tokens seen.

    Source: Lorsa paper (He et al. 2025) App. E.
    """

    contrib: torch.Tensor
    count: torch.Tensor
    n_tokens: int

    def fractions(self) -> torch.Tensor:
        """``(n_ov_heads, n_heads)`` contributions normalised to sum to 1 per Lorsa head (NaN if never active).

        Source: Lorsa paper (He et al. 2025) App. E.
        """
        total = self.contrib.sum(-1, keepdim=True)
        return torch.where(self.count[:, None] > 0, self.contrib / total, torch.nan)

    def heads_spanned(self, threshold: float = 0.9) -> torch.Tensor:
        """``(n_ov_heads,)`` int64 App. E.2 ``n``: the fewest MHSA heads (largest contributions first)
        whose cumulative normalised contribution reaches ``threshold`` (``≥``; App. E.2 says *exceeds*: the two
        differ only where a sum lands exactly on it); 0 for never-active heads.

        Source: Lorsa paper (He et al. 2025) App. E.
        """
        frac = self.fractions().nan_to_num(0.0)
        cum = frac.sort(-1, descending=True).values.cumsum(-1)
        n = (cum < threshold).sum(-1) + 1
        n = n.clamp(max=frac.shape[-1])
        return torch.where(self.count > 0, n, torch.zeros_like(n))


def mhsa_correlation(replacement: Any, layer: int, tokens: torch.Tensor, *, batch_size: int = 8,
                     skip_first: bool = True) -> MHSACorrelation:
    """Oblique-projection correlation of every Lorsa head of ``layer`` to the MHSA heads (App. E.1).

    For each token of ``tokens`` ``(n_windows, pos)`` (BOS skipped with ``skip_first``): the MHSA
    heads' outputs ``o_m`` (``mhsa_forward(per_head=True)``, without ``b_O``) are projected onto the
    active Lorsa heads' outputs ``z_h w_o^h`` (:func:`oblique_coefficients`), and the coefficient
    is added to ``contrib[h, m]``; averaged per Lorsa head over its active tokens.

    Runs on the Lorsa's device in fp32 (the MHSA weights and activations are moved there and cast; the
    Lorsa sees its input in its own dtype); the result is on the CPU.

    Raises:
        ShapeError: ``tokens`` is not a non-empty integer ``(n, pos)``. LayerOutOfRangeError: no Lorsa at
        ``layer``. ConfigMismatchError: ``replacement`` has no Lorsas. PlacementError: the Lorsa is on ``meta``.
        ArgumentError: ``batch_size`` not an int ``>= 1``.

    Source: Lorsa paper (He et al. 2025) App. E.
    """
    model, lorsa_set = replacement.model, replacement.require("lorsas", "head analysis")
    _check_tokens(tokens)
    _check_count(batch_size, "batch_size")
    adapter = get_adapter(model)
    lorsa = lorsa_set[layer]
    device, _ = placement(lorsa, f"the Lorsa of layer {layer}")
    w = _weights_f32(adapter.mhsa_weights(hf_module(model), layer), device)
    n_ov, n_heads = lorsa.cfg.n_ov_heads, w.n_heads
    contrib = torch.zeros(n_ov, n_heads, dtype=torch.float64, device=device)
    count = torch.zeros(n_ov, dtype=torch.long, device=device)
    n_tokens = 0
    w_o = lorsa.W_O.float()
    for i in range(0, tokens.shape[0], batch_size):
        act = attention_activations(model, layer, tokens[i:i + batch_size], adapter=adapter)
        x = act.x.to(device=device, dtype=torch.float32)
        positions = act.positions.to(device)
        per_head = mhsa_forward(w, x, positions, per_head=True)  # (b, s, H, d)
        _, cache = lorsa(to_module(act.x, lorsa, f"the Lorsa of layer {layer}"), positions, return_cache=True)
        if skip_first:
            per_head, z, idx = per_head[:, 1:], cache.z[:, 1:], cache.topk_indices[:, 1:]
        else:
            z, idx = cache.z, cache.topk_indices
        zk = z.gather(-1, idx).float()  # (b, s, k)
        basis = zk[..., None] * w_o[idx]  # (b, s, k, d)
        k, d = idx.shape[-1], x.shape[-1]
        coef = oblique_coefficients(basis.reshape(-1, k, d), per_head.reshape(-1, n_heads, d))  # (N, k, H)
        active = (zk > 0).reshape(-1, k)
        flat_idx = idx.reshape(-1, k)[active]
        contrib.index_add_(0, flat_idx, coef[active].double())
        count += torch.bincount(flat_idx, minlength=n_ov)
        n_tokens += int(active.shape[0])
    mean = contrib / count.clamp_min(1)[:, None]
    return MHSACorrelation(host_f32(mean), count.to(HOST), n_tokens)


def _weights_f32(w: MHSAWeights, device: torch.device) -> MHSAWeights:
    """``w`` with every tensor on ``device`` in fp32 (the analysis runs there)."""
    def f(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=torch.float32)

    return dataclasses.replace(w, W_Q=f(w.W_Q), b_Q=f(w.b_Q), W_K=f(w.W_K), b_K=f(w.b_K), W_V=f(w.W_V),
                               b_V=f(w.b_V), W_O=f(w.W_O), b_O=f(w.b_O),
                               q_norm=None if w.q_norm is None else f(w.q_norm),
                               k_norm=None if w.k_norm is None else f(w.k_norm))


def _module(model: Any, path: str) -> Any:
    root = hf_module(model)
    return root.get_submodule(path)


@torch.no_grad()
def ov_logit_lens(replacement: Any, layer: int, heads: Any = None, k: int = 10,
                  tokenizer: Any = None) -> tuple[torch.Tensor, torch.Tensor, list[list[str]] | None]:
    """Tokens each Lorsa head promotes through its OV circuit (Lorsa paper Fig. 4, "Logits via OV").

    ``logits_h = W_U (g ⊙ w_o^h)`` with ``g`` the final norm's gain (the normalisation itself only
    rescales a single direction; a LayerNorm's bias is not part of the head's direction) — for Gemma-2/3 the
    product of the ``1 + weight`` gains of ``post_attention_layernorm`` (which the head's output goes through
    before the residual) and of the final norm (:func:`~nnsight_lorsa.adapters.base.norm_gain`).

    Computed in fp32 on the unembedding's device (the Lorsa's ``w_o`` rows are moved there);
    returned on the CPU.

    Returns:
        ``(values (n, k), token_ids (n, k), token strings or None)`` for the ``n`` heads (all by default).

    Raises:
        ShapeError: the unembedding does not match ``d_model``.
        LayerOutOfRangeError: no Lorsa at ``layer``. ConfigMismatchError: ``replacement`` has no Lorsas.
        PlacementError: the unembedding or the Lorsa is on ``meta``.
        ArgumentError: ``heads`` not head indices in ``[0, n_ov_heads)`` (:func:`~nnsight_lorsa.modules.lorsa.
        head_indices`; ShapeError out of range), ``k`` not an int in ``[1, vocab]``.

    Source: Lorsa paper (He et al. 2025) §5.1, Fig. 4 ("Logits via OV").
    """
    model, lorsa = replacement.model, replacement.require("lorsas", "head analysis")[layer]
    adapter = get_adapter(model)
    w_u = _module(model, adapter.lm_head_path).weight  # (vocab, d)
    device, _ = placement(w_u, f"the unembedding {adapter.lm_head_path}")
    placement(lorsa, f"the Lorsa of layer {layer}")
    post = adapter.attention_post_norm_path(layer)
    gains = [norm_gain(_module(model, path)) for path in (post, adapter.final_norm_path) if path is not None]
    idx = (torch.arange(lorsa.cfg.n_ov_heads, device=lorsa.W_O.device) if heads is None
           else head_indices(heads, lorsa.cfg.n_ov_heads, "heads", lorsa.W_O.device))
    _check_count(k, "k")
    if k > w_u.shape[0]:
        raise ArgumentError(f"k={k} exceeds the vocabulary size {w_u.shape[0]}")
    w_o = lorsa.W_O[idx].to(device=device, dtype=torch.float32)
    if w_u.shape[1] != w_o.shape[1]:
        raise ShapeError(f"unembedding is {tuple(w_u.shape)}, Lorsa d_model {w_o.shape[1]}")
    for gain in gains:
        if gain is not None:
            w_o = w_o * gain.to(device=device, dtype=torch.float32)
    logits = w_o @ w_u.float().T
    vals, ids = (t.to(HOST) for t in logits.topk(k, dim=-1))
    tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    strings = [[tok.decode([int(t)]) for t in row] for row in ids] if tok is not None else None
    return vals, ids, strings


def ov_feature_cosines(lorsa: Any, head: int, sae_in_decoder: torch.Tensor | None = None,
                       sae_out_encoder: torch.Tensor | None = None, k: int = 5) -> dict[str, Any]:
    """App. F.2: the SAE features most aligned with head ``head``'s ``w_v`` and ``w_o``.

    Args:
        sae_in_decoder: ``(n_features, d_model)`` decoder rows of an SAE on the Lorsa *input*
            (cosine with ``w_v^h``: the features the head reads).
        sae_out_encoder: ``(n_features, d_model)`` encoder rows of an SAE on the Lorsa *output*
            (cosine with ``w_o^h``: the features the head writes).

    Returns:
        ``{"v": (values, indices), "o": (values, indices)}`` with the top-``k`` cosines present (fp32,
        on the CPU; computed on the SAE matrix's device, the Lorsa's vector moved there).

    Raises:
        ShapeError: ``head`` outside ``[0, n_ov_heads)`` (no negative indexing), SAE rows not
            ``(n_features, d_model)``.
        ArgumentError: ``head`` not an int, ``k`` not an int ``>= 1``.
        PlacementError: the Lorsa or an SAE matrix is on ``meta`` (never loaded).

    Source: Lorsa paper (He et al. 2025) App. F.
    """
    placement(lorsa, "the Lorsa")
    if not is_int(head):
        raise ArgumentError(f"head must be an int, got {head!r}")
    head = int(head_indices(head, lorsa.cfg.n_ov_heads, "head", "cpu")[0])
    _check_count(k, "k")
    out: dict[str, Any] = {}
    for name, vec, mat in (("v", lorsa.W_V[head], sae_in_decoder), ("o", lorsa.W_O[head], sae_out_encoder)):
        if mat is None:
            continue
        if not isinstance(mat, torch.Tensor) or mat.dim() != 2 or mat.shape[-1] != vec.shape[0]:
            got = tuple(mat.shape) if isinstance(mat, torch.Tensor) else type(mat).__name__
            raise ShapeError(f"SAE rows must be (n_features, d_model={vec.shape[0]}), got {got}")
        device, _ = placement(mat, f"the SAE rows for {name!r}")
        cos = torch.nn.functional.cosine_similarity(mat.float(), vec.to(device=device, dtype=torch.float32)[None],
                                                    dim=-1)
        v, i = cos.topk(min(k, cos.numel()))
        out[name] = (v.to(HOST), i.to(HOST))
    return out


@torch.no_grad()
def collect_top_activations(replacement: Any, layer: int, tokens: torch.Tensor, *, n_top: int = 8,
                            batch_size: int = 8, skip_start: int = 1, distinct_windows: bool = True
                            ) -> TopActivations:
    """Stream ``tokens`` ``(n_windows, pos)`` through the model with the Lorsa of ``layer`` spliced
    (error term on, so later layers see the true model) and keep every head's top ``n_top``
    activations and its activation frequency. Memory ``O(n_ov_heads · n_top)``.

    Args:
        skip_start: the first this many positions of every window are left out of the top activations
            and the frequency (default 1: position 0, BOS). A window cut from running text still looks
            like a document start to the model, and some heads reach their largest activations at its
            first positions (start-of-document artefacts: on the shipped Lorsa of the embedded model, one
            of the 5 top heads had its top 3 contexts all at position 1); ``skip_start=4`` leaves those
            positions out (the demo does), ``0`` keeps BOS.
        distinct_windows: at most one entry per head and window (its largest activation there;
            :class:`~.top_activations.TopActivations`), so a dashboard's contexts are distinct texts.

    Raises:
        ShapeError: ``tokens`` not a non-empty integer ``(n_windows, pos)``. LayerOutOfRangeError: no Lorsa
        at ``layer``. ArgumentError: ``n_top`` or ``batch_size`` not an int ``>= 1``; ``skip_start`` not an
        int in ``[0, pos)``.

    Source: Lorsa paper (He et al. 2025) §5.1 (top activations of a head).
    """
    model, lorsa_set = replacement.model, replacement.require("lorsas", "head analysis")
    _check_tokens(tokens)
    _check_count(n_top, "n_top")
    _check_count(batch_size, "batch_size")
    if not isinstance(skip_start, int) or isinstance(skip_start, bool) or not 0 <= skip_start < tokens.shape[-1]:
        raise ArgumentError(f"skip_start must be an int in [0, {tokens.shape[-1]}) (the window length), "
                            f"got {skip_start!r}")
    n_ov = lorsa_set[layer].cfg.n_ov_heads
    top = TopActivations.empty(n_ov, n_top, distinct_windows=distinct_windows)
    keep = torch.ones(tokens.shape, dtype=torch.bool, device=HOST)  # host-side, like the table it feeds
    keep[:, :skip_start] = False
    for i in range(0, tokens.shape[0], batch_size):
        with model.trace(tokens[i:i + batch_size], use_cache=False) as tracer:
            z = nnsight.save(lorsa_set.replace(layer=layer, error=True).hook_z.output)
            tracer.stop()  # nothing after the Lorsa is needed
        top.update(z, i, keep[i:i + batch_size])
    return top
