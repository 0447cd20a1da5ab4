"""Choose one way to run each block, fastest under a peak budget: a dynamic program
over the bytes the blocks so far keep, exact for the peak model.

NOTE [ planning as a dynamic program ]
======================================
Under the peak model (NOTE [ peak model ] in ``_profile.py``) every constraint
a plan must meet has the form ``constant + prefix[m] <= budget``, where
``prefix[m]`` is what the first m blocks keep under the plan and the constant
depends on block m's own choice at most. So what the first i choices leave to
the rest of the plan is one number, ``prefix[i]``: of two partial plans with
the same or a smaller prefix, the slower one can never finish better. The
program walks the blocks in forward order and keeps, after each block, the
Pareto front of (prefix, added seconds) over the feasible partial plans; the
fastest complete plan is optimal for the model. The smallest feasible budget
comes from the same walk with the peak so far as the objective.

The front holds at most one state per distinct prefix, and identical blocks
make prefixes repeat, so it stays small in practice (a few thousand states
for 200 blocks of three choices). Past ``cap`` states it is thinned to one
state per ``1/cap`` of its byte range (the fastest of each), still feasible
but no longer provably optimal: :attr:`Solution.optimal` says which. The work
per block is a few tensor operations on the front.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["Option", "Solution", "peak_of", "solve"]


class Option(Protocol):
    """One way to run a block (``_profile.Choice`` is one)."""

    @property
    def kept(self) -> int: ...

    @property
    def seconds(self) -> float: ...

    @property
    def recompute(self) -> int | None: ...


@dataclass(frozen=True)
class Solution:
    """A plan as the program found it."""

    choices: tuple[int, ...]  # the index of each block's option
    peak: int  # predicted
    seconds: float  # predicted time added to a step
    optimal: bool  # False if the front was thinned (see the NOTE)


def peak_of(
    floors: Sequence[int | None], options: Sequence[Sequence[Option]], choices: Sequence[int]
) -> int:
    """The predicted peak of one plan (NOTE [ peak model ]).

    Example
    -------
    >>> from scopedckpt.planner._profile import Choice
    >>> none, full = Choice("none", 100, 0.0, None), Choice("full", 10, 1.0, 150)
    >>> peak_of([5, 20, 20], [[none, full], [none, full]], [0, 1])
    260
    """
    prefix = 0
    peak = floors[0] or 0
    for i, choice in enumerate(choices):
        option = options[i][choice]
        prefix += option.kept
        if option.recompute is not None:
            peak = max(peak, prefix + option.recompute)
        floor = floors[i + 1]
        if floor is not None:
            peak = max(peak, prefix + floor)
    return peak


def _front(prefix: torch.Tensor, value: torch.Tensor, cap: int) -> tuple[torch.Tensor, bool]:
    """Indices of the Pareto front of (prefix, value), both smaller-is-better, sorted by
    prefix; thinned past ``cap`` states (returns whether it was)."""
    order = torch.argsort(value, stable=True)
    order = order[torch.argsort(prefix[order], stable=True)]
    ordered = value[order]
    best_before = torch.cummin(ordered, dim=0).values
    keep = torch.ones_like(ordered, dtype=torch.bool)
    keep[1:] = ordered[1:] < best_before[:-1]
    kept = order[keep]
    if kept.numel() <= cap:
        return kept, False
    bytes_ = prefix[kept].double()
    low, high = bytes_[0], bytes_[-1]
    bucket = ((bytes_ - low) * (cap / max(float(high - low), 1.0))).long()
    last = torch.ones_like(bucket, dtype=torch.bool)
    last[:-1] = bucket[1:] != bucket[:-1]  # the fastest state of each bucket is its last
    return kept[last], True


def solve(
    floors: Sequence[int | None],
    options: Sequence[Sequence[Option]],
    budget: float,
    *,
    minimize: str = "seconds",
    cap: int = 4096,
) -> Solution | None:
    """The best plan whose predicted peak is at most ``budget``, or None if none is.

    Parameters
    ----------
    floors
        ``floor[m]`` for m = 0..n (None where no moment had m settled blocks).
    options
        Each block's options, in forward order; option 0 must be "no region".
    budget
        Bytes; ``float("inf")`` for none.
    minimize
        ``"seconds"``: the fastest plan; ``"peak"``: the plan with the smallest peak
        (the smallest feasible budget), the fastest among those.
    cap
        The most states kept after each block (see NOTE [ planning as a dynamic
        program ]).

    Example
    -------
    >>> from scopedckpt.planner._profile import Choice
    >>> none, full = Choice("none", 100, 0.0, None), Choice("full", 10, 1.0, 150)
    >>> solve([5, 20, 20], [[none, full], [none, full]], budget=200).choices
    (1, 0)
    >>> solve([5, 20, 20], [[none, full], [none, full]], budget=1000).choices
    (0, 0)
    """
    if minimize not in ("seconds", "peak"):
        raise ValueError(f"minimize must be 'seconds' or 'peak', got {minimize!r}")
    start = floors[0] or 0
    if start > budget:
        return None
    prefix = torch.zeros(1, dtype=torch.int64)
    seconds = torch.zeros(1, dtype=torch.float64)
    peak = torch.full((1,), start, dtype=torch.int64)
    parents: list[torch.Tensor] = []
    picks: list[torch.Tensor] = []
    thinned = False
    for i, block in enumerate(options):
        floor = floors[i + 1]
        grown_prefix: list[torch.Tensor] = []
        grown_seconds: list[torch.Tensor] = []
        grown_peak: list[torch.Tensor] = []
        parent: list[torch.Tensor] = []
        pick: list[torch.Tensor] = []
        states = torch.arange(prefix.numel())
        for c, option in enumerate(block):
            p = prefix + option.kept
            q = peak
            if option.recompute is not None:
                q = torch.maximum(q, p + option.recompute)
            if floor is not None:
                q = torch.maximum(q, p + floor)
            ok = q <= budget
            grown_prefix.append(p[ok])
            grown_seconds.append(seconds[ok] + option.seconds)
            grown_peak.append(q[ok])
            parent.append(states[ok])
            pick.append(torch.full((int(ok.sum()),), c, dtype=torch.int64))
        prefix, seconds, peak = (
            torch.cat(grown_prefix),
            torch.cat(grown_seconds),
            torch.cat(grown_peak),
        )
        if prefix.numel() == 0:
            return None
        objective = seconds if minimize == "seconds" else peak.double()
        kept, thin = _front(prefix, objective, cap)
        thinned |= thin
        prefix, seconds, peak = prefix[kept], seconds[kept], peak[kept]
        parents.append(torch.cat(parent)[kept])
        picks.append(torch.cat(pick)[kept])
    if minimize == "seconds":
        best = int(torch.argmin(seconds))
    else:
        lowest = peak == peak.min()
        best = int(torch.nonzero(lowest)[torch.argmin(seconds[lowest])])
    chosen = []
    state = best
    for parents_of, picks_of in zip(reversed(parents), reversed(picks)):
        chosen.append(int(picks_of[state]))
        state = int(parents_of[state])
    return Solution(
        tuple(reversed(chosen)), int(peak[best]), float(seconds[best]), optimal=not thinned
    )
