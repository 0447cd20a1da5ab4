"""Slots: where a module's forward may keep a generator it makes, emptied by recomputes
so that they make it again.

NOTE [ generator slots ]
========================
A forward may make its generator at its first call and keep it for the later
ones (``if self.generator is None: self.generator = torch.Generator()...``, or
appended to a list that was empty). No place held it when the subtree was
listed (NOTE [ generator places ] in ``_reach.py``), and the call that makes
it draws from a fresh generator that its recompute, finding it kept and
advanced, would not. So for each module whose own code names ``Generator``
(its class's and its bases', but other libraries'), each attribute that holds
None and the first element of each attribute that holds an empty list is a
*slot*, listed with the subtree (``Listing.later``). A region follows its
slots like places (a generator kept there is stashed like any other), and
remembers those it found empty; its recomputes empty again those the first
forward filled while they run (:func:`empty_for_recompute`), so that the
forward makes its generator again, as the first forward did, and draws the
same numbers from it, then put the first forward's generator back
(``_generators``). That is exact when the forward makes it the same way each
time (from a fixed seed, not the clock: Python state, which verification
names). A nested region replayed inside its parent's recompute leaves slots
alone, as the generators run on there; a module parent's recompute empties
them itself.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ._reach import ATTR, BOOKKEEPING, ITEM, Place, foreign, namespace_of

__all__ = ["empty_for_recompute", "makes_generators", "subtree_slots"]


def subtree_slots(modules: Iterable[nn.Module]) -> tuple[Place, ...]:
    """The slots of a subtree of ``modules``: those of its modules whose code names
    ``Generator``."""
    slots: list[Place] = []
    makers: dict[type, bool] = {}
    for module in modules:
        kind = type(module)
        if kind not in makers:
            makers[kind] = makes_generators(kind)
        if makers[kind]:
            _slots_of(module, weakref.ref(module), slots)
    return tuple(slots)


def makes_generators(kind: type) -> bool:
    """Whether the code of ``kind`` (its own, and its bases' but foreign ones) names
    ``Generator``: it may make one in its forward and keep it."""
    for base in kind.__mro__:
        if foreign(base):
            continue
        for item in vars(base).values():
            item = getattr(item, "__func__", item)  # staticmethod, classmethod
            code = getattr(item, "__code__", None)
            if isinstance(code, types.CodeType) and _names(code, "Generator"):
                return True
    return False


def _names(code: types.CodeType, name: str) -> bool:
    """Whether ``code``, or code nested in it, reads ``name``."""
    return name in code.co_names or any(
        _names(constant, name)
        for constant in code.co_consts
        if isinstance(constant, types.CodeType)
    )


def _slots_of(module: nn.Module, root: weakref.ref[Any], places: list[Place]) -> None:
    """Add ``module``'s attributes that hold None, and the first element of those that
    hold an empty list, to ``places`` (its code makes generators)."""
    for name, value in list(vars(module).items()):
        if name in BOOKKEEPING:
            continue
        if value is None:
            places.append((root, ((ATTR, name),)))
        elif type(value) is list and not value:
            places.append((root, ((ATTR, name), (ITEM, 0))))


def empty_for_recompute(slot: Place) -> Callable[[], None] | None:
    """If ``slot`` (:func:`subtree_slots`) holds a generator now, empty it (None, or
    an empty list) and return what puts it back; None if it holds none."""
    reference, steps = slot
    holder = reference() if reference is not None else None
    if holder is None:
        return None
    name = steps[0][1]
    value = namespace_of(holder).get(name)
    if len(steps) == 1:
        if type(value) is not torch.Generator:
            return None
        setattr(holder, name, None)
        return functools.partial(setattr, holder, name, value)
    if type(value) is not list or not value or type(value[0]) is not torch.Generator:
        return None
    kept = value[:]
    value.clear()
    return functools.partial(value.extend, kept)
