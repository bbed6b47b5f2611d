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

from .._checks import check_flag, check_real, is_int
from .._placement import HOST, host_f32, is_index_dtype, placement, to_module
from .._repr import FieldsRepr
from .._typing import Float
from ..adapters.base import MHSAWeights, mhsa_forward, norm_gain
from ..adapters.registry import get_adapter
from ..attribution.export import decode_token
from ..envoy.nnsight_internals import check_token_ids, hf_module, stored_edits
from ..envoy.read import attention_activations
from ..envoy.replacement_model import check_replacement_model
from ..errors import ArgumentError, NonFiniteError, ShapeError, TraceOrderError
from ..modules.lorsa import head_indices
from ..training.dataset import check_zero_one
from .top_activations import TopActivations


def check_tokens(tokens: Any, model: Any = None) -> None:
    """``tokens`` a non-empty integer ``(n_windows, pos)`` tensor, and (with ``model``) of ids of its input
    embedding's vocabulary (an id outside it was torch's ``IndexError`` from inside the trace).

    Raises:
        ShapeError: not a non-empty integer ``(n_windows, pos)`` tensor. ArgumentError: an id ``< 0`` or ``>=`` the
        vocabulary size.
    """
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 1 \
            or not is_index_dtype(tokens.dtype):
        got = f"{tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ShapeError(f"tokens must be a non-empty integer tensor (n_windows, pos), got {got}")
    check_token_ids(tokens, model, "tokens")


