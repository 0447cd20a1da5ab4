"""Timing in one process: variants interleaved in rotating rounds, and paired ratios.

Every variant is timed once per round, in an order that rotates from round to round,
so that machine noise hits every variant alike and no variant always follows the same
one (a step after a big one meets a different allocator and cache state). Ratios
between two variants are *paired*: the median over rounds of the two variants' times
in the same round, because the machine's speed drifts from round to round by more than
the few percent between variants, and both times of a round see the same drift.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import RESULTS

INTERVAL_METHOD = (
    "distribution-free 95 % interval of the median: the order statistics of the sorted "
    "per-round ratios that a Binomial(n, 1/2) puts at most 2.5 % below and above it"
)


def interleaved_rounds(
    variants: dict[str, Callable[[], object]], calls: int, rounds: int
) -> dict[str, list[float]]:
    """Seconds per call of each variant in every round, after a warm-up, timed in
    rotating order.

    Parameters
    ----------
    variants
        Name to a function running one call of that variant.
    calls
        Calls per variant per round (the round's time is divided by it).
    rounds
        How many rounds.

    Returns
    -------
    dict
        Name to its seconds per call, one value per round.
    """
    names = list(variants)
    for name in names:  # warm-up
        for _ in range(max(1, calls // 4)):
            variants[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            for _ in range(calls):
                variants[name]()
            times[name].append((time.perf_counter() - start) / calls)
    return times


def interleaved(
    variants: dict[str, Callable[[], object]], calls: int, rounds: int
) -> dict[str, float]:
    """Median seconds per call of each variant (:func:`interleaved_rounds`)."""
    times = interleaved_rounds(variants, calls, rounds)
    return {name: statistics.median(values) for name, values in times.items()}


def paired(
    times: dict[str, list[float]], numerator: str, denominator: str
) -> tuple[float, float, float]:
    """The median over rounds of ``numerator / denominator`` within each round, and its
    95 % confidence interval (``INTERVAL_METHOD``).

    The interval is distribution-free: for 15 rounds the 4th and 12th of the 15 sorted
    ratios, for 120 the 49th and 72nd.

    Returns
    -------
    tuple
        The median, the interval's low end and its high end.

    Example
    -------
    >>> paired({"x": [2.0, 4.0, 6.0], "y": [1.0, 2.0, 2.0]}, "x", "y")
    (2.0, 2.0, 3.0)
    """
    ratios = sorted(a / b for a, b in zip(times[numerator], times[denominator]))
    n = len(ratios)
    # The lower end is the (k+1)-th ratio for the largest k with P(X <= k) <= 2.5 %.
    below, cumulative = 0, 0.0
    for k in range(n):
        cumulative += math.comb(n, k) / 2**n
        if cumulative > 0.025:
            below = max(k - 1, 0)
            break
    return statistics.median(ratios), ratios[below], ratios[n - 1 - below]


def save_paired_results(
    name: str,
    rows: list[dict[str, Any]],
    threads: int,
    quick: bool,
    extra: dict[str, Any] | None = None,
    directory: Path = RESULTS,
) -> dict[str, object]:
    """Write ``<directory>/<name>.json`` (``results/`` by default) for a section of paired
    ratios: its rows, ``extra``'s keys, the torch threads, the interval method, whether it
    was a quick run and the torch version."""
    results: dict[str, object] = {
        "rows": rows,
        **(extra or {}),
        "threads": threads,
        "interval": INTERVAL_METHOD,
        "quick": quick,
        "torch": torch.__version__,
    }
    directory.mkdir(exist_ok=True)
    (directory / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def print_paired(rows: list[dict[str, Any]], key: str, base: str, ratio: str) -> None:
    """Print one line per row: its ``key`` column, its rounds, the median milliseconds of
    variant ``base`` and the paired ratio named ``ratio`` with its 95 % interval."""
    print(f"\n{key:<13}{'rounds':>7}{f'{base} ms':>14}{ratio:>26}")
    for row in rows:
        low, high = row[f"{ratio} 95% interval"]
        print(
            f"{row[key]:<13}{row['rounds']:>7}{row['median_ms'][base]:>14.2f}"
            f"{row[ratio]:>10.3f} ({low:.3f}-{high:.3f})"
        )
