"""The forward's world: the tensors a region's modules hold, the attributes, the Python
and NumPy random states and the ``parametrize.cached()`` cache its forward reads, recorded
when the region starts and put in place for every recompute: a region mechanism.

NOTE [ forward's world ]
========================
A recompute runs in backward, after code outside the region may have changed
what the first forward read, and it must compute what that forward computed.
When a region over a module starts, it records its *world*:

* **bindings**, every call: which tensor each module of the subtree holds in
  its ``_parameters`` and ``_buffers`` (a copy of each non-empty dict: a few
  dict copies per region). ``torch.func.functional_call(model, fast_weights,
  x)`` registers other tensors for the call only and puts the module's own
  back before backward; a weight swap and a forward that registers a buffer
  anew (an observer that sizes its buffers at its first call) change them too.
* **attributes**: the plain attributes (``self.calls``, a cached mask,
  ``self.cache = h``) that change between a first forward's start and its
  recompute, by the forward or by anyone;
* **Python's ``random`` and NumPy's global RNG**, where the forward draws from
  them (LayerDrop written with ``random.random()``); torch's generators are the
  RNG replay's and NOTE [ explicit generators ]'s.
* **``torch.nn.utils.parametrize.cached()``'s cache**, every call where a block is
  open (off: nothing): how many blocks are open and a shallow copy of the cache. A
  parametrized weight (``weight_norm``, ``orthogonal``, a user's) cached before
  the region is read from it by the recompute; one the first forward computed and
  cached is computed again, as then, into a copy of its own (not read from the cache
  the first forward filled, which saves fewer tensors); backward after the block
  ended finds the cache as the region started. A recompute under a block that was
  not open at the region's start runs with caching off, where the region acts at
  all (over modules holding tensors, as any over a parametrized one).

Attributes and random states are costly to record at every call (a
``random.getstate()`` costs more than a region's whole machinery), so a site
(``_sampling.Site``) learns what its forward needs on its calls until one of
them is recomputed (the first step's, nested ones included) and on its
*verified* calls (NOTE [ sampled verification ]): such a call records every
attribute of the subtree's modules and both random states; the end of its
forward and the start of its recompute note which attributes changed since the
region started (by identity: a counter's new int, a mask made, a tensor
assigned; by the forward itself, so a call never recomputed teaches its site
too, or by anyone before backward), the former whether the forward drew from
either RNG; every later call of the site records those, and every recompute
puts its call's record in place. A site that starts to need more on an
unverified call (a branch taken after warm-up) is not replayed there: where
what it changes reaches a saved tensor, the light check (NOTE [ light check ])
or the path check names the region on that call; a draw whose value reaches no
saved tensor leaves the gradients exact, and Python's stream one draw ahead
after backward, until a sampled verified call learns it.

Every backward recompute puts the recorded world in place where the present
differs, runs, and puts the present back: what the recompute registers,
assigns, draws or caches does not outlive it. A region replayed inside its parent's
recompute leaves the world alone: the parent put it in place and recomputed
it up to there, other mechanisms' copies included (NOTE [ buffer guard ]),
and the parent's later code reads what the replay writes, as in the first
forward.

Not recorded: containers changed in place (a list a hook appends to), objects
outside the subtree (globals, another model's modules), plain function
regions' attributes (they have no subtree), tensors' values (NOTE [ written
parameters ] and NOTE [ buffer guard ] keep those).
"""

from __future__ import annotations

import functools
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..core._state import FORWARD, RECOMPUTE, Frame, RegionCall, Tape
from ..core._torch_private import parametrize_cache
from ._module_state import MISSING as _MISSING
from ._module_state import Swapped, put_back, swap

__all__ = ["FRAME_PHASES", "Learned", "World", "enter_frame", "numpy_random", "start_region"]

FRAME_PHASES = frozenset({FORWARD, RECOMPUTE})


@dataclass(slots=True, eq=False)
class Learned:
    """What a site's verified calls showed its forward needs (on ``_sampling.Site``)."""

    # (the module's __dict__, attribute name) of each attribute seen to change
    attributes: tuple[tuple[dict[str, Any], str], ...] = ()
    python: bool = False  # the forward drew from Python's random
    numpy: bool = False  # ... from NumPy's global RNG
    recomputed: bool = False  # a learning call's recompute has compared attributes


@dataclass(slots=True, eq=False)
class World:
    """A region's recorded world (``tape.world``); private to this mechanism."""

    site: Any
    learning: bool
    # (registration dict, its copy at the region's start)
    bindings: tuple[tuple[dict[str, Any], dict[str, Any]], ...] = ()
    # (a module's __dict__, attribute name, value at the start or _MISSING)
    attributes: list[tuple[dict[str, Any], str, Any]] = field(default_factory=list)
    # a learning call's: every module's __dict__
    dicts: list[dict[str, Any]] = field(default_factory=list)
    python: Any = None  # random.getstate() at the start, where recorded
    numpy: Any = None  # numpy.random.get_state() at the start, where recorded
    # parametrize.cached()'s (blocks open, copy of its cache) at the start, where open
    parametrize: tuple[int, dict[Any, Any]] | None = None


def numpy_random() -> Any:
    """NumPy's ``random`` module where NumPy is imported (a region never imports it)."""
    numpy = sys.modules.get("numpy")
    return None if numpy is None else numpy.random


