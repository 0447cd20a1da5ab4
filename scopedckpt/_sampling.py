"""Sampled verification: which region calls the default determinism check verifies bit for bit.

NOTE [ sampled verification ]
=============================
Under the default determinism check, scopedckpt's eager regions (its own
calls, module targets, the integrations and torch's checkpoint under
``patch_torch_checkpoint``) take ``determinism_check="bitwise"`` (NOTE
[ bitwise verification ] in ``_verify.py``) at the first call of each region
site and at every ``every``-th call after it (64 unless
:func:`set_verification_sampling` says otherwise). So a model whose recompute
is not exact fails on its first step, before its first optimizer step, and one
that stops being exact later (data-dependent state) at the next sampled call;
only sampled calls pay for verification. A site is the module whose forward
the region is (or the module passed as the function, or the module of a bound
method or partial), or else the code of the region's function (lambdas are new
objects at every call). Counts are kept per site beside a weak reference that
tells a module from a later one at the same id; past ``_SITES_MAX`` sites they
start over. Not sampled: regions whose call passes its own check
(``"bitwise"``, ``"none"``), regions under torch's debug mode (it explains
torch's own check), compiled regions (torch's operator: nothing to verify).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar

from torch import nn

__all__ = [
    "sampled_check",
    "sampling_period",
    "set_verification_sampling",
    "suspended",
    "unverified_calls_before",
]

_SITES_MAX = 4096


class _Sampling:
    every = 64
    # site key -> (weak reference to what the key follows, calls so far)
    sites: ClassVar[dict[int, tuple[Any, int]]] = {}


def set_verification_sampling(every: int) -> int:
    """Verify bit for bit the first and every ``every``-th call of each region site.

    Applies to regions under the default determinism check (NOTE [ sampled
    verification ]); ``0`` turns sampling off, ``1`` verifies every call. Regions
    that pass ``determinism_check`` (``"bitwise"``, ``"none"``) are not sampled;
    compiled regions never are. Process-wide; sites start counting again.

    Parameters
    ----------
    every
        The sampling period, an int >= 0 (default 64).

    Returns
    -------
    int
        The previous period.

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
    """No sampled verification inside (process-wide): for code that compares by itself."""
    previous, _Sampling.every = _Sampling.every, 0
    try:
        yield
    finally:
        _Sampling.every = previous


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


def sampled_check(check: str, owner: object | None, fn: object) -> str:
    """``"bitwise"`` where NOTE [ sampled verification ] samples this call, else ``check``."""
    every = _Sampling.every
    if check != "default" or not every:
        return check
    key, alive = site_of(owner, fn)
    sites = _Sampling.sites
    entry = sites.get(key)
    if entry is None or entry[0]() is not alive:
        if len(sites) >= _SITES_MAX:
            sites.clear()
        ref: Any = weakref.ref(alive)  # modules, code objects and classes all are
        calls = 0
    else:
        ref, calls = entry
    sites[key] = (ref, calls + 1)
    return "bitwise" if calls % every == 0 else check


def sampling_period() -> int:
    """The period of sampled verification (0: off)."""
    return _Sampling.every


def unverified_calls_before(owner: object | None, fn: object) -> bool:
    """Whether the site of the call being made, sampled and verified now, had earlier
    calls that sampling left unverified."""
    if _Sampling.every == 1:
        return False
    key, alive = site_of(owner, fn)
    entry = _Sampling.sites.get(key)
    return entry is not None and entry[0]() is alive and entry[1] > 1
