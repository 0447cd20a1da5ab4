"""The region engine: torch's non-reentrant checkpoint plus scoped contexts.

A region is ``torch.utils.checkpoint.checkpoint(use_reentrant=False,
context_fn=...)`` whose forward context records the region's tape and whose
recompute context replays it (see NOTE [ tape ] in ``_state.py``).

NOTE [ region mechanisms ]
==========================
Everything a region does besides running its function is a *mechanism*: one
private module implementing :class:`Mechanism`, listed once in
:data:`MECHANISMS`. The engine knows none of them by name:

* ``start_region(tape, call)`` runs once, when the region starts, puts the
  mechanism's state on the tape (a field of :class:`Tape` the mechanism owns)
  and says whether the mechanism acts in the region's frames;
* ``enter_frame(frame)`` runs at every entry of such a region (its first
  forward, and each recompute, on any thread) and returns what undoes it, an
  ``__exit__``-like callable, or None when it has nothing to do there. It is
  called only in the phases the module's ``FRAME_PHASES`` names: the tape
  lists these functions per phase, so a frame calls only the mechanisms that
  act in it.

:class:`_EnterFrame` enters them in the order listed and undoes them in
reverse, each undo run even when another raised, and undoes what it entered
when an entry raises: no token, hook or mode outlives a frame.

==============  ==========================  ====================================
mechanism       tape                        frame
==============  ==========================  ====================================
``_strict``     nothing                     first forward under the detector
``_inputs``     tensor inputs' versions     first forward: none written in place
``_rng``        generators' states          recomputes start from them
``_guard``      module states, per call     module calls guarded
``_written``    subtree tensors' versions   first forward: none written unguarded
``_selective``  kept op outputs             recorded, or served
``_report``     a memory_report row         saved tensors counted, time taken
``_verify``     fingerprints (bitwise)      first forward: fingerprints taken
==============  ==========================  ====================================
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol, TypeVar

import torch
import torch.utils.checkpoint as torch_checkpoint

from . import (
    _guard,
    _inputs,
    _report,
    _rng,
    _selective,
    _strict,
    _torch_private,
    _verify,
    _written,
)
from ._early_stop import full_recompute
from ._options import DEFAULT_OPTIONS, RegionOptions
from ._policy import as_policy
from ._sampling import sampled_check
from ._state import FORWARD, FRAME, RECOMPUTE, SCOPE, Frame, Phase, Record, RegionCall, Scope, Tape

__all__ = ["MECHANISMS", "Mechanism", "region_context_fn", "register_mechanism"]

R = TypeVar("R")
ContextFn = _torch_private.ContextFn
Undo = Callable[..., Any]  # called as __exit__ is: (exc_type, exc, traceback)

_REGION = "region"


class Mechanism(Protocol):
    """What each region mechanism module provides (NOTE [ region mechanisms ])."""

    FRAME_PHASES: frozenset[Phase]  # the phases of the frames enter_frame acts in

    def start_region(self, tape: Tape, call: RegionCall) -> bool:
        """A region starts: put this mechanism's state on its tape; whether it acts in
        the region's frames."""

    def enter_frame(self, frame: Frame) -> Undo | None:
        """A frame of the region is entered: start, and return what undoes it, if anything."""


def _registered(*mechanisms: Mechanism) -> tuple[Mechanism, ...]:
    return mechanisms  # each module is checked against the protocol here (mypy)


# Started and entered in this order, undone in reverse. The report starts last: a
# mechanism refusing the region at its start (a save= policy that cannot apply)
# leaves no row. A new mechanism: a module and a name here (or, for an
# integration, a register_mechanism call in its package).
MECHANISMS = _registered(_strict, _inputs, _rng, _guard, _written, _selective, _report, _verify)


def register_mechanism(mechanism: Mechanism, *, first: bool = False) -> None:
    """Add a mechanism from outside the engine (integrations); once. ``first``: it starts
    before the others, so that a check raising there leaves no state behind."""
    global MECHANISMS
    if mechanism not in MECHANISMS:
        MECHANISMS = (mechanism, *MECHANISMS) if first else (*MECHANISMS, mechanism)


FramePlan = tuple[tuple[Callable[[Frame], Undo | None], ...], ...]
# By the set of mechanisms acting in a region (a bit each, in the order of _PLANS_OF,
# the MECHANISMS they were made for): the enter_frame functions its forward and
# recompute frames call.
_PLANS: dict[int, FramePlan] = {}
_PLANS_OF: tuple[Mechanism, ...] = ()


def _frame_plan(acting: int) -> FramePlan:
    global _PLANS_OF
    if _PLANS_OF is not MECHANISMS:
        _PLANS.clear()
        _PLANS_OF = MECHANISMS
    plan = _PLANS.get(acting)
    if plan is None:
        used = [m for i, m in enumerate(MECHANISMS) if acting >> i & 1]
        plan = _PLANS[acting] = tuple(
            tuple(m.enter_frame for m in used if phase in m.FRAME_PHASES)
            for phase in (FORWARD, RECOMPUTE)
        )
    return plan


