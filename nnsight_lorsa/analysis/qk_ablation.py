"""Impact of SAE features on a Lorsa head's Q and K by ablation (Lorsa paper App. F.1).

For an OV head ``h`` of the Lorsa of ``layer`` (QK head ``g = h // G``) and an SAE on the Lorsa's
input with decoder rows ``d_f`` and activations ``a_f``, at every *activation location* of the
head (window ``b``, query position ``i`` with ``z^h_i > 0`` after top-k):

* **Q impact of f**: the query is recomputed from ``x_i − a_f(x_i) d_f`` (keys untouched), and
  the head's pattern row ``A^g_i`` is compared with the ablated one, ``KL(A_i ‖ A'_i)``.
  Only features active at the query position can change it.
* **K impact of f**: every key ``j ≤ i`` is recomputed from ``x_j − a_f(x_j) d_f`` (the query
  untouched). Only features active at some key position ``j ≤ i`` can change the row.

The impact of ``f`` is the **maximum** KL over all activation locations of the head in the corpus
(with where it occurred). The query/key projections are affine, so the ablation is
``q_raw − a_f (d_f W_Q^g)`` before QK-norm and RoPE, which are then applied exactly as the Lorsa
module applies them; everything is vectorised over (location, feature) pairs, one window at a time.

:func:`qk_feature_impacts` streams ``(n_windows, pos)`` token windows through nnsight batch by
batch (the attention input collected by :func:`~nnsight_lorsa.envoy.read.attention_activations`,
which stops the model after the attention); memory is bounded by ``batch_size`` and ``chunk``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .._checks import check_flag, check_int, is_int
from .._placement import placement, to_module
from .._repr import FieldsRepr
from .._typing import Float, Int
from ..envoy.replacement_model import check_replacement_model
from ..errors import ArgumentError, ConfigMismatchError, ShapeError
from ..modules.lorsa import head_indices
from ..modules.rotary import apply_rotary, rotary_cos_sin

__all__ = ["QKFeatureImpacts", "qk_feature_impacts"]


@dataclass(repr=False)
class QKFeatureImpacts(FieldsRepr):
    """Per-feature maximum KL of a Lorsa head's attention pattern under ablation (App. F.1).

    Attributes:
        layer, head: the Lorsa layer and OV head; ``qk_head`` its QK head.
        q_kl: ``(n_features,)`` max over the head's activations of ``KL(A_i ‖ A'_i)`` with the
            feature removed from the query's input (0 where never present at an activation).
        q_window, q_position: ``(n_features,)`` int64 window and query position of that maximum
            (``-1`` where the feature was never present at a query position of an activation).
        q_count: ``(n_features,)`` int64 activations at whose query position the feature was active.
        k_kl, k_window, k_position, k_count: the same with the feature removed from every key
            (present = active at some key position ``j ≤ i``); the position is the query's.
        n_activations: activation locations of the head evaluated. n_tokens: tokens seen.

    Source: Lorsa paper (He et al. 2025) App. F (interaction between Lorsa heads and SAE features).
    """

    layer: int
    head: int
    qk_head: int
    q_kl: torch.Tensor
    q_window: torch.Tensor
    q_position: torch.Tensor
    q_count: torch.Tensor
    k_kl: torch.Tensor
    k_window: torch.Tensor
    k_position: torch.Tensor
    k_count: torch.Tensor
    n_activations: int = 0
    n_tokens: int = 0

    @classmethod
    def empty(cls, layer: int, head: int, qk_head: int, n_features: int) -> QKFeatureImpacts:
        # host-side tables: update() brings each evaluated batch to the CPU
        """Zeroed impact tables for ``n_features`` features of head ``head`` (QK head ``qk_head``) of ``layer``: fp32
        on the CPU.

        Source: Lorsa paper (He et al. 2025) App. F (interaction between Lorsa heads and SAE features).
        """
        def z() -> torch.Tensor:
            return torch.zeros(n_features, dtype=torch.float32, device="cpu")

        def minus() -> torch.Tensor:
            return torch.full((n_features,), -1, dtype=torch.long, device="cpu")

        def count() -> torch.Tensor:
            return torch.zeros(n_features, dtype=torch.long, device="cpu")

        return cls(layer, head, qk_head, z(), minus(), minus(), count(), z(), minus(), minus(), count())

    def _top(self, side: str, n: int) -> list[tuple[int, float, int, int]]:
        check_int(f"QKFeatureImpacts.top_{'query' if side == 'q' else 'key'}_features", "n", n, least=0)
        kl, win, pos, cnt = (getattr(self, f"{side}_{a}") for a in ("kl", "window", "position", "count"))
        score = kl.masked_fill(cnt <= 0, float("-inf"))
        vals, idx = score.topk(min(n, int((cnt > 0).sum())))
        return [(int(f), float(v), int(win[f]), int(pos[f])) for v, f in zip(vals, idx, strict=True)]

    def top_query_features(self, n: int = 10) -> list[tuple[int, float, int, int]]:
        """The ``n`` features with the largest impact on Q: ``[(feature, max KL, window, position), …]``.

        Raises:
            ArgumentError: ``n`` not an int ``>= 0``.

        Source: Lorsa paper (He et al. 2025) App. F (interaction between Lorsa heads and SAE features).
        """
        return self._top("q", n)

    def top_key_features(self, n: int = 10) -> list[tuple[int, float, int, int]]:
        """The ``n`` features with the largest impact on K: ``[(feature, max KL, window, query position), …]``.

        Raises:
            ArgumentError: ``n`` not an int ``>= 0``.

        Source: Lorsa paper (He et al. 2025) App. F (interaction between Lorsa heads and SAE features).
        """
        return self._top("k", n)

    @torch.no_grad()
    def update(self, side: str, kl: Float[torch.Tensor, " m"], feature: Int[torch.Tensor, " m"],
               window: Int[torch.Tensor, " m"], position: Int[torch.Tensor, " m"]) -> None:
        """Merge ``m`` evaluated (activation, feature) pairs of ``side`` (``"q"`` or ``"k"``).

        Source: Lorsa paper (He et al. 2025) App. F (interaction between Lorsa heads and SAE features).
        """
        if kl.numel() == 0:
            return
        kl, feature, window, position = (t.detach().cpu() for t in (kl, feature, window, position))
        best, best_w, best_p, cnt = (getattr(self, f"{side}_{a}") for a in ("kl", "window", "position", "count"))
        cnt += torch.bincount(feature, minlength=cnt.numel())
        # per feature, the pair with the largest KL (the first one among ties, deterministically)
        order = kl.argsort(descending=True, stable=True)
        order = order[feature[order].argsort(stable=True)]
        f = feature[order]
        first = torch.ones_like(f, dtype=torch.bool)
        first[1:] = f[1:] != f[:-1]
        pick = order[first]
        f, v = feature[pick], kl[pick].float()
        better = (v > best[f]) | (best_w[f] < 0)
        f, pick = f[better], pick[better]
        best[f] = kl[pick].float()
        best_w[f] = window[pick]
        best_p[f] = position[pick]


def _project(lorsa: Any, g: int, raw: torch.Tensor, positions: torch.Tensor, side: str) -> torch.Tensor:
    """QK-norm and RoPE of QK head ``g`` applied to ``raw = x W^g + b^g`` rows ``(n, d_qk)`` at ``positions (n,)``,
    with the arithmetic of :meth:`Lorsa.qk` (and :class:`PerHeadRMSNorm` for head ``g``)."""
    cfg = lorsa.cfg
    out = raw
    if cfg.qk_norm:
        ln = lorsa.ln_q if side == "q" else lorsa.ln_k
        dtype = out.dtype
        v = out.to(torch.promote_types(dtype, torch.float32))
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + ln.eps)
        out = ln.w[g] * v.to(dtype)
    if cfg.rotary is not None:
        cos, sin = rotary_cos_sin(cfg.rotary, positions, dtype=torch.promote_types(out.dtype, torch.float32))
        out = apply_rotary(out[None, None], cos, sin, cfg.rotary.interleaved)[0, 0]
    return out


def _kl_rows(logp: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``KL(p ‖ softmax(scores))`` over the last dim, restricted to ``valid`` keys; ``logp`` the reference
    log-pattern (``-inf`` off ``valid``), float64. The softmax runs in float64 so that rounding does not add a
    first-order term to the KL (float32 gives ~1e-7 for identical patterns); clamped at 0."""
    logq = scores.double().masked_fill(~valid, float("-inf")).log_softmax(-1)
    term = torch.where(valid, logp.exp() * (logp - logq), torch.zeros((), dtype=logp.dtype, device=logp.device))
    return term.sum(-1).clamp_min(0.0)


