"""Every private torch name scopedckpt uses, in one place.

``torch.utils._python_dispatch.TorchDispatchMode`` is the only way to see each
aten op a region runs, which strict mode needs to catch random ops that did not
go through a scoped layer (``nn.Dropout``, ``torch.rand`` in user code): the
public ``torch.overrides.TorchFunctionMode`` misses ops issued from C++ (e.g.
``nn.Dropout`` calling ``bernoulli_``). The drop-in ``checkpoint`` needs three private names of
``torch.utils.checkpoint``: ``_checkpoint_debug_enabled`` (the global switch
``set_checkpoint_debug_enabled`` sets), ``_get_debug_context_and_cb`` (torch
builds its debug mode as a ``context_fn`` plus an error callback, and refuses
``debug=True`` beside any other ``context_fn``: :func:`debug_composed` lets its
next call return ours composed with torch's), and
``_checkpoint_without_reentrant_generator``, which ``checkpoint`` looks up at
every call and which ``patch_torch_checkpoint`` swaps (NOTE [ patching torch's
checkpoint ] in ``_patch.py``). The memory report (``_report.py``) reads the
innermost saved-tensor hooks, torch's checkpoint's own, through
``torch._C._autograd._top_saved_tensors_default_hooks``, to count what a
region's ops save while still handing every tensor to torch's hook.
Selective saving (``_selective.py``) is a ``TorchDispatchMode`` too and skips
the ops ``torch.utils.checkpoint.SAC_IGNORED_OPS`` lists, as torch's own does;
it detaches kept outputs under ``torch._C._SetExcludeDispatchKeyGuard`` so that
they share the version counter of the tensor the model holds, reads op schemas
(``OpOverload._schema``) to know which ops cannot be kept, and, in compiled
code, asks ``torch._guards.TracingContext`` whether torch is tracing (its
``context_fn`` then hands torch's own selective-checkpoint modes).

The buffer guard (``_guard.py``) swaps
buffers in and out of ``nn.Module._buffers``, the registry ``register_buffer``
fills, because assigning through ``setattr`` would run module ``__setattr__``
logic and hooks on every swap. ``tests/test_torch_private.py`` fails loudly if
torch renames or changes any of these, or stops tagging its random ops.

Strict mode judges an op random by its ``nondeterministic_seeded`` tag and
then by its arguments: the tag sits on ops such as
``aten._scaled_dot_product_flash_attention_for_cpu`` even with
``dropout_p=0.0``, and on ``native_dropout`` with ``train=False``, which draw
nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from ._errors import ScopedCkptError

__all__ = [
    "SAC_IGNORED_OPS",
    "OpOverload",
    "OpOverloadPacket",
    "TorchDispatchMode",
    "bound_arguments",
    "checkpoint_debug_enabled",
    "compose",
    "debug_composed",
    "detach_below_autograd",
    "draws_random_numbers",
    "module_buffers",
    "op_schema_facts",
    "scoped_draws",
    "top_saved_tensors_hooks",
    "tracing",
    "unscoped_random_detector",
]

ContextFn = Callable[[], tuple[Any, Any]]


def checkpoint_debug_enabled(debug: bool) -> bool:
    """torch's own rule: ``set_checkpoint_debug_enabled`` overrides the ``debug`` argument."""
    switch: bool | None = torch_checkpoint._checkpoint_debug_enabled
    return debug if switch is None else switch


_DEBUG_PENDING: contextvars.ContextVar[ContextFn | None] = contextvars.ContextVar(
    "scopedckpt_debug_pending", default=None
)
_TORCH_DEBUG_CONTEXT: Callable[[], tuple[ContextFn, Any]] = (
    torch_checkpoint._get_debug_context_and_cb
)
_DEBUG_LOCK = threading.Lock()


def _debug_context_and_cb() -> tuple[ContextFn, Any]:
    """torch's debug context_fn and callback; with ours composed in when one is pending."""
    debug_context_fn, callback = _TORCH_DEBUG_CONTEXT()
    ours = _DEBUG_PENDING.get()
    if ours is None:
        return debug_context_fn, callback
    _DEBUG_PENDING.set(None)  # one call only: nested regions inside push their own

    return compose(ours, debug_context_fn), callback


@contextlib.contextmanager
def debug_composed(context_fn: ContextFn) -> Iterator[None]:
    """Let the next ``checkpoint(..., debug=True)`` in this context run ``context_fn`` too."""
    with _DEBUG_LOCK:
        if torch_checkpoint._get_debug_context_and_cb is not _debug_context_and_cb:
            torch_checkpoint._get_debug_context_and_cb = _debug_context_and_cb
    token = _DEBUG_PENDING.set(context_fn)
    try:
        yield
    finally:
        _DEBUG_PENDING.reset(token)


