"""The watch of region first forwards for explicit generators, and the sites where it found
them: a ``TorchFunctionMode`` that stashes each generator at its first use.

NOTE [ watched sites ]
======================
The watch (NOTE [ explicit generators ] in ``_generators.py``) runs over a
region's first forward where that forward is verified, where the code it runs
names generators (NOTE [ watched code ]), and where the region's *site* (as in
NOTE [ sampled verification ]) was seen to use a generator: one the watch
found is one no place held when the region started, so the region stashes it
at later calls (it is remembered for the site, weakly) and watches every later
first forward of the site, so that another generator put where this one was
(a new one each epoch, by code the search does not look at) is stashed at its
first use too. Sites that never used one pay nothing.

A generator the watch finds on a *sampled* verified call of a site whose earlier
calls ran unwatched may have been used by those calls, whose recomputes then
drew other numbers from it: nothing saw them. Where the generator has drawn
since it was seeded (its state is not a freshly seeded one's), the watch raises
``ScopedCkptError`` naming the region and the fix, rather than go on as though
those steps had been exact. One that has not drawn since it was seeded is
either made for this call (by the forward: exact without a stash, as its
recompute makes it again) or reseeded for it (by the training loop, at every
step: the earlier calls were not exact), and nothing tells the two apart: the
watch stashes it and warns (a ``UserWarning``, once per site, as the site is
watched from then on), naming the region and the fix. So such a generator is
replayed from its first use on, or its first use is reported at the site's
next sampled verified call (within ``every`` calls); with sampled verification
off, nothing reports it, and only calls that are verified or watched stash it.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ._errors import ScopedCkptError
from ._mask import MASK_GENERATORS
from ._sampling import known_site, sampling_period, site, unverified_calls_before
from ._state import RegionCall, region_name

__all__ = ["Sites", "Stash", "Watch", "defaults", "known", "remember"]

# Each explicit generator a region uses, with its state before its first use there.
Stash = list[tuple[torch.Generator, torch.Tensor]]


class Sites:
    """Whether the watch found a generator at any site; the generators themselves are
    remembered on each site's ``_sampling.Site`` (weakly)."""

    any_found = False


def defaults() -> set[int]:
    """The ids of torch's default generators (the RNG replay's), CPU and initialised
    accelerators."""
    ids = {id(torch.default_generator)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        ids.update(id(g) for g in torch.cuda.default_generators)
    return ids


def known(call: RegionCall) -> list[torch.Generator] | None:
    """The live generators remembered for the site of ``call``; None where its site has
    none remembered (NOTE [ watched sites ])."""
    if not Sites.any_found:
        return None
    found = known_site(call.module, call.fn)
    if found is None or not found.generators:
        return None
    return [g for ref in found.generators if (g := ref()) is not None]


def remember(call: RegionCall, generator: torch.Generator) -> None:
    """Remember ``generator`` for the site of ``call``."""
    found = site(call.module, call.fn, count=False)
    Sites.any_found = True
    if all(ref() is not generator for ref in found.generators):
        found.generators.append(weakref.ref(generator))


class Watch(TorchFunctionMode):
    """Stashes each non-default generator at its first use in a region's first forward.

    ``sampled``: the forward is watched only because it is verified, so its site's
    earlier calls may have run unwatched (NOTE [ watched sites ]).
    """

    def __init__(self, stash: Stash | None, call: RegionCall | None, sampled: bool) -> None:
        super().__init__()
        self.stash, self.call = stash, call  # None: a recompute's, which sees nothing
        self.sampled = sampled
        self.defaults = defaults()

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
            call = self.call
            assert call is not None
            state = generator.get_state()
            if self.sampled and unverified_calls_before(call.module, call.fn):
                if not _seeded_only(generator, state):
                    raise ScopedCkptError(_message(call))
                warnings.warn(_warning(call), stacklevel=2)
            stash.append((generator, state))
            remember(call, generator)
        return func(*args, **kwargs)


def _seeded_only(generator: torch.Generator, state: torch.Tensor) -> bool:
    """Whether ``state`` is that of ``generator`` freshly seeded: it drew nothing since."""
    fresh = torch.Generator(device=generator.device)
    fresh.manual_seed(generator.initial_seed())
    return torch.equal(fresh.get_state(), state)


_FIX = (
    "Register it with checkpointing(generators=[g]), or keep it where scopedckpt finds it "
    "when a region starts: an attribute of a module the region runs, set when the module "
    "is built, or an argument of the region; or verify every call with "
    "scopedckpt.set_verification_sampling(1)."
)


def _warning(call: RegionCall) -> str:
    return (
        f"scopedckpt: {region_name(call)} drew from a freshly seeded torch.Generator it could "
        "not find before it ran; hold it as a module attribute.\n"
        "It is replayed from now on. The region's earlier calls were not watched for it: "
        "if it is made in the forward, nothing was wrong; if it is reseeded before each step "
        "and the earlier calls drew from it, their recomputes drew other numbers and those "
        f"steps' gradients are not plain training's. {_FIX}"
    )


def _message(call: RegionCall) -> str:
    return (
        f"scopedckpt: {region_name(call)} drew from a torch.Generator it could not find "
        "before it ran, and it has drawn since it was seeded; hold it as a module attribute.\n"
        "No module the region runs holds it, it is not an argument of the region, and no "
        "code scopedckpt looks at names it 'generator'. The region's earlier calls were not "
        f"verified (only the first call of each region and one in {sampling_period()} after "
        "it are), so if they drew from it, their recomputes in backward drew other numbers "
        f"and those steps' gradients are not plain training's. {_FIX}"
    )
