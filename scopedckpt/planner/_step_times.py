"""What a region costs a step besides its recompute, timed on a small region while
planning; and the cost per op of the dispatch modes involved.

NOTE [ timing regions ]
=======================
A block's recompute is not its forward again: it runs inside backward, on
freshly allocated memory, under torch's checkpoint frame, and on the CPUs
measured it cost up to twice the block's plain forward. So the planner times
recomputes themselves, in its second counted step, where every candidate
block is a full region inside :func:`scopedckpt.memory_report` (which times
each recompute frame) with sampled verification suspended, so that planning
verifies nothing in the user's place. The counting mode's cost per op is then
taken out of each recompute's time and of the step's. What a region costs
outside its recompute (setting it up, its saved-tensor hooks), what selective
saving's dispatch mode costs per op and what the counting mode costs per op
are timed on a small region of 8 ops (:func:`region_costs`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from .. import policies
from ..core._checkpoint import checkpoint
from ..core._sampling import suspended
from ..core._scope import checkpointing
from ._live import LiveBytes

__all__ = ["region_costs", "synchronize"]


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA), so that wall time measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_BODY_OPS = 8


def _body(t: torch.Tensor) -> torch.Tensor:
    for _ in range(_BODY_OPS):
        t = t * 1.0
    return t


def region_costs(device: torch.device, rounds: int = 5) -> tuple[float, float, float]:
    """Seconds a region adds to a step besides its recompute, seconds selective saving
    adds per op (both passes), and seconds the counting mode adds per op; timed on a
    small region on ``device``."""
    x = torch.ones(64, device=device, requires_grad=True)

    def forward() -> None:
        _body(x)

    def counted() -> None:
        with LiveBytes(lambda *_: None):
            _body(x)

    def plain() -> None:
        _body(x).sum().backward()

    def region(save: Any = None) -> None:
        with checkpointing(save=save):
            y = checkpoint(_body, x)
        y.sum().backward()

    variants = (forward, plain, region, lambda: region(policies.save_matmuls), counted)
    times: list[list[float]] = [[] for _ in variants]
    with suspended():
        for r in range(rounds + 1):
            for j, variant in enumerate(variants):
                synchronize(device)
                start = time.perf_counter()
                variant()
                synchronize(device)
                if r >= 1:  # after a warm-up round
                    times[j].append(time.perf_counter() - start)
    forward_s, plain_s, region_s, selective_s, counted_s = (statistics.median(t) for t in times)
    # A region adds one forward of its body (the recompute) and its own cost.
    overhead = max(region_s - plain_s - forward_s, 0.0)
    per_op = max((selective_s - region_s) / _BODY_OPS, 0.0)
    return overhead, per_op, max((counted_s - forward_s) / _BODY_OPS, 0.0)
