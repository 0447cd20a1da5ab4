"""The one exception type scopedckpt raises for its own failures."""

from __future__ import annotations

__all__ = ["ScopedCkptError"]


class ScopedCkptError(RuntimeError):
    """Raised when scopedckpt cannot keep a checkpointed step exact.

    Every message starts with ``scopedckpt:``, says what was expected, what
    came instead, and how to fix it.

    Example
    -------
    >>> import scopedckpt
    >>> issubclass(scopedckpt.ScopedCkptError, RuntimeError)
    True
    """
