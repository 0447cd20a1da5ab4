"""Explicit generators (``generator=g``) used in regions: found where the region can reach
them and by watched first forwards, stashed at every region, replayed by recomputes; a
region mechanism.

NOTE [ explicit generators ]
============================
The RNG replay (NOTE [ RNG replay ] in ``_rng.py``) stashes torch's *default*
generators. A random op given its own ``torch.Generator`` (``torch.randn(...,
generator=g)``, ``x.uniform_(generator=g)``) draws from a stream no stash knows
of: the recompute draws again, from where the first forward left ``g``, so it
computes from other random numbers, and after backward ``g`` has advanced twice
(issue 25, hole 6). Nothing global lists a process's generators, and watching
every op of every region for a ``generator=`` argument would cost every region a
Python call per torch call (a ``TorchFunctionMode``). So a region stashes, when it
starts (before any use, as the default generators are stashed):

* the generators it can reach without running (:func:`reachable`): its
  arguments (and the lists, tuples and dicts among them); its function's
  partial arguments and closure cells; the generators its function's code
  reads; and, for the module it runs and every module among those, the places
  the subtree's listing holds (``_subtree.py``): what its modules' attributes,
  their classes and their code reach, searched once per listing (NOTE
  [ generator places ] in ``_reach.py``) and followed again at every region,
  so a reassigned attribute or element is the new generator;
* the generators watched first forwards of its site were seen to use: a
  *watched* first forward (a verified one, ``determinism_check="bitwise"``:
  by default the first call of each region site and one in 64 after it, NOTE
  [ sampled verification ]; every one running code that names generators,
  NOTE [ watched code ]; and every later one of a site where the watch found
  one) runs under a ``TorchFunctionMode`` that looks at each torch call's
  arguments for a non-default generator, stashes it at its first use and
  remembers it for the site (weakly; NOTE [ watched sites ] in ``_watch.py``).

Every recompute sets the stashed states, runs, and puts back the states it
found; a region nested in another and replayed inside its recompute does not
put them back (the outer recompute's later draws must see the stream advanced
past it), as for the default generators.

So a generator a region can reach is replayed from its first use, verified
or not, and one it uses at every call from the first step. A generator a
forward makes and keeps in a slot (an attribute that held None, a list that
was empty, of a module whose code names ``Generator``) is made again by each
recompute: the recompute empties the slot while it runs, then puts the first
forward's generator back.

NOTE [ watched code ]
---------------------
A generator can still be out of every place when the subtree is listed: one
a helper makes and the module keeps in a new attribute, one put somewhere
new later. The code that uses it names it, though: an op takes it only as
``generator=`` (torch's signatures make it keyword-only, but for a few
``init`` functions), a helper passing it on has a ``generator`` parameter,
a module reads ``self.generator`` or makes one with ``torch.Generator``. So
the search that finds places (``_reach.names_generators``) also notes
whether any code it looks at names ``generator`` or ``Generator``; the
first forwards of a region running such code are watched at every call,
verified or not, and so stash any generator at its first use. Code that
names none pays nothing. The limit: code the search does not look at (a
hook registered after the listing, an installed library's, torch's) that
uses a generator no place held, or code passing one under another name
(``**kwargs``, positionally to ``torch.nn.init``), first on a call that is
not watched. The site's next sampled verified call finds it: where the
generator has drawn since it was seeded (the unwatched calls may have drawn
from it) it raises ``ScopedCkptError``; else it stashes it, and every later
first forward of the site is watched (NOTE [ watched sites ] in ``_watch.py``).

Scoped layers given ``generator=`` record their seeds; a recompute that
replays their generator draws each seed again (NOTE [ aligned draws ] in
``_dropout.py``), so that unscoped ops sharing the generator draw what they
drew in the first forward.
The generators scoped layers build masks with (``_mask.py``, reseeded at every
use) are never stashed, like the default ones.

Compiled code run by a watched region: dynamo compiles it for the torch function
modes in force, so the watch lets every call through unseen while dynamo traces
(a generator used there is not found), and the recomputes of a watched first
forward run under a watch that sees nothing: both compile the same graph, and
save the same tensors (``test_compile.py``'s eager-path tests found the
difference).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ._reach import Place, follow, function_places
from ._slots import empty_for_recompute
from ._state import FORWARD, RECOMPUTE, Frame, RegionCall, Tape
from ._subtree import Listing, subtree
from ._watch import Sites, Stash, Watch, defaults, known

__all__ = ["FRAME_PHASES", "Generators", "enter_frame", "reachable", "start_region"]

FRAME_PHASES = frozenset({FORWARD, RECOMPUTE})


@dataclass(slots=True, eq=False)
class Generators:
    """A region's explicit generators (``tape.generators``)."""

    stash: Stash
    # Whether its first forward ran under the watch: its recomputes run under a watch
    # too (that sees nothing), so that compiled code in the region, which dynamo compiles
    # for the torch function modes in force, saves the same tensors in both.
    watched: bool
    # The slots of its module's subtree that held no generator when it started (NOTE
    # [ generator slots ]): its recomputes empty those its first forward filled.
    empty: list[Place]
    # Where its first forward is watched whether or not it is verified, the call: the code
    # it runs names generators (NOTE [ watched code ]), or its site used one no place held
    # (NOTE [ watched sites ] in _watch.py).
    always: RegionCall | None = None


