"""What a recompute swaps in for module state, and how it puts it back: copies of guarded
modules' buffers, ``Stateful`` snapshots, registrations.

The buffer guard (NOTE [ buffer guard ] in ``_guard.py``) decides which calls
are guarded and when; this module keeps their state: ``enter`` before a first
forward's guarded call, ``exit_`` after it (strict mode), ``record_subtree`` when a
region over a module starts, ``swap_in_first`` when a recompute starts (which modules
need it at all: ``guarded``, in ``core/_subtree.py``).
``swap`` and ``put_back`` are the one way the mechanisms swap a value into a
dict (a registration, a module's ``__dict__``) for a recompute and undo it.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from ..core._errors import ScopedCkptError
from ..core._names import frame_region_name
from ..core._state import Frame, module_path
from ..core._subtree import Listing, subtree
from ..core._torch_private import module_buffers
from ._report import stats_of
from ._verify import not_verified_statistics, verified_call

__all__ = [
    "MISSING",
    "SWAPPED",
    "ModuleState",
    "Stateful",
    "Swapped",
    "enter",
    "exit_",
    "initialize_lazy",
    "put_back",
    "record_subtree",
    "swap",
    "swap_in_first",
]


@runtime_checkable
class Stateful(Protocol):
    """State a module keeps outside its registered buffers, restored around recomputes.

    A module whose forward changes state that is not a registered buffer (a
    Python counter, an object it owns) implements these two methods; inside
    checkpoint regions scopedckpt then calls ``scopedckpt_state()`` when a region over
    the module (or a module holding it) starts, else before the module's first call in
    a region's first forward, restores that snapshot with
    ``scopedckpt_restore(snapshot)`` when the region's recompute starts (its calls
    go on from it as the first forward's did), and puts back what it found when
    the recompute ends. The snapshot must not be changed by later calls: return
    copies (restore may be called with the same snapshot several times).

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
    """What a region's recompute starts one guarded module from (on the tape): its state
    when the region started (a module of its subtree) or before the first call in the
    region's first forward of it or of a module holding it."""

    module: nn.Module
    buffers: list[tuple[str, Tensor]]  # every buffer's value then
    state: Any  # the Stateful snapshot, or MISSING


# What a dict held at each key a swap set, as (dict, key, value or MISSING), in order.
Swapped = list[tuple[dict[str, Any], str, Any]]
MISSING = object()  # a key a dict did not hold; no Stateful snapshot


def swap(d: dict[str, Any], key: str, value: Any, found: Swapped) -> None:
    """Set ``d[key]`` to ``value`` (``MISSING``: remove it), noting in ``found`` what it
    held."""
    found.append((d, key, d.get(key, MISSING)))
    if value is MISSING:
        del d[key]
    else:
        d[key] = value


def put_back(found: Swapped) -> None:
    """Undo the swaps ``found`` noted, the last first."""
    for d, key, value in reversed(found):
        if value is MISSING:
            d.pop(key, None)
        else:
            d[key] = value


def _stateful(module: nn.Module) -> bool:
    return callable(getattr(type(module), "scopedckpt_restore", None))


def _snapshot(module: nn.Module) -> Any:
    return getattr(module, "scopedckpt_state")()  # noqa: B009 - nn.Module's __getattr__ types it as a Tensor


def _restore(module: nn.Module, state: Any) -> None:
    getattr(module, "scopedckpt_restore")(state)  # noqa: B009