class _Both:
    """Enter ``outer`` then ``inner``, exit in reverse; re-enterable if both are."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, outer: Any, inner: Any) -> None:
        self._outer, self._inner = outer, inner

    def __enter__(self) -> None:
        self._outer.__enter__()
        try:
            self._inner.__enter__()
        except BaseException as error:
            self._outer.__exit__(type(error), error, error.__traceback__)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self._inner.__exit__(*exc)
        finally:
            self._outer.__exit__(*exc)


def compose(outer: ContextFn, inner: ContextFn) -> ContextFn:
    """A ``context_fn`` whose two contexts enter ``outer``'s and then ``inner``'s."""

    def composed() -> tuple[Any, Any]:
        (forward, recompute), (inner_forward, inner_recompute) = outer(), inner()
        return _Both(forward, inner_forward), _Both(recompute, inner_recompute)

    return composed


NOOP_CONTEXT_FN: ContextFn = torch_checkpoint.noop_context_fn

# What save= items and presets are (torch.ops.aten.mm.default and torch.ops.aten.mm).
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket


def op_schema_facts(func: Any) -> tuple[bool, bool, bool, str]:
    """An op's schema, as selective saving asks: (mutates an argument, returns an
    alias of one, takes a tensor argument, its packet's name)."""
    schema = func._schema
    return (
        schema.is_mutable,
        any(r.alias_info is not None for r in schema.returns),
        any(isinstance(a.type, torch.TensorType) for a in schema.arguments),
        func.overloadpacket.__name__,
    )


def detach_below_autograd(tensor: torch.Tensor) -> torch.Tensor:
    """An alias of ``tensor`` sharing its version counter, from inside a dispatch mode.

    Below autograd, ``detach()`` skips the ADInplaceOrView kernel that makes an
    alias share its base's version counter, so in-place changes of the output
    would go unseen; torch's selective checkpointing re-enables that key the
    same way (``torch.utils.checkpoint._detach_helper``).
    """
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return tensor.detach()


# Ops torch's own selective checkpointing never caches: torch's checkpoint issues
# a different number of detaches in forward and recompute, and metadata queries.
SAC_IGNORED_OPS: frozenset[Any] = frozenset(torch_checkpoint.SAC_IGNORED_OPS)


def module_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """The module's own registered buffers, by name: the dict itself, to swap entries in."""
    return module._buffers


_SCOPED_DRAW: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "scopedckpt_scoped_draw", default=False
)


class _ScopedDraws:
    """Mark random ops issued by scoped layers as allowed in strict mode.

    A plain class rather than ``@contextmanager``: it runs on every dropout
    call, and a generator-based context manager costs several times more.
    """

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = _SCOPED_DRAW.set(True)

    def __exit__(self, *exc: object) -> None:
        _SCOPED_DRAW.reset(self._token)


def scoped_draws() -> _ScopedDraws:
    """A fresh (single-use) context manager under which strict mode lets random ops through."""
    return _ScopedDraws()


_NO_DRAW = {"p": 0.0, "dropout_p": 0.0, "train": False, "training": False}


def bound_arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """An aten op's arguments by schema name, defaults included."""
    named = dict(kwargs)
    for index, argument in enumerate(func._schema.arguments):
        if index < len(args):
            named[argument.name] = args[index]
        elif argument.name not in named and argument.has_default_value():
            named[argument.name] = argument.default_value
    return named


def draws_random_numbers(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call of a tagged op really draws (``dropout_p=0`` does not)."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    named = bound_arguments(func, args, kwargs)
    return not any(name in named and named[name] == value for name, value in _NO_DRAW.items())


def _explicit_generator(named: dict[str, Any]) -> bool:
    generator = named.get("generator")
    if generator is None:
        return False
    if generator.device.type == "cpu":
        return generator is not torch.default_generator
    module = torch.get_device_module(generator.device.type)
    defaults = getattr(module, "default_generators", ())
    return all(generator is not default for default in defaults)


class _UnscopedRandomDetector(TorchDispatchMode):
    """Raise on seeded random ops that no scoped layer issued."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if not _SCOPED_DRAW.get() and draws_random_numbers(func, args, kwargs):
            if _explicit_generator(bound_arguments(func, args, kwargs)):
                raise ScopedCkptError(
                    f"scopedckpt: strict mode found the random op {func} drawing from a "
                    "torch.Generator of its own inside a checkpoint region. The recompute "
                    "rewinds only torch's default generators, so it would draw different "
                    "numbers and the gradients would be silently wrong. Use a scoped layer "
                    "with generator=... (scopedckpt.Dropout(p, generator=g)), or draw from "
                    "the default generator, or draw outside the region."
                )
            raise ScopedCkptError(
                f"scopedckpt: strict mode found the random op {func} inside a checkpoint "
                "region, not issued by a scoped layer. It is replayed exactly from the "
                "region's stash of the default generators, but strict mode asks for scoped "
                "layers (no stash needed, exact also with preserve_rng_state=False). Replace "
                "torch dropout layers with scoped ones (scopedckpt.convert(model) does it in "
                "place), call scopedckpt.functional.dropout instead of "
                "torch.nn.functional.dropout, or turn strict off."
            )
        return func(*args, **kwargs)


def unscoped_random_detector() -> TorchDispatchMode:
    """A fresh dispatch mode that raises on unscoped random ops."""
    return _UnscopedRandomDetector()


def tracing() -> bool:
    """Whether torch.compile is tracing now (dynamo or AOT autograd), in this thread."""
    return torch._guards.TracingContext.try_get() is not None


def top_saved_tensors_hooks() -> tuple[Callable[[Any], Any], Callable[[Any], Any]] | None:
    """The innermost ``saved_tensors_hooks`` pair now in force, or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)
