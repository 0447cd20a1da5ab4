"""The region engine: torch's non-reentrant checkpoint plus scoped contexts.

A region is ``torch.utils.checkpoint.checkpoint(use_reentrant=False,
context_fn=...)`` whose forward context records the region's tape and whose
recompute context replays it (see NOTE [ tape ] in ``_state.py``); an eager
region runs it through ``_eager_checkpoint`` where that applies (NOTE [ eager
checkpoint ]), through torch's function everywhere else.

The mechanisms a region enters are listed in ``_mechanisms.py`` (NOTE [ region
mechanisms ]); this module knows none of them by name.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint as torch_checkpoint

from . import _eager_checkpoint, _mechanisms, _torch_private
from ._contexts import ContextFn, compose
from ._early_stop import full_recompute
from ._names import layer_of as layer_of
from ._oom import explain
from ._options import DEFAULT_OPTIONS, RegionOptions
from ._policy import as_policy
from ._sampling import Site, sampled_check
from ._state import (
    FORWARD,
    FRAME,
    RECOMPUTE,
    SCOPE,
    Frame,
    Phase,
    Record,
    RegionCall,
    Scope,
    Tape,
    region_name_of,
)
from ._subtree import Listing, subtree
from ._transforms import under_transform

__all__ = ["region_context_fn", "region_module"]

R = TypeVar("R")
Undo = _mechanisms.Undo

_REGION = "region"


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
        self, phase: Phase, tape: Tape, scope: Scope, owner: object | None, rewind: bool
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
        # Holds on module target patches (_targets.Patches): a _HoldingFrame's, released
        # when torch frees the region, with this context, or when a frame fails.
        self.holds: tuple[Any, ...] = ()
        # A first forward's context: the region's recompute context.
        self.partner: _EnterFrame | None = None

    def contexts(self) -> tuple[Any, Any]:
        """A region's ``context_fn``, on its first forward's context: that context and
        the region's recompute context (``partner``)."""
        return self, self.partner

    def fail(self) -> None:
        """The region's recompute failed a check after it ran: the step is lost, and the
        module targets of its scope are unpatched (as a failed verification does)."""
        self.release()
        for patches in self._scope.patches:
            patches.release_all()

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

    def __exit__(self, exc_type: type[BaseException] | None, exc: object, tb: object) -> None:
        scope_token, frame_token, undos = self._entries.pop()
        failed = exc_type is not None and not issubclass(
            exc_type, _torch_private.STOP_RECOMPUTATION
        )
        if failed and isinstance(exc, torch.OutOfMemoryError):
            frame = FRAME.get()
            if frame is not None:
                explain(exc, frame)
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


class _HoldingFrame(_EnterFrame):
    """A recompute context that holds module target patches until torch frees it.

    Only these release on deletion: a ``__del__`` on every frame context would
    run at every region's end, while most hold nothing.
    """

    __slots__ = ()

    def __del__(self) -> None:
        self.release()


def region_context_fn(
    fn: Callable[..., Any],
    owner: object | None,
    label: object,
    scope: Scope,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: RegionOptions,
    module: torch.nn.Module | None,
    listing: Listing | None = None,
    site: Site | None = None,
) -> tuple[Callable[..., Any], ContextFn]:
    """Set up one region: the ``fn`` and ``context_fn`` to hand to torch's checkpoint.

    Shared by every path that makes an eager region, torch's own ``checkpoint``
    under ``patch_torch_checkpoint`` included. The caller's ``options.context_fn`` is
    entered inside ours; ``options.save`` overrides the scope's policy (NOTE
    [ selective saving ]); ``module`` is the module the region runs
    (:func:`region_module`), ``listing`` its subtree's listing where the caller has it,
    ``site`` its site under the default check (``_sampling.sampled_check``).
    """
    parent = FRAME.get()
    # A function is no identity: lambdas and bound methods are new objects at
    # every call, so only module-owned regions check their owner on replay.
    owner_id = None if owner is None else id(owner)
    if parent is not None and parent.phase is RECOMPUTE:
        # The parent is being recomputed: this nested region already ran once
        # and its tape is the next record of the parent (NOTE [ tape ]).
        tape = parent.take(_REGION, owner_id, label).value
        forward = _EnterFrame(RECOMPUTE, tape, scope, owner, False)  # rewind: no
    else:
        tape = Tape()
        call = RegionCall(
            owner,
            label,
            scope,
            args,
            kwargs,
            options.preserve_rng_state,
            None if options.save is None else as_policy(options.save),
            options.determinism_check,
            module,
            fn,
            listing if listing is not None or module is None else subtree(module),
            site,
        )
        acting = 0
        for start_region, bit in _mechanisms.starts():
            if start_region(tape, call):
                acting |= bit
        tape.forward_mechanisms, tape.recompute_mechanisms = _mechanisms.frame_plan(acting)
        if parent is not None:
            parent.tape.records.append(Record(_REGION, owner_id, label, tape))
        forward = _EnterFrame(FORWARD, tape, scope, owner, False)  # rewind: no
    if scope.patches:
        # Keep module targets patched until torch frees this region: its
        # recompute must find nested targets patched (see _targets.Patches).
        recompute: _EnterFrame = _HoldingFrame(RECOMPUTE, tape, scope, owner, True)
        recompute.holds = tuple(patches.share() for patches in scope.patches)
    else:
        recompute = _EnterFrame(RECOMPUTE, tape, scope, owner, True)  # rewind: yes
    forward.partner = recompute
    COUNTERS.regions += 1

    context_fn = options.caller_context_fn
    if context_fn is None:
        return fn, forward.contexts
    return fn, compose(forward.contexts, context_fn)


