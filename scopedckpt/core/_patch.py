"""``patch_torch_checkpoint``: third-party calls of torch's checkpoint become regions.

NOTE [ patching torch's checkpoint ]
====================================
Libraries call ``torch.utils.checkpoint`` themselves: timm's ``checkpoint_seq``
through the module attribute, Hugging Face through a name imported at module
level and a ``functools.partial`` of it stored when checkpointing is enabled.
Rebinding names cannot reach all of those, but every call of torch's
``checkpoint`` looks module globals up at call time: the non-reentrant
generator and ``CheckpointFunction`` (the reentrant path), and on torch >= 2.14
``_checkpoint_impl``, the front that ``checkpoint`` and its decorator form
share (NOTE [ torch versions ] in ``_torch_private.py`` names them per torch).
While any ``patch_torch_checkpoint`` block is open, in any thread, these are
replaced (reference-counted, under a lock), and so are the module's
``checkpoint`` and ``checkpoint_sequential`` attributes where they hold the
mapping of an unset ``use_reentrant``, which then means ``False``.

When the first block opens, the patch proves itself live: it calls torch's
``checkpoint`` as it was bound before the patch (what Hugging Face stored),
non-reentrant, reentrant and in decorator form, and every call must reach our
replacement; else it removes the patch and raises :class:`ScopedCkptError`
naming the torch version and the piece that was not reached. A torch that
renamed its generator can therefore never silently get torch's checkpoint back.

The replacements act only in contexts where a patch block is active (a
ContextVar, like :func:`scopedckpt.checkpointing`); elsewhere they are torch's
own code. In a patched context:

* a non-reentrant call becomes a scopedckpt region (``region_context_fn``, the
  same set-up as :func:`scopedckpt.checkpoint`), torch's generator running
  with our context_fn composed with the caller's; ``preserve_rng_state``,
  ``determinism_check``, ``debug``, ``early_stop`` and
  ``respect_saved_tensors_hooks`` keep their meaning;
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
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint as torch_checkpoint

from . import _torch_private
from ._checkpoint import fn_name, reentrant_message
from ._engine import OWN_CALL, region_context_fn, region_module
from ._errors import ScopedCkptError
from ._names import layer_of
from ._options import RegionOptions
from ._sampling import sampled_check
from ._scope import decorate
from ._state import DEFAULT_SCOPE, SCOPE, Scope
from ._torch_private import PATH
from ._torch_support import missing_piece

__all__ = ["patch_torch_checkpoint"]

F = TypeVar("F", bound=Callable[..., Any])

_PATCHED: contextvars.ContextVar[bool] = contextvars.ContextVar("scopedckpt_patched", default=False)
# While the patch proves itself live: the set of replacements reached.
_PROBE: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar(
    "scopedckpt_patch_probe", default=None
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


def _generator_body(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: _torch_private.Options,
) -> Generator[None, None, None]:
    """torch's non-reentrant generator, made a scopedckpt region in patched contexts."""
    probe = _PROBE.get()
    if probe is not None:
        probe.add("generator")
        yield
        return
    torch_generator = _ORIGINALS[PATH.generator]  # type: ignore[index]
    scope = _active_scope()
    if scope is None:
        return (
            yield from _torch_private.call_generator(torch_generator, fn, args, kwargs, options)
        )
    check = options["determinism_check"]
    if check == "default":
        check = scope.determinism_check
    debug_on = _torch_private.checkpoint_debug_enabled(options["debug"])
    module = region_module(None, fn)
    site = None
    if not debug_on:  # NOTE [ sampled verification ] in _sampling.py
        check, site = sampled_check(check, module, fn)
    fn, contexts = region_context_fn(
        fn,
        None,
        layer_of(fn) or fn,  # name regions by their layer where there is one
        scope,
        args,
        kwargs,
        RegionOptions(
            preserve_rng_state=options["preserve_rng_state"],
            determinism_check=check,
            context_fn=options["context_fn"],
        ),
        module,
        site=site,
    )
    options = dict(
        options,
        determinism_check=check,
        preserve_rng_state=False,  # the region stashes the generators itself (NOTE [ RNG replay ])
        context_fn=_torch_private.NOOP_CONTEXT_FN if debug_on else contexts,
    )
    inner = _torch_private.call_generator(torch_generator, fn, args, kwargs, options)
    with _torch_private.debug_composed(contexts) if debug_on else contextlib.nullcontext():
        return (yield from inner)


class _ReentrantRefused:
    """Stands for ``CheckpointFunction``: reentrant checkpointing, refused when patched."""

    @staticmethod
    def apply(function: Callable[..., Any], preserve: bool, *args: Any) -> Any:
        probe = _PROBE.get()
        if probe is not None:
            probe.add("reentrant")
            return None
        if _active_scope() is not None:
            raise ScopedCkptError(
                reentrant_message(
                    f"torch's checkpoint(use_reentrant=True) of {fn_name(function)}",
                    "A call of torch.utils.checkpoint inside patch_torch_checkpoint asked for "
                    "use_reentrant=True, or left it unset through a name bound before the "
                    "patch on a torch whose default is reentrant. ",
                )
            )
        return _ORIGINALS[PATH.reentrant].apply(function, preserve, *args)


