"""Region sites: what scopedckpt remembers per site, and which calls sampled verification
verifies bit for bit.

NOTE [ sampled verification ]
=============================
Under the default determinism check, scopedckpt's eager regions (its own
calls, module targets, the integrations and torch's checkpoint under
``patch_torch_checkpoint``) take ``determinism_check="bitwise"`` (NOTE
[ bitwise verification ] in ``_verify.py``) at the first call of each region
site and, after it, at calls drawn pseudo-randomly, one in ``every`` on
average (64 unless :func:`set_verification_sampling` says otherwise). The draw
is a hash of the call's number at its site, so it is the same in every run,
and it has no period: a site whose calls alternate between kinds (a two-call
pattern such as an inner loop's call and a ``functional_call``) has every kind
verified, where "every 64th" verified only calls 1, 65, 129, ..., all of one
kind. Between sampled calls every unverified call still takes the light check
(NOTE [ light check ] in ``_light.py``). So a model whose recompute is not
exact fails on its first step, before its first optimizer step, and one that
stops being exact later at the call where it does.

A site is the module whose forward the region is (or the module passed as the
function, or the module of a bound method or partial), or else the code of the
region's function (lambdas are new objects at every call). A :class:`Site`
keeps the call count and what the light check learned, beside a weak
reference that tells a module from a later one at the same id; past
``_SITES_MAX`` sites they start over. Not sampled: regions whose call passes
its own check (``"bitwise"``, ``"none"``), regions under torch's debug mode (it
explains torch's own check), compiled regions (torch's operator: nothing to
verify).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar

from torch import nn

__all__ = [
    "Site",
    "known_site",
    "sampled",
    "sampled_check",
    "sampling_period",
    "set_verification_sampling",
    "site",
    "suspended",
    "unverified_calls_before",
]

_SITES_MAX = 4096
_MASK = (1 << 64) - 1


class Site:
    """What scopedckpt remembers of one region site (NOTE [ sampled verification ])."""

    __slots__ = ("alive", "calls", "generators", "late", "tail", "world")

    def __init__(self, alive: Any) -> None:
        self.alive = alive  # a weak reference to what the site's key follows
        self.calls = 0  # calls so far
        # The light check's saved tensor (NOTE [ light check ]): its index, None until a
        # call has shown it, -1 where the site saves none that it can use.
        self.tail: int | None = None
        self.world: Any = None  # _world.Learned: what its forwards were seen to need
        self.late = False  # NOTE [ late writes ]: its regions recompute whole
        # NOTE [ explicit generators ]: weak references to those its watched forwards used
        self.generators: list[weakref.ref[Any]] = []


class _Sampling:
    every = 64
    counting = True  # False inside suspended(): its calls use up no site's first call
    sites: ClassVar[dict[int, Site]] = {}  # site key -> its Site


def sampled(calls: int, every: int) -> bool:
    """Whether the call numbered ``calls`` (from 0) of a site is verified: the first, and
    each later one whose number's hash (splitmix64, its high half) is a multiple of ``every``.

    Example
    -------
    >>> [n for n in range(200) if sampled(n, 64)][:1]
    [0]
    >>> sum(sampled(n, 64) for n in range(64_000)) in range(900, 1100)
    True
    """
    if calls == 0 or every == 1:
        return True
    z = (calls * 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return ((z ^ (z >> 31)) >> 32) % every == 0  # the high half: the low bits follow calls


def set_verification_sampling(every: int) -> int:
    """Verify bit for bit the first call of each region site and, after it, one call in
    ``every`` on average, drawn without a period.

    Applies to regions under the default determinism check (NOTE [ sampled
    verification ]); ``0`` turns sampling off (the light check of every call stays),
    ``1`` verifies every call. Regions
    that pass ``determinism_check`` (``"bitwise"``, ``"none"``) are not sampled;
    compiled regions never are. Process-wide; sites start counting again.

    Parameters
    ----------
    every
        The mean number of calls per verified call, an int >= 0 (default 64).

    Returns
    -------
    int
        The previous value.

    Example
    -------
    >>> import scopedckpt
    >>> previous = scopedckpt.set_verification_sampling(0)   # no sampled verification
    >>> scopedckpt.set_verification_sampling(previous)
    0
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(
            f"scopedckpt: set_verification_sampling(every=...) takes an int >= 0 (0 turns "
            f"sampled verification off, 1 verifies every region call), got {every!r}."
        )
    previous, _Sampling.every = _Sampling.every, every
    _Sampling.sites.clear()
    return previous


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """No sampled verification inside (process-wide), and no calls counted: for code that
    compares by itself (``plan()``'s profiling, the testing helper), so that the first call
    a user makes after it is still a site's first, verified."""
    previous, _Sampling.every = _Sampling.every, 0
    counting, _Sampling.counting = _Sampling.counting, False
    try:
        yield
    finally:
        _Sampling.every, _Sampling.counting = previous, counting


def site_of(owner: object | None, fn: object) -> tuple[int, object]:
    """The key of a region's site, and the object whose lifetime the key follows."""
    if owner is None and isinstance(fn, nn.Module):
        owner = fn
    if owner is not None:
        return id(owner), owner
    target = getattr(fn, "func", fn)  # functools.partial
    target = getattr(target, "__func__", target)  # bound methods
    code = getattr(target, "__code__", None)
    if code is not None:
        return id(code), code
    return id(type(target)), type(target)


def site(owner: object | None, fn: object, count: bool = True) -> Site:
    """The :class:`Site` of a region's call (the one table of what scopedckpt remembers per
    site), made where there is none; ``count``: one more call."""
    key, alive = site_of(owner, fn)
    sites = _Sampling.sites
    entry = sites.get(key)
    if entry is None or entry.alive() is not alive:
        if len(sites) >= _SITES_MAX:
            sites.clear()
        entry = sites[key] = Site(weakref.ref(alive))  # modules, code, classes all are
    if count:
        entry.calls += 1
    return entry


def known_site(owner: object | None, fn: object) -> Site | None:
    """The :class:`Site` of a region's call where there is one, uncounted."""
    if not _Sampling.sites:
        return None
    key, alive = site_of(owner, fn)
    entry = _Sampling.sites.get(key)
    return entry if entry is not None and entry.alive() is alive else None


def sampled_check(check: str, owner: object | None, fn: object) -> tuple[str, Site | None]:
    """``"bitwise"`` where NOTE [ sampled verification ] samples this call, else ``check``;
    and the call's site under the default check (the light check's), else None."""
    if check != "default":
        return check, None
    found = site(owner, fn, count=_Sampling.counting)
    every = _Sampling.every
    if every and sampled(found.calls - 1, every):
        return "bitwise", found
    return check, found


def sampling_period() -> int:
    """The mean number of calls per sampled verified call (0: off)."""
    return _Sampling.every


def unverified_calls_before(owner: object | None, fn: object) -> bool:
    """Whether the site of the call being made, sampled and verified now, had earlier
    calls that sampling left unverified."""
    if _Sampling.every == 1:
        return False
    found = known_site(owner, fn)
    return found is not None and found.calls > 1
