"""What one guarded module call keeps and puts back: copies of its buffers, snapshots.

The buffer guard (NOTE [ buffer guard ] in ``_guard.py``) decides which calls
are guarded and when; this module does the guarding of one call: ``enter``
before it, ``exit_`` after it, ``unwind`` when a frame ends, and says
which modules need it at all (``guarded``). A call's state is its module's
buffers and its submodules' (``_nested``); a recompute runs on copies of them from
its start (``swap_in_first``) to its end (``unwind``).
"""

from __future__ import annotations

import contextvars
import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from ..core._errors import ScopedCkptError
from ..core._names import frame_region_name
from ..core._state import RECOMPUTE, Frame, module_path
from ..core._torch_private import module_buffers
from ._report import stats_of
from ._verify import not_verified_statistics, verified_call

__all__ = [
    "SWAPPED",
    "GuardEntry",
    "ModuleState",
    "Stateful",
    "count_call",
    "enter",
    "exit_",
    "guarded",
    "initialize_lazy",
    "self_guarded",
    "swap_in_first",
    "unwind",
]


@runtime_checkable
class Stateful(Protocol):
    """State a module keeps outside its registered buffers, restored around recomputes.

    A module whose forward changes state that is not a registered buffer (a
    Python counter, an object it owns) implements these two methods; inside
    checkpoint regions scopedckpt then calls ``scopedckpt_state()`` before each
    first-forward call, and around the recompute of that call restores the
    snapshot with ``scopedckpt_restore(snapshot)`` and afterwards puts back what
    it found. The snapshot must not be changed by later calls: return copies
    (restore may be called with the same snapshot several times).

    Example
    -------
    >>> import torch, scopedckpt
    >>> class Counted(torch.nn.Linear):
    ...     calls = 0
    ...     def forward(self, x):
    ...         self.calls += 1
    ...         return super().forward(x) * self.calls
    ...     def scopedckpt_state(self):
    ...         return self.calls
    ...     def scopedckpt_restore(self, state):
    ...         self.calls = state
    >>> layer = Counted(2, 2)
    >>> x = torch.ones(1, 2, requires_grad=True)
    >>> with scopedckpt.checkpointing():
    ...     y = scopedckpt.checkpoint(layer, x)
    >>> y.sum().backward()        # the recompute sees calls == 0 before its update
    >>> layer.calls
    1
    """

    def scopedckpt_state(self) -> Any: ...

    def scopedckpt_restore(self, state: Any) -> None: ...


@dataclass
class ModuleState:
    """What a recompute of one guarded call restores (on the tape)."""

    module: nn.Module
    buffers: list[tuple[str, Tensor]]  # every buffer's value before the call
    state: Any  # the Stateful snapshot, or _NONE
    # its submodules' buffers' values before the call, as (holder, name, value)
    nested: Sequence[tuple[nn.Module, str, Tensor]] = ()


@dataclass
class GuardEntry:
    """A guarded call running now (on the frame's stack); under a recompute's calls, with
    index -1, the real buffers of one module it runs on copies of (``swap_in_first``)."""

    module: nn.Module
    index: int
    # (name, tensor): forward, copies before the call; recompute, none (index -1: the reals)
    saved: list[Any]
    state: Any  # forward: the snapshot; recompute: the state to put back


_NONE = object()
_SELF_GUARDED: set[Callable[..., Any]] = set()
# _class_kind's answers by id(class), each beside a weak reference to its class whose
# callback removes the entry when the class goes: classes made at run time can go,
# and an id is never reused while its entry is here. (A WeakKeyDictionary makes a
# weak reference at every lookup, and the guard looks up every module call.)
_CLASSES: dict[int, tuple[bool | None, weakref.ref[type]]] = {}


