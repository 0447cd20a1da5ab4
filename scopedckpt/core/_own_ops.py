"""The ops scopedckpt issues for its own bookkeeping (copies, fingerprints, masks), which
selective saving neither numbers nor keeps: a first forward and its recompute issue
different ones (NOTE [ selective saving ] in ``mechanisms/_selective.py``)."""

from __future__ import annotations

import threading

__all__ = ["internal", "issuing_own_ops"]


class _Depth(threading.local):
    depth = 0


_DEPTH = _Depth()


class internal:  # noqa: N801 - used like a function: ``with internal():``
    """Mark the ops run inside as scopedckpt's own, in this thread.

    Example
    -------
    >>> with internal():
    ...     issuing_own_ops()
    True
    """

    __slots__ = ()

    def __enter__(self) -> None:
        _DEPTH.depth += 1

    def __exit__(self, *exc: object) -> None:
        _DEPTH.depth -= 1


def issuing_own_ops() -> bool:
    """Whether this thread runs scopedckpt's own ops now (inside :class:`internal`)."""
    return bool(_DEPTH.depth)
