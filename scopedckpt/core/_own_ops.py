"""The ops scopedckpt issues itself, which selective saving neither numbers nor keeps: its
bookkeeping (copies, fingerprints), which a first forward and its recompute issue
differently (NOTE [ selective saving ] in ``mechanisms/_selective.py``), and work that both
issue alike from state of their own (a dropout mask's bits from its seed).

Where a :class:`NumberingMode` (selective saving's) is the innermost dispatch mode, such ops
run with it taken off the stack, so they reach no Python per op (a hashed dropout mask is
about sixty ops); where another mode is innermost, the numbering mode sees them and leaves
them alone (:func:`unnumbered_now`), so both runs number the same calls either way. A
:class:`WatchingMode` (the explicit-generator watch of verified calls) innermost among torch
function modes is set aside alike: what scopedckpt draws itself uses generators of its own.
"""

from __future__ import annotations

import threading

from torch.overrides import TorchFunctionMode

from ._torch_private import (
    TorchDispatchMode,
    innermost_modes,
    pop_dispatch_mode,
    pop_function_mode,
    push_dispatch_mode,
    push_function_mode,
)

__all__ = [
    "NumberingMode",
    "WatchingMode",
    "aside",
    "internal",
    "issuing_own_ops",
    "unnumbered_now",
]


class _Depth(threading.local):
    own = 0  # how many internal() blocks are open in this thread
    aside = 0  # how many aside() blocks, internal() ones included


_DEPTH = _Depth()


class NumberingMode(TorchDispatchMode):
    """A dispatch mode that numbers a region's op calls (selective saving's): ops run
    :class:`aside` do not reach it where it is the innermost mode."""


class WatchingMode(TorchFunctionMode):
    """A torch function mode that watches a region's calls (explicit generators'): calls
    run :class:`aside` do not reach it where it is the innermost function mode."""


class aside:  # noqa: N801 - used like a function: ``with aside():``
    """Run the ops inside past selective saving's numbering, in this thread.

    For ops that both runs of a region issue alike and that nobody asked to keep: the
    bits of a dropout mask, a pure function of its seed.

    Example
    -------
    >>> with aside():
    ...     unnumbered_now()
    True
    """

    __slots__ = ("_dispatch", "_function")
    _own = 0

    def __enter__(self) -> None:
        _DEPTH.aside += 1
        _DEPTH.own += self._own
        function, dispatch = innermost_modes()
        self._function = function if isinstance(function, WatchingMode) else None
        self._dispatch = dispatch if isinstance(dispatch, NumberingMode) else None
        if self._function is not None:
            pop_function_mode()
        if self._dispatch is not None:
            pop_dispatch_mode()

    def __exit__(self, *exc: object) -> None:
        if self._dispatch is not None:
            push_dispatch_mode(self._dispatch)
        if self._function is not None:
            push_function_mode(self._function)
        _DEPTH.aside -= 1
        _DEPTH.own -= self._own


class internal(aside):  # noqa: N801 - used like a function: ``with internal():``
    """Mark the ops run inside as scopedckpt's own bookkeeping, in this thread: not
    numbered (:class:`aside`), and named "scopedckpt's own ops" by the peak report.

    Example
    -------
    >>> with internal():
    ...     issuing_own_ops()
    True
    """

    __slots__ = ()
    _own = 1


def issuing_own_ops() -> bool:
    """Whether this thread runs scopedckpt's own bookkeeping now (inside :class:`internal`)."""
    return bool(_DEPTH.own)


def unnumbered_now() -> bool:
    """Whether this thread runs ops that selective saving leaves alone (inside :class:`aside`)."""
    return bool(_DEPTH.aside)
