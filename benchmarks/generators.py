"""What watching regions whose code names generators costs: step time with and without.

Run from the repository root (writes ``benchmarks/results/generators.json``)::

    python -m benchmarks.generators [--quick]

A region whose code names a generator (``generator=``, a ``generator`` parameter or
attribute, ``torch.Generator``) has every first forward run under a
``TorchFunctionMode`` that stashes explicit generators at their first use (NOTE
[ watched code ] in ``scopedckpt/_generators.py``). Two blocks compute the same thing
(``Linear``, noise from an explicit generator, ``tanh``, ``Linear``): ``"named"``
passes it as ``torch.randn(..., generator=self.stream)``, so its first forwards are
watched; ``"unnamed"`` passes it as ``**self.draw`` (a dict holding it), which the
watch does not see and the region stashes from the dict anyway (NOTE [ generator
places ]). Both are exact; the difference is the watch. ``DEPTH`` blocks, each a region
of ``with scopedckpt.checkpointing(*blocks):``, at two widths (the small one is a step of
small ops, where a Python call per op weighs most). One process, one torch thread,
sampled verification off (so neither is verified); rounds interleaved in rotating
order; the ratio is the median of per-round paired ratios with a distribution-free
95 % interval (:func:`benchmarks.timing.paired`).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import scopedckpt

from .timing import interleaved_rounds, paired, print_paired, save_paired_results

DEPTH = 8
THREADS = 1
ROUNDS = 60
QUICK_ROUNDS = 4
# (name, width, batch)
SHAPES = (("small", 64, 16), ("wide", 1024, 64))
VARIANTS = ("unnamed", "named")


class Named(nn.Module):
    """Noise from ``stream``, passed as ``generator=``: its code names a generator."""

    def __init__(self, width: int, stream: torch.Generator) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.stream = stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b((h + torch.randn(h.shape, generator=self.stream)).tanh())


class Unnamed(nn.Module):
    """The same, the generator passed in a dict of keywords: its code names none."""

    def __init__(self, width: int, stream: torch.Generator) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.draw = {"generator": stream}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b((h + torch.randn(h.shape, **self.draw)).tanh())


def _step(variant: str, width: int, batch: int) -> Callable[[], None]:
    torch.manual_seed(0)
    kind = Named if variant == "named" else Unnamed
    blocks = [kind(width, torch.Generator().manual_seed(i)) for i in range(DEPTH)]
    model = nn.Sequential(*blocks)
    x = torch.randn(batch, width)

    def step() -> None:
        with scopedckpt.checkpointing(*blocks):
            loss = model(x).square().mean()
        loss.backward()
        for p in model.parameters():
            p.grad = None

    return step


def measure(shape: str, width: int, batch: int, rounds: int) -> dict[str, Any]:
    """One shape's row: median step times and the paired ratio named/unnamed."""
    steps = {variant: _step(variant, width, batch) for variant in VARIANTS}
    times = interleaved_rounds(steps, 1, rounds)
    median, low, high = paired(times, "named", "unnamed")
    return {
        "shape": shape,
        "width": width,
        "batch": batch,
        "blocks": DEPTH,
        "rounds": rounds,
        "median_ms": {v: statistics.median(t) * 1e3 for v, t in times.items()},
        "named/unnamed": median,
        "named/unnamed 95% interval": [low, high],
    }


def main(quick: bool) -> dict[str, object]:
    """Every shape's row, printed; written to ``results/generators.json``."""
    torch.set_num_threads(THREADS)
    scopedckpt.set_verification_sampling(0)
    rounds = QUICK_ROUNDS if quick else ROUNDS
    rows = [measure(*shape, rounds) for shape in SHAPES]
    print_paired(rows, "shape", "unnamed", "named/unnamed")
    return save_paired_results("generators", rows, THREADS, quick)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds per shape, a few seconds"
    )
    main(parser.parse_args().quick)