def start_region(tape: Tape, call: RegionCall) -> bool:
    """Record the region's world; acts in its frames where it recorded anything."""
    listing = call.listing
    site = call.site
    learned: Learned | None = None if site is None else site.world
    # A site learns until a call's recompute has (its first step's calls, nested ones
    # included, with sampling off too), and again at every verified call.
    learning = call.determinism_check == "bitwise" or (
        site is not None and (learned is None or not learned.recomputed)
    )
    world = World(site, learning)
    if listing is not None:
        world.bindings = tuple(zip(listing.registrations, map(dict.copy, listing.registrations)))
    if learning:
        if listing is not None:
            world.dicts = [vars(m) for ref in listing.modules if (m := ref()) is not None]
            world.attributes = [
                (d, name, value)
                for d in world.dicts
                for name, value in d.items()
                if name not in _MODULE_INTERNALS
            ]
        world.python = random.getstate()
        numpy = numpy_random()
        if numpy is not None:
            world.numpy = numpy.get_state()
    elif learned is not None:
        world.attributes = [(d, name, d.get(name, _MISSING)) for d, name in learned.attributes]
        if learned.python:
            world.python = random.getstate()
        if learned.numpy:
            numpy = numpy_random()
            world.numpy = None if numpy is None else numpy.get_state()
    enabled, cache = parametrize_cache()
    if enabled:  # off: nothing recorded
        world.parametrize = (enabled, dict(cache))
    if not (
        world.bindings
        or world.attributes
        or learning
        or world.python
        or world.numpy
        or world.parametrize
    ):
        return False
    tape.world = world
    return True


# What every nn.Module keeps in its __dict__: not attributes of the user's.
_MODULE_INTERNALS = frozenset(vars(nn.Module()))


def enter_frame(frame: Frame) -> Callable[..., None] | None:
    """A learning first forward: note at its end whether it drew random numbers. A
    recompute: put the recorded world in place, and the present back at its end."""
    world = frame.tape.world
    assert world is not None  # start_region said so
    if frame.phase is not RECOMPUTE:
        return functools.partial(_forward_ended, world) if world.learning else None
    if not frame.rewind:
        # Replayed inside its parent's recompute, which put the world in place at its
        # start and has recomputed it since, up to here: what differs now is other
        # mechanisms' copies (NOTE [ buffer guard ]), which the replay must use.
        return None
    if world.learning:
        _learn(world)
    undo: Swapped = []
    for registered, before in world.bindings:
        for name, tensor in before.items():
            if registered.get(name, _MISSING) is not tensor:
                swap(registered, name, tensor, undo)
    for d, name, value in world.attributes:  # value _MISSING: an attribute gained since
        if d.get(name, _MISSING) is not value:
            swap(d, name, value, undo)
    python = numpy_state = None
    if world.python is not None:
        python = random.getstate()
        random.setstate(world.python)
    numpy = numpy_random() if world.numpy is not None else None
    if numpy is not None:
        numpy_state = numpy.get_state()
        numpy.set_state(world.numpy)
    parametrize: tuple[int, dict[Any, Any]] | None = None
    if world.parametrize is not None:
        # A copy per recompute: what it caches (the tensors it computes anew, as the first
        # forward did) does not outlive it, nor reach a second recompute.
        enabled, cache = world.parametrize
        parametrize = parametrize_cache((enabled, dict(cache)))
    elif parametrize_cache()[0]:  # off at the start, open now: backward inside cached()
        parametrize = parametrize_cache((0, {}))
    if not (undo or python or numpy_state or parametrize):
        return None
    return functools.partial(_put_back, undo, python, numpy, numpy_state, parametrize)


def _forward_ended(world: World, *exc: object) -> None:
    """A learning call's first forward ended: the attributes it changed, and whether it
    drew from either RNG (its site learns them whether or not the call is recomputed)."""
    learned = _learned(world)
    if learned is None:
        return
    _learn_attributes(world, learned)
    if world.python is not None and random.getstate() != world.python:
        learned.python = True
    numpy = numpy_random()
    if numpy is not None and world.numpy is not None:
        now = numpy.get_state()
        if any(_differs(a, b) for a, b in zip(now, world.numpy)):
            learned.numpy = True


def _differs(a: Any, b: Any) -> bool:
    result = a != b
    return bool(result.any()) if hasattr(result, "any") else bool(result)


def _learn(world: World) -> None:
    """A learning call's recompute starts: the attributes changed since its first
    forward ended, by anyone, are recorded by every later region of its site too."""
    learned = _learned(world)
    if learned is None:
        return
    _learn_attributes(world, learned)
    learned.recomputed = True


def _learn_attributes(world: World, learned: Learned) -> None:
    """Add to ``learned`` the attributes of the subtree's modules that changed since the
    region started; one a module gained since (one that had no attribute of its own at
    the start too) is recorded by this call as _MISSING, for its recompute to remove."""
    known = {(id(d), name) for d, name in learned.attributes}
    found = list(learned.attributes)
    for d, name, value in world.attributes:
        if d.get(name, _MISSING) is not value and (id(d), name) not in known:
            found.append((d, name))
            known.add((id(d), name))
    recorded = {(id(d), name) for d, name, _ in world.attributes}
    for d in world.dicts:
        for name in list(d):
            key = (id(d), name)
            if key not in recorded and name not in _MODULE_INTERNALS:
                world.attributes.append((d, name, _MISSING))
                if key not in known:
                    found.append((d, name))
                    known.add(key)
    learned.attributes = tuple(found)


def _learned(world: World) -> Learned | None:
    site = world.site
    if site is not None and site.world is None:
        site.world = Learned()
    return None if site is None else site.world


def _put_back(
    undo: Swapped,
    python: Any,
    numpy: Any,
    numpy_state: Any,
    parametrize: tuple[int, dict[Any, Any]] | None,
    *exc: object,
) -> None:
    put_back(undo)
    if python is not None:
        random.setstate(python)
    if numpy_state is not None:
        numpy.set_state(numpy_state)
    if parametrize is not None:
        parametrize_cache(parametrize)
