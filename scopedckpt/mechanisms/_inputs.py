"""A region's tensor inputs changed in place by its own forward, refused: a region mechanism.

The recompute in backward starts from the region's inputs as they are then. A
forward that writes into one of them (``nn.ReLU(inplace=True)`` first in a
block, ``x.add_(...)``) leaves the recompute other values than the first forward
saw: autograd raises an error that names no region when the input needs a
gradient, and nothing at all says so when it does not. When a region starts,
this mechanism notes its tensor inputs' version counters (bumped by every
in-place write, through views too); when its first forward ends it raises
:class:`ScopedCkptError` naming the region, the input and the fix if one moved.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ..core._errors import ScopedCkptError
from ..core._state import FORWARD, Frame, RegionCall, Tape, region_name
from ..core._torch_private import version_of

__all__ = ["FRAME_PHASES", "enter_frame", "start_region"]

FRAME_PHASES = frozenset({FORWARD})


def start_region(tape: Tape, call: RegionCall) -> bool:
    """Note the versions of the region's tensor inputs; acts in its first forward if any."""
    if not call.tensors:
        return False
    tape.inputs = call
    return True


def enter_frame(frame: Frame) -> Callable[..., None]:
    """The first forward: check the inputs when it ends without an error."""
    return functools.partial(_check, frame)


def _check(frame: Frame, exc_type: object, *exc: object) -> None:
    call, frame.tape.inputs = frame.tape.inputs, None  # the check runs once
    if exc_type is not None or call is None:
        return
    for name, tensor, version in call.tensors:
        if version_of(tensor) != version:
            raise ScopedCkptError(_message(call, name))


def _message(call: RegionCall, name: int | str) -> str:
    which = (
        f"positional argument #{name}" if isinstance(name, int) else f"keyword argument {name!r}"
    )
    return (
        f"scopedckpt: {region_name(call)} changed its input ({which}) in place: make that "
        "op out of place (inplace=False).\n"
        "For instance nn.ReLU(inplace=True) or x.add_(...) as its first op. The recompute in "
        "backward would start from the changed values, not the ones the first forward saw. "
        "Make that op out of place (inplace=False, x = x + ...), or give the region a copy "
        "of the input (x.clone())."
    )