def _function_places(fn: object) -> tuple[list[object], object, tuple[Place, ...], bool]:
    """What a region's function carries that may be a generator (a partial's arguments, a
    closure's cells), the function its places start from, the places of the generators
    its code reads, and whether that code names generators (NOTE [ generator places ],
    NOTE [ watched code ]; cached per code object)."""
    places: list[object] = []
    if isinstance(fn, nn.Module):  # its subtree's listing covers its forward
        return places, None, (), False
    if isinstance(fn, functools.partial):
        places.extend(fn.args)
        places.extend(fn.keywords.values())
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None or not isinstance(fn, types.FunctionType):
        return places, None, (), False
    for cell in fn.__closure__ or ():
        try:
            places.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    read = _Code.places.get(code)
    if read is None:
        if len(_Code.places) >= 4096:
            _Code.places.clear()
        read = _Code.places[code] = function_places(fn)
    return places, fn, read[0], read[1]


class _Code:
    """The generator places each region function's code reads, by code object."""

    places: ClassVar[dict[Any, tuple[tuple[Place, ...], bool]]] = {}


def reachable(call: RegionCall, empty: list[Place] | None = None) -> list[torch.Generator]:
    """The generators the region can reach without running: its arguments, its function's
    partial arguments and closure, those its function's code reads, and for each module
    among these (and the module it runs) the places and slots of its subtree's listing
    (NOTE [ generator places ]); ``empty`` collects the slots of the module's subtree that
    hold none."""
    return _reach(call, empty)[0]


def _reach(call: RegionCall, empty: list[Place] | None) -> tuple[list[torch.Generator], bool]:
    """:func:`reachable`, and whether the code the region runs names generators (NOTE
    [ watched code ])."""
    found: list[torch.Generator] = []
    module = call.module
    draws = False
    if module is not None:
        listing = call.listing if call.listing is not None else subtree(module)
        draws = listing.draws
        if listing.generators or listing.later:
            _listed(listing, found, empty)
    if call.others and _scan([value for _, value in call.others], module, found):
        draws = True
    fn = call.fn
    if fn is not module:
        places, start, read, reads = _function_places(fn)
        if _scan(places, module, found) or reads:
            draws = True
        for place in read:
            generator = follow(place, start)
            if generator is not None:
                _add(found, generator)
    if found:
        default = defaults()
        found = [g for g in found if id(g) not in default]
    return found, draws


def _add(found: list[torch.Generator], generator: torch.Generator) -> None:
    if all(g is not generator for g in found):
        found.append(generator)


