"""Splice one replacement into one or several sites of a traced model, in execution order, for one trace.

The shared mechanism behind ``LorsaSet.replace`` (attention), transcoders (MLP), SAEs (hook points) and
cross-layer transcoders. Called from inside a ``model.trace(...)`` body, :func:`splice_chain`:

1. makes the replacement module an envoy of this trace under :attr:`SpliceChain.attach_path` (it and its
   :class:`~..modules.hook_point.HookPoint` children), without adding it to the model's modules
   (:func:`~.nnsight_internals.attach`: NDIF refuses ``setattr`` on the model's modules);
2. starts a per-trace worker (:mod:`.nnsight_internals`) that parks on the sites' inputs and outputs, calls
   the replacement *observed* (its internals are served to the trace body, which can read and edit them), and
   swaps each site's output for the replacement's;
3. with ``error=True`` adds the error term (below; the error node of attribution graphs, Ameisen et al. 2025,
   *Circuit Tracing*: error nodes);
4. detaches the module when the worker ends — after its last swap, or when nnsight unwinds it because the trace
   raised. Nothing survives the trace: no hook, no envoy, no controller.

With several sites, the replacement visits the sites of :attr:`SpliceChain.site_paths` one after the other and
carries a ``state`` dict from one to the next — a cross-layer transcoder encodes MLP ``l``'s input at site ``l``
and decodes the features of every layer ``≤ l'`` into MLP ``l'``'s output; each step also receives the site's true
output — an SAE reconstructs it.

Rows: called inside ``tracer.invoke(...)`` it replaces that invoke's rows only — the module computes on the whole
batch and each site writes back only the rows of the invokes that called it (the others keep the site's own output
bit for bit; :func:`splice_chain`).

The worker serves every forward pass of the run, in order: one for ``model.trace``, one per
generated token for ``model.generate`` (the prompt, then each cached decoding step), so the
replacement applies to every token; it ends quietly when the run is over.

Error terms (``error=True``): at every site, ``e_i = true_output_i − clean_i`` goes through the
module's ``error_hook(module, i)``, where ``clean_i`` is the replacement computed without edits
(the state of the clean pass holds clean features of earlier sites). The site then returns
``true_i + (out_i − clean_i) + (hook_error(e_i) − e_i)``, summed in fp32 and cast to the site's
dtype: without edits that is ``true_i`` **bit for bit** in every dtype (bf16 and fp16 included: the
error term is never rounded to the model's dtype), and an edit to the module's internals at any site
changes every later site's output by exactly the edited replacement's change. ``hook_error`` carries
``e_i`` in fp32, on the site's device. Until some intervention may edit the module's internals the
clean pass is the live one; from the first site where one may, the clean pass runs separately with
the trace stood down (nothing served or edited).

Placement (one rule for every replacement kind): the module runs on the device of the first site it
serves — a module elsewhere is moved there (``module.to(device)``, in place, once) when it is first
served — and in its own dtype; a step casts the site's input to the module's device and dtype
(:func:`~.._placement.to_module`), and the replacement's output is cast back to the site's device and dtype
before it is returned into the model. A module whose weights were never materialised (``meta``) raises
:class:`~..errors.PlacementError` naming the module and the device the site runs on; so does a site input
past the module dtype's range (an fp16 module on a wider model: :func:`~.._placement.to_module`), naming
the site, and so does a replacement's output past the site dtype's range (an fp32 / bf16 module's output, or an
edited one, above fp16's 65504 on an fp16 model: :func:`to_site`), and so does an fp16 replacement's output that
holds ``inf`` or NaN (it overflowed inside, or an edit of its internals was cast past 65504: :func:`check_overflow`,
one read per site for fp16 modules only; bf16 / fp32 modules' outputs are not read). An *offloaded*
module (``ReplacementSet.offload``: weights on the host) is not moved: at each site, for that site's step
only (the clean pass's too), its weights are copied to the site's device and dropped after
(:class:`~.._placement.resident`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from .._placement import offloaded, overflowed, past_range, place, resident
from .._repr import FieldsRepr
from ..errors import ArgumentError, InvokeRowsError, LorsaError, PlacementError, TraceOrderError
from ..modules.sparse_coder import end_encoder_matmul, share_encoder_matmul
from .nnsight_internals import (
    SPLICE_TAG,
    attach,
    batch_rows,
    current_worker,
    detach,
    enclosing,
    find_worker,
    inside_now,
    invoke_rows,
    is_envoy,
    is_instrumented,
    is_splice,
    park_or_end,
    pinned_step,
    ran_since_start,
    serve_first,
    serve_last,
    skip_gate,
    spawn_worker,
    stood_down,
    waiting_under,
)

#: ``(module, i, args, kwargs, true_output, state) -> output``: the replacement's output at site ``i``.
Step = Callable[[nn.Module, int, tuple, dict, torch.Tensor, dict], torch.Tensor]


def to_site(value: torch.Tensor, true_out: torch.Tensor, what: str) -> torch.Tensor:
    """``value`` cast to ``true_out``'s device and dtype, the output the site returns into the model.

    A cast to a narrower exponent range (an fp32 / bf16 module's output onto an fp16 model's site; fp64 onto
    fp32 / bf16) that would turn a finite value into ``inf`` is refused: the model would compute NaN from there
    on (:func:`~.._placement.past_range`, one read only for such a cast). ``what`` names the value in the error.

    Raises:
        PlacementError: ``value`` holds finite values past ``true_out``'s dtype's range (names ``what``, both
            dtypes and the largest value).
    """
    big = past_range(value, true_out.dtype)
    if big is not None:
        raise PlacementError(f"{what} holds values beyond the site's dtype {true_out.dtype} (max |x| = {big:.4g} > "
                             f"{torch.finfo(true_out.dtype).max:.4g}): cast to it they would be inf and the model "
                             "would compute NaN; run the model in a wider dtype (torch.bfloat16 or torch.float32) or "
                             "keep the replacement's output (its weights, the edit) within the site's range")
    return value.to(device=true_out.device, dtype=true_out.dtype)


def check_overflow(value: torch.Tensor, true_out: torch.Tensor, what: str) -> None:
    """Refuse an fp16 replacement output that holds ``inf`` or NaN before it enters the model (where it would make
    the logits NaN, with error terms too: ``inf − inf``). An fp16 module overflows from finite inputs and finite
    weights (a sum past 65504), and an edit of its internals is cast to fp16 by nnsight or torch without a range
    check (``hook.output[:] = big``, ``*= 1e7``), so both end here. Reads one value (a device sync) only for an
    fp16 ``value`` (:func:`~.._placement.overflowed`); a bf16 / fp32 / fp64 one is not read. ``what`` names the
    value (site and module) in the error.

    Raises:
        PlacementError: ``value`` is fp16 and holds ``inf`` or NaN; the message says whether the site's own output
            (``true_out``, read only then) is finite, i.e. whether the replacement made them.
    """
    if not overflowed(value):
        return
    if bool(torch.isfinite(true_out).all()):
        why = ("the model's own output there is finite, so the replacement made them: its forward overflowed fp16's "
               "range (|x| <= 65504) or an edit of its internals wrote a value past it (nnsight and torch cast an "
               "assignment to fp16 without a range check). Cast the replacement to a wider dtype "
               "(module.to(torch.float32) or torch.bfloat16; the splice casts its input and output), or keep edits "
               "within fp16's range")
    else:
        why = ("the model's own output there is not finite either: the model overflowed before or at this site. Run "
               "the model in a wider dtype (torch.bfloat16 or torch.float32)")
    raise PlacementError(f"{what} holds inf or NaN; {why}")


def with_error(true_out: torch.Tensor, out: torch.Tensor, clean_out: torch.Tensor,
               hook: nn.Module, what: str = "the replacement's output with its error term", *,
               edited: bool = True, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The site's output with the error term: ``true + (out − clean) + (hook(e) − e)``, ``e = true − clean``.

    Summed in fp32 (float64 kept) and returned in ``true_out``'s dtype on its device: without edits (``out`` is
    ``clean``, ``hook`` returns ``e``) the result is ``true_out`` bit for bit. With ``edited`` (something may have
    edited the module's internals or its error) the cast is :func:`to_site`'s, checked for the site dtype's range
    (``what`` names the sum in its error); without, nothing can leave ``true_out``'s values and the cast is
    unchecked (no read). Gradients reach ``out`` and ``hook``'s output, never ``true_out`` or ``clean_out``
    (held fixed). ``rows`` (an int64 index on ``true_out``'s device; None: all): ``hook`` still sees every row
    of the batch (nnsight scopes it to each reader's invoke), but only these rows of the sum are cast, checked
    and returned (``(len(rows), …)``).

    Raises:
        PlacementError: an edit took the sum past the range of ``true_out``'s dtype (fp16's 65504).
    """
    work = torch.promote_types(true_out.dtype, torch.float32)
    true = true_out.detach().to(work)
    clean = clean_out.detach().to(device=true.device, dtype=work)
    e = true - clean
    hooked = hook(e.clone())  # an edit in place (``hook_error.output[:] = …``) must not change ``e``
    total = true + (out.to(device=true.device, dtype=work) - clean) + (hooked.to(work) - e)
    if rows is not None:
        total, true_out = total.index_select(0, rows), true_out.index_select(0, rows)
    return to_site(total, true_out, what) if edited else total.to(true_out.dtype)


