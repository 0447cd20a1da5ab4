"""User forward hooks in recomputes: a hook that changed tensors in the first forward runs
again, one that only looked (a capture, a counter, a statistic) does not: a region mechanism.

NOTE [ hooks in recomputes ]
============================
A recompute calls the region's modules again, and with them their forward
hooks and pre-hooks. In plain training each runs once per call; a hook that
appends the module's output to a list (feature matching, distillation), counts
calls or accumulates statistics would do so twice. A hook that returns a value
(replacing the module's input or output) or writes its tensors in place must
run again, though: the recompute computes from what it made. So the rule is:

* in a region's first forward, each user hook of the region's module subtree
  (``_forward_pre_hooks`` and ``_forward_hooks``, with or without kwargs) is
  wrapped while the forward runs, and a hook *changed* its module's call if at a
  call it returned something other than None, moved the version counter of a
  tensor among its arguments (the input, the output) or of its module's buffers
  and parameters (legacy ``spectral_norm``'s power iteration), or assigned an
  attribute of its module;
* in each recompute, the hooks that changed their module's call in the first
  forward run as they did (the buffer guard and the forward's world, NOTE
  [ forward's world ], make what they write land on copies); the others, which
  only looked (a capture into a list or dict held elsewhere, a counter or a
  statistic kept outside the module), are not called. Side effects then happen
  once per step, as in plain training, and transforms still apply.

A hook that both changes its module's call and keeps a record elsewhere runs again
whole (its record doubles): split it in two. scopedckpt's own hooks always run. Not covered: global
module hooks (``register_module_forward_hook``), hooks of modules outside the
region's subtree (a module passed as an argument), hooks of plain function
regions (no subtree). The hooks of the region's own module run outside the
region (its forward is the region), once. Nested regions: the outermost frame
wraps the hooks; every first forward active in the thread records, so a nested
region's own recompute knows its hooks too.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ..core._state import FORWARD, RECOMPUTE, Frame, RegionCall, Tape
from ..core._torch_private import module_buffers, module_parameters, version_of

__all__ = ["FRAME_PHASES", "Hooks", "enter_frame", "start_region"]

FRAME_PHASES = frozenset({FORWARD, RECOMPUTE})

_OWN = "scopedckpt."  # the package's own hooks (the guard's, the planner's) always run


@dataclass(slots=True, eq=False)
class Hooks:
    """A region's hooked dicts and what its first forward saw (``tape.hooks``)."""

    dicts: list[dict[int, Any]]  # the subtree's hook dicts that hold hooks
    changed: set[int] = field(default_factory=set)  # ids of the hooks that changed tensors


class _Recording(threading.local):
    def __init__(self) -> None:
        self.sets: list[set[int]] = []  # the first forwards active in this thread


_RECORDING = _Recording()


def start_region(tape: Tape, call: RegionCall) -> bool:
    """A region whose subtree holds user hooks acts in its frames."""
    listing = call.listing
    if listing is None or not any(listing.hook_dicts):
        return False
    tape.hooks = Hooks([d for d in listing.hook_dicts if d])
    return True


def enter_frame(frame: Frame) -> Callable[..., None] | None:
    """Wrap the user hooks for the frame (unless an enclosing frame did); record in a first
    forward, choose in a recompute."""
    hooks = frame.tape.hooks
    assert hooks is not None  # start_region said so
    forward = frame.phase is FORWARD
    if forward:
        _RECORDING.sets.append(hooks.changed)
    wrapped: list[tuple[dict[int, Any], int, Any]] = []
    for d in hooks.dicts:
        for key, hook in list(d.items()):
            if getattr(hook, "_scopedckpt_original", None) is not None:
                continue  # an enclosing frame's wrapper
            if getattr(hook, "__module__", "").startswith(_OWN):
                continue
            wrapped.append((d, key, hook))
            wrapper = _recording(hook) if forward else _chosen(hook, id(hook) in hooks.changed)
            wrapper._scopedckpt_original = hook  # type: ignore[attr-defined]
            d[key] = wrapper
    return functools.partial(_unwrap, wrapped, forward)


def _unwrap(wrapped: list[tuple[dict[int, Any], int, Any]], forward: bool, *exc: object) -> None:
    if forward:
        _RECORDING.sets.pop()
    for d, key, hook in wrapped:
        if key in d:  # not removed meanwhile
            d[key] = hook


def _versions(args: tuple[Any, ...]) -> list[int]:
    """The version counters of the tensors among a hook's arguments (one level deep) and of
    its module's own buffers and parameters."""
    module = args[0]
    found = [version_of(t) for t in module_buffers(module).values() if t is not None]
    found.extend(version_of(t) for t in module_parameters(module).values() if t is not None)
    for arg in args[1:]:
        items = arg if isinstance(arg, tuple | list) else (arg,)
        found.extend(version_of(t) for t in items if isinstance(t, Tensor))
    return found


def _changed_attributes(module: Any, before: dict[str, Any]) -> bool:
    now = vars(module)
    return len(now) != len(before) or any(before.get(k, before) is not v for k, v in now.items())


def _recording(hook: Any) -> Callable[..., Any]:
    """``hook``, noting in every active first forward whether it changed anything."""

    def wrapper(*args: Any) -> Any:
        before, attributes = _versions(args), dict(vars(args[0]))
        result = hook(*args)
        if (
            result is not None
            or _versions(args) != before
            or _changed_attributes(args[0], attributes)
        ):
            for changed in _RECORDING.sets:
                changed.add(id(hook))
        return result

    return wrapper


def _chosen(hook: Any, run: bool) -> Callable[..., Any]:
    """``hook`` in a recompute: run where it changed tensors in the first forward."""

    def wrapper(*args: Any) -> Any:
        return hook(*args) if run else None

    return wrapper
