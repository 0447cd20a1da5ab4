"""``patch_torch_checkpoint``: third-party calls of torch's checkpoint become regions.

NOTE [ patching torch's checkpoint ]
====================================
Libraries call ``torch.utils.checkpoint`` themselves: timm's ``checkpoint_seq``
through the module attribute, Hugging Face through a name imported at module
level and a ``functools.partial`` of it stored when checkpointing is enabled.
Rebinding names cannot reach all of those, but every call of torch's
``checkpoint`` looks two module globals up at call time:
``_checkpoint_without_reentrant_generator`` (the non-reentrant path) and
``CheckpointFunction`` (the reentrant one). While any ``patch_torch_checkpoint``
block is open, in any thread, both are replaced (reference-counted, under a
lock), and so are the module's ``checkpoint`` and ``checkpoint_sequential``
attributes, which only map an unset ``use_reentrant`` to ``False``.

The replacements act only in contexts where a patch block is active (a
ContextVar, like :func:`scopedckpt.checkpointing`); elsewhere they are torch's
own code. In a patched context:

* a non-reentrant call becomes a scopedckpt region (``region_context_fn``, the
  same set-up as :func:`scopedckpt.checkpoint`), torch's generator running
  with our context_fn composed with the caller's; ``preserve_rng_state``,
  ``determinism_check``, ``debug`` and ``early_stop`` keep their meaning;
* a reentrant call raises :class:`ScopedCkptError`: it cannot be exact;
* inside ``checkpointing(enabled=False)`` calls are torch's own again;
* scopedckpt's own calls of torch's checkpoint pass through (``OWN_CALL``).

A function given as ``partial(forward, layer)`` (Hugging Face) runs the
layer's forward without ``__call__``: its submodules are guarded as usual,
its own registered buffers are not (Hugging Face layers have none).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Generator
from types import TracebackType
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint as torch_checkpoint

from . import _torch_private
from ._engine import OWN_CALL, REENTRANT_MESSAGE, layer_of, region_context_fn
from ._errors import ScopedCkptError
from ._scope import decorate
from ._state import DEFAULT_SCOPE, SCOPE, Scope

__all__ = ["patch_torch_checkpoint"]

F = TypeVar("F", bound=Callable[..., Any])

_PATCHED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "scopedckpt_patched", default=False
)
_LOCK = threading.Lock()
_USERS = 0
_ORIGINALS: dict[str, Any] = {}


def _active_scope() -> Scope | None:
    """The scope a patched call makes its region in, or None for torch's own behaviour."""
    if not _PATCHED.get() or OWN_CALL.get() or not torch.is_grad_enabled():
        return None
    scope = SCOPE.get() or DEFAULT_SCOPE
    return scope if scope.enabled else None


def _generator(
    fn: Callable[..., Any],
    preserve_rng_state: bool,
    context_fn: Any,
    determinism_check: str,
    debug: bool,
    early_stop: bool,
    *args: Any,
    **kwargs: Any,
) -> Generator[None, None, None]:
    """torch's non-reentrant generator, made a scopedckpt region in patched contexts."""
    torch_generator = _ORIGINALS["_checkpoint_without_reentrant_generator"]
    scope = _active_scope()
    if scope is None:
        options = (preserve_rng_state, context_fn, determinism_check, debug, early_stop)
        return (yield from torch_generator(fn, *options, *args, **kwargs))
    fn, contexts = region_context_fn(
        fn,
        None,
        layer_of(fn) or fn,  # name regions by their layer where there is one
        scope,
        args,
        kwargs,
        preserve_rng_state=preserve_rng_state,
        context_fn=context_fn,
    )
    debug_on = _torch_private.checkpoint_debug_enabled(debug)
    inner = torch_generator(
        fn,
        False,  # the region stashes the generators itself (NOTE [ RNG replay ])
        _torch_private.NOOP_CONTEXT_FN if debug_on else contexts,
        determinism_check,
        debug,
        early_stop,
        *args,
        **kwargs,
    )
    with _torch_private.debug_composed(contexts) if debug_on else contextlib.nullcontext():
        return (yield from inner)


