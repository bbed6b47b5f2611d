"""Which logits a graph is attributed from: the one ``targets`` setting of :func:`.attribute.attribute`.

In the spirit of circuit-tracer 0.5's ``attribution_targets`` (``circuit_tracer/attribution/targets.py``:
None auto-selects the salient logits, a tensor names vocabulary ids, a sequence of strings is tokenized),
but one value says everything — circuit-tracer keeps ``max_n_logits`` / ``desired_logit_prob`` beside it,
here the top-logit policy is itself a value (:class:`LogitTargets`):

* ``None`` (default): ``LogitTargets()`` — the most likely tokens at the last position until their
  cumulative probability reaches 0.95, at most 10 (circuit-tracer's defaults);
* ``LogitTargets(max_n=..., cumulative_prob=...)``: that policy with other bounds;
* a sequence of token ids (or a 0-/1-D integer tensor): those tokens, in that order;
* a sequence of strings: each one token of the model's tokenizer (``" Paris"``), in that order.

Circuit-tracer's custom targets (a label, a probability and a free unembedding direction) are not taken:
every target here is a vocabulary logit, whose demeaned value its incoming edges sum to. torch only.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from .._placement import is_index_dtype
from ..envoy.tokens import tokenizer_of
from ..errors import ArgumentError, ConfigMismatchError, NonFiniteError
from .graph import HOST

#: the old three settings of :func:`.attribute.attribute` and how ``targets=`` says each (refused, not aliased)
RENAMED = {
    "logit_tokens": "targets=[id, ...] (or targets=[' token', ...])",
    "desired_logit_prob": "targets=LogitTargets(cumulative_prob=...)",
    "max_n_logits": "targets=LogitTargets(max_n=...)",
}


@dataclass(frozen=True)
class LogitTargets:
    """The top-logit policy of ``attribute(..., targets=...)``: the most likely next tokens (softmax of the
    last position's logits, in fp32 on the host), most likely first, until their cumulative probability
    reaches ``cumulative_prob`` — at least one, at most ``max_n``. ``LogitTargets()`` is the default (``targets=None``):
    circuit-tracer's ``max_n_logits=10``, ``desired_logit_prob=0.95``.

    Raises:
        ArgumentError: ``max_n`` not an int, ``cumulative_prob`` not a number.
        ConfigMismatchError: ``max_n < 1``, ``cumulative_prob`` outside ``(0, 1]`` (NaN included).

    Source: circuit-tracer ``circuit_tracer/attribution/targets.py``.
    """

    max_n: int = 10
    cumulative_prob: float = 0.95

    def __post_init__(self) -> None:
        n, p = self.max_n, self.cumulative_prob
        if not isinstance(n, int) or isinstance(n, bool):
            raise ArgumentError(f"LogitTargets(max_n=...) (attribute's targets=) must be an int, got {n!r}")
        if n < 1:
            raise ConfigMismatchError(f"LogitTargets(max_n=...) (attribute's targets=) must be >= 1, got {n}")
        if not isinstance(p, (int, float)) or isinstance(p, bool):
            raise ArgumentError(f"LogitTargets(cumulative_prob=...) (attribute's targets=) must be a number, "
                                f"got {p!r}")
        if math.isnan(p) or not 0.0 < p <= 1.0:
            raise ConfigMismatchError(f"LogitTargets(cumulative_prob=...) (attribute's targets=) must be in (0, 1], "
                                      f"got {p!r}")


#: the default policy (``targets=None``): circuit-tracer's top logits to 0.95, at most 10
TOP_LOGITS = LogitTargets()
#: what ``attribute(..., targets=...)`` takes (the module docstring); checked by :func:`check_targets`
Targets: TypeAlias = LogitTargets | Sequence[int] | Sequence[str] | torch.Tensor | None
#: a checked ``targets``: the policy, or the tokens as a tuple of ids or of strings
CheckedTargets: TypeAlias = LogitTargets | tuple[int, ...] | tuple[str, ...]


def check_targets(targets: Any) -> CheckedTargets:
    """``targets`` (:data:`Targets`) checked and made hashable: ``None`` → ``LogitTargets()``, ids (a sequence or
    an integer tensor or numpy array of at most one dimension, on any device) → a tuple of ints, strings → a
    tuple of strings.
    The ids' upper bound (the vocabulary) is checked with the logits (:func:`target_logits`), the strings by
    the tokenizer (:func:`token_ids`).

    Raises:
        ArgumentError: a value of another type: a bare string (one target is ``[" Paris"]``), a number, a
            tensor that is not integer or has 2+ dimensions, a sequence mixing kinds or holding floats / bools.
        ConfigMismatchError: no tokens, a negative id, an empty string, a token named twice
            (:func:`refuse_repeated`).
    """
    if targets is None:
        return TOP_LOGITS
    if isinstance(targets, LogitTargets):
        return targets
    if isinstance(targets, str):
        raise ArgumentError(f"attribute(targets={targets!r}) is one string: targets are a sequence "
                            f"([{targets!r}]), ids ([id, ...]), a LogitTargets(...) or None")
    if hasattr(targets, "__array__") and not isinstance(targets, (torch.Tensor, Sequence)):  # a numpy array
        try:
            targets = torch.as_tensor(targets, device="cpu")  # token ids: a host-side list
        except (TypeError, ValueError, RuntimeError) as e:
            raise ArgumentError(f"attribute(targets=<array>) must hold integer token ids, got {targets!r}: {e}") from e
    if isinstance(targets, torch.Tensor):
        if not is_index_dtype(targets.dtype) or targets.dim() > 1:
            raise ArgumentError(f"attribute(targets=<tensor>) must hold integer token ids in at most one dimension, "
                                f"got dtype {targets.dtype}, shape {tuple(targets.shape)}")
        targets = targets.reshape(-1).tolist()
    if not isinstance(targets, Sequence):
        raise ArgumentError(f"attribute(targets=...) must be None, a LogitTargets(...), token ids or token strings, "
                            f"got a {type(targets).__name__}: {targets!r}")
    items = tuple(targets)
    if not items:
        raise ConfigMismatchError("attribute(targets=[]) names no logit tokens: pass at least one, or None for the "
                                  "top logits")
    if all(isinstance(t, str) for t in items):
        if not all(items):
            raise ConfigMismatchError(f"attribute(targets={list(items)!r}): an empty string is no token")
        return refuse_repeated(items, items)
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in items):
        raise ArgumentError(f"attribute(targets=...) must be all integer token ids or all token strings, "
                            f"got {list(items)!r}")
    items = tuple(int(t) for t in items)  # numpy integers too
    if min(items) < 0:
        raise ConfigMismatchError(f"attribute(targets=...): logit tokens must be ids >= 0, got {list(items)}")
    return refuse_repeated(items, items)


def refuse_repeated(items: tuple, named: tuple) -> tuple:
    """``items`` (token ids or strings) unless one is there twice: two logit nodes of one token, whose influence
    pruning and a feature budget would weigh twice and whose export would hold two nodes of one ``node_id``.
    ``named``: the targets as the call gave them (for the message).

    Raises:
        ConfigMismatchError: a token named twice (or, for ``named`` strings, two strings of one token).
    """
    seen: dict[Any, int] = {}
    for i, t in enumerate(items):
        if t in seen:
            raise ConfigMismatchError(f"attribute(targets={list(named)!r}): token {t!r} is named twice "
                                      f"({named[seen[t]]!r} and {named[i]!r}); each logit target once")
        seen[t] = i
    return items


def token_ids(targets: CheckedTargets, model: Any) -> LogitTargets | tuple[int, ...]:
    """``targets`` with its strings turned into ids by ``model``'s tokenizer (``encode(s,
    add_special_tokens=False)``); the policy and ids as they are. circuit-tracer keeps the last token of a
    multi-token string (with a warning); here a target is one token or refused.

    Raises:
        ConfigMismatchError: a string that is not exactly one token (its ids in the message); two strings of
            one token (:func:`refuse_repeated`).
        MissingTokenizerError: strings for a model without a tokenizer.
    """
    if isinstance(targets, LogitTargets) or not any(isinstance(t, str) for t in targets):
        return targets  # type: ignore[return-value]
    tokenizer = tokenizer_of(model, "attribute(targets=[<token string>, ...])")
    ids = []
    for s in targets:
        got = list(tokenizer.encode(s, add_special_tokens=False))
        if len(got) != 1:
            raise ConfigMismatchError(f"attribute(targets=[..., {s!r}, ...]): {s!r} is {len(got)} tokens {got} of the "
                                      f"model's tokenizer; a logit target is one token")
        ids.append(int(got[0]))
    return refuse_repeated(tuple(ids), tuple(targets))


def target_logits(logits: torch.Tensor, targets: LogitTargets | tuple[int, ...], *,
                  final: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The target tokens ``(k,)`` int64 and their probabilities ``(k,)`` fp32 (both on the host) at the last
    position, from its ``(vocab,)`` logits (the unembedding's output): :class:`LogitTargets`' top tokens, or the
    given ids in order. ``final``: the model's logits from the unembedding's output
    (:meth:`~nnsight_lorsa.adapters.base.ArchitectureAdapter.final_logits`; Gemma-2 soft-caps them, applied to
    ``logits`` in their own dtype, as the model does): the probabilities are those of the logits the model outputs
    (same order of tokens), computed in fp32.

    Raises:
        ConfigMismatchError: an id outside ``[0, vocab)``.
        NonFiniteError: the logits hold NaN or inf (an fp16 model's logits past 65504 are inf): every edge and
            probability of the graph would be NaN.
    """
    host = logits.detach().to(HOST, torch.float32)
    final_host = host if final is None else final(logits.detach()).to(HOST, torch.float32)  # capped in its dtype
    if not bool(torch.isfinite(host).all()):
        raise NonFiniteError(f"attribute: the model's logits at the attributed position hold NaN or inf "
                             f"({int((~torch.isfinite(host)).sum())} of {host.numel()}, computed in {logits.dtype}; "
                             "an fp16 model's logits past 65504 are inf): the graph's edges and target probabilities "
                             "would be NaN; attribute the model in a wider dtype (torch.bfloat16 or torch.float32)",
                             tensor="logits")
    probs = final_host.softmax(-1)
    if not isinstance(targets, LogitTargets):
        ids = torch.tensor(targets, dtype=torch.long, device=HOST)
        if int(ids.max()) >= probs.numel():
            raise ConfigMismatchError(f"attribute(targets=...): logit tokens must be ids in [0, {probs.numel()}) "
                                      f"(the model's vocabulary), got {ids.tolist()}")
        return ids, probs[ids]
    p, ids = probs.sort(descending=True)
    n = int((p.cumsum(0) < targets.cumulative_prob).sum()) + 1
    n = max(1, min(n, targets.max_n))
    return ids[:n], p[:n]
