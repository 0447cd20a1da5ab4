"""scopedckpt's per-region Python, timed inside real training steps and in a tight loop.

Run by ``python -m benchmarks.run`` (the breakdown section), or alone::

    python -m benchmarks.machinery

Why: ``timeit`` puts the buffer guard's global hook and the region set-up at a few
microseconds per region, while step-level comparisons (``breakdown.small_op_gap``)
put them at tens. This times the same functions both ways on the converted small-op
MLP:

* *in a step*: each function wrapped with ``time.perf_counter_ns`` while whole
  training steps run, summed and divided by the regions run (the wrapper's own
  cost, timed on an empty function, is subtracted per call);
* *in a loop*: the same functions with the same arguments called back to back
  (``timeit``), times the calls per region counted in the steps.

Their ratio is how much slower the same Python runs between a step's kernels
than in a loop that keeps it in the caches.

Under those functions a region runs a checkpoint: the eager one
(``_eager_checkpoint``, NOTE [ eager checkpoint ]) where it applies, torch's
elsewhere. :func:`engines` times a region step of each alone on a small block,
in a loop: their difference is what the eager one saves per region.
"""

from __future__ import annotations

import argparse
import functools
import math
import time
import timeit
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from . import models
from .internals import PIECES, RegionPieces, eager_checkpoint


@contextmanager
def _timed(
    pieces: dict[str, tuple[Any, str]], totals: Counter[str], calls: Counter[str]
) -> Iterator[None]:
    """Wrap every piece with a timer while the block runs."""
    originals = {name: getattr(owner, attr) for name, (owner, attr) in pieces.items()}

    def wrap(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return function(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter_ns() - start
                calls[name] += 1

        return timed

    for name, (owner, attr) in pieces.items():
        setattr(owner, attr, wrap(name, originals[name]))
    try:
        yield
    finally:
        for name, (owner, attr) in pieces.items():
            setattr(owner, attr, originals[name])


def _wrapper_ns() -> float:
    """The timing wrapper's own cost per call, on an empty function."""
    totals: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    box = type("Box", (), {"f": staticmethod(lambda: None)})
    with _timed({"empty": (box, "f")}, totals, calls):
        for _ in range(20000):
            box.f()
    return totals["empty"] / calls["empty"]


def _in_a_loop(number: int) -> dict[str, float]:
    """Microseconds per call of each piece, called back to back."""
    block = nn.Sequential(nn.Linear(256, 256), nn.GELU())
    x = torch.randn(128, 256, requires_grad=True)
    pieces = RegionPieces(block, x)

    def per_call(function: Callable[[], object]) -> float:
        return min(timeit.repeat(function, number=number, repeat=5)) / number * 1e6

    result = {"region set-up (region_context_fn)": per_call(pieces.set_up)}
    # An entry and an exit; split as measured in steps below.
    result["frame entry + exit"] = per_call(pieces.enter_and_exit)
    with pieces.in_frame():
        result["the buffer guard's hook (per module call)"] = per_call(pieces.hook(block[0]))
    return result


def engines(number: int) -> dict[str, float]:
    """Microseconds per region step (forward, then backward with its recompute) of the
    checkpoint under a region, torch's and the eager one, in a loop on one small block,
    with the keywords an eager region passes torch (no RNG stash, no context of its own)."""
    block = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    x = torch.randn(32, 64, requires_grad=True)

    def step(run: Callable[[], torch.Tensor]) -> Callable[[], None]:
        def once() -> None:
            run().sum().backward()

        return once

    variants = {
        "torch's checkpoint": step(
            lambda: torch_checkpoint.checkpoint(
                block, x, use_reentrant=False, preserve_rng_state=False
            )
        ),
        "the eager checkpoint": step(lambda: eager_checkpoint(block, x)),
    }
    timed = {name: math.inf for name in variants}
    for _ in range(5):  # interleaved: both see the same machine state
        for name, function in variants.items():
            seconds = min(timeit.repeat(function, number=number, repeat=3)) / number
            timed[name] = min(timed[name], seconds)
    result = {f"{name}, region step in a loop, us": t * 1e6 for name, t in timed.items()}
    result["torch's - the eager checkpoint, us per region"] = (
        timed["torch's checkpoint"] - timed["the eager checkpoint"]
    ) * 1e6
    return result


def machinery(depth: int = 8, steps: int = 100) -> dict[str, float]:
    """Microseconds per region of each piece in steps of the converted small-op MLP,
    and in a loop, and their ratio."""
    model, x = models.build("small_mlp", depth, "c")
    for _ in range(5):
        models.step(model, x)
    totals: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    with _timed(PIECES, totals, calls):
        for _ in range(steps):
            models.step(model, x)
    overhead = _wrapper_ns()
    regions = calls["region set-up (region_context_fn)"]
    in_step = {name: (totals[name] - overhead * calls[name]) / regions / 1e3 for name in PIECES}
    loop = _in_a_loop(2000)
    hook_calls = calls["the buffer guard's hook (per module call)"] / regions
    entries = calls["frame entries (forward, recompute)"] / regions
    in_loop = {
        "region set-up (region_context_fn)": loop["region set-up (region_context_fn)"],
        "frame entries and exits": loop["frame entry + exit"] * entries,
        "the buffer guard's hook": loop["the buffer guard's hook (per module call)"] * hook_calls,
    }
    in_step_grouped = {
        "region set-up (region_context_fn)": in_step["region set-up (region_context_fn)"],
        "frame entries and exits": in_step["frame entries (forward, recompute)"]
        + in_step["frame exits (forward, recompute)"],
        "the buffer guard's hook": in_step["the buffer guard's hook (per module call)"],
    }
    result: dict[str, float] = {"module calls hooked per region": hook_calls}
    for name in in_loop:
        result[f"{name}, in a step, us per region"] = in_step_grouped[name]
        result[f"{name}, in a loop, us per region"] = in_loop[name]
    total_step, total_loop = sum(in_step_grouped.values()), sum(in_loop.values())
    result["all three, in a step, us per region"] = total_step
    result["all three, in a loop, us per region"] = total_loop
    result["in a step / in a loop"] = total_step / total_loop
    result.update(engines(500))
    return result


def main() -> None:
    """``python -m benchmarks.machinery [--quick]``: print :func:`machinery`, two threads."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 steps instead of 100")
    args = parser.parse_args()
    torch.set_num_threads(2)
    for key, value in machinery(steps=10 if args.quick else 100).items():
        print(f"  {key:<60}{value:>10.2f}")


if __name__ == "__main__":
    main()
