"""Explicit generators (``generator=g``): those a region holds, is given, was registered
with or was seen to use are stashed when it starts and replayed by its recomputes; a region
mechanism.

NOTE [ explicit generators ]
============================
The RNG replay (NOTE [ RNG replay ] in ``_rng.py``) stashes torch's *default*
generators. A random op given its own ``torch.Generator`` (``torch.randn(...,
generator=g)``) draws from a stream no such stash knows of: the recompute
would draw again from where the first forward left ``g``, compute from other
numbers, and leave ``g`` advanced twice. Nothing global lists a process's
generators, so a region stashes, when it starts, the generators of four kinds:

* **held**: the attributes of its subtree's modules that held a generator (or
  a list, tuple or dict of them) when the subtree was listed (``_subtree.py``),
  followed again at every region, so a reassigned one is the new generator;
* **given**: its arguments, its partial's arguments and its closure's cells;
* **registered**: ``checkpointing(generators=[g])``;
* **seen**: those a *watched* forward of its site used. A verified first
  forward (NOTE [ sampled verification ]: the first call of each site and
  sampled ones after it, or every call under ``determinism_check="bitwise"``)
  runs under a ``TorchFunctionMode`` that stashes each other generator at its
  first use and remembers it for the site (weakly, on ``_sampling.Site``).

Every recompute sets the stashed states, runs, and puts back the states it
found; a region replayed inside its parent's recompute does not put them back
(the parent's later draws must see the stream advanced past it), as for the
default generators. A generator a forward makes and keeps in an attribute is
made again by each recompute: the forward's world (NOTE [ forward's world ])
empties the attribute while the recompute runs.

Anything else is refused, not searched for: a generator first used on a call
that is not verified and that none of the four kinds holds (a global read by
a helper, one in a plain object, one switched on after warm-up) makes the
recompute draw other numbers. Where they reach a saved tensor, the light
check (NOTE [ light check ]) raises on that call. Else the site's next
verified call sees the generator drawn since it was seeded and raises
``ScopedCkptError`` naming the region and the fix (register it, or hold it as a
module attribute). A freshly seeded generator found on a sampled call is
either made for that call (exact without a stash) or reseeded by the loop
(the earlier calls were not exact): nothing tells them apart, so it is
stashed from then on with a ``UserWarning``.

Scoped layers given ``generator=`` record their seeds; a recompute that
replays their generator draws each seed again (NOTE [ aligned draws ] in
``_dropout.py``). The generators scoped layers build masks with (``_mask.py``,
reseeded at every use) are never stashed, like the default ones.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..core._errors import ScopedCkptError
from ..core._own_ops import WatchingMode
from ..core._sampling import sampling_period, unverified_calls_before
from ..core._state import FORWARD, RECOMPUTE, Frame, RegionCall, Tape, region_name
from ..core._subtree import generators_in
from ._verify import verified_call

__all__ = ["FRAME_PHASES", "OWN_GENERATORS", "Generators", "enter_frame", "replays", "start_region"]

# scopedckpt's own generators (the scoped layers' mask generators, every thread's, held
# weakly): they draw what the layers' tapes replay, so no region stashes them.
OWN_GENERATORS: weakref.WeakSet[torch.Generator] = weakref.WeakSet()

FRAME_PHASES = frozenset({FORWARD, RECOMPUTE})

# Each explicit generator a region uses, with its state before its first use there.
Stash = list[tuple[torch.Generator, torch.Tensor]]


@dataclass(slots=True, eq=False)
class Generators:
    """A region's explicit generators (``tape.generators``)."""

    stash: Stash
    # Its first forward runs under the watch, its recomputes under one that sees nothing:
    # dynamo compiles code for the modes in force, so both trace (and save) the same.
    watched: bool


def _given(fn: object) -> list[object]:
    """What a region's function carries: a partial's arguments, a closure's cells."""
    carried: list[object] = []
    if isinstance(fn, functools.partial):
        carried.extend(fn.args)
        carried.extend(fn.keywords.values())
        fn = fn.func
    for cell in getattr(getattr(fn, "__func__", fn), "__closure__", None) or ():
        try:
            carried.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    return carried


def _add(found: Stash, generators: Iterable[torch.Generator], skip: set[int]) -> None:
    for generator in generators:
        if id(generator) not in skip and all(g is not generator for g, _ in found):
            found.append((generator, generator.get_state()))


