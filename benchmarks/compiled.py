"""The compiled section of the benchmark: eager configurations under ``torch.compile``.

Run as ``python -m benchmarks.compiled [--quick]`` (or ``python -m benchmarks.run
--compiled``); writes ``benchmarks/results/compiled.json``.

Configurations, each model wrapped in ``torch.compile`` (inductor, CPU):
  (a) plain torch layers, no checkpointing
  (b) torch.utils.checkpoint(use_reentrant=False) around each block
  (c) scopedckpt: converted model, ``with checkpointing(model.blocks):`` around the call
  (d) converted model, no checkpointing (the reference (c) must equal bitwise)
For each: median ms per step (interleaved repeats in one process, as the eager
section does), (c)/(b), dynamo's unique graphs and graph breaks over five steps with
a new seed each (more graphs than one would be recompiles), batch-norm updates per
step, and whether (b) equals (a) and (c) equals (d) bitwise over those five steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch._dynamo.utils import counters

import scopedckpt

from . import RESULTS, THREADS, models

CONFIGS = ("a", "b", "c", "d")
NAMES = {
    "a": "compiled, no checkpoint",
    "b": "compiled torch checkpoint",
    "c": "compiled scopedckpt",
    "d": "compiled scoped layers, no ckpt",
}


def _build(
    factory: Callable[[], tuple[nn.Module, torch.Tensor]], config: str
) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model, x = factory()
    if config in ("c", "d"):
        model = scopedckpt.convert(model)
    model.mode = "b" if config == "b" else "a"  # (c) selects blocks by scope, not by mode
    return model, x


def _step(compiled: Callable[..., torch.Tensor], model: nn.Module, x: torch.Tensor, config: str):
    with scopedckpt.checkpointing(model.blocks, enabled=config == "c"):
        loss = compiled(x).square().mean()
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return loss.detach(), grads


def _bn_updates(model: nn.Module) -> int:
    counts = [
        int(m.num_batches_tracked) for m in model.modules() if hasattr(m, "num_batches_tracked")
    ]
    return counts[0] if counts else 0


def _five_steps(factory: Callable[[], tuple[nn.Module, torch.Tensor]], config: str):
    """Graphs, breaks, BN updates per step and everything produced, from a fresh dynamo."""
    torch._dynamo.reset()
    counters.clear()
    model, x = _build(factory, config)
    compiled = torch.compile(model)
    produced: list[torch.Tensor] = []
    for seed in range(5):
        torch.manual_seed(seed)
        loss, grads = _step(compiled, model, x, config)
        produced += [loss, *grads]
    produced += [b.clone() for b in model.buffers()]
    return {
        "graphs": counters["stats"]["unique_graphs"],
        "breaks": sum(counters["graph_break"].values()),
        "bn_per_step": _bn_updates(model) / 5,
    }, produced


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def measure(name: str, factory: Callable[[], tuple[nn.Module, torch.Tensor]], repeats: int) -> dict:
    counts, produced = {}, {}
    for config in CONFIGS:
        counts[config], produced[config] = _five_steps(factory, config)
    torch._dynamo.reset()
    runs = {}
    for config in CONFIGS:
        model, x = _build(factory, config)
        runs[config] = (torch.compile(model), model, x)
        for _ in range(3):  # compile and warm up
            _step(*runs[config], config)
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for r in range(repeats):
        shift = r % len(CONFIGS)
        for config in CONFIGS[shift:] + CONFIGS[:shift]:
            start = time.perf_counter()
            _step(*runs[config], config)
            times[config].append(time.perf_counter() - start)
    median = {c: statistics.median(t) for c, t in times.items()}
    return {
        "model": name,
        "median_ms": {c: v * 1e3 for c, v in median.items()},
        "c/b": median["c"] / median["b"],
        "counts": counts,
        "b == a": _equal(produced["b"], produced["a"]),
        "c == d": _equal(produced["c"], produced["d"]),
    }


def run(
    factories: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]], repeats: int
) -> list[dict]:
    rows = [measure(name, factory, repeats) for name, factory in factories.items()]
    print(
        f"\ncompiled (inductor), ms per step, median of {repeats} interleaved repeats; graphs and "
        "breaks over 5 steps with new seeds:"
    )
    print(
        f"{'model':<14}" + "".join(f"{c:>8}" for c in CONFIGS) + f"{'(c)/(b)':>9}"
        f"{'graphs b/c':>12}{'breaks c':>10}{'BN/step b,c':>13}{'b==a':>6}{'c==d':>6}"
    )
    for r in rows:
        counts = r["counts"]
        print(
            f"{r['model']:<14}"
            + "".join(f"{r['median_ms'][c]:>8.2f}" for c in CONFIGS)
            + f"{r['c/b']:>9.3f}"
            + f"{counts['b']['graphs']:>7}/{counts['c']['graphs']:<4}"
            + f"{counts['c']['breaks']:>10}"
            + f"{counts['b']['bn_per_step']:>8.0f},{counts['c']['bn_per_step']:<4.0f}"
            + f"{r['b == a']!s:>6}{r['c == d']!s:>6}"
        )
    return rows


def main(quick: bool) -> None:
    """Every model compiled in each configuration; writes ``results/compiled.json``."""
    depth = 4 if quick else 8
    factories = {
        # The compile issue's model: Linear(256)-BatchNorm1d-GELU-Dropout-Linear blocks.
        "issue mlp x4": lambda: models.small_mlp(4),
        f"mlp x{depth}": lambda: models.mlp(depth),
        f"transformer x{depth}": lambda: models.transformer(depth),
        f"cnn x{depth}": lambda: models.cnn(depth),
    }
    rows = run(factories, repeats=5 if quick else 21)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "compiled.json").write_text(
        json.dumps({"rows": rows, "quick": quick, "torch": torch.__version__}, indent=2)
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 blocks, 5 repeats")
    torch.set_num_threads(THREADS)
    main(parser.parse_args().quick)
