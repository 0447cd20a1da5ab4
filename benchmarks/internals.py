"""Every private scopedckpt name the benchmarks reach, and the switches built on them.

scopedckpt has no public switch for what these measurements undo (the buffer guard's
global hooks, a dropout formulation, how masks are drawn), nor public handles on its
per-region functions, so the measurements that need them go through this module and
no other benchmark module imports a private scopedckpt name. When scopedckpt's
internals move, this is the one file to follow them. Each switch is a measurement
only: with it on, training is not guaranteed exact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from scopedckpt._demo import saved_activation_bytes
from scopedckpt.core import _eager_checkpoint, _engine, _sampling
from scopedckpt.core._options import RegionOptions
from scopedckpt.core._state import FRAME, Scope
from scopedckpt.layers import _dropout, _mask
from scopedckpt.mechanisms import _guard
from scopedckpt.planner._live import LiveBytes
from scopedckpt.planner._plan import choose
from scopedckpt.planner._profile import profile_step
from scopedckpt.planner._solve import solve
from scopedckpt.planner._timeline import svg as timeline_svg

__all__ = [
    "PIECES",
    "REACHED",
    "ForcedFormulation",
    "GlobalHooksOff",
    "LiveBytes",
    "MaskVariant",
    "RegionPieces",
    "choose",
    "dropout_mask",
    "eager_checkpoint",
    "light_check_off",
    "profile_step",
    "random_words",
    "saved_activation_bytes",
    "solve",
    "timeline_svg",
]


# Every private attribute read or replaced below, looked up when used: tests check that
# scopedckpt still has each (the names imported above fail at import instead).
REACHED: tuple[tuple[Any, str], ...] = (
    (_guard, "_install"),
    (_guard, "_uninstall"),
    (_guard, "_pre_hook"),
    (_engine, "region_context_fn"),
    (_engine, "_EnterFrame"),
    (_mask, "Mask"),
    (_mask, "_random_words"),
    (_mask, "NATIVE_BELOW_ELEMENTS"),
    (_mask, "PIECES_FROM_ELEMENTS"),
    (_mask, "masked_dropout"),
    (_dropout, "masked_dropout"),
)


class GlobalHooksOff:
    """Switch the buffer guard's global module hooks off (a measurement, not exact)."""

    def __enter__(self) -> None:
        self._install, self._uninstall = _guard._install, _guard._uninstall
        _guard._install = _guard._uninstall = lambda *args: None  # type: ignore[assignment]

    def __exit__(self, *exc: object) -> None:
        _guard._install, _guard._uninstall = self._install, self._uninstall


class ForcedFormulation:
    """Scoped dropout on ``x`` runs as ATen ops (``native``) or as the
    ``autograd.Function`` (NOTE [ two formulations ] in ``scopedckpt/layers/_mask.py``).

    A class, not a generator: it is entered once per timed call.
    """

    def __init__(self, x: torch.Tensor, native: bool) -> None:
        self._limit = x.numel() + 1 if native else 0

    def __enter__(self) -> None:
        self._threshold = _mask.NATIVE_BELOW_ELEMENTS
        _mask.NATIVE_BELOW_ELEMENTS = self._limit

    def __exit__(self, *exc: object) -> None:
        _mask.NATIVE_BELOW_ELEMENTS = self._threshold


class MaskVariant:
    """Recomputes in the first forward's formulation and/or masks drawn whole, the two
    choices ``breakdown.recompute_dropout`` undoes (the bits are the same)."""

    def __init__(self, first_forwards: bool, whole: bool) -> None:
        self.first_forwards, self.whole = first_forwards, whole

    def __enter__(self) -> None:
        self._saved = _dropout.masked_dropout, _mask.PIECES_FROM_ELEMENTS
        if self.first_forwards:
            shipped = _mask.masked_dropout

            def first_forwards(
                input: torch.Tensor, mask: _mask.Mask, inplace: bool, recompute: bool = False
            ) -> torch.Tensor:
                return shipped(input, mask, inplace, recompute=False)

            _dropout.masked_dropout = first_forwards  # type: ignore[assignment]
        if self.whole:
            _mask.PIECES_FROM_ELEMENTS = 1 << 62

    def __exit__(self, *exc: object) -> None:
        _dropout.masked_dropout, _mask.PIECES_FROM_ELEMENTS = self._saved


def light_check_off(blocks: nn.Module) -> None:
    """No light check (NOTE [ light check ]) in the regions over ``blocks``' children: each
    child's site is told it has no tail. Holds until sampling is set again."""
    for block in blocks.children():
        _sampling.site(block, None).tail = -1


def dropout_mask(x: torch.Tensor, p: float) -> Any:
    """The mask a scoped element-wise dropout of ``x`` draws from seed 1 (1 byte kept);
    ``.keep()`` draws it, ``.scale(dtype)`` is the factor kept elements take."""
    return _mask.Mask(1, p, tuple(x.shape), x.device, alpha=False, save_mask=True)


def random_words(words: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """What ``Mask.keep()`` runs before its compare, at sizes drawn in one piece
    (NOTE [ mask bits ])."""
    return _mask._random_words(words, generator)


# What runs per region, by name: (owner, attribute), for machinery.py to wrap.
PIECES: dict[str, tuple[Any, str]] = {
    "region set-up (region_context_fn)": (_engine, "region_context_fn"),
    "frame entries (forward, recompute)": (_engine._EnterFrame, "__enter__"),
    "frame exits (forward, recompute)": (_engine._EnterFrame, "__exit__"),
    "the buffer guard's hook (per module call)": (_guard, "_pre_hook"),
}


class RegionPieces:
    """The functions of ``PIECES``, called directly with the arguments a region around
    ``block`` (called on ``x``) gives them."""

    def __init__(self, block: nn.Module, x: torch.Tensor) -> None:
        self.block, self.x = block, x
        self.scope = Scope(enabled=True, strict=False)
        self.options = RegionOptions(preserve_rng_state=True, context_fn=None)
        # A plain region's first-forward context, with the mechanisms its tape lists.
        self._forward = self.set_up()[1]()[0]

    def set_up(self) -> Any:
        """The region's set-up: tape, RNG stash, the two contexts."""
        return _engine.region_context_fn(
            self.block,
            None,
            self.block,
            self.scope,
            (self.x,),
            {},
            self.options,
            self.block,
        )

    def enter_and_exit(self) -> None:
        """One frame entry and exit of the first forward."""
        self._forward.__enter__()
        self._forward.__exit__(None, None, None)

    @contextmanager
    def in_frame(self) -> Iterator[None]:
        """Inside the first forward's frame, where the guard's hook acts."""
        self._forward.__enter__()
        try:
            assert FRAME.get() is not None
            yield
        finally:
            self._forward.__exit__(None, None, None)

    def hook(self, module: nn.Module) -> Callable[[], None]:
        """The buffer guard's first-forward hook on ``module``, as a call."""
        return lambda: _guard._pre_hook(module, (self.x,))


def eager_checkpoint(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` through the eager region's own checkpoint alone, with no contexts and
    torch's default check (what an eager region runs it with, less scopedckpt's mechanisms)."""
    nothing = nullcontext()
    return _eager_checkpoint.run(fn, args, {}, nothing, nothing, "default", True)
