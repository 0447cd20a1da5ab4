"""The region engine: torch's non-reentrant checkpoint plus scoped contexts.

A region is ``torch.utils.checkpoint.checkpoint(use_reentrant=False,
context_fn=...)`` whose forward context records the region's tape and whose
recompute context replays it (see NOTE [ tape ] in ``_state.py``): scoped
layers' records, the default generators' states (NOTE [ RNG replay ] in
``_rng.py``) and the buffers of modules called in it (NOTE [ buffer guard ] in
``_guard.py``).
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint as torch_checkpoint

from . import _guard, _report, _rng, _selective, _strict, _torch_private
from ._errors import ScopedCkptError
from ._policy import SavePolicy, as_policy
from ._state import FRAME, SCOPE, Frame, Phase, Record, Scope, Tape, describe, module_path

__all__ = ["region_context_fn"]

R = TypeVar("R")
ContextFn = _torch_private.ContextFn

_REGION = "region"


class _Counters:
    """How many regions started and were recomputed; read by scopedckpt.testing."""

    regions = 0
    recomputes = 0


COUNTERS = _Counters()


class _EnterFrame:
    """Set the scope and a fresh frame on every entry; re-enterable.

    torch calls ``context_fn`` once per forward but enters the recompute
    context at every recompute (``retain_graph=True``, ``autograd.grad`` then
    ``backward``), possibly on another thread, so each ``__enter__`` pushes its
    own tokens and builds its own frame (cursor 0) on the shared tape.

    ``rewind``: a backward recompute puts the generators' states it found back
    on exit; a nested region replayed inside its parent's recompute does not,
    since the parent's later draws continue from it (NOTE [ RNG replay ]).
    """

    def __init__(
        self, phase: Phase, tape: Tape, scope: Scope, owner: object | None, *, rewind: bool
    ) -> None:
        self._phase = phase
        self._tape = tape
        self._scope = scope
        self._owner = owner
        self._rewind = rewind
        self._entries: list[
            tuple[
                contextvars.Token[Scope | None],
                contextvars.Token[Frame | None],
                Frame,
                Any,
                _rng.RngStash | None,
                Any,
            ]
        ] = []
        self._measures: list[Any] = []  # memory report: a hook (forward) or a start time

    def __enter__(self) -> None:
        strict_mode = None
        saved_rng = None
        if self._phase is Phase.FORWARD and self._scope.strict:
            strict_mode = _strict.unscoped_random_detector()
            strict_mode.__enter__()
        if self._phase is Phase.RECOMPUTE:
            COUNTERS.recomputes += 1
            if self._tape.rng is not None:
                saved_rng = self._tape.rng.current() if self._rewind else None
                self._tape.rng.apply()
        frame = Frame(self._phase, self._tape, self._scope, self._owner)
        _guard.begin(frame)
        selective: _selective.SavingMode | _selective.ServingMode | None = None
        saved = self._tape.saved
        if saved is not None:  # NOTE [ selective saving ] in _selective.py
            if self._phase is Phase.FORWARD:
                selective = _selective.SavingMode(saved, frame)
                if saved.policy.selects_modules:
                    frame.selective = selective
            else:
                selective = _selective.ServingMode(saved, frame)
        self._entries.append(
            (SCOPE.set(self._scope), FRAME.set(frame), frame, strict_mode, saved_rng, selective)
        )
        if selective is not None:
            selective.__enter__()
        stats = self._tape.stats
        if stats is not None:  # NOTE [ memory report ] in _report.py
            if self._phase is Phase.FORWARD:
                counting = _report.counting_saved_tensors(stats)
                counting.__enter__()
                self._measures.append(counting)
            else:
                self._measures.append(_report.now())

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        scope_token, frame_token, frame, strict_mode, saved_rng, selective = self._entries.pop()
        if selective is not None:
            selective.__exit__(exc_type, exc, tb)
        stats = self._tape.stats
        if stats is not None:
            measure = self._measures.pop()
            if self._phase is Phase.FORWARD:
                measure.__exit__(exc_type, exc, tb)
                _report.finish_forward(stats, self._tape)
            else:
                _report.recomputed(stats, _report.now() - measure)
        try:
            _guard.end(frame)
        finally:
            FRAME.reset(frame_token)
            SCOPE.reset(scope_token)
            if saved_rng is not None:
                saved_rng.apply()
            if strict_mode is not None:
                strict_mode.__exit__(exc_type, exc, tb)


def _check_no_cache(
    owner: object | None,
    label: object,
    scope: Scope,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """Refuse a Hugging Face key/value cache: every recompute would append to it again.

    Layers declaring ``_can_checkpoint_with_cache = True`` only read the cache
    (Hugging Face keeps it for them under its own checkpointing): allowed.
    """
    # Runs at every region entry: plain loops, the layer's opt-out looked up (a
    # failing nn.Module attribute lookup costs microseconds) and names formatted
    # only when a cache is there.
    named = itertools.chain(enumerate(args), kwargs.items())
    for key, value in named:
        kind = type(value)
        if kind.__name__.endswith("Cache") and kind.__module__.startswith("transformers."):
            layer = owner if owner is not None else label
            if getattr(layer, "_can_checkpoint_with_cache", False) is True:
                return
            if isinstance(key, int):
                name = f"positional argument #{key}"
            else:
                name = f"keyword argument {key!r}"
            if owner is None:
                where = describe(label)
            else:
                where = f"the forward of {module_path(owner, None, scope)}"
            raise ScopedCkptError(
                f"scopedckpt: a checkpoint region ({where}) got a Hugging Face "
                f"{kind.__name__} as {name}. The recompute in backward would "
                "append this step's keys and values to the cache a second time, and the "
                "region would see a longer cache than its first forward. Pass "
                "use_cache=False while training with checkpointing (Hugging Face's own "
                "gradient checkpointing does the same), or use "
                "scopedckpt.integrations.huggingface.gradient_checkpointing_enable(model)."
            )


def region_context_fn(
    fn: Callable[..., Any],
    owner: object | None,
    label: object,
    scope: Scope,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    preserve_rng_state: bool,
    context_fn: ContextFn | None,
    save: SavePolicy | None = None,
) -> tuple[Callable[..., Any], ContextFn]:
    """Set up one region: the ``fn`` and ``context_fn`` to hand to torch's checkpoint.

    Shared by :func:`checkpoint` and by torch's own ``checkpoint`` under
    ``patch_torch_checkpoint``. A user's ``context_fn`` is entered inside ours.
    ``save`` overrides the scope's policy (NOTE [ selective saving ]).
    """
    parent = FRAME.get()
    _check_no_cache(owner, label, scope, args, kwargs)
    # A function is no identity: lambdas and bound methods are new objects at
    # every call, so only module-owned regions check their owner on replay.
    owner_id = None if owner is None else id(owner)
    if parent is not None and parent.phase is Phase.RECOMPUTE:
        # The parent is being recomputed: this nested region already ran once
        # and its tape is the next record of the parent (NOTE [ tape ]).
        tape = parent.take(_REGION, owner_id, label).value
        forward = _EnterFrame(Phase.RECOMPUTE, tape, scope, owner, rewind=False)
    else:
        tape = Tape(rng=_rng.stash() if preserve_rng_state else None)
        policy = save if save is not None else scope.save
        if policy is not None:
            tape.saved = _selective.Saved(policy, policy.matched_modules(owner, label), label)
        tape.stats = _report.start(owner, label, scope.root, args, kwargs)
        if parent is not None:
            parent.tape.records.append(Record(_REGION, owner_id, label, tape))
        forward = _EnterFrame(Phase.FORWARD, tape, scope, owner, rewind=False)
    recompute = _EnterFrame(Phase.RECOMPUTE, tape, scope, owner, rewind=True)
    if isinstance(owner, torch.nn.Module):
        # The owner's forward runs inside the region without __call__: guard it here.
        fn = _guard.guarded_call(owner, fn)
    for patches in scope.patches:
        # Keep module targets patched until torch frees this region: its
        # recompute must find nested targets patched (see _targets.Patches).
        weakref.finalize(recompute, patches.share().remove)
    COUNTERS.regions += 1

    def ours() -> tuple[Any, Any]:
        return forward, recompute

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
    *,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    early_stop: bool = True,
    debug: bool = False,
    context_fn: ContextFn | None = None,
    scope: Scope | None = None,
    label: object = None,
    save: Any = None,
    respect_saved_tensors_hooks: bool | None = None,
) -> R:
    """Run ``fn`` as a region if a scope is active and grad is on, else plainly.

    ``scope`` forces a scope where the caller has none (integrations);
    ``label`` names the region in errors when it is not ``owner`` or ``fn``;
    ``save`` (a ``save=`` sequence or a parsed policy) overrides the scope's policy.
    """
    if scope is None:
        scope = SCOPE.get()
    if scope is None or not scope.enabled or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if label is None:
        label = owner if owner is not None else fn
    fn, contexts = region_context_fn(
        fn,
        owner,
        label,
        scope,
        args,
        kwargs,
        preserve_rng_state=preserve_rng_state,
        context_fn=context_fn,
        save=as_policy(save),
    )
    options: dict[str, Any] = dict(
        use_reentrant=False,
        preserve_rng_state=False,  # we stash more generators ourselves (NOTE [ RNG replay ])
        determinism_check=determinism_check,
        early_stop=early_stop,
    )
    if respect_saved_tensors_hooks is not None:  # torch >= 2.14 (checkpoint() checked it)
        options["respect_saved_tensors_hooks"] = respect_saved_tensors_hooks
    token = OWN_CALL.set(True)
    try:
        if _torch_private.checkpoint_debug_enabled(debug):
            # torch's debug mode is a context_fn of its own: ours rides along with it.
            with _torch_private.debug_composed(contexts):
                return torch_checkpoint.checkpoint(fn, *args, debug=True, **options, **kwargs)
        return torch_checkpoint.checkpoint(fn, *args, context_fn=contexts, **options, **kwargs)
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
