"""Path patching: a component's effect through the residual stream and MLPs only.

Lorsa paper (He et al. 2025) §6: "path patching ablates [a head's] output and allows the influence
to propagate only through residual connections and MLPs (but not through other attention heads)";
the method of Wang et al. (2023, IOI) and Conmy et al. (2023). Senders are MHSA heads (o_proj's
input columns), Lorsa heads (``hook_z``) and SAE / transcoder features (``hook_sae_acts_post`` of
the spliced SAE / transcoder, whose output then changes by ``Δa · W_dec[i]``: the error term is
held), alone or in groups patched together. For every sender (group):

1. the *clean* prompt runs as is (invoke A) and records the output of every attention site
   after the sender — the attention output projection's output (``o_proj`` / ``dense`` /
   ``c_proj``), or, where a Lorsa is spliced, its ``hook_out`` (and ``hook_error``);
2. the *corrupt* prompt (invoke B; absent for ``mode="zero"``/``"mean"``) records the sender's value;
3. the clean prompt runs again (invoke C) with the sender set to its corrupt (or zero / mean)
   value and every later attention site frozen to its clean value (``freeze=True``): the change
   reaches the logits only through the residual stream and MLPs;
4. with head receivers (``receivers=[HeadInput(MHSAHead(3, 1), "q"), ...]``) invoke C only
   records the receivers' q/k/v inputs, and a last clean run (invoke D) patches just those into
   the receivers; everything after them runs normally (Wang et al.'s sender → receiver paths).

"Later" starts at the first layer whose attention runs after the sender (:func:`_place`): layer
L + 1 for heads and transcoder features of layer L and for SAEs on layer L's output (the residual
stream after it, ``hook_resid_pre`` of L + 1), attention output, MLP norm or MLP output; 0 for an
SAE on the embedding; L for one on layer L's attention norm (which feeds only that attention, so
its effect reaches the logits only through receivers of layer L). Every attention site from
there on is frozen, and receivers must sit in such a layer. In a group, freezing starts after its
earliest sender and spares the senders themselves (Wang et al.: every non-sender head is frozen):
a layer holding sender heads is frozen through its per-head values (o_proj's input / ``hook_z``)
with the senders then set. SAE senders inside the attention or MLP modules (e.g. ``q_proj``) are
refused, as is a group that would freeze an MHSA sender's layer whose Lorsa is spliced (the
error term mixes the two). All of it is checked before the model runs.

All invokes of a chunk of senders share one ``model.trace`` (nnsight batches them into one
forward; ``tracer.barrier`` hands values between invokes at the module where they are made).
Every Lorsa and SAE/transcoder site of the call is spliced in every chunk.

The metric is the logit difference by default; :class:`PathPatchingResult` gives it per sender
and prompt (``(n_groups, batch)``), the clean (and corrupt) baselines ``(batch,)`` and the effect
``clean − patched``, fp32 on the CPU. Values handed between invokes stay on the model's device
(one forward); means may be on any device and are moved to the site they are written to.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import nnsight
import torch

from .._checks import is_int
from .._placement import like
from .._repr import FieldsRepr
from ..envoy.nnsight_internals import hf_module
from ..envoy.padding import check_same_padding, padding_mask
from ..envoy.replacement_model import ReplacementModel, check_replacement_model
from ..envoy.targets import Bound, Feature, LorsaHead, MHSAHead, Positions, Target, index_at
from ..errors import ArgumentError, ConfigMismatchError, ShapeError
from .experiments import check_padded_positions, make_metric, saved_logits, top_groups
from .interventions import _value, check_means_mode, check_positions, check_prompts, means_at, refuse_inside_trace
from .metrics import metric_rounding, normalized_effect, relative_effect

Metric = Callable[[torch.Tensor], torch.Tensor]
Projection = Literal["q", "k", "v"]

@dataclass(frozen=True, repr=False)
class HeadInput(FieldsRepr):
    """A receiver: the ``which`` (``"q"``, ``"k"`` or ``"v"``) input of an MHSA or Lorsa head.

    MHSA heads: the head's columns of ``q_proj``'s output (``k``/``v``: its KV head's columns of
    ``k_proj``/``v_proj`` — under GQA shared by ``n_heads / n_kv_heads`` query heads; OLMo-2: of ``q_norm`` /
    ``k_norm``'s output, ``adapter.head_input_names``). Needs separate q/k/v projections (Llama, Mistral, Qwen2/3,
    OLMo-2; not GPT-2's ``c_attn`` / NeoX's / Phi-3's fused QKV).
    Lorsa heads: ``hook_q``/``hook_k`` of the head's QK head (shared by its ``group_size`` OV heads),
    or ``hook_v[..., head]``.

    Source: Lorsa paper (He et al. 2025) §6; Wang et al. 2023, *Interpretability in the Wild*.
    """

    head: MHSAHead | LorsaHead
    which: Projection = "q"


Receiver = HeadInput


@dataclass(repr=False)
class PathPatchingResult(FieldsRepr):
    """Metric per sender group and prompt.

    Attributes:
        senders: the sender groups (each patched together), in the order given.
        receivers: the receiver inputs (empty: the logits).
        clean: ``(batch,)`` metric of the clean run.
        corrupt: ``(batch,)`` metric of the corrupt run, or None for zero / mean ablation.
        patched: ``(n_groups, batch)`` metric with group ``i`` path-patched.
        rounding: the eps of the logits' dtype the metrics were computed from (``torch.finfo(dtype).eps``), which
            decides where :attr:`normalized` is undefined.

    Source: Lorsa paper (He et al. 2025) §6; Wang et al. 2023, *Interpretability in the Wild*.
    """

    senders: list[tuple[Target, ...]]
    receivers: list[HeadInput]
    clean: torch.Tensor
    corrupt: torch.Tensor | None
    patched: torch.Tensor
    rounding: float = torch.finfo(torch.float32).eps

    @property
    def effect(self) -> torch.Tensor:
        """``(n_groups, batch)``: ``clean − patched`` (positive: the path supports the behaviour).

        Source: Lorsa paper (He et al. 2025) §6; Wang et al. 2023, *Interpretability in the Wild*.
        """
        return self.clean[None] - self.patched

    @property
    def relative(self) -> torch.Tensor:
        """``(n_groups,)`` relative effect on the batch-mean metric, ``(clean − patched) / clean``
        (:func:`~.metrics.relative_effect`: a zero or rounding-sized clean mean raises
        ``UndefinedNormalizationError``).

        Source: Lorsa paper (He et al. 2025) §6; Wang et al. 2023, *Interpretability in the Wild*.
        """
        return relative_effect(self.clean.mean(), self.patched.mean(-1), rounding=self.rounding)

    @property
    def normalized(self) -> torch.Tensor:
        """``(n_groups, batch)``: ``(clean − patched) / (clean − corrupt)`` (needs a corrupt run).

        Raises:
            ConfigMismatchError: no corrupt run (``mode`` zero or mean).
            UndefinedNormalizationError: rows whose clean and corrupt metrics are equal within the logits' rounding
                (:func:`~.metrics.normalized_effect`; the ratio was ±inf / NaN there).

        Source: Lorsa paper (He et al. 2025) §6; Wang et al. 2023, *Interpretability in the Wild*.
        """
        if self.corrupt is None:
            raise ConfigMismatchError("normalized needs a corrupt prompt (mode='patch')")
        return normalized_effect(self.effect, self.clean, self.corrupt, self.rounding, "PathPatchingResult.normalized")

    def top(self, k: int) -> list[tuple[Target, ...]]:
        """The ``k`` sender groups with the largest batch-mean effect (all of them where ``k`` is larger).

        Raises:
            ArgumentError: ``k`` not an int ``>= 0`` (a negative ``k`` dropped the last groups).

        Source: Lorsa paper (He et al. 2025) §6; Wang et al. 2023, *Interpretability in the Wild*.
        """
        return top_groups(self.senders, self.effect, k)


# ---------------------------------------------------------------- locations
@dataclass(frozen=True, repr=False)
class _Site(FieldsRepr):
    """One module value the invokes touch; ``key`` orders sites by execution."""

    key: tuple[Any, ...]
    kind: str  # "qkv", "proj_in", "proj_out", "lorsa_qkv", "lorsa_z", "lorsa_out", "lorsa_err", "coder"
    layer: int
    name: str = ""


# execution steps inside layer L (the first element of a site's key is the layer): the q/k/v
# projections' outputs 0.5, o_proj's input 1.0 and output 1.2, a spliced Lorsa's hook_q/k/v 1.4,
# hook_z 1.5, hook_out 1.8, hook_error 1.9 (the Lorsa runs once the attention has); SAE sites
# below; a transcoder's features 2.5 (computed once the MLP it replaces has run; 2.65 once Gemma-2's post-MLP norm
# has, for a hook_mlp_out transcoder that replaces its output: ReplacementModel.order); Gemma-2's post-norms right after
# the attention / MLP output they normalise
_SAE_STEPS = {"attention_norm_name": 0.2, "attention_name": 1.95, "attention_post_norm_name": 1.97,
              "mlp_norm_name": 2.2, "mlp_name": 2.6, "mlp_post_norm_name": 2.7}


def _place(replacement: ReplacementModel, t: Target) -> tuple[tuple[float, float], int]:
    """``((layer, step), first)``: where the model computes sender ``t`` (the site order above)
    and ``first``, the first layer whose attention runs after ``t`` (it reads the changed residual
    stream): a head's or a transcoder feature's layer + 1; for SAE features, by site: the embedding
    → 0, layer L's attention norm (``hook_resid_pre`` of L is layer L−1's output) → L, layer L's
    attention output, MLP norm, MLP output or output (the residual stream after it) → L + 1, the
    final norm → ``n_layers`` (no attention after it).

    Raises:
        ConfigMismatchError: an SAE site path patching cannot place (inside the attention or MLP
            module, or outside the decoder layers other than the embeddings and final norm).
    """
    a = replacement.adapter
    if isinstance(t, (MHSAHead, LorsaHead)):
        return (float(t.layer), 1.0 if isinstance(t, MHSAHead) else 1.5), t.layer + 1
    if t.kind == "transcoder":  # 2.5, or 2.65 where it replaces Gemma-2/3's post-MLP norm output (hook_mlp_out)
        return replacement.order(t), int(t.site) + 1
    path = str(t.site)
    if path == a.embed_path:
        return (-1.0, 0.0), 0
    if path == getattr(a, "pos_embed_path", None):
        return (-1.0, 0.1), 0
    if path == a.final_norm_path:
        return (float(a.n_layers), 0.0), a.n_layers
    m = re.fullmatch(rf"{re.escape(a.layers_path)}\.([0-9]+)(?:\.(.+))?", path)
    if m is not None and int(m.group(1)) < a.n_layers:
        layer, sub = int(m.group(1)), m.group(2)
        if sub is None:
            return (float(layer), 3.0), layer + 1
        for attr, step in _SAE_STEPS.items():
            if getattr(a, attr, "") and sub == getattr(a, attr):
                return (float(layer), step), layer if attr == "attention_norm_name" else layer + 1
    names = ", ".join(f"{a.layers_path}.L.{getattr(a, n)}" for n in _SAE_STEPS if getattr(a, n, ""))
    raise ConfigMismatchError(
        f"path patching cannot place an SAE sender at {path!r} relative to the attention sites; SAE senders "
        f"sit on {a.embed_path}, {a.layers_path}.L (a layer's output), {names} or {a.final_norm_path}")


def _sender_layers(group: tuple[Target, ...]) -> dict[int, list[Target]]:
    out: dict[int, list[Target]] = {}
    for t in group:
        if isinstance(t, (MHSAHead, LorsaHead)):
            out.setdefault(t.layer, []).append(t)
    return out


class _Plan:
    """Which sites each invoke reads or writes, in execution order (validated, nothing runs).

    ``lorsa_layers``: every Lorsa layer of the whole call (spliced, with its SAE/transcoder sites,
    in every chunk, so that the clean run is the same model in all of them).
    """

    def __init__(self, replacement: ReplacementModel, groups: list[tuple[Target, ...]], receivers: list[HeadInput],
                 freeze: bool, lorsa_layers: set[int]) -> None:
        self.replacement = replacement
        a = replacement.adapter
        self.lorsa_layers = lorsa_layers
        self.coders: dict[_Site, Feature] = {}
        sites: dict[tuple, _Site] = {}

        def add(site: _Site) -> _Site:
            return sites.setdefault((site.kind, site.layer, site.name), site)

        self.sender_sites = [[add(self._sender_site(t)) for t in g] for g in groups]
        self.receiver_sites = [add(self._receiver_site(r)) for r in receivers]
        self.freeze_sites: list[list[_Site]] = []
        last = a.n_layers if not receivers else max(r.head.layer for r in receivers)
        for g in groups:
            # Wang et al.: every attention site after the group's earliest sender is frozen, except the
            # senders: a layer holding sender heads is frozen through its per-head values (o_proj's
            # input, hook_z), where the senders are then set
            first = min(_place(replacement, t)[1] for t in g)
            heads = _sender_layers(g)
            frozen: list[_Site] = []
            for layer in range(first, last) if freeze else ():
                if layer in self.lorsa_layers:
                    if any(isinstance(t, MHSAHead) for t in heads.get(layer, ())):
                        raise ConfigMismatchError(f"an MHSA sender in spliced Lorsa layer {layer} of group {g}")
                    kind, step = ("lorsa_z", 1.5) if layer in heads else ("lorsa_out", 1.8)
                    frozen.append(add(_Site((layer, step, 0), kind, layer)))
                    if replacement.error:
                        frozen.append(add(_Site((layer, 1.9, 0), "lorsa_err", layer)))
                else:
                    kind, step = ("proj_in", 1.0) if layer in heads else ("proj_out", 1.2)
                    frozen.append(add(_Site((layer, step, 0), kind, layer)))
            self.freeze_sites.append(frozen)
        self.sites = sorted(sites.values(), key=lambda s: s.key)

    def _sender_site(self, t: Target) -> _Site:
        if isinstance(t, MHSAHead):
            return _Site((t.layer, 1.0, 0), "proj_in", t.layer)
        if isinstance(t, LorsaHead):
            return _Site((t.layer, 1.5, 0), "lorsa_z", t.layer)
        (layer, step), _ = _place(self.replacement, t)
        site = _Site((layer, step, 0), "coder", int(layer), f"{t.kind}:{t.site}")
        self.coders.setdefault(site, t)
        return site

    def _receiver_site(self, r: HeadInput) -> _Site:
        step = {"q": 0, "k": 1, "v": 2}[r.which]
        if isinstance(r.head, MHSAHead):
            return _Site((r.head.layer, 0.5, step), "qkv", r.head.layer, r.which)
        return _Site((r.head.layer, 1.4, step), "lorsa_qkv", r.head.layer, r.which)

    # ------------------------------------------------------------ in a trace
    def tensor(self, site: _Site) -> Any:
        """The (batch, …) value at ``site`` inside a trace body (narrowed to the current invoke)."""
        r, a = self.replacement, self.replacement.adapter
        if site.kind == "proj_in":
            return r.model.get(r.output_projection_path(site.layer)).input
        if site.kind == "proj_out":
            return r.model.get(r.output_projection_path(site.layer)).output
        if site.kind == "qkv":
            return r.model.get(f"{a.attention_path(site.layer)}.{a.head_input_names[site.name]}").output
        if site.kind == "coder":  # hook_sae_acts_post of the spliced SAE / transcoder
            return r.location(self.coders[site])[0]
        envoy = r.lorsas.replace(site.layer, error=r.error)
        hook = {"lorsa_z": "hook_z", "lorsa_out": "hook_out", "lorsa_err": "hook_error",
                "lorsa_qkv": f"hook_{site.name}"}[site.kind]
        return getattr(envoy, hook).output


def _splice_all(replacement: ReplacementModel, lorsa_layers: set[int], features: list[Feature]) -> None:
    """Splice every Lorsa layer and SAE/transcoder site of the call for the running invoke's rows (in every invoke,
    before any read: a splice replaces the rows of the invokes that call it)."""
    todo: list[tuple[tuple[float, float], Any]] = [((float(layer), 1.3), layer) for layer in lorsa_layers]
    todo += [(_place(replacement, f)[0], f) for f in features]
    for _, item in sorted(todo, key=lambda x: x[0]):
        if isinstance(item, Feature):
            coders = replacement.saes if item.kind == "sae" else replacement.transcoders
            coders.replace(item.site, error=replacement.error)
        else:
            replacement.lorsas.replace(item, error=replacement.error)


def _receiver_index(replacement: ReplacementModel, r: HeadInput) -> tuple:
    """Index into the receiver site's tensor (batch first) selecting this receiver's slice."""
    a = replacement.adapter
    if isinstance(r.head, MHSAHead):
        d = a.head_dim
        h = r.head.head
        if r.which != "q":
            n_kv = int(getattr(a.config, "num_key_value_heads", None) or a.n_heads)
            h = h // (a.n_heads // n_kv)
        return (slice(None), slice(None), slice(h * d, (h + 1) * d))
    cfg = replacement.lorsas[r.head.layer].cfg
    if r.which == "v":
        return (slice(None), slice(None), r.head.head)
    return (slice(None), r.head.head // cfg.group_size)  # hook_q/hook_k: (batch, n_qk, pos, d)


def _cols(replacement: ReplacementModel, t: Target) -> tuple:
    if isinstance(t, MHSAHead):
        d = replacement.adapter.head_dim
        return (slice(t.head * d, (t.head + 1) * d),)
    if isinstance(t, LorsaHead):
        return (t.head,)
    return (t.index,)


def _call_splices(groups: list[tuple[Target, ...]], receivers: list[HeadInput]) -> tuple[set[int], list[Feature]]:
    """The Lorsa layers and the SAE/transcoder sites (one feature each) the whole call splices."""
    targets = [t for g in groups for t in g] + [r.head for r in receivers]
    features: dict[tuple, Feature] = {}
    for t in targets:
        if isinstance(t, Feature):
            features.setdefault((t.kind, t.site), t)
    return {t.layer for t in targets if isinstance(t, LorsaHead)}, list(features.values())


def _check(replacement: ReplacementModel, groups: list[tuple[Target, ...]], receivers: list[HeadInput],
           mode: str, means: Any, clean: Any, corrupt: Any, freeze: bool) -> None:
    a = replacement.adapter
    for g in groups:
        if not g:
            raise ConfigMismatchError("an empty sender group")
        for t in g:
            replacement.check(t)
            if isinstance(t, Feature) and t.kind == "transcoder" \
                    and replacement.transcoders.feature_key(t) != t.site:  # a CLT's: one splice for every layer
                raise ConfigMismatchError(
                    f"path_patching: {t} is a cross-layer transcoder's feature, which writes every later MLP directly; "
                    "path patching does not separate those paths. Use activation_patching / ablation_effect, or the "
                    "patching functions in a trace")
            _place(replacement, t)
            if mode == "mean":
                if not isinstance(means, dict) or t not in means:
                    raise ConfigMismatchError(f"mode='mean' needs means[{t}] (see mean_activations)")
                replacement.check_values(t, torch.as_tensor(means[t], device="cpu"))
    for r in receivers:
        if not isinstance(r, HeadInput):
            raise ConfigMismatchError(f"receivers are HeadInput(head, 'q'|'k'|'v'), got {r!r}")
        if r.which not in ("q", "k", "v"):
            raise ConfigMismatchError(f"HeadInput.which must be 'q', 'k' or 'v', got {r.which!r}")
        if not isinstance(r.head, (MHSAHead, LorsaHead)):
            raise ConfigMismatchError(f"a receiver is an MHSA or Lorsa head's input, got {r.head!r}")
        replacement.check(r.head)
        if isinstance(r.head, MHSAHead):
            attn = a.attention_module(hf_module(replacement.model), r.head.layer)
            if not isinstance(getattr(attn, a.head_input_names[r.which], None), torch.nn.Module):
                raise ConfigMismatchError(
                    f"{a.family} attention has no separate {a.head_input_names[r.which]}: MHSA receivers need "
                    "separate q/k/v projections (Llama, Mistral, Qwen)")
        for g in groups:
            for t in g:
                first = _place(replacement, t)[1]
                if r.head.layer < first:
                    raise ConfigMismatchError(
                        f"receiver {r} must be in a later layer than sender {t}: the first attention after "
                        f"that sender is layer {first}")
    lorsa_layers, features = _call_splices(groups, receivers)
    heads = [(t, "sender") for g in groups for t in g] + [(r.head, f"receiver ({r.which})") for r in receivers]
    for t, role in heads if not replacement.error else ():
        if isinstance(t, MHSAHead) and t.layer in lorsa_layers:  # as activation_patching (check_editable) refuses it
            raise ArgumentError(
                f"path_patching: MHSA {role} {t} would be discarded: the Lorsa this call splices into layer {t.layer} "
                "(for a Lorsa head there) replaces that attention's output without an error term "
                "(ReplacementModel(error=False)), so nothing of the head reaches it. Use error=True, or path-patch "
                "the MHSA head in a call without Lorsa heads of that layer")
    tc_layers = {int(f.site) for f in features if f.kind == "transcoder"}
    replaced_by = {1.95: ("Lorsa", lorsa_layers),  # an SAE on an attention / MLP output the call also replaces
                   2.6: ("transcoder", tc_layers),  # (or only feeds the post-norm whose output the transcoder replaces)
                   2.7: ("transcoder", {layer for layer in tc_layers  # Gemma-2/3 hook_mlp_out: the post-norm output
                                        if replacement.order(Feature(layer, 0, kind="transcoder"))[1] == 2.65})}
    for f in features:
        (layer, step), _ = _place(replacement, f)
        what, layers = replaced_by.get(step, ("", set())) if f.kind == "sae" else ("", set())
        if int(layer) in layers:
            raise ConfigMismatchError(f"an SAE sender at {f.site!r} reads the output that layer {int(layer)}'s {what} "
                                      "replaces in this call: path-patch them in separate calls")
    for g in groups if freeze else ():
        first = min(_place(replacement, t)[1] for t in g)
        for t in g:
            if isinstance(t, MHSAHead) and t.layer >= first and t.layer in lorsa_layers:
                raise ConfigMismatchError(
                    f"sender group {g}: {t} sits in layer {t.layer}, whose Lorsa this call splices, after an earlier "
                    "sender of the group; that layer's attention cannot be frozen around an MHSA head (the error "
                    "term mixes them): path-patch the group in a call without Lorsa heads of that layer")
    if mode not in ("patch", "zero", "mean"):
        raise ConfigMismatchError(f"mode must be 'patch', 'zero' or 'mean', got {mode!r}")
    check_means_mode(mode, means, "path_patching")
    if corrupt is not None and mode != "patch":
        raise ConfigMismatchError(f"path_patching: corrupt= is read only with mode='patch', got mode={mode!r}: the "
                                  "corrupt prompts would be ignored. Pass mode='patch' (or drop corrupt)")
    check_prompts(clean, "path_patching", "clean", replacement.model)
    if corrupt is not None:
        check_prompts(corrupt, "path_patching", "corrupt", replacement.model)
    if mode == "patch":
        if corrupt is None:
            raise ConfigMismatchError("mode='patch' needs corrupt= prompts (or use mode='zero'/'mean')")
        if isinstance(clean, torch.Tensor) and isinstance(corrupt, torch.Tensor) and clean.shape != corrupt.shape:
            raise ShapeError(f"clean {tuple(clean.shape)} and corrupt {tuple(corrupt.shape)} differ in shape")
        rows, rows_c = _rows(clean), _rows(corrupt)
        if rows is not None and rows_c is not None and rows != rows_c:
            raise ShapeError(f"path_patching: {rows} clean prompts but {rows_c} corrupt ones: give one corrupt "
                             "prompt per clean prompt")


def _rows(prompts: Any) -> int | None:
    """How many prompts (batch rows) ``prompts`` holds, where its form says (token ids, texts, lists of them, a dict
    with ``input_ids``); else None."""
    if isinstance(prompts, dict):
        return _rows(prompts.get("input_ids"))
    if isinstance(prompts, torch.Tensor):
        return int(prompts.shape[0]) if prompts.dim() == 2 else 1 if prompts.dim() == 1 else None
    if isinstance(prompts, str) or isinstance(prompts, (list, tuple)) and prompts and all(is_int(x) for x in prompts):
        return 1
    if isinstance(prompts, (list, tuple)) and all(isinstance(x, (str, list, tuple, torch.Tensor)) for x in prompts):
        return len(prompts)
    return None


def path_patching(replacement: ReplacementModel, clean: Any, senders: Sequence[Target | Sequence[Target]], *,
                  corrupt: Any = None, mode: Literal["patch", "zero", "mean"] = "patch", means: Any = None,
                  receivers: Sequence[HeadInput] = (), metric: Metric | None = None, correct_ids: Any = None,
                  incorrect_ids: Any = None, positions: Positions = None, freeze: bool = True,
                  groups_per_trace: int = 8) -> PathPatchingResult:
    """Path-patch each sender (or group of senders, patched together) on the ``clean`` prompts.

    Lorsa paper §6 / Wang et al. (2023): the sender takes its value from ``corrupt``
    (``mode="patch"``), or 0 / its mean (``mode="zero"`` / ``"mean"`` with ``means`` from
    :func:`~.interventions.mean_activations`), at ``positions`` (None: all); every attention site
    after the sender (after a group's earliest sender, the senders excepted; see the module
    docstring for what "after" is for features) is frozen to its clean output, so the change
    flows only through the residual stream and MLPs. With ``receivers`` the change reaches only
    those heads' q/k/v inputs (at all positions), and the model runs normally after them.

    Args:
        replacement: the model and its sets; a Lorsa of a sender's/receiver's layer and the SAE /
            transcoder of a feature sender are spliced (with the error term if ``replacement.error``),
            and a spliced Lorsa site is frozen through its ``hook_out`` (and ``hook_error``).
        clean: token ids ``(batch, pos)`` (or prompts).
        senders: :class:`~.targets.MHSAHead` / :class:`~.targets.LorsaHead` /
            :class:`~.targets.Feature` (SAE or transcoder), or tuples of them (mixed kinds allowed).
        means: ``{target: mean}`` (``()`` or ``(pos,)`` per feature / Lorsa head, ``(…, head_dim)``
            per MHSA head), ``mode="mean"``; a per-position mean is taken at ``positions``
            (:func:`~.interventions.means_at`).
        corrupt: token ids of the same shape (``mode="patch"``).
        receivers: :class:`HeadInput` receivers (default: the logits).
        metric: logits ``(batch, pos, vocab)`` → ``(batch,)``; default the logit difference of
            ``correct_ids`` vs ``incorrect_ids`` at the last position.
        freeze: False lets the change flow through later attention too (= activation patching,
            the total effect; a check of the frozen run).
        groups_per_trace: sender groups per ``model.trace`` (each adds one or two invokes).

    Returns:
        :class:`PathPatchingResult` (metric ``(n_groups, batch)`` and baselines ``(batch,)``).

    Raises:
        ArgumentError: ``replacement`` is not a :class:`~nnsight_lorsa.ReplacementModel` (a set, a bare
            model or a module: wrap it, ``ReplacementModel(model, lorsas=...)``).
        ArgumentError: with ``replacement.error`` False, an MHSA sender or receiver in a layer whose Lorsa the call
            splices (for a Lorsa head there): its edit would be discarded. Token-id tensors that are not integer
            ``(pos,)`` / ``(batch, pos)`` with ``pos >= 1``.
        ConfigMismatchError: ``senders`` / ``receivers`` not lists (a bare target or :class:`HeadInput`), a receiver
            not in a layer after every sender of a group, an SAE
            sender site path patching cannot place (inside the attention / MLP module) or whose
            output a Lorsa / transcoder of the call also replaces, an MHSA sender in a spliced
            Lorsa layer after an earlier sender of its group, a feature whose set is missing, a cross-layer
            transcoder's feature,
            MHSA receivers on a fused-QKV family, bad mode / missing means or corrupt prompts, ``means`` with a
            mode other than ``"mean"`` or ``corrupt`` with one other than ``"patch"`` (they would be ignored).
        LayerOutOfRangeError, TargetIndexError: bad targets. ShapeError: clean/corrupt shapes (or numbers of
            prompts) differ, means of the wrong width (from the run: per-position means of another length than the
            prompts, or means that do not broadcast to the edited values). ArgumentError: ``freeze`` not a bool,
            ``groups_per_trace`` not an int ``>= 1``, ``positions`` not valid for the prompts
            (:func:`~.interventions.check_positions`). All raised before the model runs. ArgumentError (from the
            run): ``positions`` out of range of prompts given as lists or texts; ``positions`` (or, for the default
            metric, the last position) that are padding in some row, clean and corrupt prompts padded
            differently (:mod:`..envoy.padding`).
        ArgumentError: ``clean`` / ``corrupt`` nnsight cannot batch, or holding an id outside the model's vocabulary
            or more tokens than its learned positions (:func:`~.interventions.check_prompts`).

    Source: Lorsa paper (He et al. 2025) §6; Wang et al. 2023, *Interpretability in the Wild*.
    """
    refuse_inside_trace("path_patching")
    check_replacement_model(replacement, "path_patching")
    if not isinstance(freeze, bool):
        raise ArgumentError(f"path_patching: freeze must be a bool, got {freeze!r}")
    if not is_int(groups_per_trace) \
            or groups_per_trace < 1:
        raise ArgumentError(f"path_patching: groups_per_trace must be an int >= 1, got {groups_per_trace!r}")
    seq = int(clean.shape[-1]) if isinstance(clean, torch.Tensor) and clean.dim() >= 1 else 2**62
    check_positions(positions, seq)  # the prompts' length where known (token ids), else the types only
    for name, given in (("senders", senders), ("receivers", receivers)):
        if isinstance(given, (Target, HeadInput, str)) or not isinstance(given, Sequence):
            raise ConfigMismatchError(f"path_patching: {name} must be a list (or tuple) of them, got {given!r}")
    groups: list[tuple[Target, ...]] = [
        tuple(replacement.sort(g)) if isinstance(g, (list, tuple)) else (g,) for g in senders  # type: ignore[misc]
    ]
    if not groups or any(not g for g in groups):
        raise ConfigMismatchError("path_patching needs at least one sender, and no empty sender group")
    recv = list(receivers)
    _check(replacement, groups, recv, mode, means, clean, corrupt, freeze)
    lorsa_layers, features = _call_splices(groups, recv)
    score = make_metric(metric, correct_ids, incorrect_ids)
    clean_m: torch.Tensor | None = None
    corrupt_m: torch.Tensor | None = None
    rounding = torch.finfo(torch.float32).eps
    patched: list[torch.Tensor] = []
    with torch.no_grad():
        for start in range(0, len(groups), groups_per_trace):
            chunk = groups[start:start + groups_per_trace]
            logits = _run_chunk(replacement, chunk, recv, clean, corrupt, mode, means, positions, freeze,
                                lorsa_layers, features, metric is None)
            if clean_m is None:
                clean_m = score(logits["clean"])
                corrupt_m = score(logits["corrupt"]) if "corrupt" in logits else None
                rounding = metric_rounding(logits["clean"])
            patched += [score(x) for x in logits["patched"]]
    assert clean_m is not None
    return PathPatchingResult(groups, recv, clean_m, corrupt_m, torch.stack(patched), rounding)


def _run_chunk(replacement: ReplacementModel, groups: list[tuple[Target, ...]], receivers: list[HeadInput], clean: Any,
               corrupt: Any, mode: str, means: Any, positions: Positions, freeze: bool, lorsa_layers: set[int],
               features: list[Feature], default_metric: bool) -> dict[str, Any]:
    plan = _Plan(replacement, groups, receivers, freeze, lorsa_layers)
    model = replacement.model
    # invoke roles: A clean (source of frozen values), B corrupt (source of sender values),
    # C_i sender-patched clean run, D_i receiver-patched clean run
    roles: list[tuple[str, int]] = [("A", -1)]
    if mode == "patch":
        roles.append(("B", -1))
    roles += [("C", i) for i in range(len(groups))]
    if receivers:
        roles += [("D", i) for i in range(len(groups))]
    frozen_by = [set(fs) for fs in plan.freeze_sites]
    sender_by = [dict.fromkeys(ss) for ss in plan.sender_sites]
    recv_sites = set(plan.receiver_sites)
    recv_idx = [_receiver_index(replacement, r) for r in receivers]
    sender_idx = [[index_at(_cols(replacement, t), positions) for t in g] for g in groups]
    out: dict[str, Any] = {"patched": [None] * len(groups)}
    saved: list[torch.Tensor] = []
    shared: dict[Any, Any] = {}  # values handed between invokes (keyed by role/site)
    masks: dict[str, Any] = {}  # the clean and corrupt prompts' padding (padding.padding_mask)
    with model.trace() as tracer:
        barriers = [tracer.barrier(len(roles)) for _ in plan.sites]
        for role, gi in roles:
            prompts = corrupt if role == "B" else clean
            with tracer.invoke(prompts):
                if role in ("A", "B"):  # first: the model's inputs
                    masks[role] = nnsight.save(check_padded_positions(replacement, positions,
                                                                      default_metric and role == "A"))
                elif role == "C" and mode == "mean":  # noted for means_at (per-position means on padding)
                    padding_mask(replacement.model)
                _splice_all(replacement, lorsa_layers, features)  # every invoke: a splice replaces its callers' rows
                for site, barrier in zip(plan.sites, barriers, strict=True):
                    _before(role, gi, site, plan, shared, groups, sender_idx, frozen_by, sender_by, recv_sites)
                    barrier()
                    _after(role, gi, site, plan, shared, groups, sender_idx, frozen_by, sender_by, receivers,
                           recv_idx, mode, means)
                saved.append(saved_logits(replacement))
    if "B" in masks:
        check_same_padding(masks["A"], masks["B"], "path_patching")
    for (role, gi), logits in zip(roles, saved, strict=True):
        if role == "A":
            out["clean"] = logits
        elif role == "B":
            out["corrupt"] = logits
        elif role == "D" or not receivers:
            out["patched"][gi] = logits
    return out


def _before(role: str, gi: int, site: _Site, plan: _Plan, shared: dict, groups: list[tuple[Target, ...]],
            sender_idx: list[list[tuple]], frozen_by: list[set], sender_by: list[dict], recv_sites: set) -> None:
    """Reads an invoke makes at ``site`` before the barrier (values other invokes consume)."""
    if role == "A":
        if any(site in f for f in frozen_by):
            shared[("A", site)] = plan.tensor(site).clone()
    elif role == "B":
        for g, sites, idxs in zip(groups, plan.sender_sites, sender_idx, strict=True):
            for t, s, idx in zip(g, sites, idxs, strict=True):
                if s == site and ("B", t) not in shared:
                    shared[("B", t)] = plan.tensor(site)[idx].clone()
    elif role == "C" and site in recv_sites:
        shared[("C", gi, site)] = plan.tensor(site).clone()


def _after(role: str, gi: int, site: _Site, plan: _Plan, shared: dict, groups: list[tuple[Target, ...]],
           sender_idx: list[list[tuple]], frozen_by: list[set], sender_by: list[dict], receivers: list[HeadInput],
           recv_idx: list[tuple], mode: str, means: Any) -> None:
    """Edits (and receiver reads) an invoke makes at ``site`` after the barrier."""
    if role == "C":
        if site in frozen_by[gi]:  # first the clean value, then (a sender layer's per-head site) the senders
            plan.tensor(site)[:] = shared[("A", site)]
        if site in sender_by[gi]:
            tensor = plan.tensor(site)
            for t, s, idx in zip(groups[gi], plan.sender_sites[gi], sender_idx[gi], strict=True):
                if s != site:
                    continue
                if mode == "patch":
                    tensor[idx] = shared[("B", t)]
                elif mode == "zero":
                    tensor[idx] = 0
                else:  # a per-position mean at the edited positions, checked as ablate checks it
                    b = Bound(t, plan.replacement)
                    tensor[idx] = like(_value(b, means_at(b, means[t], idx[1], int(tensor.shape[1])), tensor[idx],
                                              "means"), tensor)
    elif role == "D" and site in plan.receiver_sites:
        tensor = plan.tensor(site)
        src = shared[("C", gi, site)]
        for s, idx in zip(plan.receiver_sites, recv_idx, strict=True):
            if s == site:
                tensor[idx] = src[idx]
