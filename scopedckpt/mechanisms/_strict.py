"""Strict mode: a lint that raises on random ops inside a region that no scoped layer issued.

Scoped layers mark their own draws (:func:`scoped_draws`); while a strict
region's first forward runs, a dispatch mode sees every aten op and raises
:class:`ScopedCkptError` on a seeded random op drawn outside such a mark,
naming the op and the fix. Strict mode judges an op random by its
``nondeterministic_seeded`` tag and then by its arguments: the tag sits on ops
such as ``aten._scaled_dot_product_flash_attention_for_cpu`` even with
``dropout_p=0.0``, and on ``native_dropout`` with ``train=False``, which draw
nothing.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import torch

from ..core._errors import ScopedCkptError
from ..core._names import frame_region_name
from ..core._state import FORWARD, Frame, RegionCall, Tape
from ..core._torch_private import TorchDispatchMode, bound_arguments

__all__ = ["FRAME_PHASES", "draws_random_numbers", "enter_frame", "scoped_draws", "start_region"]


_SCOPED_DRAW: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "scopedckpt_scoped_draw", default=False
)


class scoped_draws:  # noqa: N801 - used like a function: ``with scoped_draws():``
    """A fresh (single-use) context manager under which strict mode lets random ops through:
    scoped layers' own draws.

    A plain class rather than ``@contextmanager``: it runs on every dropout
    call, and a generator-based context manager costs several times more.
    """

    __slots__ = ("_token",)

    def __enter__(self) -> None:
        self._token = _SCOPED_DRAW.set(True)

    def __exit__(self, *exc: object) -> None:
        _SCOPED_DRAW.reset(self._token)


_NO_DRAW = {"p": 0.0, "dropout_p": 0.0, "train": False, "training": False}


def draws_random_numbers(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether this call of a tagged op really draws (``dropout_p=0`` does not)."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    named = bound_arguments(func, args, kwargs)
    return not any(name in named and named[name] == value for name, value in _NO_DRAW.items())


def _explicit_generator(named: dict[str, Any]) -> bool:
    generator = named.get("generator")
    if generator is None:
        return False
    if generator.device.type == "cpu":
        return generator is not torch.default_generator
    module = torch.get_device_module(generator.device.type)
    defaults = getattr(module, "default_generators", ())
    return all(generator is not default for default in defaults)


class _UnscopedRandomDetector(TorchDispatchMode):
    """Raise on seeded random ops that no scoped layer issued, naming ``frame``'s region."""

    def __init__(self, frame: Frame) -> None:
        super().__init__()
        self._frame = frame

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if not _SCOPED_DRAW.get() and draws_random_numbers(func, args, kwargs):
            region = frame_region_name(self._frame)
            if _explicit_generator(bound_arguments(func, args, kwargs)):
                raise ScopedCkptError(
                    f"scopedckpt: strict mode found {func} on its own generator in "
                    f"{region}: use a scoped layer with generator=g.\n"
                    "It is replayed from the region's stash of explicit generators where the "
                    "region reaches the generator (an attribute or class attribute of its "
                    "modules, a container or object they hold, a global their code reads), but "
                    "strict mode asks for scoped layers: use one with generator=... "
                    "(scopedckpt.Dropout(p, generator=g)), or draw from the default "
                    "generator, or draw outside the region."
                )
            raise ScopedCkptError(
                f"scopedckpt: strict mode found the random op {func} in {region}: use "
                "a scoped layer or turn strict off.\n"
                "The op was not issued by a scoped layer. It is replayed exactly from the "
                "region's stash of the default generators, but strict mode asks for scoped "
                "layers (no stash needed, exact also with preserve_rng_state=False). Replace "
                "torch dropout layers with scoped ones (scopedckpt.convert(model) does it in "
                "place), call scopedckpt.functional.dropout instead of "
                "torch.nn.functional.dropout, or turn strict off."
            )
        return func(*args, **kwargs)


FRAME_PHASES = frozenset({FORWARD})


def start_region(tape: Tape, call: RegionCall) -> bool:
    """Strict mode keeps nothing on the tape; it acts in a strict scope's frames."""
    return call.scope.strict


def enter_frame(frame: Frame) -> Callable[..., Any]:
    """A strict scope's first forward runs under the detector; returns its exit."""
    detector = _UnscopedRandomDetector(frame)
    detector.__enter__()
    return detector.__exit__