class _Counters:
    """How many regions started and were recomputed; read by scopedckpt.testing."""

    regions = 0
    recomputes = 0


COUNTERS = _Counters()


def _undo(undos: list[Undo], exc: tuple[Any, Any, Any]) -> None:
    """Run every undo, last first; re-raise the first error once all have run."""
    error: BaseException | None = None
    index = len(undos)
    while index:
        index -= 1
        try:
            undos[index](*exc)
        except BaseException as raised:
            error = error or raised
    if error is not None:
        raise error


class _EnterFrame:
    """Set the scope and a fresh frame on every entry, and enter the mechanisms;
    re-enterable.

    torch calls ``context_fn`` once per forward but enters the recompute
    context at every recompute (``retain_graph=True``, ``autograd.grad`` then
    ``backward``), possibly on another thread, so each ``__enter__`` pushes its
    own tokens and builds its own frame (cursor 0) on the shared tape.
    """

    __slots__ = (
        "_entries",
        "_mechanisms",
        "_owner",
        "_phase",
        "_rewind",
        "_scope",
        "_tape",
        "holds",
        "partner",
    )

    def __init__(
        self, phase: Phase, tape: Tape, scope: Scope, owner: object | None, *, rewind: bool
    ) -> None:
        self._phase = phase
        self._tape = tape
        self._scope = scope
        self._owner = owner
        self._rewind = rewind
        self._mechanisms = (
            tape.forward_mechanisms if phase is FORWARD else tape.recompute_mechanisms
        )
        self._entries: list[
            tuple[contextvars.Token[Scope | None], contextvars.Token[Frame | None], list[Undo]]
        ] = []
        # Holds on module target patches (_targets.Patches), released when torch frees
        # the region, with this context.
        self.holds: tuple[Any, ...] = ()
        # A first forward's context: the region's recompute context.
        self.partner: _EnterFrame | None = None

    def __del__(self) -> None:
        self.release()

    def release(self) -> None:
        """Release the holds on target patches (once)."""
        holds, self.holds = self.holds, ()
        for patches in holds:
            patches.remove()

    def __enter__(self) -> None:
        if self._phase is RECOMPUTE:
            COUNTERS.recomputes += 1
        frame = Frame(self._phase, self._tape, self._scope, self._owner, self._rewind)
        scope_token, frame_token = SCOPE.set(self._scope), FRAME.set(frame)
        undos: list[Undo] = []
        try:
            for enter_frame in self._mechanisms:
                undo = enter_frame(frame)
                if undo is not None:
                    undos.append(undo)
        except BaseException as error:
            try:
                _undo(undos, (type(error), error, error.__traceback__))
            finally:
                FRAME.reset(frame_token)
                SCOPE.reset(scope_token)
            raise
        self._entries.append((scope_token, frame_token, undos))

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        scope_token, frame_token, undos = self._entries.pop()
        failed = exc_type is not None and not issubclass(
            exc_type, _torch_private.STOP_RECOMPUTATION
        )
        try:
            if len(undos) == 1:
                undos[0](exc_type, exc, tb)
            else:
                _undo(undos, (exc_type, exc, tb))
        except BaseException:
            failed = True
            raise
        finally:
            FRAME.reset(frame_token)
            SCOPE.reset(scope_token)
            if failed:
                # A region whose first forward or recompute failed is not recomputed
                # again. It may outlive the error, held by a cycle through torch's
                # checkpoint (its saved-tensor hooks reach the region's inputs, whose
                # graph reaches the hooks): the patches its recompute would need are
                # released now.
                (self.partner or self).release()


