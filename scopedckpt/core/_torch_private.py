"""Every private torch name scopedckpt uses, in one place, chosen once at import.

NOTE [ torch versions ]
=======================
Each private name is read here, by feature detection rather than version strings; a
mechanism whose name is gone raises :class:`ScopedCkptError` where it is used, naming
the torch version and the missing piece, instead of silently running torch's own
checkpoint (``tests/test_torch_private.py`` checks no other module uses one):

* **checkpoint call path** (:data:`PATH`). torch <= 2.13: ``checkpoint`` calls
  ``_checkpoint_without_reentrant_generator(fn, preserve_rng_state, context_fn,
  determinism_check, debug, early_stop, *args, **kwargs)``; torch >= 2.14: ``_checkpoint_impl``
  calls ``_checkpoint_without_reentrant_generator_impl(fn, args, kwargs, *, ...)`` and the old
  name is a shim nothing calls. Both are module globals looked up per call, which
  ``patch_torch_checkpoint`` swaps (``_patch.py``); :func:`call_generator` and
  :func:`generator_like` hide the two signatures.
* **checkpoint internals**: debug mode's switch and ``_get_debug_context_and_cb``
  (:func:`debug_composed` composes ours with torch's for one call); the
  determinism-check registry, early-stop switch, stop exception, saved inputs
  (``_make_saved_tensor``), graph-task ids and internal-hook marking that the
  eager region's own checkpoint follows (``_eager_checkpoint.py``).
* **dispatch modes and op schemas**: ``TorchDispatchMode`` sees each aten op a region
  runs (strict mode, selective saving, the planner); selective saving skips
  ``SAC_IGNORED_OPS`` and detaches kept outputs under ``_SetExcludeDispatchKeyGuard``.
* **saved-tensor hooks**: the memory report reads the innermost pair. **Module and
  tensor internals**: entries of a module's parameter, buffer and hook dicts are swapped
  (``setattr`` would run hooks per swap); scoped layers subclass ``_DropoutNd`` and
  ``_BatchNorm``; versions, a view's ``_base``, torch.func's level; the globals of
  ``parametrize.cached()``, which the forward's world puts in place for a recompute.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import operator
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode

from ._contexts import ContextFn, compose
from ._errors import ScopedCkptError
from ._torch_support import check_torch, missing_piece

check_torch(torch.__version__)

Options = dict[str, Any]  # torch's checkpoint keywords, less use_reentrant
CheckpointGenerator = Generator[None, None, None]


@dataclass(frozen=True)
class CheckpointPath:
    """How this torch's ``checkpoint`` reaches its non-reentrant generator."""

    front: str  # the module global mapping use_reentrant to a path, looked up per call
    generator: str | None  # the generator global the front calls; None: none known
    split: bool  # torch >= 2.14: generator(fn, args, kwargs, *, **options)
    options: tuple[str, ...]  # the keywords the generator takes besides fn and arguments
    decorator_form: bool  # checkpoint(use_reentrant=False)(fn) exists
    reentrant = "CheckpointFunction"  # the global holding reentrant checkpointing's Function

    @property
    def respects_hooks(self) -> bool:
        """Whether torch's checkpoint takes ``respect_saved_tensors_hooks`` (torch >= 2.14)."""
        return "respect_saved_tensors_hooks" in self.options


_OPTIONS = ("preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop")


def _checkpoint_path() -> CheckpointPath:
    def has(name: str) -> bool:
        return callable(getattr(torch_checkpoint, name, None))

    split = has("_checkpoint_impl") and has("_checkpoint_without_reentrant_generator_impl")
    front = "_checkpoint_impl" if split else "checkpoint"
    name = "_checkpoint_without_reentrant_generator" + ("_impl" if split else "")
    generator = name if has(name) else None
    parameters = inspect.signature(torch_checkpoint.checkpoint).parameters
    hooks = "respect_saved_tensors_hooks"
    options = _OPTIONS + ((hooks,) if hooks in parameters else ())
    function = parameters.get("function")
    decorator = function is not None and function.default is None
    return CheckpointPath(front, generator, split, options, decorator)