def start_region(tape: Tape, call: RegionCall) -> bool:
    """Stash the generators the region holds, is given, was registered with or its site
    was seen to use; acts where there are some or its first forward is watched."""
    watched = call.determinism_check == "bitwise"
    site, listing, fn = call.site, call.listing, call.fn
    places = () if listing is None else listing.generators
    if not (places or call.others or call.scope.generators or watched) and (
        fn is call.module and (site is None or not site.generators)
    ):
        return False  # the common case: nothing to look at
    stash: Stash = []
    skip = _defaults() | {id(g) for g in OWN_GENERATORS}
    _add(stash, call.scope.generators, skip)
    for ref, name in places:
        module = ref()
        if module is not None:
            _add(stash, generators_in(vars(module).get(name)), skip)
    given = [value for _, value in call.others]
    if fn is not call.module:
        given.extend(_given(fn))
    for value in given:
        _add(stash, generators_in(value), skip)
    if site is not None:
        _add(stash, [g for ref in site.generators if (g := ref()) is not None], skip)
    if not stash and not watched:
        return False
    tape.generators = Generators(stash, watched)
    return True


def replays(tape: Tape, generator: torch.Generator) -> bool:
    """Whether the region replays ``generator`` (scoped layers drawing from it align)."""
    return tape.generators is not None and any(g is generator for g, _ in tape.generators.stash)


def enter_frame(frame: Frame) -> Callable[..., None] | None:
    """A watched first forward: watch for generators. A recompute: replay them."""
    generators = frame.tape.generators
    assert generators is not None  # start_region made it
    stash = generators.stash
    if frame.phase is not RECOMPUTE:
        call = verified_call(frame.tape)
        if call is None:
            return None
        watching = Watch(stash, call)
        watching.__enter__()
        return watching.__exit__
    found = [(g, g.get_state()) for g, _ in stash]
    for generator, state in stash:
        generator.set_state(state)
    watch: Watch | None = None
    if generators.watched:
        watch = Watch(None, None)
        watch.__enter__()
    # Replayed inside its parent's recompute: the generators run on.
    return functools.partial(_put_back, found if frame.rewind else [], watch)


def _put_back(found: Stash, watch: Watch | None, *exc: object) -> None:
    try:
        if watch is not None:
            watch.__exit__(*exc)
    finally:
        for generator, state in found:
            generator.set_state(state)


def _defaults() -> set[int]:
    """The ids of torch's default generators (the RNG replay's), CPU and initialised CUDA."""
    ids = {id(torch.default_generator)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        ids.update(id(g) for g in torch.cuda.default_generators)
    return ids


class Watch(WatchingMode):
    """Stashes each other generator at its first use in a verified first forward, and
    remembers it for the site; ``stash`` None: a recompute's watch, which sees nothing."""

    def __init__(self, stash: Stash | None, call: RegionCall | None) -> None:
        super().__init__()
        self.stash, self.call = stash, call
        self.defaults = _defaults()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        # is_compiling first: dynamo traces both watches alike
        if torch.compiler.is_compiling() or self.stash is None:
            return func(*args, **kwargs)
        stash = self.stash
        generator = kwargs.get("generator")
        if generator is None:
            generator = next((a for a in args if type(a) is torch.Generator), None)
        if (
            type(generator) is torch.Generator
            and id(generator) not in self.defaults
            and generator not in OWN_GENERATORS
            and all(g is not generator for g, _ in stash)
        ):
            self._found(stash, generator)
        return func(*args, **kwargs)

    def _found(self, stash: Stash, generator: torch.Generator) -> None:
        call = self.call
        assert call is not None
        state = generator.get_state()
        if unverified_calls_before(call.module, call.fn):
            if not _seeded_only(generator, state):
                raise ScopedCkptError(_message(call))
            warnings.warn(_warning(call), stacklevel=3)
        stash.append((generator, state))
        site = call.site
        if site is not None and all(ref() is not generator for ref in site.generators):
            site.generators.append(weakref.ref(generator))


def _seeded_only(generator: torch.Generator, state: torch.Tensor) -> bool:
    """Whether ``state`` is that of ``generator`` freshly seeded: it drew nothing since."""
    fresh = torch.Generator(device=generator.device)
    fresh.manual_seed(generator.initial_seed())
    return torch.equal(fresh.get_state(), state)


_FIX = (
    "Or hold it as an attribute of a module the region runs, set when the module is built, "
    "or pass it to the region."
)


def _warning(call: RegionCall) -> str:
    return (
        f"scopedckpt: {region_name(call)} drew from a freshly seeded torch.Generator it did "
        "not hold when it started; register it with checkpointing(generators=[g]).\n"
        "It is replayed from now on. If it is made in the forward, nothing was wrong; if it "
        "is reseeded before each step and the region's earlier, unverified calls drew from "
        f"it, their recomputes drew other numbers and those steps were not exact. {_FIX}"
    )


def _message(call: RegionCall) -> str:
    return (
        f"scopedckpt: {region_name(call)} drew from a torch.Generator it did not hold when "
        "it started, and it has drawn since it was seeded; register it with "
        "checkpointing(generators=[g]).\n"
        "No module the region runs held it, nor did its arguments or earlier verified calls. "
        "The region's earlier "
        f"calls were not verified (the first of each region and one in {sampling_period()} "
        "after it are), so if they drew from it, their recomputes in backward drew other "
        f"numbers and those steps' gradients are not plain training's. {_FIX}"
    )
