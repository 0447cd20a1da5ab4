"""The buffer guard: recomputes never change module state.

NOTE [ buffer guard ]
=====================
A recompute runs a region's modules a second time, and any module that
updates a buffer in its forward (BatchNorm of any implementation, EMA
statistics, step counters, spectral norm's power iteration) would update it
again. The guard makes every recompute see, and leave, module state exactly
as the first forward did:

* A region's first forward finds the modules it calls through a global module
  forward pre-hook, installed while any first-forward frame is active, in
  any thread (reference-counted by frame entries; it returns at once in
  contexts without a frame, and traces to nothing in compiled code that runs
  in no eager frame). A global hook sends every module call down
  ``nn.Module``'s slow path (its cost per call: docs/benchmarks.md), so a
  recompute does without one: its tape says which
  modules need guarding, and it hooks only those, while it runs (usually
  none: converted models keep no module state on the tape). Strict mode and
  selective saving, which must see every call, keep global hooks (a forward
  hook too, run after each call) in recomputes as well.
* *What is guarded:* the registered buffers (``module._buffers``, not those of
  submodules: each submodule is guarded at its own call) of every module
  called through ``__call__`` inside a region, and the region's owner module
  itself; plus any state a module exposes through the :class:`Stateful`
  protocol. *Not guarded:* plain Python attributes, tensors that are not
  registered buffers, parameters changed in place in forward, globals,
  buffers a module registers during its own call (the guard looks before
  the call): use :func:`scopedckpt.replay` or the protocol for those.
  torch's lazy modules keep placeholders until their first call fills them;
  the guard fills them itself first (``_initialize_lazy``).
* First forward: before each guarded call the module's buffers are copied
  and the copies go on the tape at once, keyed by (module, how many calls of
  it came before in this frame). All of them, not only those the call changed: a
  buffer the call left bitwise unchanged (a running variance whose update
  rounds back to itself) may have been moved on by later calls when the
  recompute comes, and would then be updated for real (found by the property
  test). The cost is a copy of each called module's own buffers per call,
  kept until backward; modules without buffers (most) cost nothing.
* Recompute: before the same call (the module's own hooks find it) all of
  its buffers are swapped for fresh copies of their values *before* the
  first forward's call, so the recompute computes from the same state (a
  counter read after its update reads the same number) and its own updates
  land on the copies; after the call the real buffers are put back,
  untouched. Swapping objects rather than copying values also keeps the real
  buffers' version counters, which the first forward's graph may have saved.
  A module with buffers that only the recompute calls is not hooked there:
  the region's control flow changed between forward and backward, which
  torch's determinism check reports when the calls save tensors, and strict
  mode always.
* Scoped batch norm guards itself (throwaway running buffers, no copies), so
  the guard skips it: the fast path stays fast.
* ``checkpointing(strict=True)`` turns a changed buffer into a
  :class:`ScopedCkptError` naming the module path: a lint that every stateful
  layer in regions is a scoped one.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.utils.hooks import RemovableHandle

from ._errors import ScopedCkptError
from ._selective import internal
from ._state import FRAME, MIRROR, Frame, Phase, RegionCall, Tape, module_path
from ._torch_private import module_buffers

__all__ = [
    "FRAME_PHASES",
    "GuardEntry",
    "ModuleState",
    "Stateful",
    "begin",
    "end",
    "enter_frame",
    "guarded_call",
    "start_region",
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


@dataclass
class GuardEntry:
    """A guarded call running now (on the frame's stack)."""

    module: nn.Module
    index: int
    saved: list[Any]  # (name, tensor): forward, copies before the call; recompute, the reals
    state: Any  # forward: the snapshot; recompute: the state to put back


_NONE = object()
_UNSEEN = object()
_SELF_GUARDED: set[Callable[..., Any]] = set()
# _class_kind's answers; weak keys, so that classes made at run time can go.
_CLASSES: weakref.WeakKeyDictionary[type, bool | None] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
# The global hooks installed now, by kind ("pre", "post"), and how many active
# frames use each.
_HANDLES: dict[str, RemovableHandle] = {}
_USERS = {"pre": 0, "post": 0}


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
    kind = _CLASSES.get(cls, _UNSEEN)
    if kind is _UNSEEN:
        kind = None if getattr(cls, "forward", None) in _SELF_GUARDED else _stateful_class(cls)
        _CLASSES[cls] = kind
    return kind  # type: ignore[return-value]


def _guarded(module: nn.Module) -> bool:
    kind = _class_kind(type(module))
    return kind is not None and (kind or bool(module_buffers(module)))


def _same(a: Any, b: Tensor) -> bool:
    return (
        isinstance(a, Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    )


def _count(frame: Frame, module: nn.Module) -> int:
    """How many calls of ``module`` came before this one in the frame (and count this one)."""
    index = frame.calls.get(id(module), 0)
    frame.calls[id(module)] = index + 1
    return index


def enter(frame: Frame, module: nn.Module) -> int:
    """Before a guarded call: copy its state (forward) or swap in the recorded one.

    Returns the call's index (how many calls of the module came before it)."""
    index = _count(frame, module)
    stateful = _stateful(module)
    if frame.phase is not Phase.RECOMPUTE:
        saved = [(n, b.clone()) for n, b in module_buffers(module).items() if b is not None]
        state = _snapshot(module) if stateful else _NONE
        frame.tape.states[(id(module), index)] = ModuleState(module, saved, state)
        if frame.scope.strict:  # checked after the call (exit_)
            frame.guards.append(GuardEntry(module, index, saved, state))
        return index
    record: ModuleState | None = frame.tape.states.get((id(module), index))
    if record is None:
        raise ScopedCkptError(
            f"scopedckpt: the recompute of a checkpoint region called "
            f"{module_path(module, frame)} (a module with buffers or state) for the "
            f"{index + 1}. time, but its first forward called it fewer times, so there is no "
            "state to recompute it from. The region's control flow must not depend on data "
            "that changes between forward and backward."
        )
    swapped: list[Any] = []
    for name, before in record.buffers:
        swapped.append((name, module_buffers(module).get(name)))
        module_buffers(module)[name] = before.clone()  # a copy: a later recompute needs `before` again
    current = _NONE
    if record.state is not _NONE:
        current = _snapshot(module)
        _restore(module, record.state)
    frame.guards.append(GuardEntry(module, index, swapped, current))
    return index


def _initialize_lazy(frame: Frame, module: nn.Module, args: tuple[Any, ...]) -> None:
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
            f"scopedckpt: {module_path(module, frame)} has uninitialized (lazy) buffers "
            "at its first call, inside a checkpoint region, and the buffer guard cannot "
            "initialize it (no initialize_parameters method, or no positional input to "
            "initialize it from), so there is no state to recompute it from. Call the "
            "model once outside checkpointing first, as torch asks before building an "
            "optimizer over lazy modules."
        )
    initialize(*args)  # as torch's own hook calls it (global hooks get no keywords)


def exit_(frame: Frame, module: nn.Module) -> None:
    """After a guarded call: strict mode's check (forward) or put the reals back."""
    if frame.phase is not Phase.RECOMPUTE:
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
            f"scopedckpt: strict mode found {module_path(module, frame)} changing its "
            f"buffers ({', '.join(changed)}) inside a checkpoint region. The buffer guard "
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
    """Leave no swapped buffer behind when a frame ends early (error, early stop)."""
    while frame.guards:
        entry = frame.guards.pop()
        if frame.phase is Phase.RECOMPUTE:
            _put_back(entry)


def _outside_numbering(
    frame: Frame, step: Callable[[Frame, nn.Module], Any], module: nn.Module
) -> Any:
    """Run a guard step; under selective saving its copies are no op calls of the
    region's (``internal`` in _selective.py)."""
    if frame.tape.saved is None:
        return step(frame, module)
    with internal():
        return step(frame, module)


def _pre_hook(module: nn.Module, args: Any) -> None:
    if torch.compiler.is_dynamo_compiling() and not MIRROR.eager:
        # Compiled code with no eager frame in this thread has nothing to
        # guard: trace nothing (NOTE [ torch.compile ] in _compiled.py).
        return
    frame = FRAME.get()
    if frame is None or frame.hooks is not None:
        return
    # _guarded() and _count() written out: this runs at every module call of a
    # first forward, and two calls fewer is the cheaper path. Keep it so:
    # calling the two helpers instead made
    # test_compiled_code_inside_an_eager_region_takes_the_eager_path update an
    # unconverted batch norm twice when run after the other compile tests
    # (dynamo traces this hook inside eager regions; why is not understood).
    kind = _CLASSES.get(type(module), _UNSEEN)
    if kind is _UNSEEN:
        kind = _class_kind(type(module))
    if kind is not None and (kind or module_buffers(module)):
        if frame.phase is not Phase.RECOMPUTE:
            _initialize_lazy(frame, module, args)
        index = _outside_numbering(frame, enter, module)
    else:
        # Counted all the same: a buffer registered lazily during the first
        # forward must not shift the call indices the recompute looks up.
        calls = frame.calls
        index = calls.get(id(module), 0)
        calls[id(module)] = index + 1
    if frame.tape.saved is None:
        return
    # Selective saving numbers op calls per module call (NOTE [ selective saving ]).
    frame.modules.append((id(module), index))
    if frame.selective is not None:
        frame.selective.enter_module(module)


def _post_hook(module: nn.Module, args: Any, output: Any) -> None:
    if torch.compiler.is_dynamo_compiling() and not MIRROR.eager:
        return
    frame = FRAME.get()
    if frame is None or frame.hooks is not None:
        return
    if frame.tape.saved is not None and frame.modules:
        frame.modules.pop()
        if frame.selective is not None:
            frame.selective.exit_module()
    if frame.guards and frame.guards[-1].module is module:
        _outside_numbering(frame, exit_, module)


def begin(frame: Frame) -> None:
    """Start guarding the module calls of a frame that is being entered.

    A first forward, strict mode and selective saving use the global hooks
    (installed while at least one frame uses them, in any thread). A plain
    recompute hooks only the modules its tape has states of: global hooks
    installed per frame, not per region alive, also mean that compiled code
    running between regions (a compiled head) meets no hooks, and dynamo
    neither traces them nor recompiles when they come and go.
    """
    MIRROR.frames += 1
    MIRROR.eager = True
    every_call = _every_call(frame)
    if frame.phase is Phase.RECOMPUTE and not every_call:
        modules = {id(s.module): s.module for s in frame.tape.states.values()}
        frame.hooks = [h for m in modules.values() for h in _own_hooks(frame, m)]
        return
    _install("pre", nn.modules.module.register_module_forward_pre_hook, _pre_hook)
    if every_call:
        _install("post", _register_post_hook, _post_hook)

# The phases of the frames enter_frame acts in.
FRAME_PHASES = frozenset({Phase.FORWARD, Phase.RECOMPUTE})


def start_region(tape: Tape, call: RegionCall) -> bool:
    """The guard fills the tape's states as the first forward calls modules: it acts in
    every frame."""
    return True


def enter_frame(frame: Frame) -> Callable[..., None]:
    """Guard the frame's module calls; returns what stops guarding them."""
    begin(frame)
    return functools.partial(end, frame)


def end(frame: Frame, *exc: object) -> None:
    """Stop guarding a frame that is being left, leaving no swapped buffer behind."""
    try:
        unwind(frame)
    finally:
        MIRROR.frames -= 1
        MIRROR.eager = MIRROR.frames > 0
        if frame.hooks is not None:
            for handle in frame.hooks:
                handle.remove()
        else:
            _uninstall("pre")
            if _every_call(frame):
                _uninstall("post")


def _every_call(frame: Frame) -> bool:
    """Whether the frame must see every module call, and after it too: strict
    mode's check and selective saving's module numbering."""
    return frame.scope.strict or frame.tape.saved is not None


def _register_post_hook(hook: Callable[..., Any]) -> RemovableHandle:
    return nn.modules.module.register_module_forward_hook(hook, always_call=True)


def _install(
    kind: str, register: Callable[[Callable[..., Any]], RemovableHandle], hook: Callable[..., Any]
) -> None:
    with _LOCK:
        _USERS[kind] += 1
        if _USERS[kind] == 1:
            _HANDLES[kind] = register(hook)


def _uninstall(kind: str) -> None:
    with _LOCK:
        _USERS[kind] -= 1
        if _USERS[kind] == 0:
            _HANDLES.pop(kind).remove()


def _own_hooks(frame: Frame, module: nn.Module) -> list[RemovableHandle]:
    """Hooks on ``module`` alone that guard its calls in ``frame`` (a recompute)."""

    def pre(module: nn.Module, args: Any) -> None:
        if FRAME.get() is frame:  # other threads and frames may call it meanwhile
            enter(frame, module)

    def post(module: nn.Module, args: Any, output: Any) -> None:
        if FRAME.get() is frame and frame.guards and frame.guards[-1].module is module:
            exit_(frame, module)

    return [
        module.register_forward_pre_hook(pre),
        module.register_forward_hook(post, always_call=True),
    ]


def guarded_call(owner: nn.Module, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (the owner's forward, run without ``__call__``) guarded as a call of ``owner``."""
    if not _guarded(owner):
        return fn

    def call(*args: Any, **kwargs: Any) -> Any:
        frame = FRAME.get()
        assert frame is not None  # called by torch's checkpoint inside our frame
        # A lazy owner is initialized: its own hook ran in __call__, outside the region.
        _outside_numbering(frame, enter, owner)
        result = fn(*args, **kwargs)
        # On an exception, unwind() cleans up when the frame ends.
        _outside_numbering(frame, exit_, owner)
        return result

    return call
