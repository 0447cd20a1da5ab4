"""Explicit generators (``generator=g``) used in regions: found where the region can reach
them and by verified first forwards, stashed at every region, replayed by recomputes; a
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
  arguments; its function's partial arguments and closure cells; the globals
  its function's code reads; and, for the module it runs and every module
  among those, each attribute of a module in its subtree and each global a
  subtree module's ``forward`` reads (listed with the subtree, ``_subtree.py``,
  and looked up again at every region, so a reassigned attribute is the new
  generator);
* the generators verified first forwards of its site were seen to use: a
  *verified* first forward (``determinism_check="bitwise"``: by default the
  first call of each region site and every 64th, NOTE [ sampled
  verification ]) runs under a ``TorchFunctionMode`` that looks at each torch
  call's arguments for a non-default generator, stashes it at its first use
  and remembers it for the site (weakly).

Every recompute sets the stashed states, runs, and puts back the states it
found; a region nested in another and replayed inside its recompute does not
put them back (the outer recompute's later draws must see the stream advanced
past it), as for the default generators.

So a generator a region can reach is replayed from its first use, verified
or not, and one it uses at every call from the first step. The limit: a
generator reached only through something else (an element of a list, an
attribute of an object that is not a module, a global read by a helper
function rather than by a forward), and first used on a call that is not
verified, is not seen until the next verified call of the site; that call's
verification raises where its draws reach a saved tensor. Scoped layers given
``generator=`` record their seeds; a recompute that replays their generator
draws each seed again (NOTE [ aligned draws ] in ``_dropout.py``), so that
unscoped ops sharing the generator draw what they drew in the first forward.
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
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ._mask import MASK_GENERATORS
from ._sampling import site_of
from ._state import FORWARD, RECOMPUTE, Frame, RegionCall, Tape
from ._subtree import Listing, global_generators_of, subtree

__all__ = ["FRAME_PHASES", "Generators", "Stash", "enter_frame", "reachable", "start_region"]

FRAME_PHASES = frozenset({FORWARD, RECOMPUTE})

# Each explicit generator a region uses, with its state before its first use there.
Stash = list[tuple[torch.Generator, torch.Tensor]]


@dataclass(slots=True, eq=False)
class Generators:
    """A region's explicit generators (``tape.generators``)."""

    stash: Stash
    # Whether its first forward ran under the watch: its recomputes run under a watch
    # too (that sees nothing), so that compiled code in the region, which dynamo compiles
    # for the torch function modes in force, saves the same tensors in both.
    watched: bool


class _Sites:
    """The explicit generators found per region site: site key -> (a weak reference to
    what the key follows, weak references to the generators)."""

    found: ClassVar[dict[int, tuple[Any, list[weakref.ref[torch.Generator]]]]] = {}


