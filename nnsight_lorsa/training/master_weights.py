"""fp32 master weights for low-precision parameters (mixed-precision training), the one mechanism of both
trainers: :class:`~.trainer.Trainer` (bf16 modules) and the sparse-attention trainer
(:class:`~..sparse_attention.train.SparseAttentionTrainer`, bf16 / fp16 models).

A module trained in bf16 or fp16 keeps its weights in that dtype for the forward and backward (activations and
memory stay low-precision); each such parameter ``p`` gets an fp32 master ``m``, and the optimizer steps the
masters (its moments are fp32 too). After the backward, :meth:`MasterWeights.move_grads` hands each gradient to
its master (widened to fp32); after the step, the module's weight is the master rounded once
(:meth:`MasterWeights.round_`). Without masters an update below half a bf16 step of a weight (relative
``2^-9``) rounds away: at ``lr=1e-4`` only a fifth of a bf16 SAE's entries move at all in 5 steps.

Whatever else writes weights in place during training (a decoder-norm constraint, a dead-latent remedy, an
initialisation that needs the scale factors, the scale-factor fold) runs inside :meth:`MasterWeights.editing`:
there the module holds each fp32 master in its parameter's place, so the edit acts on the masters in fp32, and on
leaving the module's weights are the masters rounded once.

Buffers that training updates by an estimate rather than a gradient (a module's ``trained_buffers``: BatchTopK's
inference threshold, an EMA of rate ``threshold_lr``) get an fp32 master too (:meth:`MasterWeights.add_buffers`):
while the loss runs (:meth:`MasterWeights.estimating`) the module holds it in the buffer's place, and the buffer is
then its rounding. In bf16 an EMA step below half a bf16 step of the estimate (``threshold_lr · |Δ| < 2^-9 θ``:
batch minima within 20 % of ``θ``) rounds away, and the threshold stalls (until 2026-11-27: a bf16 BatchTopK's
threshold stayed at 1.0 where the batches' smallest kept activation moved to 1.15; fp16: 1.10). Since then the
module's own update is exact too (a bf16 BatchTopK keeps an fp32 running estimate beside its buffer, not in its state
dict); the master is what the trainer's checkpoints save, restores on a refused step and broadcasts under DDP.

Memory per trained parameter: bf16 weight 2 B + fp32 master 4 B + two fp32 Adam moments 8 B = 14 B (without
masters: 2 + 4 = 6 B, the moments in bf16); fp32 training needs 4 + 8 = 12 B. Gradients come on top: 4 B on
the masters (as in fp32 training; 2 B without masters), and the bf16 gradient (2 B) until
:meth:`MasterWeights.move_grads`. Parameters in fp32 or fp64 get no master (they are their own).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import nn

ModuleT = TypeVar("ModuleT", bound=nn.Module)

#: the dtypes whose parameters get an fp32 master (below fp32's precision)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def _trained_buffers(module: nn.Module) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
    """``(submodule, name, buffer)`` of each buffer that ``module``'s submodules list in ``trained_buffers`` and
    hold (updated by the training forward in place: BatchTopK's threshold)."""
    for sub in module.modules():
        for name in getattr(sub, "trained_buffers", ()):
            buf = sub._buffers.get(name)
            if buf is not None:
                yield sub, name, buf


class MasterWeights:
    """fp32 masters of the low-precision (:data:`LOW_PRECISION`) parameters among ``params``.

    Args:
        params: the trained parameters (any order; repeats are kept once). Masters are fp32 copies on each
            parameter's device, made now from its current values.
        enabled: False: no masters at all (every parameter is its own, as in plain low-precision training).

    Every method takes the module's parameters as they are (the objects ``module.parameters()`` yields);
    a parameter without a master stands for itself.
    """

    def __init__(self, params: Iterable[nn.Parameter], enabled: bool = True) -> None:
        self._pairs: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
        #: id(buffer) -> (owner module, buffer name, buffer, fp32 master): :meth:`add_buffers`
        self._buffers: dict[int, tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = {}
        self._enabled = enabled
        if not enabled:
            return
        for p in params:
            if p.dtype in LOW_PRECISION and id(p) not in self._pairs:
                self._pairs[id(p)] = (p, nn.Parameter(p.detach().to(torch.float32), requires_grad=p.requires_grad))

    def add_buffers(self, module: nn.Module) -> None:
        """Give each low-precision buffer that ``module``'s submodules list in ``trained_buffers`` an fp32 master
        (none when disabled, or for fp32 / fp64 / integer buffers)."""
        if not self._enabled:
            return
        for sub, name, buf in _trained_buffers(module):
            if buf.dtype in LOW_PRECISION:
                self._buffers[id(buf)] = (sub, name, buf, buf.detach().to(torch.float32))

    @contextmanager
    def estimating(self, module: nn.Module) -> Iterator[None]:
        """Inside, each buffer with a master is replaced by its fp32 master (an estimate updated in the forward is
        updated in fp32); on leaving (also on an error) the buffers are put back, holding the masters rounded."""
        swapped = []
        try:
            for sub, name, buf, master in self._buffers.values():
                if sub._buffers.get(name) is buf:
                    sub._buffers[name] = master
                    swapped.append((sub, name, buf, master))
            yield
        finally:
            with torch.no_grad():
                for sub, name, buf, master in swapped:
                    sub._buffers[name] = buf
                    buf.copy_(master)

    def named_buffers(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """``{name: master}`` of ``module``'s buffers that have one (saved with the parameters' masters)."""
        return {name: self._buffers[id(b)][3] for name, b in module.named_buffers() if id(b) in self._buffers}

    @torch.no_grad()
    def set_buffer(self, buf: torch.Tensor, value: torch.Tensor) -> None:
        """Set a buffer's training value: its master (fp32) and the buffer as its rounding; a buffer without a
        master takes ``value`` cast to its dtype."""
        entry = self._buffers.get(id(buf))
        if entry is not None:
            entry[3].copy_(value.to(device=entry[3].device, dtype=entry[3].dtype))
            value = entry[3]
        buf.copy_(value.to(device=buf.device, dtype=buf.dtype))

    def estimates(self, module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[(tensor, copy)]`` of every buffer ``module``'s submodules list in ``trained_buffers`` (any dtype; with
        its master, if any): what a forward in training mode changes in place, for :meth:`restore_estimates` when the
        step is refused."""
        out = []
        for _, _, buf in _trained_buffers(module):
            out.append((buf, buf.detach().clone()))
            if id(buf) in self._buffers:
                master = self._buffers[id(buf)][3]
                out.append((master, master.detach().clone()))
        return out

    @torch.no_grad()
    def restore_estimates(self, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put back what :meth:`estimates` copied."""
        for tensor, value in saved:
            tensor.copy_(value)

    def buffer_masters(self) -> list[torch.Tensor]:
        """The buffers' fp32 masters (:meth:`add_buffers`), in the order they were added."""
        return [entry[3] for entry in self._buffers.values()]

    @torch.no_grad()
    def round_buffers_(self) -> None:
        """Every buffer with a master becomes its master rounded to its dtype (after the masters were set)."""
        for _, _, buf, master in self._buffers.values():
            buf.copy_(master)

    def has_buffer(self, buf: torch.Tensor) -> bool:
        """Whether buffer ``buf`` has an fp32 master."""
        return id(buf) in self._buffers

    def __len__(self) -> int:
        """The number of parameters with a master."""
        return len(self._pairs)

    def has(self, p: torch.Tensor) -> bool:
        """Whether ``p`` has an fp32 master."""
        return id(p) in self._pairs

    def held(self, p: nn.Parameter) -> nn.Parameter:
        """What the optimizer steps for ``p``: its fp32 master (same shape and device), or ``p`` itself."""
        pair = self._pairs.get(id(p))
        return p if pair is None else pair[1]

    def optimized(self, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """``[held(p) for p in params]``: the parameter list to give the optimizer."""
        return [self.held(p) for p in params]

    def move_grads(self) -> None:
        """After the backward: each master's gradient is its parameter's, widened to fp32 (None stays None);
        the parameter's own gradient is dropped (its memory freed)."""
        for p, m in self._pairs.values():
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None

    @torch.no_grad()
    def round_(self) -> None:
        """After the optimizer step: every parameter becomes its master rounded to its dtype (round to nearest)."""
        for p, m in self._pairs.values():
            p.copy_(m)

    @contextmanager
    def editing(self, module: nn.Module) -> Iterator[None]:
        """Inside, ``module`` (and its submodules) holds each master in its parameter's place (``module.W_dec`` is
        the fp32 master): in-place edits of the module's weights (``module.W_dec.div_(...)``, ``module.b_V[idx] =
        ...``) and anything computed from them act on the masters in fp32. On leaving (also on an error) the
        parameters are put back, holding the masters rounded once. No gradient is recorded inside. Buffers with a
        master (:meth:`add_buffers`) are held as in :meth:`estimating` (an edit of BatchTopK's ``θ`` reaches it).

        The parameters themselves are not touched until then (their tensors, hooks and gradient accumulators —
        DDP's — stay as they are; swapping their ``.data`` to another dtype would drop DDP's hooks)."""
        swapped: list[tuple[dict[str, nn.Parameter | None], str, nn.Parameter]] = []
        with torch.no_grad(), self.estimating(module):  # buffers with masters hold them too
            try:
                for sub in module.modules():
                    for name, p in sub._parameters.items():
                        if p is not None and id(p) in self._pairs:
                            swapped.append((sub._parameters, name, p))
                            sub._parameters[name] = self._pairs[id(p)][1]
                yield
            finally:
                for params, name, p in swapped:
                    params[name] = p
                self.round_()

    def rounded_copy(self, module: ModuleT) -> ModuleT:
        """A deep copy of ``module`` made inside :meth:`editing` (its parameters the fp32 masters) in which each
        master is its parameter's dtype again, rounded once (``master.to(dtype)``, one parameter at a time): no fp32
        copy of the module is made (a fold, :func:`~.objective_base.fold_rows`, then writes its rows into it).
        Buffers are copied as they are (a buffer's fp32 master as held inside ``editing``); no gradients."""
        low = {id(m): p.dtype for p, m in self._pairs.values()}
        memo: dict[int, object] = {}
        for q in module.parameters():
            if id(q) in low:
                memo[id(q)] = nn.Parameter(q.detach().to(low[id(q)]), requires_grad=q.requires_grad)
        return copy.deepcopy(module, memo)

    def named(self, module: nn.Module) -> dict[str, nn.Parameter]:
        """``{name: master}`` of ``module``'s parameters that have one (what a checkpoint saves)."""
        return {name: self._pairs[id(p)][1] for name, p in module.named_parameters() if id(p) in self._pairs}

    @torch.no_grad()
    def set_(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Set ``p``'s training value to ``value`` (any float dtype, any device): its master (fp32) and then
        ``p`` as the master rounded; a parameter without a master takes ``value`` cast to its dtype."""
        target = self.held(p)
        target.copy_(value.to(device=target.device, dtype=target.dtype))
        if target is not p:
            p.copy_(target)

    def masters(self) -> list[nn.Parameter]:
        """The fp32 masters, in the order their parameters were given."""
        return [m for _, m in self._pairs.values()]
