"""Every use of nnsight's private internals in this package, in one module.

Checked against nnsight 0.8.1 (``nnsight>=0.8.1,<0.9`` in pyproject.toml): the names below are not
part of nnsight's documented API (``Envoy``, ``.input``/``.output``, ``trace``, ``save``), so a new
nnsight version is checked here and nowhere else. What is used:

* ``nnsight.intervention.source.STATE`` / ``Controller`` — nnsight's per-module instrumentation, removed
  from a replacement module when it is unmounted (:func:`strip_nnsight`);
* ``Envoy(module, path=, interleaver=, parent=)``, ``Envoy._module``, ``Envoy.path`` as ``eproperty._location``
  reads it (:class:`EndedEnvoy`), ``interleaver.envoys``, ``Interleaver.instrument``
  / ``fragments`` and ``source.install_controller`` — an envoy for a replacement module that is not a child of
  the model's modules (:func:`attach`, :func:`detach`); ``Envoy._drop_envoy`` — unmounting a real child module
  (:func:`mount`, :func:`unmount`: a lasting local change, e.g. the gates of sparse attention); ``Envoy._edits``
  — the edits ``model.edit()`` stored (:func:`stored_edits`);
* ``nnsight.intervention.interleaver.Mediator`` (subclassed), ``Mediator.current``,
  ``interleaver.mediators`` / ``_reindex_parked`` / ``parked`` / ``interleaving`` / ``counts`` and
  ``Mediator.counts_at_start`` / ``Mediator.iteration`` — a per-trace worker that runs a replacement in
  step with the model, on every forward pass of the run (each step of a generation);
* ``nnsight.intervention.interleaver.OutOfOrderError`` — thrown into a worker still parked when the run
  is over (:func:`park_or_end`);
* ``interleaver.batcher.kwargs`` / ``extra_kwargs`` — the keyword arguments of the traced call
  (``generate``'s ``num_beams`` …, :func:`run_kwargs`); ``Batcher.total`` / ``batching`` with
  ``Mediator.batch_group`` — the rows of the batch an invoke's worker acts on (:func:`invoke_rows`, :func:`batch_rows`:
  a replacement spliced from an invoke replaces that invoke's rows);
* ``Envoy.interleave``'s frame (its ``fn`` local, found through the worker greenlet's parents) — which
  model method the trace runs (``"generate"`` or the forward, :func:`traced_method`);
* ``Envoy.interleaver``, ``Mediator.worker`` (a greenlet) and ``getcurrent`` as the interleaver module
  imports it from greenlet — whether another thread is running a trace of the same model
  (:func:`check_one_thread`; nnsight's greenlets are bound to their thread), and which worker is
  running (:func:`park_or_end`).

Mounting: a replacement module becomes an envoy of the running trace without becoming a child of a
model module (:func:`attach`: nnsight's ``Envoy`` built for it under the site's path and held by the
site's envoy; NDIF's servers refuse ``setattr`` on the model's modules); when its trace ends it is
detached and nnsight's per-module instrumentation is removed again, unless the module already
carried it before (a module the user wrapped elsewhere is left alone).

Workers: nnsight runs each intervention block as a *mediator* (a greenlet that parks on the
locations it reads or writes). A replacement module's internals are observable only when the
module is called from a *different* worker than the one reading them (nnsight docs,
``patterns/sae-and-auxiliary-modules.md``: "the edit runs the SAE call, and the trace body
parks on sae.encoder.output"). ``model.edit()`` gives such a worker but persists across
traces; :func:`spawn_worker` gives one for the current trace only: it is added to the running
interleaver, parks like any intervention, and is unwound by nnsight's own ``cancel()`` when
the trace ends, normally or by an error — so nothing it sets up outlives the trace.

Also here: the torch module under an envoy (:func:`hf_module`, ``Envoy._module``: the layers below
``envoy`` reach it through the envoy's public attribute forwarding instead, ``_placement.torch_module``),
and what :mod:`nnsight_lorsa.remote` needs of nnsight's remote backend (its private ``_serialize``
step, the ``RemoteBackend`` name it swaps, the block reduction and the block's AST (``Tracer.node``), the request
envelope, the model's ``_remoteable_get_env``, the ``_persistent_id`` the pickler sends by reference).

:data:`PRIVATE_NAMES` lists every such name with what it is; ``tests/envoy/test_nnsight_internals.py``
walks it against the installed nnsight and names the version and the name when one has changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nnsight.intervention import interleaver as nnsight_interleaver
from nnsight.intervention import source as nnsight_source
from nnsight.intervention.backends.remote import RemoteBackend
from nnsight.intervention.envoy import Envoy
from nnsight.intervention.interleaver import Mediator, OutOfOrderError
from nnsight.intervention.source import STATE, Controller, install_controller
from torch import nn

from ..adapters.registry import ADAPTERS
from ..errors import ArgumentError, ConcurrentTraceError, TraceOrderError

#: every private or internal nnsight name this package relies on, as ``(owner, name, kind)``: ``owner``
#: a dotted module, class or function path; ``kind`` one of ``"class"``, ``"callable"`` (function, method
#: or classmethod), ``"property"``, ``"constant"`` (a str), ``"instance attribute"`` (set on every
#: instance of ``owner``), ``"local"`` (a local variable of the function ``owner``) or ``"in source"``
#: (``name`` is spelled in ``owner``'s source: a key nnsight reads or writes by name). Checked against
#: nnsight 0.8.1 by ``tests/envoy/test_nnsight_internals.py``.
PRIVATE_NAMES: tuple[tuple[str, str, str], ...] = (
    # instrumentation of a module (strip_nnsight, is_instrumented)
    ("nnsight.intervention.source", "STATE", "constant"),
    ("nnsight.intervention.source", "Controller", "class"),
    # mounting and unmounting a child envoy (attach, detach), the module under an envoy (hf_module)
    ("nnsight.intervention.envoy.Envoy", "_module", "instance attribute"),
    ("nnsight.intervention.envoy.Envoy", "__init__", "callable"),
    ("nnsight.intervention.envoy.Envoy", "_drop_envoy", "callable"),
    # the edits model.edit() stored on an envoy (stored_edits)
    ("nnsight.intervention.envoy.Envoy", "_edits", "instance attribute"),
    ("nnsight.intervention.source", "install_controller", "callable"),
    ("nnsight.intervention.interleaver.Interleaver", "instrument", "callable"),
    ("nnsight.intervention.interleaver.Interleaver", "fragments", "instance attribute"),
    ("nnsight.intervention.envoy.Envoy", "interleaver", "instance attribute"),
    ("nnsight.intervention.envoy.Envoy", "path", "instance attribute"),
    # an ended replacement's envoy (EndedEnvoy): nnsight builds a location from the envoy's ``path`` attribute
    ("nnsight.intervention.eproperty.eproperty", "_location", "callable"),
    ("nnsight.intervention.eproperty.eproperty._location", "path", "in source"),
    ("nnsight.intervention.interleaver.Interleaver", "envoys", "instance attribute"),
    # workers (FunctionWorker, spawn_worker, stood_down, waiting_under, ran_since_start, park_or_end, ...)
    ("nnsight.intervention.interleaver", "Mediator", "class"),
    ("nnsight.intervention.interleaver", "OutOfOrderError", "class"),
    ("nnsight.intervention.interleaver", "getcurrent", "callable"),
    ("nnsight.intervention.interleaver.Mediator", "current", "callable"),
    ("nnsight.intervention.interleaver.Mediator", "start", "callable"),
    ("nnsight.intervention.interleaver.Mediator", "_run", "callable"),
    ("nnsight.intervention.interleaver.Mediator", "alive", "property"),
    ("nnsight.intervention.interleaver.Mediator", "interleaver", "instance attribute"),
    ("nnsight.intervention.interleaver.Mediator", "batch_group", "instance attribute"),
    ("nnsight.intervention.interleaver.Mediator", "worker", "instance attribute"),
    ("nnsight.intervention.interleaver.Mediator", "pending", "instance attribute"),
    ("nnsight.intervention.interleaver.Mediator", "iteration", "instance attribute"),
    ("nnsight.intervention.interleaver.Mediator", "counts_at_start", "instance attribute"),
    # the skip gate of the module holding a splice's site (skip_gate, inside_now): the location "{path}.skip" the
    # controller asks, its sentinel for "not skipped", and a worker's count of a location
    ("nnsight.intervention.source", "NO_SKIP", "in source"),
    ("nnsight.intervention.source.Controller.__call__", "NO_SKIP", "in source"),
    ("nnsight.intervention.source.State", "skip", "in source"),
    ("nnsight.intervention.interleaver.Mediator", "value", "callable"),
    ("nnsight.intervention.interleaver.Mediator", "occurrence", "callable"),
    ("nnsight.intervention.interleaver.Interleaver", "_reindex_parked", "callable"),
    ("nnsight.intervention.interleaver.Interleaver", "mediators", "instance attribute"),
    ("nnsight.intervention.interleaver.Interleaver", "parked", "instance attribute"),
    ("nnsight.intervention.interleaver.Interleaver", "interleaving", "instance attribute"),
    ("nnsight.intervention.interleaver.Interleaver", "counts", "instance attribute"),
    ("nnsight.intervention.interleaver.Interleaver", "batcher", "instance attribute"),
    ("nnsight.intervention.batching.Batcher", "kwargs", "instance attribute"),
    ("nnsight.intervention.batching.Batcher", "extra_kwargs", "instance attribute"),
    ("nnsight.intervention.batching.Batcher", "total", "instance attribute"),  # invoke rows (invoke_rows, batch_rows)
    ("nnsight.intervention.batching.Batcher", "batching", "property"),
    ("nnsight.intervention.envoy.Envoy.interleave", "fn", "local"),
    ("nnsight.intervention.envoy.Envoy.interleave", "self", "local"),
    ("nnsight.modeling.transformers.TransformersModel", "_call", "callable"),  # what model.trace runs (traced_method)
    # remote (nnsight_lorsa.remote through the functions below)
    ("nnsight.intervention.backends.remote", "RemoteBackend", "class"),
    ("nnsight.intervention.backends.remote.RemoteBackend", "_serialize", "callable"),
    ("nnsight.intervention.backends.remote.RemoteBackend", "request", "callable"),
    ("nnsight.intervention.backends.remote.RemoteBackend", "submit", "callable"),
    ("nnsight.intervention.backends.remote.RemoteBackend", "model_key", "instance attribute"),
    ("nnsight.intervention.backends.remote.RemoteBackend", "env", "instance attribute"),
    ("nnsight.intervention.backends.remote.RemoteBackend", "compress", "instance attribute"),
    ("nnsight.intervention.backends.remote.RemoteBackend", "verbose", "instance attribute"),
    ("nnsight.intervention.backends.remote.RemoteBackend", "display", "instance attribute"),
    ("nnsight.intervention.serialization", "dumps", "callable"),
    ("nnsight.intervention.serialization", "reduce_block", "callable"),
    ("nnsight.schema.request", "RequestModel", "class"),
    ("nnsight.tracing.tracer.Tracer", "node", "instance attribute"),
    ("nnsight.tracing.tracer.Tracer", "info", "instance attribute"),
    ("nnsight.tracing.tracer.Tracer.Info", "frame", "instance attribute"),
    ("nnsight.modeling.transformers.TransformersModel", "_remoteable_get_env", "callable"),
    # the model's modules are sent by reference: Envoy.__getstate__ tags them, the pickler reads the tag
    ("nnsight.intervention.envoy.Envoy.__getstate__", "_persistent_id", "in source"),
    ("nnsight.intervention.serialization", "_persistent_id", "in source"),
)

#: the ``__dict__`` key nnsight's pickler sends by reference (``Envoy.__getstate__`` sets it on the model's modules)
PERSISTENT_ID = "_persistent_id"


def hf_module(model: Any) -> Any:
    """The torch module an nnsight envoy wraps (``envoy._module``: for a model, the Hugging Face model),
    or ``model`` itself when it is not an envoy (a plain ``nn.Module``)."""
    return getattr(model, "_module", model)


def vocabulary_size(model: Any) -> int | None:
    """The number of token ids ``model`` (an envoy or a Hugging Face model) embeds: its input embedding's
    ``num_embeddings``; None when it has no such embedding (then no id bound is known)."""
    get = getattr(hf_module(model), "get_input_embeddings", None)
    vocab = getattr(get() if callable(get) else None, "num_embeddings", None)
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def position_limit(model: Any) -> int | None:
    """The number of positions ``model`` (an envoy or a Hugging Face model) embeds when it has learned absolute
    position embeddings (its adapter's ``pos_embed_path``: GPT-2's ``transformer.wpe``, ``n_positions`` rows); None
    for a model whose positions enter through RoPE (no table to index past) or that no adapter serves."""
    module = hf_module(model)
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    path = next((a.pos_embed_path for a in ADAPTERS if model_type in a.model_types), "")
    try:
        table = module.get_submodule(path) if path else None
    except AttributeError:  # a model of the family laid out otherwise: no table known
        table = None
    rows = getattr(table, "num_embeddings", None)
    return rows if isinstance(rows, int) and not isinstance(rows, bool) else None


def check_token_ids(ids: Any, model: Any, what: str, length: int | None = None) -> None:
    """Refuse token ids ``ids`` (an integer tensor ``(..., pos)``) below 0 or at or past ``model``'s
    :func:`vocabulary_size`, or ``length`` (default ``pos``; a stream cut into windows later: the windows' length)
    past its :func:`position_limit` (neither without a model), before the model
    runs (an id outside the vocabulary, or a position past a learned position table, is torch's ``IndexError`` from
    inside an embedding; on CUDA a device-side assert): the one check of the token ids of prompts, analysis tokens
    and training / evaluation windows.

    Raises:
        ArgumentError: naming ``what``, the vocabulary and the ids' range, or the positions and the ids' length.

    Source: ours.
    """
    if length is None and ids.dim():
        length = int(ids.shape[-1])
    limit = None if model is None or length is None else position_limit(model)
    if limit is not None and length is not None and length > limit:
        raise ArgumentError(f"{what} must be at most {limit} tokens long (the model's learned position embeddings "
                            f"have {limit} rows), got {length} tokens")
    if ids.numel() == 0:
        return
    vocab = None if model is None else vocabulary_size(model)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab is not None and high >= vocab):
        raise ArgumentError(f"{what} must be token ids in [0, {vocab}) (the model's vocabulary), got ids from {low} "
                            f"to {high}")


def stored_edits(model: Any) -> int:
    """How many edit blocks ``model.edit()`` stored on the envoy ``model`` (``Envoy._edits``; replayed on every trace
    of it): 0 for an envoy without edits or an object that is no envoy."""
    return len(getattr(model, "__dict__", {}).get("_edits", ()) or ())


def is_envoy(obj: Any) -> bool:
    """Whether ``obj`` wraps a torch module the way an nnsight envoy does."""
    return isinstance(getattr(obj, "_module", None), nn.Module)


def check_traceable(model: Any, where: str) -> None:
    """Refuse a ``model`` that is no nnsight model (an envoy wrapping a torch module) where one is traced.

    Raises:
        ArgumentError: naming ``where`` and what was given.

    Source: ours (nnsight 0.8's ``Envoy._module``).
    """
    if not is_envoy(model):
        raise ArgumentError(f"{where}: model must be the nnsight model to trace (LanguageModel(...), "
                            f"nnsight_lorsa.envoy.load_model(...)), got a {type(model).__name__}")


def strip_nnsight(module: nn.Module) -> None:
    """Undo nnsight's per-module instrumentation (controller forward + state) on a detached module."""
    for sub in module.modules():
        if isinstance(sub.__dict__.get("forward"), Controller):
            del sub.__dict__["forward"]
        sub.__dict__.pop(STATE, None)


def attach(site_envoy: Any, name: str, module: nn.Module) -> Any:
    """Make ``module`` an envoy of the running trace at ``<site path>.<name>`` and return it, **without** adding it
    to the model's modules (no ``setattr``/``add_module`` on a module of the model: NDIF's servers refuse both).

    The envoy is nnsight's own (``Envoy(module, path=..., interleaver=..., parent=site_envoy)``), built with
    nnsight's controller installed by ``install_controller`` -- the function ``Interleaver.instrument`` calls --
    reached through this module's globals: ``instrument`` imports it lazily, and an import made while a request
    runs on NDIF must be of a whitelisted module (``nnsight.intervention.source`` is not). The site's *envoy* holds
    the new envoy under ``name`` (so ``site_envoy.<name>`` reads it); the site's torch module is not touched.

    Raises:
        TraceOrderError: the site's module has a child named ``name``, or its envoy holds another module's envoy there.
    """
    held = site_envoy.__dict__.get(name)
    if held is not None and getattr(held, "_module", None) is module:
        return held
    if name in hf_module(site_envoy)._modules or held is not None:
        raise TraceOrderError(f"{site_envoy.path} already has a child module named {name!r}")
    interleaver = site_envoy.interleaver

    def instrument(envoy: Any) -> None:  # Interleaver.instrument (nnsight 0.8.1), without its lazy import
        if interleaver.fragments is not None:
            interleaver.fragments.instrument(envoy)
        install_controller(envoy)

    interleaver.__dict__["instrument"] = instrument  # the interleaver, not a module of the model
    try:
        envoy = Envoy(module, path=f"{site_envoy.path}.{name}", interleaver=interleaver, parent=site_envoy)
    finally:
        interleaver.__dict__.pop("instrument", None)
    site_envoy.__dict__[name] = envoy
    return envoy


def detach(site_envoy: Any, name: str, module: nn.Module, instrumented_before: bool) -> None:
    """Undo :func:`attach`: forget the envoy and its descendants' registrations and, unless ``module`` was
    instrumented before, strip nnsight's controllers from it."""
    held = site_envoy.__dict__.get(name)
    if held is not None and getattr(held, "_module", None) is module:
        del site_envoy.__dict__[name]
    _forget(site_envoy, name, module, instrumented_before)
    if held is not None and getattr(held, "_module", None) is module:
        end_envoy(held)


class EndedEnvoy(Envoy):
    """A replacement's envoy (or one of its hook points') after its trace ended (:func:`end_envoy`): outside a trace it
    is the envoy it was (``repr``, ``path``); inside any trace body its ``path`` — from which nnsight builds every
    ``.output`` / ``.input`` location — raises :class:`TraceOrderError` (:func:`_ended_path`). A property on the
    class wins over the instance's own ``path``."""

    path = property(lambda self: _ended_path(self))  # type: ignore[assignment]


def _ended_path(envoy: Any) -> str:
    """The ``path`` of an :class:`EndedEnvoy`: its path outside a trace; inside a trace body (an intervention is
    running: ``Mediator.current``'s test) a :class:`TraceOrderError` naming it."""
    path = envoy.__dict__.get("path", "")
    if getattr(_current_greenlet(), "mediator", None) is None:
        return path
    raise TraceOrderError(
        f"{path}: this envoy came from replace() in a trace that has ended. A replacement is spliced for one trace "
        "only and its envoy is forgotten with it, so here it would wait on a module this trace never runs (nnsight "
        "reports that as an OutOfOrderError, 'the model already ran past it'). Call replace() again in this trace and "
        "use the envoy it returns; in a model.session(), pass values (tensors) from one trace to the next, not "
        "envoys")


def end_envoy(envoy: Any) -> None:
    """Make ``envoy`` (a replacement's, detached when its trace ended) and its descendants :class:`EndedEnvoy`: used
    in a later trace, reading or editing them raises :class:`TraceOrderError` instead of nnsight's misleading
    ``OutOfOrderError``. Only envoys of nnsight's own ``Envoy`` class are changed (:func:`attach` makes them, new ones
    every trace)."""
    stack = [envoy]
    while stack:
        e = stack.pop()
        if type(e) is not Envoy:
            continue
        e.__class__ = EndedEnvoy
        prefix = e.__dict__.get("path", "") + "."
        stack.extend(c for c in e.__dict__.values() if isinstance(c, Envoy) and c.__dict__.get("path", "")
                     .startswith(prefix))


def _forget(site_envoy: Any, name: str, module: nn.Module, instrumented_before: bool) -> None:
    """Drop the interleaver's registrations of ``module`` and its descendants under ``<site path>.<name>`` and,
    unless ``module`` was instrumented before, strip nnsight's controllers. The interleaver keeps one
    registration per module (a hook point's too; nnsight's ``_drop_envoy`` forgets only the envoy's own): a
    stale one would make the next trace that attaches or mounts the module alias the old envoy (seen after
    ``tracer.stop()``: OutOfOrderError on ``hook_z`` in the following trace)."""
    registry = site_envoy.interleaver.envoys
    prefix = f"{site_envoy.path}.{name}."
    for sub in module.modules():
        envoy = registry.get(id(sub))
        if envoy is not None and f"{envoy.path}.".startswith(prefix):
            del registry[id(sub)]
    if not instrumented_before:  # leave alone a module the user had wrapped by nnsight elsewhere
        strip_nnsight(module)


def held_module(site_envoy: Any, name: str) -> nn.Module | None:
    """The module a trace has at ``<site path>.<name>``: :func:`attach`'s (held by the site's envoy) or
    :func:`mount`'s (a child of the site's module); None when there is neither."""
    held = site_envoy.__dict__.get(name)
    module = getattr(held, "_module", None) if held is not None else None
    return module if module is not None else hf_module(site_envoy)._modules.get(name)


def mount(site_envoy: Any, name: str, module: nn.Module) -> Any:
    """Mount ``module`` as a real child ``<site module>.<name>`` (``setattr`` on the envoy: nnsight adds it to the
    torch module and mirrors it) and return its envoy; raises if the name is taken. For a lasting, local change of
    the model (``install_gated_attention``), never inside a remote request: NDIF refuses ``setattr`` on the model's
    modules (a splice uses :func:`attach`)."""
    existing = hf_module(site_envoy)._modules.get(name)
    if existing is not None and existing is not module:
        raise TraceOrderError(f"{site_envoy.path} already has a child module named {name!r}")
    if existing is None:
        setattr(site_envoy, name, module)
    return getattr(site_envoy, name)


def unmount(site_envoy: Any, name: str, module: nn.Module, instrumented_before: bool) -> None:
    """Undo :func:`mount` and, unless ``module`` was instrumented before, strip nnsight's controllers."""
    if hf_module(site_envoy)._modules.get(name) is module:
        del hf_module(site_envoy)._modules[name]
        site_envoy._drop_envoy(name)
    _forget(site_envoy, name, module, instrumented_before)


def is_instrumented(module: nn.Module) -> bool:
    """Whether nnsight has instrumented ``module`` already (then unmounting leaves it so)."""
    return STATE in module.__dict__


# ------------------------------------------------------------------ workers
class FunctionWorker(Mediator):
    """A :class:`~nnsight.intervention.interleaver.Mediator` whose body is ``fn()``.

    ``batch_group`` is None: the worker sees the whole batch (all invokes), like an edit (a splice's worker writes
    back only the rows of the invokes that asked for it: :func:`invoke_rows`).
    ``tag`` identifies what it does (used to find an existing worker for the same site).
    """

    def __init__(self, fn: Callable[[], None], tag: Any) -> None:
        super(FunctionWorker, self).__init__(None, {}, {})
        self.fn = fn
        self.tag = tag
        self.batch_group = None

    def _run(self) -> None:
        # relaxed (nnsight's ``iteration = None``): each request binds to the next visit of its
        # location, so the worker follows the model through every forward pass of the run
        # (every step of a generation) instead of only the first
        self.iteration = None
        self.fn()


def current_worker(what: str) -> Mediator:
    """The intervention worker running now.

    Raises:
        TraceOrderError: not inside a ``model.trace(...)`` / ``model.generate(...)`` body.
        ConcurrentTraceError: another thread is running a trace of the same model (:func:`check_one_thread`).
    """
    try:
        worker = Mediator.current(what)
    except ValueError as e:  # nnsight: "Cannot access `<what>` outside of interleaving."
        raise TraceOrderError(f"{what}() must be called inside a model.trace(...) body, before the model "
                              "reaches the site it replaces") from e
    check_one_thread(worker, what)
    return worker


def find_worker(interleaver: Any, tag: Any) -> FunctionWorker | None:
    """The live :class:`FunctionWorker` with ``tag`` in this run, if any."""
    for mediator in interleaver.mediators:
        if isinstance(mediator, FunctionWorker) and mediator.tag == tag and mediator.alive:
            return mediator
    return None


def spawn_worker(interleaver: Any, fn: Callable[[], None], tag: Any) -> FunctionWorker:
    """Start ``fn`` as a worker of the running trace; it runs until it first parks.

    Must be called from inside an intervention (a trace body). The worker is appended to the
    interleaver's mediators, so nnsight serves it, checks it for dangling requests after the
    run and unwinds it (``GreenletExit``, running its ``finally`` blocks) in ``cancel()``.
    """
    worker = FunctionWorker(fn, tag)
    interleaver.mediators.append(worker)
    worker.start(interleaver)
    interleaver._reindex_parked()
    return worker


def serve_last(worker: Mediator) -> None:
    """Move ``worker`` to the end of its run's workers: at every location it parks on next, nnsight serves it
    after every other worker parked there (``Interleaver.handle`` serves them in list order, each seeing the
    value the ones before it left), so it sees the value as the trace body's edits and the splices' swaps
    left it. nnsight documents replacing the list mid-run (``Interleaver.reindex``)."""
    mediators = worker.interleaver.mediators
    if mediators and mediators[-1] is not worker:
        mediators.remove(worker)
        mediators.append(worker)
        worker.interleaver._reindex_parked()


#: the first element of a splice worker's tag (:func:`is_splice`)
SPLICE_TAG = ("nnsight_lorsa.splice_chain",)


def serve_first(worker: Mediator) -> None:
    """Move ``worker`` ahead of every worker that is not a splice (:func:`is_splice`) in its run's list: at the
    location it parks on next, nnsight serves it before the trace body's interventions parked there, which then
    see the value it leaves (a splice's swapped output). Splices keep their order among themselves. Undone by
    :func:`serve_last` (a splice reads its site's input after the body's edits)."""
    mediators = worker.interleaver.mediators
    mediators.remove(worker)
    at = next((i for i, m in enumerate(mediators) if not is_splice(m)), len(mediators))
    mediators.insert(at, worker)
    worker.interleaver._reindex_parked()


def is_splice(mediator: Mediator) -> bool:
    """Whether ``mediator`` is a splice's worker (:func:`~.splice_chain.splice_chain`: its tag starts with
    ``"nnsight_lorsa.splice_chain"``)."""
    tag = getattr(mediator, "tag", None)
    return isinstance(mediator, FunctionWorker) and isinstance(tag, tuple) and tag[:1] == SPLICE_TAG


def stood_down(interleaver: Any, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` with the trace stood down: module values are neither served nor edited."""
    was = interleaver.interleaving
    interleaver.interleaving = False
    try:
        return fn()
    finally:
        interleaver.interleaving = was


def waiting_under(interleaver: Any, prefix: str) -> list[Mediator]:
    """The workers of the run that wait on a location under envoy path ``prefix`` (empty: none)."""
    # workers served alongside this one may have parked since the interleaver last indexed who
    # waits where; re-index so the module's internals reach them
    interleaver._reindex_parked()
    return [m for m in interleaver.mediators if (p := getattr(m.pending, "provider", None)) is not None
            and p.startswith(prefix)]


def invoke_rows(worker: Mediator) -> tuple[int, int] | None:
    """The rows ``(start, size)`` of the run's batch that nnsight scopes ``worker``'s reads and edits to: its
    ``tracer.invoke``'s (``Mediator.batch_group``); None for the whole batch -- ``model.trace(prompt)``'s implicit
    invoke, an empty ``tracer.invoke()``, an edit, a worker of this package, or a trace in which a single invoke
    brings rows (nnsight narrows nothing then: ``Batcher.batching``)."""
    batcher = getattr(worker.interleaver, "batcher", None)
    group = worker.batch_group
    if batcher is None or not batcher.batching or group is None:
        return None
    return int(group[0]), int(group[1])


def batch_rows(interleaver: Any) -> int | None:
    """How many rows the run's batch has, all invokes together (``Batcher.total``); None when it has no batcher."""
    batcher = getattr(interleaver, "batcher", None)
    return None if batcher is None else int(batcher.total)


def ran_since_start(worker: Mediator, envoy_path: str) -> int:
    """How often the module at ``envoy_path`` was called in this forward pass since ``worker`` started."""
    key = f"{envoy_path}.input"
    return worker.interleaver.counts.get(key, 0) - worker.counts_at_start.get(key, 0)


def park_or_end(read: Callable[[], Any]) -> tuple[bool, Any]:
    """``(True, read())``, or ``(False, None)`` when the run ended while the worker waited in ``read``.

    nnsight throws ``OutOfOrderError`` into a worker still parked once the model has finished
    (``Interleaver.check_dangling_mediators``); a worker that waits for a *next* forward pass
    which never comes (the last step of a generation, or a one-pass trace) ends quietly with this.
    An ``OutOfOrderError`` about another worker's request (``Mediator.pending``, in the message)
    passes through.
    """
    try:
        return True, read()
    except OutOfOrderError as e:
        # only the end of the run for *this* worker: a trace body parked on a replacement's internals
        # that the run never reached (an out-of-order read) dies with its own OutOfOrderError, which
        # greenlet hands to the worker that last resumed it — this one — and which must stand
        me = getattr(_current_greenlet(), "mediator", lambda: None)()
        pending = getattr(me, "pending", None)
        if pending is not None and f"'{pending}'" not in str(e):
            raise
        return False, None


def enclosing(root: Any, site_path: str, reader_path: str) -> str | None:
    """The path (below ``root``) of the module nearest above the site at ``site_path`` (below ``root``) that also
    holds the module at envoy path ``reader_path`` (whose input the splice reads) and that the model calls (not a
    ``ModuleList`` / ``ModuleDict``; not the root): the module a trace's ``.skip(...)`` of which bypasses the site, a
    decoder layer for an attention or an MLP. None when there is none."""
    parts = site_path.split(".")
    for n in range(len(parts) - 1, 0, -1):
        below = ".".join(parts[:n])
        envoy = root.get(below)
        if isinstance(envoy._module, (nn.ModuleList, nn.ModuleDict)):
            continue
        return below if reader_path.startswith(envoy.path + ".") else None
    return None


def inside_now(worker: Mediator, envoy_path: str) -> bool:
    """Whether the model is inside a call of the module at ``envoy_path`` now, in the run of ``worker`` (a trace
    body's): it entered it more often than it left it since the worker started (a ``replace()`` made from a read
    within that module, after its ``.skip`` gate). The interleaver's counts run on over the model's traces."""
    return ran_since_start(worker, envoy_path) > worker.occurrence(f"{envoy_path}.output")


def skip_gate(envoy_path: str) -> bool:
    """Park the calling worker on the ``.skip`` gate of the module at ``envoy_path`` (asked before the module runs)
    and return whether the trace skipped that call (``envoy.skip(value)``: its body does not run). Served after the
    trace body's interventions there (:func:`serve_last`), so it sees their skip. nnsight's ``NO_SKIP`` sentinel is
    looked up on its module when called: code shipped by value to NDIF would carry a copy of the object, never the
    server's sentinel (every call then looked skipped)."""
    return Mediator.value(f"{envoy_path}.skip") is not nnsight_source.NO_SKIP


def run_kwargs(interleaver: Any) -> dict:
    """The keyword arguments of the traced call (``model.generate(prompt, num_beams=2)``: ``num_beams``).

    Known before the model runs (the trace body starts first); ``{}`` when nnsight keeps none.
    """
    batcher = getattr(interleaver, "batcher", None)
    if batcher is None:
        return {}
    return {**getattr(batcher, "kwargs", {}), **getattr(batcher, "extra_kwargs", {})}


def pinned_step(worker: Mediator) -> int | None:
    """The generation step a trace body's worker is in: its ``tracer.iter`` pin, None when relaxed."""
    return worker.iteration


def _current_greenlet() -> Any:
    """The running greenlet, through nnsight's interleaver module (so that code shipped to NDIF names no
    ``greenlet`` module: NDIF's unpickling whitelist has nnsight, not greenlet). The module is a global of this
    module, resolved when a request is unpickled: importing it while the request runs would be refused (NDIF's
    run-time whitelist has ``nnsight`` itself, not ``nnsight.intervention``)."""
    return nnsight_interleaver.getcurrent()


def traced_method(interleaver: Any) -> str | None:
    """The name of the model method the running trace of ``interleaver`` calls (``"generate"`` for
    ``model.generate(...)``, ``"_call"`` for ``model.trace(...)``); None when it cannot be told (e.g. on
    a remote server). Called from a trace body's worker: the caller's thread is suspended in
    ``Envoy.interleave(fn, ...)``, a parent of the worker greenlet. (Nothing is imported here: this runs
    on NDIF servers too, whose run-time import whitelist has neither ``greenlet`` nor ``sys``.)"""
    code = Envoy.interleave.__code__
    g: Any = _current_greenlet().parent
    while g is not None:
        frame = g.gr_frame
        while frame is not None:
            if frame.f_code is code and getattr(frame.f_locals.get("self"), "interleaver", None) is interleaver:
                fn = frame.f_locals.get("fn")
                return fn if isinstance(fn, str) else getattr(fn, "__name__", None)
            frame = frame.f_back
        g = g.parent
    return None


def _thread_root(g: Any) -> Any:
    """The main greenlet of the thread ``g`` belongs to (greenlets never change thread)."""
    while g.parent is not None:
        g = g.parent
    return g


def check_one_thread(model: Any, what: str) -> None:
    """Raise :class:`ConcurrentTraceError` when another thread is running a trace of ``model`` (an
    envoy, or a worker of one of its traces) now.

    Looks at the live workers of the model's interleaver: a worker greenlet belongs to the thread that
    started its trace; one from another thread (or a run in progress without one from this thread)
    means two threads share the model's one interleaver, which nnsight does not support (it fails
    with "parent cannot be on a different thread" or corrupts the other thread's run).
    """
    interleaver = getattr(model, "interleaver", None)
    if interleaver is None:
        return
    here = _thread_root(_current_greenlet())
    live = [m.worker for m in list(interleaver.mediators) if getattr(m, "worker", None) is not None
            and not m.worker.dead]
    other = [w for w in live if _thread_root(w) is not here]
    if other or (interleaver.interleaving and not live):
        raise ConcurrentTraceError(
            f"{what}: another thread is running a trace of this model right now. nnsight traces are "
            "per-thread (one interleaver per model; its intervention greenlets belong to the thread that "
            "started the trace), so two threads cannot trace one model at once. Run the traces one after "
            "another (e.g. a threading.Lock around each `with model.trace(...)` block) or give each thread "
            "its own model object.")


# ------------------------------------------------------------------ remote
class SerializingRemoteBackend(RemoteBackend):
    """nnsight's ``RemoteBackend`` with its private serialization step (``_serialize``: the request's
    bytes, which ``request`` and ``submit`` call) under a public name, :meth:`serialize_request`, for a
    subclass to measure or keep."""

    def _serialize(self, tracer: Any) -> bytes:
        return self.serialize_request(tracer)

    def serialize_request(self, tracer: Any) -> bytes:
        """The request's bytes, as nnsight serializes them (override to measure; call ``super()``).

        Source: ours (the nnsight 0.8.1 internals this package relies on, in one place).
        """
        return RemoteBackend._serialize(self, tracer)


def install_remote_backend(cls: type | None) -> None:
    """Make ``remote=True`` traces build ``cls`` (a ``RemoteBackend`` subclass): nnsight looks the name
    ``RemoteBackend`` up in ``nnsight.intervention.backends.remote`` when it builds one; None: nnsight's own."""
    from nnsight.intervention.backends import remote as remote_backends

    remote_backends.RemoteBackend = RemoteBackend if cls is None else cls  # type: ignore[misc]


def remote_env(model: Any) -> dict:
    """The per-request environment nnsight sends with a remote request of ``model``."""
    return model._remoteable_get_env()


def sent_by_reference(module: nn.Module) -> bool:
    """Whether nnsight's pickler sends ``module`` by reference (a module of the model, tagged with a
    persistent id) rather than by value."""
    return PERSISTENT_ID in module.__dict__


def block_names(tracer: Any, where: str = "block_names") -> dict[str, Any]:
    """The globals and locals the captured block of ``tracer`` references, by name: what nnsight's
    ``RequestModel.serialize`` will pickle (its own reduction, ``reduce_block``).

    Raises:
        ArgumentError: ``tracer`` not a captured nnsight trace or session (no ``info``), naming ``where``."""
    from nnsight.intervention.serialization import reduce_block

    if getattr(tracer, "info", None) is None:
        raise ArgumentError(f"{where}: tracer must be a captured nnsight trace or session (the object of "
                            f"`with model.trace(...) as tracer`), got a {type(tracer).__name__}")
    frame = tracer.info.frame
    _, used_globals, used_locals = reduce_block(tracer.node, frame.f_globals, dict(frame.f_locals))
    return {**used_globals, **used_locals}


def block_body(tracer: Any) -> list[Any]:
    """The statements (``ast.stmt``) of the captured ``with`` block of ``tracer`` (``tracer.node.body``): the code
    nnsight unparses and sends for a remote trace or session, read here without running it."""
    return list(tracer.node.body)


def serialize(obj: Any) -> bytes:
    """``obj`` pickled by nnsight's serializer (``nnsight.intervention.serialization.dumps``)."""
    from nnsight.intervention.serialization import dumps

    return dumps(obj)


def request_envelope(model_key: str, compress: bool, env: dict) -> Any:
    """The envelope (``RequestModel``) nnsight sends with a request's bytes."""
    from nnsight.schema.request import RequestModel

    return RequestModel(model_key=model_key, compress=compress, env=env)