PATH = _checkpoint_path()


def call_generator(
    original: Callable[..., CheckpointGenerator],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    options: Options,
) -> CheckpointGenerator:
    """Start torch's own generator ``original`` in this torch's calling convention."""
    if PATH.split:
        return original(fn, args, kwargs, **options)
    positional = [options[name] for name in _OPTIONS]
    return original(fn, *positional, *args, **kwargs)


def generator_like(
    body: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any], Options], Any],
) -> Callable[..., Any]:
    """A stand-in for torch's generator, called as torch calls it, running
    ``body(fn, args, kwargs, options)`` (which returns the generator)."""
    if PATH.split:

        def impl(fn: Callable[..., Any], args: Any, kwargs: Any, **options: Any) -> Any:
            return body(fn, tuple(args), dict(kwargs), options)

        return impl

    def generator(
        fn: Callable[..., Any],
        preserve_rng_state: bool = True,
        context_fn: ContextFn | None = None,
        determinism_check: str = "default",
        debug: bool = False,
        early_stop: bool = True,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        context = NOOP_CONTEXT_FN if context_fn is None else context_fn
        values = (preserve_rng_state, context, determinism_check, debug, early_stop)
        return body(fn, args, kwargs, dict(zip(_OPTIONS, values, strict=True)))

    return generator


def checkpoint_debug_enabled(debug: bool) -> bool:
    """torch's own rule: ``set_checkpoint_debug_enabled`` overrides the ``debug`` argument."""
    switch: bool | None = getattr(torch_checkpoint, "_checkpoint_debug_enabled", None)
    return debug if switch is None else switch


_DEBUG_PENDING: contextvars.ContextVar[ContextFn | None] = contextvars.ContextVar(
    "scopedckpt_debug_pending", default=None
)
_DEBUG_NAME = "_get_debug_context_and_cb"
_DEBUG_LOCK = threading.Lock()
_DEBUG_USERS = 0
_TORCH_DEBUG_CONTEXT: list[Callable[[], tuple[ContextFn, Any]]] = []  # torch's, while swapped


def _debug_context_and_cb() -> tuple[ContextFn, Any]:
    """torch's debug context_fn and callback; with ours composed in when one is pending."""
    debug_context_fn, callback = _TORCH_DEBUG_CONTEXT[0]()
    ours = _DEBUG_PENDING.get()
    if ours is None:
        return debug_context_fn, callback
    _DEBUG_PENDING.set(None)  # one call only: nested regions inside push their own
    return compose(ours, debug_context_fn), callback


@contextlib.contextmanager
def debug_composed(context_fn: ContextFn) -> Iterator[None]:
    """Let the next ``checkpoint(..., debug=True)`` in this context run ``context_fn`` too.

    torch's ``_get_debug_context_and_cb`` is swapped while any such block is
    open (reference-counted, in any thread) and put back after the last.

    Raises
    ------
    ScopedCkptError
        If this torch has no ``_get_debug_context_and_cb``, or its checkpoint
        did not call it: the region would have run without scopedckpt.
    """
    global _DEBUG_USERS
    with _DEBUG_LOCK:
        if _DEBUG_USERS == 0:
            torch_function = getattr(torch_checkpoint, _DEBUG_NAME, None)
            if torch_function is None:
                piece = f"torch.utils.checkpoint.{_DEBUG_NAME}"
                raise ScopedCkptError(missing_piece(piece, "debug=True"))
            _TORCH_DEBUG_CONTEXT[:] = [torch_function]
            setattr(torch_checkpoint, _DEBUG_NAME, _debug_context_and_cb)
        _DEBUG_USERS += 1
    token = _DEBUG_PENDING.set(context_fn)
    try:
        yield
        if _DEBUG_PENDING.get() is not None:
            piece = f"a call of torch.utils.checkpoint.{_DEBUG_NAME}"
            raise ScopedCkptError(missing_piece(piece, "debug=True"))
    finally:
        _DEBUG_PENDING.reset(token)
        with _DEBUG_LOCK:
            _DEBUG_USERS -= 1
            if _DEBUG_USERS == 0:
                setattr(torch_checkpoint, _DEBUG_NAME, _TORCH_DEBUG_CONTEXT.pop())


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


def written_positions(func: Any) -> tuple[tuple[int, str, bool], ...]:
    """Where an op's schema marks arguments it writes in place (``Tensor(a!)``): each as
    (position, name, keyword-only); empty for an op that writes none."""
    schema = func._schema
    if not schema.is_mutable:
        return ()
    return tuple(
        (index, argument.name, argument.kwarg_only)
        for index, argument in enumerate(schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
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


# Tensor and module internals, as C-level getters where they sit on hot paths.
version_of: Callable[[torch.Tensor], int] = operator.attrgetter("_version")
"""A tensor's version counter, bumped by every in-place change."""
base_of: Callable[[torch.Tensor], torch.Tensor | None] = operator.attrgetter("_base")
"""The tensor a view was made from, or None (the memory report's owner of a saved view)."""
functorch_level: Callable[[], int | None] = torch._C._functorch.maybe_current_level
"""The level of the innermost torch.func transform running (vmap, grad, ...), or None."""

# torch's layer bases: scoped layers subclass them, convert() recognises their subclasses.
DropoutBase = torch.nn.modules.dropout._DropoutNd
BatchNormBase = torch.nn.modules.batchnorm._BatchNorm
NormBase = torch.nn.modules.batchnorm._NormBase


def check_input_dim(module: BatchNormBase, input: torch.Tensor) -> None:
    """A batch norm's own input check (``_check_input_dim``), raising torch's error."""
    module._check_input_dim(input)


module_buffers: Callable[[torch.nn.Module], dict[str, torch.Tensor | None]]
module_buffers = operator.attrgetter("_buffers")
"""The module's own registered buffers, by name: the dict itself, to swap entries in."""

module_parameters: Callable[[torch.nn.Module], dict[str, torch.nn.Parameter | None]]
module_parameters = operator.attrgetter("_parameters")
"""The module's own registered parameters, by name: the dict itself, to swap entries in."""
module_hooks = operator.attrgetter("_forward_pre_hooks", "_forward_hooks")
"""The module's own forward pre-hooks and forward hooks, by handle id: the dicts themselves."""

_PARAMETRIZE: dict[str, Any] = vars(torch.nn.utils.parametrize)  # its module globals


def parametrize_cache(put: tuple[int, dict[Any, Any]] | None = None) -> tuple[int, dict[Any, Any]]:
    """``parametrize.cached()``'s state, read at each access of a parametrized tensor: (blocks
    open, 0 where this torch has none; the cache by (id(module), name)); ``put`` replaces it."""
    present = _PARAMETRIZE.get("_cache_enabled", 0), _PARAMETRIZE.get("_cache", {})
    if put is not None:
        _PARAMETRIZE["_cache_enabled"], _PARAMETRIZE["_cache"] = put
    return present


# torch's global module hooks, by key: the buffer guard puts its own in at a key of its
# own (registering returns a handle per install, at every region's first forward).
_module = torch.nn.modules.module
# An OrderedDict (tested): the guard moves its pre-hook to the front.
GLOBAL_PRE_HOOKS = cast("OrderedDict[Any, Callable[..., Any]]", _module._global_forward_pre_hooks)
GLOBAL_POST_HOOKS: dict[Any, Callable[..., Any]] = _module._global_forward_hooks
GLOBAL_POST_HOOKS_ALWAYS_CALLED: dict[Any, bool] = _module._global_forward_hooks_always_called


# What torch raises inside a recompute to end it early (early stop): no failure.
STOP_RECOMPUTATION: type[BaseException] = torch_checkpoint._StopRecomputationError


def register_determinism_check(name: str, metadata_fn: Callable[[torch.Tensor], Any]) -> None:
    """Make torch's ``determinism_check=name`` compare ``metadata_fn`` of each saved tensor."""
    torch_checkpoint._allowed_determinism_checks_to_fns[name] = metadata_fn


def recompute_whole(depth: int) -> bool:
    """Turn early stop off for the checkpoint whose pack hook (torch's, or the eager region's:
    its ``frame`` has ``early_stop``) called a check ``depth`` frames up; whether found."""
    caller = sys._getframe(depth + 1)
    frame = caller.f_locals.get("frame")
    if frame is None or not isinstance(getattr(frame, "early_stop", None), bool):
        return False
    frame.early_stop = False
    return True


def bound_arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """An aten op's arguments by schema name, defaults included."""
    named = dict(kwargs)
    for index, argument in enumerate(func._schema.arguments):
        if index < len(args):
            named[argument.name] = args[index]
        elif argument.name not in named and argument.has_default_value():
            named[argument.name] = argument.default_value
    return named


def tracing() -> bool:
    """Whether torch.compile is tracing now (dynamo or AOT autograd), in this thread."""
    return torch._guards.TracingContext.try_get() is not None


def top_saved_tensors_hooks() -> tuple[Callable[[Any], Any], Callable[[Any], Any]] | None:
    """The innermost ``saved_tensors_hooks`` pair now in force, or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


# torch's non-reentrant algorithm, for the eager region's own (_eager_checkpoint.py).
# A tensor saved as autograd saves a node's input (through the hooks in force).
make_saved_tensor = functools.partial(torch._C._autograd._make_saved_tensor, is_output=False)
infer_device_type: Callable[..., str] = torch_checkpoint._infer_device_type
early_stop_override = functools.partial(getattr, torch_checkpoint, "_enable_checkpoint_early_stop")
_HOOKS = getattr(
    torch_checkpoint, "_checkpoint_internal_hook", torch.autograd.graph.saved_tensors_hooks
)


def internal_hooks(pack: Callable[[Any], Any], unpack: Callable[[Any], Any]) -> Any:
    """``saved_tensors_hooks`` marked as a checkpoint's (torch >= 2.14 looks past them)."""
    pack._checkpoint_internal = True  # type: ignore[attr-defined]
    return _HOOKS(pack, unpack)


def modes_active() -> bool:
    """Whether a torch function or dispatch mode is active (a device context, a trace)."""
    return bool(torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack())


_C = torch._C


def innermost_modes() -> tuple[Any, Any]:
    """The innermost torch function mode and dispatch mode in force in this thread (None
    where there is none): the first each call and each op meets. ``pop_*_mode()`` takes the
    innermost off its stack, ``push_*_mode(mode)`` puts one on."""
    functions, dispatches = _C._len_torch_function_stack(), _C._len_torch_dispatch_stack()
    return (
        _C._get_function_stack_at(functions - 1) if functions else None,
        _C._get_dispatch_stack_at(dispatches - 1) if dispatches else None,
    )


pop_function_mode: Callable[[], Any] = _C._pop_torch_function_stack
push_function_mode: Callable[[Any], None] = _C._push_on_torch_function_stack
pop_dispatch_mode = functools.partial(_C._pop_torch_dispatch_stack, None)
push_dispatch_mode: Callable[[Any], None] = _C._push_on_torch_dispatch_stack


def determinism_check_fn(name: str) -> Callable[[torch.Tensor], Any]:
    """The metadata function torch's ``determinism_check=name`` compares."""
    checks = torch_checkpoint._allowed_determinism_checks_to_fns
    if name not in checks:
        raise ValueError(f"determinism_check should be one of {list(checks)}, but got {name}")
    return checks[name]


def graph_task_key() -> Any:
    """What recomputed tensors are kept by: the graph execution group, else the backward
    running now, else a fresh key (torch's rule)."""
    task = torch._C._get_graph_exec_group() or torch._C._current_graph_task_id()
    return object() if task == -1 else task
