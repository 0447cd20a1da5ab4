"""Composing checkpoint context functions: one whose contexts enter two others' in turn.

torch's checkpoint takes one ``context_fn`` returning a first-forward context and
a recompute context; a region's own contexts and a user's (or torch's debug
mode's) are entered together through :func:`compose`, the outer first and exited
last, each entry undone when the next one raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Both", "ContextFn", "compose"]

ContextFn = Callable[[], tuple[Any, Any]]


class Both:
    """Enter ``outer`` then ``inner``, exit in reverse; re-enterable if both are."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, outer: Any, inner: Any) -> None:
        self._outer, self._inner = outer, inner

    def __enter__(self) -> None:
        self._outer.__enter__()
        try:
            self._inner.__enter__()
        except BaseException as error:
            self._outer.__exit__(type(error), error, error.__traceback__)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            self._inner.__exit__(*exc)
        finally:
            self._outer.__exit__(*exc)


def compose(outer: ContextFn, inner: ContextFn) -> ContextFn:
    """A ``context_fn`` whose two contexts enter ``outer``'s and then ``inner``'s."""

    def composed() -> tuple[Any, Any]:
        (forward, recompute), (inner_forward, inner_recompute) = outer(), inner()
        return Both(forward, inner_forward), Both(recompute, inner_recompute)

    return composed