class InvokeRows:
    """The rows of a trace's batch that a splice replaces: every row, or those of the ``tracer.invoke`` blocks
    that called ``replace()`` (nnsight's ``[start, size]`` row ranges, :func:`~.nnsight_internals.invoke_rows`).

    Attributes:
        all: every row (a call from ``model.trace(prompt)``'s implicit invoke, an empty ``tracer.invoke()``, a
            trace whose one invoke brings every row).
        groups: the ``(start, size)`` ranges of the invokes that called it (when not ``all``).
    """

    def __init__(self) -> None:
        self.all = False
        self.groups: list[tuple[int, int]] = []

    def covers(self, group: tuple[int, int] | None) -> bool:
        """Whether every row of ``group`` (None: the whole batch) is replaced."""
        if self.all:
            return True
        if group is None:
            return False
        start, size = group
        return all(any(s <= r < s + n for s, n in self.groups) for r in range(start, start + size))

    def add(self, group: tuple[int, int] | None) -> None:
        """Replace the rows of ``group`` too (None: every row)."""
        if group is None:
            self.all = True
        elif not self.covers(group):
            self.groups.append(group)

    def overlaps(self, other: InvokeRows) -> bool:
        """Whether some row is replaced by both (``all`` overlaps everything, an empty set nothing)."""
        if self.all or other.all:
            return bool(self.all or self.groups) and bool(other.all or other.groups)
        return any(s < t + m and t < s + n for s, n in self.groups for t, m in other.groups)

    def with_group(self, group: tuple[int, int] | None) -> InvokeRows:
        """A copy with the rows of ``group`` added."""
        out = InvokeRows()
        out.all, out.groups = self.all, list(self.groups)
        out.add(group)
        return out

    def index(self, total: int | None, device: torch.device) -> torch.Tensor | None:
        """The replaced rows as an int64 index on ``device``, None when that is every row of the ``total``."""
        if self.all or total is None:
            return None
        rows = sorted({r for s, n in self.groups for r in range(s, s + n)})
        return None if len(rows) == total else torch.tensor(rows, dtype=torch.int64, device=device)

    def describe(self) -> str:
        return "every row" if self.all else "rows " + ", ".join(f"[{s}, {s + n})" for s, n in sorted(self.groups))