def self_guarded(forward: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a forward that keeps its module's buffers itself (scoped batch norm)."""
    _SELF_GUARDED.add(forward)
    _CLASSES.clear()
    return forward


def _stateful_class(cls: type) -> bool:
    return callable(getattr(cls, "scopedckpt_restore", None))


def _stateful(module: nn.Module) -> bool:
    return _stateful_class(type(module))


def _snapshot(module: nn.Module) -> Any:
    return getattr(module, "scopedckpt_state")()  # noqa: B009 - nn.Module's __getattr__ types it as a Tensor


def _restore(module: nn.Module, state: Any) -> None:
    getattr(module, "scopedckpt_restore")(state)  # noqa: B009


def _class_kind(cls: type) -> bool | None:
    """Per class: None if its forward guards itself, else whether it is :class:`Stateful`.

    Cached, since the global hook asks at every module call of a first forward.
    Whether an instance has buffers is asked of the instance each time: buffers
    come and go (a module may register one after construction).
    """
    entry = _CLASSES.get(id(cls))
    if entry is not None:
        return entry[0]
    kind = None if getattr(cls, "forward", None) in _SELF_GUARDED else _stateful_class(cls)
    _CLASSES[id(cls)] = (kind, weakref.ref(cls, functools.partial(_forget_class, id(cls))))
    return kind


def _forget_class(key: int, _: object) -> None:
    _CLASSES.pop(key, None)


def guarded(module: nn.Module) -> bool:
    """Whether calls of ``module`` are guarded: it has buffers or is Stateful, and its
    forward does not guard itself."""
    entry = _CLASSES.get(id(type(module)))
    kind = entry[0] if entry is not None else _class_kind(type(module))
    return kind is not None and (kind or bool(module_buffers(module)))


def _same(a: Any, b: Tensor) -> bool:
    return isinstance(a, Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _nested(module: nn.Module) -> Sequence[tuple[nn.Module, str, Tensor]]:
    """Copies of the buffers of ``module``'s guarded submodules, as (holder, name, copy).

    A forward may write a submodule's buffers without calling it (QAT's fused fake
    quant updates its observer child's statistics in its op, moving no version: NOTE [
    buffer guard ]). A leaf (a batch norm) costs one look for children.
    """
    if next(module.children(), None) is None:
        return ()
    return [
        (sub, name, b.clone())
        for sub in module.modules()
        if sub is not module and guarded(sub)
        for name, b in module_buffers(sub).items()
        if b is not None and not is_lazy(b)
    ]


def count_call(frame: Frame, module: nn.Module) -> int:
    """How many calls of ``module`` came before this one in the frame (and count this one)."""
    index = frame.calls.get(id(module), 0)
    frame.calls[id(module)] = index + 1
    return index


def enter(frame: Frame, module: nn.Module) -> int:
    """Before a guarded call: copy its state (forward) or swap in the recorded one.

    Returns the call's index (how many calls of the module came before it)."""
    if verified_call(frame.tape) is not None:
        not_verified_statistics(module)  # the registered ones now, the swapped copies below
    index = count_call(frame, module)
    stateful = _stateful(module)
    if frame.phase is not RECOMPUTE:
        saved = [(n, b.clone()) for n, b in module_buffers(module).items() if b is not None]
        state = _snapshot(module) if stateful else _NONE
        nested = _nested(module)
        frame.tape.states[(id(module), index)] = ModuleState(module, saved, state, nested)
        stats = stats_of(frame.tape)
        if stats is not None:  # the memory report's row counts the copies as kept
            stats.kept_bytes += sum(tensor.nbytes for _, tensor in saved)
            stats.kept_bytes += sum(tensor.nbytes for *_, tensor in nested)
        if frame.scope.strict:  # checked after the call (exit_)
            frame.guards.append(GuardEntry(module, index, saved, state))
        return index
    record: ModuleState | None = frame.tape.states.get((id(module), index))
    if record is None:
        raise ScopedCkptError(
            f"scopedckpt: the recompute of {frame_region_name(frame)} called "
            f"{type(module).__name__} more often than its first forward: move data-dependent "
            "branches out of it.\n"
            f"Its call {index + 1} of {module_path(module, frame)}, a module with buffers or "
            "state, has no state to recompute it from. The region's control flow must not "
            "depend on data that changes between forward and backward."
        )
    # The buffers hold copies since the recompute started (swap_in_first): fresh ones of
    # the values before this call, left after it, as the first forward left the real ones.
    for name, before in record.buffers:
        # A copy: a later recompute needs `before` again.
        module_buffers(module)[name] = before.clone()
    for holder, name, before in record.nested:
        module_buffers(holder)[name] = before.clone()
    if verified_call(frame.tape) is not None:
        not_verified_statistics(module)
    current = _NONE
    if record.state is not _NONE:
        current = _snapshot(module)
        _restore(module, record.state)
    frame.guards.append(GuardEntry(module, index, [], current))
    return index


# The buffers (module id, name) the recompute frames being run in this context have
# swapped copies in for (NOTE [ unguarded writes ] in _written.py, which sets it): a region
# nested in another runs its forward again inside the outer one's recompute, where the
# outer's copies already hold the values its first forward found, and its writes must
# land on them; and swap_in_first leaves them, holding the values at the region's start.
SWAPPED: contextvars.ContextVar[frozenset[tuple[int, str]]] = contextvars.ContextVar(
    "scopedckpt_swapped", default=frozenset()
)


def swap_in_first(frame: Frame) -> None:
    """A recompute starts: swap copies in for every buffer its calls will swap, of their
    values before the first of them in the first forward, until the recompute ends.

    Its calls swap fresh copies in and leave them: between and before calls the
    recompute reads what the first forward read (QAT's ``ConvBn2d`` folds
    ``bn.running_var`` into its weight before calling ``bn``; a fake quant reads its
    observer's statistics after calling it). The real ones go on the guard's stack,
    under the calls, and ``unwind`` puts them back. Buffers the unguarded writes swapped
    (``SWAPPED``) already hold copies, of their values at the region's start.
    """
    skip = SWAPPED.get()
    reals: dict[int, GuardEntry] = {}  # by holder id
    seen: set[tuple[int, str]] = set()
    for record in frame.tape.states.values():  # in the order of the calls
        own = ((record.module, name, before) for name, before in record.buffers)
        for holder, name, before in (*own, *record.nested):
            key = (id(holder), name)
            if key in seen or key in skip:
                continue
            seen.add(key)
            entry = reals.get(id(holder))
            if entry is None:
                entry = reals[id(holder)] = GuardEntry(holder, -1, [], _NONE)
            buffers = module_buffers(holder)
            entry.saved.append((name, buffers.get(name)))
            buffers[name] = before.clone()  # a copy: later recomputes need `before` again
    frame.guards.extend(reals.values())


def initialize_lazy(frame: Frame, module: nn.Module, args: tuple[Any, ...]) -> None:
    """Initialize a lazy module at its first call, before the guard copies its buffers.

    torch's lazy modules (``nn.LazyBatchNorm1d``) hold ``UninitializedBuffer``
    placeholders until their own forward pre-hook initializes them from the
    first input, and that hook runs after this guard's global one: there is
    nothing to copy yet. So the guard calls ``initialize_parameters`` itself,
    with the same input, at the same point (module hooks run one after the
    other), and the module's own hook then finds it initialized (torch's lazy
    modules check ``has_uninitialized_params()`` first, as torch's docs ask
    of every lazy module).
    """
    if not any(is_lazy(b) for b in module_buffers(module).values() if b is not None):
        return
    initialize = getattr(module, "initialize_parameters", None)
    if not callable(initialize) or not args:
        raise ScopedCkptError(
            f"scopedckpt: a lazy {type(module).__name__} was first called in "
            f"{frame_region_name(frame)}: call the model once outside checkpointing first.\n"
            f"{module_path(module, frame)} has uninitialized (lazy) buffers at its first call, "
            "inside a checkpoint region, and the buffer guard cannot initialize it (no "
            "initialize_parameters method, or no positional input to initialize it from), so "
            "there is no state to recompute it from. Call the model once outside "
            "checkpointing first, as torch asks before building an optimizer over lazy "
            "modules."
        )
    initialize(*args)  # as torch's own hook calls it (global hooks get no keywords)


def exit_(frame: Frame, module: nn.Module) -> None:
    """After a guarded call: strict mode's check (forward) or put the reals back."""
    if frame.phase is not RECOMPUTE:
        if frame.scope.strict:
            _refuse_changes(frame, module, frame.guards.pop())
        return
    _put_back(frame.guards.pop())


def _refuse_changes(frame: Frame, module: nn.Module, entry: GuardEntry) -> None:
    """Strict mode: a module changing its buffers in a region is not on the fast path."""
    buffers = module_buffers(module)
    changed = [name for name, copy in entry.saved if not _same(buffers.get(name), copy)]
    if changed:
        raise ScopedCkptError(
            f"scopedckpt: strict mode found {module_path(module, frame)} changing buffers in "
            "a region: use a scoped layer or turn strict off.\n"
            f"It changed {', '.join(changed)} in {frame_region_name(frame)}. The buffer guard "
            "keeps the recompute from changing them again, at the cost of a copy per call; "
            "strict mode asks for scoped layers instead. Replace it with a scoped layer "
            "(scopedckpt.convert(model) converts torch's batch norms), or turn strict off."
        )


def _put_back(entry: GuardEntry) -> None:
    for name, real in entry.saved:
        module_buffers(entry.module)[name] = real
    if entry.state is not _NONE:
        _restore(entry.module, entry.state)


def unwind(frame: Frame) -> None:
    """Leave no swapped buffer behind when a frame ends: a recompute's real buffers
    (``swap_in_first``), and after an error or early stop its calls' states."""
    while frame.guards:
        entry = frame.guards.pop()
        if frame.phase is RECOMPUTE:
            _put_back(entry)
