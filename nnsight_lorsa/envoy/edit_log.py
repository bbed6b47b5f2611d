"""Which targets the interventions of one trace edited: what an intervened-pass attribution marks.

``attribute(rm, tracer=tracer)`` (:mod:`nnsight_lorsa.attribution.intervened`) starts a recorder worker in
the running trace whose ``spec`` is an :class:`EditLog`; the interventions of :mod:`nnsight_lorsa.patching`
(``ablate``, ``scale``, ``steer``, ``patch``) call :func:`note_edit` after each edit, which hands the target
and its positions to that log (and does nothing in a trace without one). The log checks that the graph can
hold the edit and refuses, inside the trace body, one it cannot. torch-free; no nnsight import of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._repr import FieldsRepr
from ..errors import TraceOrderError
from .nnsight_internals import current_worker, find_worker
from .targets import Positions, Target

#: the worker tag of the recorder an intervened-pass attribution starts in a trace
EDIT_LOG_TAG = "nnsight_lorsa.intervened_attribution"


@dataclass(frozen=True, repr=False)  # FieldsRepr: no _thread in a request (NDIF's whitelist)
class Edit(FieldsRepr):
    """One intervention: its target and the positions it edited (None: all)."""

    target: Target
    positions: Positions


class EditLog:
    """The edits of one trace, in the order they were made.

    Args:
        check: ``check(target)`` raises a named error for a target whose edit the graph cannot hold
            (called inside the trace body, at the edit).
    """

    def __init__(self, check: Callable[[Target], None]) -> None:
        self.check = check
        self.edits: list[Edit] = []

    def note(self, target: Target, positions: Positions) -> None:
        self.check(target)
        self.edits.append(Edit(target, positions))


def note_edit(target: Target, positions: Positions, what: str) -> None:
    """Inside a trace body, after ``what`` (an intervention) edited ``target`` at ``positions``: hand the edit
    to the trace's :class:`EditLog`, if an intervened-pass attribution records this trace.

    Raises:
        ConfigMismatchError (from the log's check): an edit the attribution graph cannot hold.
    """
    try:
        worker = current_worker(what)
    except TraceOrderError:  # no trace body running this edit (e.g. one replayed by model.edit()): no recorder
        return
    recorder: Any = find_worker(worker.interleaver, EDIT_LOG_TAG)
    if recorder is not None:
        recorder.spec.note(target, positions)
