"""The region engine: torch's non-reentrant checkpoint plus scoped contexts.

A region is ``torch.utils.checkpoint.checkpoint(use_reentrant=False,
context_fn=...)`` whose forward context records the region's tape and whose
recompute context replays it (see NOTE [ tape ] in ``_state.py``).
"""

from __future__ import annotations

import contextvars
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint as torch_checkpoint

from . import _torch_private
from ._state import FRAME, SCOPE, Frame, Phase, Record, Scope, Tape

__all__ = ["checkpoint"]

R = TypeVar("R")

_REGION = "region"


class _Counters:
    """How many regions started and were recomputed; read by scopedckpt.testing."""

    regions = 0
    recomputes = 0


COUNTERS = _Counters()
_DETERMINISM_CHECKS = ("default", "none")


class _EnterFrame:
    """Set the scope and a fresh frame on every entry; re-enterable.

    torch calls ``context_fn`` once per forward but enters the recompute
    context at every recompute (``retain_graph=True``, ``autograd.grad`` then
    ``backward``), possibly on another thread, so each ``__enter__`` pushes its
    own tokens and builds its own frame (cursor 0) on the shared tape.
    """

    def __init__(self, phase: Phase, tape: Tape, scope: Scope, owner: object | None) -> None:
        self._phase = phase
        self._tape = tape
        self._scope = scope
        self._owner = owner
        self._tokens: list[
            tuple[contextvars.Token[Scope | None], contextvars.Token[Frame | None], Any]
        ] = []

    def __enter__(self) -> None:
        strict_mode = None
        if self._phase is Phase.FORWARD and self._scope.strict:
            strict_mode = _torch_private.unscoped_random_detector()
            strict_mode.__enter__()
        if self._phase is Phase.RECOMPUTE:
            COUNTERS.recomputes += 1
        frame = Frame(self._phase, self._tape, self._scope, self._owner)
        self._tokens.append((SCOPE.set(self._scope), FRAME.set(frame), strict_mode))

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        scope_token, frame_token, strict_mode = self._tokens.pop()
        FRAME.reset(frame_token)
        SCOPE.reset(scope_token)
        if strict_mode is not None:
            strict_mode.__exit__(exc_type, exc, tb)


# NOTE [ torch.compile ]
# Regions, target dispatch and scoped layers run eagerly under torch.compile
# (a graph break each): their decisions read context variables and their
# masks come from per-call generators, which dynamo would otherwise guard on
# and recompile for at every call. Region entry is skipped non-recursively, so
# the code inside a region, and between scoped layers, is compiled as usual.
@torch.compiler.disable(recursive=False)
def _region(
    fn: Callable[..., R],
    owner: object | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    preserve_rng_state: bool = False,
    determinism_check: str = "default",
    early_stop: bool = True,
) -> R:
    """Run ``fn`` as a region if a scope is active and grad is on, else plainly."""
    scope = SCOPE.get()
    if scope is None or not scope.enabled or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    parent = FRAME.get()
    label = owner if owner is not None else fn
    # A function is no identity: lambdas and bound methods are new objects at
    # every call, so only module-owned regions check their owner on replay.
    owner_id = None if owner is None else id(owner)
    if parent is not None and parent.phase is Phase.RECOMPUTE:
        # The parent is being recomputed: this nested region already ran once
        # and its tape is the next record of the parent (NOTE [ tape ]).
        tape = parent.take(_REGION, owner_id, label).value
        forward = _EnterFrame(Phase.RECOMPUTE, tape, scope, owner)
    else:
        tape = Tape()
        if parent is not None:
            parent.tape.records.append(Record(_REGION, owner_id, label, tape))
        forward = _EnterFrame(Phase.FORWARD, tape, scope, owner)
    recompute = _EnterFrame(Phase.RECOMPUTE, tape, scope, owner)
    for patches in scope.patches:
        # Keep module targets patched until torch frees this region: its
        # recompute must find nested targets patched (see _targets.Patches).
        weakref.finalize(recompute, patches.share().remove)
    COUNTERS.regions += 1
    return torch_checkpoint.checkpoint(
        fn,
        *args,
        use_reentrant=False,
        context_fn=lambda: (forward, recompute),
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
        early_stop=early_stop,
        **kwargs,
    )


def checkpoint(
    fn: Callable[..., R],
    *args: Any,
    preserve_rng_state: bool = False,
    determinism_check: str = "default",
    early_stop: bool = True,
    **kwargs: Any,
) -> R:
    """Run ``fn(*args, **kwargs)`` as a checkpoint region inside a scope.

    Inside an enabled :func:`checkpointing` scope, with grad enabled, the
    activations of ``fn`` are not kept for backward; backward recomputes them,
    and scoped layers inside replay the first forward exactly (same dropout
    masks, running statistics updated once). Outside a scope, or under
    ``torch.no_grad()``, it is the plain call ``fn(*args, **kwargs)``, so model
    code can call it unconditionally and the caller decides by scoping.

    Parameters
    ----------
    fn
        The function or module to run. Its keyword arguments pass through.
    *args
        Positional arguments of ``fn``.
    preserve_rng_state
        Also stash and restore torch's global RNG state around the recompute,
        as ``torch.utils.checkpoint`` does. Scoped layers never need it; turn it
        on only for unscoped randomness you cannot move out of the region.
    determinism_check
        ``"default"`` (torch compares the shapes of recomputed tensors) or
        ``"none"``; passed to ``torch.utils.checkpoint.checkpoint``.
    early_stop
        Stop the recompute once every needed tensor is recomputed (torch's
        default). Exactness holds either way.
    **kwargs
        Keyword arguments of ``fn``.

    Returns
    -------
    Whatever ``fn`` returns.

    Raises
    ------
    TypeError
        If ``fn`` is not callable.
    ValueError
        If ``determinism_check`` is not one torch knows.

    Example
    -------
    >>> import torch, scopedckpt
    >>> block = torch.nn.Sequential(torch.nn.Linear(4, 4), scopedckpt.Dropout(0.5))
    >>> x = torch.randn(3, 4, requires_grad=True)
    >>> with scopedckpt.checkpointing():
    ...     y = scopedckpt.checkpoint(block, x)
    >>> y.sum().backward()   # recomputes block with the same dropout mask
    >>> x.grad.shape
    torch.Size([3, 4])
    """
    if not callable(fn):
        raise TypeError(
            f"scopedckpt: checkpoint expected a callable fn (a function or an "
            f"nn.Module) as its first argument, but got {type(fn).__name__}. "
            "Call it as scopedckpt.checkpoint(fn, *args, **kwargs)."
        )
    if determinism_check not in _DETERMINISM_CHECKS:
        raise ValueError(
            f"scopedckpt: determinism_check must be one of {_DETERMINISM_CHECKS}, "
            f"but got {determinism_check!r}."
        )
    return _region(
        fn,
        None,
        args,
        kwargs,
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
        early_stop=early_stop,
    )


def current_region_owner() -> object | None:
    """The module whose forward is the innermost active region, if any."""
    frame = FRAME.get()
    return None if frame is None else frame.owner