def check_attention_mask(attention_mask: Any, tokens: torch.Tensor) -> torch.Tensor | None:
    """``attention_mask`` (``None`` or ``(n_windows, pos)`` of 0 / 1 or bools, 1 = token) as a host bool tensor.

    A row's tokens must be one run (left or right padding, or none): a row with holes would not be a prompt
    that runs alone the same way. A row of padding only is allowed (it contributes nothing).

    Raises:
        ShapeError: not a tensor of ``tokens``' shape. ArgumentError: a float / complex dtype, values other
        than 0 and 1, or a row whose tokens are not one contiguous run (the message names the rows).
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != tuple(tokens.shape):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ShapeError(f"attention_mask must be a tensor of the tokens' shape {tuple(tokens.shape)} (1 = token, "
                         f"0 = padding), got {got}")
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
        raise ArgumentError(f"attention_mask must hold integers 0 / 1 or bools, got {attention_mask.dtype}")
    m = attention_mask.to(HOST)
    check_zero_one(m, "attention_mask")
    m = m.bool()
    runs = (m[:, 1:] & ~m[:, :-1]).sum(-1) + m[:, 0]  # starts of runs of tokens, per row
    if bool((runs > 1).any()):
        rows = (runs > 1).nonzero().flatten().tolist()
        raise ArgumentError(f"attention_mask rows {rows[:8]} hold padding between tokens: each row's tokens must be "
                            "one run (left or right padding)")
    return m


def kept_tokens(mask: torch.Tensor | None, shape: tuple[int, ...], skip: int) -> torch.Tensor:
    """``(n_windows, pos)`` host bool: the tokens of each row (``mask``; None: every position) from the row's
    ``skip``-th token on (its first ``skip`` tokens — BOS — left out; counted from the first token of a
    left-padded row)."""
    n, pos = shape
    if mask is None:
        keep = torch.ones(n, pos, dtype=torch.bool, device=HOST)
        keep[:, :skip] = False
        return keep
    first = torch.where(mask.any(-1), mask.int().argmax(-1), pos)  # (n,) column of each row's first token
    return mask & (torch.arange(pos, device=HOST)[None] >= first[:, None] + skip)


def model_input(tokens: torch.Tensor, mask: torch.Tensor | None) -> Any:
    """What ``model.trace`` takes for these windows: the ids, or ``{"input_ids", "attention_mask"}`` (nnsight then
    counts the position ids from the mask, as for a left-padded list of prompts)."""
    return tokens if mask is None else {"input_ids": tokens, "attention_mask": mask.long()}


def refuse_in_trace(what: str) -> None:
    """Raise :class:`~..errors.TraceOrderError` inside a ``model.trace`` / ``generate`` body: the analysis
    functions run traces of their own, which nnsight cannot open in a running one (it ended in nnsight's
    ``AttributeError: 'NoneType' object has no attribute 'event'``); they cannot measure the traced pass."""
    from ..envoy.nnsight_internals import current_worker

    try:
        current_worker(what)
    except TraceOrderError:
        return  # not inside a trace body: fine
    raise TraceOrderError(
        f"{what}(replacement, layer, tokens) runs its own traces of the model and cannot be called inside a "
        "model.trace(...) / generate(...) body (it would not measure that trace's edits either): call it before or "
        "after the trace; a persistent change to measure is an edit stored by model.edit() (docs/analysis.md, "
        "'What the analyses measure')")


def refuse_stored_edits(model: Any, what: str, recomputed: str) -> None:
    """Raise :class:`~..errors.ArgumentError` when ``model`` carries edits stored by ``model.edit()``: nnsight
    replays them in the traces an analysis runs, but ``recomputed`` (from weights, on the attention input read
    there) is out of their reach — an edit of the MHSA or of a stored Lorsa splice's internals would be ignored, an
    edit upstream seen: a mix of the edited and the unedited model."""
    if stored_edits(model):
        raise ArgumentError(
            f"{what}: the model carries {stored_edits(model)} edit block(s) stored by model.edit(); nnsight replays "
            f"them in the traces it runs, but {recomputed} are recomputed from their weights, out of the edits' reach: "
            "the result would mix the edited and the unedited model. Call model.clear_edits() first "
            "(collect_top_activations measures the edited model)")


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
        """``(n_ov_heads, n_heads)`` contributions normalised to sum to 1 per Lorsa head.

        NaN rows: a head never active, and a head whose contributions (signed least-squares coefficients, which
        sum to about 1 for a head that explains its tokens) sum to 0 or less, where no normalisation exists (dividing
        gave inf or sign-flipped fractions).

        Source: Lorsa paper (He et al. 2025) App. E.
        """
        total = self.contrib.sum(-1, keepdim=True)
        defined = (self.count[:, None] > 0) & (total > 0)
        return torch.where(defined, self.contrib / total.where(defined, 1.0), torch.nan)

    def heads_spanned(self, threshold: float = 0.9) -> torch.Tensor:
        """``(n_ov_heads,)`` int64 App. E.2 ``n``: the fewest MHSA heads (largest contributions first)
        whose cumulative normalised contribution reaches ``threshold`` (``≥``; App. E.2 says *exceeds*: the two
        differ only where a sum lands exactly on it); 0 for never-active heads; -1 for an active head whose
        contributions sum to 0 or less (its :meth:`fractions` are NaN: ``n`` is undefined, it was reported as
        every head).

        Raises:
            ArgumentError: ``threshold`` not a number in ``(0, 1]`` (NaN counted every head, above 1 every head).

        Source: Lorsa paper (He et al. 2025) App. E.
        """
        check_real("MHSACorrelation.heads_spanned", "threshold", threshold, positive=True, upper=1.0)
        frac = self.fractions().nan_to_num(0.0)
        cum = frac.sort(-1, descending=True).values.cumsum(-1)
        n = (cum < threshold).sum(-1) + 1
        n = n.clamp(max=frac.shape[-1])
        n = torch.where(self.contrib.sum(-1) > 0, n, torch.full_like(n, -1))
        return torch.where(self.count > 0, n, torch.zeros_like(n))


def mhsa_correlation(replacement: Any, layer: int, tokens: torch.Tensor, *, batch_size: int = 8,
                     skip_first: bool = True, attention_mask: torch.Tensor | None = None) -> MHSACorrelation:
    """Oblique-projection correlation of every Lorsa head of ``layer`` to the MHSA heads (App. E.1).

    For each token of ``tokens`` ``(n_windows, pos)`` (BOS skipped with ``skip_first``): the MHSA
    heads' outputs ``o_m`` (``mhsa_forward(per_head=True)``, without ``b_O``) are projected onto the
    active Lorsa heads' outputs ``z_h w_o^h`` (:func:`oblique_coefficients`), and the coefficient
    is added to ``contrib[h, m]``; averaged per Lorsa head over its active tokens.

    ``attention_mask``: optional ``(n_windows, pos)`` (1 = token, 0 = padding; left or right padding): padded
    positions are no keys of the MHSA heads nor of the Lorsa and no tokens of the statistics, ``skip_first``
    skips each row's first token; a prompt's numbers are those of the prompt alone.

    What it measures: the attention input of ``layer`` read from a fresh trace of ``replacement.model`` (the
    model's own: the bundle's other replacements are not spliced); the MHSA heads and the Lorsa are recomputed
    from their weights on it. So a model carrying edits stored by ``model.edit()`` is refused: nnsight replays
    them in the trace, but an edit of the MHSA itself (or of a stored Lorsa splice) would not reach the recomputed
    heads.

    Runs on the Lorsa's device in fp32 (the MHSA weights and activations are moved there and cast; the
    Lorsa sees its input in its own dtype; the least squares in fp64, the sums in fp64); the result is on the CPU.

    Raises:
        ArgumentError: ``replacement`` is not a :class:`~nnsight_lorsa.ReplacementModel` (a set, a bare
            model or a module: wrap it, ``ReplacementModel(model, lorsas=...)``).
        ShapeError: ``tokens`` is not a non-empty integer ``(n, pos)``, ``attention_mask`` not of its shape
        (ArgumentError: ids outside the model's vocabulary).
        LayerOutOfRangeError: no Lorsa at ``layer``. ConfigMismatchError: ``replacement`` has no Lorsas.
        PlacementError: the Lorsa is on ``meta``. ArgumentError: ``batch_size`` not an int ``>= 1``; ``skip_first``
        not a bool; ``attention_mask`` not 0 / 1 or with padding between a row's tokens; the model carries stored edits.
        TraceOrderError: called inside a trace body. NonFiniteError: the MHSA heads' or the active Lorsa
        heads' outputs at a token are NaN / inf (e.g. an fp16 overflow).

    Source: Lorsa paper (He et al. 2025) App. E.
    """
    refuse_in_trace("mhsa_correlation")
    check_replacement_model(replacement, "mhsa_correlation")
    model, lorsa_set = replacement.model, replacement.require("lorsas", "head analysis")
    check_tokens(tokens, model)
    _check_count(batch_size, "batch_size")
    check_flag(skip_first, "skip_first", "mhsa_correlation")
    mask = check_attention_mask(attention_mask, tokens)
    refuse_stored_edits(model, "mhsa_correlation", "the MHSA heads and the Lorsa")
    adapter = get_adapter(model)
    lorsa = lorsa_set[layer]
    device, _ = placement(lorsa, f"the Lorsa of layer {layer}")
    w = _weights_f32(adapter.mhsa_weights(hf_module(model), layer), device)
    n_ov, n_heads = lorsa.cfg.n_ov_heads, w.n_heads
    contrib = torch.zeros(n_ov, n_heads, dtype=torch.float64, device=device)
    count = torch.zeros(n_ov, dtype=torch.long, device=device)
    n_tokens = 0
    w_o = lorsa.W_O.float()
    keep_all = kept_tokens(mask, tuple(tokens.shape), 1 if skip_first else 0)
    for i in range(0, tokens.shape[0], batch_size):
        rows = slice(i, i + batch_size)
        m = None if mask is None else mask[rows]
        act = attention_activations(model, layer, tokens[rows], None if m is None else m.long(), adapter=adapter)
        x = act.x.to(device=device, dtype=torch.float32)
        positions = act.positions.to(device)
        key_mask = None if m is None else m.to(device)
        per_head = mhsa_forward(w, x, positions, per_head=True, key_mask=key_mask)  # (b, s, H, d)
        _, cache = lorsa(to_module(act.x, lorsa, f"the Lorsa of layer {layer}"), positions, key_mask,
                         return_cache=True)
        keep = keep_all[rows].to(device)  # (b, s): the tokens counted
        z, idx = cache.z[keep], cache.topk_indices[keep]  # (N, n_ov), (N, k)
        per_head = per_head[keep]  # (N, H, d)
        zk = z.gather(-1, idx).float()  # (N, k)
        basis = zk[..., None] * w_o[idx]  # (N, k, d)
        active = zk > 0
        if not (bool(per_head.isfinite().all()) and bool(basis.isfinite().all())):
            raise NonFiniteError(f"mhsa_correlation: NaN / inf MHSA head or active Lorsa head outputs at layer {layer} "
                                 f"in windows {i}..{i + x.shape[0] - 1} (an overflow of a half-precision model or "
                                 "Lorsa?)", tensor="z")
        coef = oblique_coefficients(basis, per_head)  # (N, k, H)
        flat_idx = idx[active]
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

    ``logits_h = W_U (g ⊙ P w_o^h)`` with ``g`` the final norm's gain and ``P`` its centring: ``w − mean(w)`` for a
    LayerNorm (GPT-2, GPT-NeoX / Pythia: it subtracts the mean over ``d_model`` of everything in the residual, the
    head's share included), the identity for an RMSNorm — the head's direct effect on the logits with the norm's
    scale frozen, as the model's own forward (and the attribution graph's frozen norms) computes it; the scale
    ``1/σ`` is common to all heads and left out, and so are a LayerNorm's bias and ``b_U`` (not the head's). For
    Gemma-2/3 the product of the ``1 + weight`` gains of ``post_attention_layernorm`` (which the head's output goes
    through before the residual) and of the final norm (:func:`~nnsight_lorsa.adapters.base.norm_gain`), each norm
    applied in that order. Before 2026-11-30 a LayerNorm's centring was left out: on random GPT-2s the rows were
    13-24% (of their largest entry) off Llamascopium's ``DirectLogitAttributor`` (which centres: TransformerLens's
    ``ln_final``) and 10-13% of the top-10 tokens differed (docs/analysis.md).

    Computed in fp32 on the unembedding's device (the Lorsa's ``w_o`` rows are moved there);
    returned on the CPU.

    Returns:
        ``(values (n, k), token_ids (n, k), token strings or None)`` for the ``n`` heads (all by default); a token
        holding part of a UTF-8 character is written by its bytes, ``<0xNN>`` (``decode_token(...,
        partial_bytes=True)``; it decoded as ``"\ufffd"``, the same for every such token).

    Raises:
        ArgumentError: ``replacement`` is not a :class:`~nnsight_lorsa.ReplacementModel` (a set, a bare
            model or a module: wrap it, ``ReplacementModel(model, lorsas=...)``).
        ShapeError: the unembedding does not match ``d_model``.
        LayerOutOfRangeError: no Lorsa at ``layer``. ConfigMismatchError: ``replacement`` has no Lorsas.
        PlacementError: the unembedding or the Lorsa is on ``meta``.
        ArgumentError: ``heads`` not head indices in ``[0, n_ov_heads)`` (:func:`~nnsight_lorsa.modules.lorsa.
        head_indices`; ShapeError out of range), ``k`` not an int in ``[1, vocab]``.

    Source: Lorsa paper (He et al. 2025) §5.1, Fig. 4 ("Logits via OV").
    """
    check_replacement_model(replacement, "ov_logit_lens")
    model, lorsa = replacement.model, replacement.require("lorsas", "head analysis")[layer]
    adapter = get_adapter(model)
    w_u = _module(model, adapter.lm_head_path).weight  # (vocab, d)
    device, _ = placement(w_u, f"the unembedding {adapter.lm_head_path}")
    placement(lorsa, f"the Lorsa of layer {layer}")
    post = adapter.attention_post_norm_path(layer)
    norms = [_module(model, path) for path in (post, adapter.final_norm_path) if path is not None]
    idx = (torch.arange(lorsa.cfg.n_ov_heads, device=lorsa.W_O.device) if heads is None
           else head_indices(heads, lorsa.cfg.n_ov_heads, "heads", lorsa.W_O.device))
    _check_count(k, "k")
    if k > w_u.shape[0]:
        raise ArgumentError(f"k={k} exceeds the vocabulary size {w_u.shape[0]}")
    w_o = lorsa.W_O[idx].to(device=device, dtype=torch.float32)
    if w_u.shape[1] != w_o.shape[1]:
        raise ShapeError(f"unembedding is {tuple(w_u.shape)}, Lorsa d_model {w_o.shape[1]}")
    for norm in norms:  # the head's output through each norm with its scale frozen: centring (LayerNorm), gain
        if isinstance(norm, torch.nn.LayerNorm):
            w_o = w_o - w_o.mean(-1, keepdim=True)
        gain = norm_gain(norm)
        if gain is not None:
            w_o = w_o * gain.to(device=device, dtype=torch.float32)
    logits = w_o @ w_u.float().T
    vals, ids = (t.to(HOST) for t in logits.topk(k, dim=-1))
    tok = tokenizer if tokenizer is not None else getattr(model, "tokenizer", None)
    strings = [[decode_token(tok, int(t), partial_bytes=True) for t in row] for row in ids] if tok is not None else None
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
                            batch_size: int = 8, skip_start: int = 1, distinct_windows: bool = True,
                            attention_mask: torch.Tensor | None = None) -> TopActivations:
    """Stream ``tokens`` ``(n_windows, pos)`` through the model with the Lorsa of ``layer`` spliced
    (error term on, so later layers see the true model) and keep every head's top ``n_top``
    activations and its activation frequency. Memory ``O(n_ov_heads · n_top)``.

    What it measures: the Lorsa's ``z`` on the attention input of ``layer`` in a fresh trace of
    ``replacement.model`` — the model's own (the bundle's other replacements are not spliced), with the edits
    stored on it by ``model.edit()`` (nnsight replays them in the trace: an edit upstream of the layer is
    measured, and so is an edit of ``hook_z`` in a stored splice of this Lorsa; a stored splice of the layer by
    another module or error flag is an ``ArgumentError`` of ``replace``). It runs traces of its own, so not
    inside a trace body (``TraceOrderError``).

    Args:
        skip_start: the first this many positions of every window are left out of the top activations
            and the frequency (default 1: position 0, BOS). A window cut from running text still looks
            like a document start to the model, and some heads reach their largest activations at its
            first positions (start-of-document artefacts: on the shipped Lorsa of the embedded model, one
            of the 5 top heads had its top 3 contexts all at position 1); ``skip_start=4`` leaves those
            positions out (the demo does), ``0`` keeps BOS.
        distinct_windows: at most one entry per head and window (its largest activation there;
            :class:`~.top_activations.TopActivations`), so a dashboard's contexts are distinct texts.
        attention_mask: optional ``(n_windows, pos)`` (1 = token, 0 = padding; left or right padding): padded
            positions are no keys of the Lorsa and no entries, counts or ``n_tokens``; ``skip_start`` counts from
            each row's first token. Positions are columns of ``tokens`` (``tokens[window, position]`` is the
            token); otherwise a prompt's entries are those of the prompt alone. A row of padding only adds nothing.

    ``n_top`` larger than the tokens seen leaves empty slots (value ``-inf``, window and position ``-1``); a head
    that never fires keeps its largest (zero) activations with where they were, ``count`` 0.

    Raises:
        ArgumentError: ``replacement`` is not a :class:`~nnsight_lorsa.ReplacementModel` (a set, a bare
            model or a module: wrap it, ``ReplacementModel(model, lorsas=...)``).
        ShapeError: ``tokens`` not a non-empty integer ``(n_windows, pos)``, ``attention_mask`` not of its shape
        (ArgumentError: ids outside the model's vocabulary).
        LayerOutOfRangeError: no Lorsa at ``layer``. ArgumentError: ``n_top`` or ``batch_size`` not an int
        ``>= 1``; ``skip_start`` not an int in ``[0, pos)``; ``distinct_windows`` not a bool; ``attention_mask`` not
        0 / 1 or with padding between a row's tokens; NaN / inf activations at a token
        (:meth:`TopActivations.update`). TraceOrderError: called inside a trace body.

    Source: Lorsa paper (He et al. 2025) §5.1 (top activations of a head).
    """
    refuse_in_trace("collect_top_activations")
    check_replacement_model(replacement, "collect_top_activations")
    model, lorsa_set = replacement.model, replacement.require("lorsas", "head analysis")
    check_tokens(tokens, model)
    _check_count(n_top, "n_top")
    _check_count(batch_size, "batch_size")
    check_flag(distinct_windows, "distinct_windows", "collect_top_activations")
    if not isinstance(skip_start, int) or isinstance(skip_start, bool) or not 0 <= skip_start < tokens.shape[-1]:
        raise ArgumentError(f"skip_start must be an int in [0, {tokens.shape[-1]}) (the window length), "
                            f"got {skip_start!r}")
    n_ov = lorsa_set[layer].cfg.n_ov_heads
    top = TopActivations.empty(n_ov, n_top, distinct_windows=distinct_windows)
    mask = check_attention_mask(attention_mask, tokens)
    keep = kept_tokens(mask, tuple(tokens.shape), skip_start)  # host-side, like the table it feeds
    for i in range(0, tokens.shape[0], batch_size):
        rows = slice(i, i + batch_size)
        with model.trace(model_input(tokens[rows], None if mask is None else mask[rows]), use_cache=False) as tracer:
            z = nnsight.save(lorsa_set.replace(layer=layer, error=True).hook_z.output)
            if not stored_edits(model):  # nothing after the Lorsa is needed (but by an edit stored by model.edit())
                tracer.stop()
        top.update(z, i, keep[rows])
    return top