def region_context_fn(
    fn: Callable[..., Any],
    owner: object | None,
    label: object,
    scope: Scope,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: RegionOptions,
) -> tuple[Callable[..., Any], ContextFn]:
    """Set up one region: the ``fn`` and ``context_fn`` to hand to torch's checkpoint.

    Shared by every path that makes an eager region, torch's own ``checkpoint``
    under ``patch_torch_checkpoint`` included. The caller's ``options.context_fn`` is
    entered inside ours; ``options.save`` overrides the scope's policy (NOTE
    [ selective saving ]).
    """
    parent = FRAME.get()
    # A function is no identity: lambdas and bound methods are new objects at
    # every call, so only module-owned regions check their owner on replay.
    owner_id = None if owner is None else id(owner)
    if parent is not None and parent.phase is RECOMPUTE:
        # The parent is being recomputed: this nested region already ran once
        # and its tape is the next record of the parent (NOTE [ tape ]).
        tape = parent.take(_REGION, owner_id, label).value
        forward = _EnterFrame(RECOMPUTE, tape, scope, owner, rewind=False)
    else:
        tape = Tape()
        save = as_policy(options.save)
        call = RegionCall(
            owner,
            label,
            scope,
            args,
            kwargs,
            options.preserve_rng_state,
            save,
            options.determinism_check,
        )
        acting, bit = 0, 1
        for mechanism in MECHANISMS:
            if mechanism.start_region(tape, call):
                acting |= bit
            bit <<= 1
        tape.forward_mechanisms, tape.recompute_mechanisms = _frame_plan(acting)
        if parent is not None:
            parent.tape.records.append(Record(_REGION, owner_id, label, tape))
        forward = _EnterFrame(FORWARD, tape, scope, owner, rewind=False)
    recompute = _EnterFrame(RECOMPUTE, tape, scope, owner, rewind=True)
    forward.partner = recompute
    if isinstance(owner, torch.nn.Module):
        # The owner's forward runs inside the region without __call__: guard it here.
        fn = _guard.guarded_call(owner, fn)
    if scope.patches:
        # Keep module targets patched until torch frees this region: its
        # recompute must find nested targets patched (see _targets.Patches).
        recompute.holds = tuple(patches.share() for patches in scope.patches)
    COUNTERS.regions += 1

    def ours() -> tuple[Any, Any]:
        return forward, recompute

    context_fn = options.context_fn
    if context_fn is None or context_fn is _torch_private.NOOP_CONTEXT_FN:
        return fn, ours
    return fn, _torch_private.compose(ours, context_fn)


def layer_of(function: Callable[..., Any]) -> torch.nn.Module | None:
    """The layer of ``partial(forward, layer, **kwargs)`` (how Hugging Face hands its
    layers to a checkpoint function) or of a bound method, if ``function`` is one."""
    if isinstance(function, functools.partial) and function.args:
        first = function.args[0]
        return first if isinstance(first, torch.nn.Module) else None
    owner = getattr(function, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


# Set while scopedckpt itself calls torch's checkpoint, so that a patched torch
# (NOTE [ patching torch's checkpoint ] in _patch.py) does not make a region twice.
OWN_CALL: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "scopedckpt_own_call", default=False
)


def _region(
    fn: Callable[..., R],
    owner: object | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: RegionOptions = DEFAULT_OPTIONS,
    *,
    scope: Scope | None = None,
    label: object = None,
) -> R:
    """Run ``fn`` as an eager region if a scope is active and grad is on, else plainly.

    ``scope`` forces a scope where the caller has none (integrations);
    ``label`` names the region in errors when it is not ``owner`` or ``fn``.
    """
    if scope is None:
        scope = SCOPE.get()
    if scope is None or not scope.enabled or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if label is None:
        label = owner if owner is not None else fn
    options = options.in_scope(scope.determinism_check)
    # The module the region runs: its owner, or the function's (a module, a bound method).
    module = owner if owner is not None else layer_of(fn)
    if module is None and isinstance(fn, torch.nn.Module):
        module = fn
    if options.early_stop and module is not None and full_recompute(module):  # type: ignore[arg-type]
        options = dataclasses.replace(options, early_stop=False)  # NOTE [ late writes ]
    debug = _torch_private.checkpoint_debug_enabled(options.debug)
    if not debug:  # torch's debug mode explains its own check's failures
        check = sampled_check(options.determinism_check, module, fn)
        if check is not options.determinism_check:  # NOTE [ sampled verification ]
            options = dataclasses.replace(options, determinism_check=check)
    fn, contexts = region_context_fn(fn, owner, label, scope, args, kwargs, options)
    keywords = options.eager_keywords
    token = OWN_CALL.set(True)
    try:
        if debug:
            # torch's debug mode is a context_fn of its own: ours rides along with it.
            with _torch_private.debug_composed(contexts):
                return torch_checkpoint.checkpoint(fn, *args, debug=True, **keywords, **kwargs)
        return torch_checkpoint.checkpoint(fn, *args, context_fn=contexts, **keywords, **kwargs)
    finally:
        OWN_CALL.reset(token)


# The eager region reads context variables and hands torch a context_fn, neither
# of which dynamo can trace: compiled code reaches it only where NOTE
# [ torch.compile ] in _compiled.py says so, through this graph break. Eager
# callers call _region itself: the wrapper costs microseconds per call.
region_outside_dynamo = torch.compiler.disable(_region, recursive=False)


REENTRANT_MESSAGE = (
    "scopedckpt: checkpoint(use_reentrant=True) cannot be exact. Reentrant checkpointing "
    "reruns the region in a nested backward through an autograd.Function that takes no "
    "context_fn, so nothing can replay its random numbers or keep its buffers from being "
    "updated twice. Pass use_reentrant=False, or leave it unset: scopedckpt regions are "
    "always non-reentrant, which torch recommends as well."
)


def current_region_owner() -> object | None:
    """The module whose forward is the innermost active region, if any."""
    frame = FRAME.get()
    return None if frame is None else frame.owner
