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
  in no eager frame). It goes first among torch's global pre-hooks, which run
  before every module's own: a buffer a module's own pre-hook updates (legacy
  ``spectral_norm``'s power iteration), or a user's global one, is copied
  before it changes. A global hook sends every module call down
  ``nn.Module``'s slow path (its cost per call: docs/benchmarks.md), so a
  recompute hooks nothing (selective saving, which numbers its module calls,
  excepted).
* *What is guarded:* the registered buffers (``module._buffers``) of every
  module of the region's subtree (where it runs a module: its owner, the module
  it calls, or the layer of a bound method or ``partial``), called or not, and
  of every other module called through ``__call__`` inside the region, each with
  those of its guarded submodules: a forward may write a submodule's buffers
  without calling it, and without moving their versions (QAT's
  ``FusedMovingAvgObsFakeQuantize`` updates, and at its first call resizes, its
  observer child's ``min_val``/``max_val`` in its fused op), and a memory bank
  is pushed through a method (``self.bank.push(k)``); plus any state a module
  exposes through the :class:`Stateful` protocol. *Not guarded here:* plain
  Python attributes (NOTE [ forward's world ]), tensors that are not registered
  buffers, globals, buffers of modules outside the subtree that the region
  writes without calling them, buffers a module registers during its own call
  (the guard looks before the call): use :func:`scopedckpt.replay` or the
  protocol for those. Parameters changed in place are ``_written.py``'s (NOTE [
  written parameters ]). torch's lazy modules keep placeholders until their
  first call fills them; the guard fills them itself first
  (``initialize_lazy`` in ``_module_state.py``).
* First forward: when the region starts, the buffers of its subtree's guarded
  modules are copied and their :class:`Stateful` snapshots taken, on the tape;
  before its first guarded call in the region, so are those of a module not
  recorded yet (with its submodules', where it has children). All of them, not
  only those the forward changes: a buffer one call leaves bitwise unchanged (a
  running variance whose update rounds back to itself) may be updated by a
  later one. The cost is a copy of each such module's buffers per region, kept
  until backward (a region over a bound method of a whole model copies every
  buffer of the model); modules without buffers (most) cost nothing.
* Recompute: when it starts, every buffer of those modules is swapped for a
  copy of its recorded value, and each snapshot is put back
  (``swap_in_first``); the real ones go back when it ends, on early stop and
  errors too. Its calls update the copies as the first forward's updated the
  real ones, so before, between and after calls it reads what the first forward
  read: QAT's ``ConvBn2d`` reads ``bn.running_var`` before calling ``bn``, a
  fake quant reads its observer's statistics after calling it, and a module
  called twice reads its first call's update. A region nested in another runs
  its forward again inside the outer one's recompute: there it leaves alone the
  buffers the outer one swapped (``SWAPPED``), whose copies hold the values its
  first forward found and must take its writes. Swapping objects rather than
  copying values also keeps the real buffers' version counters, which the first
  forward's graph may have saved. A module with buffers that only the recompute
  calls updates its real buffers: the region's control flow changed between
  forward and backward, which the path check (NOTE [ light check ]) or
  verification names, and strict mode always.
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
calls itself again through ``torch.compiler.disable``. Traced, the hook would
graph-break at ``FRAME.get()`` and dynamo compile the bookkeeping after it as
frames of their own, specialised on this package's mutable dicts (the class
cache, a frame's call counts, the tape's states): right or wrong depending on
what earlier calls had left in them.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..core._own_ops import internal
from ..core._paths import BREAK, EAGER, frame_entered, frame_left, where
from ..core._state import FORWARD, FRAME, RECOMPUTE, Frame, RegionCall, Tape
from ..core._subtree import guarded
from ..core._torch_private import (
    GLOBAL_POST_HOOKS,
    GLOBAL_POST_HOOKS_ALWAYS_CALLED,
    GLOBAL_PRE_HOOKS,
)
from ._module_state import enter, exit_, initialize_lazy, record_subtree, swap_in_first
from ._report import stats_of
from ._selective import saves

__all__ = [
    "FRAME_PHASES",
    "end",
    "enter_frame",
    "installed",
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
    region's (``core/_own_ops.py``)."""
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
    if frame is None or frame.unhooked:
        return
    key = id(module)
    if frame.phase is not RECOMPUTE:
        modes = frame.tape.modes  # the recompute runs in these modes (enter_frame)
        if key not in modes:
            modes[key] = (module, module.training)
        if guarded(module):
            initialize_lazy(frame, module, args)
            _outside_numbering(frame, enter, module)
    if not saves(frame.tape):
        return
    # Selective saving numbers op calls per module call (NOTE [ selective saving ]).
    calls = frame.calls
    index = calls.get(key, 0)
    calls[key] = index + 1
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
    if frame is None or frame.unhooked:
        return
    if saves(frame.tape) and frame.modules:
        frame.modules.pop()
        if frame.selective is not None:
            frame.selective.exit_module()
    if frame.guards and frame.guards[-1][0] is module:  # strict mode's check
        _outside_numbering(frame, exit_, module)


# Run eagerly, where() is EAGER inside them.
_pre_outside_dynamo = torch.compiler.disable(_pre_hook)
_post_outside_dynamo = torch.compiler.disable(_post_hook)


FRAME_PHASES = frozenset({FORWARD, RECOMPUTE})


def start_region(tape: Tape, call: RegionCall) -> bool:
    """Record the state of the guarded modules of the region's subtree; the guard fills
    the tape's states and modes further as the first forward calls modules: it acts in
    every frame."""
    owner = call.owner
    if isinstance(owner, nn.Module):  # its forward runs without __call__ in the region
        tape.modes[id(owner)] = (owner, owner.training)
    if call.listing is not None and call.listing.guarded:
        record_subtree(tape.states, call.listing)
    return True


def enter_frame(frame: Frame) -> Callable[..., None]:
    """Start guarding the module calls of a frame that is being entered; returns what
    stops guarding them.

    A first forward uses the global hooks (installed while at least one frame uses
    them, in any thread), and strict mode and selective saving a global forward hook
    too. A recompute swaps in the copies its calls run on when it starts, and hooks
    nothing but for selective saving's numbering: global hooks installed per frame,
    not per region alive, also mean that compiled code running between regions (a
    compiled head) meets no hooks, and dynamo neither traces them nor recompiles when
    they come and go.
    """
    frame_entered()
    if frame.phase is not RECOMPUTE:
        stats = stats_of(frame.tape)
        if stats is not None:  # the memory report's row counts the subtree's copies as kept
            states = frame.tape.states.values()
            stats.kept_bytes += sum(b.nbytes for state in states for _, b in state.buffers)
        # Strict mode's check and selective saving's module numbering see every call,
        # and after it too.
        every_call = frame.scope.strict or saves(frame.tape)
        _install(every_call)
        owner = frame.owner
        if isinstance(owner, nn.Module) and guarded(owner):
            # Its forward runs in the region without __call__: the frame is its call.
            _outside_numbering(frame, enter, owner)
        return functools.partial(end, frame, every_call, None, None)
    every_call = saves(frame.tape)
    if every_call:
        _install(every_call)
    else:
        frame.unhooked = True  # other frames' global hooks leave its calls alone
    # Last: nothing after it raises; end() puts the real buffers back.
    put_back = swap_in_first(frame) if frame.tape.states else None
    return functools.partial(end, frame, every_call, put_back, _first_forward_modes(frame))


def _first_forward_modes(frame: Frame) -> list[tuple[nn.Module, bool]] | None:
    """Put the modules the first forward called back in the modes it called them in
    (``model.eval()`` between forward and backward); returns those switched."""
    switched = [(m, t) for m, t in frame.tape.modes.values() if m.training is not t]
    for module, training in switched:
        module.training = training
    return switched or None


def end(
    frame: Frame,
    every_call: bool,
    put_back: Callable[[], None] | None,
    switched: list[tuple[nn.Module, bool]] | None,
    exc_type: object,
    *exc: object,
) -> None:
    """Stop guarding a frame that is being left, leaving no swapped buffer or mode behind."""
    try:
        owner = frame.owner  # its call (the frame) ended: strict mode's check
        if exc_type is None and isinstance(owner, nn.Module) and frame.guards:
            if frame.guards[-1][0] is owner:  # only strict first forwards stack checks
                _outside_numbering(frame, exit_, owner)
        if put_back is not None:
            put_back()
    finally:
        if switched is not None:
            for module, training in switched:
                module.training = not training
        frame_left()
        if not frame.unhooked:
            _uninstall(every_call)


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