def _unset_means_false(use_reentrant: bool | None) -> bool | None:
    if use_reentrant is None and (_PROBE.get() is not None or _active_scope() is not None):
        return False
    return use_reentrant


def _front(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    use_reentrant: bool | None = None,
    **options: Any,
) -> Any:
    """torch >= 2.14's ``_checkpoint_impl``, non-reentrant by default when patched."""
    probe = _PROBE.get()
    if probe is not None:
        probe.add("front")
    use_reentrant = _unset_means_false(use_reentrant)
    return _ORIGINALS[PATH.front](function, args, kwargs, use_reentrant=use_reentrant, **options)


@functools.wraps(torch_checkpoint.checkpoint)
def _checkpoint(function: Any = None, *args: Any, **kwargs: Any) -> Any:
    """torch <= 2.13's ``checkpoint``, non-reentrant by default when patched."""
    kwargs["use_reentrant"] = _unset_means_false(kwargs.get("use_reentrant"))
    return _ORIGINALS["checkpoint"](function, *args, **kwargs)


@functools.wraps(torch_checkpoint.checkpoint_sequential)
def _checkpoint_sequential(
    functions: Any, segments: int, input: Any, use_reentrant: bool | None = None, **kwargs: Any
) -> Any:
    """``torch.utils.checkpoint.checkpoint_sequential``, non-reentrant by default when patched."""
    return _ORIGINALS["checkpoint_sequential"](
        functions, segments, input, use_reentrant=_unset_means_false(use_reentrant), **kwargs
    )


def _replacements() -> dict[str, Any]:
    """The module globals to swap on this torch; raises if a needed one is missing."""
    if PATH.generator is None:
        raise ScopedCkptError(
            missing_piece(
                "torch.utils.checkpoint's non-reentrant generator "
                "(_checkpoint_without_reentrant_generator_impl on torch >= 2.14, "
                "_checkpoint_without_reentrant_generator before)",
                "patch_torch_checkpoint()",
            )
        )
    replacements: dict[str, Any] = {
        PATH.generator: _torch_private.generator_like(_generator_body),
        PATH.reentrant: _ReentrantRefused,
        "checkpoint_sequential": _checkpoint_sequential,
    }
    if PATH.split:
        replacements[PATH.front] = _front
    else:
        replacements["checkpoint"] = _checkpoint
    return replacements


def _probe_fn() -> None:
    return None


def _reached(call: Callable[[], Any]) -> set[str]:
    """Which replacements ``call`` reaches; the probe makes them do nothing else."""
    reached: set[str] = set()
    token = _PROBE.set(reached)
    try:
        with torch.no_grad():
            call()
    finally:
        _PROBE.reset(token)
    return reached


def _prove_live(torch_checkpoint_fn: Callable[..., Any]) -> None:
    """Raise unless torch's ``checkpoint`` as bound before the patch reaches every replacement."""
    probe = functools.partial(torch_checkpoint_fn, _probe_fn)
    calls: list[tuple[str, Callable[[], Any], str]] = [
        ("use_reentrant=False", functools.partial(probe, use_reentrant=False), "generator"),
        ("use_reentrant=True", functools.partial(probe, use_reentrant=True), "reentrant"),
    ]
    if PATH.split:
        calls.append(("use_reentrant unset", probe, "front"))
    if PATH.decorator_form:
        decorated = lambda: torch_checkpoint_fn(use_reentrant=False)(_probe_fn)()  # noqa: E731
        calls.append(("checkpoint(use_reentrant=False)(fn)", decorated, "generator"))
    names = {"generator": PATH.generator, "reentrant": PATH.reentrant, "front": PATH.front}
    missing = [
        f"torch.utils.checkpoint.{names[piece]} (called as {how})"
        for how, call, piece in calls
        if piece not in _reached(call)
    ]
    if missing:
        raise ScopedCkptError(
            missing_piece(
                "torch's checkpoint calling " + ", ".join(missing), "patch_torch_checkpoint()"
            )
        )


def _install() -> None:
    global _USERS
    with _LOCK:
        if _USERS == 0:
            replacements = _replacements()
            torch_checkpoint_fn = torch_checkpoint.checkpoint
            for name, replacement in replacements.items():
                _ORIGINALS[name] = getattr(torch_checkpoint, name)
                setattr(torch_checkpoint, name, replacement)
            try:
                _prove_live(torch_checkpoint_fn)
            except BaseException:
                _restore()
                raise
        _USERS += 1


def _restore() -> None:
    for name, original in _ORIGINALS.items():
        setattr(torch_checkpoint, name, original)
    _ORIGINALS.clear()


def _uninstall() -> None:
    global _USERS
    with _LOCK:
        _USERS -= 1
        if _USERS == 0:
            _restore()


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

    def __exit__(self, *exc: object) -> None:
        try:
            _PATCHED.reset(self._tokens.pop())
        finally:
            _uninstall()

    def __call__(self, func: F) -> F:
        """Use the patch as a decorator: every call of ``func`` runs inside a fresh block."""
        return decorate(patch_torch_checkpoint, func)