def _input_gain(sae: Any, x: torch.Tensor) -> torch.Tensor | None:
    """``(*batch, 1)`` fp32: the factor ``s(x)`` by which a feature's decoder row ``a_f d_f`` enters the SAE's
    reconstruction of ``x`` in ``x``'s own scale — ``denormalize(x, out)`` is ``out · s(x) + c(x)`` for every
    normalisation of :class:`~nnsight_lorsa.modules.sae.SparseAutoencoder` (``‖x‖ / √d_in`` for
    ``constant_norm_rescale``, the standard deviation for ``layer_norm``, 1 for none) — or None for a coder without
    ``denormalize`` (its decoder rows taken in the input's scale).

    Source: SAELens ``sae_lens/saes/sae.py`` (``run_time_activation_norm_fn_out``); Lorsa paper App. F.1 (the
    feature's contribution removed from the input).
    """
    denormalize = getattr(sae, "denormalize", None)
    if denormalize is None:
        return None
    xf = x.float()
    return (denormalize(xf, torch.ones_like(xf)) - denormalize(xf, torch.zeros_like(xf)))[..., :1]


def _check(lorsa_set: Any, layer: int, head: int, sae: Any, tokens: torch.Tensor, features: Any,
           batch_size: int) -> tuple[Any, torch.Tensor | None]:
    from ..envoy.sae_set import SAESet
    from ..modules.replacement_module import ReplacementModule

    lorsa = lorsa_set[layer]  # LayerOutOfRangeError: no Lorsa at this layer
    n_ov, d_model = lorsa.cfg.n_ov_heads, lorsa.cfg.d_model
    if not is_int(head) or not 0 <= int(head) < n_ov:  # numpy / 0-d tensor integers too (a researcher's argmax)
        raise ShapeError(f"head {head!r} out of range [0, {n_ov}) of the Lorsa of layer {layer}")
    if isinstance(sae, ReplacementModule) and not SAESet.holds(sae):
        # a transcoder's decoder rows are MLP-output directions, not directions of the input it reads
        raise ConfigMismatchError(
            f"qk_feature_impacts ablates SAE features of the Lorsa's input; got a {type(sae).__name__}, whose "
            "decoder rows are not directions of its input (a SparseAutoencoder on the attention input is needed)")
    w_dec = getattr(sae, "W_dec", None)
    d_in = getattr(getattr(sae, "cfg", None), "d_in", None)
    if w_dec is None or w_dec.dim() != 2 or w_dec.shape[1] != d_model or d_in != d_model:
        shape = None if w_dec is None else tuple(w_dec.shape)
        raise ConfigMismatchError(
            f"the SAE must read and write the Lorsa input of width d_model={d_model}; it has d_in={d_in}, "
            f"W_dec {shape}"
        )
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ArgumentError(f"batch_size must be an int >= 1, got {batch_size!r}")
    keep = None
    if features is not None:
        n = w_dec.shape[0]
        idx = head_indices(features, n, "features", "cpu")  # ints in [0, n): ArgumentError / ShapeError
        keep = torch.zeros(n, dtype=torch.bool, device="cpu")  # moved to the activations' device where used
        keep[idx] = True
    return lorsa, keep


