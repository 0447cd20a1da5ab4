"""The example and the cost of ``scopedckpt.peak_report()`` in docs/memory.md ("Where did my
memory go").

Run as ``python -m benchmarks.peak [--rounds N] [--html PATH]``. It prints the report of one
training step of the page's model (four converted ``nn.TransformerEncoderLayer`` regions
between two linear layers, AdamW, batch 8 x 128 tokens, 2 threads), taken after a first
step (whose every region is verified bit for bit, and whose optimizer state is new), then
the step time plainly, under ``measure_peak`` and under ``peak_report``: the median of
``--rounds`` interleaved rounds, each round one step of each in turn, on that model and on
a small one whose ops are cheap, where the per-op cost shows most (8 converted blocks of
Linear(256, 256), BatchNorm1d, GELU, Dropout, each a region; batch 512). Nothing is
written unless ``--html`` names the page ``report.save_html`` writes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import scopedckpt
from benchmarks import THREADS


def model_and_step() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """The page's model, its optimizer, and one training step of it."""
    torch.manual_seed(0)
    layers = [nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True) for _ in range(4)]
    model = scopedckpt.convert(
        nn.Sequential(nn.Linear(256, 512), nn.Sequential(*layers), nn.Linear(512, 10))
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(8, 128, 256)

    def step() -> None:
        with scopedckpt.checkpointing(*model[1]):  # each encoder layer is a region
            loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, optimizer, step


def small_model_and_step() -> tuple[nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """The small model of cheap ops, its optimizer, and one training step of it."""
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Linear(256, 256), nn.BatchNorm1d(256), nn.GELU(), nn.Dropout(0.1))
        for _ in range(8)
    ]
    model = scopedckpt.convert(nn.Sequential(*blocks))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(512, 256)

    def step() -> None:
        with scopedckpt.checkpointing(*model):
            loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, optimizer, step


def overhead(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[], None], rounds: int
) -> None:
    """Print the median step time plainly, under measure_peak and under peak_report."""
    runs: dict[str, Callable[[], object]] = {
        "plain step": step,
        "measure_peak(step)": lambda: scopedckpt.measure_peak(step),
        "peak_report(step)": lambda: scopedckpt.peak_report(step, root=model, optimizer=optimizer),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            began = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - began)
    medians = {name: statistics.median(seconds) for name, seconds in times.items()}
    for name, seconds in medians.items():
        ratio = seconds / medians["measure_peak(step)"]
        print(f"  {name:<20} {seconds * 1e3:8.1f} ms  {ratio:.2f}x measure_peak")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--html", help="write report.save_html(...) here")
    options = parser.parse_args()
    torch.set_num_threads(THREADS)
    model, optimizer, step = model_and_step()
    step()  # the first step: every region verified, the optimizer's state made
    report = scopedckpt.peak_report(step, root=model, optimizer=optimizer)
    print(report)
    if options.html:
        report.save_html(options.html)
    print(f"\nmedian of {options.rounds} interleaved rounds, torch {torch.__version__}:")
    overhead(model, optimizer, step, options.rounds)
    small, small_optimizer, small_step = small_model_and_step()
    small_step()
    print("the small model of cheap ops:")
    overhead(small, small_optimizer, small_step, options.rounds)


if __name__ == "__main__":
    main()
