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
* Hook order: the global pre-hook goes first among torch's global pre-hooks,
  which run before every module's own; a recompute's own pre-hooks go before
  the module's own (``prepend``), its forward hooks after them. So a buffer a
  module's own pre-hook updates (legacy ``spectral_norm``'s power iteration)
  is copied before and swapped before that hook runs, and one its own forward
  hook updates is updated on the swapped copy. While any other global
  pre-hook is installed (a user's may update buffers too), a recompute uses
  the global hook instead of its own pre-hooks. Global forward hooks run
  before a module's own, so a recompute guarded by global hooks (strict mode,
  selective saving, a foreign pre-hook) still ends each call (a
  :class:`Stateful` module's state goes back) from forward hooks of its own,
  after the module's.
* *What is guarded:* the registered buffers (``module._buffers``) of every
  module called through ``__call__`` inside a region, and of the region's
  owner module itself, each with those of its guarded submodules: a forward
  may write a submodule's buffers without calling it, and without moving
  their versions (QAT's ``FusedMovingAvgObsFakeQuantize`` updates, and at its
  first call resizes, its observer child's ``min_val``/``max_val`` in its
  fused op); plus any state a module exposes through the :class:`Stateful`
  protocol. *Not guarded here:* plain Python attributes (NOTE [ forward's world ]), tensors that are not
  registered buffers, globals, buffers a module registers during its own
  call (the guard looks before the call): use :func:`scopedckpt.replay` or
  the protocol for those. Buffers of the region's module subtree written
  outside their module's own call (through a method, by another module),
  and parameters changed in place, are replayed from copies taken at the
  region's start (NOTE [ unguarded writes ] in ``_written.py``).
  torch's lazy modules keep placeholders until their first call fills them;
  the guard fills them itself first (``initialize_lazy`` in ``_module_state.py``).
* First forward: before each guarded call the module's buffers are copied
  and the copies go on the tape at once, keyed by (module, how many calls of
  it came before in this frame). All of them, not only those the call changed: a
  buffer the call left bitwise unchanged (a running variance whose update
  rounds back to itself) may have been moved on by later calls when the
  recompute comes, and would then be updated for real (found by the property
  test). The cost is a copy of each called module's buffers per call (and of
  its submodules', where it has children), kept until backward; modules
  without buffers (most) cost nothing.
* Recompute: when it starts, every buffer its calls will swap is swapped for
  a copy of its value before the first of them in the first forward
  (``swap_in_first``); the real ones wait under the calls on the guard's
  stack and go back when it ends. Before each call (the module's own hooks
  find it) its buffers are swapped again, for fresh copies of their values
  *before* the first forward's call, so the call computes from the same state
  (a counter read after its update reads the same number), and the copies
  its updates land on stay after it. So the recompute reads, before, between
  and after calls, what the first forward read: QAT's ``ConvBn2d`` reads
  ``bn.running_var`` before calling ``bn``, a fake quant reads its observer's
  statistics after calling it. Buffers the unguarded writes swapped keep their
  copies, of the values at the region's start. Swapping objects rather than
  copying values also keeps the real buffers' version counters, which the
  first forward's graph may have saved; the extra cost is one copy of each
  guarded buffer per recompute.
  A module with buffers that only the recompute calls is not hooked there:
  the region's control flow changed between forward and backward, which
  torch's determinism check reports when the calls save tensors, and strict
  mode always.
* Scoped batch norm guards itself (throwaway running buffers, no copies), so
  the guard skips it: the fast path stays fast. Its statistics read outside
  its call (``convert`` run on a QAT-fused ``ConvBn2d``) are the real ones:
  sampled verification reports the difference.
* ``checkpointing(strict=True)`` turns a changed buffer into a
  :class:`ScopedCkptError` naming the module path: a lint that every stateful
  layer in regions is a scoped one.

NOTE [ the guard under dynamo ]
===============================
Compiled code run by an eager region (a compiled block inside
``scopedckpt.checkpoint``, or any recompute of one) calls the guard's
global hooks while dynamo traces. Its work is never traced: in compiled code
a hook either returns (no eager frame in this thread: nothing to guard) or
calls itself again through ``torch.compiler.disable``, as do a
recompute's own hooks. Traced, the hook graph-broke at ``FRAME.get()`` and
dynamo compiled the bookkeeping after it (``guarded``, ``count_call``,
``enter``) as frames of their own, specialised on this package's mutable
dicts (the class cache, a frame's call counts, the tape's states). Which of
them a compiled frame got right depended on what earlier calls had left in
those dicts: ``test_compiled_code_inside_an_eager_region_takes_the_eager_path``
updated an unconverted batch norm twice when run after the graph-break test,
and not alone. ``test_the_guards_work_is_never_traced`` checks the guard runs
untraced (mutant ``guard_hook_traced_by_dynamo``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..core._paths import BREAK, EAGER, frame_entered, frame_left, where
from ..core._state import FORWARD, FRAME, RECOMPUTE, Frame, RegionCall, Tape
from ..core._torch_private import (
    GLOBAL_POST_HOOKS,
    GLOBAL_POST_HOOKS_ALWAYS_CALLED,
    GLOBAL_PRE_HOOKS,
)
from ._module_state import (
    enter,
    exit_,
    guarded,
    initialize_lazy,
    swap_in_first,
    unwind,
)
from ._selective import internal, saves

__all__ = [
    "FRAME_PHASES",
    "end",
    "enter_frame",
    "guarded_call",
    "installed",
    "modules_called",
    "start_region",
]


_LOCK = threading.Lock()
# How many active frames use each kind of the guard's global hooks.
_PRE_USERS = 0
_POST_USERS = 0


def _outside_numbering(
    frame: Frame, step: Callable[[Frame, nn.Module], Any], module: nn.Module
) -> Any:
    """Run a guard step; under selective saving its copies are no op calls of the
    region's (``internal`` in _selective.py)."""
    if not saves(frame.tape):
        return step(frame, module)
    with internal():
        return step(frame, module)


def _pre_hook(module: nn.Module, args: Any) -> None:
    here = where()
    if here is not EAGER:
        # NOTE [ the guard under dynamo ]: traced, the guard's work runs outside
        # the graph; in a graph with no eager frame in this thread there is none.
        if here is BREAK:
            _pre_outside_dynamo(module, args)
        return
    frame = FRAME.get()
    if frame is None or frame.hooks is not None:
        return
    key = id(module)
    if frame.phase is not RECOMPUTE:
        modes = frame.tape.modes  # the recompute runs in these modes (enter_frame)
        if key not in modes:
            modes[key] = (module, module.training)
    if guarded(module):
        if frame.phase is not RECOMPUTE:
            initialize_lazy(frame, module, args)
        index = _outside_numbering(frame, enter, module)
    else:
        # Counted all the same: a buffer registered lazily during the first
        # forward must not shift the call indices the recompute looks up.
        calls = frame.calls  # count_call, written out: this runs at every module call
        index = calls.get(key, 0)
        calls[key] = index + 1
    if not saves(frame.tape):
        return
    # Selective saving numbers op calls per module call (NOTE [ selective saving ]).
    frame.modules.append((key, index))
    if frame.selective is not None:
        frame.selective.enter_module(module)


def _post_hook(module: nn.Module, args: Any, output: Any) -> None:
    here = where()
    if here is not EAGER:
        if here is BREAK:
            _post_outside_dynamo(module, args, output)
        return
    frame = FRAME.get()
    if frame is None or frame.hooks is not None:
        return
    if saves(frame.tape) and frame.modules:
        frame.modules.pop()
        if frame.selective is not None:
            frame.selective.exit_module()
    if frame.exits is None and frame.guards and frame.guards[-1].module is module:
        _outside_numbering(frame, exit_, module)


# Run eagerly, where() is EAGER inside them.
_pre_outside_dynamo = torch.compiler.disable(_pre_hook)
_post_outside_dynamo = torch.compiler.disable(_post_hook)


# The phases of the frames enter_frame acts in.
FRAME_PHASES = frozenset({FORWARD, RECOMPUTE})


def start_region(tape: Tape, call: RegionCall) -> bool:
    """The guard fills the tape's states and modes as the first forward calls modules: it
    acts in every frame."""
    owner = call.owner
    if isinstance(owner, nn.Module):  # its forward runs without __call__ in the region
        tape.modes[id(owner)] = (owner, owner.training)
    return True


def modules_called(tape: Tape) -> set[int]:
    """The ids of the modules the region's first forward called (not its nested regions')."""
    return set(tape.modes)


def enter_frame(frame: Frame) -> Callable[..., None]:
    """Start guarding the module calls of a frame that is being entered; returns what
    stops guarding them.

    A first forward, strict mode and selective saving use the global hooks
    (installed while at least one frame uses them, in any thread). A plain
    recompute hooks only the modules its tape has states of: global hooks
    installed per frame, not per region alive, also mean that compiled code
    running between regions (a compiled head) meets no hooks, and dynamo
    neither traces them nor recompiles when they come and go.
    """
    frame_entered()
    # Strict mode's check and selective saving's module numbering see every call,
    # and after it too.
    every_call = frame.scope.strict or saves(frame.tape)
    if frame.phase is not RECOMPUTE:
        _install(every_call)
        return functools.partial(end, frame, every_call, None)
    states = frame.tape.states
    modules = {id(s.module): s.module for s in states.values()} if states else None
    # Another global pre-hook (a user's) runs before every module's own hooks, and may
    # update buffers: the guard's global one, in front of it, must swap them first.
    foreign = len(GLOBAL_PRE_HOOKS) > (_KEY in GLOBAL_PRE_HOOKS)
    if not every_call and not foreign:
        frame.hooks = []
        if modules:
            frame.hooks = [h for m in modules.values() for h in _own_hooks(frame, m)]
    else:
        _install(every_call)
        # Global post hooks run before a module's own: calls end after those (which
        # update the swapped copies), from hooks of its own.
        frame.exits = [_own_exit(frame, m) for m in modules.values()] if modules else []
    if states:  # last: nothing after it raises; end() puts the real buffers back
        swap_in_first(frame)
    return functools.partial(end, frame, every_call, _first_forward_modes(frame))


def _first_forward_modes(frame: Frame) -> list[tuple[nn.Module, bool]] | None:
    """Put the modules the first forward called back in the modes it called them in
    (``model.eval()`` between forward and backward); returns those switched."""
    modes = frame.tape.modes
    if not modes:  # no module called in the first forward
        return None
    switched = [(m, t) for m, t in modes.values() if m.training is not t]
    for module, training in switched:
        module.training = training
    return switched or None


def end(
    frame: Frame, every_call: bool, switched: list[tuple[nn.Module, bool]] | None, *exc: object
) -> None:
    """Stop guarding a frame that is being left, leaving no swapped buffer or mode behind."""
    try:
        if frame.guards:
            unwind(frame)
    finally:
        if switched is not None:
            for module, training in switched:
                module.training = not training
        frame_left()
        if frame.hooks is not None:
            for handle in frame.hooks:
                handle.remove()
        else:
            _uninstall(every_call)
            for handle in frame.exits or ():
                handle.remove()
            frame.exits = None


# The key of the guard's global hooks in torch's dicts of them (torch's are handle ids,
# non-negative ints).
_KEY = "scopedckpt buffer guard"


# _install and _uninstall run at every first forward's entry and exit: they acquire and
# release the lock by hand, not in a ``with`` statement.
def _install(post: bool) -> None:
    global _PRE_USERS, _POST_USERS
    _LOCK.acquire()
    try:
        _PRE_USERS += 1
        if _PRE_USERS == 1:
            GLOBAL_PRE_HOOKS[_KEY] = _pre_hook
            if len(GLOBAL_PRE_HOOKS) > 1:
                # First: global pre-hooks run before the modules' own, and other global
                # ones may update buffers too.
                GLOBAL_PRE_HOOKS.move_to_end(_KEY, last=False)
        if post:
            _POST_USERS += 1
            if _POST_USERS == 1:
                GLOBAL_POST_HOOKS[_KEY] = _post_hook
                GLOBAL_POST_HOOKS_ALWAYS_CALLED[_KEY] = True
    finally:
        _LOCK.release()


def _uninstall(post: bool) -> None:
    global _PRE_USERS, _POST_USERS
    _LOCK.acquire()
    try:
        _PRE_USERS -= 1
        if not _PRE_USERS:
            del GLOBAL_PRE_HOOKS[_KEY]
        if post:
            _POST_USERS -= 1
            if not _POST_USERS:
                del GLOBAL_POST_HOOKS[_KEY]
                del GLOBAL_POST_HOOKS_ALWAYS_CALLED[_KEY]
    finally:
        _LOCK.release()


def installed() -> list[str]:
    """The kinds of global hooks the guard has installed now ("pre", "post")."""
    return [
        kind
        for kind, hooks in (("pre", GLOBAL_PRE_HOOKS), ("post", GLOBAL_POST_HOOKS))
        if _KEY in hooks
    ]


def _own_hooks(frame: Frame, module: nn.Module) -> list[RemovableHandle]:
    """Hooks on ``module`` alone that guard its calls in ``frame`` (a recompute)."""

    @torch.compiler.disable  # NOTE [ the guard under dynamo ]
    def pre(module: nn.Module, args: Any) -> None:
        if FRAME.get() is frame:  # other threads and frames may call it meanwhile
            enter(frame, module)

    # Before the module's own pre-hooks (spectral norm's power iteration updates its
    # buffers in one), after its own forward hooks: they update the swapped copies.
    return [module.register_forward_pre_hook(pre, prepend=True), _own_exit(frame, module)]


def _own_exit(frame: Frame, module: nn.Module) -> RemovableHandle:
    """A forward hook on ``module`` alone, after its own, that puts its real buffers back."""

    @torch.compiler.disable  # NOTE [ the guard under dynamo ]
    def post(module: nn.Module, args: Any, output: Any) -> None:
        if FRAME.get() is frame and frame.guards and frame.guards[-1].module is module:
            _outside_numbering(frame, exit_, module)

    return module.register_forward_hook(post, always_call=True)


def guarded_call(owner: nn.Module, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (the owner's forward, run without ``__call__``) guarded as a call of ``owner``."""
    if not guarded(owner):
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