def _scan(places: Iterable[object], module: nn.Module | None, found: list[torch.Generator]) -> bool:
    """Add the generators among ``places`` and in the lists, tuples and dicts among them,
    and those the modules among them reach; whether those modules' code names generators."""
    draws = False
    for place in places:
        kind = type(place)
        if kind is torch.Tensor:
            continue
        if kind is torch.Generator:
            _add(found, place)  # type: ignore[arg-type]
        elif isinstance(place, nn.Module):
            if place is not module:
                listing = subtree(place)
                draws = draws or listing.draws
                _listed(listing, found)
        elif kind is list or kind is tuple:
            for item in place:  # type: ignore[attr-defined]
                if type(item) is torch.Generator:
                    _add(found, item)
        elif kind is dict:
            for item in place.values():  # type: ignore[attr-defined]
                if type(item) is torch.Generator:
                    _add(found, item)
    return draws


def _listed(
    listing: Listing, found: list[torch.Generator], empty: list[Place] | None = None
) -> None:
    """Add the generators at the places and slots a subtree's listing names; ``empty``
    collects the slots that hold none."""
    for place in listing.generators:
        generator = follow(place)
        if generator is not None:
            _add(found, generator)
    for slot in listing.later:
        generator = follow(slot)
        if generator is not None:
            _add(found, generator)
        elif empty is not None:
            empty.append(slot)


def start_region(tape: Tape, call: RegionCall) -> bool:
    """Stash the generators the region can reach or its site was seen to use; acts where
    there are some, or where the first forward is watched: verified, running code that
    names generators (NOTE [ watched code ]), or of a site seen to use one (NOTE
    [ watched sites ] in ``_watch.py``)."""
    module, listing = call.module, call.listing
    if (
        call.fn is module  # a region running a module: no function's places
        and listing is not None
        and not (listing.generators or listing.later or listing.draws)
        and not call.others
        and not Sites.any_found
        and call.determinism_check != "bitwise"
    ):
        return False  # nothing to reach, nothing remembered, not watched (as below)
    empty: list[Place] = []
    reached, always = _reach(call, empty)
    remembered = known(call)
    if remembered is not None:  # NOTE [ watched sites ] in _watch.py
        always = True
        # stashed before any use, as the reachable ones: the watch sees eager calls only
        for generator in remembered:
            _add(reached, generator)
    watched = always or call.determinism_check == "bitwise"
    if not reached and not watched and not empty:
        return False
    stash = [(g, g.get_state()) for g in reached]
    tape.generators = Generators(stash, watched, empty, call if always else None)
    return True


def enter_frame(frame: Frame) -> Callable[..., None] | None:
    """A watched first forward (verified, running code that names generators, or of a
    site seen to use one): watch for generators. A recompute: replay them."""
    generators = frame.tape.generators
    assert generators is not None  # start_region made it
    stash = generators.stash
    if frame.phase is not RECOMPUTE:
        verifying = frame.tape.verifying
        always = generators.always
        call = always if verifying is None else verifying.call
        if call is None:
            return None
        watching = Watch(stash, call, sampled=always is None)
        watching.__enter__()
        return watching.__exit__
    found = [(g, g.get_state()) for g, _ in stash]
    for generator, state in stash:
        generator.set_state(state)
    # Slots the first forward filled: emptied, so the recompute makes its generator again
    # (NOTE [ generator slots ]). Nested, replayed in its parent's recompute: left alone,
    # as the generators run on; a module parent's recompute empties them itself.
    refill = (
        [r for slot in generators.empty if (r := empty_for_recompute(slot))] if frame.rewind else []
    )
    watch: Watch | None = None
    if generators.watched:
        watch = Watch(None, None, sampled=False)
        watch.__enter__()
    if not found and watch is None and not refill:
        return None
    # Nested, replayed in its parent's recompute: the generators run on.
    return functools.partial(_put_back, found if frame.rewind else [], watch, refill)


def _put_back(
    found: Stash, watch: Watch | None, refill: list[Callable[[], None]], *exc: object
) -> None:
    try:
        if watch is not None:
            watch.__exit__(*exc)
    finally:
        for put in refill:
            put()
        for generator, state in found:
            generator.set_state(state)