def _same(a: Any, b: Tensor) -> bool:
    return isinstance(a, Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def _copies(module: nn.Module) -> list[tuple[str, Tensor]]:
    return [(n, b.clone()) for n, b in module_buffers(module).items() if b is not None]


def enter(frame: Frame, module: nn.Module) -> None:
    """Before a guarded call of a first forward: at the first call in the region of a
    module not recorded yet, record it and its subtree (``record_subtree``), which the
    recompute starts from (``swap_in_first``); in strict mode, put copies to check the
    call against (``exit_``) on the frame's stack."""
    if verified_call(frame.tape) is not None:
        not_verified_statistics(module)
    states = frame.tape.states
    if id(module) not in states:
        copied = record_subtree(states, subtree(module))
        stats = stats_of(frame.tape)
        if stats is not None:  # the memory report's row counts the copies as kept
            stats.kept_bytes += copied
    if frame.scope.strict:
        frame.guards.append((module, _copies(module)))


def record_subtree(states: dict[int, ModuleState], listing: Listing) -> int:
    """Record the state of every guarded module of a subtree not recorded yet, called or
    not (a forward may write their buffers without calling them: QAT's fused fake quant
    updates its observer child's statistics in its op, a bank is pushed through a
    method); returns the bytes copied.

    When a region over a module starts, its subtree; at a first forward's first call of
    a module outside it, that module's. A module with lazy buffers is recorded at its
    first call instead, once initialized (``initialize_lazy``).
    """
    copied = 0
    for ref in listing.guarded:
        module = ref()
        if module is None or id(module) in states:
            continue
        if any(is_lazy(b) for b in module_buffers(module).values() if b is not None):
            continue
        buffers = _copies(module)
        state = _snapshot(module) if _stateful(module) else MISSING
        states[id(module)] = ModuleState(module, buffers, state)
        copied += sum(b.nbytes for _, b in buffers)
    return copied


# The tensors (module id, name) the recompute frames running in this context swapped
# copies in for (swap_in_first, and _written for parameters): a nested region's
# recompute, run inside its parent's, writes on them and leaves them in place.
SWAPPED: contextvars.ContextVar[frozenset[tuple[int, str]]] = contextvars.ContextVar(
    "scopedckpt_swapped", default=frozenset()
)


def swap_in_first(frame: Frame) -> Callable[[], None]:
    """A recompute starts: swap copies in for the buffers of every module recorded, of
    their recorded values, and put back each one's snapshot (NOTE [ buffer guard ]);
    returns what puts the real ones back.

    Buffers an enclosing recompute swapped (``SWAPPED``) keep their copies.
    """
    swapped = SWAPPED.get()
    seen = set(swapped)
    verified = verified_call(frame.tape) is not None
    found: Swapped = []
    states: list[tuple[nn.Module, Any]] = []  # (module, its state to put back)
    for record in frame.tape.states.values():  # in the order recorded
        holder = record.module
        for name, before in record.buffers:
            if (id(holder), name) in seen:
                continue
            seen.add((id(holder), name))
            # A copy: a later recompute needs `before` again.
            swap(module_buffers(holder), name, before.clone(), found)
        if verified and record.buffers:
            not_verified_statistics(holder)
        if record.state is not MISSING:
            states.append((record.module, _snapshot(record.module)))
            _restore(record.module, record.state)
    token = SWAPPED.set(frozenset(seen)) if len(seen) > len(swapped) else None
    return functools.partial(_put_back, found, states, token)


def _put_back(
    found: Swapped,
    states: list[tuple[nn.Module, Any]],
    token: contextvars.Token[frozenset[tuple[int, str]]] | None,
) -> None:
    """Put back the states, then the buffers (independent: snapshots hold no buffer)."""
    if token is not None:
        SWAPPED.reset(token)
    for module, state in states:
        _restore(module, state)
    put_back(found)


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
    """After a guarded call of a strict first forward: a module changing its buffers in
    a region is not on the fast path."""
    _, copies = frame.guards.pop()
    buffers = module_buffers(module)
    changed = [name for name, copy in copies if not _same(buffers.get(name), copy)]
    if changed:
        raise ScopedCkptError(
            f"scopedckpt: strict mode found {module_path(module, frame)} changing buffers in "
            "a region: use a scoped layer or turn strict off.\n"
            f"It changed {', '.join(changed)} in {frame_region_name(frame)}. The buffer guard "
            "keeps the recompute from changing them again, at the cost of a copy of them per "
            "region; strict mode asks for scoped layers instead. Replace it with a scoped layer "
            "(scopedckpt.convert(model) converts torch's batch norms), or turn strict off."
        )