def _defaults() -> set[int]:
    """The ids of torch's default generators (the RNG replay's), CPU and initialised
    accelerators."""
    ids = {id(torch.default_generator)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        ids.update(id(g) for g in torch.cuda.default_generators)
    return ids


def _known(call: RegionCall) -> list[torch.Generator]:
    """The live generators remembered for the site of ``call``."""
    if not _Sites.found:
        return []
    key, alive = site_of(call.module, call.fn)
    entry = _Sites.found.get(key)
    if entry is None or entry[0]() is not alive:
        return []
    return [g for ref in entry[1] if (g := ref()) is not None]


def _remember(call: RegionCall, generator: torch.Generator) -> None:
    key, alive = site_of(call.module, call.fn)
    entry = _Sites.found.get(key)
    if entry is None or entry[0]() is not alive:
        if len(_Sites.found) >= 4096:
            _Sites.found.clear()
        entry = _Sites.found[key] = (weakref.ref(alive), [])
    if all(ref() is not generator for ref in entry[1]):
        entry[1].append(weakref.ref(generator))


def _function_places(fn: object) -> list[object]:
    """What a region's function carries that may be a generator: a partial's arguments, a
    closure's cells, and the generators its code reads as globals (NOTE [ explicit
    generators ])."""
    places: list[object] = []
    if isinstance(fn, nn.Module):  # its subtree's listing covers its forward
        return places
    if isinstance(fn, functools.partial):
        places.extend(fn.args)
        places.extend(fn.keywords.values())
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return places
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            places.append(cell.cell_contents)
        except ValueError:  # an empty cell
            pass
    read = _Globals.by_code.get(code)
    if read is None:
        if len(_Globals.by_code) >= 4096:
            _Globals.by_code.clear()
        read = _Globals.by_code[code] = global_generators_of(fn)
    places.extend(namespace.get(name) for namespace, name in read)
    return places


class _Globals:
    """The global generators each region function's code reads, by code object."""

    by_code: ClassVar[dict[Any, tuple[tuple[dict[str, Any], str], ...]]] = {}


def reachable(call: RegionCall) -> list[torch.Generator]:
    """The generators the region can reach without running: its arguments, its function's
    partial arguments and closure, the globals its code reads, and for each module among
    these (and the module it runs) the attributes of the modules in its subtree and the
    globals their forwards read (NOTE [ explicit generators ])."""
    found: list[torch.Generator] = []
    module = call.module
    if module is not None:
        listing = call.listing if call.listing is not None else subtree(module)
        if listing.generators or listing.global_generators:
            _listed(listing, found)
    _scan(call.args, module, found)
    if call.kwargs:
        _scan(call.kwargs.values(), module, found)
    fn = call.fn
    if fn is not module:
        _scan(_function_places(fn), module, found)
    if found:
        defaults = _defaults()
        found = [g for g in found if id(g) not in defaults]
    return found


def _add(found: list[torch.Generator], generator: torch.Generator) -> None:
    if all(g is not generator for g in found):
        found.append(generator)


def _scan(places: Iterable[object], module: nn.Module | None, found: list[torch.Generator]) -> None:
    """Add the generators among ``places``, and those the modules among them reach."""
    for place in places:
        kind = type(place)
        if kind is torch.Tensor:
            continue
        if kind is torch.Generator:
            _add(found, place)  # type: ignore[arg-type]
        elif isinstance(place, nn.Module) and place is not module:
            _listed(subtree(place), found)


def _listed(listing: Listing, found: list[torch.Generator]) -> None:
    """Add the generators a subtree's listing says where to find."""
    for holder_ref, name in listing.generators:
        holder = holder_ref()
        value = None if holder is None else vars(holder).get(name)
        if type(value) is torch.Generator:
            _add(found, value)
    for namespace, name in listing.global_generators:
        value = namespace.get(name)
        if type(value) is torch.Generator:
            _add(found, value)


def start_region(tape: Tape, call: RegionCall) -> bool:
    """Stash the generators the region can reach or its site was seen to use; acts where
    there are some, or where the first forward is verified (and watched)."""
    known = reachable(call)
    for generator in _known(call):
        _add(known, generator)
    watched = call.determinism_check == "bitwise"
    if not known and not watched:
        return False
    tape.generators = Generators([(g, g.get_state()) for g in known], watched)
    return True


class _Watch(TorchFunctionMode):
    """Stashes each non-default generator at its first use in a region's first forward."""

    def __init__(self, stash: Stash | None, call: RegionCall | None) -> None:
        super().__init__()
        self.stash, self.call = stash, call  # None: a recompute's, which sees nothing
        self.defaults = _defaults()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        if torch.compiler.is_compiling():  # the same trace under either watch
            return func(*args, **kwargs)
        generator = kwargs.get("generator") if kwargs else None
        if generator is None:
            for arg in args:
                if type(arg) is torch.Generator:
                    generator = arg
                    break
            else:
                return func(*args, **kwargs)
        stash = self.stash
        if (
            stash is not None
            and type(generator) is torch.Generator
            and id(generator) not in self.defaults
            and generator not in MASK_GENERATORS
            and all(g is not generator for g, _ in stash)
        ):
            stash.append((generator, generator.get_state()))
            assert self.call is not None
            _remember(self.call, generator)
        return func(*args, **kwargs)


def enter_frame(frame: Frame) -> Callable[..., None] | None:
    """A verified first forward: watch for generators. A recompute: replay them."""
    generators = frame.tape.generators
    assert generators is not None  # start_region made it
    stash = generators.stash
    if frame.phase is not RECOMPUTE:
        verifying = frame.tape.verifying
        if verifying is None:
            return None
        watching = _Watch(stash, verifying.call)
        watching.__enter__()
        return watching.__exit__
    found = [(g, g.get_state()) for g, _ in stash]
    for generator, state in stash:
        generator.set_state(state)
    watch: _Watch | None = None
    if generators.watched:
        watch = _Watch(None, None)
        watch.__enter__()
    if not found and watch is None:
        return None
    # Nested, replayed in its parent's recompute: the generators run on.
    return functools.partial(_put_back, found if frame.rewind else [], watch)


def _put_back(found: Stash, watch: _Watch | None, *exc: object) -> None:
    if watch is not None:
        watch.__exit__(*exc)
    for generator, state in found:
        generator.set_state(state)