@torch.no_grad()
def qk_feature_impacts(
    replacement: Any,
    layer: int,
    head: int,
    sae: Any,
    tokens: torch.Tensor,
    *,
    batch_size: int = 8,
    features: Any = None,
    skip_first: bool = True,
    chunk: int = 1 << 22,
    attention_mask: torch.Tensor | None = None,
) -> QKFeatureImpacts:
    """App. F.1: each SAE feature's maximum impact on Lorsa head ``head``'s Q and K over ``tokens``.

    Args:
        replacement: a :class:`~nnsight_lorsa.ReplacementModel` with a Lorsa at ``layer``.
        head: OV head index of that Lorsa.
        sae: an SAE on the Lorsa input (``encode``, ``W_dec (n_features, d_model)``; e.g. a
            :class:`~nnsight_lorsa.modules.sae.SparseAutoencoder` on the pre-attention norm's output). A feature's
            contribution ``a_f d_f`` is taken in the input's scale: an SAE that normalises its input at run time
            (``normalize_activations``) has it scaled back as its ``denormalize`` does (``‖x‖ / √d_in``, the
            standard deviation). An object of another library is read through ``encode`` / ``W_dec`` alone (a
            normalisation inside its ``encode`` is not undone: load its files with :func:`~nnsight_lorsa.load`).
        tokens: ``(n_windows, pos)`` token windows (BOS first), streamed ``batch_size`` at a time.
        features: only evaluate these feature indices (default: every feature that is active).
        skip_first: ignore activations at position 0 (BOS; its pattern row has a single entry).
        chunk: bound on the elements of one ablated-score tensor (memory knob).
        attention_mask: optional ``(n_windows, pos)`` (1 = token, 0 = padding; left or right padding): padded
            positions are no keys, no activation locations, no feature presences and no ``n_tokens``;
            ``skip_first`` skips each row's first token; a prompt's numbers are those of the prompt alone
            (positions are columns of ``tokens``).

    Returns:
        :class:`QKFeatureImpacts` (per feature: max KL for Q and for K, where, and how often present).

    Raises:
        ArgumentError: ``replacement`` is not a :class:`~nnsight_lorsa.ReplacementModel` (a set, a bare
            model or a module: wrap it, ``ReplacementModel(model, lorsas=...)``).
        LayerOutOfRangeError: no Lorsa at ``layer``. ShapeError: ``head`` or ``features`` out of
        range, ``tokens`` not a non-empty integer ``(n_windows, pos)`` tensor (ArgumentError: ids outside the
        model's vocabulary). ConfigMismatchError: the SAE's width is not the Lorsa's ``d_model``, or ``sae``
        is a transcoder, CLT or Lorsa (its decoder rows are not directions of its input).
        PlacementError: the Lorsa or the SAE is on ``meta``. ArgumentError: ``batch_size`` or ``chunk`` not an
        int ``>= 1``, ``skip_first`` not a bool, ``features`` not a non-empty list / integer tensor of ints,
        ``attention_mask`` not 0 / 1 or with padding between a row's tokens (ShapeError: not of the tokens' shape),
        the model carries stored edits.
        TraceOrderError: called inside a trace body. All before the model runs.

    What it measures: the Lorsa's pattern, recomputed from its weights on the attention input of ``layer`` read
    from a fresh trace of ``replacement.model`` — the model's own (the bundle's other replacements are not
    spliced). A model carrying edits stored by ``model.edit()`` is refused (``ArgumentError``): nnsight would
    replay them, but an edit of a stored splice of the Lorsa (its ``hook_z``, ``hook_q`` …) would not reach the
    recomputation.

    The ablations run on the Lorsa's device in fp32 (the attention input and the SAE's activations are
    moved there; the Lorsa and the SAE each see their input in their own dtype); the result is on the CPU.

    Source: Lorsa paper (He et al. 2025) App. F (interaction between Lorsa heads and SAE features).
    """
    from ..adapters.registry import get_adapter
    from ..envoy.read import attention_activations
    from .heads import check_attention_mask, check_tokens, kept_tokens, refuse_in_trace, refuse_stored_edits

    refuse_in_trace("qk_feature_impacts")
    check_replacement_model(replacement, "qk_feature_impacts")
    check_flag(skip_first, "skip_first", "qk_feature_impacts")
    if not is_int(chunk) or chunk < 1:
        raise ArgumentError(f"chunk must be an int >= 1 (elements of one ablated-score tensor), got {chunk!r}")
    model, lorsa_set = replacement.model, replacement.require("lorsas", "head analysis")
    refuse_stored_edits(model, "qk_feature_impacts", "the Lorsa's queries and keys")
    check_tokens(tokens, model)
    lorsa, keep = _check(lorsa_set, layer, head, sae, tokens, features, batch_size)
    head = int(head)  # a numpy / 0-d tensor integer as the int it is
    mask = check_attention_mask(attention_mask, tokens)
    counted = kept_tokens(mask, tuple(tokens.shape), 1 if skip_first else 0)  # (n_windows, pos) host
    adapter = get_adapter(model)
    cfg = lorsa.cfg
    g = head // cfg.group_size
    n_feat = sae.W_dec.shape[0]
    result = QKFeatureImpacts.empty(layer, head, g, n_feat)
    lorsa_name = f"the Lorsa of layer {layer}"
    device, _ = placement(lorsa, lorsa_name)  # everything below runs on the Lorsa's device, in fp32
    placement(sae, "the SAE")
    w_q, w_k = lorsa.W_Q[g].float(), lorsa.W_K[g].float()  # (d, e)
    b_q, b_k = lorsa.b_Q[g].float(), lorsa.b_K[g].float()
    w_dec = sae.W_dec.to(device=device, dtype=torch.float32)
    dq, dk = w_dec @ w_q, w_dec @ w_k  # (n_features, e): each feature's direction in raw q / k
    scale = cfg.scale
    for start in range(0, tokens.shape[0], batch_size):
        ids = tokens[start:start + batch_size]
        m = None if mask is None else mask[start:start + batch_size].to(device)
        act = attention_activations(model, layer, ids, None if m is None else m.long(), adapter=adapter)
        x = act.x.to(device=device, dtype=torch.float32)
        bsz, seq, _ = x.shape
        positions = act.positions.to(device)
        pos = positions.reshape(-1, seq).expand(bsz, seq)
        _, cache = lorsa(to_module(act.x, lorsa, lorsa_name), positions, m, return_cache=True)
        here = counted[start:start + batch_size].to(device)  # (b, s) tokens counted (BOS and padding out)
        loc = (cache.z[..., head] > 0) & here  # (b, s) activation locations
        result.n_tokens += int(here.sum())
        if not loc.any():
            continue
        # the SAE encodes on its own device, in its dtype; its activations join the rest in fp32
        x_sae = to_module(act.x, sae, "the SAE")
        acts = sae.encode(x_sae).to(device=device, dtype=torch.float32)
        gain = _input_gain(sae, x_sae)
        if gain is not None:  # a_f d_f in the input's scale: the SAE's run-time normalisation undone
            acts = acts * gain.to(device)
        if keep is not None:
            acts = acts * keep.to(acts.device)
        if m is not None:
            acts = acts * m[..., None]  # a feature at a padded position is present nowhere
        q_raw, k_raw = x @ w_q + b_q, x @ w_k + b_k  # (b, s, e)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        for b in range(bsz):
            qi = loc[b].nonzero().flatten()  # query positions of the activations in this window
            if qi.numel() == 0:
                continue
            result.n_activations += int(qi.numel())
            q = _project(lorsa, g, q_raw[b], pos[b], "q")  # (s, e)
            k = _project(lorsa, g, k_raw[b], pos[b], "k")
            valid = causal[qi] if m is None else causal[qi] & m[b][None]  # (p, s): the keys of each row
            scores = q[qi] @ k.T / scale
            logp = scores.double().masked_fill(~valid, float("-inf")).log_softmax(-1)  # original rows log A_i
            _q_side(result, lorsa, g, acts[b], qi, q_raw[b], pos[b], k, logp, valid, dq, scale, start + b, chunk)
            _k_side(result, lorsa, g, acts[b], qi, q[qi], k_raw[b], pos[b], scores, logp, valid, dk, scale,
                    start + b, chunk)
    return result


