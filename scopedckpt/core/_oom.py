"""Out-of-memory errors raised in a region say where they happened: a note on torch's own
error naming the region in flight, its phase, the device allocator's counts, and the fixes.

The note (PEP 678, ``BaseException.add_note``) changes neither the error's type nor
its message, so code catching ``torch.OutOfMemoryError`` behaves as before; Python
prints notes under the traceback. The innermost region frame the error leaves adds it,
once: enclosing regions and later frames find the error marked. It costs nothing until
an error is raised: what was live at the failing moment needs the counting mode, which
``scopedckpt.peak_report`` runs (NOTE [ peak attribution ]).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ._names import frame_region_name
from ._state import RECOMPUTE, Frame

__all__ = ["add_hint", "explain"]

_NOTED = "_scopedckpt_noted"
# Lines other packages add about the failing frame (the planner: a plan it made that names
# the region's module), or None.
_HINTS: list[Callable[[Frame], str | None]] = []


def add_hint(hint: Callable[[Frame], str | None]) -> None:
    """Add a line the note may carry: ``hint(frame)``, where not None."""
    _HINTS.append(hint)


def explain(error: BaseException, frame: Frame) -> None:
    """Add the note to ``error`` (a ``torch.OutOfMemoryError``) leaving ``frame``, unless
    an inner frame did.

    Example
    -------
    >>> from scopedckpt.core._state import Frame, FORWARD, Scope, Tape
    >>> error = torch.OutOfMemoryError("CUDA out of memory.")
    >>> explain(error, Frame(FORWARD, Tape(), Scope(True, False), torch.nn.Linear(2, 2)))
    >>> print(error.__notes__[0].splitlines()[0])
    scopedckpt: out of memory in the first forward of the region of a Linear module (pass root=model to checkpointing() for its path).
    """
    if getattr(error, _NOTED, False):
        return
    setattr(error, _NOTED, True)
    phase = "recompute (in backward)" if frame.phase is RECOMPUTE else "first forward"
    lines = [f"scopedckpt: out of memory in the {phase} of {frame_region_name(frame)}."]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gib = 2**30
        lines.append(
            f"On cuda:{torch.cuda.current_device()}: {torch.cuda.memory_allocated() / gib:.2f} "
            f"GiB allocated, {torch.cuda.max_memory_allocated() / gib:.2f} GiB at most since "
            f"the last reset, {torch.cuda.memory_reserved() / gib:.2f} GiB reserved."
        )
    lines.extend(line for hint in _HINTS if (line := hint(frame)) is not None)
    lines.append(
        "To see what was live and when, run one step under scopedckpt.peak_report(step, "
        "root=model); to fit a budget, let scopedckpt.plan(model, x, budget=...) choose the "
        "regions (docs/memory.md)."
    )
    error.add_note("\n".join(lines))
