"""Every private torch name scopedckpt uses, in one place.

``torch.utils._python_dispatch.TorchDispatchMode`` is the only way to see each
aten op a region runs, which strict mode needs to catch random ops that did not
go through a scoped layer (``nn.Dropout``, ``torch.rand`` in user code): the
public ``torch.overrides.TorchFunctionMode`` misses ops issued from C++ (e.g.
``nn.Dropout`` calling ``bernoulli_``). ``tests/test_torch_private.py`` fails
loudly if torch renames or changes it.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._errors import ScopedCkptError

__all__ = ["TorchDispatchMode", "scoped_draws", "unscoped_random_detector"]

_SCOPED_DRAW: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "scopedckpt_scoped_draw", default=False
)


class _ScopedDraws:
    """Mark random ops issued by scoped layers as allowed in strict mode.

    A plain class rather than ``@contextmanager``: it runs on every dropout
    call, and a generator-based context manager costs several times more.
    """

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = _SCOPED_DRAW.set(True)

    def __exit__(self, *exc: object) -> None:
        _SCOPED_DRAW.reset(self._token)


def scoped_draws() -> _ScopedDraws:
    """A fresh (single-use) context manager under which strict mode lets random ops through."""
    return _ScopedDraws()


class _UnscopedRandomDetector(TorchDispatchMode):
    """Raise on seeded random aten ops that no scoped layer issued."""

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if torch.Tag.nondeterministic_seeded in func.tags and not _SCOPED_DRAW.get():
            raise ScopedCkptError(
                f"scopedckpt: strict mode found the random op {func} inside a "
                "checkpoint region, not issued by a scoped layer; its recompute in "
                "backward would draw different numbers and the gradients would be "
                "silently wrong. Replace torch dropout layers with scoped ones "
                "(scopedckpt.convert(model) does it in place), call "
                "scopedckpt.functional.dropout instead of torch.nn.functional.dropout, "
                "or draw the randomness outside the region."
            )
        return func(*args, **(kwargs or {}))


def unscoped_random_detector() -> TorchDispatchMode:
    """A fresh dispatch mode that raises on unscoped random ops."""
    return _UnscopedRandomDetector()
