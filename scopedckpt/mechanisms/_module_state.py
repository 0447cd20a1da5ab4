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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from ..core._errors import ScopedCkptError
from ..core._names import frame_region_name
from ..core._state import RECOMPUTE, Frame, module_path
from ..core._subtree import guarded
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


def _stateful(module: nn.Module) -> bool:
    return callable(getattr(type(module), "scopedckpt_restore", None))


def _snapshot(module: nn.Module) -> Any:
    return getattr(module, "scopedckpt_state")()  # noqa: B009 - nn.Module's __getattr__ types it as a Tensor


def _restore(module: nn.Module, state: Any) -> None:
    getattr(module, "scopedckpt_restore")(state)  # noqa: B009


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


def _copies(module: nn.Module) -> list[tuple[str, Tensor]]:
    return [(n, b.clone()) for n, b in module_buffers(module).items() if b is not None]


def enter(frame: Frame, module: nn.Module) -> int:
    """Before a guarded call of a first forward: at the module's first call in the frame,
    record its state (copies of its buffers and its submodules', its snapshot), which the
    recompute starts from; in strict mode, copies to check the call against. A
    recompute's calls run on the copies ``swap_in_first`` put in.

    Returns the call's index (how many calls of the module came before it)."""
    index = count_call(frame, module)
    if frame.phase is RECOMPUTE:
        return index
    if verified_call(frame.tape) is not None:
        not_verified_statistics(module)
    states = frame.tape.states
    saved: list[tuple[str, Tensor]] | None = None
    if id(module) not in states:
        saved = _copies(module)
        state = _snapshot(module) if _stateful(module) else _NONE
        nested = _nested(module)
        states[id(module)] = ModuleState(module, saved, state, nested)
        stats = stats_of(frame.tape)
        if stats is not None:  # the memory report's row counts the copies as kept
            stats.kept_bytes += sum(tensor.nbytes for _, tensor in saved)
            stats.kept_bytes += sum(tensor.nbytes for *_, tensor in nested)
    if frame.scope.strict:  # checked after the call (exit_)
        frame.guards.append(GuardEntry(module, index, saved or _copies(module), _NONE))
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
    """A recompute starts: swap copies in for the buffers of every module its first
    forward called, of their values before the module's first call, and put back each
    one's snapshot, until the recompute ends.

    The recompute's calls update the copies as the first forward's updated the real
    ones, so before, between and after calls it reads what the first forward read
    (QAT's ``ConvBn2d`` folds ``bn.running_var`` into its weight before calling ``bn``;
    a fake quant reads its observer's statistics after calling it). The real ones go
    on the frame's guard stack, and ``unwind`` puts them back. Buffers the unguarded
    writes swapped (``SWAPPED``) already hold copies, of their values at the region's
    start.
    """
    skip = SWAPPED.get()
    verified = verified_call(frame.tape) is not None
    reals: dict[int, GuardEntry] = {}  # by holder id
    seen: set[tuple[int, str]] = set()
    for record in frame.tape.states.values():  # in the order of the first calls
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
            if verified:
                not_verified_statistics(holder)
        if record.state is not _NONE:
            entry = reals.get(id(record.module))
            if entry is None:
                entry = reals[id(record.module)] = GuardEntry(record.module, -1, [], _NONE)
            entry.state = _snapshot(record.module)
            _restore(record.module, record.state)
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
    """After a guarded call of a first forward: strict mode's check."""
    if frame.phase is not RECOMPUTE and frame.scope.strict:
        _refuse_changes(frame, module, frame.guards.pop())


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
    """Leave no swapped buffer behind when a frame ends: a recompute's real buffers and
    states (``swap_in_first``); a first forward's strict checks left by an error."""
    while frame.guards:
        entry = frame.guards.pop()
        if frame.phase is RECOMPUTE:
            _put_back(entry)