def region_module(owner: object | None, fn: Callable[..., Any]) -> torch.nn.Module | None:
    """The module a region runs: its owner, the module it calls, or the layer of a bound
    method or partial (:func:`_names.layer_of`); None for a plain function."""
    if isinstance(owner, torch.nn.Module):
        return owner
    if isinstance(fn, torch.nn.Module):
        return fn
    return layer_of(fn)


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
) -> R:
    """Run ``fn`` as an eager region if a scope is active and grad is on, else plainly.

    ``scope`` forces a scope where the caller has none (integrations).
    """
    if scope is None:
        scope = SCOPE.get()
    if scope is None or not scope.enabled or not torch.is_grad_enabled() or under_transform():
        return fn(*args, **kwargs)  # under a transform: NOTE [ torch.func transforms ]
    label = owner if owner is not None else fn
    options = options.in_scope(scope.determinism_check)
    module = region_module(owner, fn)
    listing = None if module is None else subtree(module)
    if options.early_stop and full_recompute(listing, module, fn):
        options = dataclasses.replace(options, early_stop=False)  # NOTE [ late writes ]
    debug = _torch_private.checkpoint_debug_enabled(options.debug)
    site = None
    if not debug:  # torch's debug mode explains its own check's failures
        check, site = sampled_check(options.determinism_check, module, fn)
        if check is not options.determinism_check:  # NOTE [ sampled verification ]
            options = dataclasses.replace(options, determinism_check=check)
    fn, contexts = region_context_fn(
        fn, owner, label, scope, args, kwargs, options, module, listing, site
    )
    keywords = options.eager_keywords
    token = OWN_CALL.set(True)
    try:
        if debug:
            # torch's debug mode is a context_fn of its own: ours rides along with it.
            with _torch_private.debug_composed(contexts):
                return torch_checkpoint.checkpoint(fn, *args, debug=True, **keywords, **kwargs)
        if _eager_checkpoint.usable(options):
            forward_context, recompute_context = contexts()
            return _eager_checkpoint.run(
                fn,
                args,
                kwargs,
                forward_context,
                recompute_context,
                options.determinism_check,
                options.early_stop,
                site,
                functools.partial(_region_name, owner, label, scope),
            )
        return torch_checkpoint.checkpoint(fn, *args, context_fn=contexts, **keywords, **kwargs)
    finally:
        OWN_CALL.reset(token)


# The eager region reads context variables and hands torch a context_fn, neither
# of which dynamo can trace: compiled code reaches it only where NOTE
# [ torch.compile ] in _compiled.py says so, through this graph break. Eager
# callers call _region itself: the wrapper costs microseconds per call.
region_outside_dynamo = torch.compiler.disable(_region, recursive=False)


def _region_name(owner: object | None, label: object, scope: Scope) -> str:
    """A region's name in an error message: ``the forward of 'blocks.1' (Block)``, or
    ``checkpoint region <function>``."""
    name = region_name_of(owner, label, scope)
    return name if owner is not None else f"checkpoint region {name}"


def current_region_owner() -> object | None:
    """The module whose forward is the innermost active region, if any."""
    frame = FRAME.get()
    return None if frame is None else frame.owner
