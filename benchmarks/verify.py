"""What checking recomputes costs: bitwise verification and the light check, in step time
and memory, side by side.

Run from the repository root (writes ``benchmarks/results/verify.json``)::

    python -m benchmarks.verify [--quick]

Each model of :mod:`benchmarks.models` at ``DEPTH`` blocks, converted
(``scopedckpt.convert``), every block a region of
``with scopedckpt.checkpointing(model.blocks, determinism_check=...):``, in three
variants on three instances built from the same seed: ``"default"`` (torch's shape
check and the light check, NOTE [ light check ] in ``scopedckpt/core/_light.py``: one saved
tensor per call fingerprinted in the first forward and in the recompute),
``"unlit"`` (the same without the light check: its sites are told they have no tail)
and ``"bitwise"`` (NOTE [ bitwise verification ] in ``scopedckpt/mechanisms/_verify.py``: every
saved tensor fingerprinted in the first forward and compared after each recompute).
One process, one torch thread; rounds interleaved in rotating order; each ratio is the
median of per-round paired ratios with a distribution-free 95 % interval
(:func:`benchmarks.timing.paired`). Memory: the peak of the planner's live-bytes
counter (NOTE [ live bytes ] in ``scopedckpt/planner/_live.py``) over a step, gradients made
anew, for ``"default"`` and ``"bitwise"`` (under the counter's dispatch mode regions
take torch's checkpoint, which verification serves as well); and the peak heap in use
during a step (glibc ``mallinfo2`` sampled after every aten op,
:func:`benchmarks.heap.peak_in_use`, the most of three steps per variant). Sampled
verification (NOTE [ sampled verification ]) is off in this process, so ``"default"``
verifies nothing.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch

import scopedckpt

from . import heap, models
from .internals import LiveBytes, light_check_off
from .timing import interleaved_rounds, paired, print_paired, save_paired_results

DEPTH = 8
THREADS = 1
ROUNDS = 60
QUICK_ROUNDS = 4
MODELS = ("small_mlp", "mlp", "transformer", "cnn")
VARIANTS = ("default", "unlit", "bitwise")


def _step(model: models.Blocks, x: torch.Tensor, check: str) -> Callable[[], None]:
    def step() -> None:
        with scopedckpt.checkpointing(model.blocks, determinism_check=check):
            loss = model(x).square().mean()
        loss.backward()
        for p in model.parameters():
            p.grad = None

    return step


def _live_peak(step: Callable[[], None]) -> int:
    """The peak of the planner's live-bytes counter over one step."""
    with LiveBytes() as counter:
        step()
    return counter.peak


def measure(kind: str, rounds: int) -> dict[str, Any]:
    """One model's row: median step times, the paired ratios bitwise/default and
    default/unlit, and peaks."""
    steps = {}
    for variant in VARIANTS:
        model, x = models.build(kind, DEPTH, "d")  # converted, checkpointed by the scope
        if variant == "unlit":
            light_check_off(model.blocks)
        steps[variant] = _step(model, x, "default" if variant == "unlit" else variant)
    times = interleaved_rounds(steps, 1, rounds)
    median, low, high = paired(times, "bitwise", "default")
    light, light_low, light_high = paired(times, "default", "unlit")
    peaks = {v: max(heap.peak_in_use(step) for _ in range(3)) / 2**20 for v, step in steps.items()}
    live = {v: max(_live_peak(steps[v]) for _ in range(2)) / 2**20 for v in ("default", "bitwise")}
    return {
        "model": kind,
        "blocks": DEPTH,
        "rounds": rounds,
        "median_ms": {v: statistics.median(t) * 1e3 for v, t in times.items()},
        "bitwise/default": median,
        "bitwise/default 95% interval": [low, high],
        "default/unlit": light,
        "default/unlit 95% interval": [light_low, light_high],
        "peak_heap_mib": peaks,
        "peak_live_mib": live,
    }


def main(quick: bool) -> dict[str, object]:
    """Every model's row, printed; written to ``results/verify.json``."""
    torch.set_num_threads(THREADS)
    scopedckpt.set_verification_sampling(0)  # "default": torch's check alone
    rounds = QUICK_ROUNDS if quick else ROUNDS
    rows = [measure(kind, rounds) for kind in MODELS]
    print_paired(rows, "model", "default", "bitwise/default")
    print_paired(rows, "model", "unlit", "default/unlit")
    return save_paired_results("verify", rows, THREADS, quick)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds per model, a few seconds"
    )
    main(parser.parse_args().quick)
