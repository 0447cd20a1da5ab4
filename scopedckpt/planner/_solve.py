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

import torch

__all__ = ["Choice", "Solution", "peak_of", "solve"]


@dataclass(frozen=True)
class Choice:
    """One way to run a block: what it keeps, what it costs, when its recompute peaks."""

    name: str  # "none", "full" or a key of _profile.PRESETS
    kept: int  # bytes kept from the block's forward to its backward
    seconds: float  # time added to a step
    # Bytes live at the recompute's peak besides what settled blocks keep (NOTE
    # [ peak model ]); None for no region.
    recompute: int | None


@dataclass(frozen=True)
class Solution:
    """A plan as the program found it."""

    choices: tuple[int, ...]  # the index of each block's option
    peak: int  # predicted
    seconds: float  # predicted time added to a step
    optimal: bool  # False if the front was thinned (see the NOTE)


def peak_of(
    floors: Sequence[int | None], options: Sequence[Sequence[Choice]], choices: Sequence[int]
) -> int:
    """The predicted peak of one plan (NOTE [ peak model ]).

    Example
    -------
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
    options: Sequence[Sequence[Choice]],
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
        (the smallest feasible budget).
    cap
        The most states kept after each block (see NOTE [ planning as a dynamic
        program ]).

    Example
    -------
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
        # Per option, the states it leaves feasible: prefix, seconds, peak, parent, pick.
        grown: list[tuple[torch.Tensor, ...]] = []
        states = torch.arange(prefix.numel())
        for c, option in enumerate(block):
            p = prefix + option.kept
            q = peak
            if option.recompute is not None:
                q = torch.maximum(q, p + option.recompute)
            if floor is not None:
                q = torch.maximum(q, p + floor)
            ok = q <= budget
            pick = torch.full((int(ok.sum()),), c, dtype=torch.int64)
            grown.append((p[ok], seconds[ok] + option.seconds, q[ok], states[ok], pick))
        prefix, seconds, peak, parent, pick = (torch.cat(parts) for parts in zip(*grown))
        if prefix.numel() == 0:
            return None
        objective = seconds if minimize == "seconds" else peak.double()
        kept, thin = _front(prefix, objective, cap)
        thinned |= thin
        prefix, seconds, peak = prefix[kept], seconds[kept], peak[kept]
        parents.append(parent[kept])
        picks.append(pick[kept])
    # The front's objective falls strictly along it (_front): its last state is the best.
    best = state = prefix.numel() - 1
    chosen = []
    for parents_of, picks_of in zip(reversed(parents), reversed(picks)):
        chosen.append(int(picks_of[state]))
        state = int(parents_of[state])
    return Solution(
        tuple(reversed(chosen)), int(peak[best]), float(seconds[best]), optimal=not thinned
    )
