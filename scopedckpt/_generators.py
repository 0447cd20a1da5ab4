"""Explicit generators (``generator=g``) used in regions: found by verified first forwards,
stashed at every region of their site, replayed by recomputes; a region mechanism.

NOTE [ explicit generators ]
============================
The RNG replay (NOTE [ RNG replay ] in ``_rng.py``) stashes torch's *default*
generators. A random op given its own ``torch.Generator`` (``torch.randn(...,
generator=g)``, ``x.uniform_(generator=g)``) draws from a stream no stash knows
of: the recompute draws again, from where the first forward left ``g``, so it
computes from other random numbers, and after backward ``g`` has advanced twice
(issue 25, hole 6). Nothing global lists a process's generators, and watching
every op of every region for a ``generator=`` argument would cost every region.
So:

* a *verified* first forward (``determinism_check="bitwise"``: by default the
  first call of each region site and every 64th, NOTE [ sampled verification ])
  runs under a ``TorchFunctionMode`` that looks at each torch call's arguments
  for a non-default generator; at its first use in the region it stashes the
  generator's state on the tape and remembers the generator for the region's
  site (weakly);
* every region of a site with remembered generators stashes their states when
  it starts (before any use, as the default ones are);
* every recompute sets the stashed states, runs, and puts back the states it
  found; a region nested in another and replayed inside its recompute does
  not put them back (the outer recompute's later draws must see the stream
  advanced past it), as for the default generators.

So a generator a region uses at every call is replayed from the first step. A
generator first used on a call that is not verified (a new one, or a branch the
site's verified calls never took) is not seen until the next verified call of
the site; that call's verification raises where its draws reach a saved tensor.
Scoped layers given ``generator=`` record their seeds and draw nothing in
recomputes: stashing their generator too changes nothing.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.overrides import TorchFunctionMode

from ._sampling import site_of
from ._state import FORWARD, RECOMPUTE, Frame, RegionCall, Tape

__all__ = ["FRAME_PHASES", "Generators", "Stash", "enter_frame", "start_region"]

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


def start_region(tape: Tape, call: RegionCall) -> bool:
    """Stash the generators remembered for the region's site; acts where there are some,
    or where the first forward is verified (and watched)."""
    known = _known(call)
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
