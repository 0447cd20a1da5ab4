"""Module targets: make selected modules' forwards regions with no wrappers.

While any scope selecting a module is active, in any thread, the module's
``forward`` (the instance attribute for an instance target; the class
attribute of the class and of every subclass defining its own ``forward`` for
a class target) is a small function that asks the *current context's* scope
whether this call is a region. Module structure, qualified names,
``state_dict`` keys and user hooks are untouched: hooks run around ``forward``
as always, outside the region. Patches are reference-counted across threads
and nested scopes and removed when the last scope selecting them exits.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

from ._engine import _region, current_region_owner
from ._paths import EAGER, enter_traced_block, exit_traced_block, where
from ._policy import SavePolicy
from ._run import run_region
from ._state import SCOPE

__all__ = ["Patches", "enter_traced", "exit_traced", "install"]

# Re-entrant: a region's finalizer may release patches during a garbage
# collection that starts while this thread holds the lock.
_LOCK = threading.RLock()
_MISSING = object()


@dataclass
class _Patch:
    count: int
    holder: Any  # the module instance or class whose __dict__ holds the patch
    previous: Any  # what the holder's own __dict__ had under "forward", or _MISSING


_PATCHES: dict[int, _Patch] = {}


def _regioned(
    forward: Callable[..., Any], module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if where() is not EAGER:  # NOTE [ torch.compile ] in _compiled.py
        return run_region(forward, module, args, kwargs)
    scope = SCOPE.get()
    # current_region_owner() is module: we are already inside this module's
    # region (e.g. a subclass forward calling super().forward): stay plain.
    if scope is not None and scope.selects(module) and current_region_owner() is not module:
        return _region(forward, module, args, kwargs)
    return forward(*args, **kwargs)


def _instance_forward(module: nn.Module, previous: Any) -> Callable[..., Any]:
    # The class's function, bound here: looking ``forward`` up at call time can
    # find this very wrapper under torch.compile and recurse.
    inner = (
        previous if previous is not _MISSING else functools.partial(type(module).forward, module)
    )

    def forward(*args: Any, **kwargs: Any) -> Any:
        return _regioned(inner, module, args, kwargs)

    forward.__scopedckpt_patch__ = True  # type: ignore[attr-defined]
    return forward


def _class_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _regioned(original.__get__(self), self, args, kwargs)

    forward.__scopedckpt_patch__ = True  # type: ignore[attr-defined]
    return forward


def _classes_to_patch(cls: type) -> Iterator[type]:
    """``cls`` and every subclass that defines its own ``forward``."""
    yield cls
    stack: list[type] = list(cls.__subclasses__())
    seen = {cls}
    while stack:
        sub = stack.pop()
        if sub in seen:
            continue
        seen.add(sub)
        if "forward" in vars(sub):
            yield sub
        stack.extend(sub.__subclasses__())


@dataclass
class Patches:
    """The patches one scope entry made; each hold on them is released by one ``remove()``.

    A scope entry holds its patches while the block runs; each region started
    in it takes a further hold (:meth:`share`) released when torch frees the
    region, because the backward recompute, usually after the block exited,
    must find nested targets still patched to make them regions again. After
    the block the patches are inert: calls in contexts without the scope are
    plain calls. The holders' counts (across scope entries) change only when
    the first hold is taken and the last released, so a region's hold costs the
    same however many modules the scope patched.
    """

    holders: list[Any]
    holds: int = 1

    def release_all(self) -> None:
        """Remove the patches now, whatever holds remain (after a region failed: torch's
        checkpoint can keep such regions alive in a reference cycle)."""
        with _LOCK:
            self.holds = 1
        self.remove()

    def share(self) -> Patches:
        """A further hold on the same patches (released by a ``remove()``)."""
        with _LOCK:
            self.holds += 1
        return self

    def remove(self) -> None:
        with _LOCK:
            self.holds -= 1
            if self.holds > 0:
                return
            self.holds = 0  # released for good: later holds' removals do nothing
            for holder in self.holders:
                patch = _PATCHES[id(holder)]
                patch.count -= 1
                if patch.count:
                    continue
                del _PATCHES[id(holder)]
                if isinstance(holder, type):
                    if patch.previous is _MISSING:
                        delattr(holder, "forward")
                    else:
                        holder.forward = patch.previous  # type: ignore[attr-defined]
                elif patch.previous is _MISSING:
                    holder.__dict__.pop("forward", None)
                else:
                    holder.__dict__["forward"] = patch.previous
            self.holders.clear()


def install(modules: tuple[nn.Module, ...], classes: tuple[type, ...]) -> Patches:
    """Patch the forwards of ``modules`` and ``classes`` (reference-counted)."""
    holders: list[Any] = list(modules)
    for cls in classes:
        holders.extend(_classes_to_patch(cls))
    with _LOCK:
        for holder in holders:
            existing = _PATCHES.get(id(holder))
            if existing is not None:
                existing.count += 1
                continue
            previous = vars(holder).get("forward", _MISSING)
            if isinstance(holder, type):
                holder.forward = _class_forward(holder.forward)  # type: ignore[attr-defined]
            else:
                holder.__dict__["forward"] = _instance_forward(holder, previous)
            _PATCHES[id(holder)] = _Patch(1, holder, previous)
    return Patches(holders)


def _traced_forward(module: nn.Module, previous: Any) -> Callable[..., Any]:
    inner = previous if previous is not None else functools.partial(type(module).forward, module)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return run_region(inner, module, args, kwargs)

    return forward


def enter_traced(
    modules: list[nn.Module], enabled: bool, save: SavePolicy | None
) -> tuple[tuple[bool, Any], list[tuple[nn.Module, Any]]]:
    """A ``checkpointing()`` block entered while dynamo traces: set the mirror and
    patch the targets for the trace; returns what :func:`exit_traced` puts back.

    Dynamo records both as side effects of the traced function and replays
    only their net result (nothing) when the compiled code runs.
    """
    previous = enter_traced_block(enabled, save)
    patched = []
    for module in modules:
        existing = module.__dict__.get("forward")
        if getattr(existing, "__scopedckpt_patch__", False):
            continue  # patched by a block entered outside the compiled function
        module.__dict__["forward"] = _traced_forward(module, existing)
        patched.append((module, existing))
    return previous, patched


def exit_traced(previous: tuple[bool, Any], patched: list[tuple[nn.Module, Any]]) -> None:
    """Undo :func:`enter_traced`."""
    exit_traced_block(previous)
    for module, existing in patched:
        if existing is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = existing
