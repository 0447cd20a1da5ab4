"""Choose one way to run each block, fastest under a peak budget: a dynamic program
over the bytes the blocks so far keep, exact for the peak model.

NOTE [ planning as a dynamic program ]
======================================
Under the peak model (NOTE [ peak model ] in ``_profile.py``) every constraint
a plan must meet has the form ``constant + prefix[m] <= budget``, where
``prefix[m]`` is what the first m blocks keep under the plan and the constant
depends on block m's own choice at most, but for the late floors (NOTE [ inputs
regions hold ] in ``_held.py``), which bind only plans with a region among the
first m blocks. So what the first i choices leave to the rest of the plan is one
number, ``prefix[i]``: of two partial plans with regions and the same or a
smaller prefix, the worse one can never finish better. The program walks the
blocks in forward order and keeps, after each block, the Pareto front of
(prefix, key) over the feasible partial plans with a region, and beside it the
one without (every block so far none), where a plan's key orders plans by their
cost (NOTE [ counted costs ] in ``_costs.py``), then by their number of regions
(fewer first), then by their choices in forward order: at the first block where
two differ, a region before none, and of two regions the earlier option (a
profile lists full, then the presets in the order of ``_profile.PRESETS``).
Costs and region counts add up and the last rule compares histories of equal
length, so every part of the key survives extending both plans the same way:
the best complete plan by the key is the program's, the same in every run. The
smallest feasible budget comes from the same walk with the peak so far as the
objective.

The front holds at most one state per distinct prefix, and identical blocks
make prefixes repeat, so it stays small in practice (a few thousand states
for 200 blocks of three choices). Past ``cap`` states it is thinned to one
state per ``1/cap`` of its byte range (the best of each), still feasible
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
    cost: int  # added to a step, in the units of NOTE [ counted costs ]
    # Bytes live at the recompute's peak besides what settled blocks keep (NOTE
    # [ peak model ]); None for no region.
    recompute: int | None


@dataclass(frozen=True)
class Solution:
    """A plan as the program found it."""

    choices: tuple[int, ...]  # the index of each block's option
    peak: int  # predicted
    cost: int  # predicted cost added to a step (NOTE [ counted costs ])
    optimal: bool  # False if the front was thinned (see the NOTE)


def peak_of(
    floors: Sequence[int | None],
    options: Sequence[Sequence[Choice]],
    choices: Sequence[int],
    late: Sequence[int | None] | None = None,
) -> int:
    """The predicted peak of one plan (NOTE [ peak model ]); ``late[m]`` applies where a
    region is among the first m blocks (NOTE [ inputs regions hold ]).

    Example
    -------
    >>> none, full = Choice("none", 100, 0, None), Choice("full", 10, 1, 150)
    >>> peak_of([5, 20, 20], [[none, full], [none, full]], [0, 1])
    260
    >>> peak_of([5, 20, 20], [[none, full], [none, full]], [1, 0], late=[None, 30, 60])
    170
    """
    prefix = 0
    peak = floors[0] or 0
    regions = False  # a region so far
    for i, choice in enumerate(choices):
        option = options[i][choice]
        prefix += option.kept
        if option.recompute is not None:
            regions = True
            peak = max(peak, prefix + option.recompute)
        for floor in (floors[i + 1], late[i + 1] if late and regions else None):
            if floor is not None:
                peak = max(peak, prefix + floor)
    return peak


def _order(*columns: torch.Tensor) -> torch.Tensor:
    """The row indices in lexicographic order of ``columns``, ties kept in row order:
    stable one-dimensional sorts by each column, last first (``unique(dim=0)``, which
    ranks rows in one call, took ten times as long on fronts of thousands of states)."""
    order = torch.argsort(columns[-1], stable=True)
    for column in reversed(columns[:-1]):
        order = order[torch.argsort(column[order], stable=True)]
    return order


def _lex(*columns: torch.Tensor) -> torch.Tensor:
    """Dense ranks of the rows of ``columns`` in lexicographic order, smallest first: a new
    rank wherever a row in :func:`_order` differs from the one before it.

    Example
    -------
    >>> _lex(torch.tensor([2, 1, 2, 1]), torch.tensor([0, 5, 0, 3])).tolist()
    [2, 1, 2, 0]
    """
    order = _order(*columns)
    new = torch.zeros(order.numel(), dtype=torch.bool)
    new[0] = True
    for column in columns:
        ordered = column[order]
        new[1:] |= ordered[1:] != ordered[:-1]
    ranks = torch.empty_like(order)
    ranks[order] = torch.cumsum(new, 0) - 1
    return ranks


def _front(prefix: torch.Tensor, key: torch.Tensor, cap: int) -> tuple[torch.Tensor, bool]:
    """Indices of the Pareto front of (prefix, key), both smaller-is-better, sorted by
    prefix; thinned past ``cap`` states (returns whether it was)."""
    order = _order(prefix, key)
    ordered = key[order]
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
    last[:-1] = bucket[1:] != bucket[:-1]  # the best state of each bucket is its last
    return kept[last], True


def solve(
    floors: Sequence[int | None],
    options: Sequence[Sequence[Choice]],
    budget: float,
    *,
    minimize: str = "cost",
    cap: int = 4096,
    late: Sequence[int | None] | None = None,
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
        ``"cost"``: the cheapest plan, ties broken by the rule of NOTE [ planning as
        a dynamic program ]; ``"peak"``: the plan with the smallest peak (the
        smallest feasible budget).
    cap
        The most states kept after each block (see NOTE [ planning as a dynamic
        program ]).
    late
        ``late[m]``, a floor that applies where a region is among the first m blocks
        (NOTE [ inputs regions hold ] in ``_held.py``); None: none.

    Example
    -------
    >>> none, full = Choice("none", 100, 0, None), Choice("full", 10, 1, 150)
    >>> solve([5, 20, 20], [[none, full], [none, full]], budget=200).choices
    (1, 0)
    >>> solve([5, 20, 20], [[none, full], [none, full]], budget=1000).choices
    (0, 0)
    """
    if minimize not in ("cost", "peak"):
        raise ValueError(f"minimize must be 'cost' or 'peak', got {minimize!r}")
    start = floors[0] or 0
    if start > budget:
        return None
    # One state per partial plan: prefix, cost, regions, peak, and its history's rank.
    state = [torch.zeros(1, dtype=torch.int64) for _ in range(5)]
    state[3] += start
    parents: list[torch.Tensor] = []
    picks: list[torch.Tensor] = []
    thinned = False
    for i, block in enumerate(options):
        floor = floors[i + 1]
        after = late[i + 1] if late else None
        prefix, cost, regions, peak, rank = state
        grown: list[tuple[torch.Tensor, ...]] = []  # per option, the states it leaves feasible
        states = torch.arange(prefix.numel())
        for c, option in enumerate(block):
            p = prefix + option.kept
            q = peak
            if option.recompute is not None:
                q = torch.maximum(q, p + option.recompute)
            if floor is not None:
                q = torch.maximum(q, p + floor)
            r = regions + (c > 0)
            if after is not None:
                q = torch.where(r > 0, torch.maximum(q, p + after), q)
            ok = q <= budget
            # The option's place at this block: a region before none, then option order.
            order = torch.full((int(ok.sum()),), c or len(block), dtype=torch.int64)
            added = (cost[ok] + option.cost, r[ok], q[ok], rank[ok], order)
            grown.append((p[ok], *added, states[ok]))
        prefix, cost, regions, peak, rank, order, parent = map(torch.cat, zip(*grown))
        if prefix.numel() == 0:
            return None
        pick = torch.where(order == len(block), 0, order)
        rank = _lex(rank, order)  # histories of equal length, in forward order
        key = _lex(cost, regions, rank) if minimize == "cost" else _lex(peak, rank)
        # The plan without a region yet (one state at most) is kept beside the front of
        # those with one: the late floors bind only these.
        ranged = (regions > 0).nonzero().flatten()
        front, thin = _front(prefix[ranged], key[ranged], cap)
        kept = torch.cat(((regions == 0).nonzero().flatten(), ranged[front]))
        thinned |= thin
        state = [t[kept] for t in (prefix, cost, regions, peak, rank)]
        keys = key[kept]
        parents.append(parent[kept])
        picks.append(pick[kept])
    best = at = int(torch.argmin(keys))  # keys are ranks, one per history
    chosen = []
    for parents_of, picks_of in zip(reversed(parents), reversed(picks)):
        chosen.append(int(picks_of[at]))
        at = int(parents_of[at])
    return Solution(
        tuple(reversed(chosen)), int(state[3][best]), int(state[1][best]), optimal=not thinned
    )
