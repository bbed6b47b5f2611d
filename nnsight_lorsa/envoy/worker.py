"""A per-trace worker that runs a Python function in step with the model.

nnsight runs each intervention block as a *mediator* (a greenlet that parks on the locations it
reads or writes). A replacement module's internals are observable only when the module is
called from a *different* worker than the one reading them (nnsight docs,
``patterns/sae-and-auxiliary-modules.md``: "the edit runs the SAE call, and the trace body
parks on sae.encoder.output"). ``model.edit()`` gives such a worker but persists across
traces; :func:`spawn_worker` gives one for the current trace only: it is added to the running
interleaver, parks like any intervention, and is unwound by nnsight's own ``cancel()`` when
the trace ends, normally or by an error — so nothing it sets up outlives the trace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nnsight.intervention.interleaver import Mediator


class FunctionWorker(Mediator):
    """A :class:`~nnsight.intervention.interleaver.Mediator` whose body is ``fn()``.

    ``batch_group`` is None: the worker sees the whole batch (all invokes), like an edit.
    ``tag`` identifies what it does (used to find an existing worker for the same site).
    """

    def __init__(self, fn: Callable[[], None], tag: Any) -> None:
        super(FunctionWorker, self).__init__(None, {}, {})
        self.fn = fn
        self.tag = tag
        self.batch_group = None

    def _run(self) -> None:
        self.fn()


def current_worker(what: str) -> Mediator:
    """The intervention worker running now (raises ``ValueError`` outside a trace)."""
    return Mediator.current(what)


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
