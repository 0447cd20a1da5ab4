"""Where code runs, eager or traced by dynamo, and so which path a region call takes.

NOTE [ region paths ]
=====================
Every layer of scopedckpt asks one of two questions here, never dynamo's
flag itself:

* :func:`where`, for code that runs inside a region (scoped layers, the
  buffer guard's hooks, a compiled region's body): ``EAGER`` (read the
  context variables), ``GRAPH`` (dynamo traces it and this thread runs no
  eager region frame: emit torch's own ops, which torch's checkpoint operator
  makes exact) or ``BREAK`` (dynamo traces it inside an eager region frame:
  leave the graph and run the eager code, NOTE [ torch.compile ] in
  ``_compiled.py``).
* :func:`region_path`, for a call that may start a region:

  ==============  ===============================================  =============
  path            when                                             run by
  ==============  ===============================================  =============
  ``PLAIN``       no enabled scope (eager) or mirror (traced), or  the caller
                  grad disabled
  ``EAGER``       eager code in an enabled scope, or traced code   ``_engine``
                  inside an eager region frame (a graph break)
  ``COMPILED``    traced code in an enabled block, no eager frame  ``_compiled``
  ``FALLBACK``    a compiled region's body that dynamo runs        ``_compiled``
                  eagerly after a graph break: its frames entered
                  by the body itself
  ==============  ===============================================  =============

:data:`MIRROR` is what traced code reads instead of the context variables,
and only the functions below write it.
"""

from __future__ import annotations

import enum
import threading
from typing import Any

import torch

from ._state import SCOPE, Scope

__all__ = ["BREAK", "EAGER", "GRAPH", "MIRROR", "Path", "Where", "region_path", "where"]

_compiling = torch.compiler.is_dynamo_compiling


class CompiledView(threading.local):
    """What compiled code reads instead of the context variables (which dynamo cannot read
    without a graph break): this thread's view of them (NOTE [ torch.compile ])."""

    def __init__(self) -> None:
        # Set per thread, on its first access. Instance attributes, not class
        # attributes: dynamo guards on the instance's __dict__, and a first
        # assignment would otherwise change it.
        self.regions = False  # this thread is inside an enabled checkpointing() block
        self.eager = False  # this thread runs an eager region frame
        self.enabled_blocks = 0  # behind ``regions`` (eager code only)
        self.frames = 0  # behind ``eager`` (eager code only)
        self.save: Any = None  # the innermost block's _policy.SavePolicy, or None
        # The innermost block applies a plan whose regions differ in policy: each module's,
        # by id, as (policy key, whether it selects modules), key -1 for a full region.
        self.planned: dict[int, tuple[int, bool]] | None = None


MIRROR = CompiledView()


class Where(enum.Enum):
    """Where the code asking runs (NOTE [ region paths ])."""

    EAGER = "eager"
    GRAPH = "traced into a graph"
    BREAK = "traced, inside an eager region frame"


# The members as module constants: looking a member up on its Enum class is a
# metaclass attribute lookup, and where() is asked at every module call of a first
# forward. Compare with these (``where() is EAGER``).
EAGER, GRAPH, BREAK = Where.EAGER, Where.GRAPH, Where.BREAK


def where() -> Where:
    """Whether the caller runs eagerly, traced into a graph, or traced where it must
    leave the graph (NOTE [ region paths ])."""
    if not _compiling():
        return EAGER
    return BREAK if MIRROR.eager else GRAPH


class Path(enum.Enum):
    """The paths a region call takes (NOTE [ region paths ])."""

    PLAIN = "plain"
    EAGER = "eager region"
    COMPILED = "compiled region"
    FALLBACK = "eager fallback"


def region_path(scope: Scope | None = None) -> Path:
    """The path a region call takes here; ``scope`` forces a scope in eager code
    (integrations), which otherwise reads the innermost one.

    ``FALLBACK`` is never the answer here: a compiled region's body finds
    itself run eagerly (``where() is Where.EAGER``).
    """
    if _compiling():
        if MIRROR.eager:
            return Path.EAGER
        return Path.COMPILED if MIRROR.regions and torch.is_grad_enabled() else Path.PLAIN
    if scope is None:
        scope = SCOPE.get()
    if scope is None or not scope.enabled or not torch.is_grad_enabled():
        return Path.PLAIN
    return Path.EAGER


def enter_block(delta: int, save: Any, planned: dict[int, tuple[int, bool]] | None = None) -> Any:
    """An eager ``checkpointing()`` block is entered; ``delta``: how it changes the number
    of enabled blocks (an enabled block nested in an enabled one counts once, a
    disabled one in an enabled one takes one away); ``planned``: its regions' policies
    by module, where they differ (``MIRROR.planned``). Returns what :func:`exit_block` takes to
    put the mirror back."""
    MIRROR.enabled_blocks += delta
    MIRROR.regions = MIRROR.enabled_blocks > 0
    previous = delta, MIRROR.save, MIRROR.planned
    MIRROR.save, MIRROR.planned = save, planned
    return previous


def exit_block(previous: Any) -> None:
    """Undo :func:`enter_block`."""
    delta, MIRROR.save, MIRROR.planned = previous
    MIRROR.enabled_blocks -= delta
    MIRROR.regions = MIRROR.enabled_blocks > 0


def enter_traced_block(enabled: bool, save: Any) -> tuple[bool, Any]:
    """A ``checkpointing()`` block entered while dynamo traces: set the mirror for the
    trace (dynamo replays only the net result, nothing); returns the previous values."""
    previous = MIRROR.regions, MIRROR.save
    MIRROR.regions = enabled
    if save is not None:
        MIRROR.save = save
    return previous


def exit_traced_block(previous: tuple[bool, Any]) -> None:
    """Undo :func:`enter_traced_block`."""
    MIRROR.regions, MIRROR.save = previous


def frame_entered() -> None:
    """An eager region frame starts in this thread (the buffer guard's ``begin``)."""
    MIRROR.frames += 1
    MIRROR.eager = True


def frame_left() -> None:
    """An eager region frame ends in this thread."""
    MIRROR.frames -= 1
    MIRROR.eager = MIRROR.frames > 0