def describe_rows(group: tuple[int, int] | None) -> str:
    """How messages name an invoke's rows (None: the whole batch, e.g. an empty ``tracer.invoke()``)."""
    return "the whole batch (an empty tracer.invoke(), an edit or a worker)" if group is None else \
        f"rows [{group[0]}, {group[0] + group[1]})"


@dataclass(frozen=True, repr=False)
class SpliceChain(FieldsRepr):
    """Where and how a replacement is spliced into a sequence of sites.

    Attributes:
        site_paths: envoy paths of the modules whose outputs are replaced, in the order the
            model runs them, e.g. ``("model.layers.0.mlp", "model.layers.1.mlp")``.
        attach_path: envoy path the module's envoy sits under (``""``: the root model).
        attach_name: the name its envoy takes there, e.g. ``"clt"``.
        step: :data:`Step`; ``state`` is a dict private to one pass (live or clean) that the
            step may add entries to (it must not mutate values it stored at earlier sites). It
            lives as long as the trace: the forward passes of a run (the steps of a generation)
            share it, e.g. a Lorsa's :class:`~..modules.lorsa.LorsaKV` of the earlier tokens.
        get_output: the tensor to replace, from a site's return value.
        set_output: a site's return value with that tensor replaced.
        error_hook: ``(module, i) -> nn.Module`` carrying site ``i``'s error term.
        check_call: optional ``(args, kwargs) -> None`` raising on unsupported calls.
        input_paths: optional, one envoy path per site: the module whose call's ``(args, kwargs)`` the step
            receives instead of the site's own — a module the model runs after the previous site's and before this
            one's output (a transcoder reading ``hook_resid_mid`` or GemmaScope's ``ln2.hook_normalized``: the pre-MLP
            norm, whose input is the residual before the norm). None: each site's own inputs.
        reads_output: the step hands the site's own output to the module (an SAE reconstructs it); False: the step
            computes from the site's inputs only (a Lorsa, a transcoder, a CLT) and so, without an error term,
            overwrites the site's output unread — :func:`splice_chain` refuses to splice such a chain where another
            replacement's output at the same site (spliced before it) or at a module inside the site would be lost.
    """

    site_paths: tuple[str, ...]
    attach_path: str
    attach_name: str
    step: Step
    get_output: Callable[[Any], torch.Tensor]
    set_output: Callable[[Any, torch.Tensor], Any]
    error_hook: Callable[[nn.Module, int], nn.Module]
    check_call: Callable[[tuple, dict], None] | None = None
    input_paths: tuple[str, ...] | None = None
    reads_output: bool = False


