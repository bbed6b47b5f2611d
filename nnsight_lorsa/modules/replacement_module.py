"""What every replacement module (Lorsa, SAE, transcoder, cross-layer transcoder) shares as a module.

:class:`ReplacementModule` is the base of :class:`~.lorsa.Lorsa`, :class:`~.sparse_coder.SparseCoder` (SAEs,
transcoders), :class:`~.clt.CrossLayerTranscoder` and its per-layer view :class:`~.clt.CLTLayer`. Its one
member, :attr:`~ReplacementModule.weights_owner`, is the module whose parameters a module computes with:
itself, except for a view, which reads another module's weights (a ``CLTLayer`` its CLT's). Placement and
offload (:mod:`nnsight_lorsa._placement`: ``resident``, ``offloaded``, ``placement``) act on the owner, so
that a view is fetched, placed and counted as the one module it reads. Needs torch only.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .._checks import check_instance
from .._placement import check_placement_args


def check_construction(cfg: Any, kind: type, device: Any, dtype: Any, where: str) -> None:
    """A replacement module's constructor arguments, before any tensor is made: ``cfg`` a ``kind`` (a dict is
    read with ``kind.from_dict``), ``device`` / ``dtype`` as every loader takes them.

    Raises:
        ArgumentError: ``cfg`` not a ``kind``; a dtype other than fp16 / bf16 / fp32 / fp64 (``float``, ``"bf16"``,
            an integer dtype), a device that is not one. PlacementError: a device this machine lacks. Each was
            torch's ``TypeError`` / ``RuntimeError`` / ``AssertionError`` from the first ``torch.empty``.

    Source: ours (the base every replacement module shares).
    """
    check_instance(cfg, kind, where, "cfg", f" ({kind.__name__}(...); a dict: {kind.__name__}.from_dict(d))")
    check_placement_args(device, dtype, where)


class ReplacementModule(nn.Module):
    """An ``nn.Module`` that replaces (or approximates) a model's sub-computation; see the module docstring.

    Source: ours (the base every replacement module shares).
    """

    @property
    def weights_owner(self) -> nn.Module:
        """The module that holds the weights this one computes with (its parameters, its offload marker):
        ``self``; a view (:class:`~.clt.CLTLayer`) returns the module it reads.

        Source: ours (the base every replacement module shares).
        """
        return self
