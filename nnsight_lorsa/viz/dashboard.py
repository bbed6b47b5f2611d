"""A static, self-contained HTML dashboard per Lorsa head (Lorsa paper §5.1, Fig. 4).

:func:`head_dashboard_data` collects, for one head: its top-activating contexts with the
z-pattern of the top activation (``zp[j] = A_ij v_j``: each earlier token's contribution to the
head's activation at the query token, paper §5.1), the OV logit lens (tokens the head promotes),
its activation frequency and, optionally, its correlated MHSA heads (App. E.1) and the SAE features
that move its Q and K (App. F.1, :func:`~nnsight_lorsa.analysis.qk_ablation.qk_feature_impacts`) or
align with its ``w_v`` / ``w_o`` (App. F.2, :func:`~nnsight_lorsa.analysis.heads.ov_feature_cosines`) —
the four aspects the paper's dashboards show.
:func:`render_dashboard` turns that JSON-able dict into one HTML file whose inline script builds
the page (no network, no external assets), with a colour legend.

Tokens are shown as text: each context is decoded as one span and cut into per-token pieces
(:func:`~.page.token_pieces`), so a character that byte-level BPE splits over two tokens (``é``, ``—``, CJK,
emoji) shows once instead of as two ``\ufffd``. Contexts are distinct windows, each with the head
active (``z > 0``); which positions count (BOS, the first positions of a window) is decided when the
top activations are collected (:func:`~nnsight_lorsa.analysis.heads.collect_top_activations`'s
``skip_start``).
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .._checks import is_int
from .._placement import to_module
from ..analysis.heads import (
    MHSACorrelation,
    check_attention_mask,
    check_tokens,
    ov_logit_lens,
    refuse_in_trace,
    refuse_stored_edits,
)
from ..analysis.qk_ablation import QKFeatureImpacts
from ..analysis.top_activations import TopActivations
from ..envoy.read import attention_activations
from ..envoy.targets import check_index
from ..errors import ArgumentError, ConfigMismatchError
from .page import embed_json, finite, token_pieces

#: tokens decoded before a context's first token, so that a character begun there is decoded whole
_LEAD = 4


@torch.no_grad()
def head_dashboard_data(replacement: Any, layer: int, head: int, top: TopActivations,
                        tokens: torch.Tensor, *, n_contexts: int = 8, window: int = 24, lens_k: int = 10,
                        correlation: MHSACorrelation | None = None, extra: dict[str, Any] | None = None,
                        qk_features: Any = None, ov_features: dict[str, Any] | None = None, n_features: int = 8,
                        attention_mask: torch.Tensor | None = None) -> dict[str, Any]:
    """Everything the dashboard of Lorsa head ``(layer, head)`` shows, as a JSON-able dict.

    Args:
        top: :func:`~nnsight_lorsa.analysis.heads.collect_top_activations` over ``tokens``
            ``(n_windows, pos)`` (its window indices index ``tokens``). Its entries are shown best first,
            one per window (a repeated window is skipped) and only where the head is active (``z > 0``).
        n_contexts: at most this many contexts.
        window: tokens of context shown before the query token (each context's ``tokens`` are its text
            pieces, :func:`~.page.token_pieces`).
        extra: free-form entries shown in the header (e.g. path-patching effect).
        correlation: :func:`~nnsight_lorsa.analysis.heads.mhsa_correlation` of the layer: the MHSA heads listed
            with their normalised ``fraction`` and mean coefficient ``contribution`` (largest coefficient first),
            and ``heads_spanned`` (-1 — shown as undefined, fractions "n/a" — for a head whose contributions sum
            to 0 or less); no MHSA section for a head never active in the correlation's tokens (its
            ``count`` 0: nothing to attribute).
        qk_features: a :class:`~nnsight_lorsa.analysis.qk_ablation.QKFeatureImpacts` of this head
            (App. F.1: max KL of its pattern with a feature ablated from Q / from K).
        ov_features: :func:`~nnsight_lorsa.analysis.heads.ov_feature_cosines` of this head (App. F.2).
        n_features: features listed per aspect.
        attention_mask: the ``(n_windows, pos)`` mask ``top`` was collected with (1 = token; left or right
            padding): each context is recomputed on its row's tokens alone (its ``position`` stays a column of
            ``tokens``); without it a left-padded row would be recomputed with its padding as tokens.

    The model, the Lorsa and ``tokens`` may each be on any device and in any dtype: the z-patterns are
    computed on the Lorsa's device and every number is read back to the host.

    Raises:
        ConfigMismatchError: ``qk_features`` of another layer or head. PlacementError: the Lorsa is on ``meta``.
        TargetIndexError: ``head`` not an OV head of the layer's Lorsa. ArgumentError: ``top`` not a
        :class:`~nnsight_lorsa.analysis.TopActivations` of as many heads; ``n_contexts``, ``window``, ``n_features``
        not ints ≥ 0 (a negative ``window`` sliced the context from the wrong end); ``correlation`` not None or a
        :class:`~nnsight_lorsa.analysis.MHSACorrelation`, ``qk_features`` not None or a
        :class:`~nnsight_lorsa.analysis.QKFeatureImpacts`, ``ov_features`` / ``extra`` not None or a mapping.
        ShapeError / ArgumentError: ``tokens`` not a non-empty integer ``(n_windows, pos)`` tensor of the model's
        vocabulary (``analysis.heads.check_tokens``; checked even where no context is shown); ``attention_mask``
        not of ``tokens``' shape, not 0 / 1, or with padding between
        a row's tokens, or padding where ``top`` has an entry; the model carries edits stored by ``model.edit()``
        (the z-patterns are recomputed from the Lorsa's weights, out of their reach). TraceOrderError: called inside
        a trace body (it runs traces of its own).

    Source: Lorsa paper (He et al. 2025) §5.2 (visualization interface), Fig. 4.
    """
    from ..envoy.replacement_model import check_replacement_model

    check_replacement_model(replacement, "head_dashboard_data")
    refuse_in_trace("head_dashboard_data")
    check_tokens(tokens, replacement.model)
    mask = check_attention_mask(attention_mask, tokens)
    model, lorsa = replacement.model, replacement.require("lorsas", "head analysis")[layer]
    check_index(head, lorsa.cfg.n_ov_heads, f"head_dashboard_data: layer {layer}'s Lorsa OV head")
    head = int(head)  # a numpy / 0-d tensor integer as the int it is (was refused as "out of range")
    if not isinstance(top, TopActivations) or top.values.shape[0] != lorsa.cfg.n_ov_heads:
        got = f"one of {top.values.shape[0]} heads" if isinstance(top, TopActivations) else type(top).__name__
        raise ArgumentError(f"head_dashboard_data: top must be collect_top_activations(...) of layer {layer}'s Lorsa "
                            f"({lorsa.cfg.n_ov_heads} OV heads), got {got}")
    for name, value in (("n_contexts", n_contexts), ("window", window), ("n_features", n_features)):
        if not is_int(value) or value < 0:
            raise ArgumentError(f"head_dashboard_data: {name} must be an int >= 0, got {value!r}")
    optional: tuple[tuple[str, Any, type, str], ...] = (
        ("correlation", correlation, MHSACorrelation, "mhsa_correlation(...) of the layer"),
        ("qk_features", qk_features, QKFeatureImpacts, "qk_feature_impacts(...) of this head"),
        ("ov_features", ov_features, Mapping, "ov_feature_cosines(...) of this head"),
        ("extra", extra, Mapping, "a mapping {label: value}"))
    for name, given, kind, expected in optional:
        if given is not None and not isinstance(given, kind):
            raise ArgumentError(f"head_dashboard_data: {name} must be None or {expected}, got a {type(given).__name__}")
    refuse_stored_edits(model, "head_dashboard_data", "the contexts' z-patterns")
    tok = model.tokenizer
    contexts: list[dict[str, Any]] = []
    shown: set[int] = set()
    for v, w, p in zip(top.values[head].tolist(), top.window[head].tolist(), top.position[head].tolist(), strict=True):
        if w < 0 or w in shown or not v > 0 or len(contexts) >= n_contexts:
            continue  # empty, a window already shown, or the head inactive there
        shown.add(w)
        ids, col = tokens[w], p
        if mask is not None:  # the row's tokens alone: a left-padded row's first token is its column 0
            if not bool(mask[w, p]):
                raise ArgumentError(f"head_dashboard_data: top's entry (window {w}, position {p}) is padding in "
                                    "attention_mask: pass the mask top was collected with")
            ids, col = ids[mask[w].to(ids.device)], p - int(mask[w].int().argmax())
        act = attention_activations(model, layer, ids[None])
        x_in = to_module(act.x, lorsa, f"the Lorsa of layer {layer}")  # on the Lorsa's device, in its dtype
        zp = lorsa.z_pattern(x_in, [head], act.positions.to(x_in.device))[0, 0, col, : col + 1].float().cpu()
        start = max(0, col - window)
        contexts.append({
            "z": round(float(v), 4), "window": int(w), "position": int(p),
            "tokens": token_pieces(tok, ids[max(0, start - _LEAD):col + 1])[start - max(0, start - _LEAD):],
            "contrib": [round(float(c), 4) for c in zp[start:]],
        })
    vals, ids_, strings = ov_logit_lens(replacement, layer, [head], lens_k)
    data: dict[str, Any] = {
        "title": f"Lorsa L{layer}.H{head}", "layer": layer, "head": head,
        "qk_head": head // lorsa.cfg.group_size, "frequency": float(top.frequency[head]),
        "n_tokens": int(top.n_tokens), "contexts": contexts,
        "logit_lens": [{"token": s, "id": int(i), "logit": round(float(x), 3)}
                       for s, i, x in zip(strings[0] if strings else [], ids_[0].tolist(), vals[0].tolist(),
                                          strict=False)],
        "extra": extra or {},
    }
    if correlation is not None and correlation.count[head] > 0:
        frac, contrib = correlation.fractions()[head], correlation.contrib[head]
        # by the mean coefficient: the fractions' order where they are defined (a positive sum), and an order
        # where they are not (NaN, shown "n/a"; heads_spanned -1, shown as undefined)
        data["mhsa"] = [{"head": f"L{layer}.{m}", "fraction": round(float(frac[m]), 3),
                         "contribution": round(float(contrib[m]), 4)}
                        for m in contrib.argsort(descending=True).tolist()]
        data["heads_spanned"] = int(correlation.heads_spanned()[head])
    features: list[dict[str, Any]] = []
    if qk_features is not None:
        if (qk_features.layer, qk_features.head) != (layer, head):
            raise ConfigMismatchError(f"qk_features are for L{qk_features.layer}.H{qk_features.head}, "
                                      f"not L{layer}.H{head}")
        for aspect, rows in (("Q", qk_features.top_query_features(n_features)),
                             ("K", qk_features.top_key_features(n_features))):
            features += [{"aspect": aspect, "feature": f, "score": round(v, 4), "measure": "max KL"}
                         for f, v, _, _ in rows]
    for aspect in ("v", "o"):
        if ov_features is not None and aspect in ov_features:
            vals, idx = ov_features[aspect]
            features += [{"aspect": aspect.upper(), "feature": int(i), "score": round(float(v), 4),
                          "measure": "cosine"} for v, i in zip(vals[:n_features].tolist(), idx[:n_features].tolist(),
                                                                strict=True)]
    if features:
        data["sae_features"] = features
    return data


_STYLE = """
body{font-family:system-ui,sans-serif;margin:20px;color:#222;max-width:1100px}
h1{font-size:20px;margin:0 0 6px} h2{font-size:15px;margin:18px 0 6px;border-bottom:1px solid #ddd}
.meta span{margin-right:16px;color:#555} .ctx{font-family:monospace;margin:4px 0;line-height:1.9;white-space:pre-wrap}
.tok{padding:1px 0;border-radius:2px} .query{outline:2px solid #d62728} .z{color:#888;margin-right:8px}
table{border-collapse:collapse} td{padding:2px 8px;border-bottom:1px solid #eee;font-family:monospace}
#legend{margin:8px 0;color:#444;font-size:13px} #legend span{margin-right:14px;white-space:nowrap}
#legend i{display:inline-block;width:26px;height:12px;margin-right:4px;vertical-align:middle;border-radius:2px}
"""

_SCRIPT = """
const d = JSON.parse(document.getElementById('head-data').textContent);
const el = (t, a, txt) => { const e = document.createElement(t); Object.assign(e, a || {});
  if (txt !== undefined) e.textContent = txt; return e; };
const fx = (v, n) => (typeof v === 'number' && isFinite(v)) ? v.toFixed(n) : 'n/a';  // null: a NaN / inf
const root = document.getElementById('app');
root.appendChild(el('h1', {}, d.title));
const meta = el('div', {className: 'meta', id: 'meta'});
meta.appendChild(el('span', {id: 'frequency'},
  'active on ' + fx(d.frequency === null ? null : 100 * d.frequency, 2) + '% of ' + d.n_tokens + ' tokens'));
meta.appendChild(el('span', {}, 'QK head ' + d.qk_head));
if (d.heads_spanned !== undefined)
  meta.appendChild(el('span', {id: 'spanned'}, d.heads_spanned >= 0 ? 'spans ' + d.heads_spanned + ' MHSA head(s)'
    : 'MHSA heads spanned: undefined (its contributions sum to 0 or less)'));
for (const [k, v] of Object.entries(d.extra)) meta.appendChild(el('span', {className: 'extra'}, k + ': ' + v));
root.appendChild(meta);
root.appendChild(el('h2', {}, 'Top activations (z-pattern: contribution of each key token to z at the query)'));
const legend = el('div', {id: 'legend'});
for (const [cls, bg, text] of [['pos', 'linear-gradient(90deg,rgba(31,119,180,.1),rgba(31,119,180,1))',
                                 'key token raising z (shade: share of the largest contribution)'],
                                ['neg', 'linear-gradient(90deg,rgba(214,39,40,.1),rgba(214,39,40,1))',
                                 'key token lowering z'],
                                ['query', '#fff', 'query token (where z is read)']]) {
  const s = el('span', {className: 'legend-' + cls}); const i = el('i');
  i.style.background = bg; if (cls === 'query') i.style.outline = '2px solid #d62728';
  s.appendChild(i); s.appendChild(document.createTextNode(text)); legend.appendChild(s);
}
root.appendChild(legend);
const ctxs = el('div', {id: 'contexts'});
for (const c of d.contexts) {
  const row = el('div', {className: 'ctx'});
  row.appendChild(el('span', {className: 'z'}, 'z=' + fx(c.z, 2)));
  const m = c.contrib.reduce((a, x) => Math.max(a, Math.abs(x)), 1e-9);  // no spread: a long window is fine
  c.tokens.forEach((t, i) => {
    const s = el('span', {className: 'tok'}, t.replace(/\\n/g, '\\u23ce'));
    const a = (c.contrib[i] || 0) / m;
    s.style.background = a >= 0 ? `rgba(31,119,180,${a.toFixed(3)})` : `rgba(214,39,40,${(-a).toFixed(3)})`;
    s.title = 'contribution ' + c.contrib[i];
    if (i === c.tokens.length - 1) s.classList.add('query');
    row.appendChild(s);
  });
  ctxs.appendChild(row);
}
root.appendChild(ctxs);
root.appendChild(el('h2', {}, 'Logits via OV (tokens the head promotes)'));
const lens = el('table', {id: 'logit-lens'});
for (const r of d.logit_lens) { const tr = el('tr'); tr.appendChild(el('td', {}, JSON.stringify(r.token)));
  tr.appendChild(el('td', {}, fx(r.logit, 3))); lens.appendChild(tr); }
root.appendChild(lens);
if (d.mhsa) {
  root.appendChild(el('h2', {}, 'Correlated MHSA heads (oblique projection, App. E.1)'));
  const t = el('table', {id: 'mhsa'});
  for (const r of d.mhsa) { const tr = el('tr'); tr.appendChild(el('td', {}, r.head));
    tr.appendChild(el('td', {}, fx(r.fraction, 3)));
    if (r.contribution !== undefined) tr.appendChild(el('td', {className: 'contribution'}, fx(r.contribution, 4)));
    t.appendChild(tr); }
  root.appendChild(t);
}
if (d.sae_features) {
  root.appendChild(el('h2', {}, 'SAE features by aspect (Q, K: ablation KL, App. F.1; V, O: cosine, App. F.2)'));
  const t = el('table', {id: 'sae-features'});
  for (const r of d.sae_features) { const tr = el('tr', {className: 'aspect-' + r.aspect});
    tr.appendChild(el('td', {}, r.aspect)); tr.appendChild(el('td', {}, 'feature ' + r.feature));
    tr.appendChild(el('td', {}, r.measure + ' ' + fx(r.score, 4))); t.appendChild(tr); }
  root.appendChild(t);
}
document.body.setAttribute('data-rendered', 'yes');
"""


def render_dashboard(data: dict[str, Any]) -> str:
    """One self-contained HTML page (inline CSS, JSON and script) for :func:`head_dashboard_data`'s dict.

    Any string (a title, an ``extra=`` field, a token) is inert: the JSON is embedded with ``<``, ``>``
    and ``&`` escaped (:func:`~.page.embed_json`), so no ``</script>`` or ``<!--`` can end
    or comment out the data; NaN / inf values are written as ``null`` and shown as "n/a" (they made the
    page blank before). A legend (``#legend``) says what the colours of the contexts mean.

    Raises:
        ArgumentError: ``data`` not a mapping (:func:`head_dashboard_data`'s dict).

    Source: Lorsa paper (He et al. 2025) §5.2 (visualization interface), Fig. 4.
    """
    if not isinstance(data, Mapping):
        raise ArgumentError(f"render_dashboard: data must be head_dashboard_data(...)'s dict, got a "
                            f"{type(data).__name__}")
    payload = embed_json(finite(data))
    return (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(str(data.get('title', '')))}"
            f"</title><style>{_STYLE}</style></head><body><div id='app'></div>"
            f"<script type='application/json' id='head-data'>{payload}</script>"
            f"<script>{_SCRIPT}</script></body></html>\n")


def write_dashboard(path: str | Path, data: dict[str, Any]) -> Path:
    """Write :func:`render_dashboard` to ``path`` (parents created; atomically: a sibling temporary
    renamed over it); returns the path.

    Raises:
        ArgumentError: ``path`` not a str / ``os.PathLike``; ``data`` not a mapping (nothing written).

    Source: Lorsa paper (He et al. 2025) §5.2 (visualization interface), Fig. 4.
    """
    from .._atomic import atomic_file
    from ..formats.files import check_path

    check_path(path, "write_dashboard", "an HTML file")
    return atomic_file(path, render_dashboard(data).encode("utf-8"))