def splice_chain(root: Any, chain: SpliceChain, module: nn.Module, *, error: bool = False) -> Any:
    """Replace the outputs of ``chain``'s sites by ``module``'s for the current trace; return its envoy.

    Must be called inside a ``model.trace(...)`` body before the model reaches the first site.

    Rows: the sites are replaced for the rows of the batch whose intervention called this — inside
    ``tracer.invoke(...)`` that invoke's rows (nnsight's ``Mediator.batch_group``,
    :func:`~.nnsight_internals.invoke_rows`); in ``model.trace(prompt)``'s body, an empty ``tracer.invoke()`` or a
    trace whose one invoke brings every row, the whole batch. Calling it again for the same chain in the same trace
    (the same module and ``error``, e.g. from another invoke) returns the same envoy, splices once and adds the
    caller's rows. The module computes on every row of the batch (its inputs there are the model's own); at each
    site only the replaced rows of its output are written back (``index_copy``), so the other rows keep the site's
    own output bit for bit (and their gradient path). A trace body reading or editing the module's internals
    (``envoy.hook_z.output`` …) from rows it does not replace — values computed for no row the model uses — makes
    the run raise :class:`~..errors.InvokeRowsError` when the model reaches the site.

    Raises:
        TraceOrderError: called outside a trace.
        ArgumentError: ``root`` is not an nnsight model (a set built on a bare Hugging Face model: such a set serves
            attribution from a cache only); the chain is already spliced in this trace with another module or
            ``error`` flag; or its output or another splice's would never reach the model (:func:`_check_not_lost`: a
            chain that does not read its site's output, without an error term, spliced after another one at the same
            site or around one inside its site's module, for rows they share).
        LorsaError: ``error=True`` but ``chain.error_hook`` gives no module for some site.
        TraceOrderError: the model already ran one of the sites in this forward pass (for the caller's rows, when
            another invoke spliced the chain first), or the parent already has a child module or envoy named
            ``chain.attach_name``; or first called inside ``tracer.iter[...]`` at a step after the first (the
            splice serves every step).
        InvokeRowsError: in the run, at a site: its internals are read or edited from rows it does not replace,
            or only some rows are replaced and the site's output is not batch-first (beam search).
    """
    if not is_envoy(root):
        raise ArgumentError(f"a replacement set built on a {type(root).__name__} cannot splice: build the set on the "
                            "nnsight model you trace (e.g. LanguageModel(hf, tokenizer=...)); a set of a bare model "
                            "serves attribution from a cache only")
    if not chain.site_paths:
        raise LorsaError("a splice chain needs at least one site")
    for i in range(len(chain.site_paths)) if error else ():
        try:
            hook = chain.error_hook(module, i)
        except (AttributeError, IndexError):
            hook = None
        if not isinstance(hook, nn.Module):
            raise LorsaError(f"{type(module).__name__} has no error hook module for site {i}: "
                             "it cannot carry an error term")
    me = current_worker("splice_chain")
    interleaver = me.interleaver
    parent = root.get(chain.attach_path) if chain.attach_path else root
    tag = (*SPLICE_TAG, chain.site_paths, chain.attach_path, chain.attach_name)
    group = invoke_rows(me)
    sites = [root.get(path) for path in chain.site_paths]
    if chain.input_paths is not None and len(chain.input_paths) != len(sites):
        raise LorsaError(f"a splice chain needs one input path per site, got {len(chain.input_paths)} for "
                         f"{len(sites)} sites")
    readers = sites if chain.input_paths is None else [root.get(path) for path in chain.input_paths]
    existing = find_worker(interleaver, tag)
    if existing is not None:
        spliced, spliced_error = getattr(existing, "spec", (module, error))
        if spliced is not module or spliced_error != error:
            what = (f"error={spliced_error}" if spliced is module else f"another {type(spliced).__name__}")
            raise ArgumentError(
                f"{chain.site_paths[0]} is already replaced in this trace ({what}); a site is spliced once per "
                f"trace (every invoke that replaces it shares that splice), so this replace(..., error={error}) "
                "cannot apply. Call replace() with one module and error flag per site in a trace (a new trace "
                "for another setting)")
        rows: InvokeRows = existing.rows
        if not rows.covers(group):  # a further invoke: its rows too, if the model has not run the sites yet
            _check_not_started(me, chain, sites, f" for {describe_rows(group)}", readers)
            _check_not_lost(interleaver, existing, chain, module, error, rows.with_group(group))
            rows.add(group)
        return getattr(parent, chain.attach_name)
    _check_not_started(me, chain, sites, "", readers)
    rows = InvokeRows()
    rows.add(group)
    _check_not_lost(interleaver, None, chain, module, error, rows)
    # undoes the attachment (and nnsight's instrumentation, unless the module had it before)
    undo = partial(detach, parent, chain.attach_name, module, is_instrumented(module))
    envoy = attach(parent, chain.attach_name, module)

    # the module enclosing each site whose ``.skip(...)`` would bypass it (a decoder layer): watched before the site
    gate_below = [enclosing(root, path, reader.path) for path, reader in zip(chain.site_paths, readers, strict=True)]
    gates = [None if g is None else root.get(g).path for g in gate_below]
    inside = gates[0] is not None and inside_now(me, gates[0])  # replace() called within it: gate passed

    def body() -> None:
        live: dict = {}
        clean: dict = {}
        diverged = False  # whether the clean pass must run apart from the live one
        try:
            first = True
            while True:  # every forward pass of the run: each generation step
                for i, (site, reader) in enumerate(zip(sites, readers, strict=True)):
                    if not (first and i == 0):  # (spawned last: the first time it is there already)
                        serve_last(worker)  # the input as the body's edits left it
                    gate = gates[i]
                    if gate is not None and not (first and i == 0 and inside):
                        more, skipped = park_or_end(partial(skip_gate, gate))
                        if not more:
                            return
                        if skipped:  # the site does not run in this forward pass
                            refuse_skipped(i, gate)
                            # past the skipped call (a wait on the gate now would be this same visit's)
                            more, _ = park_or_end(partial(getattr, root.get(gate_below[i]), "output"))
                            if not more:
                                return
                            continue
                    more, call = park_or_end(partial(getattr, reader, "inputs"))
                    if not more:  # the run is over: no further step, or a tracer.stop() before this site
                        return  # (nnsight's warning about a tracer.iter loop that outran the run would be wrong)
                    args, kwargs = call
                    diverged = serve(i, site, args, kwargs, live, clean, diverged)
                first = False
        finally:
            undo()

    def refuse_skipped(i: int, gate: str) -> None:
        """Site ``i`` is bypassed in this forward pass: the trace skipped ``gate``, the module holding it. The site
        returns nothing of the replacement (the skip value is the module's output, as without it); refuse what would
        be silently wrong: the trace body reading or editing the replacement's internals there (they are never
        computed; nnsight's ``OutOfOrderError`` said the model "ran past" them), and a chain whose later sites use
        this one's state (a cross-layer transcoder decodes layer ``i``'s features into every later MLP)."""
        where = (f"the trace skipped {gate} ({gate}.skip(...)), which holds {chain.site_paths[i]}: the "
                 f"{type(module).__name__} replacing it does not run in that forward pass")
        waiting = waiting_under(interleaver, f"{envoy.path}.")
        if waiting:
            raise TraceOrderError(
                f"{envoy.path}: read or edited, but {where}, so its internals have no value there. Read them in a "
                f"trace that does not skip {gate}, or skip the replacement's site alone (its output is then the "
                "skip value, its internals computed)")
        if i < len(sites) - 1:
            raise TraceOrderError(
                f"{where}, and its later sites ({', '.join(chain.site_paths[i + 1:])}) decode what it computes there "
                f"(a cross-layer transcoder's features of that layer): they would be replaced without them. Skip a "
                f"layer outside the {type(module).__name__}'s layers, or do not replace() it in this trace")

    def serve(i: int, site: Any, args: tuple, kwargs: dict, live: dict, clean: dict, diverged: bool) -> bool:
        """Swap site ``i``'s output in this forward pass; return whether the clean pass now runs apart."""
        if chain.check_call is not None:
            chain.check_call(args, kwargs)
        serve_first(worker)  # the swap before the body's reads and edits of the site's output (they see the swap)
        original = site.output
        true_out = chain.get_output(original)
        if i == 0 and not offloaded(module):
            place(module, true_out.device, chain.site_paths[0])
        waiting = waiting_under(interleaver, f"{envoy.path}.")  # also re-indexes who waits where
        for reader in waiting:
            if not rows.covers(invoke_rows(reader)):
                raise InvokeRowsError(
                    f"{envoy.path}: read or edited from an intervention on {describe_rows(invoke_rows(reader))}, "
                    f"but replace() for {chain.site_paths[0]} was called for {rows.describe()} of the batch only: "
                    "the replacement's values on other rows are computed for nothing the model uses. Call "
                    "replace() in that invoke too (it returns the same envoy), or once in an empty "
                    "tracer.invoke() to replace every row")
        idx = rows.index(batch_rows(interleaver), true_out.device)
        if idx is not None and true_out.shape[0] != batch_rows(interleaver):
            raise InvokeRowsError(
                f"cannot replace {chain.site_paths[i]} for {rows.describe()} only: its output's first dimension "
                f"({true_out.shape[0]}) is not the batch's {batch_rows(interleaver)} rows (beam search, or a "
                "layout that is not batch-first), so the invokes' rows cannot be told apart. Call replace() in "
                "every invoke, or once in an empty tracer.invoke()")
        diverged = diverged or (error and bool(waiting))
        clean_out = None
        true_kept = true_out
        try:
            with resident(module, true_out.device):  # an offloaded module: on the site's device for this step only
                # two passes: one encoder matmul (of a sparse coder, on the same unedited input) for both
                shared = diverged and share_encoder_matmul(module)
                try:
                    if diverged:
                        clean_out = stood_down(interleaver, partial(chain.step, module, i, args, kwargs, true_out,
                                                                    clean))
                    if error and diverged and chain.reads_output:
                        # the module's input is the site's output itself: an edit of it in place (``sae.input[...] +=``)
                        # must reach the module, not the error term's true output (an assigned one never does)
                        true_kept = true_out.clone()
                    out = chain.step(module, i, args, kwargs, true_out, live)  # observed by the trace
                finally:
                    if shared:
                        end_encoder_matmul(module)
        except PlacementError as e:  # e.g. an input past an fp16 module's range (to_module): name the site
            raise PlacementError(f"at {chain.site_paths[i]}: {e}") from e
        what = f"at {chain.site_paths[i]}: the {type(module).__name__}'s output ({out.dtype})"

        def pick(t: torch.Tensor) -> torch.Tensor:  # the replaced rows only (the module ran on every row)
            return t if idx is None else t.index_select(0, idx.to(t.device))

        check_overflow(pick(out), pick(true_out), what)
        if clean_out is not None:  # the clean pass ran apart: the error term subtracts it
            check_overflow(pick(clean_out), pick(true_out), what.replace("output", "output without edits", 1))
        if error:
            if clean_out is None:  # nothing could edit so far: the clean pass is the live one
                clean.clear()
                clean.update(live)
                clean_out = out
            out = with_error(true_kept, out, clean_out, chain.error_hook(module, i), what + " with its error term",
                             edited=diverged, rows=idx)  # not diverged: nothing could edit, the sum is true_out
        else:
            out = to_site(pick(out), pick(true_out), what)
        if idx is not None:  # the other invokes' rows: the site's own output, bit for bit
            out = true_kept.index_copy(0, idx, out)
        site.output = chain.set_output(original, out)
        return diverged

    try:
        earlier = frozenset(m.tag for m in interleaver.mediators if is_splice(m) and m.alive)
        worker = spawn_worker(interleaver, body, tag)
        # what _check_not_lost reads: the splices declared before this one (at one site they swap first)
        worker.spec, worker.rows, worker.chain, worker.earlier = (module, error), rows, chain, earlier
    except BaseException:
        undo()
        raise
    return envoy


