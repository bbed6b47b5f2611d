"""The one place that touches private attributes of transformers models (and of ``torch.nn.Module``):
switching a model's attention implementation, and adding or taking off a child module by name.

Names used (pinned by ``tests/adapters/test_transformers_internals.py``, which fails naming the
transformers version that changed them):

- ``PreTrainedModel.set_attn_implementation(name)`` and ``_can_set_attn_implementation()``: switch every
  attention module of a model to a function registered with ``AttentionInterface``;
- ``PretrainedConfig._attn_implementation`` (the implementation in use, a property) and
  ``PretrainedConfig._attn_implementation_internal`` (its stored value: what ``save_pretrained``
  writes to ``config.json`` as ``_attn_implementation``… or omits);
- ``nn.Module._modules``: the children by name (a child is looked up there, not by ``getattr``, so an
  attribute of the same name that is not a module is never taken for it).

Callers: :mod:`nnsight_lorsa.sparse_attention` (installing gated attention, saving a gated model as a
dense Hugging Face directory) and the GPT-2 adapter (which scale the model's attention applies).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

from ..errors import UnsupportedArchitectureError

__all__ = ["attn_implementation", "child", "children_removed", "remove_child", "saved_attn_implementation",
           "set_attn_implementation"]


def attn_implementation(model_or_config: Any) -> str | None:
    """The attention implementation a transformers model (or its config, or a module holding ``config``)
    runs, e.g. ``"eager"``, ``"sdpa"``; None where the config does not say (transformers then uses eager)."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "_attn_implementation", None)


def set_attn_implementation(hf: Any, name: str) -> None:
    """Switch every attention module of ``hf`` to the implementation ``name`` (registered with
    transformers' ``AttentionInterface``, or a built-in one).

    Raises:
        UnsupportedArchitectureError: ``hf`` is not a transformers model, does not dispatch attention
            through ``AttentionInterface``, or refused ``name`` (each naming the model class).
    """
    setter = getattr(hf, "set_attn_implementation", None)
    if setter is None:
        raise UnsupportedArchitectureError(f"{type(hf).__name__} has no set_attn_implementation "
                                           "(not a transformers model)")
    can = getattr(hf, "_can_set_attn_implementation", lambda: True)
    if not can():
        raise UnsupportedArchitectureError(
            f"{type(hf).__name__} does not dispatch attention through transformers' AttentionInterface"
        )
    setter(name)
    if hf.config._attn_implementation != name:  # pragma: no cover - depends on transformers internals
        raise UnsupportedArchitectureError(f"{type(hf).__name__} refused attention implementation {name!r}")


@contextmanager
def saved_attn_implementation(hf: Any, name: str) -> Iterator[None]:
    """Inside the block, ``hf.config`` records ``name`` as its attention implementation (what
    ``save_pretrained`` writes), without switching the modules; restored on exit, also on error."""
    before = hf.config._attn_implementation
    hf.config._attn_implementation_internal = name
    try:
        yield
    finally:
        hf.config._attn_implementation_internal = before


def child(module: nn.Module, name: str) -> nn.Module | None:
    """``module``'s child module ``name``, or None (an attribute of that name that is not a child: None)."""
    return module._modules.get(name)


def remove_child(module: nn.Module, name: str) -> nn.Module:
    """Take the child ``name`` off ``module`` and return it.

    Raises:
        KeyError: ``module`` has no such child."""
    removed = module._modules.pop(name)
    if removed is None:
        raise KeyError(name)
    return removed


@contextmanager
def children_removed(modules: Sequence[nn.Module], name: str) -> Iterator[None]:
    """Inside the block, each of ``modules`` lacks its child ``name`` (e.g. so that ``save_pretrained``
    does not serialise it); every child is put back on exit, also on error. A module without that
    child is left as it is."""
    taken = [(m, m._modules.pop(name)) for m in modules if m._modules.get(name) is not None]
    try:
        yield
    finally:
        for m, c in taken:
            m._modules[name] = c
