"""Where tensors live: the one device and dtype rule of the package (splice, training, patching, analysis,
viz, sparse attention; attribution keeps its graph on :data:`HOST` too).

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

**Offload** (the field's term, from accelerate / DeepSpeed): an *offloaded* module (:func:`offloaded`, set by
``ReplacementSet.offload``) stores its weights on the host (pinned where CUDA is available:
:func:`store_on_host`) and computes on the device of the site it serves: for the span of one computation
:class:`resident` swaps its parameters and buffers for copies on that device (``non_blocking`` from pinned
memory) and puts the host tensors back after, so at most the module in use is on the device, and only
while it runs. For an offloaded module the rule above reads "runs on the site's device". A view of another
module's weights (a cross-layer transcoder's per-layer ``CLTLayer``) is placed, marked and made resident
through its ``weights_owner`` (:class:`~nnsight_lorsa.modules.replacement_module.ReplacementModule`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any

import torch

from .errors import ArgumentError, PlacementError

#: the device of host-side tables (results, counters, top-k tables)
HOST = torch.device("cpu")


#: the dtypes a module may be loaded in or cast to by argument (``dtype=``): its forward's matmuls run in them
#: on every device (integer, bool, complex and fp8 modules cannot compute)
MODULE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_index_dtype(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` can be token ids, positions or indices: an integer dtype (not floating, complex or
    bool), the one rule of every id check of the package."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_dtype_arg(dtype: Any, where: str) -> torch.dtype | None:
    """``dtype`` if it is None or one of :data:`MODULE_DTYPES` (a ``torch.dtype``; strings such as
    ``"bfloat16"`` are refused, not guessed); ``where`` names the call in the error.

    Raises:
        ArgumentError: anything else, naming the call and the dtypes it takes.
    """
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in MODULE_DTYPES):
        return dtype
    raise ArgumentError(f"{where}: dtype must be None or a floating torch.dtype (torch.float16, torch.bfloat16, "
                        f"torch.float32, torch.float64), got {dtype!r} ({type(dtype).__name__})")


def check_device_arg(device: Any, where: str) -> torch.device | None:
    """``device`` (None, a ``torch.device``, a string such as ``"cuda:1"``, or a CUDA index) as a
    ``torch.device`` that torch can put tensors on here (``meta`` included); ``where`` names the call.

    Raises:
        ArgumentError: not a device (``"nonsense"``, ``1.5``, ``True``).
        PlacementError: a device this machine lacks (``"cuda"`` without CUDA, a GPU index past the last).
    """
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise ArgumentError(f"{where}: device must be a torch.device, a string (cpu, cuda, cuda:1, meta) or a "
                            f"CUDA index, got {device!r} ({type(device).__name__})")
    try:
        d = torch.device(device)
    except RuntimeError as e:
        if isinstance(device, int):  # an accelerator index where torch sees no accelerator
            raise PlacementError(f"{where}: device={device!r} (cuda:{device}) is not available here: {e}") from None
        raise ArgumentError(f"{where}: device {device!r} is not a device (cpu, cuda, cuda:1, meta): {e}") from None
    try:
        torch.empty(0, device=d)
    except (RuntimeError, AssertionError, NotImplementedError) as e:  # torch's "not compiled with CUDA" is an assert
        raise PlacementError(f"{where}: torch cannot put tensors on {d} here (torch {torch.__version__}): "
                             f"{e}") from None
    return d


def check_placement_args(device: Any, dtype: Any, where: str) -> torch.device | None:
    """A loader's or trainer's ``device=`` / ``dtype=`` checked before anything is read or moved
    (:func:`check_dtype_arg`, :func:`check_device_arg`); returns the device as a ``torch.device`` (None stays None).

    Raises:
        ArgumentError: a dtype other than fp16 / bf16 / fp32 / fp64, or a device that is not one.
        PlacementError: a device this machine lacks."""
    check_dtype_arg(dtype, where)
    return check_device_arg(device, where)


def torch_module(model: Any) -> Any:
    """``model`` as a torch module: itself, or the module an nnsight envoy wraps, reached through the
    envoy's public attribute forwarding (``envoy.get_submodule("")`` runs the wrapped module's own
    ``get_submodule``, which returns that module); anything else unchanged. The layers below ``envoy``
    read no nnsight internals; above, ``envoy.nnsight_internals.hf_module`` gives the same module."""
    if isinstance(model, torch.nn.Module):
        return model
    get = getattr(model, "get_submodule", None)
    return get("") if callable(get) else model


def placement(module: Any, name: str | None = None) -> tuple[torch.device, torch.dtype]:
    """``(device, dtype)`` of ``module``'s first floating-point parameter (``module`` a ``nn.Module`` or a
    tensor); ``name`` names it in errors (default: its type). Inside a :class:`resident` block open for
    ``module`` the parameters it left on the host are not counted: the block computes where the others are.

    Raises:
        PlacementError: the module has no parameters, they are on the ``meta`` device (never
            materialised), or on several devices; the message names the module and where they are.
    """
    what = name or type(module).__name__
    if isinstance(module, torch.Tensor):
        t: torch.Tensor | None = module
        devices = {module.device}
    else:
        left = _open_block(module)[0]
        params = [p for n, p in module.named_parameters() if n not in left] \
            if hasattr(module, "named_parameters") else []
        t = next((p for p in params if p.is_floating_point()), params[0] if params else None)
        devices = {p.device for p in params}
    if t is None:
        raise PlacementError(f"{what} ({type(module).__name__}) has no parameters to place a computation on")
    if any(d.type == "meta" for d in devices):
        raise PlacementError(f"{what} ({type(module).__name__}) is on the meta device (its weights were never "
                             "loaded): load or initialise it on a real device, e.g. module.to('cuda'), before using it")
    if len(devices) > 1:
        raise PlacementError(f"{what} ({type(module).__name__}) has parameters on several devices "
                             f"{sorted(map(str, devices))}: move it to one device")
    return t.device, t.dtype


def place(module: torch.nn.Module, device: torch.device, where: str) -> None:
    """Move ``module`` (in place) to ``device`` unless it is there; ``where`` names its site in errors.

    ``device`` ``meta`` (a shape-only pass of a model whose weights are not loaded) moves nothing.

    Raises:
        PlacementError: the module's tensors are on ``meta`` (never materialised), or the move fails.
    """
    devices = {t.device for t in module.parameters()} | {t.device for t in module.buffers()}
    if devices == {device} or not devices:
        return
    name = type(module).__name__
    if any(d.type == "meta" for d in devices):
        raise PlacementError(f"the {name} for {where} has its weights on the meta device (never loaded or "
                             f"materialised) while the model runs that site on {device}; load it with "
                             "formats.load / from_pretrained or initialise it before replace()")
    if device.type == "meta":  # a shape-only pass (the model's weights not loaded): never move weights there
        return
    try:
        module.to(device)
    except (RuntimeError, NotImplementedError) as e:
        raise PlacementError(f"cannot move the {name} for {where} from {sorted(map(str, devices))} to "
                             f"{device}, where the model runs that site: {e}") from e


#: the attribute an offloaded module carries (set by ``ReplacementSet.offload``; travels with copies)
OFFLOAD_ATTR = "nnsight_lorsa_offload"
_ABSENT = object()  # a mark never set (kept_on_failure restores its absence)


def offloaded(module: Any) -> bool:
    """Whether ``module`` is offloaded: weights stored on the host, computed on its site's device."""
    return isinstance(module, torch.nn.Module) and bool(module.__dict__.get(OFFLOAD_ATTR, False))


