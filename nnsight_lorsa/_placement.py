"""Where tensors live: the device and dtype rules of the patching, analysis, viz and sparse-attention code.

* Every tensor the package creates takes its device (and dtype) from an argument or an existing tensor.
* Small host-side tables (results, counters, top-k tables) are created on the CPU and say so.
* A computation that mixes a replacement module (Lorsa, SAE, transcoder) with model activations runs on
  the module's device in fp32 (:func:`placement` + ``x.to(device, torch.float32)``), and hands the module
  its input in the module's own dtype (:func:`to_module`): a bf16 model with an fp32 Lorsa works, and so
  does the reverse.
* Metrics and results read out of a trace go to the host in fp32 (:func:`host_f32`), so that they compare
  with values computed anywhere and do not depend on the model's device.

A module whose parameters were never materialised (``meta``) cannot compute anything:
:class:`~nnsight_lorsa.errors.PlacementError` names it.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import PlacementError

#: the device of host-side tables (results, counters, top-k tables)
HOST = torch.device("cpu")


def placement(module: Any, name: str) -> tuple[torch.device, torch.dtype]:
    """``(device, dtype)`` of ``module``'s first floating-point parameter (``module`` a ``nn.Module`` or a
    tensor).

    Raises:
        PlacementError: the module has no parameters, or they are on the ``meta`` device.
    """
    if isinstance(module, torch.Tensor):
        t: torch.Tensor | None = module
    else:
        params = list(module.parameters()) if hasattr(module, "parameters") else []
        t = next((p for p in params if p.is_floating_point()), params[0] if params else None)
    if t is None:
        raise PlacementError(f"{name} ({type(module).__name__}) has no parameters to place a computation on")
    if t.device.type == "meta":
        raise PlacementError(f"{name} ({type(module).__name__}) is on the meta device (its weights were never "
                             "loaded): move it to the model's device, e.g. module.to('cuda'), before using it")
    return t.device, t.dtype


def to_module(x: torch.Tensor, module: Any, name: str) -> torch.Tensor:
    """``x`` moved to ``module``'s device and cast to its dtype (the input a module's forward accepts)."""
    device, dtype = placement(module, name)
    return x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)


def host_f32(x: Any) -> torch.Tensor:
    """``x`` (a tensor on any device, or a number) as a detached fp32 tensor on the CPU."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(device=HOST, dtype=torch.float32)
    return torch.as_tensor(x, dtype=torch.float32, device=HOST)


def like(value: Any, tensor: torch.Tensor) -> Any:
    """``value`` (a tensor, array or number) as a tensor on ``tensor``'s device in its dtype; Python
    numbers stay numbers (they mix with a tensor on any device)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    return torch.as_tensor(value).to(device=tensor.device, dtype=tensor.dtype)


__all__ = ["HOST", "host_f32", "like", "placement", "to_module"]