def _check_not_lost(interleaver: Any, this: Any, chain: SpliceChain, module: nn.Module, error: bool,
                    rows: InvokeRows) -> None:
    """Refuse a splice (``chain`` with ``module``; ``this``: its worker when it exists already and gains ``rows``) that,
    together with another splice of the trace on rows both replace, would make one replacement's output never reach
    the model: a chain that does not read its site's output (a Lorsa, a transcoder, a CLT), without an error term,
    overwrites that output unread — so a replacement spliced before it at the same site (they swap in the order they
    were spliced) and one at a module inside its site (run before the site returns) are computed, served to the trace
    and editable for nothing. Spliced the other way round at one site, or with an error term (which then carries the
    other's output), both reach the model. Nothing is read: the check runs on the host at ``replace()``.

    Raises:
        ArgumentError: names both replacements, their sites and the ways out.
    """
    tag = None if this is None else this.tag
    for other in interleaver.mediators:
        if not is_splice(other) or not other.alive or other.tag == tag or not hasattr(other, "chain"):
            continue
        if not other.rows.overlaps(rows):
            continue
        other_module, other_error = other.spec
        # ``first`` swaps before ``second`` at a site they share
        this_first = this is not None and this.tag in other.earlier
        mine = (chain, module, error)
        theirs = (other.chain, other_module, other_error)
        first, second = (mine, theirs) if this_first else (theirs, mine)
        for lost, over, same in _lost_outputs(first, second):
            lost_chain, lost_module, _ = lost
            over_chain, over_module, _ = over
            lost_name, over_name = type(lost_module).__name__, type(over_module).__name__
            hint = (f"splice the {over_name} first (an {lost_name} spliced after it at that site reconstructs its "
                    "output: ReplacementModel.replace's order), " if same and lost_chain.reads_output else "")
            raise ArgumentError(
                f"the {lost_name} at {lost_chain.site_paths[0]} would never reach the model: the {over_name} at "
                f"{over_chain.site_paths[0]} replaces {'that same output' if same else 'what it feeds'} from its own "
                f"inputs, without an error term, for rows both replace, so the {lost_name} would be computed, read "
                f"and edited for nothing. To keep both, {hint}pass error=True to the {over_name} (its error term then "
                f"carries the {lost_name}'s output), or splice them in separate traces or invokes")


