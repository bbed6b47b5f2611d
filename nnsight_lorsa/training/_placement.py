"""Where training tensors live: the trained module's device and dtype, the model's device.

Rules the training code follows (issue 21): every tensor it creates takes its device from an
argument or an existing tensor; activations are converted to the module's device and dtype at the
module boundary (:func:`to_module`); losses and metrics are computed in fp32 (:func:`f32`);
host-side bookkeeping that stays on the CPU says so (``device="cpu"``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..errors import PlacementError


def module_placement(module: torch.nn.Module, what: str | None = None) -> tuple[torch.device, torch.dtype]:
    """``(device, dtype)`` of ``module``'s floating-point parameters.

    Raises:
        PlacementError: a parameter is on ``meta`` (never materialised), or the parameters are on
            several devices; the message names the module and the parameters' devices.
    """
    name = what or type(module).__name__
    params = [(n, p) for n, p in module.named_parameters() if p.is_floating_point()]
    if not params:
        raise PlacementError(f"{name} has no floating-point parameters to train")
    meta = [n for n, p in params if p.is_meta]
    if meta:
        raise PlacementError(f"{name}: parameters {meta[:3]} are on the meta device (not materialised); "
                             "build the module on a real device (or call to_empty(device=…) and initialise it)")
    devices = {p.device for _, p in params}
    if len(devices) > 1:
        where = {n: str(p.device) for n, p in params}
        raise PlacementError(f"{name}: parameters on several devices {where}; move the module to one device")
    return params[0][1].device, params[0][1].dtype


def model_device(model: Any) -> torch.device:
    """The device of an nnsight (or HF) model's first parameter (where its input ids must go). An
    nnsight model not dispatched yet (weights on ``meta``) is dispatched first, as its first trace would.

    Raises:
        PlacementError: the model's parameters are still on ``meta`` (it cannot be dispatched).
    """
    hf = getattr(model, "_module", model)
    p = next(iter(hf.parameters()), None)
    if p is not None and p.is_meta and callable(getattr(model, "dispatch", None)) \
            and not getattr(model, "dispatched", True):
        model.dispatch()
        hf = getattr(model, "_module", model)
        p = next(iter(hf.parameters()), None)
    if p is None:
        return torch.device("cpu")
    if p.is_meta:
        raise PlacementError(f"the model {type(hf).__name__} is on the meta device: dispatch it (load its "
                             "weights) before reading activations")
    return p.device


def f32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least fp32 (fp16 / bf16 upcast; fp32 and fp64 unchanged): for losses and metrics."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def to_module(batch: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """A copy of a :class:`~.activations.Batch` on ``device``: ``x`` / ``y`` also cast to ``dtype``
    (an SAE batch's shared ``y is x`` stays shared), masks and positions moved only. The batch itself
    when nothing changes."""
    x = batch.x.to(device=device, dtype=dtype)
    y = x if batch.y is batch.x else batch.y.to(device=device, dtype=dtype)
    fields: dict[str, Any] = {"x": x, "y": y}
    for name in ("loss_mask", "positions", "attn_mask"):
        value = getattr(batch, name, None)
        fields[name] = value.to(device) if isinstance(value, torch.Tensor) else value
    if all(fields[k] is getattr(batch, k, None) for k in fields):
        return batch
    return dataclasses.replace(batch, **fields)