def set_offload(module: torch.nn.Module, on: bool) -> None:
    """Mark (``on``) or unmark ``module`` as offloaded; :func:`store_on_host` / :func:`place` then move it."""
    module.__dict__[OFFLOAD_ATTR] = bool(on)


@contextlib.contextmanager
def kept_on_failure(modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Inside, ``modules`` may be marked (:func:`set_offload`) and moved (:func:`place`, :func:`store_on_host`);
    on an error (a failed move, ``Ctrl-C``) each is put back exactly as it was on entering — its offload mark
    (or its absence) and each parameter's and buffer's tensor (the same objects, the same storage: nothing is moved
    back, so the undo cannot fail) — before the error propagates. Holds references to the tensors until leaving."""
    saved = []
    for m in modules:
        mark = m.__dict__.get(OFFLOAD_ATTR, _ABSENT)
        subs = [(sub, dict(sub._parameters), dict(sub._buffers),
                 {n: p.data for n, p in sub._parameters.items() if p is not None}) for sub in m.modules()]
        saved.append((m, mark, subs))
    try:
        yield
    except BaseException:
        for m, mark, subs in saved:
            if mark is _ABSENT:
                m.__dict__.pop(OFFLOAD_ATTR, None)
            else:
                m.__dict__[OFFLOAD_ATTR] = mark
            for sub, params, buffers, data in subs:
                sub._parameters.clear()
                sub._parameters.update(params)
                sub._buffers.clear()
                sub._buffers.update(buffers)
                for n, d in data.items():
                    params[n].data = d  # type: ignore[union-attr]
        raise


def store_on_host(module: torch.nn.Module, where: str, pin: bool | None = None) -> None:
    """Move ``module``'s parameters and buffers (in place) to :data:`HOST`, in pinned (page-locked) memory
    when ``pin`` (default: where CUDA is available), so that :class:`resident`'s copies to the device run
    ``non_blocking``. ``where`` names its site in errors.

    Raises:
        PlacementError: the module is on ``meta`` (never materialised).
    """
    if pin is None:
        pin = torch.cuda.is_available()
    tensors = [*module.parameters(), *module.buffers()]
    if not pin or any(t.device.type == "meta" for t in tensors):
        place(module, HOST, where)  # refuses a meta module, naming it
        return
    with torch.no_grad():
        for t in tensors:
            if not t.is_pinned():  # straight into page-locked memory: no second host copy on the way
                host = torch.empty(t.shape, dtype=t.dtype, device=HOST, pin_memory=True)
                host.copy_(t)
                t.data = host


def pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in page-locked memory where it is on the host and CUDA is available (else ``t`` itself): copies
    from it to the device then run ``non_blocking``."""
    if t.device.type == "cpu" and not t.is_pinned() and torch.cuda.is_available():
        return t.pin_memory()
    return t


def fetch(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of ``t`` on ``device`` (``non_blocking`` from pinned memory; autograd links it to ``t``)."""
    return t.to(device, non_blocking=t.is_pinned())


def fetched_entries(module: torch.nn.Module, leave: Collection[str] = ()) -> list[tuple[dict, str, torch.Tensor]]:
    """``(store, name, tensor)`` of every parameter and buffer of ``module`` a :class:`resident` block copies: all
    but those named in ``leave`` (qualified names) and the ``None`` ones."""
    out = []
    for prefix, sub in module.named_modules():
        for store in (sub._parameters, sub._buffers):
            for name, t in list(store.items()):
                if t is not None and (f"{prefix}.{name}" if prefix else name) not in leave:
                    out.append((store, name, t))
    return out


def fetched_bytes(module: torch.nn.Module, leave: Collection[str] = (), parts: Mapping[str, int] | None = None) -> int:
    """Bytes one ``resident(module, device, leave, parts)`` block copies to ``device`` (each distinct tensor once;
    of a tensor named in ``parts``, the one index copied)."""
    parts = parts or {}
    seen = {id(t): t for _, _, t in fetched_entries(module, {*leave, *parts})}
    copied = [*seen.values(), *(_part_of(module, name)[i] for name, i in parts.items())]
    return sum(t.numel() * t.element_size() for t in copied)


#: the attribute a module carries inside a :class:`resident` block that did not copy all of it: ``(left, parts)``,
#: the qualified names left on the host (:func:`placement` skips them) and ``{(name, index): copy}`` of the indices
#: copied alone (:func:`fetched_part`). A plain tuple: this module runs on NDIF, whose unpickling refuses namedtuples'
#: ``_collections`` accessors
RESIDENT_ATTR = "nnsight_lorsa_resident"


def _open_block(module: Any) -> tuple[frozenset[str], dict[tuple[str, int], torch.Tensor]]:
    """``(left, parts)`` of the :class:`resident` block open for ``module`` (empty where none is)."""
    found = module.__dict__.get(RESIDENT_ATTR) if isinstance(module, torch.nn.Module) else None
    return found if found is not None else (frozenset(), {})


def _part_of(module: torch.nn.Module, name: str) -> torch.Tensor:
    t = module._parameters.get(name, module._buffers.get(name))
    if t is None:
        raise PlacementError(f"{type(module).__name__} has no parameter or buffer {name!r} to fetch a part of")
    return t


def fetched_part(module: Any, name: str, index: int) -> torch.Tensor | None:
    """``module.<name>[index]`` as the :class:`resident` block open for ``module`` copied it alone (``parts``), or
    None where no such block is open (read the tensor itself then)."""
    return _open_block(module)[1].get((name, index))


class resident:  # noqa: N801  (a context manager, named for what holds inside it)
    """``with resident(module, device):`` an offloaded ``module``'s parameters and buffers are copies on
    ``device`` (:func:`fetch`) for the block; on exit (also on error, and when a copy fails on entry: a CUDA OOM
    or an interrupt part-way through the copies) its host tensors are put back and the copies dropped (freed
    once nothing else holds them: under grad mode a graph that saved them for its backward keeps them until it
    is freed). A module that is not offloaded, or a ``None`` / ``meta``
    ``device``, is left as it is (the block runs wherever the module is). Not re-entrant for one module.

    Args:
        module: a replacement module (``nn.Module``; anything else passes through).
        device: the site's device, where the computation runs.
        leave: qualified names (as ``named_parameters`` / ``named_buffers`` give them: ``"W_V"``,
            ``"ln_q.w"``) of tensors the block does not use: left where they are, not copied
            (:func:`fetched_tensors`; a Lorsa's queries and keys need no ``W_V`` / ``W_O``).
        parts: ``{name: index}`` of ``module``'s own tensors (a parameter or buffer of the module itself) of which
            the block uses ``t[index]`` alone: left where they are (in ``leave`` too), ``t[index]`` copied and read
            through :func:`fetched_part` (a cross-layer transcoder's MLP site: its own layer's ``W_skip[layer]``).
    """

    def __init__(self, module: Any, device: torch.device | None, leave: Collection[str] = (),
                 parts: Mapping[str, int] | None = None) -> None:
        self.parts = dict(parts or {})
        self.module, self.device = module, device
        self.leave: Collection[str] = frozenset({*leave, *self.parts}) if self.parts else leave
        self.saved: list[tuple[dict, str, torch.Tensor]] = []

    def __enter__(self) -> Any:
        device = self.device
        if not offloaded(self.module) or device is None or device.type == "meta":
            return self.module
        copies: dict[int, torch.Tensor] = {}  # a tensor shared by two names (tied weights) is copied once
        try:
            for store, name, t in fetched_entries(self.module, self.leave):
                # on ``device`` already (a CPU model), ``fetch`` returns ``t`` itself
                if id(t) not in copies:
                    copies[id(t)] = fetch(t, device)
                self.saved.append((store, name, t))
                store[name] = copies[id(t)]
            if self.leave or self.parts:  # placement and fetched_part read what the block left and copied in part
                self.module.__dict__[RESIDENT_ATTR] = (
                    frozenset(self.leave), {(name, i): fetch(_part_of(self.module, name)[i], device)
                                            for name, i in self.parts.items()})
        except BaseException:  # a copy failed part-way (a CUDA OOM, Ctrl-C): the host tensors go back
            self.__exit__()
            raise
        return self.module

    def __exit__(self, *exc: Any) -> None:
        for store, name, t in self.saved:
            store[name] = t
        self.saved = []
        if isinstance(self.module, torch.nn.Module):
            self.module.__dict__.pop(RESIDENT_ATTR, None)


def model_device(model: Any) -> torch.device:
    """The device of an nnsight (or HF) model's first parameter (where its input ids must go). An
    nnsight model not dispatched yet (weights on ``meta``) is dispatched first, as its first trace would.

    Raises:
        PlacementError: the model's parameters are still on ``meta`` (it cannot be dispatched).
    """
    hf = torch_module(model)
    p = next(iter(hf.parameters()), None)
    if p is not None and p.is_meta and callable(getattr(model, "dispatch", None)) \
            and not getattr(model, "dispatched", True):
        model.dispatch()
        hf = torch_module(model)
        p = next(iter(hf.parameters()), None)
    if p is None:
        return HOST
    if p.is_meta:
        raise PlacementError(f"the model {type(hf).__name__} is on the meta device: dispatch it (load its "
                             "weights) before reading activations")
    return p.device


def f32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in at least fp32 (fp16 / bf16 upcast; fp32 and fp64 unchanged): for losses and metrics."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` (``(n, i, k) @ (n, k, j)``; or ``(..., i, k) @ (..., k, j)``, the same leading dims) with an
    fp32 result for fp16 / bf16 inputs (fp32 / fp64: their own dtype): the attention scores that patterns are made
    from (an fp16 ``q·k`` past 65504 would be ``inf``).

    On an accelerator, two half inputs of one dtype multiply in it with fp32 accumulation and output
    (``torch.bmm(..., out_dtype=torch.float32)``): the product of two bf16 or fp16 numbers is exact in fp32 (8 / 11
    significant bits each), so the result is the fp32 product of the same numbers up to the order of the sums — on
    tensor cores, where the upcast copies multiply in fp32 (an H100/H200's fp32 rate is ~1/15 of its bf16 one:
    issue 21, the recomputed Lorsa pattern rows of every attribution pass). Elsewhere (the CPU; a backend or build
    without that overload) the inputs are upcast first."""
    if a.dim() > 3:  # (..., i, k) @ (..., k, j) with the same leading dims: as one batch
        lead = a.shape[:-2]
        out = bmm_f32(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
        return out.view(*lead, *out.shape[-2:])
    if (a.dtype == b.dtype and a.dtype in (torch.float16, torch.bfloat16) and a.device.type != "cpu"
            and _BMM_OUT_DTYPE):
        try:
            return torch.bmm(a, b, out_dtype=torch.float32)
        except (NotImplementedError, RuntimeError):  # no kernel for this backend / layout: the upcast below
            pass
    return torch.bmm(f32(a), f32(b))


#: torch's ``bmm(..., out_dtype=)`` overload (2.8+; CUDA and ``meta`` kernels)
_BMM_OUT_DTYPE = "dtype" in torch.ops.aten.bmm.overloads()


def check_one_dtype(module: Any, name: str | None = None) -> None:
    """Refuse a replacement module whose floating parameters are in several dtypes (one cast on its own:
    ``module.W_O.data = module.W_O.data.to(torch.bfloat16)``): its forward takes its input in one dtype
    (:func:`to_module`), so it could only fail in torch's matmul. ``name`` names it (default: its type).

    Raises:
        PlacementError: naming the parameters of each dtype (the largest group counted)."""
    if not isinstance(module, torch.nn.Module):
        return
    groups: dict[torch.dtype, list[str]] = {}
    for n, p in module.named_parameters():
        if p.is_floating_point():
            groups.setdefault(p.dtype, []).append(n)
    if len(groups) < 2:
        return
    ordered = sorted(groups.items(), key=lambda kv: len(kv[1]))
    *few, (most, rest) = ordered
    listed = "; ".join(f"{', '.join(names)} in {dt}" for dt, names in few)
    raise PlacementError(f"{name or type(module).__name__} has parameters in several dtypes: {listed}; the other "
                         f"{len(rest)} in {most}. Its forward computes in one dtype: cast the whole module "
                         f"(module.to({most}))")


def narrows_range(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether a cast from ``src`` to ``dst`` can turn a finite value into ``inf``: ``dst`` floating with a
    narrower exponent range than ``src`` (fp16 from fp32 / bf16 / fp64; fp32 or bf16 from fp64), or ``src`` an
    integer dtype. Not bf16 from fp32 (the same exponent range: its max is within 0.4% of fp32's)."""
    if not dst.is_floating_point:
        return False
    if not src.is_floating_point:
        return not src.is_complex and src != torch.bool
    return 2 * torch.finfo(dst).max < torch.finfo(src).max


def is_fake(x: torch.Tensor) -> bool:
    """Whether ``x`` is a fake tensor — shapes and dtypes, no values to read: nnsight's ``model.scan`` (and
    ``trace(..., scan=True)``) runs the forward under torch's ``FakeTensorMode``, where reading a value (``bool(t)``)
    raises torch's ``GuardOnDataDependentSymNode``. Told by the class's name (``FakeTensor``, torch 2.x), not by an
    import of torch's private ``torch._subclasses``."""
    return any(c.__name__ == "FakeTensor" for c in type(x).__mro__)


def past_range(x: torch.Tensor, dtype: torch.dtype) -> float | None:
    """The largest finite ``|x|`` that the cast of ``x`` to ``dtype`` turns into ``inf``, or None when there is
    none. Reads one value (a device sync) only where the cast narrows the range (:func:`narrows_range`); a fake
    tensor (:func:`is_fake`: ``model.scan``) has none to read and gives None."""
    if not narrows_range(x.dtype, dtype) or is_fake(x):
        return None
    limit = torch.finfo(dtype).max
    a = x.detach().abs()
    if not a.is_floating_point():
        a = a.double()
    if not bool(((a > limit) & torch.isfinite(a)).any()):
        return None
    return float(torch.where(torch.isfinite(a), a, 0).max())


def overflowed(x: torch.Tensor) -> bool:
    """Whether ``x`` is in a floating dtype of narrower exponent range than fp32 (fp16: ``|x| <= 65504``) and holds
    an ``inf`` or NaN. fp16 is the one dtype whose computations overflow in practice from finite inputs and finite
    weights, so only there is ``x`` read (one reduction and one value, a device sync); a bf16 / fp32 / fp64 (or
    integer) ``x`` is not read and gives False, as does a fake tensor (:func:`is_fake`: ``model.scan``)."""
    return narrows_range(torch.float32, x.dtype) and not is_fake(x) and not bool(torch.isfinite(x).all())


def to_module(x: torch.Tensor, module: Any, name: str | None = None) -> torch.Tensor:
    """``x`` moved to ``module``'s device and cast to its dtype (the input a module's forward accepts). Inside
    ``with resident(module, device, leave):`` that is the device of the tensors the block copied (the left ones
    stay on the host: :func:`placement`).

    A cast to a dtype of narrower exponent range (fp16, ``|x| <= 65504``, from fp32 / bf16 / fp64; fp32 or bf16
    from fp64) that would turn a finite value of ``x`` into ``inf`` is refused (the module would compute NaN and
    hand it to the model): that check reads one value (a device sync), only for such a cast (:func:`past_range`).

    Raises:
        PlacementError: as :func:`placement` and :func:`check_one_dtype`; ``x`` holds finite values past the
            module dtype's range (names the module, both dtypes and the largest value).
    """
    device, dtype = placement(module, name)
    check_one_dtype(module, name)
    if not x.is_floating_point():
        return x.to(device=device)
    big = past_range(x, dtype)
    if big is not None:
        what = name or type(module).__name__
        raise PlacementError(f"the {what} ({dtype}) is fed values beyond {dtype}'s range (max |x| = {big:.4g} > "
                             f"{torch.finfo(dtype).max:.4g}, given in {x.dtype}): the cast to the module's dtype "
                             "would turn them into inf and the module would compute NaN; cast the module to a wider "
                             "dtype (module.to(torch.float32) or torch.bfloat16)")
    return x.to(device=device, dtype=dtype)


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


__all__ = ["HOST", "MODULE_DTYPES", "OFFLOAD_ATTR", "check_device_arg", "check_dtype_arg", "check_one_dtype",
           "check_placement_args", "f32", "fetch", "host_f32", "like", "model_device", "narrows_range", "offloaded",
           "overflowed", "past_range", "pinned", "place", "placement", "resident", "set_offload", "store_on_host",
           "to_module"]