def refuse_discarded_edit(path: str, what: str) -> None:
    """Refuse an edit of the model's own module at envoy path ``path`` (``what``: the edited target, for the message)
    from the calling trace body when a splice of this trace discards it: a replacement that does not read its site's
    output (a Lorsa, a transcoder, a CLT), without an error term, spliced at a module containing ``path``, on rows
    the calling invoke edits — its site's output is then computed from the site's input alone, so the edit would
    move nothing, without a word (e.g. ``ablate(r(MHSAHead(1, 0)))`` under a Lorsa on layer 1 with
    ``error=False``: the logits moved by 0.0). With an error term the edit reaches the model through it; a splice
    made later in the body cannot start once the model has run the edited module (:func:`_check_not_started`).
    Nothing is read: the check runs on the host.

    Raises:
        ArgumentError: names the edit, the replacement and its site, and the ways out.
        TraceOrderError: called outside a trace body.
    """
    me = current_worker("an edit")
    rows = InvokeRows()
    rows.add(invoke_rows(me))
    for other in me.interleaver.mediators:
        if not is_splice(other) or not other.alive or not hasattr(other, "chain"):
            continue
        module, error = other.spec
        if error or other.chain.reads_output or not other.rows.overlaps(rows):
            continue
        site = next((p for p in other.chain.site_paths if path.startswith(p + ".")), None)
        if site is not None:
            name = type(module).__name__
            raise ArgumentError(
                f"{what} (at {path}) would be discarded: the {name} replacing {site} in this trace, without an error "
                f"term, computes that output from the site's input alone, so the edit would move nothing. Edit it "
                f"with the {name} spliced with error=True (its error term carries the edit), or in a trace or invoke "
                f"that does not replace {site}")


