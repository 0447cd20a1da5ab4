"""The region mechanisms: their protocol, the one list of them, and which of them each
region's frames enter.

NOTE [ region mechanisms ]
==========================
Everything a region does besides running its function is a *mechanism*: one
private module implementing :class:`Mechanism`, registered once, in order,
by ``mechanisms/__init__.py`` into :data:`MECHANISMS`. The engine (``_engine.py``) knows none of them by name:

* ``start_region(tape, call)`` runs once, when the region starts, puts the
  mechanism's state on the tape (a field of :class:`Tape` the mechanism owns:
  no other module reads it; what others need, the owner's functions answer,
  such as ``_rng.replays(tape)``) and says whether the mechanism acts in the
  region's frames;
* ``enter_frame(frame)`` runs at every entry of such a region (its first
  forward, and each recompute, on any thread) and returns what undoes it, an
  ``__exit__``-like callable, or None when it has nothing to do there. It is
  called only in the phases the module's ``FRAME_PHASES`` names: the tape
  lists these functions per phase, so a frame calls only the mechanisms that
  act in it.

:class:`_engine._EnterFrame` enters them in the order listed and undoes them in
reverse, each undo run even when another raised, and undoes what it entered
when an entry raises: no token, hook or mode outlives a frame.

================  ==========================  ====================================
mechanism         tape                        frame
================  ==========================  ====================================
``_strict``       nothing                     first forward under the detector
``_inputs``       tensor inputs' versions     first forward: none written in place
``_world``        bindings, attributes,       recomputes run in the forward's world
                  Python/NumPy RNG states     (NOTE [ forward's world ])
``_rng``          generators' states          recomputes start from them
``_generators``   explicit ones' states       recomputes start from them;
                                              watched first forwards find them
``_written``      changed parameters' copies  recomputes: copies swapped in
``_hooks``        user hooks that changed     first forward: recorded; recomputes
                  tensors                     run only those (NOTE [ hooks in
                                              recomputes ])
``_guard``        module states: the subtree  recomputes: copies swapped in
                  at the start, others at
                  their first call
``_selective``    kept op outputs             recorded, or served
``_report``       a memory_report row         saved tensors counted, time taken
``_verify``       fingerprints (bitwise)      first forward: fingerprints taken
================  ==========================  ====================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ._state import FORWARD, RECOMPUTE, Frame, Phase, RegionCall, Tape

__all__ = ["MECHANISMS", "Mechanism", "Undo", "frame_plan", "register_mechanism", "starts"]

Undo = Callable[..., Any]  # called as __exit__ is: (exc_type, exc, traceback)


class Mechanism(Protocol):
    """What each region mechanism module provides (NOTE [ region mechanisms ])."""

    FRAME_PHASES: frozenset[Phase]  # the phases of the frames enter_frame acts in

    def start_region(self, tape: Tape, call: RegionCall) -> bool:
        """A region starts: put this mechanism's state on its tape; whether it acts in
        the region's frames."""

    def enter_frame(self, frame: Frame) -> Undo | None:
        """A frame of the region is entered: start, and return what undoes it, if anything."""


# Started and entered in this order, undone in reverse: registered by the mechanisms
# package (``mechanisms/__init__.py``, which says the order and why), then by
# integrations. The core imports no mechanism.
MECHANISMS: tuple[Mechanism, ...] = ()


def register_mechanism(mechanism: Mechanism, *, first: bool = False) -> None:
    """Add a mechanism, once, after the others or ``first`` (an integration's check that
    may raise, so that it leaves no state behind)."""
    global MECHANISMS
    if mechanism not in MECHANISMS:
        MECHANISMS = (mechanism, *MECHANISMS) if first else (*MECHANISMS, mechanism)


_STARTS: list[tuple[Callable[[Tape, RegionCall], bool], int]] = []
_STARTS_OF: tuple[Mechanism, ...] = ()


def starts() -> list[tuple[Callable[[Tape, RegionCall], bool], int]]:
    """Each mechanism's start_region, in MECHANISMS order, with its bit in
    :func:`frame_plan`'s ``acting``."""
    global _STARTS, _STARTS_OF
    if _STARTS_OF is not MECHANISMS:
        _STARTS = [(m.start_region, 1 << i) for i, m in enumerate(MECHANISMS)]
        _STARTS_OF = MECHANISMS
    return _STARTS


FramePlan = tuple[tuple[Callable[[Frame], Undo | None], ...], ...]
# By the set of mechanisms acting in a region (a bit each, in the order of _PLANS_OF,
# the MECHANISMS they were made for): the enter_frame functions its forward and
# recompute frames call.
_PLANS: dict[int, FramePlan] = {}
_PLANS_OF: tuple[Mechanism, ...] = ()


def frame_plan(acting: int) -> FramePlan:
    """The enter_frame functions of the mechanisms ``acting`` names (a bit each, in
    MECHANISMS order), for a forward frame and for a recompute frame."""
    global _PLANS_OF
    if _PLANS_OF is not MECHANISMS:
        _PLANS.clear()
        _PLANS_OF = MECHANISMS
    plan = _PLANS.get(acting)
    if plan is None:
        used = [m for i, m in enumerate(MECHANISMS) if acting >> i & 1]
        plan = _PLANS[acting] = tuple(
            tuple(m.enter_frame for m in used if phase in m.FRAME_PHASES)
            for phase in (FORWARD, RECOMPUTE)
        )
    return plan