class _ReentrantRefused:
    """Stands for ``CheckpointFunction``: reentrant checkpointing, refused when patched."""

    @staticmethod
    def apply(function: Callable[..., Any], preserve: bool, *args: Any) -> Any:
        if _active_scope() is not None:
            raise ScopedCkptError(
                f"{REENTRANT_MESSAGE} (A call of torch.utils.checkpoint inside "
                "patch_torch_checkpoint asked for use_reentrant=True, or left it unset "
                "through a name bound before the patch: torch 2.13's default is reentrant.)"
            )
        return _ORIGINALS["CheckpointFunction"].apply(function, preserve, *args)


def _checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint``, non-reentrant by default when patched."""
    if kwargs.get("use_reentrant") is None and _active_scope() is not None:
        kwargs["use_reentrant"] = False
    return _ORIGINALS["checkpoint"](function, *args, **kwargs)


def _checkpoint_sequential(
    functions: Any, segments: int, input: Any, use_reentrant: bool | None = None, **kwargs: Any
) -> Any:
    """``torch.utils.checkpoint.checkpoint_sequential``, non-reentrant by default when patched."""
    if use_reentrant is None and _active_scope() is not None:
        use_reentrant = False
    return _ORIGINALS["checkpoint_sequential"](
        functions, segments, input, use_reentrant=use_reentrant, **kwargs
    )


_REPLACEMENTS: dict[str, Any] = {
    "_checkpoint_without_reentrant_generator": _generator,
    "CheckpointFunction": _ReentrantRefused,
    "checkpoint": functools.wraps(torch_checkpoint.checkpoint)(_checkpoint),
    "checkpoint_sequential": functools.wraps(torch_checkpoint.checkpoint_sequential)(
        _checkpoint_sequential
    ),
}


def _install() -> None:
    global _USERS
    with _LOCK:
        _USERS += 1
        if _USERS == 1:
            for name, replacement in _REPLACEMENTS.items():
                _ORIGINALS[name] = getattr(torch_checkpoint, name)
                setattr(torch_checkpoint, name, replacement)


def _uninstall() -> None:
    global _USERS
    with _LOCK:
        _USERS -= 1
        if _USERS == 0:
            for name, original in _ORIGINALS.items():
                setattr(torch_checkpoint, name, original)
            _ORIGINALS.clear()


class patch_torch_checkpoint:  # noqa: N801 - reads like the docs: ``with patch_torch_checkpoint():``
    """Make calls of ``torch.utils.checkpoint`` in this context scopedckpt regions.

    For code you do not own: timm's ``set_grad_checkpointing`` (``checkpoint_seq``),
    Hugging Face's ``gradient_checkpointing_enable``, training scripts. Inside the
    block, every non-reentrant call of ``torch.utils.checkpoint.checkpoint`` or
    ``checkpoint_sequential`` made in the current context (however the function
    was imported, also through a ``functools.partial`` made before the block) is
    a scopedckpt region: randomness replayed, buffers updated once, torch's
    keywords honoured; an unset ``use_reentrant`` means ``False``, and a reentrant
    call raises :class:`scopedckpt.ScopedCkptError`. An enclosing
    :func:`scopedckpt.checkpointing` block supplies ``strict``; with
    ``enabled=False`` calls are torch's own. Other threads and contexts see
    torch's checkpoint unchanged; the patch is gone when the last block exits,
    also on exceptions. Regions made inside may be recomputed after the block.

    Use it as a context manager or a decorator (a fresh block per call).

    Example
    -------
    >>> import torch, scopedckpt
    >>> from scopedckpt.integrations import patch_torch_checkpoint
    >>> bn = torch.nn.BatchNorm1d(4)
    >>> x = torch.randn(3, 4, requires_grad=True)
    >>> with patch_torch_checkpoint():
    ...     y = torch.utils.checkpoint.checkpoint(bn, x, use_reentrant=False)
    >>> y.square().sum().backward()
    >>> int(bn.num_batches_tracked)   # torch's own checkpoint would say 2
    1
    """

    def __init__(self) -> None:
        self._tokens: list[contextvars.Token[bool]] = []

    def __enter__(self) -> patch_torch_checkpoint:
        _install()
        self._tokens.append(_PATCHED.set(True))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            _PATCHED.reset(self._tokens.pop())
        finally:
            _uninstall()

    def __call__(self, func: F) -> F:
        """Use the patch as a decorator: every call of ``func`` runs inside a fresh block."""
        return decorate(patch_torch_checkpoint, func)