def _q_side(result: QKFeatureImpacts, lorsa: Any, g: int, acts: torch.Tensor, qi: torch.Tensor,
            q_raw: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, logp: torch.Tensor, valid: torch.Tensor,
            dq: torch.Tensor, scale: float, window: int, chunk: int) -> None:
    """Q ablation: every (activation p, feature f active at its query position) pair, ``step`` pairs at a time."""
    p_idx, f_idx = acts[qi].nonzero(as_tuple=True)
    step = max(1, chunk // k.shape[0])
    for s0 in range(0, p_idx.numel(), step):
        p, f = p_idx[s0:s0 + step], f_idx[s0:s0 + step]
        i = qi[p]
        raw = q_raw[i] - acts[i, f][:, None] * dq[f]
        q_abl = _project(lorsa, g, raw, pos[i], "q")  # (m, e)
        kl = _kl_rows(logp[p], q_abl @ k.T / scale, valid[p])
        result.update("q", kl, f, torch.full_like(f, window), i)


def _k_side(result: QKFeatureImpacts, lorsa: Any, g: int, acts: torch.Tensor, qi: torch.Tensor, q: torch.Tensor,
            k_raw: torch.Tensor, pos: torch.Tensor, scores: torch.Tensor, logp: torch.Tensor, valid: torch.Tensor,
            dk: torch.Tensor, scale: float, window: int, chunk: int) -> None:
    """K ablation: for each feature active at a key ``j ≤ max(qi)``, the keys at its positions are
    recomputed and substituted into every activation's score row; ``step`` features at a time."""
    last = int(qi.max()) + 1
    present = acts[:last] != 0  # (j, f)
    feats = present.any(0).nonzero().flatten()
    if feats.numel() == 0:
        return
    upto = present.cummax(0).values[qi]  # (p, f): f active at some key j <= i_p
    n_p, seq = scores.shape
    step = max(1, chunk // (n_p * seq))
    for s0 in range(0, feats.numel(), step):
        fs = feats[s0:s0 + step]
        j_idx, local = present[:, fs].nonzero(as_tuple=True)  # (key position, index into fs)
        f = fs[local]
        raw = k_raw[j_idx] - acts[j_idx, f][:, None] * dk[f]
        k_abl = _project(lorsa, g, raw, pos[j_idx], "k")  # (m, e)
        abl = scores.expand(fs.numel(), n_p, seq).clone()  # (n_f, p, s)
        abl[local, :, j_idx] = (q @ k_abl.T / scale).T  # the ablated keys' columns
        kl = _kl_rows(logp[None], abl, valid[None])  # (n_f, p)
        mask = upto[:, fs].T  # (n_f, p): pairs where the feature is present
        fi, pi = mask.nonzero(as_tuple=True)
        result.update("k", kl[fi, pi], fs[fi], torch.full_like(fi, window), qi[pi])
