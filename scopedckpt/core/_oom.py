"""Out-of-memory errors raised under scopedckpt say where they happened: a note on torch's
own error naming the region in flight and its phase (or the block it left, outside any
region, and the user's line it was raised at), the device allocator's counts, and the fixes.

The note (PEP 678, ``BaseException.add_note``) changes neither the error's type nor
its message, so code catching ``torch.OutOfMemoryError`` behaves as before; Python
prints notes under the traceback. The innermost place the error leaves adds it, once:
a region frame, else a ``checkpointing()`` scope or a ``memory_report()`` block (which
adds the regions it measured so far); enclosing ones find the error marked. It costs
nothing until an error is raised: what was live at the failing moment needs the
counting mode, which ``scopedckpt.peak_report`` runs (NOTE [ peak attribution ]).
"""

from __future__ import annotations

import linecache
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ._names import frame_region_name, innermost_user_frame
from ._state import RECOMPUTE, Frame

__all__ = ["add_hint", "explain", "explain_outside"]

_NOTED = "_scopedckpt_noted"
# Lines other packages add about the modules in flight (the planner: a plan it made of
# their blocks), or None.
_HINTS: list[Callable[[Iterable[nn.Module]], str | None]] = []


def add_hint(hint: Callable[[Iterable[nn.Module]], str | None]) -> None:
    """Add a line the note may carry: ``hint(modules)``, where not None."""
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
    if _first_note(error):
        phase = "recompute (in backward)" if frame.phase is RECOMPUTE else "first forward"
        owner = frame.owner
        modules = [owner] if isinstance(owner, nn.Module) else []
        _note(error, f"the {phase} of {frame_region_name(frame)}", modules)


def explain_outside(
    error: BaseException, block: str, modules: Iterable[nn.Module], so_far: str = ""
) -> None:
    """Add the note to ``error`` leaving ``block`` (``"a checkpointing() scope"``),
    raised outside any region, unless a region or an inner block did: it names the
    user's line the error was raised at, and adds ``so_far`` (what the block measured).
    """
    if not _first_note(error):
        return
    where = f"{block}, outside any region"
    found = innermost_user_frame(error.__traceback__)
    if found is not None:
        filename, line = found[0].f_code.co_filename, found[1]
        where += f", at {filename}:{line} ({linecache.getline(filename, line).strip()})"
    _note(error, where, [m for module in modules for m in module.modules()], so_far)


def _first_note(error: BaseException) -> bool:
    """Whether no note was added to ``error`` yet; marks it."""
    if getattr(error, _NOTED, False):
        return False
    setattr(error, _NOTED, True)
    return True


def _note(error: BaseException, where: str, modules: list[nn.Module], so_far: str = "") -> None:
    lines = [f"scopedckpt: out of memory in {where}."]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gib = 2**30
        lines.append(
            f"On cuda:{torch.cuda.current_device()}: {torch.cuda.memory_allocated() / gib:.2f} "
            f"GiB allocated, {torch.cuda.max_memory_allocated() / gib:.2f} GiB at most since "
            f"the last reset, {torch.cuda.memory_reserved() / gib:.2f} GiB reserved."
        )
    if so_far:
        lines.append(so_far)
    lines.extend(line for hint in _HINTS if (line := hint(modules)) is not None)
    lines.append(
        "To see what was live and when, run one step under scopedckpt.peak_report(step, "
        "root=model); to fit a budget, let scopedckpt.plan(model, x, budget=...) choose the "
        "regions (docs/memory.md)."
    )
    error.add_note("\n".join(lines))
