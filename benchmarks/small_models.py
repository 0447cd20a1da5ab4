"""The region path's cost on small models: scopedckpt against torch's checkpoint and plain training.

Run from the repository root (writes ``benchmarks/results/small_models.json``)::

    python -m benchmarks.small_models [--quick]

Two models of small ops, where per-region Python is a visible share of a step, each
at ``DEPTH`` blocks and one region per block (:mod:`benchmarks.models`): the small-op
MLP (``small_mlp``) and a small CNN (``small_cnn``). Three variants of each, every one
on its own instance built from the same seed:

* ``plain``: torch's layers, no checkpointing, no scopedckpt code;
* ``torch``: torch's layers (``nn.Dropout``, ``nn.BatchNorm1d``/``2d``, ``nn.Dropout2d``),
  each block run as ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``;
* ``scopedckpt``: the model after ``scopedckpt.convert``, each block a region through
  the scope's targets: ``with scopedckpt.checkpointing(model.blocks):`` around the
  forward, ``loss.backward()`` after it.

One process, ``torch.set_num_threads(1)``. After a warm-up, every round times one step
of each variant, in an order that rotates from round to round
(:func:`benchmarks.timing.interleaved_rounds`); each ratio is the median of the
per-round paired ratios with a distribution-free 95 % interval from order statistics
(:func:`benchmarks.timing.paired`).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch

import scopedckpt

from . import models
from .internals import saved_activation_bytes
from .timing import interleaved_rounds, paired, save_paired_results

DEPTH = 8
THREADS = 1
ROUNDS = 800  # per model: a full run takes about three minutes on two cores
QUICK_ROUNDS = 20
MODELS = {
    "small_mlp": "Linear(256)-BatchNorm1d-GELU-Dropout-Linear blocks, batch 128",
    "small_cnn": (
        "Conv-BatchNorm2d-ReLU-Dropout2d-Conv-BatchNorm2d residual blocks, 16 channels, "
        "batch 8 of 16 x 16 images"
    ),
}
VARIANTS = ("plain", "torch", "scopedckpt")
RATIOS = (("scopedckpt", "torch"), ("scopedckpt", "plain"), ("torch", "plain"))


def _saved(model: models.Blocks, x: torch.Tensor, variant: str) -> int:
    """Bytes the variant's forward keeps for backward (parameters excluded)."""

    def forward() -> torch.Tensor:
        with scopedckpt.checkpointing(model.blocks, enabled=variant == "scopedckpt"):
            return model(x)

    return saved_activation_bytes(forward, exclude=model.parameters())


def variants(kind: str, depth: int) -> dict[str, tuple[Callable[[], None], int]]:
    """Each variant's step on its own instance of ``kind``, with the bytes it saves."""
    built = {
        "plain": models.build(kind, depth, "a"),
        "torch": models.build(kind, depth, "b"),
        "scopedckpt": models.build(kind, depth, "d"),  # converted; regions by target
    }
    steps: dict[str, Callable[[], None]] = {
        "plain": lambda: models.plain_step(*built["plain"]),
        "torch": lambda: models.plain_step(*built["torch"]),
        "scopedckpt": lambda: models.region_step(*built["scopedckpt"]),
    }
    return {v: (steps[v], _saved(*built[v], v)) for v in VARIANTS}


def measure(kind: str, rounds: int) -> dict[str, Any]:
    """One model's row: median step times, saved bytes and paired ratios."""
    prepared = variants(kind, DEPTH)
    times = interleaved_rounds({v: step for v, (step, _) in prepared.items()}, 1, rounds)
    row: dict[str, Any] = {
        "model": kind,
        "description": MODELS[kind],
        "blocks": DEPTH,
        "rounds": rounds,
        "median_ms": {v: statistics.median(t) * 1e3 for v, t in times.items()},
        "saved_bytes": {v: saved for v, (_, saved) in prepared.items()},
    }
    for numerator, denominator in RATIOS:
        median, low, high = paired(times, numerator, denominator)
        row[f"{numerator}/{denominator}"] = median
        row[f"{numerator}/{denominator} 95% interval"] = [low, high]
    return row


def main(quick: bool) -> dict[str, object]:
    """Every model's row, printed; written to ``results/small_models.json``."""
    torch.set_num_threads(THREADS)
    rounds = QUICK_ROUNDS if quick else ROUNDS
    rows = [measure(kind, rounds) for kind in MODELS]
    print(f"\n{'model':<11}{'rounds':>7}" + "".join(f"{f'{n}/{d}':>22}" for n, d in RATIOS))
    for row in rows:
        cells = []
        for n, d in RATIOS:
            low, high = row[f"{n}/{d} 95% interval"]
            cells.append(f"{row[f'{n}/{d}']:.3f} ({low:.3f}-{high:.3f})")
        print(f"{row['model']:<11}{row['rounds']:>7}" + "".join(f"{c:>22}" for c in cells))
    return save_paired_results("small_models", rows, THREADS, quick)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds per model, a few seconds"
    )
    main(parser.parse_args().quick)