def _lost_outputs(first: tuple, second: tuple) -> list[tuple[tuple, tuple, bool]]:
    """``[(lost, over, same_site)]`` for two splices ``(chain, module, error)``, ``first`` swapping before ``second``
    at a site they share: the one whose output the other (reading no site output, without an error term) overwrites
    unread — at the same site (spliced before it) or at a module inside one of its sites. (A module whose input the
    other reads in place of its site's, ``input_paths``, is left alone: its output is the site's own input, which the
    other may be meant to bypass — a ``hook_resid_mid`` transcoder beside an SAE on the pre-MLP norm.)"""
    found = []
    for lost, over in ((first, second), (second, first)):
        over_chain, _, over_error = over
        if over_chain.reads_output or over_error:
            continue
        for q in lost[0].site_paths:
            for p in over_chain.site_paths:
                if q.startswith(p + ".") or (q == p and over is second):
                    found.append((lost, over, q == p))
    return found[:1]


def _check_not_started(me: Any, chain: SpliceChain, sites: list, whom: str, readers: list) -> None:
    """Refuse to start replacing ``chain``'s sites (``whom``: for which rows) once the model has run one of them in
    this trace's run — or one of ``readers``, the modules whose input the replacement reads where that is not the
    site (``chain.input_paths``) —, or from a generation step after the first (the calling worker ``me``'s
    ``tracer.iter`` pin).

    Raises:
        TraceOrderError: names the site and the fix.
    """
    if pinned_step(me) != 0:  # first called in a tracer.iter[...] loop, at a step after the first
        raise TraceOrderError(
            f"cannot start replacing {chain.site_paths[0]}{whom} at a later generation step (tracer.iter / "
            "tracer.all): a replacement serves every forward pass of the trace, so it cannot leave the "
            "earlier steps out. Call replace() once before the loop (it applies to every step of the "
            "generation) and read or edit its hook points inside the loop")
    for path, site in zip(chain.site_paths, sites, strict=True):
        if ran_since_start(me, site.path) > 0:
            raise TraceOrderError(f"cannot replace {path}{whom}: the model already ran it in this forward pass; "
                                  "call replace() before reading anything at or after that site")
    for reader in readers if chain.input_paths is not None else ():
        if ran_since_start(me, reader.path) > 0:
            raise TraceOrderError(f"cannot replace {chain.site_paths[0]}{whom}: the model already ran {reader.path} "
                                  "(whose input the replacement reads) in this forward pass; call replace() before "
                                  "reading anything at or after that site")
