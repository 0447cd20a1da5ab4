"""What regions hold of their inputs beyond plain training: the bytes the peak model (NOTE
[ peak model ] in ``_profile.py``) adds where a region keeps alive an input that the step
without regions had freed.

NOTE [ inputs regions hold ]
============================
A region holds its inputs until its backward ends, where plain training may free
them at once: torch's attention saves a transposed copy of its input, not the
input, and GPT-2's attention mask lives only until the model's forward returns
(without this, plans of the benchmark transformer and GPT-2 peaked up to 1 % above
their predictions). The step without regions notes each block's inputs, and which
of them are dead when the forward ends. Of those:

* one the block before made (its output, ``handed``): the region keeps it, and it
  is taken out of what the block before keeps as a region (measured in the step
  where every block is a region, it counted there, held by this one), and out of
  what the rest of the step holds at that region's recompute (dead by then): so a
  block without a region after one does not keep it, and while the block after a
  region runs it is counted once, as its input;
* one made outside the blocks, or earlier, and taken by this block alone: its
  region keeps it;
* one made outside the blocks and taken by several (a mask): it lives until the
  backward of the first region holding it, so where any region is among the first
  m blocks it is charged to every moment with m settled blocks after its last use
  without regions (``late[m]``: too much where that region does not take it, never
  too little).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ._live import OUTSIDE

__all__ = ["Held", "held_inputs", "late_floors"]


@dataclass
class Held:
    """Bytes regions hold of their inputs, by block position (NOTE [ inputs regions hold ])."""

    alone: dict[int, int] = field(default_factory=dict)  # by a region there, always
    handed: dict[int, int] = field(default_factory=dict)  # made by the block before
    # (bytes, m at its last use without regions) of each input several blocks share
    shared: list[tuple[int, int]] = field(default_factory=list)


def held_inputs(
    inputs: dict[int, dict[int, tuple[int, int]]],
    alive: set[int],
    freed_at: dict[int, int],
    blocks: int,
) -> Held:
    """Sort the inputs (by position, serial: bytes, creator's tag) that were dead when the
    forward without regions ended (not ``alive``) by who holds them under a plan.

    Example
    -------
    >>> held = held_inputs({0: {7: (64, -1)}, 1: {8: (32, 0), 7: (64, -1)}}, set(), {7: 2}, 2)
    >>> held.handed, held.alone, held.shared
    ({1: 32}, {}, [(64, 2)])
    """
    takers: dict[int, list[int]] = {}
    sizes: dict[int, tuple[int, int]] = {}
    for k, taken in inputs.items():
        for serial, (nbytes, tag) in taken.items():
            if serial not in alive:
                takers.setdefault(serial, []).append(k)
                sizes[serial] = (nbytes, tag)
    held = Held()
    for serial, positions in takers.items():
        nbytes, tag = sizes[serial]
        if tag == OUTSIDE and len(positions) > 1:
            held.shared.append((nbytes, freed_at.get(serial, blocks)))
            continue
        for k in positions:
            into = held.handed if k > 0 and tag == k - 1 else held.alone
            into[k] = into.get(k, 0) + nbytes
    return held


def late_floors(
    settled: list[int],
    forward_segments: dict[int, int],
    backward_segments: dict[int, int],
    shared: list[tuple[int, int]],
) -> tuple[int | None, ...]:
    """``late[m]``: the most bytes live besides what the first m blocks keep, at the moments
    with m settled blocks, with the shared inputs a region holds where plain training has
    freed them; None where it charges nothing.

    Example
    -------
    >>> late_floors([0, 100], {0: 10, 1: 150}, {1: 120}, [(5, 1)])
    (None, 55)
    """
    everything = sum(nbytes for nbytes, _ in shared)
    late: list[int | None] = []
    for m, below in enumerate(settled):
        charged = [
            (backward_segments.get(m), everything),
            (forward_segments.get(m), sum(b for b, freed in shared if freed <= m)),
        ]
        values = [live + charge for live, charge in charged if live is not None and charge]
        late.append(max(values) - below if values else None)
    return tuple(late)
